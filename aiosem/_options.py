"""The options every layer takes, each declared and documented once.

A semaphore's options reach it through three layers: the classes
(`AsyncFairSemaphore`, `AsyncLockedSemaphore`, `AsyncRateLimiter`), the
functions that find an object by name (`limit_concurrency`, `limiter`,
`limit_rate`, `rate_limiter`, the web integrations), and `configure`. Each
layer takes its options as ``**options: Unpack[...]`` of a `TypedDict` here,
so that an option's type and its text are written once: mypy checks the
keywords against it, and the API pages (griffe's ``unpack_typeddict``
extension) list each option with the text below.

Three options are declared once per layer because they mean something
else there: ``timeout``, ``blocking_timeout`` and ``prefix`` of a class
have a value (10 s, for ever, ``"aiosem"``); by name, ``None`` means "as
configured" (and to `configure`, "unchanged"). Each public function
refuses a keyword its `TypedDict` lacks (`refuse_unknown`), as Python
does for a signature that lists them. Nothing here imports the rest of the
library but for types.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Final, Literal, NamedTuple, TypeAlias, TypedDict

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._connection import Client
    from ._exceptions import PermitLost

__all__ = [
    "DEFAULT",
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_PREFIX",
    "DEFAULT_TIMEOUT",
    "ByNameOptions",
    "ConfigureOptions",
    "Kind",
    "LimiterOptions",
    "LockedSemaphoreOptions",
    "LostCallback",
    "Rate",
    "RateByNameOptions",
    "RateLimiterOptions",
    "RequestLimitOptions",
    "SemaphoreOptions",
    "refuse_unknown",
]

#: The values of the options that have one when left out, as their texts below say.
DEFAULT_TIMEOUT: Final = 10.0
DEFAULT_PREFIX: Final = "aiosem"
DEFAULT_LOCK_TIMEOUT: Final = 1.0

#: Which class a semaphore found by name is: `AsyncFairSemaphore` or `AsyncLockedSemaphore`.
Kind: TypeAlias = Literal["fair", "locked"]
#: Called with the loss of a permit kept alive.
LostCallback: TypeAlias = "Callable[[PermitLost], object]"


class Rate(NamedTuple):
    """A rate limiter's rate: ``rate`` calls per ``per`` seconds, ``burst`` at once from rest."""

    rate: float
    per: float = 1.0
    burst: int = 1


class _Upkeep(TypedDict, total=False):
    """How a semaphore keeps its waiters and holders alive: the same in every layer that makes one."""

    waiter_timeout: float | None
    """How long a queued waiter whose process stopped answering keeps its
    place, in seconds: at most ``timeout``; default the smaller of 2 s and
    ``timeout``. Each process proves its waiters alive three times per
    ``waiter_timeout``."""
    refresh_interval: float | None
    """How often a permit held through ``async with`` (or taken with
    ``acquire(auto_refresh=True)``, or by a decorated call) is refreshed, in
    seconds: less than ``timeout``; default a third of it."""


class _Label(TypedDict, total=False):
    label: str | None
    """A name for this user of the semaphore, shown by ``python -m aiosem
    status`` beside each of its holders and waiters, with their host and
    process id: 1 to 64 printable characters (default ``None``: none)."""


class _OnLost(TypedDict, total=False):
    on_lost: LostCallback | None
    """If set, a permit lost while its block runs calls ``on_lost(PermitLost)``
    (in a background task: it must not block) and the block runs on,
    instead of being cancelled; the block still raises `PermitLost` as it
    ends."""


class _Object(TypedDict, total=False):
    """What every class -- semaphore or rate limiter -- takes."""

    blocking_timeout: float | None
    """How long `acquire` and ``async with`` wait by default, in seconds;
    ``None`` (the default) waits for ever."""
    prefix: str
    """The first part of every key (no braces); default ``"aiosem"``."""
    clock: Callable[[], float] | None
    """Read the time here instead of on the Redis server: ``time.time`` for a
    server that forbids ``TIME`` in scripts (then every client's clock must
    agree), or a fake clock in tests. Default ``None``: the server's."""


class SemaphoreOptions(_Label, _OnLost, _Upkeep, _Object, total=False):
    """The options of `AsyncFairSemaphore` (and of `AsyncLockedSemaphore`)."""

    timeout: float
    """The lease in seconds (default 10): a permit neither refreshed nor
    released within it is reclaimed. Every user of a semaphore must use the
    same lease."""
    replicas: int
    """Follow each acquire and refresh with a ``WAIT`` until this many
    replicas have it (at most ``waiter_timeout``; fewer raises
    `NotReplicated`), so that a failover to a replica cannot forget a permit
    its holder was told it has. 0, the default, waits for none: Redis
    replicates asynchronously. See the deployment page."""


