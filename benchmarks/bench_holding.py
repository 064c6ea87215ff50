"""What keeping held permits alive costs Redis: 1,000 permits held in one process.

For `AsyncFairSemaphore` and `AsyncLockedSemaphore` (limit 1,000, lease 6 s,
so a refresh round every 2 s), 1,000 permits are taken with
``acquire(auto_refresh=True)`` and held; then, over a measured window:

* ``round trips/s``: writes to the client's sockets (one per round trip,
  pipelined or not), counted on the client;
* ``commands/s``: every command the server ran, those inside scripts
  included (``INFO commandstats``).

The same 1,000 permits are then kept alive the naive way -- a task per permit
calling the book's ``refresh_fair_semaphore`` every 2 s -- in the same run,
on the same server, as the baseline the batched refresher is compared with.

It starts a private ``redis-server`` (``$AIOSEM_REDIS_SERVER``, else the one
on ``PATH``) on a free loopback port, with no persistence, and stops it at the
end; it never touches port 6379.

Run it::

    python benchmarks/bench_holding.py                     # about 30 s
    python benchmarks/bench_holding.py --json benchmarks/results/holding.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import anyio
import redis.asyncio
from harness import RedisServer, environment, markdown_table, redis_server_binary, write_report

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, Permit, recipes

if TYPE_CHECKING:
    from collections.abc import Sequence

Kind = Literal["fair", "locked"]
Method = Literal["refresher", "task per permit"]

PERMITS: Final = 1000
LEASE: Final = 6.0
#: A refresh round every 2 s: a third of the lease.
INTERVAL: Final = LEASE / 3
POOL: Final = 32
CLASSES: Final = {"fair": AsyncFairSemaphore, "locked": AsyncLockedSemaphore}


@dataclass(frozen=True, slots=True)
class HoldingResult:
    kind: Kind
    method: Method
    permits: int
    window_s: float
    round_trips_per_s: float
    commands_per_s: float
    permits_kept: int


async def all_commands(client: redis.asyncio.Redis) -> int:
    """Commands the server ran since its stats were reset, those inside scripts included."""
    stats = await client.info("commandstats")
    return sum(int(entry["calls"]) for name, entry in stats.items() if name != "cmdstat_info")


class CountingConnection(redis.asyncio.Connection):
    """Counts writes to the socket: one per round trip, pipelined or not."""

    writes = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).writes += 1
        await super().send_packed_command(command, check_health)


async def measure(port: int, kind: Kind, method: Method, window: float) -> HoldingResult:
    # Bounded, as a service's pool should be: the naive way would open a
    # connection per permit whenever its refreshes coincide.
    pool = redis.asyncio.BlockingConnectionPool(
        host="127.0.0.1", port=port, connection_class=CountingConnection, max_connections=POOL
    )
    client = redis.asyncio.Redis.from_pool(pool)
    control = redis.asyncio.Redis(host="127.0.0.1", port=port)
    await control.flushdb()
    sem = CLASSES[kind](client, f"holding-{kind}", PERMITS, timeout=LEASE)
    permits: list[Permit] = []
    try:

        async def keep(permit: Permit) -> None:
            while True:
                await anyio.sleep(INTERVAL)
                await recipes.refresh_fair_semaphore(client, sem.key, permit.identifier, timeout=LEASE)

        async with anyio.create_task_group() as tasks:
            for _ in range(PERMITS):
                permit = await sem.acquire(auto_refresh=method == "refresher")
                if permit is None:
                    raise RuntimeError("a free permit could not be taken")
                permits.append(permit)
                if method == "task per permit":
                    tasks.start_soon(keep, permit)
            await anyio.sleep(INTERVAL)  # past the first round
            await control.config_resetstat()
            writes = CountingConnection.writes
            await anyio.sleep(window)
            every = await all_commands(control)
            round_trips = CountingConnection.writes - writes
            holders = await sem.holders()
            tasks.cancel_scope.cancel()
        kept = sum(1 for permit in permits if permit.identifier in holders)
        return HoldingResult(
            kind=kind,
            method=method,
            permits=PERMITS,
            window_s=window,
            round_trips_per_s=round(round_trips / window, 1),
            commands_per_s=round(every / window, 1),
            permits_kept=kept,
        )
    finally:
        await sem.aclose()
        for permit in permits:
            await sem.release(permit)
        await client.aclose()
        await pool.aclose()
        await control.aclose()


def table(results: Sequence[HoldingResult]) -> str:
    header = ["class", "keeping alive", "permits", "kept", "round trips/s", "commands/s", "commands vs task per permit"]
    baseline = {r.kind: r.commands_per_s for r in results if r.method == "task per permit"}
    rows = [
        [
            f"{CLASSES[r.kind].__name__}",
            r.method,
            f"{r.permits:,}",
            f"{r.permits_kept:,}",
            f"{r.round_trips_per_s:,.1f}",
            f"{r.commands_per_s:,.1f}",
            f"{r.commands_per_s / baseline[r.kind]:.3f}x" if baseline.get(r.kind) else "-",
        ]
        for r in results
    ]
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--window", type=float, default=6.0, help="measured seconds per scenario (default 6)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    binary = redis_server_binary()
    results: list[HoldingResult] = []
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(binary, Path(directory)) as server,
    ):
        for kind in CLASSES:
            for method in ("refresher", "task per permit"):
                print(f"  {CLASSES[kind].__name__}, {method} ...", file=sys.stderr, flush=True)
                results.append(asyncio.run(measure(server.port, kind, method, args.window)))  # type: ignore[arg-type]
        version = server.version
    print()
    print(
        f"Keeping {PERMITS:,} held permits alive in one process (lease {LEASE:g} s, a round every {INTERVAL:g} s), "
        f"over {args.window:g} s"
    )
    print()
    print(table(results))
    if args.json is not None:
        report = {**environment([version]), "results": [asdict(result) for result in results]}
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
