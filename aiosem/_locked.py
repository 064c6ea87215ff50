"""`AsyncLockedSemaphore`: the book's lock-protected semaphore, without Lua."""

from __future__ import annotations

import logging
import math
import secrets
from typing import TYPE_CHECKING, Any, Final

import anyio

from ._connection import Command, PinnedConnection, pinned_connection
from ._semaphore import Operation, Reply, _Semaphore
from ._validation import check_timeout

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from redis.asyncio import Redis

    from ._keys import SemaphoreKeys

__all__ = ["AsyncLockedSemaphore"]

logger = logging.getLogger("aiosem")

#: How long freeing the lock of an interrupted step may take.
_UNLOCK_TIMEOUT: Final = 2.0


class AsyncLockedSemaphore(_Semaphore):
    """A counting semaphore shared through Redis that needs no Lua at all.

    The same semaphore as `AsyncFairSemaphore` -- same interface, same data,
    same guarantees -- for servers where scripting is forbidden (an ACL with
    ``-@scripting``, some managed services, fakeredis without lupa). Each step
    is *Redis in Action*'s strictest design made safe: it takes a short lock
    (``lock:`` + the semaphore's key), reads the semaphore under ``WATCH``,
    and writes its changes and the lock's deletion in one ``MULTI``/``EXEC``.
    Should the lock expire mid-step and someone else take it, or anyone else
    write the semaphore, the ``EXEC`` aborts and the step is retried, so
    nothing is ever half-written or decided on stale data. A step costs two
    round trips; a busy lock is waited out with a jittered back-off.

    It shares its keys, and therefore its permits, with an
    `AsyncFairSemaphore` of the same name and prefix, and its lock with
    book clients that call ``acquire_semaphore_with_lock`` on its key.

    Args:
        client: A ``redis.asyncio.Redis`` client; the semaphore borrows one
            connection of its pool per step.
        name: The semaphore's name: any non-empty string.
        limit: How many permits may be held at once (at least 1).
        timeout: The lease in seconds: a permit neither refreshed nor
            released within it is reclaimed. Every user of a semaphore must
            use the same lease.
        blocking_timeout: How long `acquire` and ``async with`` wait by
            default, in seconds; ``None`` waits for ever.
        prefix: The first part of every key (no braces).
        clock: Read the time here instead of on the Redis server (see
            `AsyncFairSemaphore`).
        lock_timeout: How long the step lock lives if its holder dies
            mid-step, in seconds: the longest a crash can stall the others.

    Raises:
        TypeError: An argument has the wrong type (the message names it).
        ValueError: An argument is out of range (the message names it).
    """

    __slots__ = ("_lock_ms",)

    def __init__(
        self,
        client: Redis,
        name: str,
        limit: int,
        *,
        timeout: float = 10.0,
        blocking_timeout: float | None = None,
        prefix: str = "aiosem",
        clock: Callable[[], float] | None = None,
        lock_timeout: float = 1.0,
    ) -> None:
        super().__init__(
            client, name, limit, timeout=timeout, blocking_timeout=blocking_timeout, prefix=prefix, clock=clock
        )
        self._lock_ms = max(1, math.ceil(check_timeout(lock_timeout, "lock_timeout") * 1000))

    async def _execute(self, operation: Operation, identifiers: Sequence[str]) -> Reply | None:
        keys = self._keys
        owner = secrets.token_hex(16)
        now = self._now()
        reads: list[Command] = [
            ("SET", keys.lock, owner, "NX", "PX", self._lock_ms),
            ("WATCH", keys.lock, *keys.fair),
            ("ZRANGE", keys.timeout_set, 0, -1, "WITHSCORES"),
            ("ZRANGE", keys.owner_set, 0, -1, "WITHSCORES"),
            ("GET", keys.counter),
        ]
        if now is None:
            reads.append(("TIME",))
        # Until a reply says otherwise, the lock may be ours: a compare-and-delete
        # with our own owner value is safe even if the SET never happened.
        locked = True
        committed: Any = None
        try:
            async with pinned_connection(self._client) as connection:
                replies = await connection.batch(*reads)
                if replies[0] is None:
                    locked = False
                    await connection.batch(("UNWATCH",))
                    return None
                plan = _Plan(
                    connection,
                    keys,
                    now=_parse_time(replies[5]) if now is None else now,
                    lease=self._timeout,
                    leases=_parse_zset(replies[2]),
                    owners=_parse_zset(replies[3]),
                    counter=int(replies[4] or 0),
                )
                reply = plan.run(operation, identifiers, self._limit)
                committed = (await connection.batch(("MULTI",), *plan.writes, ("DEL", keys.lock), ("EXEC",)))[-1]
                locked = committed is None
        finally:
            if locked:
                await self._unlock(owner)
        return None if committed is None else reply

    async def _unlock(self, owner: str) -> None:
        # After an aborted EXEC, or an error or cancellation mid-step, the lock
        # may still be ours. An EXEC of ours still in flight watches the lock,
        # so deleting it first only makes that EXEC abort: safe either way.
        with anyio.CancelScope(shield=True), anyio.move_on_after(_UNLOCK_TIMEOUT):
            try:
                async with pinned_connection(self._client) as connection:
                    value = (await connection.batch(("WATCH", self._keys.lock), ("GET", self._keys.lock)))[1]
                    if value is not None and connection.encode(value) == owner.encode():
                        await connection.batch(("MULTI",), ("DEL", self._keys.lock), ("EXEC",))
                    else:
                        await connection.batch(("UNWATCH",))
            except Exception:
                logger.warning("could not free the lock of %r; it expires by itself", self, exc_info=True)


