"""`AsyncFairSemaphore`: each step is one Lua script, one round trip."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._connection import Client, publish_command
from ._protocol import Operation, Reply, Step, parse_reply
from ._scripts import FAIR_ACQUIRE, FAIR_REFRESH, FAIR_RELEASE
from ._semaphore import _Semaphore
from ._timing import step_bound

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._keys import SemaphoreKeys
    from ._semaphore import LostCallback

__all__ = ["AsyncFairSemaphore", "fair_step"]

_SCRIPTS = {Operation.ACQUIRE: FAIR_ACQUIRE, Operation.RELEASE: FAIR_RELEASE, Operation.REFRESH: FAIR_REFRESH}


def format_now(now: float | None) -> str:
    """The ``now`` argument of every script: '' lets the script read the server's clock."""
    return "" if now is None else repr(now)


async def fair_step(
    client: Client,
    step: Step,
    keys: SemaphoreKeys,
    identifiers: Sequence[str],
    *,
    now: float | None,
    lease: float,
    limit: int | None,
    waiter_ttl: float,
    caller: str = "",
    call: str = "",
    relays: bool = False,
    replicas: int = 0,
    replication_timeout: float = 0.0,
) -> Reply:
    """Run one fair-semaphore script; shared by the class and the recipes.

    A release with a ``call`` id leaves a receipt for as long as a step may
    take: the same call, tried again after its reply was lost, answers what
    the first try released. With ``relays``, a mutex handed to one of the
    ``caller``'s waiters is relayed through the caller's waiters queued
    right behind it, and the reply names them. With ``replicas``, the script is followed by a
    ``WAIT`` of at most ``replication_timeout`` on its connection, and the
    reply says how many replicas acknowledged it.
    """
    args = [
        format_now(now),
        repr(lease),
        "" if limit is None else str(limit),
        repr(waiter_ttl),
        caller,
        keys.channels,
        publish_command(client),
        step.mode,
        call,
        repr(step_bound(lease)),
        "1" if relays else "",
        *identifiers,
    ]
    script = _SCRIPTS[step.operation]
    script_keys = (*keys.fair, keys.receipt(call))
    if not replicas:
        return parse_reply(await script.run(client, script_keys, args), len(identifiers))
    raw, acknowledged = await script.run_replicated(
        client, script_keys, args, replicas, max(1, math.ceil(replication_timeout * 1000))
    )
    return parse_reply(raw, len(identifiers), acknowledged)


class AsyncFairSemaphore(_Semaphore):
    """A counting semaphore shared through Redis, each step one Lua script.

    Like `asyncio.Semaphore`, but the count lives in Redis, so every process
    using the same name and Redis shares one limit; and each permit is a
    lease, so a holder that crashes frees its permit after ``timeout``.

        sem = AsyncFairSemaphore(redis, "db", limit=3, timeout=10)
        async with sem as permit:
            ...  # at most 3 bodies run at once, across all processes

    Grants, releases and refreshes are each one atomic script on the
    server's clock, so no race between clients and no client's clock can
    push it over its limit. Blocked acquirers queue in Redis in arrival
    order, across all processes; the script that frees a permit hands it to
    the head of the queue in the same step and wakes that waiter's process
    with one message. The data is laid out as in *Redis in Action* (see
    `aiosem.recipes`), and each permit carries a fencing token.

    Args:
        client: A ``redis.asyncio.Redis`` client; the semaphore borrows it.
        name: The semaphore's name: any non-empty string.
        limit: How many permits may be held at once (at least 1).
        timeout: The lease in seconds: a permit neither refreshed nor
            released within it is reclaimed. Every user of a semaphore must
            use the same lease.
        blocking_timeout: How long `acquire` and ``async with`` wait by
            default, in seconds; ``None`` waits for ever.
        prefix: The first part of every key (no braces).
        clock: Read the time here instead of on the Redis server, e.g.
            ``time.time`` for a server that forbids ``TIME`` in scripts (then
            every client's clock must agree), or a fake clock in tests.
        waiter_timeout: How long a queued waiter whose process stopped
            answering keeps its place, in seconds (at most ``timeout``;
            default: the smaller of 2 s and ``timeout``). Each process proves
            its waiters alive three times per ``waiter_timeout``.
        refresh_interval: How often a permit held through ``async with`` (or
            taken with ``acquire(auto_refresh=True)``) is refreshed, in
            seconds; less than ``timeout``, default a third of it.
        on_lost: If set, a permit lost under an ``async with`` body calls
            ``on_lost(PermitLost)`` (in a background task: it must not
            block) and the body runs on, instead of being cancelled; the
            block still raises `PermitLost` as it ends.
        replicas: Follow each acquire and refresh with a ``WAIT`` until this
            many replicas have it (at most ``waiter_timeout``; fewer raises
            `NotReplicated`), so that a failover to a replica cannot forget
            a permit its holder was told it has. 0, the default, waits for
            none: Redis replicates asynchronously. See the deployment page.

    Raises:
        TypeError: An argument has the wrong type (the message names it).
        ValueError: An argument is out of range (the message names it).
    """

    __slots__ = ()

    _relays = True

    def __init__(
        self,
        client: Client,
        name: str,
        limit: int,
        *,
        timeout: float = 10.0,
        blocking_timeout: float | None = None,
        prefix: str = "aiosem",
        clock: Callable[[], float] | None = None,
        waiter_timeout: float | None = None,
        refresh_interval: float | None = None,
        on_lost: LostCallback | None = None,
        replicas: int = 0,
    ) -> None:
        # Its own signature, so that a wrong keyword is refused in this class's name.
        super().__init__(
            client,
            name,
            limit,
            timeout=timeout,
            blocking_timeout=blocking_timeout,
            prefix=prefix,
            clock=clock,
            waiter_timeout=waiter_timeout,
            refresh_interval=refresh_interval,
            on_lost=on_lost,
            replicas=replicas,
        )

    async def _execute(self, step: Step, identifiers: Sequence[str], call: str) -> Reply:
        return await fair_step(
            self._client,
            step,
            self._keys,
            identifiers,
            now=self._now(),
            lease=self._timeout,
            limit=self._limit,
            waiter_ttl=self._waiter_ttl,
            caller=self._process,
            call=call,
            # A relayed permit's next holder is told before Redis is: with
            # replicas to wait for, every grant waits for them instead.
            relays=not self._replicas,
            replicas=self._replicas_for(step),
            replication_timeout=self._waiter_ttl,
        )
