"""Arrival order holds from the very first call: a fresh client, a fresh object, eager tasks, a give-up at hand-off.

`asyncio.Semaphore` serves its waiters in the order they called
``acquire``, from the first call on. So does aiosem, within a process and
across processes: no one-time set-up (the eviction-policy check, the first
subscription of an object, the first connection of a client) may let a
later call overtake an earlier one, or stretch a call's timeout. Every test
here builds its clients as users do (redis-py's defaults, with their socket
timeout) and its objects just before use.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import TYPE_CHECKING

import anyio
import pytest

import aiosem
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._protocol import Step
from aiosem._scripts import FAIR_RELEASE
from tests.harness.faults import proxied_client
from tests.harness.support import until_queued

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence
    from contextlib import AbstractAsyncContextManager

    import redis.asyncio

    from tests.harness.proxy import TcpProxy
    from tests.harness.support import RedisServer

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: A generous bound on anything here: a few round trips at most.
BOUND = 10.0
#: How many callers arrive, one after another.
CALLERS = 5
#: Loop turns between two callers' arrivals: nothing (all in one turn), a few
#: turns, and more than any set-up takes to start its first round trip.
GAPS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


async def turns(count: int) -> None:
    """Let the event loop run ``count`` times."""
    for _ in range(count):
        await asyncio.sleep(0)


async def in_arrival_order(limited: AbstractAsyncContextManager[object], gap: int, *, hold: float = 0.01) -> list[int]:
    """Start `CALLERS` bodies under ``limited``, ``gap`` loop turns apart; return the order they ran in."""
    order: list[int] = []

    async def body(number: int) -> None:
        async with limited:
            order.append(number)
            await anyio.sleep(hold)

    callers = []
    for number in range(CALLERS):
        callers.append(asyncio.create_task(body(number)))
        await turns(gap)
    with anyio.fail_after(BOUND):
        await asyncio.gather(*callers)
    return order


@pytest.fixture
async def fresh_client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A client as a user makes it (redis-py's defaults), of the session's emptied server, never used yet."""
    admin = redis_server.admin_client()
    await admin.flushdb()
    await admin.aclose()
    client = redis_server.client()
    yield client
    await client.aclose()


@pytest.fixture
async def eager_tasks() -> AsyncIterator[None]:
    """asyncio's eager task factory on the running loop (Python 3.12 and later)."""
    if sys.version_info < (3, 12):
        pytest.skip("asyncio.eager_task_factory is new in Python 3.12")
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
    yield
    loop.set_task_factory(None)


# --- 1. the first call through a fresh client --------------------------------------------


@pytest.mark.parametrize("gap", GAPS)
async def test_the_first_calls_on_a_fresh_client_run_in_arrival_order(
    cls: SemaphoreClass, fresh_client: redis.asyncio.Redis, gap: int
) -> None:
    sem = cls(fresh_client, "fresh-client", 1)
    try:
        assert await in_arrival_order(sem, gap) == list(range(CALLERS))
    finally:
        await sem.aclose()


@pytest.mark.parametrize("gap", [0, 1, 3, 8])
async def test_the_first_calls_on_a_fresh_client_run_in_arrival_order_with_eager_tasks(
    cls: SemaphoreClass, fresh_client: redis.asyncio.Redis, gap: int, eager_tasks: None
) -> None:
    sem = cls(fresh_client, "fresh-eager", 1)
    try:
        assert await in_arrival_order(sem, gap) == list(range(CALLERS))
    finally:
        await sem.aclose()


# --- 2. the first subscription of a fresh object -------------------------------------------


@pytest.mark.parametrize("gap", GAPS)
async def test_the_first_waiters_of_a_fresh_object_are_served_in_arrival_order(
    cls: SemaphoreClass, fresh_client: redis.asyncio.Redis, redis_server: RedisServer, gap: int
) -> None:
    # The client is warm (its first call is behind it); the object is new, and
    # every caller has to wait: the object subscribes to its channel meanwhile.
    other_client = redis_server.client()
    holder_sem = cls(other_client, "fresh-object", 1)
    holder = await holder_sem.acquire()
    assert holder is not None
    await fresh_client.ping()
    sem = cls(fresh_client, "fresh-object", 1)
    try:
        order: list[int] = []

        async def wait_then_record(number: int) -> None:
            async with sem:
                order.append(number)

        callers = []
        for number in range(CALLERS):
            callers.append(asyncio.create_task(wait_then_record(number)))
            await turns(gap)
        await until_queued(holder_sem, CALLERS)
        assert await holder_sem.release(holder)
        with anyio.fail_after(BOUND):
            await asyncio.gather(*callers)
        assert order == list(range(CALLERS))
    finally:
        await sem.aclose()
        await holder_sem.aclose()
        await other_client.aclose()


