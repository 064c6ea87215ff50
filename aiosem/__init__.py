"""Distributed counting semaphores on Redis, for asyncio.

Many processes on many machines share one limit -- three concurrent queries
against a database, five calls to a paid API -- kept in Redis, with leases so
that a crashed holder frees its permit.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from ._config import configure as configure
from ._decorators import current_permit as current_permit
from ._decorators import limit_concurrency as limit_concurrency
from ._decorators import limit_rate as limit_rate
from ._decorators import limiter as limiter
from ._decorators import rate_limiter as rate_limiter
from ._exceptions import AcquireTimeout as AcquireTimeout
from ._exceptions import LimitMismatch as LimitMismatch
from ._exceptions import LimitNotSet as LimitNotSet
from ._exceptions import NotReplicated as NotReplicated
from ._exceptions import OutOfMemory as OutOfMemory
from ._exceptions import PermitLost as PermitLost
from ._exceptions import RedisUnavailable as RedisUnavailable
from ._exceptions import SemaphoreError as SemaphoreError
from ._fair import AsyncFairSemaphore as AsyncFairSemaphore
from ._locked import AsyncLockedSemaphore as AsyncLockedSemaphore
from ._loop_cache import aclose as aclose
from ._observing import LimiterEvent as LimiterEvent
from ._observing import add_observer as add_observer
from ._observing import remove_observer as remove_observer
from ._permit import Permit as Permit
from ._rate import AsyncRateLimiter as AsyncRateLimiter
from ._semaphore import SemaphoreStatistics as SemaphoreStatistics

__all__ = [
    "AcquireTimeout",
    "AsyncFairSemaphore",
    "AsyncLockedSemaphore",
    "AsyncRateLimiter",
    "LimitMismatch",
    "LimitNotSet",
    "LimiterEvent",
    "NotReplicated",
    "OutOfMemory",
    "Permit",
    "PermitLost",
    "RedisUnavailable",
    "SemaphoreError",
    "SemaphoreStatistics",
    "__version__",
    "aclose",
    "add_observer",
    "configure",
    "current_permit",
    "limit_concurrency",
    "limit_rate",
    "limiter",
    "rate_limiter",
    "remove_observer",
]

__version__ = _version("aiosem")

for _name in __all__:
    if _name != "__version__":
        globals()[_name].__module__ = __name__
del _name
