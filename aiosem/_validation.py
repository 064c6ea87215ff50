"""Argument checks shared by the semaphores and the recipes.

Each check raises before anything reaches Redis, with a message that names
the argument, and returns the value in the form the caller stores.
"""

from __future__ import annotations

import math
from typing import Any, Final

#: The longest duration accepted: Redis keeps millisecond TTLs in 64 bits,
#: and no lease or lock is meant to outlive its application.
LONGEST: Final = 1e9


def check_name(value: Any, argument: str = "name") -> str:
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{argument} must not be empty")
    return value


def check_limit(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"limit must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"limit must be at least 1, got {value}")
    return value


def _check_number(value: Any, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number of seconds, not {type(value).__name__}")
    if math.isnan(value):
        raise ValueError(f"{argument} must not be NaN")
    return float(value)


def check_timeout(value: Any, argument: str = "timeout") -> float:
    """A duration that must be positive and finite (a lease, a lock's TTL)."""
    seconds = _check_number(value, argument)
    if seconds <= 0 or math.isinf(seconds):
        raise ValueError(f"{argument} must be a positive, finite number of seconds, got {value}")
    if seconds > LONGEST:
        raise ValueError(f"{argument} must be at most {LONGEST:g} seconds, got {value}")
    return seconds


def check_wait(value: Any, argument: str = "blocking_timeout") -> float | None:
    """How long to wait: ``None`` (or infinity) waits for ever, 0 not at all."""
    if value is None:
        return None
    seconds = _check_number(value, argument)
    if seconds < 0:
        raise ValueError(f"{argument} must not be negative, got {value}")
    return None if math.isinf(seconds) else seconds


def check_now(value: Any) -> float | None:
    """A caller-supplied clock reading in seconds, or ``None`` for the server's."""
    if value is None:
        return None
    seconds = _check_number(value, "now")
    if math.isinf(seconds):
        raise ValueError(f"now must be finite, got {value}")
    return seconds


#: The most slots a rate limiter lets through at once: its script counts in doubles.
MOST_BURST: Final = 1_000_000


def check_positive(value: object, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument} must be a number, not {type(value).__name__}")
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(f"{argument} must be a positive, finite number, got {value}")
    return float(value)


def check_burst(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"burst must be an int, not {type(value).__name__}")
    if not 1 <= value <= MOST_BURST:
        raise ValueError(f"burst must be between 1 and {MOST_BURST:,}, got {value}")
    return value


def check_replicas(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"replicas must be an int, not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"replicas must not be negative, got {value}")
    return value
