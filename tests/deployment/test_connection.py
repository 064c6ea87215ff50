"""The pinned connection that Lua-free steps write whole batches to."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import pytest
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._connection import Command, PinnedConnection
from tests.harness.support import until_queued

if TYPE_CHECKING:
    from tests.harness.support import RedisServer

COMMANDS: list[Command] = [
    ("SET", "aiosem:{café}:lock", "e0f1", "NX", "PX", 1000),
    ("ZADD", "aiosem:{café}", "1700000000.123456", b"\x00\xff member"),
    ("ZRANGE", "k", 0, -1, "WITHSCORES"),
    ("INCRBY", "k", 10**20),
    ("ZADD", "k", -1.25e-7, "m"),
    ("TIME",),
]


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
