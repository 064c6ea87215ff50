"""Where the decorators and limiters get their Redis, their defaults and their objects.

`limit_concurrency` and `limiter` use semaphore objects, `limit_rate` and
`rate_limiter` rate limiter objects; both kinds are found the same way, in
the same per-loop cache, from the same settings.

Three layers, from the longest-lived:

- **Settings** (`configure`): process-wide defaults, read at every call of a
  decorated function or limiter, so a `configure` made after decoration
  still applies. They survive a fork: a gunicorn ``--preload`` child keeps
  what its master configured.
- **Per event loop** (`LoopState`): the clients created from a URL -- a
  ``redis.asyncio`` client must never cross event loops -- and the
  semaphore and rate limiter objects, in a cache bounded to `CACHE_SIZE` idle objects that
  never evicts one in use. Each state closes itself when its loop shuts
  down (``asyncio.run``, ``asyncio.Runner`` and pytest-asyncio close the
  loop's async generators first; the state watches its loop with one), and
  `aclose` closes it at once.
- **Per process**: the embedded store of ``memory://`` URLs (one
  ``fakeredis.FakeServer``, shared by every loop of the process). A forked
  child drops all per-loop state and the store, without closing anything:
  the sockets are its parent's.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, NamedTuple, TypeAlias, TypeVar
from urllib.parse import urlsplit

import anyio

from ._exceptions import PermitLost
from ._fair import AsyncFairSemaphore
from ._keys import check_prefix
from ._locked import AsyncLockedSemaphore
from ._rate import AsyncRateLimiter
from ._urls import CLUSTER_SCHEMES, SENTINEL_SCHEMES, SERVER_SCHEMES, check_url_form, close, connect
from ._validation import (
    check_burst,
    check_client,
    check_interval,
    check_limit,
    check_name,
    check_positive,
    check_replicas,
    check_timeout,
    check_wait,
)

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable

    import redis.asyncio

    from ._connection import Client

__all__ = ["aclose", "configure"]

logger = logging.getLogger("aiosem")

Kind: TypeAlias = Literal["fair", "locked"]
Semaphore: TypeAlias = AsyncFairSemaphore | AsyncLockedSemaphore
#: What the cache holds: semaphores and rate limiters.
Limited: TypeAlias = AsyncFairSemaphore | AsyncLockedSemaphore | AsyncRateLimiter
L = TypeVar("L", bound=Limited)
V = TypeVar("V")
LostCallback: TypeAlias = Callable[[PermitLost], object]

#: The environment variable read when `configure` was given no URL or client.
ENV_URL: Final = "AIOSEM_REDIS_URL"
#: The URL used when nothing is configured: an in-process store.
MEMORY_URL: Final = "memory://"
_SCHEMES: Final = (*SERVER_SCHEMES, *CLUSTER_SCHEMES, *SENTINEL_SCHEMES, "memory")
_KINDS: Final[Mapping[str, type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]]] = {
    "fair": AsyncFairSemaphore,
    "locked": AsyncLockedSemaphore,
}

#: How many idle objects (semaphores and rate limiters) each event loop keeps, least recently used
#: first out. Objects in use (holding or waiting) are never evicted and not
#: counted. (Not `Final`: the tests make it small.)
CACHE_SIZE = 1024
#: How long closing may take, per step, before it is abandoned.
_CLOSE_TIMEOUT: Final = 5.0


class _Unset(enum.Enum):
    token = 0


#: "Not given here: take the configured value" (where ``None`` means something).
UNSET: Final = _Unset.token


class Rate(NamedTuple):
    """A rate limiter's rate: ``rate`` calls per ``per`` seconds, ``burst`` at once from rest."""

    rate: float
    per: float = 1.0
    burst: int = 1


