"""What the benchmarks share: servers, clients, the measuring loop, helper processes and the report.

Every script in ``benchmarks/`` imports its plumbing from here, and no
script imports another: this is the only module of ``benchmarks/`` that
reaches into the test harness (``tests/harness``), which starts our own
``redis-server`` processes and Sentinel groups and counts what a failover
forgets. ``book.py`` is not plumbing but a peer, the book's semaphores.

- The server: `redis_server_binary`, `RedisServer`, `SentinelGroup`,
  `redis_benchmark_ping`, `commandstats_calls`, `on_fresh_server`.
- The measuring loop: `Cycler`, `RawLoop` (the floor: two EVALSHA per
  cycle), `new_client`, `worker`, `run_phase`, `percentile`.
- Helper processes of a multi-process benchmark: `Peer`, and on the
  helper's side `parse_or_play_role`, `open_stdin`, `next_message`,
  `report`.
- The report: `environment`, `markdown_table`, `verdict`, `write_report`,
  and the argument types `positive` and `non_negative`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias, TypeVar

import redis
import redis.asyncio

from tests.harness import book_client
from tests.harness.failover import How, Semaphore, count_forgotten
from tests.harness.support import RedisServer, find_redis_server
from tests.harness.topology import SentinelGroup

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Mapping, Sequence

__all__ = [
    "GRACE",
    "HOST",
    "LINE_LIMIT",
    "MAX_CONNECTIONS",
    "RAW_ADD",
    "RAW_REMOVE",
    "STEP_TIMEOUT",
    "Cycler",
    "How",
    "Message",
    "Peer",
    "Phase",
    "RawLoop",
    "RedisServer",
    "Semaphore",
    "SentinelGroup",
    "book_client",
    "commandstats_calls",
    "count_forgotten",
    "environment",
    "find_redis_server",
    "markdown_table",
    "new_client",
    "next_message",
    "non_negative",
    "on_fresh_server",
    "open_stdin",
    "package_version",
    "parse_or_play_role",
    "percentile",
    "positive",
    "redis_benchmark_ping",
    "redis_server_binary",
    "report",
    "run_phase",
    "verdict",
    "worker",
    "write_report",
]

HOST: Final = "127.0.0.1"
#: Enough for 64 coroutines that each hold at most one connection at a time;
#: a bound, so that a leak shows up as waiting rather than as 1000 sockets.
MAX_CONNECTIONS: Final = 128
#: How long a coroutine may still be inside a cycle after the time is up.
GRACE: Final = 10.0
#: How long any one step -- a wait for a reply, a condition, a grant -- may take.
STEP_TIMEOUT: Final = 30.0
#: The longest line a helper may report: a report can carry every span a
#: worker measured, far beyond asyncio's default of 64 KiB.
LINE_LIMIT: Final = 256 * 1024 * 1024

# The raw floor does what the fair scripts do at the least: one write to a
# sorted set per step, the identifier as member.
RAW_ADD: Final = "return redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])"
RAW_REMOVE: Final = "return redis.call('ZREM', KEYS[1], ARGV[1])"

T = TypeVar("T")
Message: TypeAlias = dict[str, Any]


# --- the server ------------------------------------------------------------


def redis_server_binary() -> str:
    """The ``redis-server`` a benchmark starts (``$AIOSEM_REDIS_SERVER``, else the one on ``PATH``); exits without."""
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("no redis-server: put it on PATH or in AIOSEM_REDIS_SERVER")
    return binary


def redis_benchmark_ping(port: int) -> dict[str, float] | None:
    """``redis-benchmark``'s PING rates (requests/s) by test name, or None without the tool."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    command = [binary, "-h", HOST, "-p", str(port), "-q", "-t", "ping", "-n", "100000", "-P", "1"]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    except (subprocess.SubprocessError, OSError) as error:
        print(f"redis-benchmark failed, skipped: {error}", file=sys.stderr)
        return None
    # -q still writes progress lines, separated by carriage returns.
    rates = {
        match[1]: float(match[2])
        for match in re.finditer(r"^(PING_\w+): ([\d.]+) requests per second", completed.stdout, re.MULTILINE)
    }
    return rates or None


