"""A mutex relayed through a run of one object's waiters.

When a semaphore with limit 1 -- of either class -- hands its permit to one of an
object's own waiters, the same step gives the object's waiters queued right
behind it their fencing tokens: the object then passes the permit from each
to the next at once, and tells Redis after. They stay queued in Redis until
a pass reaches them, so that a permit the object does not pass on goes to
them from the queue all the same. Each test uses objects of its own on the
session's real server; two objects stand for two processes (each has its
own identity in Redis).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, Permit, PermitLost, SemaphoreError
from aiosem._scripts import FAIR_RELEASE
from tests.harness.faults import proxied_client
from tests.harness.support import unrestricted, until_queued

if TYPE_CHECKING:
    from collections.abc import Coroutine

    import redis.asyncio

    from aiosem._relay import Relay
    from tests.harness.proxy import TcpProxy
    from tests.harness.support import RedisServer

#: Generous bounds on what happens within a few round trips.
BOUND = 10.0

Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore
SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]


def relay_of(sem: Semaphore) -> Relay:
    """The relay of a semaphore object (without replicas, it always has one)."""
    relay = sem._core.relay
    assert relay is not None
    return relay


async def queue_up(sem: Semaphore, watcher: Semaphore, order: list[str], label: str) -> asyncio.Task[Permit]:
    """Start an acquire that records ``label`` when granted and releases at once; return once it is queued."""
    queued_before = await watcher.waiting()

    async def cycle() -> Permit:
        permit = await sem.acquire()
        assert permit is not None
        order.append(label)
        await sem.release(permit)
        return permit

    task = asyncio.create_task(cycle())
    await until_queued(watcher, queued_before + 1)
    return task


async def relayed_to_head(
    sem: Semaphore, *behind: Coroutine[Any, Any, Any], refreshed: bool = False
) -> tuple[Permit, list[asyncio.Task[Any]]]:
    """Hold the mutex, queue a head waiter and then ``behind`` in order, and release.

    Returns the head's permit, granted by this object's own release step,
    which made ``behind`` its run; and the tasks of ``behind``.
    """
    holder = await sem.acquire()
    assert holder is not None
    head = asyncio.create_task(sem.acquire(auto_refresh=refreshed))
    await until_queued(sem, 1)
    tasks = []
    for queued, waiter in enumerate(behind, start=2):
        tasks.append(asyncio.create_task(waiter))
        await until_queued(sem, queued)
    await sem.release(holder)
    with anyio.fail_after(BOUND):
        relayed = await head
    assert relayed is not None
    return relayed, tasks


async def assert_idle(sem: Semaphore) -> None:
    assert await sem.count() == 0
    assert await sem.waiting() == 0


async def test_the_run_is_served_in_arrival_order_and_another_processes_waiter_ends_it(
    cls: SemaphoreClass,
    real_client: redis.asyncio.Redis,
) -> None:
    one = cls(real_client, "relay-order", 1)
    other = cls(real_client, "relay-order", 1)
    order: list[str] = []
    first = await one.acquire()
    assert first is not None
    tasks = [
        await queue_up(sem, one, order, label)
        for sem, label in ((one, "a1"), (one, "a2"), (other, "b1"), (one, "a3"), (one, "a4"))
    ]
    await one.release(first)
    with anyio.fail_after(BOUND):
        permits = await asyncio.gather(*tasks)
    assert order == ["a1", "a2", "b1", "a3", "a4"]
    tokens = [permit.fencing_token for permit in permits]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)
    assert tokens[0] > first.fencing_token
    await assert_idle(one)


async def test_the_next_waiter_of_a_run_holds_before_redis_answers_the_release(
    cls: SemaphoreClass, redis_server: RedisServer, proxy: TcpProxy
) -> None:
    client = proxied_client(proxy, redis_server)
    sem = cls(client, "relay-at-once", 1)
    try:
        warm = await sem.acquire()  # loads the scripts: no NOSCRIPT reply is held below
        assert warm is not None
        await sem.release(warm)
        relayed, (behind,) = await relayed_to_head(sem, sem.acquire())
        assert relay_of(sem).run_of(relayed.identifier)  # the step that granted it made the waiter behind its run
        assert await sem.waiting() == 1  # queued still, in its place

        # The pass's first request: the script, or the locked step's lock and reads.
        proxy.hold_replies(after=FAIR_RELEASE.sha.encode() if cls is AsyncFairSemaphore else b"WATCH")
        releasing = asyncio.create_task(sem.release(relayed))
        with anyio.fail_after(BOUND):
            successor = await behind
            await proxy.wait_until(lambda: proxy.held_replies > 0)
        proxy.disarm_replies()  # only the pass's reply is held
        assert successor is not None
        assert successor.fencing_token > relayed.fencing_token
        assert not releasing.done()  # the pass is still on its way
        proxy.release_replies()
        with anyio.fail_after(BOUND):
            assert await releasing
        assert await sem.holders() == {successor.identifier: pytest.approx(10.0, abs=1.0)}
        assert await sem.release(successor)
        await assert_idle(sem)
    finally:
        proxy.release_replies()
        await sem.aclose()
        await client.aclose()


async def test_a_waiter_of_a_run_that_gives_up_is_passed_over(
    cls: SemaphoreClass, real_client: redis.asyncio.Redis
) -> None:
    sem = cls(real_client, "relay-give-up", 1)
    relayed, (quitter, last) = await relayed_to_head(sem, sem.acquire(), sem.acquire())
    quitter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await quitter
    await sem.release(relayed)
    with anyio.fail_after(BOUND):
        permit = await last
    assert permit is not None
    assert await sem.release(permit)
    await assert_idle(sem)
    # The waiter that gave up left the queue: no tombstone was needed for it.
    assert await real_client.zcard(f"{sem.key}:cancelled") == 0


async def test_a_waiter_cancelled_once_the_permit_was_relayed_to_it_relays_it_on(
    cls: SemaphoreClass,
    real_client: redis.asyncio.Redis,
) -> None:
    sem = cls(real_client, "relay-cancelled-holder", 1)
    relayed, (doomed, last) = await relayed_to_head(sem, sem.acquire(), sem.acquire())
    releasing = asyncio.create_task(sem.release(relayed))
    await asyncio.sleep(0)  # the release relays the permit to `doomed` before its first await
    assert not doomed.done()
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    with anyio.fail_after(BOUND):
        assert await releasing
        permit = await last
    assert permit is not None
    assert await sem.release(permit)
    await assert_idle(sem)


async def test_a_run_whose_holder_lets_its_lease_run_out_is_served_from_the_queue(
    cls: SemaphoreClass,
    real_client: redis.asyncio.Redis,
) -> None:
    sem = cls(real_client, "relay-lapsed", 1, timeout=1.0)
    forgotten, (behind,) = await relayed_to_head(sem, sem.acquire())  # held, never refreshed, never released
    with anyio.fail_after(BOUND):
        permit = await behind
    assert permit is not None
    assert permit.fencing_token > forgotten.fencing_token
    assert await sem.holders() == {permit.identifier: pytest.approx(1.0, abs=0.5)}
    assert not await sem.release(forgotten)
    assert await sem.release(permit)
    await assert_idle(sem)


async def test_a_relay_whose_holder_lost_its_permit_still_serves_the_next_waiter(
    cls: SemaphoreClass,
    real_client: redis.asyncio.Redis,
) -> None:
    sem = cls(real_client, "relay-holder-gone", 1)
    entered = asyncio.Event()

    async def hold_it() -> None:
        async with sem:
            entered.set()

    relayed, (body,) = await relayed_to_head(sem, hold_it())
    await real_client.zrem(f"{sem.key}:owner", relayed.identifier)  # lost in Redis, say by eviction
    assert not await sem.release(relayed)
    with anyio.fail_after(BOUND):
        await entered.wait()
        await body  # no PermitLost: the freed permit went to the queue's head, the next waiter
    await assert_idle(sem)


async def test_a_relay_that_finds_the_next_waiter_gone_from_the_queue_tells_it(
    cls: SemaphoreClass,
    real_client: redis.asyncio.Redis,
) -> None:
    sem = cls(real_client, "relay-gone", 1)
    entered = asyncio.Event()
    outcome: list[BaseException] = []

    async def hold_it() -> None:
        try:
            async with sem:
                entered.set()
                await asyncio.sleep(BOUND)
        except PermitLost as error:
            outcome.append(error)

    relayed, (body,) = await relayed_to_head(sem, hold_it())
    (successor,) = relay_of(sem).run_of(relayed.identifier)
    # Presumed dead in Redis (a process stalled past its waiter timeout, say), and its holder's permit lost.
    await real_client.zrem(f"{sem.key}:queue", successor[0])
    await real_client.zrem(f"{sem.key}:waiters", successor[0])
    await real_client.zrem(f"{sem.key}:owner", relayed.identifier)
    assert not await sem.release(relayed)
    with anyio.fail_after(BOUND):
        await entered.wait()
        await body
    assert len(outcome) == 1
    await assert_idle(sem)


async def test_without_a_mutex_nothing_is_relayed(cls: SemaphoreClass, real_client: redis.asyncio.Redis) -> None:
    sem = cls(real_client, "relay-limit-2", 2)
    holders = [await sem.acquire() for _ in range(2)]
    waiters = [asyncio.create_task(sem.acquire())]
    await until_queued(sem, 1)
    waiters.append(asyncio.create_task(sem.acquire()))
    await until_queued(sem, 2)
    for permit in holders:
        assert permit is not None
        await sem.release(permit)
    with anyio.fail_after(BOUND):
        granted = await asyncio.gather(*waiters)
    assert not any(relay_of(sem).run_of(permit.identifier) for permit in granted if permit is not None)
    for permit in granted:
        assert permit is not None
        assert await sem.release(permit)
    await assert_idle(sem)


async def test_closing_gives_back_a_relayed_permit_and_fails_the_waiters_of_its_run(
    cls: SemaphoreClass,
    real_client: redis.asyncio.Redis,
) -> None:
    sem = cls(real_client, "relay-close", 1)
    _, (behind,) = await relayed_to_head(sem, sem.acquire(), refreshed=True)  # kept alive: closing releases it
    await sem.aclose()
    with pytest.raises(SemaphoreError, match="closed"):
        await behind
    await assert_idle(sem)


async def test_no_run_forms_while_a_locked_waiter_that_came_first_is_on_its_way(
    real_client: redis.asyncio.Redis,
) -> None:
    # A locked waiter takes its ticket when it arrives and is queued by a
    # later step: here that step waits for a step lock held by hand. The fair
    # object's waiters queue behind its ticket meanwhile. Were the first of
    # them handed the mutex with the second as its run, the locked waiter,
    # queued next, would be ahead of the run: the relay would hand the mutex
    # to the second while the queue gave it to the locked waiter.
    fair = AsyncFairSemaphore(real_client, "relay-arriving", 1)
    locked = AsyncLockedSemaphore(real_client, "relay-arriving", 1)
    keys = fair._core.keys
    holder = await fair.acquire()
    assert holder is not None
    order: list[str] = []
    first_holds, first_may_release = asyncio.Event(), asyncio.Event()

    async def cycle(sem: AsyncFairSemaphore | AsyncLockedSemaphore, label: str) -> None:
        permit = await sem.acquire()
        assert permit is not None
        order.append(label)
        if label == "f1":
            first_holds.set()
            await first_may_release.wait()
        await sem.release(permit)

    async with unrestricted(real_client) as admin:
        assert await admin.set(keys.lock, "held by the test", px=60_000)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(cycle, locked, "locked")
            with anyio.fail_after(BOUND):
                while await admin.get(keys.tickets) is None:  # noqa: ASYNC110 -- a bounded poll of Redis's state
                    await asyncio.sleep(0.01)
            for count, label in enumerate(("f1", "f2"), start=1):
                tasks.start_soon(cycle, fair, label)
                await until_queued(fair, count)
            await fair.release(holder)
            with anyio.fail_after(BOUND):
                await first_holds.wait()
            await admin.delete(keys.lock)
            await until_queued(fair, 2)  # f2 and, ahead of it, the locked waiter
            first_may_release.set()
    assert order == ["f1", "locked", "f2"]
    await assert_idle(fair)
    await locked.aclose()


async def test_a_locked_waiter_taken_for_gone_on_its_way_is_queued_behind_those_who_came_after(
    real_client: redis.asyncio.Redis,
) -> None:
    # Its step waits for a step lock held by hand while its entry in
    # :arriving goes, as when a step found it past its deadline: a run may
    # have been relayed since as if it were gone, so its first ticket could
    # put it ahead of that run. It takes a new one, behind the waiter that
    # came after it. (With the whole key evicted: tests/faults/test_eviction.py.)
    first, second = (AsyncLockedSemaphore(real_client, "relay-lost-place", 1) for _ in range(2))
    keys = first._core.keys
    holder = await first.acquire()
    assert holder is not None
    order: list[str] = []

    async def cycle(sem: AsyncLockedSemaphore, label: str) -> None:
        permit = await sem.acquire()
        assert permit is not None
        order.append(label)
        await sem.release(permit)

    async with unrestricted(real_client) as admin:
        assert await admin.set(keys.lock, "held by the test", px=60_000)
        async with anyio.create_task_group() as tasks:
            # The holder's acquire drew ticket 1.
            for label, sem, drawn in (("first", first, b"2"), ("second", second, b"3")):
                tasks.start_soon(cycle, sem, label)
                with anyio.fail_after(BOUND):
                    while await admin.get(keys.tickets) != drawn:  # noqa: ASYNC110 -- a bounded poll of Redis's state
                        await asyncio.sleep(0.01)
            arriving: list[bytes] = await admin.zrange(keys.arriving, 0, -1)  # type: ignore[assignment]
            (gone,) = [member for member in arriving if member.startswith(first._core.process.encode())]
            await admin.zrem(keys.arriving, gone)
            await admin.delete(keys.lock)
            await until_queued(first, 2)
            assert await admin.zscore(keys.queue, gone) == 4  # drawn again, behind the second
            await first.release(holder)
    assert order == ["second", "first"]
    for sem in (first, second):
        await sem.aclose()
