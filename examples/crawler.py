"""Crawl many pages, politely: two at a time per host, and one start every 0.1 s per host.

The limits are per host: ``@limit_concurrency`` and ``@limit_rate`` are
given a function of the call's arguments that names the semaphore and the
rate limiter, so each host gets its own -- as a robots.txt with
``Crawl-delay`` asks, here scaled down to 0.1 s so that the example runs
in a few seconds. ``@limit_concurrency`` goes on top: a fetch takes its
permit first, then waits for its slot and starts as soon as it comes.

Fetches are simulated (no network); each prints the host and how many
fetches of that host were running at that moment, in this process::

    python examples/crawler.py                            # memory:// (pip install 'aiosem[memory]')
    python examples/crawler.py redis://localhost:6379/0   # start several: the limits hold across them

The exit status is 1 if a host ever had more than two fetches at once. The
closest two starts of one host are printed too: about the crawl delay, or a
little less when the machine is busy, since a start is noted when its wait
ends.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
from collections import Counter, defaultdict
from urllib.parse import urlsplit

import anyio

import aiosem

PER_HOST = 2
#: Seconds between two fetches of one host (robots.txt ``Crawl-delay``).
CRAWL_DELAY = 0.1
HOSTS = [f"site{number}.example" for number in range(5)]
running: Counter[str] = Counter()
peaks: Counter[str] = Counter()
starts: defaultdict[str, list[float]] = defaultdict(list)


def host_of(url: str) -> str:
    """The semaphore and the rate limiter of a URL: one of each per host."""
    return f"crawler:host:{urlsplit(url).hostname}"


@aiosem.limit_concurrency(host_of, PER_HOST, timeout=30)
@aiosem.limit_rate(host_of, 1, per=CRAWL_DELAY)
async def fetch(url: str) -> int:
    host = urlsplit(url).hostname or ""
    starts[host].append(anyio.current_time())
    running[host] += 1
    peaks[host] = max(peaks[host], running[host])
    try:
        print(f"{host}: fetching {url} ({running[host]} running)")
        await anyio.sleep(random.uniform(0.01, 0.3))  # the network, simulated
        return len(url)
    finally:
        running[host] -= 1


def closest_starts() -> float:
    """The shortest time between two starts of one host, in this process."""
    gaps = [b - a for times in starts.values() for a, b in itertools.pairwise(sorted(times))]
    return min(gaps, default=CRAWL_DELAY)


async def crawl(url: str) -> int:
    aiosem.configure(url=url)
    try:
        pages = [f"https://{random.choice(HOSTS)}/page/{number}" for number in range(40)]
        sizes = await asyncio.gather(*(fetch(page) for page in pages))
        print(f"fetched {len(sizes)} pages; most at once per host: {dict(sorted(peaks.items()))}")
        print(f"closest starts of one host: {closest_starts():.3f} s (crawl delay {CRAWL_DELAY} s)")
    finally:
        await aiosem.aclose()
    # Only the concurrency limit decides the exit status: starts are noted
    # after each wait ends, so on a busy machine two can be noted closer
    # together than their slots were.
    return 1 if max(peaks.values()) > PER_HOST else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(crawl(sys.argv[1] if len(sys.argv) > 1 else "memory://")))