@dataclass(frozen=True, slots=True)
class Settings:
    """What `configure` set; replaced whole by each call, never changed in place."""

    #: Not in the repr: it may hold a password.
    url: str | None = field(default=None, repr=False)
    client: Client | None = None
    prefix: str = "aiosem"
    timeout: float = 10.0
    blocking_timeout: float | None = None
    kind: Kind = "fair"
    replicas: int = 0
    limits: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    rates: Mapping[str, Rate] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class Options(Generic[L]):
    """What one decorator or limiter was given; ``None`` or `UNSET`: from the settings.

    The part every kind of object shares; each subclass adds its own and
    says, in `resolve`, which object a call uses.
    """

    blocking_timeout: float | _Unset | None = UNSET
    prefix: str | None = None
    client: Client | None = None

    def resolve(self, name: str, current: Settings) -> tuple[Hashable, Factory[L]]:
        """What tells this kind's objects of ``name`` apart, and how to create one.

        Reads what was not given from ``current``; raises `LookupError`
        before anything else is done if the object cannot be created.
        """
        raise NotImplementedError


#: Creates a cached object from the client, the name, the prefix and the blocking timeout.
Factory: TypeAlias = Callable[["Client", str, str, float | None], L]


@dataclass(frozen=True, slots=True)
class SemaphoreOptions(Options[Semaphore]):
    """What `limit_concurrency` or `limiter` was given."""

    limit: int | None = None
    timeout: float | None = None
    kind: Kind | None = None
    waiter_timeout: float | None = None
    refresh_interval: float | None = None
    on_lost: LostCallback | None = None

    def resolve(self, name: str, current: Settings) -> tuple[Hashable, Factory[Semaphore]]:
        limit = LIMITS.resolve(name, self.limit)
        kind = current.kind if self.kind is None else self.kind
        timeout = current.timeout if self.timeout is None else self.timeout
        extra: dict[str, Any] = {}
        if self.waiter_timeout is not None:
            extra["waiter_timeout"] = self.waiter_timeout
        if self.refresh_interval is not None:
            extra["refresh_interval"] = self.refresh_interval
        if self.on_lost is not None:
            extra["on_lost"] = self.on_lost
        if current.replicas:
            extra["replicas"] = current.replicas

        def create(client: Client, name: str, prefix: str, blocking_timeout: float | None) -> Semaphore:
            return _KINDS[kind](
                client, name, limit, timeout=timeout, blocking_timeout=blocking_timeout, prefix=prefix, **extra
            )

        key = (kind, limit, timeout, self.waiter_timeout, self.refresh_interval, id(self.on_lost), current.replicas)
        return key, create


@dataclass(frozen=True, slots=True)
class RateOptions(Options[AsyncRateLimiter]):
    """What `limit_rate` or `rate_limiter` was given: a whole `Rate`, or ``None`` for the configured one."""

    rate: Rate | None = None

    def resolve(self, name: str, current: Settings) -> tuple[Hashable, Factory[AsyncRateLimiter]]:
        rate, per, burst = RATES.resolve(name, self.rate)

        def create(client: Client, name: str, prefix: str, blocking_timeout: float | None) -> AsyncRateLimiter:
            return AsyncRateLimiter(
                client, name, rate, per, burst=burst, blocking_timeout=blocking_timeout, prefix=prefix
            )

        return ("rate", rate, per, burst), create


_lock = threading.Lock()
_settings = Settings()
#: What decorators with a fixed name declared, by setting and name: limits, rates.
_declared: dict[tuple[str, str], set[Any]] = {}
_states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopState] = weakref.WeakKeyDictionary()
_memory_server: Any = None
_warned_memory = False
_forked = False
#: What a forked child inherited and must neither close nor let be collected:
#: finalizers would close the parent's sockets, or unregister them from an
#: epoll instance the parent shares with the child.
_left_by_parent: list[object] = []


# --- arguments -----------------------------------------------------------------