def commandstats_calls(stats: dict[str, Any]) -> dict[str, int]:
    """Calls by command name, from an INFO reply that holds the commandstats section among others."""
    return {
        name.removeprefix("cmdstat_"): int(entry["calls"])
        for name, entry in stats.items()
        if name.startswith("cmdstat_")
    }


def on_fresh_server(
    binary: str, versions: set[str], label: str, scenario: Callable[[int], Coroutine[Any, Any, T]]
) -> T:
    """Run ``scenario(port)`` in a new event loop, against a new ``redis-server``."""
    print(f"  {label} ...", file=sys.stderr, flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(binary, Path(directory)) as server,
    ):
        versions.add(server.version)
        return asyncio.run(scenario(server.port))


# --- the measuring loop ------------------------------------------------------


class Cycler(Protocol[T]):
    """Anything with the semaphores' acquire/release shape."""

    async def acquire(self) -> T | None: ...

    async def release(self, permit: T) -> object: ...


class RawLoop:
    """The floor: a semaphore's two round trips with none of its logic."""

    __slots__ = ("_add", "_client", "_key", "_remove")

    def __init__(self, client: redis.asyncio.Redis, key: str, add: str, remove: str) -> None:
        self._client = client
        self._key = key
        self._add = add
        self._remove = remove

    @classmethod
    async def load(cls, client: redis.asyncio.Redis, key: str) -> RawLoop:
        add = await client.script_load(RAW_ADD)
        remove = await client.script_load(RAW_REMOVE)
        return cls(client, key, str(add), str(remove))

    async def acquire(self) -> str:
        # A fresh identifier per cycle, as the semaphores make, so that 64
        # coroutines never remove each other's members.
        identifier = secrets.token_hex(16)
        await self._client.evalsha(self._add, 1, self._key, time.time(), identifier)
        return identifier

    async def release(self, permit: str) -> object:
        return await self._client.evalsha(self._remove, 1, self._key, permit)


class InProcess:
    """``asyncio.Semaphore``, in the acquire/release shape: the ceiling of one process."""

    __slots__ = ("_semaphore",)

    def __init__(self, limit: int) -> None:
        self._semaphore = asyncio.Semaphore(limit)

    def __repr__(self) -> str:
        return f"InProcess({self._semaphore!r})"

    async def acquire(self) -> bool:
        await self._semaphore.acquire()
        return True

    async def release(self, permit: bool) -> None:
        self._semaphore.release()


@dataclass(frozen=True, slots=True)
class Phase:
    cycles: int
    seconds: float
    latencies: list[float]


def new_client(port: int) -> redis.asyncio.Redis:
    pool = redis.asyncio.BlockingConnectionPool(host=HOST, port=port, max_connections=MAX_CONNECTIONS, timeout=GRACE)
    return redis.asyncio.Redis.from_pool(pool)


async def worker(cycler: Cycler[T], stop_at: float, latencies: list[float]) -> int:
    cycles = 0
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        permit = await cycler.acquire()
        latencies.append(time.perf_counter() - started)
        if permit is None:
            raise RuntimeError("acquire gave up although it was asked to wait for ever")
        await cycler.release(permit)
        cycles += 1
    return cycles


