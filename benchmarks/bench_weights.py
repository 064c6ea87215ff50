"""What weighing permits costs: weighted against unweighted cycles, in the same run, at the same concurrency.

Each scenario runs ``permit = await sem.acquire(weight=w); await
sem.release(permit)`` from 64 coroutines sharing one client, for a fixed
time, and reports completed cycles per second. The scenarios hold the same
number of permits at once -- 16 -- so that what differs is the weighing
alone, not how many calls can run together:

* ``weight 1``: limit 16, every permit weighs 1 -- the baseline;
* ``weight 2``: limit 32, every permit weighs 2;
* ``weights 1-4``: limit 40, the weights 1, 2, 3 and 4 in turn (2.5 on
  average: 16 held at once), so that heads that do not fit hold back the
  queue behind them;
* ``weight 1, again``: the baseline once more, last: the spread between two
  runs of the same thing, against which to read the others' ratios.

Both classes are measured. On a small machine a run moves 20-40 % from the
next, so the scenarios of one class run in turn, ``--rounds`` times, and
each weighted scenario's ratio is taken to the baseline of the same round;
the report gives the median ratio and the median cycles/s.

It starts a private ``redis-server`` (``$AIOSEM_REDIS_SERVER``, else the one
on ``PATH``) on a free loopback port, with no persistence, and stops it at
the end; it never touches port 6379.

Run it::

    python benchmarks/bench_weights.py                       # 3 rounds of 3 s per scenario
    python benchmarks/bench_weights.py --json benchmarks/results/weights.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from harness import (
    RedisServer,
    environment,
    markdown_table,
    new_client,
    non_negative,
    positive,
    redis_server_binary,
    run_phase,
    write_report,
)

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, Permit

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

Kind = Literal["fair", "locked"]

COROUTINES: Final = 64
#: (scenario, limit, weights in turn): each holds 16 permits at once.
SCENARIOS: Final[tuple[tuple[str, int, tuple[int, ...]], ...]] = (
    ("weight 1", 16, (1,)),
    ("weight 2", 32, (2,)),
    ("weights 1-4", 40, (1, 2, 3, 4)),
    # The baseline once more: how far two runs of the same thing are apart, on this machine, in this run.
    ("weight 1, again", 16, (1,)),
)
BASELINE: Final = SCENARIOS[0][0]
CLASSES: Final[dict[Kind, type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]]] = {
    "fair": AsyncFairSemaphore,
    "locked": AsyncLockedSemaphore,
}


class Weighed:
    """A semaphore whose acquires take the given weights in turn (a `harness.Cycler`)."""

    __slots__ = ("_semaphore", "_weights")

    def __init__(self, semaphore: AsyncFairSemaphore | AsyncLockedSemaphore, weights: Sequence[int]) -> None:
        self._semaphore = semaphore
        self._weights: Iterator[int] = itertools.cycle(weights)

    async def acquire(self) -> Permit | None:
        return await self._semaphore.acquire(weight=next(self._weights))

    async def release(self, permit: Permit) -> object:
        return await self._semaphore.release(permit)


@dataclass(frozen=True, slots=True)
class Result:
    kind: Kind
    scenario: str
    limit: int
    weights: tuple[int, ...]
    #: cycles/s of each round, in order.
    rounds: tuple[float, ...]
    median_cycles_per_second: float
    #: The median, over the rounds, of cycles/s over the same round's baseline of the same class.
    median_ratio_to_baseline: float


async def cycles_per_second(
    port: int, kind: Kind, scenario: tuple[str, int, tuple[int, ...]], run: int, *, duration: float, warmup: float
) -> float:
    # A client and a name of their own: no scenario inherits another's connections or permits.
    title, limit, weights = scenario
    client = new_client(port)
    try:
        semaphore = CLASSES[kind](client, f"bench-weights-{kind}-{limit}-{run}", limit)
        cycler = Weighed(semaphore, weights)
        if warmup > 0:
            await run_phase(cycler, COROUTINES, warmup)
        phase = await run_phase(cycler, COROUTINES, duration)
        await semaphore.aclose()
    finally:
        await client.aclose()
    print(f"  {kind} {title}, round {run + 1}: {phase.cycles / phase.seconds:,.0f} cycles/s", file=sys.stderr)
    return phase.cycles / phase.seconds


async def run_all(port: int, rounds: int, duration: float, warmup: float) -> list[Result]:
    results = []
    for kind in CLASSES:
        measured: dict[str, list[float]] = {title: [] for title, _, _ in SCENARIOS}
        for run in range(rounds):
            for scenario in SCENARIOS:
                rate = await cycles_per_second(port, kind, scenario, run, duration=duration, warmup=warmup)
                measured[scenario[0]].append(rate)
        baseline = measured[BASELINE]
        for title, limit, weights in SCENARIOS:
            ratios = [value / base for value, base in zip(measured[title], baseline, strict=True)]
            results.append(
                Result(
                    kind=kind,
                    scenario=title,
                    limit=limit,
                    weights=weights,
                    rounds=tuple(round(value, 1) for value in measured[title]),
                    median_cycles_per_second=round(statistics.median(measured[title]), 1),
                    median_ratio_to_baseline=round(statistics.median(ratios), 3),
                )
            )
    return results


def results_table(results: Sequence[Result]) -> str:
    header = ("class", "scenario", "limit", "cycles/s (median)", f"vs {BASELINE} (median of rounds)")
    rows = [
        (
            result.kind,
            result.scenario,
            str(result.limit),
            f"{result.median_cycles_per_second:,.0f}",
            f"{result.median_ratio_to_baseline:.2f}",
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
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every scenario in turn (default 3)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(redis_server_binary(), Path(directory)) as server,
    ):
        print(f"redis-server {server.version} on {server.host}:{server.port}", file=sys.stderr)
        results = asyncio.run(run_all(server.port, args.rounds, args.duration, args.warmup))
    print()
    print(results_table(results))
    if args.json is not None:
        report = {
            **environment(server.version),
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "coroutines": COROUTINES,
            "scenarios": [asdict(result) for result in results],
        }
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
