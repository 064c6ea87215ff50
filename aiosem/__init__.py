"""Distributed counting semaphores on Redis, for asyncio.

Many processes on many machines share one limit -- three concurrent queries
against a database, five calls to a paid API -- kept in Redis, with leases so
that a crashed holder frees its permit.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from ._exceptions import AcquireTimeout as AcquireTimeout
from ._exceptions import LimitMismatch as LimitMismatch
from ._exceptions import PermitLost as PermitLost
from ._exceptions import SemaphoreError as SemaphoreError
from ._fair import AsyncFairSemaphore as AsyncFairSemaphore
from ._locked import AsyncLockedSemaphore as AsyncLockedSemaphore
from ._semaphore import Permit as Permit
from ._semaphore import SemaphoreStatistics as SemaphoreStatistics

__all__ = [
    "AcquireTimeout",
    "AsyncFairSemaphore",
    "AsyncLockedSemaphore",
    "LimitMismatch",
    "Permit",
    "PermitLost",
    "SemaphoreError",
    "SemaphoreStatistics",
    "__version__",
]

__version__ = _version("aiosem")

for _name in __all__[:-1]:
    globals()[_name].__module__ = __name__
del _name