class _Plan:
    """The writes of one step, decided from what was read under WATCH.

    It follows the fair scripts in ``aiosem/lua`` decision for decision, so
    both classes behave identically on the same data.
    """

    __slots__ = ("_connection", "_counter", "_keys", "_lease", "_leases", "_now", "_owners", "writes")

    def __init__(
        self,
        connection: PinnedConnection,
        keys: SemaphoreKeys,
        *,
        now: float,
        lease: float,
        leases: dict[Any, float],
        owners: dict[Any, float],
        counter: int,
    ) -> None:
        self._connection = connection
        self._keys = keys
        self._now = now
        self._lease = lease
        self._counter = counter
        self.writes: list[Command] = []
        leases = {connection.encode(member): score for member, score in leases.items()}
        owners = {connection.encode(member): score for member, score in owners.items()}
        cutoff = now - lease
        dead = {member for member, score in leases.items() if score <= cutoff}
        leases = {member: score for member, score in leases.items() if member not in dead}
        owners = {member: score for member, score in owners.items() if member not in dead}
        strays = leases.keys() ^ owners.keys()
        if strays:
            dead |= strays
            leases = {member: score for member, score in leases.items() if member not in strays}
            owners = {member: score for member, score in owners.items() if member not in strays}
        if dead:
            self.writes.append(("ZREM", keys.timeout_set, *dead))
            self.writes.append(("ZREM", keys.owner_set, *dead))
        self._leases = leases
        self._owners = owners

    def run(self, operation: Operation, identifiers: Sequence[str], limit: int) -> Reply:
        keys, stamp = self._keys, f"{self._now:.6f}"
        values: list[int] = []
        first_token = self._counter + 1
        for identifier in identifiers:
            member = identifier.encode()
            held = member in self._owners
            if operation == "acquire":
                if held:
                    self.writes.append(("ZADD", keys.timeout_set, "XX", stamp, member))
                elif len(self._owners) < limit:
                    self._counter += 1
                    self._owners[member] = self._counter
                    self.writes.append(("ZADD", keys.owner_set, self._counter, member))
                    self.writes.append(("ZADD", keys.timeout_set, stamp, member))
                else:
                    values.append(0)
                    continue
                self._leases[member] = self._now
                values.append(int(self._owners[member]))
            elif operation == "release":
                if held:
                    del self._owners[member], self._leases[member]
                    self.writes.append(("ZREM", keys.owner_set, member))
                    self.writes.append(("ZREM", keys.timeout_set, member))
                values.append(int(held))
            else:
                if held:
                    self._leases[member] = self._now
                    self.writes.append(("ZADD", keys.timeout_set, "XX", stamp, member))
                values.append(int(held))
        if self._counter >= first_token:
            self.writes.insert(0, ("INCRBY", keys.counter, self._counter - first_token + 1))
        earliest = min(self._leases.values(), default=None)
        return Reply(
            holders=len(self._owners),
            next_expiry=None if earliest is None else max(0.0, earliest + self._lease - self._now),
            values=tuple(values),
        )


def _parse_zset(reply: list[Any]) -> dict[Any, float]:
    # RESP2 answers ZRANGE WITHSCORES flat, [member, score, ...]; RESP3 in pairs.
    if reply and isinstance(reply[0], list):
        return {member: float(score) for member, score in reply}
    return {reply[i]: float(reply[i + 1]) for i in range(0, len(reply), 2)}


def _parse_time(reply: list[Any]) -> float:
    return int(reply[0]) + int(reply[1]) / 1_000_000
