"""What a function that finds its object by name was given, checked, and how it becomes an object.

`limit_concurrency`, `limiter` and the web integrations make a
`SemaphoreSpec`; `limit_rate` and `rate_limiter` a `RateSpec`. Both are
checked when made, so that a mistake shows at decoration; what they leave
out (``None``) is read from the settings at each call (`Spec.resolve`),
which also says what tells the objects of one name apart in the per-loop
cache, and how to create one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Generic, TypeAlias, TypeVar

from ._declarations import LIMITS, RATES
from ._fair import AsyncFairSemaphore
from ._keys import check_prefix
from ._locked import AsyncLockedSemaphore
from ._rate import AsyncRateLimiter
from ._validation import (
    check_callable,
    check_client,
    check_kind,
    check_label,
    check_limit,
    check_rate,
    check_timeout,
    check_wait,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Mapping

    from ._config import Settings
    from ._connection import Client
    from ._options import Kind, LostCallback, Rate

__all__ = ["UNSET", "Limited", "RateSpec", "Semaphore", "SemaphoreSpec", "Spec", "rate_spec", "semaphore_spec"]

Semaphore: TypeAlias = AsyncFairSemaphore | AsyncLockedSemaphore
#: What the per-loop cache holds: semaphores and rate limiters.
Limited: TypeAlias = AsyncFairSemaphore | AsyncLockedSemaphore | AsyncRateLimiter
L = TypeVar("L", bound=Limited)

_KINDS: Final[Mapping[str, type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]]] = {
    "fair": AsyncFairSemaphore,
    "locked": AsyncLockedSemaphore,
}


class _Unset(enum.Enum):
    token = 0


#: "Not given here: take the configured value" (where ``None`` means something).
UNSET: Final = _Unset.token

#: Creates a cached object from the client, the name, the prefix and the blocking timeout.
Factory: TypeAlias = "Callable[[Client, str, str, float | None], L]"


@dataclass(frozen=True, slots=True)
class Spec(Generic[L]):
    """What one function by name was given; ``None`` or `UNSET`: from the settings.

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


@dataclass(frozen=True, slots=True)
class SemaphoreSpec(Spec[Semaphore]):
    """What `limit_concurrency`, `limiter` or a web integration was given."""

    limit: int | None = None
    timeout: float | None = None
    kind: Kind | None = None
    #: The semaphore's own options given (``waiter_timeout``, ``refresh_interval``, ``on_lost``, ``label``), checked.
    upkeep: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def on_lost(self) -> LostCallback | None:
        on_lost: LostCallback | None = self.upkeep.get("on_lost")
        return on_lost

    def resolve(self, name: str, current: Settings) -> tuple[Hashable, Factory[Semaphore]]:
        # None anywhere: the semaphore takes the limit in force in Redis.
        limit = LIMITS.find(name, self.limit, current.limits)
        kind = current.kind if self.kind is None else self.kind
        timeout = current.timeout if self.timeout is None else self.timeout
        options = dict(self.upkeep)
        if current.replicas:
            options["replicas"] = current.replicas

        def create(client: Client, name: str, prefix: str, blocking_timeout: float | None) -> Semaphore:
            return _KINDS[kind](
                client, name, limit, timeout=timeout, blocking_timeout=blocking_timeout, prefix=prefix, **options
            )

        # A callback tells objects apart by identity: equal callbacks may differ.
        upkeep = tuple((key, id(value) if key == "on_lost" else value) for key, value in sorted(self.upkeep.items()))
        return (kind, limit, timeout, upkeep, current.replicas), create


@dataclass(frozen=True, slots=True)
class RateSpec(Spec[AsyncRateLimiter]):
    """What `limit_rate` or `rate_limiter` was given: a whole `Rate`, or ``None`` for the configured one."""

    rate: Rate | None = None

    def resolve(self, name: str, current: Settings) -> tuple[Hashable, Factory[AsyncRateLimiter]]:
        rate, per, burst = RATES.resolve(name, self.rate, current.rates)

        def create(client: Client, name: str, prefix: str, blocking_timeout: float | None) -> AsyncRateLimiter:
            return AsyncRateLimiter(
                client, name, rate, per, burst=burst, blocking_timeout=blocking_timeout, prefix=prefix
            )

        return ("rate", rate, per, burst), create


def _common(options: Mapping[str, object]) -> dict[str, Any]:
    """The checked options every function by name takes."""
    blocking_timeout, prefix, client = options.get("blocking_timeout"), options.get("prefix"), options.get("client")
    return {
        # None is "configured"; infinity is "for ever", whatever is configured.
        "blocking_timeout": UNSET if blocking_timeout is None else check_wait(blocking_timeout),
        "prefix": None if prefix is None else check_prefix(prefix),
        "client": None if client is None else check_client(client),
    }


def semaphore_spec(limit: int | None, options: Mapping[str, object]) -> SemaphoreSpec:
    """Check what a semaphore's function by name was given (`LimiterOptions`); ``None`` means "configured"."""
    upkeep: dict[str, Any] = {}
    if (on_lost := check_callable(options.get("on_lost"), "on_lost")) is not None:
        upkeep["on_lost"] = on_lost
    timeout, kind = options.get("timeout"), options.get("kind")
    checked_limit = None if limit is None else check_limit(limit)
    checked_timeout = None if timeout is None else check_timeout(timeout)
    checked_kind = None if kind is None else check_kind(kind)
    for interval in ("waiter_timeout", "refresh_interval"):
        if (value := options.get(interval)) is not None:
            upkeep[interval] = check_timeout(value, interval)
    if (label := check_label(options.get("label"))) is not None:
        upkeep["label"] = label
    return SemaphoreSpec(
        limit=checked_limit,
        timeout=checked_timeout,
        kind=checked_kind,
        upkeep=MappingProxyType(upkeep),
        **_common(options),
    )


def rate_spec(rate: float | None, per: float | None, options: Mapping[str, object]) -> RateSpec:
    """Check what a rate limiter's function by name was given; no ``rate``: the configured one, whole."""
    burst = options.get("burst")
    if rate is None:
        if per is not None or burst is not None:
            raise ValueError(
                "per and burst go with rate: give rate= too, or none of them to use the configured or declared rate"
            )
        whole = None
    else:
        whole = check_rate(rate, 1.0 if per is None else per, 1 if burst is None else burst)
    return RateSpec(rate=whole, **_common(options))
