"""Argument checks shared by every layer: the classes, the functions by name, `configure`, the recipes.

Each check raises before anything reaches Redis, with a message that names
the argument, and returns the value in the form the caller stores. Only
``int`` and ``float`` (and their subclasses, ``bool`` excepted) count as
numbers; only a float infinity means "for ever", an ``int`` too large
for a float is merely too large.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import redis.asyncio

from ._options import Kind, Rate

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._connection import Client

#: The longest duration accepted: Redis keeps millisecond TTLs in 64 bits,
#: and no lease, lock or wait is meant to outlive its application.
LONGEST: Final = 1e9
#: The shortest lease or interval accepted: Redis counts TTLs in milliseconds,
#: and a shorter lease would run out before its grant could be read.
SHORTEST: Final = 0.001
#: The longest label: one line of a status table, and a small record per holder.
LONGEST_LABEL: Final = 64
#: The largest limit: the scripts count in doubles, exact up to 2**53, and
#: write a limit beyond 10**16 in a form the other clients cannot read.
MOST_LIMIT: Final = 2**53


def check_client(value: object) -> Client:
    """An asyncio client of redis-py, of one server (or Sentinel's master) or of a cluster."""
    if not isinstance(value, (redis.asyncio.Redis, redis.asyncio.RedisCluster)):
        raise TypeError(
            f"client must be a redis.asyncio.Redis or RedisCluster (aiosem is asyncio-only), not "
            f"{type(value).__module__}.{type(value).__qualname__}"
        )
    return value


def _shown(value: object) -> str:
    """``value`` for a message; an int too long to print is described instead."""
    if isinstance(value, int) and value.bit_length() > 64:  # noqa: PLR2004 -- beyond any int Redis takes
        return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"
    return str(value)


def check_name(value: Any, argument: str = "name") -> str:
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{argument} must not be empty")
    try:
        value.encode()
    except UnicodeEncodeError as error:
        # A lone surrogate (from os.fsdecode, or a bad slice) cannot be sent
        # to Redis: refused here rather than by the first command.
        raise ValueError(
            f"{argument} must be valid Unicode, without lone surrogates; it has one at index {error.start}"
        ) from None
    return value


def check_label(value: Any) -> str | None:
    """A semaphore's label, shown by ``python -m aiosem status`` beside its holders and waiters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"label must be a str or None, not {type(value).__name__}")
    if not value or len(value) > LONGEST_LABEL:
        raise ValueError(f"label must be 1 to {LONGEST_LABEL} characters long, got {len(value)}")
    if not value.isprintable():
        bad = next(char for char in value if not char.isprintable())
        raise ValueError(f"label must be printable, without control characters; it has {bad!r}")
    return value


def check_limit(value: Any, argument: str = "limit") -> int:
    """A count of permits -- a limit, a weight -- as the scripts count exactly: an int from 1 to 2**53."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{argument} must be at least 1, got {_shown(value)}")
    if value > MOST_LIMIT:
        raise ValueError(f"{argument} must be at most 2**53 ({MOST_LIMIT:,}), got {_shown(value)}")
    return value


