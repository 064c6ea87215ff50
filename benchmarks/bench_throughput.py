"""Throughput and acquire latency of aiosem's semaphores against a raw redis.asyncio floor.

Each scenario runs ``permit = await sem.acquire(); await sem.release(permit)``
in a loop, from 1 or 64 coroutines sharing one client, for a fixed time, and
reports completed cycles per second and the p50/p99 time ``acquire`` took:

* ``raw``: two EVALSHA round trips per cycle (a one-line ZADD script, then a
  one-line ZREM script) -- the most any Redis-backed semaphore driven from
  redis.asyncio can do, and the baseline every other row is divided by;
* ``AsyncFairSemaphore`` and ``AsyncLockedSemaphore`` with limit 16 and with
  limit 1 (a mutex) under contention (64 coroutines), and with limit 16
  uncontended (1 coroutine).

The baseline is measured in the same run because on a small machine it moves
20-40 % from one run to the next. When uvloop is installed, every scenario
runs again on a uvloop event loop, against the same server, and the report
says what that changes: each scenario's ratio to its own run on asyncio's
loop, and to the raw loop on uvloop. The script also counts, with ``INFO
commandstats``, how many EVALSHA calls one uncontended `AsyncFairSemaphore`
cycle makes, and prints ``redis-benchmark``'s PING rate when that tool is
installed, as the server's own ceiling.

It starts a private ``redis-server`` (``$AIOSEM_REDIS_SERVER``, else the one on
``PATH``) on a free loopback port, with no persistence, and stops it at the
end; it never touches port 6379.

Run it::

    python benchmarks/bench_throughput.py                    # 3 s per scenario
    python benchmarks/bench_throughput.py --duration 10 --json benchmarks/results/throughput.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, TypeVar

from harness import (
    GRACE,
    Cycler,
    RawLoop,
    RedisServer,
    environment,
    markdown_table,
    new_client,
    non_negative,
    package_version,
    percentile,
    positive,
    redis_benchmark_ping,
    redis_server_binary,
    run_phase,
    write_report,
)

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore

if TYPE_CHECKING:
    from collections.abc import Sequence

#: The semaphores' limit, unless a scenario says otherwise.
LIMIT: Final = 16
#: Uncontended cycles counted with INFO commandstats.
COUNTED_CYCLES: Final = 1000


Kind = Literal["raw", "fair", "locked"]

#: (kind, coroutines, limit), in the order they run; the raw loop has no limit.
SCENARIOS: Final[tuple[tuple[Kind, int, int | None], ...]] = (
    ("raw", 64, None),
    ("fair", 64, LIMIT),
    ("locked", 64, LIMIT),
    ("fair", 64, 1),
    ("locked", 64, 1),
    ("raw", 1, None),
    ("fair", 1, LIMIT),
    ("locked", 1, LIMIT),
)

NAMES: Final[dict[Kind, str]] = {
    "raw": "raw EVALSHA loop",
    "fair": "AsyncFairSemaphore",
    "locked": "AsyncLockedSemaphore",
}


T = TypeVar("T")


def label(kind: Kind, limit: int | None) -> str:
    return NAMES[kind] if limit is None else f"{NAMES[kind]} (limit {limit})"


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    kind: Kind
    coroutines: int
    limit: int | None
    cycles: int
    seconds: float
    cycles_per_second: float
    acquire_p50_ms: float
    acquire_p99_ms: float
    #: cycles/s over the raw loop's with as many coroutines, in this run, on the same event loop.
    ratio_to_raw: float | None = None
    #: The event loop: asyncio's own, or uvloop's.
    loop: str = "asyncio"
    #: On uvloop: cycles/s over the same scenario's on asyncio's loop, in this run.
    ratio_to_asyncio: float | None = None


@dataclass(frozen=True, slots=True)
class CommandCount:
    cycles: int
    evalsha_per_cycle: float
    eval_per_cycle: float


# --- the server ------------------------------------------------------------


# --- the measurements ----------------------------------------------------------


async def measure(
    cycler: Cycler[T], scenario: tuple[Kind, int, int | None], duration: float, warmup: float
) -> ScenarioResult:
    kind, coroutines, limit = scenario
    if warmup > 0:
        # Opens the pool's connections and loads the scripts (a first EVALSHA
        # gets NOSCRIPT), neither of which is what a steady state costs.
        await run_phase(cycler, coroutines, warmup)
    phase = await run_phase(cycler, coroutines, duration)
    latencies = sorted(phase.latencies)
    return ScenarioResult(
        scenario=label(kind, limit),
        kind=kind,
        coroutines=coroutines,
        limit=limit,
        cycles=phase.cycles,
        seconds=round(phase.seconds, 3),
        cycles_per_second=round(phase.cycles / phase.seconds, 1),
        acquire_p50_ms=round(percentile(latencies, 0.50) * 1000, 3),
        acquire_p99_ms=round(percentile(latencies, 0.99) * 1000, 3),
    )


async def run_scenario(
    port: int, scenario: tuple[Kind, int, int | None], duration: float, warmup: float
) -> ScenarioResult:
    # A client and a semaphore name of its own, so no scenario inherits
    # another's connections or leftover permits.
    kind, coroutines, limit = scenario
    name = f"bench-{kind}-{coroutines}-{limit}"
    client = new_client(port)
    try:
        if limit is None:
            return await measure(await RawLoop.load(client, f"bench:{{{name}}}"), scenario, duration, warmup)
        cls = AsyncFairSemaphore if kind == "fair" else AsyncLockedSemaphore
        return await measure(cls(client, name, limit), scenario, duration, warmup)
    finally:
        await client.aclose()


async def sequential_cycles(cycler: Cycler[T], cycles: int) -> None:
    for _ in range(cycles):
        permit = await cycler.acquire()
        if permit is None:
            raise RuntimeError("an uncontended acquire failed")
        await cycler.release(permit)


async def count_fair_round_trips(port: int, cycles: int = COUNTED_CYCLES) -> CommandCount:
    """EVALSHA (and EVAL) calls per uncontended `AsyncFairSemaphore` cycle, from INFO commandstats."""
    client = new_client(port)
    try:
        semaphore = AsyncFairSemaphore(client, "bench-commandstats", LIMIT)
        # Loads the scripts first, so a NOSCRIPT fallback is not counted as a per-cycle cost.
        await asyncio.wait_for(sequential_cycles(semaphore, 10), timeout=GRACE)
        before = await client.info("commandstats")
        await asyncio.wait_for(sequential_cycles(semaphore, cycles), timeout=GRACE + cycles * 0.01)
        after = await client.info("commandstats")
    finally:
        await client.aclose()

    def calls(command: str) -> int:
        key = f"cmdstat_{command}"
        return int(after.get(key, {}).get("calls", 0)) - int(before.get(key, {}).get("calls", 0))

    return CommandCount(cycles, calls("evalsha") / cycles, calls("eval") / cycles)


async def run_all(port: int, duration: float, warmup: float, loop: str) -> tuple[list[ScenarioResult], CommandCount]:
    results: list[ScenarioResult] = []
    for scenario in SCENARIOS:
        kind, coroutines, limit = scenario
        print(f"  {label(kind, limit)}, {coroutines} coroutine(s), on {loop} ...", file=sys.stderr, flush=True)
        result = await run_scenario(port, scenario, duration, warmup)
        results.append(replace(result, loop=loop))
    raw_rates = {result.coroutines: result.cycles_per_second for result in results if result.kind == "raw"}
    results = [
        replace(result, ratio_to_raw=round(result.cycles_per_second / raw_rates[result.coroutines], 3))
        if raw_rates.get(result.coroutines)
        else result
        for result in results
    ]
    return results, await count_fair_round_trips(port)


def on_uvloop(port: int, duration: float, warmup: float, on_asyncio: Sequence[ScenarioResult]) -> list[ScenarioResult]:
    """Every scenario again on a uvloop event loop, each with its ratio to its run on asyncio's; [] without uvloop."""
    try:
        import uvloop  # noqa: PLC0415 -- optional: measured only where installed
    except ImportError:
        print("uvloop is not installed: its runs are skipped", file=sys.stderr)
        return []
    results, _ = uvloop.run(run_all(port, duration, warmup, "uvloop"))
    return [
        replace(result, ratio_to_asyncio=round(result.cycles_per_second / before.cycles_per_second, 3))
        for result, before in zip(results, on_asyncio, strict=True)
    ]


