"""`configure`: the process-wide defaults of the functions that find their objects by name.

The settings are read at every call of a decorated function or limiter, so
a `configure` made after decoration still applies. They survive a fork: a
gunicorn ``--preload`` child keeps what its master configured. The rest of
what these functions share lives by job: `aiosem._specs` (what each was
given), `aiosem._declarations` (what decorators declare by name),
`aiosem._default_client` (where they connect when given no client),
`aiosem._loop_cache` (their objects, per event loop) and `aiosem._fork`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from . import _declarations, _default_client, _fork
from ._keys import check_prefix
from ._options import DEFAULT_PREFIX, DEFAULT_TIMEOUT, ConfigureOptions, refuse_unknown
from ._urls import check_url, is_memory
from ._validation import check_client, check_kind, check_limits, check_rates, check_replicas, check_timeout, check_wait

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from typing_extensions import Unpack

    from ._connection import Client
    from ._options import Kind, Rate

__all__ = ["Settings", "configure", "settings"]

_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Settings:
    """What `configure` set; replaced whole by each call, never changed in place."""

    #: Not in the repr: it may hold a password.
    url: str | None = field(default=None, repr=False)
    client: Client | None = None
    prefix: str = DEFAULT_PREFIX
    timeout: float = DEFAULT_TIMEOUT
    blocking_timeout: float | None = None
    kind: Kind = "fair"
    replicas: int = 0
    limits: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    rates: Mapping[str, Rate] = field(default_factory=lambda: MappingProxyType({}))


_settings = Settings()

#: How `configure` checks each plain setting, in the order it checks them.
_CHECKS: Final[Mapping[str, Callable[[Any], object]]] = {
    "prefix": check_prefix,
    "timeout": check_timeout,
    "blocking_timeout": check_wait,
    "kind": check_kind,
    "replicas": check_replicas,
}


def configure(**options: Unpack[ConfigureOptions]) -> None:
    """Set the defaults of the decorators and limiters for the whole process.

    Each argument given replaces that setting; those left out (``None``)
    keep theirs, so it can be called several times, from several places.
    The settings are read at each call of a decorated function or limiter,
    so functions decorated before `configure` ran use them too, and a
    change applies from the next call on. A call already holding or waiting
    keeps what it started with. Arguments given to a decorator or limiter
    win over these.

        aiosem.configure(url="redis://localhost:6379/0", limits={"api": 5}, rates={"api": (10, 1.0)})

    Where the decorator and limiter connect, first match wins: their own
    ``client=``; ``configure(client=...)``; ``configure(url=...)``; the
    ``AIOSEM_REDIS_URL`` environment variable; else ``memory://``, with a
    warning logged once -- and an error in a process that looks like one
    of several workers, where an in-process store would not limit anything
    across them.

    Clients aiosem creates from a URL are created lazily, one per event loop
    (a ``redis.asyncio`` client must not cross loops), with 5 s socket
    timeouts and a blocking pool of 64 connections; query parameters of the
    URL override these (``?socket_timeout=10&max_connections=200``). A
    client given here is never closed by aiosem, and belongs to the event
    loop it is used in: with several loops, give a URL.

    Args:
        **options: The settings to replace (`ConfigureOptions`): ``url``,
            ``client``, ``prefix``, ``timeout``, ``blocking_timeout``,
            ``kind``, ``limits``, ``rates``, ``replicas``.

    Raises:
        TypeError: An argument has the wrong type (the message names it).
        ValueError: An argument is out of range, a URL has another scheme,
            or both ``url`` and ``client`` were given.
        ImportError: ``memory://`` without fakeredis and lupa installed.
    """
    global _settings  # noqa: PLW0603 -- the process-wide settings, replaced whole
    refuse_unknown(options, ConfigureOptions, "configure")
    url, client = options.get("url"), options.get("client")
    if url is not None and client is not None:
        raise ValueError("give url or client, not both")
    changes: dict[str, Any] = {}
    if url is not None:
        changes.update(url=check_url(url), client=None)
        if is_memory(url):
            _default_client.import_memory()
    if client is not None:
        changes.update(client=check_client(client), url=None)
    for option, check in _CHECKS.items():
        if (value := options.get(option)) is not None:
            changes[option] = check(value)
    limits, rates = options.get("limits"), options.get("rates")
    checked_limits = None if limits is None else check_limits(limits)
    checked_rates = None if rates is None else check_rates(rates)
    with _lock:
        if checked_limits is not None:
            changes["limits"] = MappingProxyType({**_settings.limits, **checked_limits})
        if checked_rates is not None:
            changes["rates"] = MappingProxyType({**_settings.rates, **checked_rates})
        _settings = replace(_settings, **changes)


def settings() -> Settings:
    """The current settings."""
    return _settings


def _reset() -> None:
    """Forget every setting and declaration, and that this process was forked (tests only)."""
    global _settings  # noqa: PLW0603 -- a clean slate
    with _lock:
        _settings = Settings()
    _declarations.reset()
    _default_client.reset()
    _fork.reset()


def _forget_lock() -> None:
    global _lock  # noqa: PLW0603 -- the parent may have held it at the fork; the settings stay
    _lock = threading.Lock()


_fork.forget(_forget_lock)
