"""A waiter goes through the states the design page draws, and only those transitions."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, _waiting
from aiosem._waiting import Waiter, WaiterState
from tests.harness.support import until_queued, until_subscribed

if TYPE_CHECKING:
    from collections.abc import Callable

    import redis.asyncio

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

ARRIVING, QUEUED, HANDED, CLAIMING, RELAYED, DONE = (
    WaiterState.ARRIVING,
    WaiterState.QUEUED,
    WaiterState.HANDED,
    WaiterState.CLAIMING,
    WaiterState.RELAYED,
    WaiterState.DONE,
)

#: The most any wait in these tests may take before the test fails.
BOUND = 10.0


class RecordingWaiter(Waiter):
    """A waiter that remembers every state it was put in, in order."""

    __slots__ = ("history",)

    def __init__(self, identifier: str, future: asyncio.Future[int]) -> None:
        self.history: list[WaiterState] = []
        super().__init__(identifier, future)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and (not self.history or self.history[-1] is not value):
            self.history.append(value)
        super().__setattr__(name, value)


@pytest.fixture
def waiters(monkeypatch: pytest.MonkeyPatch) -> list[RecordingWaiter]:
    """Every waiter made from now on, in the order they were made."""
    made: list[RecordingWaiter] = []

    def recording(identifier: str, future: asyncio.Future[int]) -> RecordingWaiter:
        waiter = RecordingWaiter(identifier, future)
        made.append(waiter)
        return waiter

    monkeypatch.setattr(_waiting, "Waiter", recording)
    return made


@pytest.fixture
def make(cls: SemaphoreClass, real_client: redis.asyncio.Redis) -> Callable[..., Semaphore]:
    """Semaphore objects on one name: each object stands for a process of its own."""

    def make(limit: int = 1, **options: Any) -> Semaphore:
        return cls(real_client, "states", limit, **options)

    return make


async def until_done(waiter: RecordingWaiter) -> None:
    with anyio.fail_after(BOUND):
        while waiter.state is not DONE:  # noqa: ASYNC110 -- a claim lands in the background
            await asyncio.sleep(0.002)


async def test_a_waiter_granted_at_once_is_never_queued(
    make: Callable[..., Semaphore], waiters: list[RecordingWaiter]
) -> None:
    sem = make()
    assert await sem.acquire() is not None
    (waiter,) = waiters
    assert waiter.history == [ARRIVING, DONE]


async def test_a_try_makes_no_waiter(make: Callable[..., Semaphore], waiters: list[RecordingWaiter]) -> None:
    sem = make()
    assert await sem.acquire(blocking=False) is not None
    assert waiters == []


async def test_a_waiter_granted_by_its_own_objects_release_goes_from_queued_to_done(
    make: Callable[..., Semaphore], waiters: list[RecordingWaiter]
) -> None:
    sem = make(2)
    holders = [await sem.acquire(), await sem.acquire()]
    acquire = asyncio.create_task(sem.acquire())
    await until_queued(sem)
    (waiter,) = waiters[2:]
    assert waiter.history == [ARRIVING, QUEUED]
    assert holders[0] is not None
    await sem.release(holders[0])
    with anyio.fail_after(BOUND):
        assert await acquire is not None
    assert waiter.history == [ARRIVING, QUEUED, DONE]


async def test_a_permit_handed_over_by_another_process_is_claimed(
    make: Callable[..., Semaphore], waiters: list[RecordingWaiter], real_client: redis.asyncio.Redis
) -> None:
    holder_side, waiter_side = make(), make()
    held = await holder_side.acquire()
    acquire = asyncio.create_task(waiter_side.acquire())
    await until_queued(holder_side)
    await until_subscribed(waiter_side)  # the grant comes by message
    assert held is not None
    await holder_side.release(held)
    with anyio.fail_after(BOUND):
        permit = await acquire
    assert permit is not None
    waiter = waiters[-1]
    await until_done(waiter)
    assert waiter.history == [ARRIVING, QUEUED, HANDED, CLAIMING, DONE]
    # The claim restarted the lease: a whole timeout from now, not a waiter timeout.
    leases = await holder_side.holders()
    assert leases[permit.identifier] > waiter_side.waiter_timeout


async def test_a_waiter_that_gives_up_while_queued_leaves_the_queue(
    make: Callable[..., Semaphore], waiters: list[RecordingWaiter]
) -> None:
    sem = make()
    assert await sem.acquire() is not None
    assert await sem.acquire(blocking_timeout=0.05) is None
    (_, waiter) = waiters
    assert waiter.history == [ARRIVING, QUEUED, DONE]
    assert await sem.waiting() == 0


async def test_a_waiter_the_queue_forgot_is_queued_again_and_stays_queued(
    make: Callable[..., Semaphore], waiters: list[RecordingWaiter], real_client: redis.asyncio.Redis
) -> None:
    sem = make(waiter_timeout=0.3)
    held = await sem.acquire()
    acquire = asyncio.create_task(sem.acquire())
    await until_queued(sem)
    waiter = waiters[-1]
    # Presumed dead (as after a stall): the next heartbeat finds it gone, and queues it again.
    await real_client.zrem(f"{sem.key}:queue", waiter.identifier)
    await real_client.zrem(f"{sem.key}:waiters", waiter.identifier)
    await until_queued(sem)
    assert waiter.history == [ARRIVING, QUEUED]
    assert held is not None
    await sem.release(held)
    with anyio.fail_after(BOUND):
        assert await acquire is not None
    assert waiter.history == [ARRIVING, QUEUED, DONE]


@pytest.mark.parametrize("cls", [AsyncFairSemaphore], ids=["fair"])
async def test_a_mutex_relayed_within_a_process_goes_through_relayed(
    make: Callable[..., Semaphore], waiters: list[RecordingWaiter]
) -> None:
    sem = make()
    held = await sem.acquire()
    first = asyncio.create_task(sem.acquire())
    await until_queued(sem, 1)
    second = asyncio.create_task(sem.acquire())
    await until_queued(sem, 2)
    assert held is not None
    await sem.release(held)  # grants `first`, and makes `second` the run behind it
    with anyio.fail_after(BOUND):
        relayed = await first
    assert relayed is not None
    assert sem._core.relay is not None
    assert sem._core.relay.run_of(relayed.identifier)
    await sem.release(relayed)  # relays to `second` at once; the pass tells Redis behind it
    with anyio.fail_after(BOUND):
        assert await second is not None
    assert waiters[1].history == [ARRIVING, QUEUED, DONE]
    assert waiters[2].history == [ARRIVING, QUEUED, RELAYED, DONE]