class LockedSemaphoreOptions(SemaphoreOptions, total=False):
    """The options of `AsyncLockedSemaphore`."""

    lock_timeout: float
    """The longest the step lock may live, in seconds (default 1). It is set
    to expire after this, or after a quarter of the shorter of ``timeout``
    and ``waiter_timeout`` (but at least 10 ms) if that is shorter: 0.5 s
    with the defaults, 0.25 s with a lease of 1 s. Each step deletes its
    lock as it commits; the lock stays only when its process crashes,
    stalls or is cut off mid-step, and holds everyone else's steps up for no
    longer than this -- well within the lease, so that holders refreshing on
    time and live waiters lose nothing by it. A step must end within it: a
    step slower than its lock is tried again."""


class RateLimiterOptions(_Object, total=False):
    """The options of `AsyncRateLimiter`."""

    burst: int
    """How many calls an idle limiter lets through at once (at least 1, the
    default: calls are spaced evenly)."""


class ByNameOptions(TypedDict, total=False):
    """What every function that finds its object by name takes, and `configure` sets; ``None``: as configured."""

    blocking_timeout: float | None
    """How long to wait for a permit or a slot before giving up
    (`AcquireTimeout`, or a web request's 503), in seconds; ``math.inf``
    waits for ever. Default: as configured (for ever)."""
    client: Client | None
    """A ``redis.asyncio.Redis`` or ``RedisCluster`` to use instead of the
    configured one; aiosem never closes it."""
    prefix: str | None
    """The first part of every key; default as configured (``"aiosem"``)."""


class _SemaphoreDefaults(ByNameOptions, total=False):
    timeout: float | None
    """The lease in seconds; default as configured (10). Every user of a
    semaphore must use the same one."""
    kind: Kind | None
    """``"fair"`` (`AsyncFairSemaphore`) or ``"locked"``
    (`AsyncLockedSemaphore`, for servers without Lua); default as
    configured (``"fair"``)."""


class RequestLimitOptions(_Label, _Upkeep, _SemaphoreDefaults, total=False):
    """The options of the web integrations' limits."""

    retry_after: int
    """The ``Retry-After`` of a 503, in whole seconds (default 1)."""


class LimiterOptions(_Label, _OnLost, _Upkeep, _SemaphoreDefaults, total=False):
    """The options of `limit_concurrency` and `limiter`."""


class RateByNameOptions(ByNameOptions, total=False):
    """The options of `limit_rate` and `rate_limiter`."""

    burst: int | None
    """How many calls a limiter at rest lets start at once (default 1:
    evenly spaced); only with ``rate``."""


class ConfigureOptions(_SemaphoreDefaults, total=False):
    """The settings `configure` takes; each given replaces that setting, each left out keeps its own."""

    url: str | None
    """``redis://``, ``rediss://`` (TLS), ``unix://`` (a Unix socket),
    ``redis+cluster://host:port,host:port`` (a Redis Cluster, from any of its
    nodes), ``redis+sentinel://host:port,host:port/service`` (the master
    Sentinel names; ``rediss+...`` for TLS), or ``memory://`` -- an embedded
    store (fakeredis), shared by the event loops of this process and by
    nothing else; needs aiosem's ``memory`` extra. Replaces a
    ``client``. The deployment page of the docs details each form."""
    limits: Mapping[str, int] | None
    """Limits by semaphore name, added to those set before: used by a
    decorator or limiter not given a ``limit``."""
    rates: Mapping[str, float | tuple[float, float] | tuple[float, float, int]] | None
    """Rates by rate limiter name, added to those set before: used by
    `limit_rate` and `rate_limiter` when not given a ``rate``. Each is a
    number of calls per second, a ``(rate, per)`` tuple (``rate`` calls per
    ``per`` seconds), or ``(rate, per, burst)``."""
    replicas: int | None
    """How many replicas must have each acquire and refresh of the
    decorators' and limiters' semaphores before it counts (default 0; see
    `AsyncFairSemaphore`'s ``replicas``)."""


def refuse_unknown(options: Mapping[str, object], declared: type, function: str) -> None:
    """Refuse a keyword ``declared`` (a `TypedDict` of options) lacks, in the name of the public ``function``.

    ``**options`` takes any keyword at run time: this refuses the others as
    Python does for a signature that lists its keywords.

    Raises:
        TypeError: ``{function}() got an unexpected keyword argument '...'``.
    """
    known: frozenset[str] = declared.__optional_keys__  # type: ignore[attr-defined]
    for keyword in options:
        if keyword not in known:
            raise TypeError(f"{function}() got an unexpected keyword argument {keyword!r}")


class _Default(enum.Enum):
    token = 0


#: Stands for "the object's own ``blocking_timeout``" in `acquire` (of a semaphore or a rate limiter).
DEFAULT: Final = _Default.token
