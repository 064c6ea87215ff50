"""A holder that dies without releasing loses its permit when its lease runs out."""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from typing import TYPE_CHECKING

import anyio
import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore

if TYPE_CHECKING:
    import redis.asyncio

    from tests.harness.support import RedisServer

LEASE = 1.0

HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    import redis.asyncio
    import aiosem

    async def main(url, cls, name, lease):
        client = redis.asyncio.Redis.from_url(url)
        sem = getattr(aiosem, cls)(client, name, 1, timeout=float(lease))
        permit = await sem.acquire()
        print(permit.fencing_token, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
async def test_a_killed_holders_permit_is_reclaimed_after_its_lease(
    redis_server: RedisServer, real_client: redis.asyncio.Redis, cls: type[AsyncFairSemaphore | AsyncLockedSemaphore]
) -> None:
    name = f"crash-{cls.__name__}"
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, redis_server.url, cls.__name__, name, str(LEASE),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout is not None
    with anyio.fail_after(30):
        token = int(await holder.stdout.readline())
    holder.send_signal(signal.SIGKILL)
    await holder.wait()
    killed_at = anyio.current_time()

    sem = cls(real_client, name, 1, timeout=LEASE)
    assert await sem.acquire(blocking=False) is None  # the dead holder's lease still runs
    permit = await sem.acquire(blocking_timeout=LEASE + 5)
    assert permit is not None
    assert anyio.current_time() - killed_at < LEASE + 1  # generous: the lease plus scheduling noise
    assert permit.fencing_token > token
    await sem.release(permit)
