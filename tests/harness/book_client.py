"""The *Redis in Action* §6.2-6.3 locks and semaphores, transcribed as written.

This is the book's code (listings 6.8, 6.9 and 6.11-6.17) moved onto
``redis.asyncio`` and nothing more: the same commands in the same round
trips, the same key layout, ``time.time()`` for the semaphores' clock. Its
faults are kept on purpose -- it is the baseline that `aiosem.recipes` and the
semaphore classes are compared against, and the stand-in for a client
written from the book that shares a semaphore with aiosem. In particular:

- `acquire_semaphore` and `acquire_fair_semaphore` take two or three round
  trips, so concurrent callers can interleave and go over the limit (§6.3.4);
  a refused caller's entries live in Redis for a moment;
- the semaphores read each client's own clock, so a skewed client steals or
  keeps permits;
- `refresh_fair_semaphore` re-adds its identifier before finding out whether
  it was still there, and revives a permit that expired but was not yet
  reaped;
- `acquire_lock` has no timeout, and `acquire_lock_with_timeout` sets the key
  and its expiry in two commands (with a TTL rounded up to whole seconds);
- the lock waits spin every millisecond.

What had to change to run at all: ``ZADD`` takes a mapping (redis-py 3+),
the identifier read back under ``WATCH`` is compared as text whatever the
client's ``decode_responses``, and the lock waits measure their deadline on
a monotonic clock instead of ``time.time()`` so that a test can freeze or
skew the semaphores' ``clock`` without stalling a wait. The semaphore
functions take that ``clock`` as an extra keyword argument (default
``time.time``, the book's).

The one fix is the book's own erratum: listing 6.17 releases its lock with
`release_lock` (one widespread transcription calls ``release_fair_semaphore``
there and never frees the lock).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import redis.exceptions

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = [
    "acquire_fair_semaphore",
    "acquire_lock",
    "acquire_lock_with_timeout",
    "acquire_semaphore",
    "acquire_semaphore_with_lock",
    "refresh_fair_semaphore",
    "release_fair_semaphore",
    "release_lock",
    "release_semaphore",
]

#: What the semaphores read the time from: the client's wall clock.
Clock = Callable[[], float]


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


async def acquire_lock(conn: Redis, lockname: str, acquire_timeout: float = 10) -> str | Literal[False]:
    """Listing 6.8: ``SETNX lock:<lockname>``, retried every millisecond; no timeout."""
    identifier = str(uuid.uuid4())
    end = time.monotonic() + acquire_timeout
    while time.monotonic() < end:
        if await conn.setnx("lock:" + lockname, identifier):
            return identifier
        await asyncio.sleep(0.001)
    return False


async def release_lock(conn: Redis, lockname: str, identifier: str) -> bool:
    """Listing 6.9: delete ``lock:<lockname>`` under ``WATCH`` if ``identifier`` holds it."""
    lockname = "lock:" + lockname
    async with conn.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(lockname)
                if _text(await pipe.get(lockname)) == identifier:
                    pipe.multi()  # type: ignore[no-untyped-call]  # untyped in redis-py
                    pipe.delete(lockname)
                    await pipe.execute()
                    return True
                await pipe.unwatch()  # type: ignore[no-untyped-call]  # untyped in redis-py
                break
            except redis.exceptions.WatchError:
                pass
    return False


async def acquire_lock_with_timeout(
    conn: Redis, lockname: str, acquire_timeout: float = 10, lock_timeout: float = 10
) -> str | Literal[False]:
    """Listing 6.11: ``SETNX``, then ``EXPIRE`` in a second command (whole seconds)."""
    identifier = str(uuid.uuid4())
    lockname = "lock:" + lockname
    lock_timeout = math.ceil(lock_timeout)
    end = time.monotonic() + acquire_timeout
    while time.monotonic() < end:
        if await conn.setnx(lockname, identifier):
            await conn.expire(lockname, lock_timeout)
            return identifier
        # As printed. TTL answers -1 for "no expiry" since Redis 2.8 (it was
        # nil when the book was written), so this repair no longer fires.
        elif not await conn.ttl(lockname):  # noqa: RET505 -- the book's shape
            await conn.expire(lockname, lock_timeout)
        await asyncio.sleep(0.001)
    return False


async def acquire_semaphore(
    conn: Redis, semname: str, limit: int, timeout: float = 10, *, clock: Clock = time.time
) -> str | None:
    """Listing 6.12: reap, add and rank in one ``MULTI``; a refused caller removes itself after."""
    identifier = str(uuid.uuid4())
    now = clock()
    pipeline = conn.pipeline(transaction=True)
    pipeline.zremrangebyscore(semname, "-inf", now - timeout)
    pipeline.zadd(semname, {identifier: now})
    pipeline.zrank(semname, identifier)
    if (await pipeline.execute())[-1] < limit:
        return identifier
    await conn.zrem(semname, identifier)
    return None


async def release_semaphore(conn: Redis, semname: str, identifier: str) -> bool:
    """Listing 6.13: ``ZREM``; ``True`` if the identifier was there, expired or not."""
    return bool(await conn.zrem(semname, identifier))


async def acquire_fair_semaphore(
    conn: Redis, semname: str, limit: int, timeout: float = 10, *, clock: Clock = time.time
) -> str | None:
    """Listing 6.14: two ``MULTI`` round trips with the ``INCR`` between them (§6.3.4's race)."""
    identifier = str(uuid.uuid4())
    czset = semname + ":owner"
    ctr = semname + ":counter"

    now = clock()
    pipeline = conn.pipeline(transaction=True)
    pipeline.zremrangebyscore(semname, "-inf", now - timeout)
    pipeline.zinterstore(czset, {czset: 1, semname: 0})

    pipeline.incr(ctr)
    counter = (await pipeline.execute())[-1]

    pipeline.zadd(semname, {identifier: now})
    pipeline.zadd(czset, {identifier: counter})

    pipeline.zrank(czset, identifier)
    if (await pipeline.execute())[-1] < limit:
        return identifier

    pipeline.zrem(semname, identifier)
    pipeline.zrem(czset, identifier)
    await pipeline.execute()
    return None


async def release_fair_semaphore(conn: Redis, semname: str, identifier: str) -> bool:
    """Listing 6.15: ``ZREM`` from both sets; the reply of the timeout set's."""
    pipeline = conn.pipeline(transaction=True)
    pipeline.zrem(semname, identifier)
    pipeline.zrem(semname + ":owner", identifier)
    return bool((await pipeline.execute())[0])


async def refresh_fair_semaphore(conn: Redis, semname: str, identifier: str, *, clock: Clock = time.time) -> bool:
    """Listing 6.16: ``ZADD`` the new time; if that added the identifier, it was lost: release."""
    if await conn.zadd(semname, {identifier: clock()}):
        await release_fair_semaphore(conn, semname, identifier)
        return False
    return True


async def acquire_semaphore_with_lock(
    conn: Redis, semname: str, limit: int, timeout: float = 10, *, clock: Clock = time.time
) -> str | None:
    """Listing 6.17: the fair semaphore under ``lock:<semname>``, given up after 10 ms."""
    identifier = await acquire_lock(conn, semname, acquire_timeout=0.01)
    if identifier:
        try:
            return await acquire_fair_semaphore(conn, semname, limit, timeout, clock=clock)
        finally:
            await release_lock(conn, semname, identifier)
    return None
