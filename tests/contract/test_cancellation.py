"""A cancelled acquire leaves nothing behind: no permit, no place in the queue, no tombstone.

Both classes, on the session's real server, through a `TcpProxy` that can
hold a request or a reply mid-flight -- so that a cancellation lands exactly
between the server acting on an acquire and the client hearing of it, or
the cleanup of a cancelled acquire overtakes the acquire itself. Each test
ends by checking that the semaphore is idle and that of its keys only the
fencing counter is left (and the waiters' ticket counter, which expires by
itself a waiter timeout later).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis.asyncio

import aiosem
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, LimiterEvent, Permit
from aiosem._core import Core
from aiosem._protocol import Step
from aiosem._rules import TOMBSTONE_TTL_MS, queue_ttl_ms
from aiosem._timing import SHORTEST_STEP_BOUND
from aiosem._urls import close, connect
from aiosem._waiting import WaitQueue
from tests.harness.proxy import TcpProxy
from tests.harness.support import FakeClock, record_steps, until_one_time_checks_done, until_subscribed

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from anyio.abc import TaskGroup

    from aiosem._coordination import Submission
    from aiosem._protocol import Reply
    from tests.harness.support import RedisServer

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: The longest any one wait of these tests may take before the test fails.
WAIT = 5.0


@pytest.fixture
def granting_command(cls: SemaphoreClass) -> bytes:
    """The command whose execution grants a permit: the fair script, or the locked step's transaction."""
    return b"EVALSHA" if cls is AsyncFairSemaphore else b"EXEC"


@pytest.fixture
async def proxied(proxy: TcpProxy) -> AsyncIterator[redis.asyncio.Redis]:
    """A client that reaches the session's server through the proxy."""
    client = redis.asyncio.Redis(host=proxy.host, port=proxy.port)
    yield client
    await client.aclose()


@pytest.fixture
def direct(real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis) -> redis.asyncio.Redis:
    """An unrestricted client of the same server that bypasses the proxy (the database is flushed)."""
    return admin_client


# --- helpers ------------------------------------------------------------------------


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Ask ``condition`` (a round trip each time) until it holds; fail after `WAIT` seconds."""
    with anyio.fail_after(WAIT):
        while not await condition():
            pass


async def until_queued(sem: Semaphore, waiters: int) -> None:
    """Wait until exactly ``waiters`` are queued in Redis."""

    async def queued() -> bool:
        return await sem.waiting() == waiters

    await until(queued)


async def finished(task: asyncio.Task[object]) -> None:
    """Wait until ``task`` is done, whatever its outcome; fail after `WAIT` seconds."""
    with anyio.fail_after(WAIT):
        await asyncio.wait({task})


async def when_queued(sem: Semaphore, then: Callable[[], object]) -> None:
    """Call ``then`` once one waiter is queued in Redis."""
    await until_queued(sem, 1)
    then()


def expire(scope: anyio.CancelScope) -> None:
    """Make a timeout's deadline now, as if it had just run out."""
    scope.deadline = anyio.current_time()


async def warm_up(sem: Semaphore) -> None:
    """Acquires and releases: scripts loaded, the eviction policy looked at, one connection in the pool."""
    permit = await sem.acquire()
    assert permit is not None
    assert await sem.release(permit)
    await until_one_time_checks_done()
    client = sem._client
    assert isinstance(client, redis.asyncio.Redis)
    await client.connection_pool.disconnect()
    permit = await sem.acquire()
    assert permit is not None
    assert await sem.release(permit)


async def assert_nothing_left(sem: Semaphore, direct: redis.asyncio.Redis, *, tombstones: bool = False) -> None:
    """No permit held, nobody queued, and of the semaphore's keys only its counter.

    The waiters' ticket counter may outlive its last waiter by a waiter
    timeout, and a release call's receipt the call by a step bound: both
    expire by themselves. Tombstones are allowed only if asked.
    """
    assert await sem.count() == 0
    assert await sem.waiting() == 0
    counter, tickets, cancelled = (f"{sem.key}:{suffix}".encode() for suffix in ("counter", "tickets", "cancelled"))
    receipts = set(await direct.keys(sem.key + ":receipt:*"))
    left = set(await direct.keys(sem.key + "*")) - receipts
    assert left - ({tickets, cancelled} if tombstones else {tickets}) == {counter}
    assert await direct.pttl(tickets) <= queue_ttl_ms(sem.waiter_timeout)
    for receipt in receipts:
        assert 0 < await direct.pttl(receipt) <= max(sem.timeout, SHORTEST_STEP_BOUND) * 1000
    assert await direct.pttl(cancelled) <= TOMBSTONE_TTL_MS
    # A step that failed (not cancelled) frees its lock in the background, and
    # the lock expires by itself within its lock timeout (1 s) in any case.
    with anyio.fail_after(WAIT):
        while await direct.exists(f"lock:{sem.key}"):  # noqa: ASYNC110 -- the lock's end is in Redis
            await anyio.sleep(0.01)


