"""A process's first calls into aiosem run inside its event loop: they import nothing there.

An import inside a running loop stalls every task of that loop -- the other
requests of a web server, at its first limited one -- for as long as the
import takes. What aiosem's calls need is imported with ``import aiosem``.
Each test runs a fresh interpreter, as a process starting up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.harness.support import RedisServer

FIRST_CALLS = """
import asyncio, json, sys
import redis.asyncio
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter

async def main(url):
    client = redis.asyncio.Redis.from_url(url, socket_timeout=5)
    before = set(sys.modules)
    for cls in (AsyncFairSemaphore, AsyncLockedSemaphore):
        sem = cls(client, "first-call", 2)
        async with sem:
            pass
        permit = await sem.acquire()
        await sem.release(permit)
        await sem.holders()
        await sem.aclose()
    limiter = AsyncRateLimiter(client, "first-call", 100)
    await limiter.acquire()
    await limiter.aclose()
    await client.aclose()
    print(json.dumps(sorted(set(sys.modules) - before)))

asyncio.run(main(sys.argv[1]))
"""

#: What a client's first connection imports, whoever makes it: asyncio's IDNA encoding of a host name.
NOT_AIOSEMS = ("encodings.", "stringprep", "unicodedata")


def test_the_first_calls_of_a_fresh_process_import_nothing_inside_its_event_loop(redis_server: RedisServer) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", FIRST_CALLS, redis_server.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    imported = [name for name in json.loads(completed.stdout) if not name.startswith(NOT_AIOSEMS)]
    assert imported == []
