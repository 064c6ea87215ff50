"""A client written from *Redis in Action* and aiosem share one semaphore.

`AsyncFairSemaphore(client, name, ...)` keeps the book's layout under
``aiosem:{name}``, so a book client that takes that key as its ``semname``
(with the same lease) shares its permits. Neither may harm the other: each
counts the other's permits, each reaps the other's expired ones and nothing
else, and a book client that serialises on the lock, as in listing 6.17,
serialises with `AsyncLockedSemaphore`. The book's client is
`tests.harness.book_client`, faults included; the last tests show those faults.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis.asyncio
from redis.asyncio.client import Pipeline

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, Permit
from tests.harness import book_client as book

if TYPE_CHECKING:
    from redis.asyncio.connection import ConnectionPool

    from tests.harness.support import FakeClock

# The book's client needs commands aiosem's own user lacks (ZRANK, SETNX).
pytestmark = pytest.mark.unrestricted

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]

LEASE = 10


async def members(client: redis.asyncio.Redis, key: str) -> set[str]:
    found = await client.zrange(key, 0, -1)
    assert all(isinstance(member, bytes) for member in found)
    return {member.decode() for member in found if isinstance(member, bytes)}


# (a) each counts the other's permits


async def test_a_book_permit_counts_against_aiosems_limit(client: redis.asyncio.Redis, cls: SemaphoreClass) -> None:
    sem = cls(client, "shared", 2, timeout=LEASE)
    assert await book.acquire_fair_semaphore(client, sem.key, 2, LEASE) is not None
    book_token = int(await client.get(f"{sem.key}:counter") or 0)
    permit = await sem.acquire(blocking=False)
    assert permit is not None
    assert permit.fencing_token > book_token
    assert await sem.acquire(blocking=False) is None
    assert await sem.count() == 2


async def test_an_aiosem_permit_counts_against_the_books_limit(
    client: redis.asyncio.Redis, cls: SemaphoreClass
) -> None:
    sem = cls(client, "shared", 2, timeout=LEASE)
    assert await book.acquire_fair_semaphore(client, sem.key, 2, LEASE) is not None
    assert await sem.acquire(blocking=False) is not None
    assert await book.acquire_fair_semaphore(client, sem.key, 2, LEASE) is None


# (b) each reaps the other's expired permits, and only those


async def test_aiosem_reaps_the_books_expired_permits_from_both_sets(
    client: redis.asyncio.Redis, cls: SemaphoreClass, clock: FakeClock
) -> None:
    sem = cls(client, "shared", 1, timeout=LEASE, clock=clock)
    expired = await book.acquire_fair_semaphore(client, sem.key, 1, LEASE, clock=clock)
    assert expired is not None
    clock.advance(LEASE)
    permit = await sem.acquire(blocking=False)
    assert permit is not None
    assert await members(client, sem.key) == {permit.identifier}
    assert await members(client, f"{sem.key}:owner") == {permit.identifier}


async def test_the_books_reaping_keeps_aiosems_live_permits(
    client: redis.asyncio.Redis, cls: SemaphoreClass, clock: FakeClock
) -> None:
    sem = cls(client, "shared", 2, timeout=LEASE, clock=clock)
    permit = await sem.acquire(blocking=False)
    assert permit is not None
    granted_at = clock()
    clock.advance(LEASE - 1)
    assert await book.acquire_fair_semaphore(client, sem.key, 2, LEASE, clock=clock) is not None
    assert await client.zscore(sem.key, permit.identifier) == granted_at
    assert await client.zscore(f"{sem.key}:owner", permit.identifier) == permit.fencing_token
    assert await sem.refresh(permit) is True


# (c) each release removes only its own entries


async def test_the_books_release_removes_only_its_own_entries(client: redis.asyncio.Redis, cls: SemaphoreClass) -> None:
    sem = cls(client, "shared", 2, timeout=LEASE)
    permit = await sem.acquire(blocking=False)
    identifier = await book.acquire_fair_semaphore(client, sem.key, 2, LEASE)
    assert permit is not None
    assert identifier is not None
    assert await book.release_fair_semaphore(client, sem.key, identifier) is True
    assert await members(client, sem.key) == {permit.identifier}
    assert await members(client, f"{sem.key}:owner") == {permit.identifier}
    assert await sem.refresh(permit) is True


async def test_aiosem_can_release_a_book_permit_and_only_that(client: redis.asyncio.Redis, cls: SemaphoreClass) -> None:
    sem = cls(client, "shared", 2, timeout=LEASE)
    identifier = await book.acquire_fair_semaphore(client, sem.key, 2, LEASE)
    mine = await sem.acquire(blocking=False)
    assert identifier is not None
    assert mine is not None
    theirs = Permit(sem.name, identifier, 1, sem.key)
    assert await sem.release(theirs) is True
    assert await members(client, sem.key) == {mine.identifier}
    assert await members(client, f"{sem.key}:owner") == {mine.identifier}


# (d) half-written entries are reaped, not held for ever


async def test_an_owner_entry_whose_lease_was_evicted_is_reaped(
    client: redis.asyncio.Redis, cls: SemaphoreClass
) -> None:
    sem = cls(client, "shared", 1, timeout=LEASE)
    stray = await book.acquire_fair_semaphore(client, sem.key, 1, LEASE)
    assert stray is not None
    await client.delete(sem.key)  # as allkeys-* eviction could
    assert await sem.acquire(blocking=False) is not None
    assert await client.zscore(f"{sem.key}:owner", stray) is None


async def test_entries_in_one_set_only_are_reaped_when_the_sets_are_the_same_size(
    client: redis.asyncio.Redis, cls: SemaphoreClass
) -> None:
    sem = cls(client, "shared", 2, timeout=LEASE)
    live = await sem.acquire(blocking=False)
    stray = await book.acquire_fair_semaphore(client, sem.key, 2, LEASE)
    assert live is not None
    assert stray is not None
    await client.zrem(sem.key, stray)
    await client.zadd(sem.key, {"lease-without-owner": time.time()})
    assert await sem.count() == 1
    assert await members(client, sem.key) == {live.identifier}
    assert await members(client, f"{sem.key}:owner") == {live.identifier}


# (e) under contention, the shared lock keeps both within the limit


@pytest.mark.slow
async def test_book_and_aiosem_clients_serialised_by_the_lock_never_exceed_the_limit(
    real_client: redis.asyncio.Redis,
) -> None:
    # 20 book clients (listing 6.17) and 20 AsyncLockedSemaphore users take
    # turns on ``lock:aiosem:{shared}`` for 2 s -- longer, up to 10 s, until
    # both sides have been granted. Holders overlap for 10-20 ms each.
    limit, workers = 3, 20
    sem = AsyncLockedSemaphore(real_client, "shared", limit, timeout=LEASE)
    grants = {"book": 0, "aiosem": 0}
    peak = 0
    started = time.monotonic()

    def running() -> bool:
        elapsed = time.monotonic() - started
        return elapsed < 2 or (elapsed < 10 and not all(grants.values()))

    async def pause() -> None:
        await anyio.sleep(random.uniform(0.001, 0.005))

    async def hold(side: str) -> None:
        nonlocal peak
        grants[side] += 1
        peak = max(peak, await real_client.incr("holders"))
        await anyio.sleep(random.uniform(0.01, 0.02))
        await real_client.decr("holders")

    async def book_worker() -> None:
        while running():
            identifier = await book.acquire_semaphore_with_lock(real_client, sem.key, limit, LEASE)
            if identifier is not None:
                try:
                    await hold("book")
                finally:
                    await book.release_fair_semaphore(real_client, sem.key, identifier)
            await pause()

    async def aiosem_worker() -> None:
        while running():
            permit = await sem.acquire(blocking=False)
            if permit is not None:
                try:
                    await hold("aiosem")
                finally:
                    await sem.release(permit)
            await pause()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            for _ in range(workers):
                tasks.start_soon(book_worker)
                tasks.start_soon(aiosem_worker)

    assert 0 < peak <= limit
    assert grants["book"] > 0
    assert grants["aiosem"] > 0
    assert await real_client.get("holders") == b"0"
    assert await sem.count() == 0
    assert await real_client.exists(f"lock:{sem.key}") == 0


# (f) the book's fair semaphore on its own, for contrast


class _PausingPipeline(Pipeline):
    """A pipeline that waits for ``resume`` before its second round trip."""

    def __init__(self, client: redis.asyncio.Redis, paused: anyio.Event, resume: anyio.Event) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, transaction=True, shard_hint=None)
        self._paused = paused
        self._resume = resume
        self._round_trips = 0

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        self._round_trips += 1
        if self._round_trips == 2:
            self._paused.set()
            await self._resume.wait()
        return await super().execute(raise_on_error)


class _PausingClient(redis.asyncio.Redis):
    """A client on another's connection pool whose pipelines pause before their second round trip."""

    def __init__(self, pool: ConnectionPool, paused: anyio.Event, resume: anyio.Event) -> None:
        super().__init__(connection_pool=pool)
        self._paused = paused
        self._resume = resume

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        assert transaction
        assert shard_hint is None
        return _PausingPipeline(self, self._paused, self._resume)


async def test_the_books_fair_semaphore_goes_over_its_limit_when_two_clients_interleave(
    client: redis.asyncio.Redis,
) -> None:
    # §6.3.4: A increments the counter first, B adds itself and checks its
    # rank first and is granted; then A, with the lower counter, is too.
    paused, resume = anyio.Event(), anyio.Event()
    slow = _PausingClient(client.connection_pool, paused, resume)
    granted: dict[str, str | None] = {}

    async def first() -> None:
        granted["A"] = await book.acquire_fair_semaphore(slow, "sem", 1)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(first)
            await paused.wait()
            granted["B"] = await book.acquire_fair_semaphore(client, "sem", 1)
            resume.set()

    assert granted["A"] is not None
    assert granted["B"] is not None
    assert await client.zcard("sem:owner") == 2


async def test_the_books_fair_semaphore_lets_a_fast_client_clock_steal_a_live_permit(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    holder = await book.acquire_fair_semaphore(client, "sem", 1, LEASE, clock=clock)
    assert holder is not None
    thief = await book.acquire_fair_semaphore(client, "sem", 1, LEASE, clock=lambda: clock() + LEASE + 1)
    assert thief is not None
    # The holder is not told until its next refresh.
    assert await client.zscore("sem:owner", holder) is None
