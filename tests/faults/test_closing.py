"""Closing closes: once a user has closed what they opened, aiosem runs nothing and holds no connection.

A user who made a semaphore over their own client, as the README does,
closes the client when done (and `aiosem.aclose()` for what aiosem made
itself): within half a second, no task of aiosem's is left and the server
sees no connection of that client -- none kept, none made again. Each test
names its client, so that the server's ``CLIENT LIST`` tells its
connections from the test's own.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import aiosem
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, SemaphoreError
from aiosem._connection import Command, PinnedConnection
from tests.harness.faults import proxied_client
from tests.harness.support import until_queued

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from contextlib import AbstractAsyncContextManager

    import redis.asyncio

    from tests.harness.proxy import TcpProxy
    from tests.harness.support import RedisServer

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: The issue's promise: within half a second of the close.
WITHIN = 0.5
#: The name of the user's client on the server.
USERS = "users-client"
#: A generous bound on the set-up: a few round trips.
BOUND = 10.0

_PACKAGE = Path(aiosem.__file__).parent


def aiosem_tasks() -> list[asyncio.Task[object]]:
    """The tasks of the running loop that run aiosem's code, at their outermost coroutine."""
    tasks = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        if code is not None and Path(code.co_filename).is_relative_to(_PACKAGE):
            tasks.append(task)
    return tasks


async def users_connections(admin: redis.asyncio.Redis) -> int:
    """How many connections of the user's client the server has."""
    return sum(1 for entry in await admin.client_list() if entry.get("name") == USERS)


async def assert_all_closed_within(admin: redis.asyncio.Redis, seconds: float) -> None:
    """Within ``seconds``: no aiosem task, and no connection of the user's client on the server."""
    deadline = anyio.current_time() + seconds
    while True:
        tasks, connections = aiosem_tasks(), await users_connections(admin)
        if not tasks and not connections:
            return
        if anyio.current_time() >= deadline:
            raise AssertionError(f"{seconds} s after the close: tasks {tasks}, {connections} connection(s)")
        await anyio.sleep(0.01)


async def assert_none_made_again(admin: redis.asyncio.Redis, seconds: float) -> None:
    """For ``seconds``, the user's client makes no connection again."""
    deadline = anyio.current_time() + seconds
    while anyio.current_time() < deadline:
        assert await users_connections(admin) == 0
        assert not aiosem_tasks()
        await anyio.sleep(0.05)


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis_server.admin_client()
    await client.flushdb()
    yield client
    await client.aclose()


async def used_after_a_wait(limited: AbstractAsyncContextManager[object], holder_sem: Semaphore) -> None:
    """Enter ``limited`` once, having waited for the permit ``holder_sem`` (another process) held first."""
    holder = await holder_sem.acquire()
    assert holder is not None

    async def body() -> None:
        async with limited:
            await asyncio.sleep(0)

    with anyio.fail_after(BOUND):
        waiting = asyncio.create_task(body())
        await until_queued(holder_sem, 1)
        assert await holder_sem.release(holder)
        await waiting
    await holder_sem.aclose()


@pytest.mark.parametrize("contended", [False, True], ids=["alone", "after-a-wait"])
async def test_closing_the_users_client_leaves_no_task_and_no_connection(
    cls: SemaphoreClass, redis_server: RedisServer, admin: redis.asyncio.Redis, contended: bool
) -> None:
    client = redis_server.client(client_name=USERS)
    if contended:
        await used_after_a_wait(cls(client, "closing", 1), cls(admin, "closing", 1))
    else:
        sem = cls(client, "closing", 1)
        async with sem:
            pass
    await aiosem.aclose()
    await client.aclose()
    await assert_all_closed_within(admin, WITHIN)
    await assert_none_made_again(admin, 1.0)


