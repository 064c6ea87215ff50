"""Crawl many pages, at most two at a time per host, however many crawlers run.

The limit is per host: ``@limit_concurrency`` is given a function of the
call's arguments that names the semaphore, so each host gets one of its own.
Fetches are simulated (no network); each prints the host and how many
fetches of that host were running at that moment, in this process::

    python examples/crawler.py                            # memory:// (pip install 'aiosem[memory]')
    python examples/crawler.py redis://localhost:6379/0   # start several: the limit holds across them

The exit status is 1 if a host ever had more than two fetches at once.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections import Counter
from urllib.parse import urlsplit

import anyio

import aiosem

PER_HOST = 2
HOSTS = [f"site{number}.example" for number in range(5)]
running: Counter[str] = Counter()
peaks: Counter[str] = Counter()


def host_of(url: str) -> str:
    """The semaphore of a URL: one per host."""
    return f"crawler:host:{urlsplit(url).hostname}"


@aiosem.limit_concurrency(host_of, PER_HOST, timeout=30)
async def fetch(url: str) -> int:
    host = urlsplit(url).hostname or ""
    running[host] += 1
    peaks[host] = max(peaks[host], running[host])
    try:
        print(f"{host}: fetching {url} ({running[host]} running)")
        await anyio.sleep(random.uniform(0.01, 0.05))  # the network, simulated
        return len(url)
    finally:
        running[host] -= 1


async def crawl(url: str) -> int:
    aiosem.configure(url=url)
    try:
        pages = [f"https://{random.choice(HOSTS)}/page/{number}" for number in range(40)]
        sizes = await asyncio.gather(*(fetch(page) for page in pages))
        print(f"fetched {len(sizes)} pages; most at once per host: {dict(sorted(peaks.items()))}")
    finally:
        await aiosem.aclose()
    return 1 if max(peaks.values()) > PER_HOST else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(crawl(sys.argv[1] if len(sys.argv) > 1 else "memory://")))
