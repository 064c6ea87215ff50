"""How closely `AsyncRateLimiter` keeps its rate when four processes share it.

Four processes (this file run again with a hidden ``--role`` flag) of
``--coroutines`` coroutines each call ``acquire()`` in a loop on one
``AsyncRateLimiter(rate=5, per=1, burst=1)`` for ``--duration`` seconds,
all starting at the same instant, and note each grant with
``time.perf_counter()`` -- ``CLOCK_MONOTONIC`` on Linux, so the notes of
all processes compare. A coroutine stops asking once its slot would come
after the end (``blocking_timeout``), so no grant falls outside the run.
Reported:

* ``max in 1 s``: the most grants in any window of ``per`` seconds, sliding
  over the grant times, against ``rate + burst`` (the most GCRA allows in
  a window that starts just before a slot, in the server's time);
* ``total / ideal``: grants against ``rate * duration + burst``;
* ``gap min/p50``: the time between two consecutive grants, against the
  emission interval ``per / rate``: the median shows the pace, the minimum
  how close a late-noted grant came to the next one.

It runs against a private ``redis-server`` (``$AIOSEM_REDIS_SERVER``, else
the one on ``PATH``) on a free loopback port, stopped at the end -- it never
touches port 6379 -- and against fakeredis served over TCP, as
``python -m aiosem demo`` does (skipped if fakeredis is missing).

Run it::

    python benchmarks/bench_rate.py                    # 2 x 10 s
    python benchmarks/bench_rate.py --duration 5 --json benchmarks/results/rate.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import redis.asyncio
from harness import RedisServer, environment, markdown_table, redis_server_binary, write_report

from aiosem import AsyncRateLimiter
from aiosem._demo import embedded_server

if TYPE_CHECKING:
    from collections.abc import Sequence

SCRIPT: Final = str(Path(__file__).resolve())
PROCESSES: Final = 4
RATE: Final = 5.0
PER: Final = 1.0
BURST: Final = 1
NAME: Final = "bench-rate"
#: Time given to the processes to start before the common start.
STARTUP: Final = 2.0


@dataclass(frozen=True, slots=True)
class RateResult:
    server: str
    processes: int
    coroutines: int
    duration_s: float
    rate: float
    per: float
    burst: int
    grants: int
    ideal: float
    total_vs_ideal: float
    max_in_window: int
    allowed_in_window: float
    interval_ms: float
    gap_min_ms: float
    gap_p50_ms: float


# --- the worker processes --------------------------------------------------------------


async def role_worker(url: str, coroutines: int, start: float, end: float) -> list[float]:
    """Take slots from ``start`` until the next would come after ``end``; the grant times."""
    client = redis.asyncio.Redis.from_url(url)
    limiter = AsyncRateLimiter(client, NAME, RATE, PER, burst=BURST)
    grants: list[float] = []

    async def take() -> None:
        while (left := end - time.perf_counter()) > 0 and await limiter.acquire(blocking_timeout=left):
            grants.append(time.perf_counter())

    try:
        await client.ping()  # connected before the start
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        await asyncio.gather(*(take() for _ in range(coroutines)))
    finally:
        await client.aclose()
    return grants


# --- measuring ---------------------------------------------------------------------------


def max_in_window(grants: Sequence[float], window: float) -> int:
    """The most grants in any half-open window ``[t, t + window)``, t a grant time."""
    return max((bisect.bisect_left(grants, at + window) - i for i, at in enumerate(grants)), default=0)


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


async def measure(server: str, url: str, coroutines: int, duration: float) -> RateResult:
    control = redis.asyncio.Redis.from_url(url)
    await control.delete(AsyncRateLimiter(control, NAME, RATE).key)
    await control.aclose()
    start = time.perf_counter() + STARTUP
    arguments = ["--role", "worker", "--url", url, "--coroutines", str(coroutines)]
    arguments += ["--start", repr(start), "--end", repr(start + duration)]
    workers = [
        await asyncio.create_subprocess_exec(sys.executable, SCRIPT, *arguments, stdout=asyncio.subprocess.PIPE)
        for _ in range(PROCESSES)
    ]
    outputs = [await worker.communicate() for worker in workers]
    if any(worker.returncode for worker in workers):
        raise RuntimeError(f"a worker failed: exit codes {[worker.returncode for worker in workers]}")
    grants = sorted(at for stdout, _ in outputs for at in json.loads(stdout))
    interval = PER / RATE
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(grants))
    ideal = RATE * duration / PER + BURST
    return RateResult(
        server=server,
        processes=PROCESSES,
        coroutines=coroutines,
        duration_s=duration,
        rate=RATE,
        per=PER,
        burst=BURST,
        grants=len(grants),
        ideal=ideal,
        total_vs_ideal=round(len(grants) / ideal, 3),
        max_in_window=max_in_window(grants, PER),
        allowed_in_window=RATE + BURST,
        interval_ms=round(interval * 1000, 2),
        gap_min_ms=round(gaps[0] * 1000, 2),
        gap_p50_ms=round(percentile(gaps, 0.5) * 1000, 2),
    )


def table(results: Sequence[RateResult]) -> str:
    header = ["server", "processes x coroutines", "grants", "ideal", "total / ideal", "max in 1 s", "allowed"]
    header += ["interval", "gap min", "gap p50"]
    rows = [
        [
            r.server,
            f"{r.processes} x {r.coroutines}",
            f"{r.grants}",
            f"{r.ideal:g}",
            f"{r.total_vs_ideal:.3f}",
            f"{r.max_in_window}",
            f"{r.allowed_in_window:g}",
            f"{r.interval_ms:.0f} ms",
            f"{r.gap_min_ms:.2f} ms",
            f"{r.gap_p50_ms:.2f} ms",
        ]
        for r in results
    ]
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per server (default 10)")
    parser.add_argument("--coroutines", type=int, default=8, help="coroutines per process (default 8)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--end", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        grants = asyncio.run(role_worker(args.url, args.coroutines, args.start, args.end))
        print(json.dumps(grants))
        return 0
    binary = redis_server_binary()
    results: list[RateResult] = []
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(binary, Path(directory)) as server,
    ):
        print(f"  redis-server {server.version} ...", file=sys.stderr, flush=True)
        results.append(asyncio.run(measure("redis-server", server.url, args.coroutines, args.duration)))
        version = server.version
    try:
        with embedded_server() as url:
            print("  fakeredis over TCP ...", file=sys.stderr, flush=True)
            results.append(asyncio.run(measure("fakeredis (TCP)", url, args.coroutines, args.duration)))
    except ModuleNotFoundError as error:
        print(f"  fakeredis skipped: {error}", file=sys.stderr)
    print()
    print(
        f"AsyncRateLimiter(rate={RATE:g}, per={PER:g}, burst={BURST}) shared by {PROCESSES} processes "
        f"of {args.coroutines} coroutines, for {args.duration:g} s"
    )
    print()
    print(table(results))
    if args.json is not None:
        report = {**environment([version]), "results": [asdict(result) for result in results]}
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