# --- 3. no one-time set-up stretches a timeout ---------------------------------------------


@pytest.mark.parametrize("held_for", ["CONFIG", "SUBSCRIBE"])
async def test_a_slow_one_time_set_up_stretches_no_blocking_timeout(
    cls: SemaphoreClass, redis_server: RedisServer, proxy: TcpProxy, held_for: str
) -> None:
    # The eviction-policy check and the first subscription are answered
    # late: the first acquire must still give up at its own time.
    admin = redis_server.admin_client()
    await admin.flushdb()
    holder_sem = cls(admin, "slow-set-up", 1)
    holder = await holder_sem.acquire()
    assert holder is not None
    client = proxied_client(proxy, redis_server)
    await client.ping()  # a connection exists: the proxy holds replies on the connections open now
    proxy.hold_replies(after=held_for.encode())
    sem = cls(client, "slow-set-up", 1)
    try:
        started = anyio.current_time()
        with anyio.fail_after(BOUND):
            assert await sem.acquire(blocking_timeout=0.2) is None
        took = anyio.current_time() - started
        # Held for ever, a set-up in the way would have cost the whole 5 s it is given.
        assert took < 1.0
    finally:
        proxy.release_replies()
        await sem.aclose()
        await client.aclose()
        await holder_sem.release(holder)
        await holder_sem.aclose()
        await admin.aclose()


# --- 4. a give-up at hand-off ------------------------------------------------------------


