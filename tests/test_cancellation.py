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
import random
import sys
from typing import TYPE_CHECKING

import anyio
import pytest
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._timing import SHORTEST_STEP_BOUND
from tests.proxy import TcpProxy

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from anyio.abc import TaskGroup

    from tests.support import RedisServer

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
    """One acquire and release: subscribed, scripts loaded, one connection in the pool."""
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
    assert await direct.pttl(tickets) <= (sem.waiter_timeout + 1) * 1000
    for receipt in receipts:
        assert 0 < await direct.pttl(receipt) <= max(sem.timeout, SHORTEST_STEP_BOUND) * 1000
    assert await direct.pttl(cancelled) <= 61_000  # a tombstone lives a minute
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
    closed = proxy.closed
    proxy.release_requests()
    with anyio.fail_after(WAIT):
        # The held acquire reaches Redis, then the end of its dropped connection.
        await proxy.wait_until(lambda: proxy.closed > closed)
    assert await direct.zcard(f"{sem.key}:owner") == 0
    if cls is AsyncFairSemaphore:
        assert await direct.exists(tombstones) == 0  # the late script met it, and removed it
        await assert_nothing_left(sem, direct)
    else:
        # The late EXEC watched the lock its cancelled step held, so it aborted
        # without reading the tombstone, which expires by itself.
        await assert_nothing_left(sem, direct, tombstones=True)


async def test_a_waiter_cancelled_right_after_its_grant_passes_the_permit_on(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None
    first = asyncio.create_task(sem.acquire())
    await until_queued(sem, 1)
    second = asyncio.create_task(sem.acquire())
    await until_queued(sem, 2)

    assert await sem.release(holder)
    # The release's own reply handed `first` the permit; `first` has not run since.
    assert sum(waiter.done() for waiter in sem._waiters.values()) == 1
    first.cancel()
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
    deliver = cls._on_message

    def cancel_first_on_its_grant(self: Semaphore, message: str) -> None:
        deliver(self, message)
        handed.append(message)
        if len(handed) == 1:
            first.cancel()  # before `first` runs again: its grant is waiting for it

    monkeypatch.setattr(cls, "_on_message", cancel_first_on_its_grant)
    holder = await releasing.acquire()
    assert holder is not None
    first = asyncio.create_task(waiting.acquire())
    await until_queued(waiting, 1)
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
async def test_blocking_timeout_is_honoured_to_the_millisecond(
    cls: SemaphoreClass, proxied: redis.asyncio.Redis, direct: redis.asyncio.Redis, blocking_timeout: float
) -> None:
    sem = cls(proxied, "sem", 1)
    holder = await sem.acquire()
    assert holder is not None

    started = anyio.current_time()
    with anyio.fail_after(WAIT):
        permit = await sem.acquire(blocking_timeout=blocking_timeout)
    elapsed = anyio.current_time() - started

    assert permit is None
    assert blocking_timeout <= elapsed <= blocking_timeout + 0.05
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
