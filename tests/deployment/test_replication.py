"""``replicas=n``: acquires and refreshes count only once n replicas have them (WAIT on the writing connection)."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

import anyio
import pytest
import redis
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, NotReplicated
from tests.harness.support import RedisServer, two_processes, until_queued

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

Semaphore = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]


@pytest.fixture
def replica_of(fresh_redis_server: RedisServer, redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    """A replica of ``fresh_redis_server``, in sync before the test starts."""
    directory = tmp_path / "replica"
    directory.mkdir()
    with redis.Redis(host=fresh_redis_server.host, port=fresh_redis_server.port) as admin:
        admin.config_set("repl-diskless-sync-delay", 0)  # the default waits 5 s for more replicas
    replica = RedisServer(redis_binary, directory, "--replicaof", fresh_redis_server.host, str(fresh_redis_server.port))
    replica.start()
    probe = redis.Redis(host=replica.host, port=replica.port, socket_timeout=5)
    try:
        deadline = time.monotonic() + 20
        while probe.info("replication")["master_link_status"] != "up":
            assert time.monotonic() < deadline, "the replica did not sync in 20 s"
            time.sleep(0.02)
        yield replica
    finally:
        probe.close()
        replica.stop()


@pytest.fixture
async def master(fresh_redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = fresh_redis_server.client()
    yield client
    await client.aclose()


@pytest.fixture
async def replica(replica_of: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = replica_of.client()
    yield client
    await client.aclose()


async def test_a_permit_is_on_the_replica_when_acquire_returns(
    master: redis.asyncio.Redis, replica: redis.asyncio.Redis, cls: Semaphore
) -> None:
    semaphore = cls(master, "db", 2, replicas=1)
    for _ in range(20):
        permit = await semaphore.acquire()
        assert permit is not None
        # Read at once from the replica: WAIT returned only once it had the grant.
        assert await replica.zscore(f"{permit.key}:owner", permit.identifier) == permit.fencing_token
        assert await semaphore.release(permit)
    await semaphore.aclose()


async def test_a_permit_handed_over_is_on_the_replica_when_the_waiter_returns(
    fresh_redis_server: RedisServer, replica: redis.asyncio.Redis, cls: Semaphore
) -> None:
    async with two_processes(fresh_redis_server.client, cls, "db", 1, replicas=1) as (holder, waiter):
        permit = await holder.acquire()
        assert permit is not None
        waiting = asyncio.create_task(waiter.acquire(blocking_timeout=20))
        await until_queued(holder)
        assert await holder.release(permit)
        with anyio.fail_after(10):
            handed = await waiting
        assert handed is not None
        assert await replica.zscore(f"{handed.key}:owner", handed.identifier) == handed.fencing_token
        assert await waiter.release(handed)


async def test_a_weighted_permit_granted_by_a_raised_limit_is_on_the_replica_when_the_waiter_returns(
    fresh_redis_server: RedisServer, replica: redis.asyncio.Redis, cls: Semaphore
) -> None:
    async with two_processes(fresh_redis_server.client, cls, "db", 4, replicas=1) as (holder, waiter):
        permit = await holder.acquire(weight=3)
        assert permit is not None
        waiting = asyncio.create_task(waiter.acquire(weight=2, blocking_timeout=20))
        await until_queued(holder)
        assert await holder.set_limit(5) == 4
        with anyio.fail_after(10):
            handed = await waiting
        assert handed is not None
        assert handed.weight == 2
        # The weight, the grant and the limit set reached the replica before the waiter returned.
        assert await replica.zscore(f"{handed.key}:owner", handed.identifier) == handed.fencing_token
        assert await replica.get(f"{handed.key}:weight") == b"3"  # 3 - 1 and 2 - 1
        assert await replica.get(f"{handed.key}:limit") == b"=5"
        assert await waiter.release(handed)
        assert await holder.release(permit)
        assert await holder.set_limit(None) == 5


async def test_without_the_replicas_an_acquire_raises_and_takes_nothing(
    real_client: redis.asyncio.Redis, cls: Semaphore
) -> None:
    name = f"lonely-{secrets.token_hex(4)}"
    semaphore = cls(real_client, name, 2, replicas=1, waiter_timeout=0.2)
    with pytest.raises(NotReplicated, match=r"reached 0 of the 1 replica\(s\) it waits for") as raised:
        await semaphore.acquire()
    assert (raised.value.name, raised.value.replicas, raised.value.acknowledged) == (name, 1, 0)
    assert await semaphore.count() == 0
    await semaphore.aclose()


async def test_without_the_replicas_a_refresh_raises(real_client: redis.asyncio.Redis, cls: Semaphore) -> None:
    name = f"lonely-{secrets.token_hex(4)}"
    taker = cls(real_client, name, 2)
    permit = await taker.acquire()
    assert permit is not None
    waiting_for_one = cls(real_client, name, 2, replicas=1, waiter_timeout=0.2)
    with pytest.raises(NotReplicated):
        await waiting_for_one.refresh(permit)
    assert await taker.release(permit)
    for semaphore in (taker, waiting_for_one):
        await semaphore.aclose()


def test_replicas_is_checked(real_client: redis.asyncio.Redis, cls: Semaphore) -> None:
    with pytest.raises(ValueError, match="replicas must not be negative, got -2"):
        cls(real_client, "db", 1, replicas=-2)
    with pytest.raises(TypeError, match="replicas must be an int, not float"):
        cls(real_client, "db", 1, replicas=1.0)  # type: ignore[arg-type]
    assert cls(real_client, "db", 1, replicas=2).replicas == 2
