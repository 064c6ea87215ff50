"""The connection a lane's flusher lets go of waits, parked, for the next flusher of its event loop.

A lone caller -- a web request, a crawler's fetch -- starts a flusher for
each of its steps; without the park each borrowed a connection from the
pool and gave it back. These tests use clients made as users make them
(redis-py 8's socket timeout, the unrestricted or the suite's user), and
read the pool's bookkeeping to see where the connection is.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, _connection
from aiosem._connection import PARKED_FOR, PARKED_PER_POOL
from tests.harness.support import until_one_time_checks_done

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import redis.asyncio

    from tests.harness.support import RedisServer

#: Far more than anything that is going to happen on an idle loop needs.
BOUND = 5.0
CLIENT_NAME = "parked-test"


def borrows_by_lanes(client: redis.asyncio.Redis) -> list[int]:
    """Count, from now on, the connections the semaphores' lanes borrow from ``client``'s pool."""
    pool = client.connection_pool
    borrow = pool.get_connection
    borrowed = [0]

    async def counted(*args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        if task is not None and task.get_name() == "aiosem lane":
            borrowed[0] += 1
        return await borrow(*args, **kwargs)  # type: ignore[no-untyped-call]

    pool.get_connection = counted  # type: ignore[method-assign]
    return borrowed


def out_of_the_pool(client: redis.asyncio.Redis) -> int:
    return len(client.connection_pool._in_use_connections)


def the_parked_connection() -> AbstractConnection:
    """The one connection parked in the running event loop."""
    parks = _connection._parks[asyncio.get_running_loop()]._parked.values()
    (parked,) = [connection for parked in parks for connection, _ in parked]
    return parked


async def named_connections(admin: redis.asyncio.Redis) -> set[str]:
    """The ids of the server's connections named `CLIENT_NAME`."""
    return {entry["id"] for entry in await admin.client_list() if entry["name"] == CLIENT_NAME}


async def cycle(sem: AsyncFairSemaphore | AsyncLockedSemaphore) -> None:
    permit = await sem.acquire()
    assert permit is not None
    assert await sem.release(permit)


async def first_cycle(sem: AsyncFairSemaphore | AsyncLockedSemaphore) -> None:
    """A cycle, and the one-time checks it started in the background ended: they borrow from the pool too."""
    await cycle(sem)
    await until_one_time_checks_done()


