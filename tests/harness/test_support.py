"""The servers and helpers of `tests.harness.support`: a ``redis-server`` of our own starts, stops, dies and comes back.

The server fixtures of the root conftest are built on `RedisServer`; the
topologies (`test_topology`) too.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import fakeredis

from tests.harness.support import FakeClock, RedisServer, Software, binary_software, flushed_client, unrestricted

if TYPE_CHECKING:
    from pathlib import Path


def refuses(port: int) -> bool:
    """Whether nothing listens on ``port`` of the loopback."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_server_starts_on_a_free_port_and_stops_by_its_pid(redis_binary: str, tmp_path: Path) -> None:
    server = RedisServer(redis_binary, tmp_path)
    server.stop()  # before a start: nothing to do
    with server:
        assert server.process is not None
        pid = server.process.pid
        with server._sync_client(socket_timeout=5) as admin:
            info = admin.info("server")
        assert info["process_id"] == pid
        assert server.version == info["redis_version"]
        assert server.url.endswith(f"127.0.0.1:{server.port}/0")
        assert server.admin_url == f"redis://127.0.0.1:{server.port}/0"
    assert server.process is None
    assert refuses(server.port)
    server.stop()  # twice: nothing to do


def test_the_software_a_binary_names_is_the_one_that_answers(redis_binary: str, tmp_path: Path) -> None:
    with RedisServer(redis_binary, tmp_path) as server:
        assert server.software == binary_software(redis_binary)


def test_valkey_is_known_by_its_own_version_not_the_redis_version_it_answers() -> None:
    valkey = Software.from_info({"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "9.1.2"})
    assert valkey == Software("valkey", (9, 1, 2))
    assert Software.from_info({"redis_version": "7.0.15"}) == Software("redis", (7, 0, 15))


def test_client_setinfo_is_known_to_redis_7_2_and_later_and_to_valkey() -> None:
    assert not Software("redis", (7, 0, 15)).has_client_setinfo
    assert Software("redis", (7, 2, 0)).has_client_setinfo
    assert Software("valkey", (7, 2, 5)).has_client_setinfo


def test_a_transaction_of_reads_is_refused_when_full_by_redis_before_7_4_and_valkey_before_8() -> None:
    servers = [
        Software("redis", (7, 2, 9)),
        Software("redis", (7, 4, 0)),
        Software("valkey", (7, 2, 5)),
        Software("valkey", (8, 0, 0)),
    ]
    refused = [server.refuses_reads_in_a_transaction_when_full for server in servers]
    assert refused == [True, False, True, False]


def test_a_killed_server_comes_back_on_its_port_and_a_saved_one_with_its_data(
    redis_binary: str, tmp_path: Path
) -> None:
    with RedisServer(redis_binary, tmp_path) as server:
        port = server.port
        with server._sync_client(socket_timeout=5) as admin:
            admin.set("kept", "1")
        server.save_and_stop()
        assert refuses(port)
        server.start(same_port=True)
        assert server.port == port
        with server._sync_client(socket_timeout=5) as admin:
            assert admin.get("kept") == b"1"
        server.kill()
        assert server.process is None
        assert refuses(port)
        server.start(same_port=True)
        with server._sync_client(socket_timeout=5) as admin:
            assert admin.ping()


async def test_a_flushed_client_sees_an_empty_database(redis_server: RedisServer) -> None:
    admin = redis_server.admin_client()
    try:
        await admin.set("left-over", "1")
        client = await flushed_client(redis_server)
        try:
            async with unrestricted(client) as unrestricted_client:
                assert await unrestricted_client.dbsize() == 0
        finally:
            await client.aclose()
    finally:
        await admin.aclose()


async def test_a_client_without_a_user_is_its_own_unrestricted_client() -> None:
    client = fakeredis.FakeAsyncRedis()
    try:
        async with unrestricted(client) as admin:
            assert admin is client
    finally:
        await client.aclose()


def test_the_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(start=100.0)
    assert clock() == 100.0
    clock.advance(2.5)
    assert clock() == clock.now == 102.5