@pytest.fixture(params=[False, True], ids=["check-at-once", "slow-check"])
def slow_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the eviction-policy check a client's first call starts is slow: still under way at the close."""
    if request.param:
        batch = PinnedConnection.batch

        async def slowly(self: PinnedConnection, *commands: Command) -> list[Any]:
            if commands[0][0] == "CONFIG":
                await asyncio.sleep(0.05)
            return await batch(self, *commands)

        monkeypatch.setattr(PinnedConnection, "batch", slowly)
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("contended", [False, True], ids=["alone", "after-a-wait"])
@pytest.mark.usefixtures("slow_check")
async def test_closing_the_semaphore_leaves_no_task_and_no_connection_of_aiosems(
    cls: SemaphoreClass, redis_server: RedisServer, admin: redis.asyncio.Redis, contended: bool
) -> None:
    client = redis_server.client(client_name=USERS)
    sem = cls(client, "closing", 1)
    if contended:
        holder = await cls(admin, "closing", 1).acquire()
        assert holder is not None
        waiting = asyncio.create_task(sem.acquire())
        await until_queued(sem, 1)
        assert await cls(admin, "closing", 1).release(holder)
        with anyio.fail_after(BOUND):
            permit = await waiting
    else:
        permit = await sem.acquire()
    assert permit is not None
    assert await sem.release(permit)
    await sem.aclose()
    deadline = anyio.current_time() + WITHIN
    try:
        # The pool's idle connections are the client's own, closed with it: only aiosem's must be gone.
        # Counted afresh each time: a one-time check still under way gives its connection back to the pool.
        while aiosem_tasks() or await users_connections(admin) > len(client.connection_pool._available_connections):
            assert anyio.current_time() < deadline, (
                f"tasks {aiosem_tasks()}, {await users_connections(admin)} connections,"
                f" {len(client.connection_pool._available_connections)} idle in the pool"
            )
            await anyio.sleep(0.01)
    finally:
        # A failure here must not leave the client's connections to the next test on the server.
        await client.aclose()
    await assert_all_closed_within(admin, WITHIN)


@pytest.fixture
def held_check(monkeypatch: pytest.MonkeyPatch) -> tuple[anyio.Event, anyio.Event]:
    """Holds the eviction-policy check a client's first call starts, once it has its connection: (held, go_on)."""
    held, go_on = anyio.Event(), anyio.Event()
    batch = PinnedConnection.batch

    async def held_at_the_check(self: PinnedConnection, *commands: Command) -> list[Any]:
        if commands[0][0] == "CONFIG":
            held.set()
            await go_on.wait()
        return await batch(self, *commands)

    monkeypatch.setattr(PinnedConnection, "batch", held_at_the_check)
    return held, go_on


async def closed_with_the_check_under_way(
    limited: AbstractAsyncContextManager[object],
    close: Callable[[], Awaitable[None]],
    held_check: tuple[anyio.Event, anyio.Event],
) -> None:
    """Enter ``limited`` once, then ``close`` it while the check its first call started is held; let the check go on."""
    held, go_on = held_check
    async with limited:
        pass
    with anyio.fail_after(BOUND):
        await held.wait()
    await close()
    go_on.set()


#: What a user closes before their client: each kind of object that starts the check.
CLOSED_FIRST: dict[
    str, Callable[[redis.asyncio.Redis], AsyncFairSemaphore | AsyncLockedSemaphore | AsyncRateLimiter]
] = {
    "fair": lambda client: AsyncFairSemaphore(client, "closing", 1),
    "locked": lambda client: AsyncLockedSemaphore(client, "closing", 1),
    "rate-limiter": lambda client: AsyncRateLimiter(client, "closing", 100),
}


@pytest.mark.parametrize("kind", CLOSED_FIRST)
async def test_a_client_closed_right_after_its_object_is_never_connected_again(
    kind: str, redis_server: RedisServer, admin: redis.asyncio.Redis, held_check: tuple[anyio.Event, anyio.Event]
) -> None:
    # A check still under way after `aclose` would go on once the client was
    # closed: it connects the closed pool again, and leaves the connection
    # open there, for the garbage collector to warn about.
    client = redis_server.client(client_name=USERS)
    limited = CLOSED_FIRST[kind](client)

    async def close() -> None:
        await limited.aclose()
        await client.aclose()

    await closed_with_the_check_under_way(limited, close, held_check)
    await assert_all_closed_within(admin, WITHIN)
    await assert_none_made_again(admin, 1.0)


async def test_a_client_closed_under_the_check_alone_is_left_with_no_connection_open(
    cls: SemaphoreClass,
    redis_server: RedisServer,
    admin: redis.asyncio.Redis,
    held_check: tuple[anyio.Event, anyio.Event],
) -> None:
    # As a one-request script ends, with no `aclose` of the semaphore: the
    # check goes on once the client is closed, and the connection it opens
    # again for its command must not be left open in the closed pool.
    client = redis_server.client(client_name=USERS)
    await closed_with_the_check_under_way(cls(client, "closing", 1), client.aclose, held_check)
    await assert_all_closed_within(admin, WITHIN)
    await assert_none_made_again(admin, 1.0)


