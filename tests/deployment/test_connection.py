"""The pinned connection that Lua-free steps write whole batches to."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import anyio
import pytest
import redis
import redis.asyncio
from redis.exceptions import ResponseError

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._connection import Command, PinnedConnection, pinned_connection
from tests.harness.support import until_queued

if TYPE_CHECKING:
    from typing import Any

    from tests.harness.proxy import TcpProxy
    from tests.harness.support import RedisServer

COMMANDS: list[Command] = [
    ("SET", "aiosem:{café}:lock", "e0f1", "NX", "PX", 1000),
    ("ZADD", "aiosem:{café}", "1700000000.123456", b"\x00\xff member"),
    ("ZRANGE", "k", 0, -1, "WITHSCORES"),
    ("INCRBY", "k", 10**20),
    ("ZADD", "k", -1.25e-7, "m"),
    ("TIME",),
]


#: Clients of the unrestricted user (these tests send commands no semaphore sends), made as users
#: make them, with the socket timeout redis-py 8 and `aiosem.configure` set: a batch is read under
#: one timeout, RESP2 and RESP3 alike; with health checks or without a timeout, as redis-py reads.
CLIENTS: dict[str, dict[str, Any]] = {
    "RESP2": {"socket_timeout": 5, "protocol": 2},
    "RESP3": {"socket_timeout": 5, "protocol": 3},
    "health checks": {"socket_timeout": 5, "health_check_interval": 30},
    "no socket timeout": {"socket_timeout": None},
}
BOUND = 5.0


@pytest.fixture(params=list(CLIENTS))
def client_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    options: dict[str, Any] = CLIENTS[request.param]
    return options


async def test_a_batch_reads_every_reply_before_it_raises_the_first_error(
    redis_server: RedisServer, client_options: dict[str, Any]
) -> None:
    client = redis_server.admin_client(**client_options)
    try:
        async with pinned_connection(client, "batch-errors") as connection:
            with pytest.raises(ResponseError, match="not an integer"):
                await connection.batch(("SET", "batch-errors", "a"), ("INCR", "batch-errors"), ("ECHO", "after"))
            # In step with the server: the next batch reads its own replies.
            assert await connection.batch(("GET", "batch-errors"), ("ECHO", "next")) == [b"a", b"next"]
    finally:
        await client.aclose()


@pytest.mark.skipif(
    tuple(int(part) for part in redis.__version__.split(".")[:2]) < (6, 2),
    reason="before 6.2, redis-py's hiredis parser returns a RESP3 push message as a reply, to its own commands too",
)
async def test_a_batch_hears_replies_past_a_resp3_push_message(redis_server: RedisServer) -> None:
    client = redis_server.admin_client(socket_timeout=5, protocol=3)
    writer = redis_server.admin_client()
    try:
        async with pinned_connection(client, "pushed") as connection:
            assert await connection.batch(("CLIENT", "TRACKING", "ON"), ("GET", "pushed")) == [b"OK", None]
            await writer.set("pushed", "changed")  # an invalidation is pushed to the tracking connection
            assert await connection.batch(("ECHO", "a"), ("ECHO", "b")) == [b"a", b"b"]
    finally:
        await client.aclose()
        await writer.aclose()


@pytest.mark.parametrize("shape", ["RESP2", "RESP3", "health checks"])
async def test_a_batch_whose_replies_stall_past_the_socket_timeout_raises_and_closes_its_connection(
    proxy: TcpProxy, shape: str
) -> None:
    client = redis.asyncio.Redis(host=proxy.host, port=proxy.port, **{**CLIENTS[shape], "socket_timeout": 0.3})
    try:
        async with pinned_connection(client, "stalled") as connection:
            assert await connection.batch(("ECHO", "warm")) == [b"warm"]
            proxy.hold_replies()
            with anyio.fail_after(BOUND), pytest.raises(redis.TimeoutError):
                await connection.batch(("ECHO", "a"), ("ECHO", "b"))
            assert not connection._connection.is_connected
    finally:
        proxy.release_replies()
        await client.aclose()


@pytest.mark.skipif(
    not hasattr(redis.asyncio.Connection, "update_current_socket_timeout"),
    reason="this redis-py relaxes no read's timeout (maintenance notifications came in redis-py 7)",
)
async def test_a_batch_whose_read_redis_py_relaxes_waits_past_the_socket_timeout(proxy: TcpProxy) -> None:
    # redis-py relaxes the timeout of the read under way when the server announces a maintenance.
    client = redis.asyncio.Redis(host=proxy.host, port=proxy.port, socket_timeout=0.3)
    try:
        async with pinned_connection(client, "relaxed") as connection:
            assert await connection.batch(("ECHO", "warm")) == [b"warm"]
            proxy.hold_replies()
            reading = asyncio.create_task(connection.batch(("ECHO", "a"), ("ECHO", "b")))
            with anyio.fail_after(BOUND):
                await proxy.wait_until(lambda: proxy.held_replies > 0)
            connection._connection.update_current_socket_timeout(BOUND)  # type: ignore[attr-defined,unused-ignore]
            await asyncio.sleep(0.6)  # twice the socket timeout
            assert not reading.done()
            proxy.release_replies()
            with anyio.fail_after(BOUND):
                assert await reading == [b"a", b"b"]
    finally:
        proxy.release_replies()
        await client.aclose()


@pytest.mark.parametrize("shape", ["RESP2", "RESP3", "health checks"])
@pytest.mark.parametrize(
    ("interruption", "raised"), [("cancelled", asyncio.CancelledError), ("dropped", redis.ConnectionError)]
)
async def test_a_batch_interrupted_while_it_reads_raises_and_closes_its_connection(
    proxy: TcpProxy, shape: str, interruption: str, raised: type[BaseException]
) -> None:
    # A read cut short leaves replies unread: the connection must never serve another batch.
    client = redis.asyncio.Redis(host=proxy.host, port=proxy.port, **CLIENTS[shape])
    try:
        async with pinned_connection(client, interruption) as connection:
            assert await connection.batch(("ECHO", "warm")) == [b"warm"]
            proxy.hold_replies()
            reading = asyncio.create_task(connection.batch(("ECHO", "a"), ("ECHO", "b")))
            with anyio.fail_after(BOUND):
                await proxy.wait_until(lambda: proxy.held_replies > 0)
            if interruption == "cancelled":
                reading.cancel()
            else:
                proxy.drop()
            with anyio.fail_after(BOUND), pytest.raises(raised):
                await reading
            assert not connection._connection.is_connected
    finally:
        proxy.release_replies()
        await client.aclose()


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_a_batch_is_packed_exactly_as_redis_py_packs_it(encoding: str) -> None:
    connection = redis.asyncio.Connection(encoding=encoding)
    packed = PinnedConnection(connection)._pack(COMMANDS)
    assert b"".join(packed) == b"".join(connection.pack_commands(COMMANDS))


async def test_a_client_with_another_encoding_stores_its_keys_in_that_encoding(redis_server: RedisServer) -> None:
    client = redis.asyncio.Redis(host=redis_server.host, port=redis_server.port, encoding="latin-1")
    sem = AsyncLockedSemaphore(client, "encoded-café", 1)
    permit = await sem.acquire()
    assert permit is not None
    assert await client.exists("aiosem:{encoded-café}:owner".encode("latin-1")) == 1
    assert await client.exists("aiosem:{encoded-café}:owner".encode()) == 0
    assert await sem.release(permit)
    await client.aclose()


async def test_a_server_that_will_not_tell_its_eviction_policy_is_used_without_a_warning(
    fresh_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = fresh_redis_server.admin_client()
    await admin.config_set("maxmemory", 1 << 30)
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    # A user without CONFIG, as on managed services: the check is skipped, not failed.
    await admin.acl_setuser(
        "app", enabled=True, passwords=["+app"], keys=["*"], channels=["*"], commands=["+@all", "-config"]
    )
    client = fresh_redis_server.client(username="app", password="app")
    with caplog.at_level(logging.DEBUG, logger="aiosem"):
        sem = AsyncFairSemaphore(client, "policy", 1)
        permit = await sem.acquire()
        assert permit is not None
        assert await sem.release(permit)
        await sem.aclose()
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert any("could not read the eviction policy" in record.getMessage() for record in caplog.records)
    await client.aclose()
    await admin.aclose()


async def test_a_client_with_another_encoding_is_woken_by_message(redis_server: RedisServer) -> None:
    waiter_client, holder_client = (
        redis.asyncio.Redis(host=redis_server.host, port=redis_server.port, encoding="latin-1") for _ in range(2)
    )
    # Re-checks every 10 s: a waiter woken sooner was woken by its channel, named in latin-1.
    waiter_side = AsyncFairSemaphore(waiter_client, "woken-café", 1, timeout=60, waiter_timeout=30)
    holder_side = AsyncFairSemaphore(holder_client, "woken-café", 1, timeout=60, waiter_timeout=30)
    held = await holder_side.acquire()
    assert held is not None
    waiting = asyncio.create_task(waiter_side.acquire(blocking_timeout=5))
    try:
        await until_queued(holder_side)
        await holder_side.release(held)
        permit = await waiting
        assert permit is not None
        await waiter_side.release(permit)
    finally:
        await waiter_side.aclose()
        await waiter_client.aclose()
        await holder_client.aclose()
