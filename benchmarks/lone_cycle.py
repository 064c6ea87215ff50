"""A lone coroutine's cycle, counted: client CPU and wall time per cycle, loop turns and Python calls.

What a request of a web app under a limit pays is one acquire and one
release by one coroutine, with nobody to share a step with. This measures
that cycle on a private ``redis-server``, two ways: ``acquire()`` then
``release()`` on an `AsyncFairSemaphore`, and ``async with
aiosem.limiter(...)`` on the client `aiosem.configure` makes. For each, 5
runs of ``--cycles`` cycles give the lowest client CPU and the median wall
time per cycle; one more run counts the event loop's turns and, under
cProfile, the Python calls per cycle (the counts do not move from run to
run, as the times do).

It compares checkouts: run it with each on ``PYTHONPATH``, interleaved,
since this machine moves 20-40 % from one run to the next::

    for i in 1 2 3 4; do
        for tree in ../before .; do PYTHONPATH=$tree python benchmarks/lone_cycle.py; done
    done
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harness import RedisServer, new_client, positive, redis_server_binary

import aiosem
from aiosem import AsyncFairSemaphore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

RUNS = 5


class CountingLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop that counts its turns (``_run_once`` is asyncio's own, private, name for one)."""

    turns = 0

    def _run_once(self) -> None:
        self.turns += 1
        super()._run_once()  # type: ignore[misc]


async def measure(port: int, cycles: int) -> list[str]:
    aiosem.configure(url=f"redis://127.0.0.1:{port}")
    client = new_client(port)
    semaphore = AsyncFairSemaphore(client, "lone", 16)

    async def acquire_release(count: int) -> None:
        for _ in range(count):
            permit = await semaphore.acquire()
            assert permit is not None  # noqa: S101 -- a wait without a bound ends with a permit
            await semaphore.release(permit)

    async def limiter_block(count: int) -> None:
        for _ in range(count):
            async with aiosem.limiter("lone-limiter", 16):
                pass

    loop = asyncio.get_running_loop()
    assert isinstance(loop, CountingLoop)  # noqa: S101 -- main runs it on one
    lines = []
    scenarios: list[tuple[str, Callable[[int], Awaitable[None]]]] = [
        ("acquire+release", acquire_release),
        ("async with limiter", limiter_block),
    ]
    for label, cycle in scenarios:
        await cycle(200)  # warm: connections open, scripts loaded
        walls, cpus = [], []
        for _ in range(RUNS):
            wall, cpu = time.perf_counter(), time.process_time()
            await cycle(cycles)
            walls.append((time.perf_counter() - wall) / cycles * 1e6)
            cpus.append((time.process_time() - cpu) / cycles * 1e6)
        turns = loop.turns
        profile = cProfile.Profile()
        profile.enable()
        await cycle(cycles)
        profile.disable()
        turns = loop.turns - turns
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        calls = sum(entry[1] for entry in stats.values())
        lines.append(
            f"{label}: client CPU {min(cpus):.0f} us/cycle (lowest of {RUNS}), wall {statistics.median(walls):.0f}"
            f" us/cycle (median), {turns / cycles:.1f} loop turns and {calls / cycles:.0f} Python calls per cycle"
        )
    await aiosem.aclose()
    await client.aclose()
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--cycles", type=positive, default=1500, help="cycles per run (default 1500)")
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(redis_server_binary(), Path(directory)) as server,
    ):
        loop = CountingLoop()
        try:
            lines = loop.run_until_complete(measure(server.port, int(args.cycles)))
        finally:
            loop.close()
    print(f"aiosem from {Path(aiosem.__file__).parent}", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
