"""The *Redis in Action* §6.2-6.3 locks and semaphores, async and correct.

Each function keeps the book's name, argument order, defaults and key layout
-- a semaphore ``semname`` is a sorted set of identifiers scored by float
seconds, ``semname:owner`` scores them by ``semname:counter``, and a lock is
the string ``lock:`` + ``lockname`` -- so they share a semaphore with clients
written from the book on a single node. What changes is that they are
correct:

- every acquire, refresh and release is one atomic step: a Lua script (run
  by EVALSHA, reloaded after NOSCRIPT) instead of several round trips that
  other clients can interleave with;
- time comes from the Redis server, not from each client's clock; pass
  ``now=time.time()`` to opt into a client clock on servers that forbid
  ``TIME`` in scripts;
- every script first reaps expired permits, so a refresh never revives a
  lost permit and a release reports only live ones. Because of that, a
  release and a refresh take the ``timeout`` the permit was acquired with
  (default 10, as everywhere in the book): use the same one everywhere;
- a lock is only ever released by its owner, under its own key;
- waiting for a lock backs off with jitter (1-50 ms) instead of spinning.

Identifiers are 32 random hex digits. Failure is ``None`` (the book returns
``None`` or ``False``; both are falsy). For a semaphore object with waiting,
``async with`` and fencing tokens, use `aiosem.AsyncFairSemaphore`, which
runs on the same scripts.

Cancellation: a recipe cancelled while its script is in flight may still
take effect in Redis; a permit acquired that way is reclaimed when its lease
runs out, and a lock with a timeout when its timeout does.
"""

from __future__ import annotations

import math
import secrets
from typing import TYPE_CHECKING, Literal

from ._exceptions import LimitMismatch
from ._fair import fair_step, format_now
from ._keys import SemaphoreKeys
from ._protocol import LIMIT_MISMATCH, Step
from ._scripts import BASIC_ACQUIRE, BASIC_RELEASE, LOCK_RELEASE
from ._timing import Backoff, Deadline
from ._validation import check_limit, check_name, check_now, check_timeout, check_wait

if TYPE_CHECKING:
    from ._connection import Client

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

#: How long `acquire_semaphore_with_lock` keeps its lock if it dies holding
#: it. The lock guards one round trip; a crash costs the others this long.
_SEMAPHORE_LOCK_TIMEOUT = 1.0
#: The recipes never queue; the scripts take a waiter timeout all the same.
_WAITER_TIMEOUT = 2.0


def _semaphore_args(semname: object, timeout: object, now: object) -> tuple[str, str, str]:
    return check_name(semname, "semname"), repr(check_timeout(timeout)), format_now(check_now(now))


async def acquire_semaphore(
    conn: Client, semname: str, limit: int, timeout: float = 10, *, now: float | None = None
) -> str | None:
    """Try once to take a permit of the book's basic semaphore (listing 6.12).

    Unfair: it keeps no owner set or counter, only ``semname`` scored by the
    grant time. Unlike the book's, reaping, counting and adding are one
    atomic step on the server's clock, so it never goes over ``limit`` and a
    refused caller leaves nothing behind.

    Args:
        conn: The client.
        semname: The semaphore's key.
        limit: How many permits may be held at once.
        timeout: The lease in seconds.
        now: The time in seconds to decide at, instead of the server's.

    Returns:
        The permit's identifier, or ``None`` if all permits are held.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    semname, lease, at = _semaphore_args(semname, timeout, now)
    identifier = secrets.token_hex(16)
    granted = await BASIC_ACQUIRE.run(conn, (semname,), (at, lease, check_limit(limit), identifier))
    return identifier if granted else None


async def release_semaphore(
    conn: Client, semname: str, identifier: str, timeout: float = 10, *, now: float | None = None
) -> bool:
    """Release a permit of the basic semaphore (listing 6.13).

    Expired permits are reaped first, so ``True`` means the permit was still
    live.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    semname, lease, at = _semaphore_args(semname, timeout, now)
    return bool(await BASIC_RELEASE.run(conn, (semname,), (at, lease, check_name(identifier, "identifier"))))


async def acquire_fair_semaphore(
    conn: Client, semname: str, limit: int, timeout: float = 10, *, now: float | None = None
) -> str | None:
    """Try once to take a permit of the book's fair semaphore (listing 6.14).

    The book's version takes two round trips with an ``INCR`` between them,
    so two clients can each see a free permit and both hold it (§6.3.4). Here
    reaping, the counter and both sets change in one atomic script on the
    server's clock: the limit holds, and the first to run is served first.

    Returns:
        The permit's identifier, or ``None`` if all permits are held.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        aiosem.LimitMismatch: The semaphore is in use with another limit
            (the book would silently enforce neither).
        redis.RedisError: Redis failed or could not be reached.
    """
    semname, _, _ = _semaphore_args(semname, timeout, now)
    identifier = secrets.token_hex(16)
    reply = await fair_step(
        conn,
        Step.TRY,
        SemaphoreKeys(semname),
        (identifier,),
        now=check_now(now),
        lease=check_timeout(timeout),
        limit=check_limit(limit),
        waiter_ttl=_WAITER_TIMEOUT,
    )
    if reply.values[0] == LIMIT_MISMATCH:
        raise LimitMismatch(name=semname, limit=limit, stored_limit=reply.limit or 0)
    return identifier if reply.values[0] > 0 else None