def check_url(value: object, argument: str = "url") -> str:
    """A URL aiosem can connect to; the message never repeats it (it may hold a password)."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    try:
        parts = urlsplit(value)
    except ValueError as error:
        raise ValueError(f"{argument}: {error}") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        shown = f"a {scheme}:// URL" if scheme else "no URL scheme"
        raise ValueError(
            f"{argument} must be a redis://, rediss://, unix://, redis+cluster://, redis+sentinel:// "
            f"or memory:// URL, got {shown}"
        )
    if scheme == "memory" and (parts.netloc or parts.path not in ("", "/") or parts.query or parts.fragment):
        raise ValueError(f"{argument}: a memory:// URL takes no host, path or options")
    check_url_form(value, argument)
    return value


def check_kind(value: object) -> Kind:
    if value == "fair":
        return "fair"
    if value == "locked":
        return "locked"
    raise ValueError(f"kind must be 'fair' or 'locked', got {value!r}")


def check_limits(value: object) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise TypeError(f"limits must be a mapping of names to limits, not {type(value).__name__}")
    checked = {}
    for name, limit in value.items():
        check_name(name, "a name in limits")
        try:
            checked[name] = check_limit(limit)
        except (TypeError, ValueError) as error:
            raise type(error)(f"limits[{name!r}]: {error}") from None
    return checked


def check_rate(rate: object, per: object = 1.0, burst: object = 1) -> Rate:
    """A whole rate, each part checked as `AsyncRateLimiter` checks it."""
    checked = Rate(check_positive(rate, "rate"), check_positive(per, "per"), check_burst(burst))
    check_interval(checked.rate, checked.per)
    return checked


def check_rates(value: object) -> dict[str, Rate]:
    """``{name: rate}`` (calls per second), ``{name: (rate, per)}`` or ``{name: (rate, per, burst)}``."""
    if not isinstance(value, Mapping):
        raise TypeError(f"rates must be a mapping of names to rates, not {type(value).__name__}")
    checked = {}
    for name, rate in value.items():
        check_name(name, "a name in rates")
        if isinstance(rate, tuple) and len(rate) in (2, 3):
            parts = rate
        elif isinstance(rate, (int, float)) and not isinstance(rate, bool):
            parts = (rate,)
        else:
            raise TypeError(
                f"rates[{name!r}] must be a number of calls per second, or a (rate, per) or (rate, per, burst) "
                f"tuple, not {type(rate).__name__}" + (f" of {len(rate)}" if isinstance(rate, tuple) else "")
            )
        try:
            checked[name] = check_rate(*parts)
        except (TypeError, ValueError) as error:
            raise type(error)(f"rates[{name!r}]: {error}") from None
    return checked


def _common(blocking_timeout: float | None, prefix: str | None, client: Client | None) -> dict[str, Any]:
    """The checked arguments every decorator and limiter takes."""
    return {
        # None is "configured"; infinity is "for ever", whatever is configured.
        "blocking_timeout": UNSET if blocking_timeout is None else check_wait(blocking_timeout),
        "prefix": None if prefix is None else check_prefix(prefix),
        "client": None if client is None else check_client(client),
    }


def semaphore_options(
    *,
    limit: int | None,
    timeout: float | None,
    blocking_timeout: float | None,
    prefix: str | None,
    kind: Kind | None,
    client: Client | None,
    waiter_timeout: float | None,
    refresh_interval: float | None,
    on_lost: LostCallback | None,
) -> SemaphoreOptions:
    """Check what a semaphore's decorator or limiter was given; ``None`` means "configured"."""
    if on_lost is not None and not callable(on_lost):
        raise TypeError(f"on_lost must be callable or None, not {type(on_lost).__name__}")
    return SemaphoreOptions(
        limit=None if limit is None else check_limit(limit),
        timeout=None if timeout is None else check_timeout(timeout),
        kind=None if kind is None else check_kind(kind),
        waiter_timeout=None if waiter_timeout is None else check_timeout(waiter_timeout, "waiter_timeout"),
        refresh_interval=None if refresh_interval is None else check_timeout(refresh_interval, "refresh_interval"),
        on_lost=on_lost,
        **_common(blocking_timeout, prefix, client),
    )


def rate_options(
    *,
    rate: float | None,
    per: float | None,
    burst: int | None,
    blocking_timeout: float | None,
    prefix: str | None,
    client: Client | None,
) -> RateOptions:
    """Check what a rate limiter's decorator or limiter was given; no ``rate``: the configured one, whole."""
    if rate is None:
        if per is not None or burst is not None:
            raise ValueError(
                "per and burst go with rate: give rate= too, or none of them to use the configured or declared rate"
            )
        whole = None
    else:
        whole = check_rate(rate, 1.0 if per is None else per, 1 if burst is None else burst)
    return RateOptions(rate=whole, **_common(blocking_timeout, prefix, client))