def _as_float(value: Any, argument: str, what: str) -> float:
    """``value`` as a float, or a TypeError naming ``argument`` if it is not ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be {what}, not {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _check_number(value: Any, argument: str) -> float:
    seconds = _as_float(value, argument, "a number of seconds")
    if math.isnan(seconds):
        raise ValueError(f"{argument} must not be NaN")
    return seconds


def check_timeout(value: Any, argument: str = "timeout") -> float:
    """A duration that must be positive and finite (a lease, a lock's TTL)."""
    seconds = _check_number(value, argument)
    if seconds <= 0 or seconds == value == math.inf:
        raise ValueError(f"{argument} must be a positive, finite number of seconds, got {_shown(value)}")
    if seconds < SHORTEST:
        raise ValueError(f"{argument} must be at least {SHORTEST:g} s (Redis counts in milliseconds), got {value}")
    if seconds > LONGEST:
        raise ValueError(f"{argument} must be at most {LONGEST:g} seconds, got {_shown(value)}")
    return seconds


def check_wait(value: Any, argument: str = "blocking_timeout") -> float | None:
    """How long to wait: ``None`` (or infinity) waits for ever, 0 not at all."""
    if value is None:
        return None
    seconds = _check_number(value, argument)
    if seconds < 0:
        raise ValueError(f"{argument} must not be negative, got {_shown(value)}")
    if seconds == value == math.inf:
        return None
    if seconds > LONGEST:
        raise ValueError(
            f"{argument} must be at most {LONGEST:g} seconds (None or math.inf waits for ever), got {_shown(value)}"
        )
    return seconds


#: The default waiter timeout, unless the lease is shorter.
WAITER_TIMEOUT: Final = 2.0


def check_upkeep(waiter_timeout: Any, refresh_interval: Any, timeout: float) -> tuple[float, float]:
    """A semaphore's waiter timeout and refresh interval, checked against its lease; ``None`` for the defaults."""
    if waiter_timeout is None:
        waiter_ttl = min(WAITER_TIMEOUT, timeout)
    else:
        waiter_ttl = check_timeout(waiter_timeout, "waiter_timeout")
        if waiter_ttl > timeout:
            raise ValueError(f"waiter_timeout must not exceed timeout ({timeout:g} s), got {waiter_timeout}")
    if refresh_interval is None:
        return waiter_ttl, timeout / 3
    interval = check_timeout(refresh_interval, "refresh_interval")
    if interval >= timeout:
        raise ValueError(f"refresh_interval must be shorter than timeout ({timeout:g} s), got {refresh_interval}")
    return waiter_ttl, interval


def check_now(value: Any, argument: str = "now") -> float | None:
    """A caller-supplied clock reading in seconds, or ``None`` for the server's."""
    if value is None:
        return None
    seconds = _check_number(value, argument)
    if math.isinf(seconds):
        raise ValueError(f"{argument} must be finite, got {_shown(value)}")
    return seconds


#: The most slots a rate limiter lets through at once: its script counts in doubles.
MOST_BURST: Final = 1_000_000


def check_positive(value: object, argument: str) -> float:
    number = _as_float(value, argument, "a number")
    if not 0 < number < math.inf:
        raise ValueError(f"{argument} must be a positive, finite number, got {_shown(value)}")
    return number


def check_interval(rate: float, per: float) -> None:
    """Refuse a rate whose interval, ``per / rate``, is longer than Redis can keep as a TTL (`LONGEST`)."""
    interval = per / rate
    if interval > LONGEST:
        raise ValueError(f"per / rate, the time between two calls, must be at most {LONGEST:g} s, got {interval:g}")


def check_burst(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"burst must be an int, not {type(value).__name__}")
    if not 1 <= value <= MOST_BURST:
        raise ValueError(f"burst must be between 1 and {MOST_BURST:,}, got {_shown(value)}")
    return value


def check_cost(value: object, burst: int | None = None, argument: str = "cost") -> int:
    """How many slots of a rate limiter one call takes: at least 1, and at most ``burst`` when it is known.

    A cost above the burst could never be granted: refused before anything is sent.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{argument} must be at least 1, got {_shown(value)}")
    if burst is not None and value > burst:
        raise ValueError(
            f"{argument} must be at most burst ({burst}), got {_shown(value)}: a call of that cost could never "
            "be granted"
        )
    return value


def check_weight(value: object) -> int:
    """What one permit weighs: an int from 1 to 2**53 (whether it fits the limit in force, Redis says)."""
    return check_limit(value, "weight")


def check_replicas(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"replicas must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"replicas must not be negative, got {_shown(value)}")
    return value


def check_callable(value: Any, argument: str) -> Callable[..., Any] | None:
    """A callback, or ``None`` for none."""
    if value is not None and not callable(value):
        raise TypeError(f"{argument} must be callable or None, not {type(value).__name__}")
    return value  # type: ignore[no-any-return]


def check_kind(value: object) -> Kind:
    if value == "fair":
        return "fair"
    if value == "locked":
        return "locked"
    raise ValueError(f"kind must be 'fair' or 'locked', got {value!r}")


def check_limits(value: object) -> dict[str, int]:
    """``{name: limit}``, each name and limit checked as the semaphores check them."""
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
    """A whole rate, each part checked as `AsyncRateLimiter` checks it: each on its own, in order, then together."""
    rate, per, burst = check_positive(rate, "rate"), check_positive(per, "per"), check_burst(burst)
    check_interval(rate, per)
    return Rate(rate, per, burst)


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
