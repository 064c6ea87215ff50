"""What mypy sees of the options taken as ``**options``: each keyword, and its type, checked.

Checked by ``mypy --strict`` with the rest of the repository, like
``decorated.py``: each call marked ``type: ignore[...]`` must be an error.
Never run: it only has to type-check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiosem import (
    AsyncFairSemaphore,
    AsyncLockedSemaphore,
    AsyncRateLimiter,
    configure,
    limit_concurrency,
    limit_rate,
    limiter,
    rate_limiter,
)
from aiosem.contrib.fastapi import limit

if TYPE_CHECKING:
    import redis.asyncio


def check(client: redis.asyncio.Redis) -> None:
    AsyncFairSemaphore(client, "db", 3, timeout=5, blocking_timeout=None, refresh_interval=1.0, on_lost=print)
    AsyncFairSemaphore(client, "db", 3, loop=None)  # type: ignore[call-arg]
    AsyncFairSemaphore(client, "db", 3, timeout="5")  # type: ignore[arg-type]
    AsyncFairSemaphore(client, "db", 3, lock_timeout=0.5)  # type: ignore[call-arg]
    AsyncLockedSemaphore(client, "db", 3, lock_timeout=0.5, replicas=1)
    AsyncRateLimiter(client, "api", 5, burst=2, clock=None)
    AsyncRateLimiter(client, "api", 5, timeout=1)  # type: ignore[call-arg]
    limiter("db", 3, kind="locked", timeout=None, client=client)
    limiter("db", 3, kind="other")  # type: ignore[arg-type]
    limit_concurrency("db", 3, clock=None)  # type: ignore[call-arg]
    limit_rate("api", 5, burst=2, prefix="app")
    rate_limiter("api", 5, per=2.0, burst=None)
    rate_limiter("api", 5, refresh_interval=1.0)  # type: ignore[call-arg]
    limit_rate("api", 5, burst=50, cost=len)
    limit_rate("api", 5, burst=50, cost=str)  # type: ignore[arg-type]
    rate_limiter("api", 5, burst=50, cost=10)
    rate_limiter("api", 5, burst=50, cost=len)  # type: ignore[arg-type]
    configure(url="redis://localhost", replicas=1, rates={"api": (5, 1.0)})
    configure(lock_timeout=1)  # type: ignore[call-arg]
    limit("db", 3, retry_after=2, refresh_interval=1.0)
    limit("db", 3, on_lost=print)  # type: ignore[call-overload]
