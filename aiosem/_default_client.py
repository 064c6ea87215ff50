"""Where the decorators and limiters connect when they were given no client.

First match wins: ``configure(url=...)``; the ``AIOSEM_REDIS_URL``
environment variable; else ``memory://``, the embedded store -- with a
warning logged once, and an error in a process that looks like one of
several workers, where an in-process store would not limit anything across
them. The store is one ``fakeredis.FakeServer`` per process, shared by every
event loop of it; a forked child drops it without closing it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import TYPE_CHECKING, Any, Final

from . import _fork
from ._extras import install_hint
from ._urls import MEMORY_URL, check_url, connect, is_memory

if TYPE_CHECKING:
    import redis.asyncio

    from ._connection import Client

__all__ = ["ENV_URL", "client_from_url", "default_url", "import_memory"]

logger = logging.getLogger("aiosem")

#: The environment variable read when `configure` was given no URL or client.
ENV_URL: Final = "AIOSEM_REDIS_URL"

_lock = threading.Lock()
_memory_server: Any = None
_warned_memory = False


def _several_workers() -> str | None:
    """Why this process looks like one of several workers sharing a job, or ``None``."""
    if _fork.forked():
        return "it was forked after aiosem was imported (gunicorn --preload, multiprocessing 'fork')"
    if multiprocessing.parent_process() is not None:
        return "it is a multiprocessing child (uvicorn --workers or --reload, a process pool)"
    if os.environ.get("SERVER_SOFTWARE", "").startswith("gunicorn/"):
        return "it runs under gunicorn (SERVER_SOFTWARE)"
    concurrency = os.environ.get("WEB_CONCURRENCY", "").strip()
    if concurrency.isdigit() and int(concurrency) > 1:
        return f"WEB_CONCURRENCY is {concurrency}"
    return None


def default_url(configured: str | None) -> str:
    """The URL of the default client: ``configured``, else ``AIOSEM_REDIS_URL``, else ``memory://``.

    Raises:
        RuntimeError: Nothing is configured and this process looks like one
            of several workers.
        ValueError: ``AIOSEM_REDIS_URL`` is not a URL aiosem can use.
    """
    global _warned_memory  # noqa: PLW0603 -- once per process
    if configured is not None:
        return configured
    environment = os.environ.get(ENV_URL)
    if environment:
        return check_url(environment, ENV_URL)
    reason = _several_workers()
    if reason is not None:
        raise RuntimeError(
            f"aiosem has no Redis to use, and this process looks like one of several workers ({reason}): "
            f"the default {MEMORY_URL} store lives in one process, so it would not limit anything across them. "
            f"Call aiosem.configure(url='redis://...') or set {ENV_URL} "
            f"({ENV_URL}={MEMORY_URL} if this process really is alone)."
        )
    if not _warned_memory:
        _warned_memory = True
        logger.warning(
            "aiosem has no Redis configured (aiosem.configure(url=...) or %s): using %s, an in-process store. "
            "Limits hold within this process only, not across processes or machines.",
            ENV_URL,
            MEMORY_URL,
        )
    return MEMORY_URL


def import_memory() -> Any:
    """The fakeredis module, imported once; configuring ``memory://`` imports it, outside the event loop."""
    try:
        import fakeredis  # noqa: PLC0415 -- an optional dependency, needed for memory:// only
        import lupa  # noqa: F401, PLC0415 -- fakeredis runs the Lua scripts with it
    except ImportError as error:
        raise ImportError(f"{MEMORY_URL} needs fakeredis and lupa: {install_hint('memory')} ({error})") from error
    return fakeredis


def _memory_client() -> redis.asyncio.Redis:
    global _memory_server  # noqa: PLW0603 -- one store per process
    fakeredis = import_memory()
    with _lock:
        if _memory_server is None:
            _memory_server = fakeredis.FakeServer()
        server = _memory_server
    client: redis.asyncio.Redis = fakeredis.FakeAsyncRedis(server=server)
    return client


def client_from_url(url: str) -> Client:
    """A new client for ``url``; it connects on its first command."""
    if is_memory(url):
        return _memory_client()
    return connect(url)


def reset() -> None:
    """Warn again about the embedded store (tests only)."""
    global _warned_memory  # noqa: PLW0603 -- a clean slate
    _warned_memory = False


def _forget() -> Any:
    """Drop the parent's store, and the lock it may have held at the fork."""
    global _lock, _memory_server, _warned_memory  # noqa: PLW0603 -- a new process
    _lock = threading.Lock()
    server, _memory_server = _memory_server, None
    _warned_memory = False
    return server


_fork.forget(_forget)
