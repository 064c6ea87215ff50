"""What one acquire + release costs in round trips to Redis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from tests.harness.support import until_one_time_checks_done

if TYPE_CHECKING:
    from tests.harness.support import RedisServer


class CountingConnection(redis.asyncio.Connection):
    """Counts writes to the socket: one per round trip, pipelined or not."""

    writes = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).writes += 1
        await super().send_packed_command(command, check_health)


@pytest.mark.parametrize(
    ("cls", "round_trips"),
    # The locked class: a ticket when a blocking acquire arrives, then a lock
    # step of two round trips each for the acquire and the release.
    [(AsyncFairSemaphore, 2), (AsyncLockedSemaphore, 5)],
    ids=["fair", "locked"],
)
async def test_uncontended_acquire_and_release_round_trips(
    redis_server: RedisServer, cls: type[AsyncFairSemaphore | AsyncLockedSemaphore], round_trips: int
) -> None:
    pool = redis.asyncio.ConnectionPool(
        host=redis_server.host, port=redis_server.port, connection_class=CountingConnection
    )
    async with redis.asyncio.Redis.from_pool(pool) as client:
        sem = cls(client, f"round-trips-{cls.__name__}", 4)
        # The first cycle loads the scripts (the first EVALSHA meets NOSCRIPT),
        # and starts the eviction-policy check, which closes the pool connection
        # it used: the next cycle connects it again.
        for _ in range(2):
            warm = await sem.acquire()
            assert warm is not None
            await sem.release(warm)
            await until_one_time_checks_done()

        CountingConnection.writes = 0
        for _ in range(100):
            permit = await sem.acquire()
            assert permit is not None
            assert await sem.release(permit)
        assert CountingConnection.writes == 100 * round_trips


async def test_fair_semaphore_sends_one_evalsha_per_step(
    real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis
) -> None:
    sem = AsyncFairSemaphore(real_client, "commandstats", 4)
    warm = await sem.acquire()
    assert warm is not None
    await sem.release(warm)
    await admin_client.config_resetstat()
    for _ in range(50):
        permit = await sem.acquire()
        assert permit is not None
        await sem.release(permit)
    stats = await admin_client.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 100
    assert "cmdstat_eval" not in stats
