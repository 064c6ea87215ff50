"""What a failover does to permits, and what ``replicas=1`` costs to prevent it.

On a master, its replica and three sentinels of its own (`tests.harness.topology.SentinelGroup`),
all on loopback, for `AsyncFairSemaphore` and `AsyncLockedSemaphore`:

* **forgotten permits**: ``--rounds`` failovers, each while a task takes
  permits one after another (`tests.harness.failover.count_forgotten`); afterwards
  every permit the task was told it got is looked up on the new master.
  Both by ``SENTINEL FAILOVER`` and by SIGKILL of the master, with
  ``replicas=0`` (the default) and ``replicas=1``.
* **the cost of waiting for the replica**: one coroutine's acquire + release
  cycles/s and p50 cycle time, and 64 coroutines' cycles/s at limit 16, with
  ``replicas=0`` and ``replicas=1``, in the same run on the same pair.

Run it::

    python benchmarks/bench_failover.py                    # about 4 minutes
    python benchmarks/bench_failover.py --rounds 5 --json benchmarks/results/failover.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from harness import How, Semaphore, SentinelGroup, count_forgotten, environment, find_redis_server, markdown_table

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._urls import close, connect

if TYPE_CHECKING:
    from aiosem._connection import Client

CLASSES: Final[dict[str, Semaphore]] = {"fair": AsyncFairSemaphore, "locked": AsyncLockedSemaphore}


@dataclass(frozen=True, slots=True)
class ForgottenRow:
    kind: str
    how: How
    replicas: int
    rounds: int
    granted: int
    forgotten: int
    not_replicated: int
    seconds_per_round: float
    outage_median_s: float
    outage_max_s: float


@dataclass(frozen=True, slots=True)
class CostRow:
    kind: str
    replicas: int
    one_coroutine_cycles_per_s: float
    one_coroutine_p50_ms: float
    many_coroutines_cycles_per_s: float


async def cycles(client: Client, cls: Semaphore, replicas: int, coroutines: int, seconds: float) -> list[float]:
    """Acquire + release cycles for ``seconds``; the duration of each, in seconds."""
    semaphore = cls(client, f"cost-{replicas}-{coroutines}", 16, replicas=replicas)
    durations: list[float] = []
    until = time.perf_counter() + seconds

    async def loop() -> None:
        while (start := time.perf_counter()) < until:
            async with semaphore:
                pass
            durations.append(time.perf_counter() - start)

    await asyncio.gather(*(loop() for _ in range(coroutines)))
    await semaphore.aclose()
    return durations


async def cost(group: SentinelGroup, kind: str, replicas: int, seconds: float) -> CostRow:
    client = connect(group.url)
    try:
        await cycles(client, CLASSES[kind], replicas, 1, 0.3)  # scripts loaded, connections made
        one = await cycles(client, CLASSES[kind], replicas, 1, seconds)
        many = await cycles(client, CLASSES[kind], replicas, 64, seconds)
    finally:
        await close(client)
    return CostRow(kind, replicas, len(one) / seconds, statistics.median(one) * 1000, len(many) / seconds)


async def measure(binary: str, rounds: int, seconds: float) -> tuple[list[ForgottenRow], list[CostRow], str]:
    forgotten: list[ForgottenRow] = []
    costs: list[CostRow] = []
    with tempfile.TemporaryDirectory() as directory, SentinelGroup(binary, Path(directory)) as group:
        version = group.master().version
        costs += [await cost(group, kind, replicas, seconds) for kind in CLASSES for replicas in (0, 1)]
        for kind in CLASSES:
            for how in ("failover", "kill"):
                for replicas in (0, 1):
                    result = await count_forgotten(group, CLASSES[kind], replicas=replicas, rounds=rounds, how=how)
                    row = ForgottenRow(
                        kind,
                        how,
                        replicas,
                        rounds,
                        result.granted,
                        result.forgotten,
                        result.not_replicated,
                        result.seconds / rounds,
                        statistics.median(result.outages),
                        max(result.outages),
                    )
                    print(row, flush=True)
                    forgotten.append(row)
    return forgotten, costs, version


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=20, help="failovers per row (default 20)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cost row (default 3)")
    parser.add_argument("--json", type=Path, help="write the results here")
    arguments = parser.parse_args()
    binary = find_redis_server()
    if binary is None:
        print("no redis-server: install it or set AIOSEM_REDIS_SERVER", file=sys.stderr)
        return 1
    forgotten, costs, version = asyncio.run(measure(binary, arguments.rounds, arguments.seconds))
    print()
    print(
        markdown_table(
            [
                "semaphore",
                "failover by",
                "replicas",
                "rounds",
                "permits granted",
                "forgotten",
                "NotReplicated",
                "no grant for (median / max)",
            ],
            [
                [
                    r.kind,
                    r.how,
                    str(r.replicas),
                    str(r.rounds),
                    f"{r.granted:,}",
                    f"{r.forgotten:,}",
                    f"{r.not_replicated:,}",
                    f"{r.outage_median_s:.2f} s / {r.outage_max_s:.2f} s",
                ]
                for r in forgotten
            ],
        )
    )
    print()
    baseline = {row.kind: row for row in costs if row.replicas == 0}
    print(
        markdown_table(
            ["semaphore", "replicas", "1 coroutine: cycles/s", "p50 ms", "64 coroutines: cycles/s", "vs replicas=0"],
            [
                [
                    r.kind,
                    str(r.replicas),
                    f"{r.one_coroutine_cycles_per_s:,.0f}",
                    f"{r.one_coroutine_p50_ms:.3f}",
                    f"{r.many_coroutines_cycles_per_s:,.0f}",
                    f"{r.one_coroutine_cycles_per_s / baseline[r.kind].one_coroutine_cycles_per_s:.2f}x / "
                    f"{r.many_coroutines_cycles_per_s / baseline[r.kind].many_coroutines_cycles_per_s:.2f}x",
                ]
                for r in costs
            ],
        )
    )
    if arguments.json:
        arguments.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "environment": environment(version),
            "forgotten": [asdict(row) for row in forgotten],
            "cost": [asdict(row) for row in costs],
        }
        arguments.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
