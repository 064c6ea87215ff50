"""The test topologies themselves: a Redis Cluster that moves slots, a Sentinel group that fails over."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import pytest
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError

from tests.harness.topology import RedisClusterGroup, SentinelGroup, _wait_for

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import redis.asyncio

    from tests.harness.support import RedisServer

T = TypeVar("T")

#: How long a client may take to find the new master after a failover.
RECOVERY = 15.0


@pytest.fixture
def cluster(redis_cluster: RedisClusterGroup) -> RedisClusterGroup:
    """The session's cluster: the tests below leave it settled."""
    return redis_cluster


async def eventually(operation: Callable[[], Awaitable[T]]) -> T:
    """``operation``, retried while a client finds its master gone or demoted, for at most `RECOVERY` s."""
    with anyio.fail_after(RECOVERY):
        while True:
            try:
                return await operation()
            except (RedisConnectionError, ReadOnlyError):  # noqa: PERF203 -- retrying is the point
                await anyio.sleep(0.05)


async def command(client: redis.asyncio.Redis, *args: Any) -> Any:
    """The raw reply of ``args``."""
    return await client.execute_command(*args)  # type: ignore[no-untyped-call]  # untyped in redis-py


def key_on(cluster: RedisClusterGroup, node: RedisServer, prefix: str) -> str:
    """The first ``<prefix>-<n>`` whose slot ``node`` owns."""
    for n in range(1000):
        key = f"{prefix}-{n}"
        if cluster.node_for_slot(key_slot(key.encode())) is node:
            return key
    raise AssertionError(f"no key for node {node.port}")


def pairs(flat: list[Any]) -> dict[str, Any]:
    """``[k1, v1, k2, v2, ...]`` (a RESP2 map) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


async def slot_owners_seen_by(node: RedisServer, slot: int) -> tuple[int, int]:
    """The port owning ``slot`` according to ``node``'s ``CLUSTER SHARDS`` and ``CLUSTER SLOTS``."""
    async with node.client(protocol=2, decode_responses=True) as direct:
        shards = [pairs(shard) for shard in await command(direct, "CLUSTER", "SHARDS")]
        slots = await command(direct, "CLUSTER", "SLOTS")
    by_shards = {
        int(pairs(shard["nodes"][0])["port"])
        for shard in shards
        if any(first <= slot <= last for first, last in zip(shard["slots"][::2], shard["slots"][1::2], strict=True))
    }
    by_slots = {int(owner[1]) for first, last, owner, *_ in slots if first <= slot <= last}
    assert len(by_shards) == len(by_slots) == 1
    return by_shards.pop(), by_slots.pop()


def test_a_wait_that_runs_out_says_what_it_waited_for_and_what_it_saw() -> None:
    with pytest.raises(TimeoutError, match=r"^replica in sync: not reached within 0\.1 s; last seen: link down$"):
        _wait_for(lambda: "link down", 0.1, "replica in sync")


# --------------------------------------------------------------------------------------------- cluster


@pytest.mark.slow
async def test_a_cluster_client_reads_and_writes_keys_on_every_node(cluster: RedisClusterGroup) -> None:
    assert cluster.url == "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in cluster.nodes)
    assert len({cluster.node_id(node) for node in cluster.nodes}) == 3
    keys = {node.port: key_on(cluster, node, "spread") for node in cluster.nodes}
    async with cluster.client() as client:
        for port, key in keys.items():
            assert await client.set(key, port)
        for port, key in keys.items():
            assert await client.get(key) == str(port).encode()
    for node in cluster.nodes:
        async with node.client() as direct:
            assert await direct.get(keys[node.port]) == str(node.port).encode()


@pytest.mark.slow
async def test_a_moved_slot_takes_its_keys_to_the_new_owner(cluster: RedisClusterGroup) -> None:
    slot = key_slot(b"moving")
    source = cluster.node_for_slot(slot)
    target = next(node for node in cluster.nodes if node is not source)
    async with cluster.client() as client:
        await client.set("{moving}:a", "1")
        await client.set("{moving}:b", "2")
        cluster.move_slot(slot, target)
        # The old client's slot table is stale: MOVED sends it to the new owner.
        assert await client.get("{moving}:a") == b"1"
    assert cluster.node_for_slot(slot) is target
    async with cluster.client() as fresh:
        assert await fresh.mget("{moving}:a", "{moving}:b") == [b"1", b"2"]
    for node in cluster.nodes:
        assert await slot_owners_seen_by(node, slot) == (target.port, target.port)
    with pytest.raises(ValueError, match=rf"slot {slot} is on node {target.port} already"):
        cluster.begin_migration(slot, target)


@pytest.mark.slow
async def test_a_slot_can_be_held_half_migrated(cluster: RedisClusterGroup) -> None:
    slot = key_slot(b"half")
    source = cluster.node_for_slot(slot)
    target = next(node for node in cluster.nodes if node is not source)
    async with cluster.client() as client:
        await client.set("{half}:old", "before")
        cluster.begin_migration(slot, target)
        async with source.client(decode_responses=True) as direct:
            assert f"[{slot}->-{cluster.node_id(target)}]" in await command(direct, "CLUSTER", "NODES")
        # A key the source lacks is created on the target, through ASK.
        await client.set("{half}:new", "during")
        assert cluster.migrate_keys(slot, target) == 1
        assert await client.mget("{half}:old", "{half}:new") == [b"before", b"during"]
        assert cluster.node_for_slot(slot) is source
        cluster.finish_migration(slot, target)
        assert cluster.node_for_slot(slot) is target
        assert await client.get("{half}:new") == b"during"


# -------------------------------------------------------------------------------------------- sentinel


async def test_the_sentinel_client_writes_to_the_master_and_the_replica_follows(
    sentinel_group: SentinelGroup,
) -> None:
    ports = ",".join(f"127.0.0.1:{port}" for _, port in sentinel_group.sentinels)
    assert sentinel_group.url == f"redis+sentinel://{ports}/aiosem-master/0"
    master, replica = sentinel_group.master(), sentinel_group.replica()
    assert master is not replica
    async with sentinel_group.client() as client:
        await client.set("greeting", "hello")
        assert await command(client, "WAIT", 1, 5000) == 1
    async with replica.client() as direct:
        assert await direct.get("greeting") == b"hello"
        assert (await direct.info("replication"))["master_port"] == master.port


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.failover
async def test_failover_twice_and_the_same_client_follows(sentinel_group: SentinelGroup) -> None:
    first = sentinel_group.master()
    async with sentinel_group.client() as client:
        await client.set("counter", 0)
        for count, expected in enumerate((sentinel_group.replica(), first), start=1):
            assert await eventually(lambda: command(client, "WAIT", 1, 5000)) == 1
            sentinel_group.failover()
            assert sentinel_group.master() is expected
            assert await eventually(lambda: client.incr("counter")) == count
    async with first.client() as direct:
        assert (await direct.info("replication"))["role"] == "master"
        assert await direct.get("counter") == b"2"


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.failover
async def test_kill_master_twice_and_the_same_client_follows(sentinel_group: SentinelGroup) -> None:
    first = sentinel_group.master()
    async with sentinel_group.client() as client:
        await client.set("survivor", "yes")
        for expected in (sentinel_group.replica(), first):
            assert await eventually(lambda: command(client, "WAIT", 1, 5000)) == 1
            sentinel_group.kill_master()
            assert sentinel_group.master() is expected
            assert await eventually(lambda: client.get("survivor")) == b"yes"
    # Restarted empty and as a replica, the first master got the data back from the second.
    async with first.client() as direct:
        assert await direct.get("survivor") == b"yes"