@pytest.fixture(params=[AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
def cls(request: pytest.FixtureRequest) -> type[AsyncFairSemaphore | AsyncLockedSemaphore]:
    kind: type[AsyncFairSemaphore | AsyncLockedSemaphore] = request.param
    return kind


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A client as users make them, with redis-py 8's socket timeout."""
    client = redis_server.client(socket_timeout=5)
    yield client
    await client.aclose()


async def test_a_lone_callers_steps_borrow_one_connection_from_the_pool(
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore], client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "parked", 1)
    await first_cycle(sem)
    borrowed = borrows_by_lanes(client)

    for _ in range(5):
        await cycle(sem)

    assert borrowed[0] <= 1


async def test_a_parked_connection_goes_back_to_its_pool_once_idle(client: redis.asyncio.Redis) -> None:
    await first_cycle(AsyncFairSemaphore(client, "parked", 1))
    assert out_of_the_pool(client) == 1

    await asyncio.sleep(PARKED_FOR)
    with anyio.fail_after(BOUND):
        while out_of_the_pool(client):  # noqa: ASYNC110 -- the pool's bookkeeping, not an event of ours
            await asyncio.sleep(0.01)


async def test_a_connection_parked_again_at_every_step_stays_out_of_the_pool_while_steps_come(
    client: redis.asyncio.Redis,
) -> None:
    # Its time in the park counts from its last park, not its first: a
    # steady caller's steps, PARKED_FOR / 10 apart, never borrow again.
    sem = AsyncFairSemaphore(client, "parked", 1)
    await first_cycle(sem)
    borrowed = borrows_by_lanes(client)

    for _ in range(30):
        await cycle(sem)
        await asyncio.sleep(PARKED_FOR / 10)

    assert borrowed[0] <= 1


async def test_a_parked_connection_the_server_closed_is_not_used_again(
    redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    # No retries: a step written to the closed connection would fail, not be tried again.
    client = redis_server.client(socket_timeout=5, client_name=CLIENT_NAME, retry=Retry(NoBackoff(), 0))
    try:
        sem = AsyncFairSemaphore(client, "parked", 1)
        await first_cycle(sem)
        parked = the_parked_connection()
        killed = await named_connections(admin_client)
        assert killed
        for identifier in killed:
            await admin_client.client_kill_filter(_id=identifier)
        # Until the end of the connection reaches the client, as a pool's own check needs it to.
        with anyio.fail_after(BOUND):
            while parked._reader is None or not parked._reader.at_eof():  # noqa: ASYNC110 -- the kernel's news
                await asyncio.sleep(0.001)

        await cycle(sem)
    finally:
        await client.aclose()


@pytest.mark.skipif(not hasattr(AbstractConnection, "mark_for_reconnect"), reason="redis-py 8 marks connections")
async def test_a_parked_connection_marked_for_a_reconnect_is_reconnected_before_the_next_step(
    redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    client = redis_server.client(socket_timeout=5, client_name=CLIENT_NAME)
    try:
        sem = AsyncFairSemaphore(client, "parked", 1)
        await first_cycle(sem)
        parked = the_parked_connection()
        await client.connection_pool.disconnect(inuse_connections=False)  # all but the parked one
        before = await named_connections(admin_client)

        parked.mark_for_reconnect()  # type: ignore[no-untyped-call]  # as redis-py 8 does when a move is announced
        await cycle(sem)

        after = await named_connections(admin_client)
        assert not parked.should_reconnect()  # type: ignore[no-untyped-call]
        assert after
        assert not after & before
    finally:
        await client.aclose()


async def test_closing_a_semaphore_gives_its_parked_connection_back_at_once(
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore], client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "parked", 1)
    await first_cycle(sem)

    await sem.aclose()

    assert out_of_the_pool(client) == 0


async def test_closing_a_rate_limiter_gives_its_parked_connection_back_at_once(client: redis.asyncio.Redis) -> None:
    limiter = AsyncRateLimiter(client, "parked", 100, burst=10)
    assert await limiter.try_acquire()
    await until_one_time_checks_done()
    assert out_of_the_pool(client) == 1

    await limiter.aclose()

    assert out_of_the_pool(client) == 0
    assert await limiter.try_acquire()


def test_the_event_loops_shutdown_gives_the_parked_connection_back(redis_server: RedisServer) -> None:
    client = redis_server.client(socket_timeout=5)

    async def main() -> None:
        await first_cycle(AsyncFairSemaphore(client, "parked", 1))
        assert out_of_the_pool(client) == 1

    # What asyncio.run does, with a look between closing the loop's async generators and closing it.
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
        loop.run_until_complete(loop.shutdown_asyncgens())

        assert out_of_the_pool(client) == 0
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


async def test_flushers_ending_at_once_park_two_connections_and_give_the_others_back(
    client: redis.asyncio.Redis,
) -> None:
    semaphores = [AsyncFairSemaphore(client, f"parked-{index}", 1) for index in range(PARKED_PER_POOL + 2)]
    await first_cycle(semaphores[0])

    await asyncio.gather(*(cycle(sem) for sem in semaphores))

    assert out_of_the_pool(client) == PARKED_PER_POOL


async def test_a_bounded_pool_keeps_a_connection_for_the_application_past_the_park(
    redis_server: RedisServer,
) -> None:
    # A pool that does not block refuses a connection past its bound ("Too
    # many connections"): two parked would have taken both of its two.
    client = redis_server.client(socket_timeout=5, max_connections=2)
    try:
        first, second = AsyncFairSemaphore(client, "parked-1", 1), AsyncFairSemaphore(client, "parked-2", 1)
        await first_cycle(first)

        await asyncio.gather(cycle(first), cycle(second))

        assert out_of_the_pool(client) == 1
        assert await client.ping()
    finally:
        await client.aclose()


async def test_an_objects_acquires_and_releases_taking_turns_borrow_no_connection_while_steps_come(
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore], client: redis.asyncio.Redis
) -> None:
    # Each holder keeps its permit a loop pass, as a request's handler does:
    # the acquires' flusher and the releases' end and start one after the
    # other, and each finds a connection parked by the last.
    sem = cls(client, "parked", 2)
    await first_cycle(sem)

    async def holder() -> None:
        for _ in range(10):
            permit = await sem.acquire()
            assert permit is not None
            await asyncio.sleep(0)
            assert await sem.release(permit)

    async def steps() -> None:
        await asyncio.gather(*(holder() for _ in range(4)))

    with anyio.fail_after(BOUND):
        await steps()  # the waiting's one-time set-up: its channel, its subscription
    borrowed = borrows_by_lanes(client)
    with anyio.fail_after(BOUND):
        await steps()

    assert borrowed[0] <= 1


def test_a_park_left_by_a_loop_closed_without_its_shutdown_is_forgotten_by_the_next_loop(
    redis_server: RedisServer,
) -> None:
    async def used_then_closed() -> None:
        # A client never crosses event loops: each loop has its own.
        client = redis_server.client(socket_timeout=5)
        await first_cycle(AsyncFairSemaphore(client, "parked", 1))
        await client.aclose()

    abandoned = asyncio.new_event_loop()
    abandoned.run_until_complete(used_then_closed())
    abandoned.close()  # as a program that never closes its loop's async generators
    assert abandoned in _connection._parks

    asyncio.run(used_then_closed())

    assert abandoned not in _connection._parks


async def test_a_borrow_interrupted_while_it_checks_a_parked_connection_gives_the_connection_back(
    client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step's bound, or the loop's shutdown, may cancel a flusher as it checks the connection it took out of
    # the park: the pool must get the connection back, closed, since nobody knows what it holds.
    await first_cycle(AsyncFairSemaphore(client, "parked", 1))
    parked = the_parked_connection()
    checking, never = asyncio.Event(), asyncio.Event()

    async def stuck() -> bool:
        checking.set()
        await never.wait()
        return False

    for check in ("can_read", "can_read_destructive"):  # redis-py 8's name, and the older one
        if hasattr(parked, check):
            monkeypatch.setattr(parked, check, stuck)
    borrow = asyncio.create_task(_connection._borrow(client.connection_pool, parked=True))
    with anyio.fail_after(BOUND):
        await checking.wait()
    borrow.cancel()

    with pytest.raises(asyncio.CancelledError):
        await borrow
    assert out_of_the_pool(client) == 0
    assert not parked.is_connected
