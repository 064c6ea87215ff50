"""Clients made from URLs: one server, a cluster, a master found through Sentinel; no server needed."""

from __future__ import annotations

import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

import aiosem
from aiosem import _config, _urls


async def test_clients_from_a_url_have_socket_timeouts_and_a_bounded_blocking_pool() -> None:
    client = _urls.connect("redis://localhost:6379/0")
    assert isinstance(client, redis.asyncio.Redis)
    try:
        pool = client.connection_pool
        assert isinstance(pool, redis.asyncio.BlockingConnectionPool)
        assert pool.max_connections == 64
        assert pool.timeout == 5
        assert pool.connection_kwargs["socket_timeout"] == 5
        assert pool.connection_kwargs["socket_connect_timeout"] == 5
    finally:
        await _urls.close(client)


async def test_the_query_of_a_url_overrides_the_pool_and_timeouts() -> None:
    client = _urls.connect("redis://localhost:6379/0?socket_timeout=9&max_connections=7&timeout=2")
    assert isinstance(client, redis.asyncio.Redis)
    try:
        pool = client.connection_pool
        assert pool.max_connections == 7
        assert pool.timeout == 2  # type: ignore[attr-defined]
        assert pool.connection_kwargs["socket_timeout"] == 9
    finally:
        await _urls.close(client)


async def test_a_rediss_url_makes_a_tls_client() -> None:
    client = _urls.connect("rediss://localhost:6380/0")
    assert isinstance(client, redis.asyncio.Redis)
    try:
        assert issubclass(client.connection_pool.connection_class, redis.asyncio.SSLConnection)
    finally:
        await _urls.close(client)


async def test_a_cluster_url_names_every_startup_node_with_the_credentials_and_timeouts() -> None:
    client = _urls.connect("redis+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2:7001,node3?socket_timeout=3")
    assert isinstance(client, RedisCluster)
    try:
        manager = client.nodes_manager
        assert sorted(manager.startup_nodes) == ["10.0.0.1:7000", "10.0.0.2:7001", "node3:6379"]
        assert manager.connection_kwargs["username"] == "app"
        assert manager.connection_kwargs["password"] == "s@cret"
        assert manager.connection_kwargs["socket_timeout"] == 3
        assert manager.connection_kwargs["socket_connect_timeout"] == 5
    finally:
        await _urls.close(client)


async def test_a_rediss_cluster_url_connects_with_tls() -> None:
    client = _urls.connect("rediss+cluster://10.0.0.1:7000")
    assert isinstance(client, RedisCluster)
    try:
        assert issubclass(client.nodes_manager.connection_kwargs["connection_class"], redis.asyncio.SSLConnection)
    finally:
        await _urls.close(client)


async def test_a_sentinel_url_asks_its_sentinels_for_the_named_master() -> None:
    url = "redis+sentinel://app:pw@10.0.0.1:26379,10.0.0.2/mymaster/2?sentinel_password=spw&socket_timeout=4"
    client = _urls.connect(url)
    assert isinstance(client, redis.asyncio.Redis)
    try:
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "mymaster"
        assert pool.connection_kwargs["password"] == "pw"
        assert pool.connection_kwargs["username"] == "app"
        assert pool.connection_kwargs["db"] == 2
        assert pool.connection_kwargs["socket_timeout"] == 4
        sentinels = pool.sentinel_manager.sentinels
        assert [
            (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels
        ] == [
            ("10.0.0.1", 26379),
            ("10.0.0.2", 26379),
        ]
        # The sentinels' own password, not the master's.
        assert sentinels[0].connection_pool.connection_kwargs["password"] == "spw"
        assert sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 4
    finally:
        await _urls.close(client)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://:hunter2@10.0.0.1:26379", "names its service"),
        ("redis+sentinel://:hunter2@10.0.0.1:26379/mymaster/x", "must be a number"),
        ("redis+cluster://:hunter2@10.0.0.1:7000/3", "only database 0"),
        ("redis+cluster://:hunter2@10.0.0.1:port", "bad port"),
        ("redis+cluster://:hunter2@10.0.0.1:7000,,10.0.0.2:7001", "every host must be named"),
    ],
)
def test_a_malformed_url_is_refused_without_repeating_its_password(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        aiosem.configure(url=url)
    assert "hunter2" not in str(caught.value)


def test_configure_accepts_cluster_and_sentinel_urls() -> None:
    try:
        aiosem.configure(url="redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
        assert _config.settings().url == "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
        aiosem.configure(url="rediss+sentinel://127.0.0.1:26379/mymaster")
        assert _config.settings().url == "rediss+sentinel://127.0.0.1:26379/mymaster"
    finally:
        _config._reset()


def test_replicas_are_checked_by_configure() -> None:
    with pytest.raises(ValueError, match="replicas must not be negative, got -1"):
        aiosem.configure(replicas=-1)
    with pytest.raises(TypeError, match="replicas must be an int, not bool"):
        aiosem.configure(replicas=True)