# --- where the cancellation lands ------------------------------------------------------


async def test_a_waiter_cancelled_while_queued_leaves_the_queue(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None
    waiter = asyncio.create_task(sem.acquire())
    await until_queued(sem, 1)

    waiter.cancel()
    await finished(waiter)

    assert waiter.cancelled()
    assert await sem.waiting() == 0
    assert await sem.release(holder)
    await assert_nothing_left(sem, direct)


async def test_a_grant_whose_reply_never_arrives_is_given_back(
    cls: SemaphoreClass,
    proxy: TcpProxy,
    proxied: redis.asyncio.Redis,
    direct: redis.asyncio.Redis,
    granting_command: bytes,
) -> None:
    sem = cls(proxied, "sem", 1)
    owners = f"{sem.key}:owner"
    await warm_up(sem)
    proxy.hold_replies(after=granting_command)
    acquiring = asyncio.create_task(sem.acquire())

    async def granted_in_redis() -> bool:
        return await direct.zcard(owners) == 1

    await until(granted_in_redis)
    acquiring.cancel()
    await finished(acquiring)

    assert acquiring.cancelled()
    assert await direct.zcard(owners) == 0  # given back while the grant's reply is still held
    proxy.release_replies()
    other = cls(direct, "sem", 1)
    permit = await other.acquire(blocking=False)
    assert permit is not None
    assert await other.release(permit)
    await assert_nothing_left(sem, direct)


async def test_an_acquire_that_arrives_after_its_cancellation_takes_nothing(
    cls: SemaphoreClass,
    proxy: TcpProxy,
    proxied: redis.asyncio.Redis,
    direct: redis.asyncio.Redis,
    granting_command: bytes,
) -> None:
    sem = cls(proxied, "sem", 1)
    tombstones = f"{sem.key}:cancelled"
    await warm_up(sem)
    proxy.hold_requests(at=granting_command)
    acquiring = asyncio.create_task(sem.acquire())
    with anyio.fail_after(WAIT):
        await proxy.wait_until(lambda: proxy.held_requests > 0)

    acquiring.cancel()
    await finished(acquiring)

    assert acquiring.cancelled()
    assert await direct.zcard(tombstones) == 1  # the cleanup overtook the acquire
    proxy.release_requests()

    async def tombstone_met() -> bool:
        # The held acquire reaches Redis, meets the tombstone and removes it
        # (a locked step's EXEC, which watched the lock, aborts first, and its
        # retry reads the tombstone).
        return await direct.exists(tombstones) == 0

    await until(tombstone_met)
    assert await direct.zcard(f"{sem.key}:owner") == 0
    await assert_nothing_left(sem, direct)


#: How many acquires are cancelled at once: half the connections of redis-py 8's default pool.
TOGETHER = 50


@pytest.fixture
def arriving_command(cls: SemaphoreClass) -> bytes:
    """The command of a blocking acquire's arrival: the fair first step's script, or the locked ticket draw."""
    return b"EVALSHA" if cls is AsyncFairSemaphore else b"INCRBY"


async def test_acquires_cancelled_together_give_up_on_a_connection_or_two(
    cls: SemaphoreClass,
    proxy: TcpProxy,
    proxied: redis.asyncio.Redis,
    direct: redis.asyncio.Redis,
    arriving_command: bytes,
) -> None:
    # Each used to take a connection of its own to leave :arriving (locked),
    # all at once as their draw ended: a hundred such ran redis-py 8's
    # default pool dry, and the give-ups that met "Too many connections"
    # left their permits held.
    sem = cls(proxied, "sem", 1)
    await warm_up(sem)
    holder = await sem.acquire()
    assert holder is not None
    proxy.hold_replies(after=arriving_command)
    acquiring = [asyncio.create_task(sem.acquire()) for _ in range(TOGETHER)]
    with anyio.fail_after(WAIT):
        await proxy.wait_until(lambda: proxy.held_replies > 0)
    opened = proxy.accepted

    for task in acquiring:
        task.cancel()
    await asyncio.sleep(0)  # each gives up, and waits for its arrival's reply
    proxy.release_replies()
    for task in acquiring:
        await finished(task)

    assert all(task.cancelled() for task in acquiring)
    assert proxy.accepted - opened <= 2
    assert await sem.release(holder)
    await assert_nothing_left(sem, direct, tombstones=True)


async def test_a_give_up_that_fails_after_its_acquire_was_cancelled_is_logged(
    cls: SemaphoreClass,
    proxied: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An anyio scope cancels the caller again while it waits for its give-up:
    # the give-up's failure, which the caller no longer hears of, used to go untold.
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None
    submit = Core.submit

    async def cancel_fails(self: Core, step: Step, identifiers: Sequence[str] | Submission[Reply]) -> Any:
        if step is Step.CANCEL:
            raise redis.ConnectionError("Too many connections")
        return await submit(self, step, identifiers)

    monkeypatch.setattr(Core, "submit", cancel_fails)
    with caplog.at_level(logging.WARNING, logger="aiosem"), anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sem.acquire)
            await until_queued(sem, 1)
            tasks.cancel_scope.cancel()

    (record,) = [record for record in caplog.records if "could not give back" in record.getMessage()]
    assert record.exc_info is not None
    assert "Too many connections" in str(record.exc_info[1])
    assert await sem.release(holder)


async def test_a_waiter_cancelled_right_after_its_grant_passes_the_permit_on(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None
    first = asyncio.create_task(sem.acquire())
    await until_queued(sem, 1)
    with anyio.fail_after(WAIT):
        while not sem._core.queue.queued():  # noqa: ASYNC110 -- `first` may not have read its reply yet
            await asyncio.sleep(0.002)
    (first_identifier,) = sem._core.queue.queued()
    second = asyncio.create_task(sem.acquire())
    await until_queued(sem, 2)
    observe = WaitQueue.observe

    def cancel_first_on_its_grant(self: WaitQueue, reply: Reply, sent: float) -> None:
        observe(self, reply, sent)
        if first_identifier in dict(reply.granted):
            assert self.waiter(first_identifier) is None  # granted, and `first` has not run since
            first.cancel()

    monkeypatch.setattr(WaitQueue, "observe", cancel_first_on_its_grant)
    assert await sem.release(holder)  # its own reply hands `first` the permit
    with anyio.fail_after(WAIT):
        permit = await second

    assert permit is not None
    await finished(first)
    assert first.cancelled()
    assert await sem.release(permit)
    await assert_nothing_left(sem, direct)


async def test_a_waiter_cancelled_as_another_process_hands_it_the_permit_passes_it_on(
    cls: SemaphoreClass,
    proxied: redis.asyncio.Redis,
    direct: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    releasing = cls(proxied, "sem", 1)
    waiting = cls(proxied, "sem", 1)
    handed: list[str] = []
    deliver = WaitQueue.on_message

    def cancel_first_on_its_grant(self: WaitQueue, message: str) -> None:
        deliver(self, message)
        handed.append(message)
        if len(handed) == 1:
            first.cancel()  # before `first` runs again: its grant is waiting for it

    monkeypatch.setattr(WaitQueue, "on_message", cancel_first_on_its_grant)
    holder = await releasing.acquire()
    assert holder is not None
    first = asyncio.create_task(waiting.acquire())
    await until_queued(waiting, 1)
    await until_subscribed(waiting)  # `first`'s grant comes by message
    second = asyncio.create_task(waiting.acquire())
    await until_queued(waiting, 2)

    assert await releasing.release(holder)
    with anyio.fail_after(WAIT):
        permit = await second

    assert permit is not None
    assert len(handed) == 1  # `first`'s grant came by message; `second`'s in the reply of the give-back
    await finished(first)
    assert first.cancelled()
    assert await waiting.release(permit)
    await assert_nothing_left(waiting, direct)


async def test_an_acquire_cancelled_while_subscribing_does_not_stall_the_others(
    cls: SemaphoreClass, proxy: TcpProxy, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    sem = cls(proxied, "sem", 1)
    proxy.delay(0.2, "replies")  # the subscription's first connection takes at least 0.2 s to set up
    cancelled = asyncio.create_task(sem.acquire())  # subscribes for both
    patient = asyncio.create_task(sem.acquire())
    with anyio.fail_after(WAIT):
        await proxy.wait_until(lambda: proxy.connections == 1)

    cancelled.cancel()  # while connecting: nothing has been sent for it yet
    proxy.delay(0)
    with anyio.fail_after(1.0):  # the subscription and the grant take ~0.2 s; the stall, 5 s
        permit = await patient

    assert permit is not None
    await finished(cancelled)
    assert cancelled.cancelled()
    assert await sem.release(permit)
    await assert_nothing_left(sem, direct)


# --- a cancellation at every point, with clients as users make them ----------------------------------
#
# redis-py wraps its socket writes and reads in `asyncio.wait_for` whenever the
# client has a socket timeout -- redis-py 8's default client does, and so does
# every client `aiosem.configure` makes -- and on Python 3.10 and 3.11 that
# `wait_for` returns the result of a write that completed as its caller was
# cancelled, swallowing the cancellation. Each test below cancels a call after
# every number of event-loop turns from 0 up to past its end: a call that was
# still running when it was cancelled must raise `CancelledError` and leave
# nothing behind, wherever the cancellation landed.

#: Loop turns after which a call is cancelled: from its start to well past its end.
CANCEL_AFTER = range(48)
#: The lease of the sweeps: longer than any of them takes.
SWEEP_LEASE = 300.0


@pytest.fixture(params=["default", "configured"])
async def users_client(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of the session's emptied server as users make one: redis-py's defaults, or `aiosem.configure`'s."""
    admin = redis_server.admin_client()
    await admin.flushdb()
    await admin.aclose()
    client = redis_server.client() if request.param == "default" else connect(redis_server.url)
    assert isinstance(client, redis.asyncio.Redis)
    if request.param == "configured" or redis.VERSION >= (8,):
        # The condition these tests are about (redis-py 5's default client has no socket timeout).
        assert client.connection_pool.connection_kwargs["socket_timeout"]
    yield client
    await close(client)


async def cancelled_after(turns: int, call: Awaitable[object]) -> tuple[bool, object]:
    """Run ``call`` as a task and cancel it after ``turns`` loop turns.

    Returns whether the call was still running when cancelled, and what it
    returned or raised (the `CancelledError` included).
    """
    task = asyncio.ensure_future(call)
    for _ in range(turns):
        await asyncio.sleep(0)
    running = task.cancel()
    try:
        with anyio.fail_after(WAIT):
            return running, await asyncio.shield(task)
    except BaseException as error:  # the outcome is what the test looks at
        if not task.done():
            raise
        return running, error


def assert_cancelled(running: bool, outcome: object, turns: int) -> None:
    """A call still running when cancelled raised `CancelledError`."""
    if running:
        assert isinstance(outcome, asyncio.CancelledError), f"cancelled after {turns} turns, the call gave {outcome!r}"


@pytest.mark.parametrize("contended", [False, True], ids=["free", "contended"])
async def test_a_cancelled_acquire_raises_and_leaves_nothing_wherever_it_lands(
    cls: SemaphoreClass, users_client: redis.asyncio.Redis, direct: redis.asyncio.Redis, contended: bool
) -> None:
    # A lease far longer than the test, which keeps the holder's permit unrefreshed.
    holder_sem = cls(direct, "sweep", 1, timeout=SWEEP_LEASE)
    holder = await holder_sem.acquire() if contended else None
    for turns in CANCEL_AFTER:
        sem = cls(users_client, "sweep", 1, timeout=SWEEP_LEASE)  # fresh each time: the first call is where order broke
        running, outcome = await cancelled_after(turns, sem.acquire())
        assert_cancelled(running, outcome, turns)
        if isinstance(outcome, Permit):
            assert await sem.release(outcome)
        assert await sem.waiting() == 0
        assert await sem.count() == (1 if contended else 0)
        await sem.aclose()
    if holder is not None:
        assert await holder_sem.release(holder)
    await holder_sem.aclose()
    await assert_nothing_left(holder_sem, direct, tombstones=True)


async def test_a_cancelled_async_with_raises_and_leaves_nothing_wherever_it_lands(
    cls: SemaphoreClass, users_client: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    entered: list[int] = []

    async def body(sem: Semaphore, turns: int) -> None:
        async with sem:
            entered.append(turns)
            await asyncio.sleep(0)

    for turns in CANCEL_AFTER:
        sem = cls(users_client, "sweep-with", 1)
        running, outcome = await cancelled_after(turns, body(sem, turns))
        assert_cancelled(running, outcome, turns)
        assert (await sem.count(), await sem.waiting()) == (0, 0), f"cancelled after {turns} turns"
        await sem.aclose()
    await assert_nothing_left(cls(direct, "sweep-with", 1), direct, tombstones=True)


#: Loop turns after an ``async with`` body ends within which its release reaches Redis and comes back.
RELEASE_TURNS = 16


async def test_a_release_cancelled_on_its_way_goes_on_and_is_told_released(
    cls: SemaphoreClass, users_client: redis.asyncio.Redis
) -> None:
    told: list[LimiterEvent] = []

    async def body(sem: Semaphore, leaving: asyncio.Event) -> None:
        async with sem:
            leaving.set()

    aiosem.add_observer(told.append)
    try:
        for turns in range(RELEASE_TURNS):
            sem = cls(users_client, "told", 1)
            leaving = asyncio.Event()
            task = asyncio.ensure_future(body(sem, leaving))
            with anyio.fail_after(WAIT):
                await leaving.wait()
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()  # once the release is on its way, or back (a task done ignores it)
            with anyio.fail_after(WAIT):
                await asyncio.gather(task, return_exceptions=True)
            assert await sem.count() == 0, f"cancelled {turns} turns after the body"
            await sem.aclose()
    finally:
        aiosem.remove_observer(told.append)
    acquired = [event.identifier for event in told if event.kind == "acquired"]
    released = [event.identifier for event in told if event.kind == "released"]
    assert len(acquired) == RELEASE_TURNS
    assert released == acquired


async def test_a_cancelled_rate_limited_call_raises_wherever_it_lands(users_client: redis.asyncio.Redis) -> None:
    for turns in CANCEL_AFTER:
        limiter = AsyncRateLimiter(users_client, f"sweep-rate-{turns}", 1000)
        running, outcome = await cancelled_after(turns, limiter.acquire())
        assert_cancelled(running, outcome, turns)


async def test_a_cancelled_costly_rate_limited_call_gives_all_its_slots_back_wherever_it_lands(
    users_client: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    clock = FakeClock()
    for turns in CANCEL_AFTER:
        limiter = AsyncRateLimiter(users_client, f"sweep-cost-{turns}", 1, burst=5, clock=clock)
        assert await limiter.acquire(cost=5)
        before = await direct.get(limiter.key)
        running, outcome = await cancelled_after(turns, limiter.acquire(cost=3))  # its slots are 3 s away
        assert_cancelled(running, outcome, turns)
        # Taken and given back, or never taken: the next call finds the TAT the first left.
        assert await direct.get(limiter.key) == before, f"cancelled after {turns} turns"


async def test_asyncio_timeout_fires_around_an_acquire_wherever_it_lands(
    cls: SemaphoreClass, users_client: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout is new in Python 3.11")
    holder_sem = cls(direct, "sweep-timeout", 1, timeout=SWEEP_LEASE)
    holder = await holder_sem.acquire()
    assert holder is not None
    timeouts = 0
    for microseconds in range(0, 3000, 100):
        sem = cls(users_client, "sweep-timeout", 1, timeout=SWEEP_LEASE)
        try:
            async with asyncio.timeout(microseconds / 1_000_000):  # type: ignore[attr-defined,unused-ignore]
                permit = await sem.acquire()
        except TimeoutError:
            timeouts += 1
        else:
            raise AssertionError(f"an acquire granted {permit!r} while the only permit was held")
        assert await sem.waiting() == 0
        await sem.aclose()
    assert timeouts == 30
    assert await holder_sem.release(holder)
    await holder_sem.aclose()


# --- the ways a caller gives up ---------------------------------------------------------


async def test_asyncio_timeout_around_a_blocked_acquire(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    if sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout is new in Python 3.11")
    else:
        sem = cls(proxied, "sem", 1)
        holder = await sem.acquire()
        assert holder is not None
        timeout = asyncio.timeout(None)

        async def blocked() -> None:
            async with timeout:
                await sem.acquire()

        expiry = asyncio.create_task(when_queued(sem, lambda: timeout.reschedule(asyncio.get_running_loop().time())))
        with anyio.fail_after(WAIT), pytest.raises(TimeoutError):
            await blocked()

        await finished(expiry)
        assert await sem.waiting() == 0
        assert await sem.release(holder)
        await assert_nothing_left(sem, direct)


async def test_anyio_move_on_after_around_a_blocked_acquire(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tasks:
            with anyio.move_on_after(None) as timeout:
                tasks.start_soon(when_queued, sem, lambda: expire(timeout))
                await sem.acquire()

    assert timeout.cancelled_caught
    assert await sem.waiting() == 0
    assert await sem.release(holder)
    await assert_nothing_left(sem, direct)


async def test_anyio_fail_after_around_a_blocked_acquire(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None

    async def blocked(tasks: TaskGroup) -> None:
        with anyio.fail_after(None) as timeout:
            tasks.start_soon(when_queued, sem, lambda: expire(timeout))
            await sem.acquire()

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tasks:
            with pytest.raises(TimeoutError):
                await blocked(tasks)

    assert await sem.waiting() == 0
    assert await sem.release(holder)
    await assert_nothing_left(sem, direct)


async def test_task_group_cancellation_around_a_blocked_acquire(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sem.acquire)
            await until_queued(sem, 1)
            tasks.cancel_scope.cancel()

    assert tasks.cancel_scope.cancelled_caught
    assert await sem.waiting() == 0
    assert await sem.release(holder)
    await assert_nothing_left(sem, direct)


@pytest.mark.parametrize("blocking_timeout", [0.02, 0.2])
async def test_a_blocking_timeout_ends_the_wait_at_its_deadline_by_a_timer_not_by_polling(
    cls: SemaphoreClass,
    proxied: redis.asyncio.Redis,
    direct: redis.asyncio.Redis,
    blocking_timeout: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None
    steps = record_steps(cls, monkeypatch)

    started = anyio.current_time()
    with anyio.fail_after(WAIT):
        permit = await sem.acquire(blocking_timeout=blocking_timeout)
    elapsed = anyio.current_time() - started

    assert permit is None
    # Never before the deadline. How late after it is up to a busy machine:
    # the bound here is generous, and the steps show there was no polling.
    assert blocking_timeout <= elapsed < blocking_timeout + 1.0
    assert steps.count(Step.WAIT) == 1
    assert steps.count(Step.CANCEL) == 1
    assert Step.TRY not in steps
    assert await sem.waiting() == 0
    assert await sem.release(holder)
    await assert_nothing_left(sem, direct)


# --- many at once --------------------------------------------------------------------------

#: The contention test: permits, contenders, tries each, and how long it may run.
LIMIT = 3
CONTENDERS = 100
TRIES = 40
BUDGET = 12.0
CANCELLATIONS = 1000


@pytest.fixture(params=[None, 0.001], ids=["direct", "proxy-1ms"])
async def contended(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of the session's server, directly or through a proxy that delays each chunk 1 ms each way."""
    latency: float | None = request.param
    if latency is None:
        client = redis_server.client()
        yield client
        await client.aclose()
        return
    async with TcpProxy(redis_server.host, redis_server.port) as proxy:
        proxy.delay(latency)
        client = redis.asyncio.Redis(host=proxy.host, port=proxy.port)
        yield client
        await client.aclose()


@pytest.mark.slow
async def test_a_thousand_random_cancellations_under_contention_leave_nothing_behind(
    cls: SemaphoreClass, contended: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    sem = cls(contended, "sem", LIMIT)
    rng = random.Random(20240501)
    deadline = anyio.current_time() + BUDGET
    cancelled = bodies = inside = most_inside = 0

    async def contend() -> None:
        nonlocal cancelled, bodies, inside, most_inside
        for _ in range(TRIES):
            if anyio.current_time() >= deadline:
                return
            with anyio.move_on_after(rng.uniform(0, 0.05)) as attempt:
                async with sem:
                    inside += 1
                    most_inside = max(most_inside, inside)
                    try:
                        await anyio.sleep(rng.uniform(0, 0.003))
                    finally:
                        inside -= 1
                    bodies += 1
            cancelled += attempt.cancelled_caught

    with anyio.fail_after(BUDGET + 2 * WAIT):
        async with anyio.create_task_group() as tasks:
            for _ in range(CONTENDERS):
                tasks.start_soon(contend)

    assert cancelled >= CANCELLATIONS, f"only {cancelled} cancellations ({bodies} bodies ran)"
    assert bodies > 0
    assert most_inside <= LIMIT
    # An acquire cancelled before it reached Redis (while its connection was
    # being made, or -- locked -- while it waited out the step lock) leaves a
    # tombstone nobody will ask for: it refuses nothing and is gone in a minute.
    await assert_nothing_left(sem, direct, tombstones=True)
