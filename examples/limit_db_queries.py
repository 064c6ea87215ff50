"""Limit concurrent database queries across processes to three.

Run it in several terminals at once against the same Redis; all of them
together never run more than three queries at a time::

    python examples/limit_db_queries.py redis://localhost:6379/0
"""

from __future__ import annotations

import asyncio
import random
import sys

import redis.asyncio

from aiosem import AsyncFairSemaphore


async def query(db: AsyncFairSemaphore, number: int) -> None:
    async with db as permit:
        # Hand the fencing token to the database with each write, so that a
        # holder whose lease ran out while it was stalled is refused.
        print(f"query {number} runs with fencing token {permit.fencing_token}")
        await asyncio.sleep(random.uniform(0.05, 0.2))


async def main(url: str) -> None:
    client = redis.asyncio.Redis.from_url(url)
    db = AsyncFairSemaphore(client, "db", limit=3, timeout=10, blocking_timeout=30)
    try:
        await asyncio.gather(*(query(db, number) for number in range(12)))
    finally:
        await client.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "redis://localhost:6379/0"))
