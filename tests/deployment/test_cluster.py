"""Redis Cluster: one slot per semaphore, sharded wake-ups, and slots that move under a semaphore in use.

Everything runs on three real cluster masters (`tests.harness.topology.RedisClusterGroup`),
shared by the session: each test uses names of its own, and a test that
moves a slot leaves the cluster settled.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import TYPE_CHECKING

import anyio
import pytest
import redis.asyncio
from redis.asyncio.client import PubSub
from redis.crc import key_slot

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter
from aiosem._keys import SemaphoreKeys
from aiosem._scripts import FAIR_ACQUIRE
from tests.harness.support import two_processes, until_queued

if TYPE_CHECKING:
    from redis.asyncio.cluster import RedisCluster

    from tests.harness.support import RedisServer
    from tests.harness.topology import RedisClusterGroup

Semaphore = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]


def unique(stem: str) -> str:
    return f"{stem}-{secrets.token_hex(4)}"


def slot_of(name: str) -> int:
    return key_slot(SemaphoreKeys.for_name("aiosem", name).base.encode())


def another_node(cluster: RedisClusterGroup, slot: int) -> RedisServer:
    owner = cluster.node_for_slot(slot)
    return next(node for node in cluster.nodes if node is not owner)


def test_every_key_and_channel_of_a_semaphore_hashes_to_one_slot() -> None:
    keys = SemaphoreKeys.for_name("aiosem", "db {shard} }{ *")
    names = [*keys.fair, keys.rate, keys.lock, keys.channels + "0123abcd"]
    assert len({key_slot(name.encode()) for name in names}) == 1


async def test_semaphores_spread_over_every_node_and_each_works(
    cluster_client: RedisCluster, redis_cluster: RedisClusterGroup, cls: Semaphore
) -> None:
    names = [unique("spread") for _ in range(24)]
    owners = {redis_cluster.node_for_slot(slot_of(name)).port for name in names}
    assert len(owners) == 3  # 24 random names all on fewer nodes: 3 * (2/3)^24, about 2e-4
    for name in names:
        semaphore = cls(cluster_client, name, 2, timeout=5)
        async with semaphore as permit:
            assert await semaphore.count() == 1
            assert permit.identifier in await semaphore.holders()
        assert await semaphore.count() == 0
        await semaphore.aclose()


async def test_a_waiter_of_another_client_is_woken_by_sharded_pub_sub(
    redis_cluster: RedisClusterGroup, cls: Semaphore
) -> None:
    # Re-checks every 20 s at the earliest, and a lease of a minute: a waiter
    # that gets the permit within 5 s was woken by the grant's message.
    async with two_processes(redis_cluster.client, cls, unique("wake"), 1, timeout=60, waiter_timeout=60) as pair:
        holder, waiter = pair
        permit = await holder.acquire()
        assert permit is not None
        waiting = asyncio.create_task(waiter.acquire(blocking_timeout=30))
        await until_queued(holder)
        await holder.release(permit)
        with anyio.fail_after(5):
            handed = await waiting
        assert handed is not None
        assert await waiter.release(handed)


async def test_a_weighted_waiter_of_another_client_is_woken_by_a_raised_limit(
    redis_cluster: RedisClusterGroup, cls: Semaphore
) -> None:
    # As above: only the raise's own step, and its message, can grant within 5 s.
    name = unique("weighted")
    async with two_processes(redis_cluster.client, cls, name, 4, timeout=60, waiter_timeout=60) as pair:
        holder, waiter = pair
        permit = await holder.acquire(weight=3)
        assert permit is not None
        waiting = asyncio.create_task(waiter.acquire(weight=3, blocking_timeout=30))
        await until_queued(holder)
        assert await holder.set_limit(6) == 4
        with anyio.fail_after(5):
            handed = await waiting
        assert handed is not None
        assert handed.weight == 3
        assert await holder.count() == 6
        assert await waiter.release(handed)
        assert await holder.release(permit)
        assert await holder.set_limit(None) == 6


async def test_a_semaphore_keeps_working_while_its_slot_moves_to_another_node(
    redis_cluster: RedisClusterGroup, cls: Semaphore
) -> None:
    name = unique("moving")
    slot = slot_of(name)
    async with two_processes(redis_cluster.client, cls, name, 1, timeout=6, waiter_timeout=1.5) as (holder, waiter):
        async with holder as permit:
            waiting = asyncio.create_task(waiter.acquire(blocking_timeout=30))
            await until_queued(holder)
            target = another_node(redis_cluster, slot)
            await anyio.to_thread.run_sync(redis_cluster.move_slot, slot, target)
            assert redis_cluster.node_for_slot(slot) is target
            # Held through the move and kept alive on the new node: a full
            # lease later it is still held.
            await asyncio.sleep(holder.timeout)
            assert permit.identifier in await holder.holders()
        # Handed to the waiter on the new node, woken by its new subscription
        # or at the latest by its next re-check.
        with anyio.fail_after(10):
            handed = await waiting
        assert handed is not None
        assert handed.fencing_token > permit.fencing_token
        assert await waiter.release(handed)
        assert await waiter.count() == 0


async def test_a_step_sent_while_the_slot_is_half_moved_completes_once_it_settles(
    redis_cluster: RedisClusterGroup, cluster_client: RedisCluster, cls: Semaphore
) -> None:
    name = unique("half-moved")
    slot = slot_of(name)
    semaphore = cls(cluster_client, name, 2, timeout=10)
    first = await semaphore.acquire()
    assert first is not None
    target = another_node(redis_cluster, slot)
    await anyio.to_thread.run_sync(redis_cluster.begin_migration, slot, target)
    try:
        await anyio.to_thread.run_sync(redis_cluster.migrate_keys, slot, target)
        # The keys are on the target, the slot still on its owner: the owner
        # answers ASK. The step goes there or waits for the move to settle.
        second = asyncio.create_task(semaphore.acquire(blocking=False))
        await asyncio.sleep(0.2)
    finally:
        await anyio.to_thread.run_sync(redis_cluster.finish_migration, slot, target)
    with anyio.fail_after(10):
        permit = await second
    assert permit is not None
    assert permit.fencing_token > first.fencing_token
    assert set(await semaphore.holders()) == {first.identifier, permit.identifier}
    for held in (first, permit):
        assert await semaphore.release(held)
    await semaphore.aclose()


async def test_scripts_are_loaded_again_on_the_node_a_slot_moved_to(
    redis_cluster: RedisClusterGroup, cluster_client: RedisCluster
) -> None:
    name = unique("scripts")
    slot = slot_of(name)
    semaphore = AsyncFairSemaphore(cluster_client, name, 1, timeout=10)
    permit = await semaphore.acquire()
    assert permit is not None
    target = another_node(redis_cluster, slot)
    admin = redis.asyncio.Redis(host=target.host, port=target.port)
    try:
        await admin.script_flush()
        await anyio.to_thread.run_sync(redis_cluster.move_slot, slot, target)
        assert await semaphore.release(permit)  # NOSCRIPT on the new node, then EVAL
        assert await admin.script_exists(FAIR_ACQUIRE.sha) == [False]
        assert await semaphore.acquire(blocking=False) is not None
        assert await admin.script_exists(FAIR_ACQUIRE.sha) == [True]
    finally:
        await semaphore.aclose()
        await admin.aclose()


async def test_a_rate_limiter_spaces_calls_on_the_cluster(cluster_client: RedisCluster) -> None:
    limiter = AsyncRateLimiter(cluster_client, unique("rate"), 20, 1.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(5):
        await limiter.acquire()
    # Four gaps of 50 ms at the least, on the node's clock.
    assert loop.time() - started >= 0.19


def test_a_cluster_client_needs_sharded_pub_sub_from_redis_py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(PubSub, "ssubscribe", raising=False)
    client = redis.asyncio.RedisCluster(host="127.0.0.1", port=7000)
    with pytest.raises(RuntimeError, match=r"Redis Cluster needs redis-py 8\.0 or later"):
        AsyncFairSemaphore(client, "db", 3)
