"""The fixture that points what a documentation block connects to at the session's own redis-server."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio

from aiosem import _config, _default_client, _observing
from tests.harness.limiting import isolate

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.harness.support import RedisServer


@pytest.fixture
def block_server(
    redis_server: RedisServer, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RedisServer]:
    """The session's server, flushed, where a block's connections go; what a block changes in this process, undone.

    - ``AIOSEM_REDIS_URL`` is the server's URL: the decorators, limiters and
      ``configure()`` without ``url`` connect there;
    - ``redis.asyncio.Redis()`` without host, port, socket or pool connects
      there too (redis-py's defaults, localhost:6379, are replaced);
    - ``memory://`` is refused: a block that would fall back on the
      in-process Redis fails instead of passing without the real one;
    - the configuration, the observers and the levels of aiosem's loggers
      are put back afterwards.
    """
    isolate(request, monkeypatch)
    with redis_server._sync_client() as admin:
        admin.flushdb()
    monkeypatch.setenv("AIOSEM_REDIS_URL", redis_server.url)
    _default_to(redis_server, monkeypatch)
    monkeypatch.setattr(_default_client, "_memory_client", _refuse_memory)
    monkeypatch.setattr(_observing, "_observers", _observing._observers)
    levels = {name: logging.getLogger(name).level for name in _aiosem_loggers()}
    yield redis_server
    for name in _aiosem_loggers():
        logging.getLogger(name).setLevel(levels.get(name, logging.NOTSET))
    _config._reset()


def _default_to(server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``redis.asyncio.Redis()``, given nothing that says where, connect to ``server`` as its user."""
    original = redis.asyncio.Redis.__init__
    user = server.user if server._user_created else None
    credentials = {} if user is None else {"username": user.name, "password": user.password}

    @functools.wraps(original)
    def __init__(self: redis.asyncio.Redis, *args: Any, **options: Any) -> None:  # noqa: N807 -- it replaces one
        if not args and options.keys().isdisjoint({"host", "port", "unix_socket_path", "connection_pool"}):
            options = {"host": server.host, "port": server.port, **credentials, **options}
        original(self, *args, **options)

    monkeypatch.setattr(redis.asyncio.Redis, "__init__", __init__)
    unplaced = redis.asyncio.Redis()
    assert unplaced.connection_pool.connection_kwargs["port"] == server.port, "redis-py's defaults were not replaced"


def _refuse_memory() -> redis.asyncio.Redis:
    raise AssertionError("a documentation block fell back on memory://: it must run on the test's redis-server")


def _aiosem_loggers() -> list[str]:
    return [name for name in logging.Logger.manager.loggerDict if name == "aiosem" or name.startswith("aiosem.")]