@pytest.mark.usefixtures("unconfigured")
async def test_aiosem_aclose_ends_the_check_a_first_call_started(
    redis_server: RedisServer, admin: redis.asyncio.Redis, held_check: tuple[anyio.Event, anyio.Event]
) -> None:
    aiosem.configure(url=f"{redis_server.url}?client_name={USERS}")
    await closed_with_the_check_under_way(aiosem.limiter("closing", 1), aiosem.aclose, held_check)
    await assert_all_closed_within(admin, WITHIN)
    await assert_none_made_again(admin, 1.0)


@pytest.mark.usefixtures("unconfigured")
@pytest.mark.parametrize("kind", ["fair", "locked"])
async def test_aiosem_aclose_leaves_no_task_and_no_connection_of_what_it_made(
    redis_server: RedisServer, admin: redis.asyncio.Redis, kind: str
) -> None:
    aiosem.configure(url=f"{redis_server.url}?client_name={USERS}", kind=kind)  # type: ignore[arg-type]
    await used_after_a_wait(aiosem.limiter("closing", 1), AsyncFairSemaphore(admin, "closing", 1))
    await aiosem.aclose()
    await assert_all_closed_within(admin, WITHIN)
    await assert_none_made_again(admin, 1.0)


async def test_aclose_returns_once_the_acquires_it_failed_have_left_the_queue(
    cls: SemaphoreClass, redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    # The quick start closes its client right after its semaphore: the
    # acquires `aclose` failed must have left Redis's queue by then, not have
    # their way out cut off by the client's closing (seen on Python 3.13 as a
    # warning per waiter, "could not give back what an interrupted acquire
    # took").
    client = redis_server.client(client_name=USERS)
    holder_sem = cls(admin, "left", 1)
    holder = await holder_sem.acquire()
    assert holder is not None
    sem = cls(client, "left", 1)
    acquires = [asyncio.create_task(sem.acquire()) for _ in range(3)]
    await until_queued(sem, 3)
    await sem.aclose()
    # A blocking client reads Redis as `aclose` left it: no other task runs meanwhile.
    reader = redis_server._sync_client()
    try:
        assert reader.zcard(sem._core.keys.queue) == 0
    finally:
        reader.close()
    outcomes = await asyncio.gather(*acquires, return_exceptions=True)
    assert all(isinstance(outcome, SemaphoreError) for outcome in outcomes), outcomes
    assert await holder_sem.release(holder)
    await client.aclose()


async def test_closing_while_acquires_are_cancelled_leaves_no_error_unread(
    cls: SemaphoreClass, redis_server: RedisServer, proxy: TcpProxy
) -> None:
    # Acquires whose steps are on their way when they are cancelled and their
    # object closed, as a task group cancels its tasks and `finally` closes:
    # the error `aclose` gives each waiter is read, not left to the garbage
    # collector's "Future exception was never retrieved".
    admin = redis_server.admin_client()
    await admin.flushdb()
    client = proxied_client(proxy, redis_server)
    holder_sem = cls(admin, "unread", 1)
    sem = cls(client, "unread", 1)
    try:
        warm = await sem.acquire()  # the scripts are loaded: no NOSCRIPT is held below
        assert warm is not None
        assert await sem.release(warm)
        holder = await holder_sem.acquire()
        assert holder is not None
        proxy.hold_replies(after=b"EVALSHA" if cls is AsyncFairSemaphore else b"EXEC")
        acquires = [asyncio.create_task(sem.acquire()) for _ in range(5)]
        with anyio.fail_after(BOUND):
            await proxy.wait_until(lambda: proxy.held_replies > 0)
        loop = asyncio.get_running_loop()
        unread: list[str] = []
        loop.set_exception_handler(lambda _, context: unread.append(str(context.get("message"))))
        try:
            closing = asyncio.create_task(sem.aclose())  # runs first: it fails the waiters the others then leave
            for task in acquires:
                task.cancel()
            await asyncio.sleep(0)
            proxy.release_replies()
            with anyio.fail_after(BOUND):
                await asyncio.gather(*acquires, closing, return_exceptions=True)
            del acquires, closing
            for _ in range(3):
                gc.collect()
                await asyncio.sleep(0)
        finally:
            loop.set_exception_handler(None)
        assert not [message for message in unread if "never retrieved" in message], unread
        assert await holder_sem.release(holder)
        assert await holder_sem.count() == 0
    finally:
        proxy.release_replies()
        await holder_sem.aclose()
        await client.aclose()
        await admin.aclose()