async def test_a_waiter_that_gives_up_as_the_permit_reaches_it_leaves_everyone_their_place(
    cls: SemaphoreClass, redis_server: RedisServer, proxy: TcpProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # Process P holds the mutex and has three waiters queued, w1 w2 w3; process Q
    # has one queued behind them, x. P releases, handing the permit to w1 -- and
    # w1 gives up before it hears so. The permit goes to w2, then w3, then x.
    admin = redis_server.admin_client()
    await admin.flushdb()
    client = proxied_client(proxy, redis_server)
    p = cls(client, "hand-off-give-up", 1)
    q = cls(admin, "hand-off-give-up", 1)
    order: list[str] = []

    async def wait(sem: Semaphore, label: str) -> None:
        async with sem:
            order.append(label)

    try:
        warm = await p.acquire()  # loads the scripts: no NOSCRIPT is held below
        assert warm is not None
        await p.release(warm)
        holder = await p.acquire()
        assert holder is not None
        w1 = asyncio.create_task(wait(p, "w1"))
        await until_queued(q, 1)
        rest = []
        for queued, (sem, label) in enumerate(((p, "w2"), (p, "w3"), (q, "x")), start=2):
            rest.append(asyncio.create_task(wait(sem, label)))
            await until_queued(q, queued)

        granting = FAIR_RELEASE.sha.encode() if cls is AsyncFairSemaphore else b"EXEC"
        proxy.hold_replies(after=granting)
        with caplog.at_level(logging.WARNING, logger="aiosem"):
            releasing = asyncio.create_task(p.release(holder))
            with anyio.fail_after(BOUND):
                await proxy.wait_until(lambda: proxy.held_replies > 0)
                # Only the release's reply is held: w1's give-up, on another connection, goes through.
                proxy.disarm_replies()
                # Redis has handed the permit to w1; w1 has not heard, and gives up.
                w1.cancel()
                await asyncio.wait({w1})
            proxy.release_replies()
            with anyio.fail_after(BOUND):
                assert await releasing
                await asyncio.gather(*rest)
        assert order == ["w2", "w3", "x"]
        assert not [record for record in caplog.records if "lost their place" in record.getMessage()]
        assert await q.count() == 0
        assert await q.waiting() == 0
    finally:
        proxy.release_replies()
        await p.aclose()
        await q.aclose()
        await client.aclose()
        await admin.aclose()


# --- 5. the decorators and limiters, configured by URL ------------------------------------


@pytest.mark.parametrize("gap", [0, 1, 2, 4, 8, 16])
@pytest.mark.usefixtures("unconfigured")
async def test_the_first_calls_through_a_limiter_run_in_arrival_order(
    redis_server: RedisServer, gap: int, kind: str
) -> None:
    admin = redis_server.admin_client()
    await admin.flushdb()
    await admin.aclose()
    aiosem.configure(url=redis_server.url, kind=kind)  # type: ignore[arg-type]
    try:
        assert await in_arrival_order(aiosem.limiter(f"first-calls-{kind}", 1), gap) == list(range(CALLERS))
    finally:
        await aiosem.aclose()


@pytest.fixture(params=["fair", "locked"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


# --- 6. a release and an acquire in one turn ------------------------------------------------


async def test_a_permit_released_in_the_turn_of_a_non_blocking_acquire_is_free_for_it(
    fresh_client: redis.asyncio.Redis,
) -> None:
    # As with asyncio.Semaphore: the try is called first, the release after it
    # in the same turn, and the release reaches Redis first. (Not so for
    # AsyncLockedSemaphore: there the try meets the release's step lock, and
    # a single try does not wait out a busy lock.)
    sem = AsyncFairSemaphore(fresh_client, "release-then-try", 1)
    try:
        held = await sem.acquire()
        assert held is not None
        trying = asyncio.create_task(sem.acquire(blocking=False))
        releasing = asyncio.create_task(sem.release(held))
        with anyio.fail_after(BOUND):
            taken = await trying
            assert await releasing
        assert taken is not None
        assert await sem.holders() == {taken.identifier: pytest.approx(sem.timeout, abs=1.0)}
    finally:
        await sem.aclose()


async def test_a_release_in_the_turn_of_its_process_acquiring_again_goes_to_the_waiter_queued_first(
    cls: SemaphoreClass, fresh_client: redis.asyncio.Redis, redis_server: RedisServer
) -> None:
    # The release goes ahead of the acquire made beside it; the permit is the
    # other process's, queued first, and the acquire queues behind it.
    sem = cls(fresh_client, "release-then-wait", 1)
    other_client = redis_server.client()
    other_sem = cls(other_client, "release-then-wait", 1)
    try:
        held = await sem.acquire()
        assert held is not None
        first = asyncio.create_task(other_sem.acquire())
        await until_queued(sem)
        again = asyncio.create_task(sem.acquire())
        releasing = asyncio.create_task(sem.release(held))
        with anyio.fail_after(BOUND):
            assert await releasing
            handed = await first
            assert handed is not None
            await until_queued(sem)
        assert not again.done()
        assert await other_sem.release(handed)
        with anyio.fail_after(BOUND):
            assert await again is not None
    finally:
        await sem.aclose()
        await other_sem.aclose()
        await other_client.aclose()


# --- 7. a release that wakes a waiter of its process ------------------------------------------


async def test_a_release_that_wakes_a_waiter_here_answers_once_the_waiters_release_has_gone(
    cls: SemaphoreClass, fresh_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The waiter woken by the release releases at once; its release goes out
    # before the first releaser, answered, makes its next call.
    sem = cls(fresh_client, "wakes-here", 2)
    events: list[str] = []
    step = type(sem._core)._step

    async def recorded(core: object, kind: Step, identifiers: Sequence[str], since: float | None = None) -> object:
        if kind is Step.RELEASE:
            events.append(f"release step of {', '.join(names.get(i, '?') for i in identifiers)}")
        return await step(core, kind, identifiers, since)  # type: ignore[arg-type]

    try:
        first, second = await sem.acquire(), await sem.acquire()
        assert first is not None
        assert second is not None
        names = {first.identifier: "the releaser", second.identifier: "the other holder"}

        async def waiter() -> None:
            permit = await sem.acquire()
            assert permit is not None
            names[permit.identifier] = "the waiter"
            assert await sem.release(permit)

        waiting = asyncio.create_task(waiter())
        await until_queued(sem)
        monkeypatch.setattr(type(sem._core), "_step", recorded)
        with anyio.fail_after(BOUND):
            assert await sem.release(first)
            events.append("the releaser answered")
            await waiting
        assert events == ["release step of the releaser", "release step of the waiter", "the releaser answered"]
        assert await sem.release(second)
    finally:
        await sem.aclose()


async def test_a_release_that_wakes_a_waiter_here_answers_while_the_waiter_holds_on(
    cls: SemaphoreClass, fresh_client: redis.asyncio.Redis
) -> None:
    sem = cls(fresh_client, "wakes-here-holding", 1)
    answered = asyncio.Event()
    try:
        held = await sem.acquire()
        assert held is not None

        async def waiter() -> None:
            async with sem:
                await answered.wait()  # holds until the releaser has its answer

        waiting = asyncio.create_task(waiter())
        await until_queued(sem)
        with anyio.fail_after(BOUND):
            assert await sem.release(held)
            answered.set()
            await waiting
        assert await sem.count() == 0
    finally:
        await sem.aclose()