# --- configure -------------------------------------------------------------------


def configure(
    *,
    url: str | None = None,
    client: Client | None = None,
    prefix: str | None = None,
    timeout: float | None = None,
    blocking_timeout: float | None = None,
    limits: Mapping[str, int] | None = None,
    kind: Kind | None = None,
    rates: Mapping[str, float | tuple[float, float] | tuple[float, float, int]] | None = None,
    replicas: int | None = None,
) -> None:
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
        url: ``redis://``, ``rediss://`` (TLS), ``unix://`` (a Unix socket),
            ``redis+cluster://host:port,host:port`` (a Redis Cluster, from
            any of its nodes), ``redis+sentinel://host:port,host:port/service``
            (the master Sentinel names; ``rediss+...`` for TLS), or
            ``memory://`` -- an embedded store (fakeredis), shared by the
            event loops of this process and by nothing else; needs
            ``pip install 'aiosem[memory]'``. Replaces a ``client``. The
            deployment page of the docs details each form.
        client: A ``redis.asyncio.Redis`` or ``RedisCluster`` to use instead
            of a URL.
        prefix: The first part of every key (default ``"aiosem"``).
        timeout: The lease in seconds (default 10): every user of a
            semaphore must use the same one.
        blocking_timeout: How long to wait for a permit or a rate limiter's
            slot before `AcquireTimeout`, in seconds; ``math.inf`` waits for
            ever (the default).
        limits: Limits by semaphore name, added to those set before: used
            by a decorator or limiter not given a ``limit``.
        kind: ``"fair"`` (`AsyncFairSemaphore`, the default) or ``"locked"``
            (`AsyncLockedSemaphore`, for servers without Lua).
        rates: Rates by rate limiter name, added to those set before: used
            by `limit_rate` and `rate_limiter` when not given a ``rate``.
            Each is a number of calls per second, a ``(rate, per)`` tuple
            (``rate`` calls per ``per`` seconds), or ``(rate, per, burst)``.
        replicas: How many replicas must have each acquire and refresh of
            the decorators' and limiters' semaphores before it counts
            (default 0; see `AsyncFairSemaphore`'s ``replicas``).

    Raises:
        TypeError: An argument has the wrong type (the message names it).
        ValueError: An argument is out of range, a URL has another scheme,
            or both ``url`` and ``client`` were given.
        ImportError: ``memory://`` without fakeredis and lupa installed.
    """
    global _settings  # noqa: PLW0603 -- the process-wide settings, replaced whole
    if url is not None and client is not None:
        raise ValueError("give url or client, not both")
    changes: dict[str, Any] = {}
    if url is not None:
        changes.update(url=check_url(url), client=None)
        if urlsplit(url).scheme.lower() == "memory":
            _import_memory()
    if client is not None:
        changes.update(client=check_client(client), url=None)
    if prefix is not None:
        changes["prefix"] = check_prefix(prefix)
    if timeout is not None:
        changes["timeout"] = check_timeout(timeout)
    if blocking_timeout is not None:
        changes["blocking_timeout"] = check_wait(blocking_timeout)
    if kind is not None:
        changes["kind"] = check_kind(kind)
    if replicas is not None:
        changes["replicas"] = check_replicas(replicas)
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


@dataclass(frozen=True, slots=True)
class Declarable(Generic[V]):
    """A setting by name -- a semaphore's limit, a rate limiter's rate -- that a decorator may declare."""

    #: The argument that gives it, as in "pass limit=".
    argument: str
    #: What it belongs to, as in "no limit for semaphore 'api'".
    owner: str
    #: The `configure` argument and `Settings` field of these settings by name.
    setting: str
    #: The decorator that declares it.
    decorator: str

    def declare(self, name: str, value: V) -> None:
        """Note that a decorator gives ``name`` this value: a limiter given none may use it."""
        with _lock:
            _declared.setdefault((self.setting, name), set()).add(value)

    def resolve(self, name: str, given: V | None) -> V:
        """The value of a call: given, else configured, else declared by a decorator."""
        if given is not None:
            return given
        configured: Mapping[str, V] = getattr(_settings, self.setting)
        if name in configured:
            return configured[name]
        with _lock:
            declared = sorted(_declared.get((self.setting, name), ()))
        if len(declared) == 1:
            return declared[0]  # type: ignore[no-any-return]
        what = f"no {self.argument} for {self.owner} {name!r}"
        if declared:
            raise LookupError(
                f"{what}: decorators declare it with different {self.setting} {declared}; "
                f"pass {self.argument}=, or set one with aiosem.configure({self.setting}={{{name!r}: ...}})"
            )
        raise LookupError(
            f"{what}: pass {self.argument}=, set one with aiosem.configure({self.setting}={{{name!r}: ...}}), "
            f"or decorate a function with @{self.decorator}({name!r}, ...) first"
        )


LIMITS: Final[Declarable[int]] = Declarable("limit", "semaphore", "limits", "limit_concurrency")
RATES: Final[Declarable[Rate]] = Declarable("rate", "rate limiter", "rates", "limit_rate")


# --- where to connect ----------------------------------------------------------------


def _several_workers() -> str | None:
    """Why this process looks like one of several workers sharing a job, or ``None``."""
    if _forked:
        return "it was forked after aiosem was imported (gunicorn --preload, multiprocessing 'fork')"
    if multiprocessing.parent_process() is not None:
        return "it is a multiprocessing child (uvicorn --workers or --reload, a process pool)"
    if os.environ.get("SERVER_SOFTWARE", "").startswith("gunicorn/"):
        return "it runs under gunicorn (SERVER_SOFTWARE)"
    concurrency = os.environ.get("WEB_CONCURRENCY", "").strip()
    if concurrency.isdigit() and int(concurrency) > 1:
        return f"WEB_CONCURRENCY is {concurrency}"
    return None


def default_url() -> str:
    """The URL of the default client: configured, else ``AIOSEM_REDIS_URL``, else ``memory://``."""
    global _warned_memory  # noqa: PLW0603 -- once per process
    if _settings.url is not None:
        return _settings.url
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


def _import_memory() -> Any:
    """The fakeredis module, imported once; configuring ``memory://`` imports it, outside the event loop."""
    try:
        import fakeredis  # noqa: PLC0415 -- an optional dependency, needed for memory:// only
        import lupa  # noqa: F401, PLC0415 -- fakeredis runs the Lua scripts with it
    except ImportError as error:
        raise ImportError(f"{MEMORY_URL} needs fakeredis and lupa: pip install 'aiosem[memory]' ({error})") from error
    return fakeredis


def _memory_client() -> redis.asyncio.Redis:
    global _memory_server  # noqa: PLW0603 -- one store per process
    fakeredis = _import_memory()
    with _lock:
        if _memory_server is None:
            _memory_server = fakeredis.FakeServer()
        server = _memory_server
    client: redis.asyncio.Redis = fakeredis.FakeAsyncRedis(server=server)
    return client


def client_from_url(url: str) -> Client:
    """A new client for ``url``; it connects on its first command."""
    if urlsplit(url).scheme.lower() == "memory":
        return _memory_client()
    return connect(url)


# --- per event loop ----------------------------------------------------------------


class Entry(Generic[L]):
    """A cached object -- a semaphore or a rate limiter -- and how many calls use it (hold or wait)."""

    __slots__ = ("cached", "epoch", "key", "state", "users")

    def __init__(self, state: LoopState, key: Hashable, cached: L) -> None:
        self.state = state
        self.key = key
        self.cached = cached
        self.epoch = state.epoch
        self.users = 0

    def __repr__(self) -> str:
        return f"Entry({self.cached!r}, users={self.users})"


class LoopState:
    """What aiosem created for one event loop: clients, semaphore and rate limiter objects.

    Used from its own loop only. ``busy`` holds the objects some call uses,
    ``idle`` the others, least recently used first; only idle objects are
    evicted. `close` empties both and closes the clients; the state can be
    used again afterwards (new clients, new objects).
    """

    __slots__ = (
        "__weakref__",
        "busy",
        "clients",
        "closed",
        "epoch",
        "idle",
        "loop",
        "retired",
        "unused",
        "users",
        "watcher",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.clients: dict[str, Client] = {}
        #: Clients closed by `aiosem.aclose` while calls still ran: a late
        #: release may have reopened a connection, closed again at the end.
        self.retired: list[Client] = []
        self.busy: dict[Hashable, Entry[Any]] = {}
        self.idle: OrderedDict[Hashable, Entry[Any]] = OrderedDict()
        #: How many calls use an object, of this epoch or an earlier one;
        #: `unused` is set while none does.
        self.users = 0
        self.unused = asyncio.Event()
        self.unused.set()
        #: Bumped by each `close`: entries of an earlier epoch are not cached again.
        self.epoch = 0
        self.closed = False
        self.watcher = _watch(self)

    def __repr__(self) -> str:
        return (
            f"LoopState(clients={len(self.clients)}, busy={len(self.busy)}, idle={len(self.idle)}, "
            f"closed={self.closed})"
        )

    def client_for(self, url: str) -> Client:
        client = self.clients.get(url)
        if client is None:
            client = self.clients[url] = client_from_url(url)
        return client

    def checkout(self, key: Hashable, create: Callable[[], L]) -> Entry[L]:
        """The object for ``key``, counted as in use until `checkin`."""
        entry: Entry[L] | None = self.busy.get(key)
        if entry is None:
            entry = self.idle.pop(key, None)
            if entry is None:
                entry = Entry(self, key, create())
            self.busy[key] = entry
        entry.users += 1
        self.users += 1
        self.unused.clear()
        return entry

    def checkin(self, entry: Entry[Any]) -> None:
        """A call is done with ``entry``; an object nobody uses joins the idle ones, and the oldest go."""
        entry.users -= 1
        self.users -= 1
        if entry.users == 0 and self.busy.get(entry.key) is entry:
            del self.busy[entry.key]
            if entry.epoch == self.epoch:
                self.idle[entry.key] = entry
                while len(self.idle) > CACHE_SIZE:
                    # Idle: it holds nothing, nobody waits on it, and it lets
                    # go of its subscription by itself: it needs no closing.
                    self.idle.popitem(last=False)
        if self.users == 0:
            self.unused.set()

    async def close(self, *, final: bool) -> None:
        """Close the objects and the clients aiosem created.

        `aiosem.aclose` closes every object. At the loop's end, running
        calls are first given time to finish, and only the objects still
        in use then are closed: an idle one holds nothing, and closing it
        would only talk to a client its owner may have closed already.
        """
        with anyio.CancelScope(shield=True):
            if final and not self.unused.is_set():
                # The loop's tasks are cancelled by now, but async generators
                # closed alongside this one may still be giving permits back.
                with anyio.move_on_after(_CLOSE_TIMEOUT):
                    await self.unused.wait()
            objects: list[Limited] = [entry.cached for entry in self.busy.values()]
            if not final:
                objects += [entry.cached for entry in self.idle.values()]
            self.busy.clear()
            self.idle.clear()
            self.epoch += 1
            clients = [*self.clients.values()]
            self.clients.clear()
            if final:
                clients += self.retired
                self.retired.clear()
                self.closed = True
            else:
                self.retired += clients
            for cached in objects:
                await _quietly(cached.aclose(), "closing %r", cached)
            for client in clients:
                await _quietly(close(client), "closing the client %r", client)


async def _quietly(step: Awaitable[None], message: str, subject: object) -> None:
    """Run a clean-up step, bounded; a failure is logged, so the other steps still run."""
    try:
        with anyio.fail_after(_CLOSE_TIMEOUT):
            await step
    except Exception:
        logger.warning(message + " failed", subject, exc_info=True)


async def _watch(state: LoopState) -> AsyncGenerator[None, None]:
    """Close ``state`` when its event loop shuts down.

    Started once, it stays suspended, known to the loop as one of its async
    generators; ``asyncio.run`` and ``asyncio.Runner`` (pytest-asyncio's,
    uvicorn's) close those after cancelling the loop's tasks and before
    closing the loop.
    """
    try:
        yield
    finally:
        await state.close(final=True)
        with _lock:
            if _states.get(state.loop) is state:
                del _states[state.loop]


async def loop_state() -> LoopState:
    """The state of the running event loop, created on first use."""
    loop = asyncio.get_running_loop()
    with _lock:
        state = _states.get(loop)
        if state is not None and not state.closed:
            return state
        for other in [other for other in _states if other.is_closed()]:
            # Closed without closing its async generators: nothing can be
            # closed any more, only forgotten.
            del _states[other]
        state = _states[loop] = LoopState(loop)
    await anext(state.watcher)
    return state


async def checkout(name: str, given: Options[L]) -> Entry[L]:
    """Find or create the object of a call in the running loop, counted as in use.

    Every setting not given is read from the configuration now; an object
    is shared by every call with the same settings in this loop. A
    semaphore and a rate limiter of one name are two objects.

    Raises:
        LookupError: No limit (or rate) for ``name``.
        RuntimeError: Nothing is configured and this looks like one of
            several worker processes.
        ImportError: ``memory://`` without fakeredis and lupa.
        TypeError, ValueError: The object refused the settings.
    """
    current = _settings
    specific, create = given.resolve(name, current)
    state = await loop_state()
    client = given.client if given.client is not None else current.client
    if client is None:
        client = state.client_for(default_url())
    prefix = current.prefix if given.prefix is None else given.prefix
    blocking_timeout = current.blocking_timeout if given.blocking_timeout is UNSET else given.blocking_timeout
    key = (id(client), prefix, name, blocking_timeout, specific)
    return state.checkout(key, lambda: create(client, name, prefix, blocking_timeout))


# --- aclose ------------------------------------------------------------------------------


async def aclose() -> None:
    """Close everything aiosem created in the running event loop.

    Every semaphore object the decorators and limiters created in this loop
    gives back the permits held through it -- calls still holding then
    raise `PermitLost` at their end, those still waiting fail -- and every
    client aiosem created from a URL in this loop is closed. Clients you
    gave (``client=``) are never closed. Call it at shutdown, once the
    limited work is done:

        try:
            await main()
        finally:
            await aiosem.aclose()

    Without it, the same happens when the event loop shuts down through
    ``asyncio.run`` or ``asyncio.Runner`` (as pytest-asyncio and uvicorn
    do). Other event loops are not touched: each is closed by its own
    `aclose` or shutdown. aiosem can be used again afterwards; it then
    creates new clients and objects.

    Failures are logged (logger ``aiosem``), not raised, so that every step
    runs; a permit that could not be given back ends with its lease.

    Cancellation:
        Shielded: a cancelled `aclose` still closes everything, each step
        bounded to 5 s.
    """
    with _lock:
        state = _states.get(asyncio.get_running_loop())
    if state is not None:
        await state.close(final=False)


# --- tests and forks -----------------------------------------------------------------------


def _after_fork_in_child() -> None:
    """Forget, without closing, everything the parent process created: its sockets are not ours."""
    global _lock, _states, _memory_server, _warned_memory, _forked  # noqa: PLW0603 -- a new process
    # The parent may have held the lock at the fork.
    _lock = threading.Lock()
    _left_by_parent.append([*_states.items(), _memory_server])
    _states = weakref.WeakKeyDictionary()
    _memory_server = None
    _warned_memory = False
    _forked = True


if hasattr(os, "register_at_fork"):  # pragma: no branch -- not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _reset() -> None:
    """Forget every setting and declaration (tests only; live loop states close with their loops)."""
    global _settings, _warned_memory, _forked  # noqa: PLW0603 -- a clean slate
    with _lock:
        _settings = Settings()
        _declared.clear()
    _warned_memory = False
    _forked = False
