"""Instructions a cycle runs in the client, counted by callgrind: repeatable where times are not.

On this shared machine a run's times move 20-40 % from one run to the next,
and more on a slow spell; a change worth 3 % is lost in that. valgrind's
callgrind counts the instructions a process runs instead: the same count,
to 0.5 %, from run to run, whatever else the machine does. Each scenario
runs in a child process under ``valgrind --tool=callgrind
--instr-atstart=no``: the child warms up, switches the count on with
``callgrind_control -i on``, runs its cycles and switches it off, so that
start-up, imports and the first connections are not counted. The server --
a private ``redis-server`` on a free loopback port -- runs outside
valgrind, at its own speed.

The scenarios:

* a lone ``acquire()`` then ``release()`` on an `AsyncFairSemaphore`: what
  a request of a web app under a limit pays;
* 64 coroutines at limit 16, each permit held one loop pass, as
  ``bench_peers.py`` holds it, on an `AsyncFairSemaphore`;
* the same loop on ``asyncio.Semaphore``, which every row is divided by.

Instructions are not time: a system call, a wait on Redis and a cache miss
count for little or nothing. They tell which of two checkouts runs less
Python, as lone_cycle.py's call counts do, but weighed. Compare checkouts
with each on ``PYTHONPATH``::

    for tree in ../before .; do PYTHONPATH=$tree python benchmarks/instructions.py; done

Needs valgrind (``apt-get install valgrind``); takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import RedisServer, markdown_table, new_client, positive, redis_server_binary, write_report

import aiosem
from aiosem import AsyncFairSemaphore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence

#: Coroutines, limit and warm-up cycles of the held loop.
COROUTINES = 64
LIMIT = 16
WARM = 500
#: Where callgrind reports its count on stderr.
COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def counting(on: bool) -> None:
    """Switch callgrind's count on or off for this process (the child runs under it)."""
    control = shutil.which("callgrind_control") or "callgrind_control"
    subprocess.run([control, "-i", "on" if on else "off", str(os.getpid())], check=True, capture_output=True)


async def lone(port: int, cycles: int) -> int:
    client = new_client(port)
    semaphore = AsyncFairSemaphore(client, "instructions-lone", LIMIT)

    async def cycle(count: int) -> None:
        for _ in range(count):
            permit = await semaphore.acquire()
            assert permit is not None  # noqa: S101 -- a wait without a bound ends with a permit
            await semaphore.release(permit)

    await cycle(WARM)
    counting(on=True)
    await cycle(cycles)
    counting(on=False)
    await semaphore.aclose()
    await client.aclose()
    return cycles


async def held(
    acquire: Callable[[], Awaitable[object]], release: Callable[[object], Awaitable[object]], cycles: int
) -> int:
    """The peers' loop: `COROUTINES` coroutines, each holding a permit one loop pass; the cycles counted."""
    done = 0

    async def worker(until: int) -> None:
        nonlocal done
        while done < until:
            permit = await acquire()
            await asyncio.sleep(0)
            await release(permit)
            done += 1

    await asyncio.gather(*(worker(WARM) for _ in range(COROUTINES)))
    counting(on=True)
    start = done
    await asyncio.gather(*(worker(start + cycles) for _ in range(COROUTINES)))
    counting(on=False)
    return done - start


async def held_fair(port: int, cycles: int) -> int:
    client = new_client(port)
    semaphore = AsyncFairSemaphore(client, "instructions-held", LIMIT)

    async def release(permit: object) -> object:
        assert isinstance(permit, aiosem.Permit)  # noqa: S101 -- the loop hands back what it took
        return await semaphore.release(permit)

    counted = await held(semaphore.acquire, release, cycles)
    await semaphore.aclose()
    await client.aclose()
    return counted


async def held_in_process(_port: int, cycles: int) -> int:
    semaphore = asyncio.Semaphore(LIMIT)

    async def release(_permit: object) -> None:
        semaphore.release()

    return await held(semaphore.acquire, release, cycles)


#: Each scenario: its label, and what the child runs (it answers the cycles it counted).
SCENARIOS: dict[str, tuple[str, Callable[[int, int], Coroutine[Any, Any, int]]]] = {
    "lone": ("AsyncFairSemaphore, 1 coroutine, acquire + release", lone),
    "held": (f"AsyncFairSemaphore, {COROUTINES} coroutines, limit {LIMIT}, a loop pass held", held_fair),
    "in-process": (f"asyncio.Semaphore, {COROUTINES} coroutines, limit {LIMIT}, a loop pass held", held_in_process),
}
BASELINE = "in-process"


def count(scenario: str, port: int, cycles: int, directory: Path) -> tuple[int, int]:
    """Run ``scenario`` in a child under callgrind: the instructions it counted, and the cycles they ran."""
    child = subprocess.run(
        [
            shutil.which("valgrind") or "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={directory / f'{scenario}.callgrind'}",
            sys.executable,
            __file__,
            "--child",
            scenario,
            "--port",
            str(port),
            "--cycles",
            str(cycles),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    collected = COLLECTED.search(child.stderr)
    if child.returncode != 0 or collected is None:
        raise RuntimeError(f"{scenario} failed under valgrind ({child.returncode}):\n{child.stderr[-2000:]}")
    return int(collected.group(1)), int(child.stdout.split()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--cycles", type=positive, default=2000, help="cycles counted per scenario (default 2000)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--child", choices=list(SCENARIOS), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cycles = int(args.cycles)
    if args.child:
        print(asyncio.run(SCENARIOS[args.child][1](args.port, cycles)))
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 1
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(redis_server_binary(), Path(directory)) as server,
    ):
        counted = {scenario: count(scenario, server.port, cycles, Path(directory)) for scenario in SCENARIOS}
    per_cycle = {scenario: instructions / done for scenario, (instructions, done) in counted.items()}
    rows = [
        (label, counted[scenario][1], round(per_cycle[scenario]), round(per_cycle[scenario] / per_cycle[BASELINE], 2))
        for scenario, (label, _) in SCENARIOS.items()
    ]
    print(f"aiosem from {Path(aiosem.__file__).parent}", file=sys.stderr)
    header = ["scenario", "cycles counted", "instructions/cycle", "vs asyncio.Semaphore"]
    print(
        markdown_table(
            header, [[label, f"{done:,}", f"{each:,}", f"{ratio:.2f}x"] for label, done, each, ratio in rows]
        )
    )
    if args.json:
        keys = ("scenario", "cycles", "instructions_per_cycle", "vs_in_process")
        write_report(args.json, {"rows": [dict(zip(keys, row, strict=True)) for row in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
