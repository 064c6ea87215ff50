"""What aiosem's web integrations add to a request: FastAPI and aiohttp apps, limited and not, under wrk.

For each framework, two apps answer ``GET /`` with a tiny JSON body; they
differ only by the limit:

* ``plain``: the handler alone -- the baseline;
* ``limited``: the same handler under a limit of 1000 on the name
  ``bench-web`` -- for FastAPI the dependency
  ``Depends(aiosem.contrib.fastapi.limit("bench-web", 1000))``, for aiohttp
  the decorator ``aiosem.contrib.aiohttp.limit("bench-web", 1000)``. The
  limit is far above the load, so no request ever waits for a permit: what
  the limited app adds is the integration's own cost, a permit taken and
  given back per request.

Each app is served by 2 worker processes, as a deployment would: FastAPI by
``uvicorn --workers 2``, aiohttp by two ``web.run_app`` processes sharing
the port (``reuse_port``). Every worker calls
``aiosem.configure(url=...)`` at startup, pointing at a private
``redis-server``. Each server keeps its defaults, as a deployment would:
uvicorn runs uvloop when it is installed, aiohttp the asyncio loop; the
frameworks' figures compare with each other only as such. ``wrk`` loads each app with one thread, at
``--connections`` (default 16) and at 1 connection, where a request's
latency is its service time and the target applies: the limit adds at most
1 ms to the p50. A small machine moves from one run to the next, so the
plain and the limited app run in turn, ``--rounds`` times (the order swapped
every round), and the report gives the medians over the rounds: p50, p90
and p99 latency, requests/s, the limited p50 minus the plain p50 of the same
round, and the limited requests/s over the plain ones. Redis's ``INFO
commandstats``, read before and after each run, counts the commands per
request of the limited app: where its cost goes.

It starts a private ``redis-server`` (``$AIOSEM_REDIS_SERVER``, else the one
on ``PATH``) on a free loopback port, with no persistence, and stops it at
the end; it never touches port 6379. The app servers are this file run
again with hidden flags, each the leader of a process group of its own:
they are stopped by group at the end, and end themselves if this process
goes away or after a bounded lifetime. ``wrk`` shares the machine with the
servers and Redis: on 2 cores the figures are the whole stack's, not the
app's alone.

Run it::

    python benchmarks/bench_web.py                        # about 3 minutes
    python benchmarks/bench_web.py --quick                # a smoke run, about 1 minute
    python benchmarks/bench_web.py --json benchmarks/results/web.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, get_args

import uvicorn
from aiohttp import web
from fastapi import Depends, FastAPI
from harness import (
    HOST,
    RedisServer,
    commandstats_calls,
    environment,
    markdown_table,
    package_version,
    redis_server_binary,
    verdict,
    write_report,
)

import aiosem
from aiosem.contrib import aiohttp as aiosem_aiohttp
from aiosem.contrib import fastapi as aiosem_fastapi

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    import redis.asyncio

Framework = Literal["fastapi", "aiohttp"]
App = Literal["plain", "limited"]

FRAMEWORKS: Final[tuple[Framework, ...]] = get_args(Framework)
APPS: Final[tuple[App, ...]] = get_args(App)
NAME: Final = "bench-web"
#: Far above what wrk's connections can hold at once: no request ever waits.
LIMIT: Final = 1000
WORKERS: Final = 2
#: The row where a request's latency is its service time, which the target is about.
LOW_CONNECTIONS: Final = 1
#: The most the limit may add to the p50 of a request, in ms.
TARGET_MS: Final = 1.0
#: How long an app server may take to start, and to stop before it is killed.
START_TIMEOUT: Final = 30.0
STOP_TIMEOUT: Final = 10.0
#: How long a wrk run may outlast its duration before it is killed.
WRK_GRACE: Final = 30.0
#: What an app server's lifetime allows beyond the runs planned for it.
LIFETIME_MARGIN: Final = 120.0
#: How a uvicorn worker, started by uvicorn rather than by this file, learns its app.
URL_VARIABLE: Final = "AIOSEM_BENCH_WEB_URL"
APP_VARIABLE: Final = "AIOSEM_BENCH_WEB_APP"
#: This file, which each app server runs again.
SCRIPT: Final = Path(__file__).resolve()

#: wrk's time units, in ms.
UNITS_MS: Final = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
LATENCY: Final = re.compile(r"^\s*(50|90|99)%\s+([\d.]+)(us|ms|s|m|h)\s*$", re.MULTILINE)
REQUESTS: Final = re.compile(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m|h)", re.MULTILINE)
RATE: Final = re.compile(r"^Requests/sec:\s+([\d.]+)", re.MULTILINE)
NON_2XX: Final = re.compile(r"Non-2xx or 3xx responses: (\d+)")
SOCKET_ERRORS: Final = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


# --- the app servers (this file run again with --serve) ------------------------


@contextlib.asynccontextmanager
async def _announce(_: FastAPI) -> AsyncIterator[None]:
    _ready()
    yield


def _ready(*_: object) -> None:
    # One line per worker on the shared stdout: the parent loads the app only once all are up.
    print(f"ready {os.getpid()}", flush=True)


def fastapi_app() -> FastAPI:
    """The app of one uvicorn worker: uvicorn calls this factory in each worker process."""
    aiosem.configure(url=os.environ[URL_VARIABLE])
    limited = os.environ[APP_VARIABLE] == "limited"
    app = FastAPI(lifespan=_announce)

    @app.get("/", dependencies=[Depends(aiosem_fastapi.limit(NAME, LIMIT))] if limited else [])
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    return app


def aiohttp_app(app: App) -> web.Application:
    """The app of one aiohttp worker process."""

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": "world"})

    application = web.Application()
    application.router.add_get("/", aiosem_aiohttp.limit(NAME, LIMIT)(hello) if app == "limited" else hello)
    return application


def bound_lifetime(lifetime: float) -> None:
    """Kill this process group once the parent closes our stdin (or dies), or after ``lifetime`` seconds."""

    def end() -> None:
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def on_eof() -> None:
        # os.read, not sys.stdin: a daemon thread blocked in a buffered read aborts the interpreter's exit.
        while os.read(sys.stdin.fileno(), 4096):
            pass
        end()

    threading.Thread(target=on_eof, name="lifeline", daemon=True).start()
    deadline = threading.Timer(lifetime, end)
    deadline.daemon = True
    deadline.start()


def serve(framework: Framework, app: App, port: int, url: str, lifetime: float) -> None:
    """Serve ``app`` on ``port`` until SIGTERM: uvicorn's 2 workers, or one aiohttp process of the 2."""
    bound_lifetime(lifetime)
    if framework == "fastapi":
        # uvicorn's workers are new interpreters that import the factory by name and inherit the environment.
        os.environ[URL_VARIABLE] = url
        os.environ[APP_VARIABLE] = app
        uvicorn.run(
            f"{SCRIPT.stem}:fastapi_app",
            factory=True,
            app_dir=str(SCRIPT.parent),
            host=HOST,
            port=port,
            workers=WORKERS,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
    else:
        aiosem.configure(url=url)
        web.run_app(
            aiohttp_app(app), host=HOST, port=port, reuse_port=True, access_log=None, print=_ready, shutdown_timeout=1
        )


# --- starting and stopping them ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Server:
    """An app being served on ``port`` by ``processes``, each the leader of its own process group."""

    framework: Framework
    app: App
    port: int
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def running(framework: Framework, app: App, url: str, lifetime: float) -> AsyncIterator[Server]:
    """Serve ``app`` while the block runs, once every worker said it is up and a request got a 200."""
    server = Server(framework, app, free_port())
    # uvicorn starts its 2 workers itself; aiohttp's are 2 processes of ours.
    launchers = 1 if framework == "fastapi" else WORKERS
    try:
        for _ in range(launchers):
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(SCRIPT),
                "--serve", framework, "--app", app, "--http-port", str(server.port), "--redis-url", url,
                "--lifetime", str(lifetime),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
            server.processes.append(process)
        await asyncio.wait_for(wait_ready(server, WORKERS // launchers), START_TIMEOUT)
        yield server
    finally:
        await asyncio.gather(*(stop(process) for process in server.processes))


async def wait_ready(server: Server, lines: int) -> None:
    for process in server.processes:
        if process.stdout is None:
            raise RuntimeError("an app server's stdout must be piped")
        for _ in range(lines):
            if not await process.stdout.readline():
                raise RuntimeError(f"the {server.framework} {server.app} server exited with {await process.wait()}")
    status = await get_status(server.port)
    if status != 200:
        raise RuntimeError(f"the {server.framework} {server.app} server answered {status} to GET /")


async def get_status(port: int) -> int:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        status_line = await reader.readline()
    finally:
        writer.close()
        await writer.wait_closed()
    return int(status_line.split()[1])


async def stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the process group, then SIGKILL it, so that no worker outlives its leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(process.wait(), STOP_TIMEOUT)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    await asyncio.wait_for(process.wait(), STOP_TIMEOUT)


# --- loading them ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """One wrk run against one app."""

    connections: int
    requests: int
    seconds: float
    requests_per_second: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    #: The commands Redis ran during the run, by name (``INFO commandstats`` deltas: those scripts ran
    #: included, our own INFO left out). A few releases of the limited app's last requests land in
    #: the next run, whichever app that loads.
    redis_commands: dict[str, int]


def parse_wrk(output: str, connections: int, redis_commands: dict[str, int]) -> Load:
    """A `Load` from wrk's report, run with ``--latency``."""
    latencies = {int(match[1]): float(match[2]) * UNITS_MS[match[3]] for match in LATENCY.finditer(output)}
    requests, rate = REQUESTS.search(output), RATE.search(output)
    if requests is None or rate is None or set(latencies) != {50, 90, 99}:
        raise RuntimeError(f"wrk's report could not be read:\n{output}")
    non_2xx = NON_2XX.search(output)
    socket_errors = SOCKET_ERRORS.search(output)
    return Load(
        connections=connections,
        requests=int(requests[1]),
        seconds=float(requests[2]) * UNITS_MS[requests[3]] / 1e3,
        requests_per_second=float(rate[1]),
        p50_ms=latencies[50],
        p90_ms=latencies[90],
        p99_ms=latencies[99],
        non_2xx=0 if non_2xx is None else int(non_2xx[1]),
        socket_errors=0 if socket_errors is None else sum(int(count) for count in socket_errors.groups()),
        redis_commands=redis_commands,
    )


async def run_wrk(wrk: str, port: int, connections: int, seconds: int) -> str:
    """wrk's report of ``seconds`` of load on ``port`` from one thread and ``connections`` connections."""
    process = await asyncio.create_subprocess_exec(
        wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "--timeout", "10s", f"http://{HOST}:{port}/",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), seconds + WRK_GRACE)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"wrk failed with {process.returncode}: {stderr.decode(errors='replace')}")
    return stdout.decode()


async def measure(wrk: str, server: Server, connections: int, seconds: int, admin: redis.asyncio.Redis) -> Load:
    """One wrk run against ``server``, with the commands Redis ran meanwhile."""
    before = commandstats_calls(await admin.info("commandstats"))
    output = await run_wrk(wrk, server.port, connections, seconds)
    after = commandstats_calls(await admin.info("commandstats"))
    commands = {
        name: calls - before.get(name, 0)
        for name, calls in sorted(after.items())
        if name != "info" and calls > before.get(name, 0)
    }
    load = parse_wrk(output, connections, commands)
    # A 503 or a 500 would be another measurement: a request that waited, or one that failed.
    if load.non_2xx:
        raise RuntimeError(f"{server.framework} {server.app}: {load.non_2xx} responses were not 2xx")
    if load.socket_errors:
        print(f"  warning: {load.socket_errors} socket errors in this run", file=sys.stderr)
    return load


# --- the rounds and the report ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    duration: int
    warmup: int
    rounds: int


FULL: Final = Plan(duration=5, warmup=2, rounds=3)
QUICK: Final = Plan(duration=2, warmup=1, rounds=2)


@dataclass(frozen=True, slots=True)
class Latencies:
    """Medians over the rounds of one app at one connection count."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    requests_per_second: float

    @classmethod
    def of(cls, loads: Sequence[Load]) -> Latencies:
        return cls(
            p50_ms=statistics.median(load.p50_ms for load in loads),
            p90_ms=statistics.median(load.p90_ms for load in loads),
            p99_ms=statistics.median(load.p99_ms for load in loads),
            requests_per_second=statistics.median(load.requests_per_second for load in loads),
        )


@dataclass(frozen=True, slots=True)
class Row:
    framework: Framework
    connections: int
    plain: Latencies
    limited: Latencies
    #: The median, over the rounds, of the limited p50 minus the plain p50 of the same round.
    overhead_p50_ms: float
    #: The median, over the rounds, of the limited requests/s over the plain ones of the same round.
    requests_ratio: float
    #: Over every limited run: EVALSHA calls, and every command Redis ran, per request served.
    evalsha_per_request: float
    commands_per_request: float
    #: Every run, in order, plain and limited.
    rounds: dict[str, list[Load]]

    @classmethod
    def of(cls, framework: Framework, connections: int, plain: Sequence[Load], limited: Sequence[Load]) -> Row:
        requests = sum(load.requests for load in limited)
        commands = [sum(load.redis_commands.values()) for load in limited]
        return cls(
            framework=framework,
            connections=connections,
            plain=Latencies.of(plain),
            limited=Latencies.of(limited),
            overhead_p50_ms=statistics.median(b.p50_ms - a.p50_ms for a, b in zip(plain, limited, strict=True)),
            requests_ratio=statistics.median(
                b.requests_per_second / a.requests_per_second for a, b in zip(plain, limited, strict=True)
            ),
            evalsha_per_request=sum(load.redis_commands.get("evalsha", 0) for load in limited) / requests,
            commands_per_request=sum(commands) / requests,
            rounds={"plain": list(plain), "limited": list(limited)},
        )


async def run_framework(
    framework: Framework, *, wrk: str, url: str, admin: redis.asyncio.Redis, plan: Plan, counts: Sequence[int]
) -> list[Row]:
    runs = plan.rounds * len(counts) * len(APPS)
    lifetime = 2 * plan.warmup + runs * (plan.duration + 1) + LIFETIME_MARGIN
    loads: dict[tuple[int, App], list[Load]] = {(count, app): [] for count in counts for app in APPS}
    async with contextlib.AsyncExitStack() as stack:
        servers = {app: await stack.enter_async_context(running(framework, app, url, lifetime)) for app in APPS}
        if plan.warmup:
            # Each worker opens its Redis connections and fills its caches here, not in the first round.
            for server in servers.values():
                await run_wrk(wrk, server.port, max(counts), plan.warmup)
        for round_ in range(plan.rounds):
            for count in counts:
                # Each app goes first in every other round: a drift of the machine falls on both.
                for app in APPS if round_ % 2 == 0 else APPS[::-1]:
                    load = await measure(wrk, servers[app], count, plan.duration, admin)
                    loads[count, app].append(load)
                    print(
                        f"  {framework} {app}, {count} connections, round {round_ + 1}: "
                        f"p50 {load.p50_ms:.2f} ms, {load.requests_per_second:,.0f} requests/s",
                        file=sys.stderr,
                    )
    return [Row.of(framework, count, loads[count, "plain"], loads[count, "limited"]) for count in counts]


async def run_all(wrk: str, server: RedisServer, plan: Plan, counts: Sequence[int]) -> list[Row]:
    admin = server.admin_client()
    try:
        rows = []
        for framework in FRAMEWORKS:
            rows.extend(await run_framework(framework, wrk=wrk, url=server.url, admin=admin, plan=plan, counts=counts))
        return rows
    finally:
        await admin.aclose()


def results_table(rows: Sequence[Row]) -> str:
    header = (
        "framework",
        "connections",
        "plain p50 / p90 / p99 ms",
        "limited p50 / p90 / p99 ms",
        "added p50 ms",
        "plain req/s",
        "limited req/s",
        "limited / plain",
        "EVALSHA / req",
        "commands / req",
        f"added p50 <= {TARGET_MS:g} ms",
    )
    body = [
        (
            row.framework,
            str(row.connections),
            f"{row.plain.p50_ms:.2f} / {row.plain.p90_ms:.2f} / {row.plain.p99_ms:.2f}",
            f"{row.limited.p50_ms:.2f} / {row.limited.p90_ms:.2f} / {row.limited.p99_ms:.2f}",
            f"{row.overhead_p50_ms:+.2f}",
            f"{row.plain.requests_per_second:,.0f}",
            f"{row.limited.requests_per_second:,.0f}",
            f"{row.requests_ratio:.2f}",
            f"{row.evalsha_per_request:.2f}",
            f"{row.commands_per_request:.2f}",
            verdict(row.overhead_p50_ms <= TARGET_MS),
        )
        for row in rows
    ]
    return (
        f"{WORKERS} workers per app, wrk -t1, limit {LIMIT} (never reached); medians of the rounds; "
        "added p50: limited minus plain in the same round; commands: every command Redis ran, "
        "those inside scripts included\n\n" + markdown_table(header, body)
    )


def whole_seconds(text: str) -> int:
    # wrk takes whole seconds only.
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds, not negative, got {text}")
    return value


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def wrk_version(wrk: str) -> str:
    # `wrk -v` prints its version and usage, and exits with 1.
    completed = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=10, check=False)
    return completed.stdout.split("Copyright")[0].strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 2 s per run")
    parser.add_argument(
        "--duration", type=at_least_one, help=f"whole seconds of each wrk run (default {FULL.duration})"
    )
    parser.add_argument(
        "--warmup", type=whole_seconds, help=f"unmeasured seconds of load on each app first (default {FULL.warmup})"
    )
    parser.add_argument("--rounds", type=at_least_one, help=f"rounds of every run in turn (default {FULL.rounds})")
    parser.add_argument(
        "--connections", type=at_least_one, default=16, help="wrk's connections in the main row (default 16)"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    # An app server: this file run again by `running`.
    parser.add_argument("--serve", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--app", choices=APPS, help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.app, args.http_port, args.redis_url, args.lifetime)
        return 0

    wrk = shutil.which("wrk")
    if wrk is None:
        raise SystemExit("bench_web.py loads the apps with wrk, which is not on PATH: apt-get install wrk")
    base = QUICK if args.quick else FULL
    plan = Plan(
        duration=base.duration if args.duration is None else args.duration,
        warmup=base.warmup if args.warmup is None else args.warmup,
        rounds=base.rounds if args.rounds is None else args.rounds,
    )
    counts = sorted({args.connections, LOW_CONNECTIONS}, reverse=True)
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(redis_server_binary(), Path(directory)) as server,
    ):
        print(f"redis-server {server.version} on {server.host}:{server.port}", file=sys.stderr)
        rows = asyncio.run(run_all(wrk, server, plan, counts))
    print()
    print(results_table(rows))
    if args.json is not None:
        report = {
            **environment(server.version),
            "wrk": wrk_version(wrk),
            "packages": {
                name: package_version(name) for name in ("fastapi", "starlette", "uvicorn", "uvloop", "aiohttp")
            },
            "quick": args.quick,
            "duration_s": plan.duration,
            "warmup_s": plan.warmup,
            "rounds": plan.rounds,
            "workers": WORKERS,
            "limit": LIMIT,
            "target_ms": TARGET_MS,
            "rows": [asdict(row) for row in rows],
        }
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
