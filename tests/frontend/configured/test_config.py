"""`configure`, URLs, the environment, the ``memory://`` default, event loops, `aclose` and forks."""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import sys
import threading
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import fakeredis
import pytest
import redis
import redis.asyncio

import aiosem
from aiosem import (
    AsyncFairSemaphore,
    PermitLost,
    _config,
    _default_client,
    _fork,
    _loop_cache,
    limit_concurrency,
    limiter,
)
from aiosem._holding import Refresher
from tests.harness.limiting import Gate, assert_no_task_left, state
from tests.harness.support import RedisServer

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator
    from pathlib import Path


async def held(client: redis.asyncio.Redis, name: str) -> int:
    return await AsyncFairSemaphore(client, name, 1).count()


def connections(server: RedisServer) -> int:
    """How many clients the server has, not counting the one asking."""
    probe = redis.Redis(host=server.host, port=server.port, socket_timeout=5)
    try:
        return len(probe.client_list()) - 1
    finally:
        probe.close()


# --- configure ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"url": 6379}, TypeError, "url must be a str, not int"),
        (
            {"client": redis.Redis()},
            TypeError,
            r"client must be a redis\.asyncio\.Redis or RedisCluster \(aiosem is asyncio-only\)",
        ),
        ({"prefix": ""}, ValueError, "prefix must not be empty"),
        ({"prefix": "a}b"}, ValueError, "prefix must not contain"),
        ({"timeout": 0}, ValueError, "timeout must be a positive, finite number of seconds, got 0"),
        ({"timeout": "10"}, TypeError, "timeout must be a number of seconds, not str"),
        ({"timeout": math.inf}, ValueError, "timeout must be a positive, finite number"),
        ({"blocking_timeout": -1}, ValueError, "blocking_timeout must not be negative, got -1"),
        ({"blocking_timeout": math.nan}, ValueError, "blocking_timeout must not be NaN"),
        ({"limits": [("api", 1)]}, TypeError, "limits must be a mapping of names to limits, not list"),
        ({"limits": {"api": 0}}, ValueError, r"limits\['api'\]: limit must be at least 1, got 0"),
        ({"limits": {"api": "5"}}, TypeError, r"limits\['api'\]: limit must be an int, not str"),
        ({"limits": {"": 5}}, ValueError, "a name in limits must not be empty"),
        ({"kind": "fast"}, ValueError, "kind must be 'fair' or 'locked', got 'fast'"),
    ],
)
def test_configure_names_the_argument_it_refuses(arguments: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        aiosem.configure(**arguments)


def test_configure_refuses_a_url_and_a_client_together() -> None:
    with pytest.raises(ValueError, match="give url or client, not both"):
        aiosem.configure(url="redis://localhost", client=fakeredis.FakeAsyncRedis())


@pytest.mark.parametrize("url", ["http://user:secret@example.com", "localhost:6379", "valkey://secret@host"])
def test_configure_refuses_other_schemes_without_repeating_the_url(url: str) -> None:
    with pytest.raises(
        ValueError,
        match=r"url must be a redis://, rediss://, unix://, redis\+cluster://, redis\+sentinel:// or memory:// URL",
    ) as raised:
        aiosem.configure(url=url)
    assert "secret" not in str(raised.value)
    assert "6379" not in str(raised.value)


@pytest.mark.parametrize("url", ["memory://host", "memory:///data", "memory://?size=1"])
def test_a_memory_url_takes_nothing_more(url: str) -> None:
    with pytest.raises(ValueError, match="a memory:// URL takes no host, path or options"):
        aiosem.configure(url=url)


@pytest.mark.parametrize("url", ["redis://localhost:6379/0", "rediss://:pw@host:6380/1", "unix:///run/redis.sock"])
def test_configure_takes_the_schemes_of_redis(url: str) -> None:
    aiosem.configure(url=url)
    assert _config.settings().url == url


def test_a_refused_configure_changes_nothing() -> None:
    aiosem.configure(prefix="before", limits={"api": 2})
    with pytest.raises(ValueError, match="limit must be at least 1"):
        aiosem.configure(prefix="after", timeout=5, limits={"api": 0})
    assert _config.settings() == _config.Settings(prefix="before", limits={"api": 2})


def test_configure_changes_only_what_it_is_given() -> None:
    aiosem.configure(url="redis://one", prefix="app", timeout=20, blocking_timeout=3, kind="locked")
    aiosem.configure(timeout=30)
    assert _config.settings() == _config.Settings(
        url="redis://one", prefix="app", timeout=30, blocking_timeout=3, kind="locked"
    )


def test_configure_adds_limits_to_those_set_before() -> None:
    aiosem.configure(limits={"api": 2, "db": 3})
    aiosem.configure(limits={"db": 4, "mail": 1})
    assert dict(_config.settings().limits) == {"api": 2, "db": 4, "mail": 1}


def test_an_infinite_blocking_timeout_configures_waiting_for_ever() -> None:
    aiosem.configure(blocking_timeout=3)
    aiosem.configure(blocking_timeout=math.inf)
    assert _config.settings().blocking_timeout is None


def test_a_configured_url_replaces_a_configured_client_and_back() -> None:
    client = fakeredis.FakeAsyncRedis()
    aiosem.configure(client=client)
    aiosem.configure(url="redis://one")
    assert (_config.settings().url, _config.settings().client) == ("redis://one", None)
    aiosem.configure(client=client)
    assert (_config.settings().url, _config.settings().client) == (None, client)


# --- URLs ----------------------------------------------------------------------------------


async def test_a_redis_url_reaches_that_server(redis_server: RedisServer, real_client: redis.asyncio.Redis) -> None:
    aiosem.configure(url=redis_server.url)
    async with limiter("api", 1):
        assert await held(real_client, "api") == 1


async def test_a_unix_url_reaches_the_server_through_its_socket(redis_binary: str, tmp_path: Path) -> None:
    socket = tmp_path / "redis.sock"
    with RedisServer(redis_binary, tmp_path, "--unixsocket", str(socket), "--unixsocketperm", "700") as server:
        aiosem.configure(url=f"unix://{socket}?db=0")
        async with limiter("api", 1):
            probe = server.client()
            try:
                assert await held(probe, "api") == 1
            finally:
                await probe.aclose()
        await aiosem.aclose()


async def test_a_memory_url_needs_no_server(caplog: pytest.LogCaptureFixture) -> None:
    aiosem.configure(url="memory://")
    async with limiter("api", 1):
        assert isinstance(state().clients["memory://"], fakeredis.FakeAsyncRedis)
    assert not caplog.records


def test_a_memory_url_without_fakeredis_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lupa", None)
    with pytest.raises(
        ImportError, match=r"memory:// needs fakeredis and lupa: pip install 'fakeredis>=2.26' 'lupa>=2'"
    ):
        aiosem.configure(url="memory://")
    assert _config.settings().url is None


async def test_the_memory_default_without_fakeredis_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lupa", None)
    with pytest.raises(ImportError, match=r"pip install 'fakeredis>=2.26' 'lupa>=2'"):
        async with limiter("api", 1):
            pass  # pragma: no cover -- never entered


def test_memory_is_shared_by_the_event_loops_of_a_process() -> None:
    aiosem.configure(url="memory://")
    holding, done = threading.Event(), threading.Event()

    async def hold() -> None:
        async with limiter("api", 1):
            holding.set()
            await anyio.to_thread.run_sync(done.wait, 10)

    async def try_to_enter() -> None:
        with pytest.raises(aiosem.AcquireTimeout):
            async with limiter("api", 1, blocking_timeout=0):
                pass  # pragma: no cover -- never entered

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    holder.start()
    try:
        assert holding.wait(10)
        asyncio.run(try_to_enter())
    finally:
        done.set()
        holder.join(10)
    assert not holder.is_alive()


# --- the environment and the default ---------------------------------------------------------


async def test_the_environment_gives_the_url_when_none_is_configured(
    redis_server: RedisServer, real_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOSEM_REDIS_URL", redis_server.url)
    async with limiter("api", 1):
        assert await held(real_client, "api") == 1


async def test_a_configured_url_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSEM_REDIS_URL", "redis://localhost:1/0")
    aiosem.configure(url="memory://")
    async with limiter("api", 1):
        assert list(state().clients) == ["memory://"]


async def test_a_bad_url_in_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSEM_REDIS_URL", "http://localhost")
    with pytest.raises(
        ValueError,
        match=r"AIOSEM_REDIS_URL must be a redis://, rediss://, unix://, redis\+cluster://, .* or memory:// URL",
    ):
        async with limiter("api", 1):
            pass  # pragma: no cover -- never entered


async def test_with_nothing_configured_memory_is_used_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aiosem")
    async with limiter("api", 1):
        pass
    async with limiter("db", 1):
        pass
    assert list(state().clients) == ["memory://"]
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "using memory://" in record.getMessage()
    assert "Limits hold within this process only" in record.getMessage()


@pytest.mark.parametrize(
    ("signal", "reason"),
    [
        ("web_concurrency", "WEB_CONCURRENCY is 4"),
        ("gunicorn", r"it runs under gunicorn \(SERVER_SOFTWARE\)"),
        ("multiprocessing", "it is a multiprocessing child"),
        ("fork", "it was forked after aiosem was imported"),
    ],
)
async def test_with_nothing_configured_one_of_several_workers_refuses(
    signal: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if signal == "web_concurrency":
        monkeypatch.setenv("WEB_CONCURRENCY", "4")
    elif signal == "gunicorn":
        monkeypatch.setenv("SERVER_SOFTWARE", "gunicorn/23.0.0")
    elif signal == "multiprocessing":
        monkeypatch.setattr(multiprocessing, "parent_process", object)
    else:
        monkeypatch.setattr(_fork, "_forked", True)
    with pytest.raises(RuntimeError, match=rf"looks like one of several workers \({reason}.*AIOSEM_REDIS_URL"):
        async with limiter("api", 1):
            pass  # pragma: no cover -- never entered


async def test_one_web_worker_is_not_several(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEB_CONCURRENCY", "1")
    async with limiter("api", 1):
        pass


async def test_memory_chosen_on_purpose_is_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEB_CONCURRENCY", "4")
    monkeypatch.setenv("AIOSEM_REDIS_URL", "memory://")
    async with limiter("api", 1):
        pass


# --- event loops and aclose ----------------------------------------------------------------------


def test_each_event_loop_gets_its_own_client_closed_with_the_loop(redis_server: RedisServer) -> None:
    aiosem.configure(url=redis_server.url)
    before = connections(redis_server)
    clients: list[redis.asyncio.Redis | redis.asyncio.RedisCluster] = []

    async def use() -> None:
        async with limiter("api", 1):
            clients.append(state().clients[redis_server.url])
            assert connections(redis_server) > before

    asyncio.run(use())
    assert not _loop_cache._states
    assert connections(redis_server) == before
    asyncio.run(use())
    assert not _loop_cache._states
    assert connections(redis_server) == before
    assert clients[0] is not clients[1]


async def test_aclose_closes_the_clients_aiosem_created(redis_server: RedisServer) -> None:
    aiosem.configure(url=redis_server.url)
    before = await anyio.to_thread.run_sync(connections, redis_server)
    async with limiter("api", 1):
        pass
    assert await anyio.to_thread.run_sync(connections, redis_server) > before
    await aiosem.aclose()
    assert await anyio.to_thread.run_sync(connections, redis_server) == before
    assert not state().clients


async def test_aclose_leaves_the_clients_it_was_given_open(admin_client: redis.asyncio.Redis) -> None:
    aiosem.configure(client=admin_client)
    async with limiter("api", 1):
        pass
    async with admin_client.client() as connection:
        await connection.client_setname("user")
        await aiosem.aclose()
        names = [entry["name"] for entry in await admin_client.client_list()]
    assert "user" in names


async def test_aclose_gives_back_the_permit_of_a_call_still_running(real_client: redis.asyncio.Redis) -> None:
    aiosem.configure(client=real_client)
    gate = Gate()
    losses: list[PermitLost] = []

    @limit_concurrency("api", 1)
    async def work() -> None:
        await gate.pass_through()

    async def call() -> None:
        try:
            await work()
        except PermitLost as lost:
            losses.append(lost)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            await gate.arrived.wait()
            await aiosem.aclose()
            assert await held(real_client, "api") == 0
            gate.open.set()
    # The call ran on, and learnt at its end that it had lost its permit.
    assert gate.entered == 1
    assert len(losses) == 1


async def test_aclose_gives_back_the_permit_of_an_open_generator(
    real_client: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    aiosem.configure(client=real_client)

    @limit_concurrency("api", 1)
    async def numbers() -> AsyncGenerator[int, None]:
        yield 1
        yield 2  # pragma: no cover -- never reached

    generator = numbers()
    await anext(generator)
    await aiosem.aclose()
    assert await held(real_client, "api") == 0
    await generator.aclose()
    assert "was lost before its generator ended with GeneratorExit" in caplog.text


async def test_aclose_leaves_no_task_running(redis_server: RedisServer) -> None:
    aiosem.configure(url=redis_server.url)

    @limit_concurrency("api", 1)
    async def numbers() -> AsyncGenerator[int, None]:
        yield 1

    assert [number async for number in numbers()] == [1]
    async with limiter("db", 1):
        assert Refresher.of_running_loop().busy  # its first round is due
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
    await aiosem.aclose()
    await assert_no_task_left(within=0.1)


async def test_aiosem_can_be_used_again_after_aclose(redis_server: RedisServer) -> None:
    aiosem.configure(url=redis_server.url)
    async with limiter("api", 1):
        first = state().clients[redis_server.url]
    await aiosem.aclose()
    async with limiter("api", 1):
        assert state().clients[redis_server.url] is not first


# --- forks --------------------------------------------------------------------------------------------


async def test_after_a_fork_the_child_forgets_what_its_parent_created(monkeypatch: pytest.MonkeyPatch) -> None:
    aiosem.configure(url="memory://", limits={"api": 1})
    async with limiter("api"):
        pass
    inherited, server = state(), _default_client._memory_server
    monkeypatch.setattr(_fork, "_left_by_parent", [])
    try:
        _fork._after_fork_in_child()
        assert not _loop_cache._states
        assert _default_client._memory_server is None
        assert _fork.forked()
        # Kept, never closed nor collected: the sockets are the parent's.
        (left,) = _fork._left_by_parent
        assert isinstance(left, list)
        assert [(asyncio.get_running_loop(), inherited)] in left
        assert server in left
        # What was configured stays.
        assert _config.settings().limits == {"api": 1}
    finally:
        await inherited.close(final=False)


def _use_in_forked_child(url: str, parent_client_id: int) -> None:
    """The child of a fork: nothing of the parent's is used, and the decorator works."""
    assert not _loop_cache._states

    @limit_concurrency("forked", 1)
    async def work() -> int:
        return id(state().clients[url])

    async def main() -> None:
        assert await work() != parent_client_id
        await aiosem.aclose()

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
async def test_a_forked_child_uses_the_decorator_on_its_own_connections(
    redis_server: RedisServer, real_client: redis.asyncio.Redis
) -> None:
    aiosem.configure(url=redis_server.url)
    async with limiter("forked", 1):
        parent_client = state().clients[redis_server.url]
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_use_in_forked_child, args=(redis_server.url, id(parent_client)))
    child.start()
    await anyio.to_thread.run_sync(child.join, 60)
    assert child.exitcode == 0
    # The parent's client still works.
    async with limiter("forked", 1):
        assert state().clients[redis_server.url] is parent_client
        assert await held(real_client, "forked") == 1