# --- the report ------------------------------------------------------------


def results_table(results: Sequence[ScenarioResult]) -> str:
    header = ("scenario", "loop", "coroutines", "cycles/s", "vs raw", "vs asyncio", "acquire p50 ms", "acquire p99 ms")
    rows = [
        (
            result.scenario,
            result.loop,
            str(result.coroutines),
            f"{result.cycles_per_second:,.0f}",
            "n/a" if result.ratio_to_raw is None else f"{result.ratio_to_raw:.2f}",
            "" if result.ratio_to_asyncio is None else f"{result.ratio_to_asyncio:.2f}",
            f"{result.acquire_p50_ms:.3f}",
            f"{result.acquire_p99_ms:.3f}",
        )
        for result in results
    ]
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=positive, default=3.0, help="seconds measured per scenario (default 3)")
    parser.add_argument(
        "--warmup", type=non_negative, default=0.5, help="unmeasured seconds before each scenario (default 0.5)"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)

    binary = redis_server_binary()
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(binary, Path(directory)) as server,
    ):
        print(f"redis-server {server.version} on {server.host}:{server.port}", file=sys.stderr)
        # First, while the server is idle: the PING rate is the server's ceiling, not ours.
        ping = redis_benchmark_ping(server.port)
        results, commands = asyncio.run(run_all(server.port, args.duration, args.warmup, "asyncio"))
        uvloop_results = on_uvloop(server.port, args.duration, args.warmup, results)

    print()
    print(results_table([*results, *uvloop_results]))
    print()
    if ping is None:
        print("redis-benchmark PING: not measured (redis-benchmark not on PATH)")
    else:
        print("redis-benchmark PING: " + ", ".join(f"{name} {rate:,.0f} requests/s" for name, rate in ping.items()))
    print(
        f"AsyncFairSemaphore, uncontended: {commands.evalsha_per_cycle:g} EVALSHA "
        f"(+ {commands.eval_per_cycle:g} EVAL) per acquire+release, over {commands.cycles} cycles"
    )

    if args.json is not None:
        report = {
            **environment(server.version),
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "limit": LIMIT,
            "redis_benchmark_ping": ping,
            "fair_commands_per_cycle": asdict(commands),
            "scenarios": [asdict(result) for result in results],
            "uvloop": {
                "version": package_version("uvloop"),
                "scenarios": [asdict(result) for result in uvloop_results],
            },
        }
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
