"""`AsyncFairSemaphore`: each step is one Lua script, one round trip."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._connection import Client, publish_command
from ._options import SemaphoreOptions, refuse_unknown
from ._protocol import Operation, Reply, Step, parse_reply
from ._scripts import FAIR_ACQUIRE, FAIR_REFRESH, FAIR_RELEASE, Script
from ._semaphore import _Semaphore
from ._timing import step_bound

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from typing_extensions import Unpack

    from ._core import Core
    from ._keys import SemaphoreKeys
    from ._waiting import Waiter

__all__ = ["AsyncFairSemaphore", "fair_call", "fair_step"]

_SCRIPTS = {Operation.ACQUIRE: FAIR_ACQUIRE, Operation.RELEASE: FAIR_RELEASE, Operation.REFRESH: FAIR_REFRESH}


def format_now(now: float | None) -> str:
    """The ``now`` argument of every script: '' lets the script read the server's clock."""
    return "" if now is None else repr(now)


def fair_call(
    step: Step,
    keys: SemaphoreKeys,
    identifiers: Sequence[str],
    *,
    now: float | None,
    lease: float,
    limit: int | None,
    waiter_ttl: float,
    caller: str,
    call: str,
    relays: bool,
    record: str,
    publish: str,
) -> tuple[Script, tuple[str, ...], list[str]]:
    """The script a fair step runs, its keys and its arguments (see `fair_step`; ``publish``: `publish_command`)."""
    args = [
        format_now(now),
        repr(lease),
        "" if limit is None else str(limit),
        repr(waiter_ttl),
        caller,
        keys.channels,
        publish,
        step.mode,
        call,
        repr(step_bound(lease)),
        "1" if relays else "",
        record,
        *identifiers,
    ]
    return _SCRIPTS[step.operation], (*keys.fair, keys.receipt(call)), args


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
    record: str = "",
    replicas: int = 0,
    replication_timeout: float = 0.0,
) -> Reply:
    """Run one fair-semaphore script; shared by the class and the recipes.

    A release with a ``call`` id leaves a receipt for as long as a step may
    take: the same call, tried again after its reply was lost, answers what
    the first try released. With ``relays``, a mutex handed to one of the
    ``caller``'s waiters is relayed through the caller's waiters queued
    right behind it, and the reply names them. An identifier the step
    queues, or grants a permit to straight away, is stored with ``record``
    (`aiosem._keys.encode_record`; '' for none, as a book client). With ``replicas``, the script is followed by a
    ``WAIT`` of at most ``replication_timeout`` on its connection, and the
    reply says how many replicas acknowledged it.
    """
    script, script_keys, args = fair_call(
        step,
        keys,
        identifiers,
        now=now,
        lease=lease,
        limit=limit,
        waiter_ttl=waiter_ttl,
        caller=caller,
        call=call,
        relays=relays,
        record=record,
        publish=publish_command(client),
    )
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

    Its keyword options (`SemaphoreOptions`, each described below) are
    ``timeout`` (the lease), ``blocking_timeout``, ``prefix``, ``clock``,
    ``waiter_timeout``, ``refresh_interval``, ``on_lost``, ``replicas`` and
    ``label`` (shown by ``python -m aiosem status`` beside its holders and
    waiters, with their host and process id).

    Args:
        client: A ``redis.asyncio.Redis`` client; the semaphore borrows it.
        name: The semaphore's name: any non-empty string.
        limit: How many permits may be held at once (at least 1), unless
            a limit set with `set_limit` is in force; ``None`` takes the
            limit in force in Redis (see `set_limit`).

    Raises:
        TypeError: An argument has the wrong type (the message names it).
        ValueError: An argument is out of range (the message names it).
    """

    __slots__ = ()

    def __init__(self, client: Client, name: str, limit: int | None, **options: Unpack[SemaphoreOptions]) -> None:
        refuse_unknown(options, SemaphoreOptions, "AsyncFairSemaphore.__init__")
        super().__init__(client, name, limit, options, ScriptedSteps)


class ScriptedSteps:
    """The steps of `AsyncFairSemaphore`: each one Lua script, one round trip (a `Backend`)."""

    __slots__ = ("_core",)

    #: The scripts relay a mutex granted to one of the caller's waiters through the run queued behind it.
    relays = True

    def __init__(self, core: Core) -> None:
        self._core = core

    async def execute(self, step: Step, identifiers: Sequence[str], call: str) -> Reply:
        core = self._core
        settings = core.settings
        return await fair_step(
            core.client,
            step,
            core.keys,
            identifiers,
            now=core.now(),
            lease=settings.timeout,
            limit=settings.limit,
            waiter_ttl=settings.waiter_ttl,
            caller=core.process,
            call=call,
            # A relayed permit's next holder is told before Redis is: with
            # replicas to wait for, every grant waits for them instead.
            relays=not settings.replicas,
            record=settings.record(),
            replicas=core.replicas_for(step),
            replication_timeout=settings.waiter_ttl,
        )

    def arrive(self, waiter: Waiter, then: Callable[[], None]) -> None:
        """Nothing to note: a script queues a waiter in the step that finds it must wait."""
        then()

    async def withdraw(self, identifiers: Sequence[str]) -> None:
        """Nothing to take back: arriving wrote nothing."""

    def forget(self, identifier: str) -> None:
        """Nothing to forget: nothing is kept about a waiter."""

    async def close(self) -> None:
        """Nothing to wait for: a script leaves nothing behind."""