async def run_phase(cycler: Cycler[T], coroutines: int, seconds: float) -> Phase:
    latencies: list[float] = []
    start = time.perf_counter()
    tasks = [asyncio.create_task(worker(cycler, start + seconds, latencies)) for _ in range(coroutines)]
    _, pending = await asyncio.wait(tasks, timeout=seconds + GRACE)
    # Cycles that finish after the deadline count, so the time they took does too.
    elapsed = time.perf_counter() - start
    if pending:
        for task in pending:
            task.cancel()
        # The semaphores give back a cancelled acquire's permit, shielded but bounded.
        await asyncio.wait(pending, timeout=GRACE)
        raise RuntimeError(f"{len(pending)} of {coroutines} coroutines were still in a cycle {GRACE:g} s after the end")
    cycles = sum(task.result() for task in tasks)
    return Phase(cycles, elapsed, latencies)


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile: a value that was actually observed."""
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


# --- helper processes ----------------------------------------------------------


class Peer:
    """Another process running a benchmark script with ``--role``, spoken to over its stdin and stdout."""

    __slots__ = ("_process", "_stdin", "_stdout", "role")

    def __init__(self, role: str, process: asyncio.subprocess.Process) -> None:
        if process.stdin is None or process.stdout is None:
            raise ValueError("the process needs piped stdin and stdout")
        self.role = role
        self._process = process
        self._stdin = process.stdin
        self._stdout = process.stdout

    def __repr__(self) -> str:
        return f"Peer(role={self.role!r}, pid={self._process.pid}, returncode={self._process.returncode})"

    @classmethod
    async def start(cls, role: str, port: int, *, script: str, **config: Any) -> Peer:
        """Start the benchmark ``script`` again with ``--role``; its messages are read with `receive`."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, script, "--role", role, "--port", str(port), "--config", json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=LINE_LIMIT,
        )  # fmt: skip
        return cls(role, process)

    async def send(self, **message: Any) -> None:
        self._stdin.write(json.dumps(message).encode() + b"\n")
        await self._stdin.drain()

    async def receive(self, within: float = STEP_TIMEOUT) -> Message:
        """The next message; `TimeoutError` if none comes ``within`` seconds."""
        line = await asyncio.wait_for(self._stdout.readline(), within)
        if not line:
            raise RuntimeError(f"the {self.role} process ended unexpectedly (exit code {self._process.returncode})")
        message: Message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"the {self.role} process failed: {message['error']}")
        return message

    def kill(self) -> None:
        """SIGKILL the process, as a crash would."""
        if self._process.returncode is None:
            self._process.kill()

    async def close(self) -> None:
        """Close its stdin (it exits on EOF), then kill it if it lingers."""
        if not self._stdin.is_closing():
            self._stdin.close()
        try:
            await asyncio.wait_for(self._process.wait(), 10)
        except TimeoutError:
            self.kill()
            await asyncio.wait_for(self._process.wait(), 10)

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if exc_info[0] is not None:
            self.kill()
        await self.close()


def parse_or_play_role(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    roles: Mapping[str, object],
    run_role: Callable[[str, int, Message], Coroutine[Any, Any, None]],
) -> argparse.Namespace | None:
    """Parse a multi-process benchmark's arguments, with the hidden ones of its helper processes.

    Started as a helper process (``--role``), play the role and return
    ``None``. Otherwise warn if ``perf_counter`` cannot be compared across
    processes, as the figures need.
    """
    parser.add_argument("--role", choices=sorted(roles), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=json.loads, default={}, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role is not None:
        asyncio.run(run_role(args.role, args.port, args.config))
        return None
    clock = time.get_clock_info("perf_counter")
    if "CLOCK_MONOTONIC" not in clock.implementation:
        print(f"warning: perf_counter is {clock.implementation}; cross-process times may not compare", file=sys.stderr)
    return args


async def open_stdin() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def next_message(stdin: asyncio.StreamReader) -> Message | None:
    line = await stdin.readline()
    return json.loads(line) if line else None


def report(**message: Any) -> None:
    print(json.dumps(message), flush=True)


# --- the report ----------------------------------------------------------------


def environment(redis_server: object) -> dict[str, object]:
    """What a result depends on besides aiosem's code: when, where, and with which versions."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "aiosem": package_version("aiosem"),
        "redis_py": redis.__version__,
        "hiredis": package_version("hiredis"),
        "redis_server": redis_server,
    }


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table, the first column left-aligned and the others right."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (width + 1) + (":" if i else "-") for i, width in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def verdict(met: bool) -> str:
    return "yes" if met else "**no**"


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write a benchmark's figures to ``path`` as indented JSON, making its folder if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def positive(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be zero or a positive number of seconds, got {text}")
    return value