async def release_fair_semaphore(
    conn: Client, semname: str, identifier: str, timeout: float = 10, *, now: float | None = None
) -> bool:
    """Release a permit of the fair semaphore (listing 6.15).

    Returns:
        ``True`` if the permit was still live, ``False`` if it had expired
        or was never held.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    return await _fair_flag(conn, "release", semname, identifier, timeout=timeout, now=now)


async def refresh_fair_semaphore(
    conn: Client, semname: str, identifier: str, timeout: float = 10, *, now: float | None = None
) -> bool:
    """Restart the lease of a fair-semaphore permit (listing 6.16).

    The book's version re-adds the identifier and then, if it was new,
    removes it again: for a moment a lost permit counts as held, and a stolen
    one is never noticed by the thief. Here expired permits are reaped first
    and the lease is only updated in place, in one atomic step: a lost permit
    stays lost.

    Returns:
        ``True`` if the permit is still held, ``False`` if it was lost.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    return await _fair_flag(conn, "refresh", semname, identifier, timeout=timeout, now=now)


async def _fair_flag(
    conn: Client,
    operation: Literal["release", "refresh"],
    semname: object,
    identifier: object,
    *,
    timeout: object,
    now: object,
) -> bool:
    step = Step.RELEASE if operation == "release" else Step.REFRESH
    reply = await fair_step(
        conn,
        step,
        SemaphoreKeys(check_name(semname, "semname")),
        (check_name(identifier, "identifier"),),
        now=check_now(now),
        lease=check_timeout(timeout),
        limit=None,
        waiter_ttl=_WAITER_TIMEOUT,
        # redis-py tries a command again after its connection failed: under
        # the same id, a release whose first reply was lost still says True.
        call=secrets.token_hex(8) if step.leaves_receipts else "",
    )
    return reply.values[0] > 0


async def _acquire_lock(conn: Client, lockname: object, acquire_timeout: object, lock_ms: int | None) -> str | None:
    key = "lock:" + check_name(lockname, "lockname")
    deadline = Deadline(check_wait(acquire_timeout, "acquire_timeout"))
    identifier = secrets.token_hex(16)
    backoff = Backoff()
    while not await conn.set(key, identifier, nx=True, px=lock_ms):
        if deadline.passed():
            return None
        await backoff.pause(deadline)
    return identifier


async def acquire_lock(conn: Client, lockname: str, acquire_timeout: float = 10) -> str | None:
    """Take the lock ``lock:`` + ``lockname``, waiting up to ``acquire_timeout`` (listing 6.8).

    As in the book, the lock has no timeout: if its holder dies, it stays
    locked until someone deletes it. Prefer `acquire_lock_with_timeout`.
    Waiting polls with a jittered back-off of 1-50 ms, where the book spins
    every millisecond.

    Returns:
        The lock's identifier, or ``None`` if it stayed locked.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    return await _acquire_lock(conn, lockname, acquire_timeout, None)


async def acquire_lock_with_timeout(
    conn: Client, lockname: str, acquire_timeout: float = 10, lock_timeout: float = 10
) -> str | None:
    """Take a lock that frees itself after ``lock_timeout`` seconds (listing 6.11).

    The book sets the key and its expiry in two commands, so a crash between
    them leaves a lock that never expires; here one ``SET NX PX`` does both,
    to the millisecond (the book rounds up to whole seconds).

    Returns:
        The lock's identifier, or ``None`` if it stayed locked.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    lock_ms = max(1, math.ceil(check_timeout(lock_timeout, "lock_timeout") * 1000))
    return await _acquire_lock(conn, lockname, acquire_timeout, lock_ms)


async def release_lock(conn: Client, lockname: str, identifier: str) -> bool:
    """Release the lock ``lock:`` + ``lockname`` if ``identifier`` still owns it (listing 6.9).

    Compare and delete are one atomic script, under the lock's own key.

    Returns:
        ``True`` if the lock was the caller's and is released; ``False`` if
        it had expired or belongs to someone else (who keeps it).

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    key = "lock:" + check_name(lockname, "lockname")
    return bool(await LOCK_RELEASE.run(conn, (key,), (check_name(identifier, "identifier"),)))


async def acquire_semaphore_with_lock(
    conn: Client, semname: str, limit: int, timeout: float = 10, *, now: float | None = None
) -> str | None:
    """Try to take a fair-semaphore permit under the lock ``lock:`` + ``semname`` (listing 6.17).

    The book needs the lock to close the race in its fair semaphore. Our
    `acquire_fair_semaphore` is atomic already; the lock remains so that book
    clients, which take it too, are serialised with this call. Unlike the
    book's, the lock expires by itself (after 1 s) if its holder dies, and it
    is released with `release_lock` under its own key -- one widespread
    transcription releases it with ``release_fair_semaphore`` and so never
    frees it. As in the book, a lock that stays busy for 10 ms is a failure.

    Returns:
        The permit's identifier, or ``None`` if the lock was busy or all
        permits are held.

    Raises:
        TypeError, ValueError: A bad argument (the message names it).
        redis.RedisError: Redis failed or could not be reached.
    """
    semname, _, _ = _semaphore_args(semname, timeout, now)
    check_limit(limit)
    lock = await acquire_lock_with_timeout(conn, semname, acquire_timeout=0.01, lock_timeout=_SEMAPHORE_LOCK_TIMEOUT)
    if lock is None:
        return None
    try:
        return await acquire_fair_semaphore(conn, semname, limit, timeout, now=now)
    finally:
        await release_lock(conn, semname, lock)
