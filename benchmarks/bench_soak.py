"""A soak: worker processes killed and Redis restarted for ten minutes, while the limit must hold.

Eight worker processes (this file again, with a hidden ``--role worker``)
loop ``async with`` an `AsyncFairSemaphore` -- limit 4, lease 2 s -- around
a random hold (exponential, mean 50 ms), against one ``redis-server`` this
script starts on a free loopback port, in a temporary directory, and stops
by its PID. Meanwhile:

* every 30 s a worker that holds a permit is SIGKILLed, and started again;
* every 2 minutes Redis is stopped (SIGTERM) and started again on the same
  port, alternately keeping its data (an append-only file, fsync ``always``:
  every acknowledged write survives) and losing it (the files deleted between
  stop and start, as a server without persistence would).

Each worker writes a line to its stdout as each body starts (with the
permit's fencing token) and ends, and for each error by type, stamped with
``time.monotonic()``: CLOCK_MONOTONIC, one clock for every process of the
machine. From these lines the parent works out:

* how many bodies ran at once, at most, and every moment that was over the
  limit -- counted apart inside a failover window (from a restart's SIGTERM
  to a lease after the server answers again: a server that lost its data
  forgets its holders, who learn of it at their next refresh) and outside;
* after each kill, how long until the killed worker's permit was granted
  again: the first grant after the kill that takes the holders above
  ``limit - permits the killed worker held`` could only be made with one of
  those (the limit being kept), and with 8 workers on 4 permits somebody
  always waits for it;
* errors by type (and whether entering or leaving the ``async with``),
  grants, restarts, fencing tokens handed out twice, and the machine's load
  average over the run (the machine may be shared).

The workers make their client as ``aiosem.configure(url=...)`` does
(``--client url``, the default), or as ``redis.asyncio.Redis(host=...,
port=...)`` does, with redis-py's retry of a failed command on a new
connection (``--client retrying``).

Run it::

    python benchmarks/bench_soak.py --minutes 1 --kill-every 10 --restart-every 20   # a smoke run
    python benchmarks/bench_soak.py --minutes 10 --json benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import anyio
import redis
import redis.asyncio
from harness import HOST, RedisServer, environment, markdown_table, positive, redis_server_binary, write_report

from aiosem import AsyncFairSemaphore
from aiosem._urls import close, connect

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

SCRIPT: Final = str(Path(__file__).resolve())
NAME: Final = "soak"
#: A worker's pause after an error before its next acquire: Redis may be restarting.
ERROR_PAUSE: Final = 0.05
#: How long a worker lives at most past the planned end, whatever happens to the parent.
LIFETIME_MARGIN: Final = 300.0
#: How long a kill waits for some worker to be holding, at most.
HOLDER_WAIT: Final = 5.0
#: How long stopping the workers at the end may take before they are killed.
STOP_TIMEOUT: Final = 15.0
#: How long a restarted server may take to load its data.
LOAD_TIMEOUT: Final = 10.0
#: How often the load average is sampled.
LOAD_SAMPLE_EVERY: Final = 10.0
#: Redis's files, deleted for a restart that loses the data.
DATA_FILES: Final = ("appendonlydir", "dump.rdb")
#: Keep every acknowledged write across a SIGTERM (the RDB save points stay off).
PERSISTENCE: Final = ("--appendonly", "yes", "--appendfsync", "always")

RestartKind = Literal["data kept", "data lost"]


@dataclass(frozen=True, slots=True)
class Plan:
    #: How the workers make their client: ``url`` as ``aiosem.configure(url=...)`` does
    #: (`aiosem._urls.connect`), or ``retrying`` as ``redis.asyncio.Redis(host=..., port=...)``
    #: does, with redis-py's default retry of a failed connection.
    client: Literal["url", "retrying"]
    seconds: float
    workers: int
    coroutines: int
    limit: int
    lease: float
    hold_mean: float
    kill_every: float
    restart_every: float


@dataclass(frozen=True, slots=True)
class Event:
    """One line of a worker: a body entered (with its token) or left, or an error."""

    at: float
    worker: str
    kind: Literal["enter", "exit", "error"]
    token: int | None = None
    error: str | None = None


@dataclass(slots=True)
class Kill:
    worker: str
    at: float
    #: Permits the worker held when it died, as its own lines say.
    held: int = 0
    #: From the kill to the first grant that needed one of its permits.
    reclaimed_after_s: float | None = None


@dataclass(slots=True)
class Restart:
    kind: RestartKind
    stopped_at: float
    ready_at: float
    #: From the SIGTERM until the server answered again, its data loaded.
    downtime_s: float = 0.0
    #: From the server answering again to the next grant.
    first_grant_after_s: float | None = None
    over_limit: int = 0


@dataclass(slots=True)
class Outcome:
    started: float
    ended: float
    events: list[Event] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    load: list[float] = field(default_factory=list)


# --- a worker process ---------------------------------------------------------------


def emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"kind": kind, "at": time.monotonic(), **fields}), flush=True)


async def cycle_forever(semaphore: AsyncFairSemaphore, rng: random.Random, hold_mean: float) -> None:
    while True:
        await cycle(semaphore, rng, hold_mean)


async def cycle(semaphore: AsyncFairSemaphore, rng: random.Random, hold_mean: float) -> None:
    """Hold a permit for a random while; an error is reported by type and step, and waited out a moment."""
    entered = False
    try:
        async with semaphore as permit:
            entered = True
            emit("enter", token=permit.fencing_token)
            try:
                await anyio.sleep(rng.expovariate(1 / hold_mean))
            finally:
                emit("exit")
    except Exception as error:  # noqa: BLE001 -- counted by type; the worker carries on, as a service would
        emit("error", error=f"{type(error).__name__} {'leaving' if entered else 'entering'}")
        await anyio.sleep(ERROR_PAUSE)


async def run_worker(port: int, plan: Plan) -> None:
    """Cycle until stdin closes (the parent is done or gone), or the lifetime runs out."""
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    client = connect(f"redis://{HOST}:{port}/0") if plan.client == "url" else redis.asyncio.Redis(host=HOST, port=port)
    semaphore = AsyncFairSemaphore(client, NAME, plan.limit, timeout=plan.lease)
    rng = random.Random()
    try:
        with anyio.move_on_after(plan.seconds + LIFETIME_MARGIN):
            async with anyio.create_task_group() as group:
                for _ in range(plan.coroutines):
                    group.start_soon(cycle_forever, semaphore, rng, plan.hold_mean)
                await stdin.read()
                group.cancel_scope.cancel()
    finally:
        with anyio.move_on_after(5):
            await semaphore.aclose()
        await close(client)


# --- the parent -----------------------------------------------------------------------


class Worker:
    """One worker process, its lines read into the shared event list as they come."""

    __slots__ = ("_stdin", "holding", "key", "killed", "process", "reader", "slot")

    def __init__(self, slot: int, generation: int, process: asyncio.subprocess.Process, events: list[Event]) -> None:
        if process.stdin is None or process.stdout is None:
            raise ValueError("the process needs piped stdin and stdout")
        self.slot = slot
        self.key = f"{slot}.{generation}"
        self.process = process
        self._stdin = process.stdin
        #: Bodies entered and not left, as far as its lines have been read.
        self.holding = 0
        self.killed = False
        self.reader = asyncio.get_running_loop().create_task(self._read(process.stdout, events))

    async def _read(self, stdout: asyncio.StreamReader, events: list[Event]) -> None:
        async for line in stdout:
            message = json.loads(line)
            event = Event(message["at"], self.key, message["kind"], message.get("token"), message.get("error"))
            events.append(event)
            self.holding += {"enter": 1, "exit": -1}.get(event.kind, 0)

    async def kill(self) -> float:
        """SIGKILL it, as a crash would, and read what it wrote before; return when it was killed."""
        self.killed = True
        self.process.kill()
        killed_at = time.monotonic()
        await self.process.wait()
        await self.reader
        return killed_at

    async def stop(self) -> None:
        """Close its stdin, so that it gives its permit back and exits; kill it if it lingers."""
        self._stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), STOP_TIMEOUT)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        await self.reader


class Soak:
    """The run: workers, their kills and restarts, and Redis's restarts."""

    def __init__(self, server: RedisServer, directory: Path, plan: Plan) -> None:
        self.server = server
        self.directory = directory
        self.plan = plan
        self.rng = random.Random(20_241_122)
        self.workers: dict[int, Worker] = {}
        self.generations: dict[int, int] = {}
        #: Where the workers' stderr goes: aiosem's warnings, and any traceback.
        self.log = directory / "workers.log"
        self.outcome = Outcome(started=time.monotonic(), ended=math.nan)

    async def start_worker(self, slot: int) -> None:
        generation = self.generations[slot] = self.generations.get(slot, -1) + 1
        with self.log.open("a", encoding="utf-8") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable, SCRIPT, "--role", "worker", "--port", str(self.server.port),
                "--plan", json.dumps(asdict(self.plan)),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            )  # fmt: skip
        self.workers[slot] = Worker(slot, generation, process, self.outcome.events)

    async def run(self) -> Outcome:
        plan = self.plan
        outcome = self.outcome
        for slot in range(plan.workers):
            await self.start_worker(slot)
        outcome.started = time.monotonic()
        end = outcome.started + plan.seconds
        schedule = sorted(
            [
                (outcome.started + plan.kill_every * (i + 0.5), "kill")
                for i in range(int(plan.seconds // plan.kill_every))
            ]
            + [
                (outcome.started + plan.restart_every * i, "restart")
                for i in range(1, int(plan.seconds // plan.restart_every) + 1)
            ]
        )
        schedule = [(at, what) for at, what in schedule if at < end]
        async with anyio.create_task_group() as group:
            group.start_soon(self.watch)
            for at, what in schedule:
                await anyio.sleep(max(0.0, at - time.monotonic()))
                if what == "kill":
                    await self.kill_a_holder()
                else:
                    await self.restart_redis()
            await anyio.sleep(max(0.0, end - time.monotonic()))
            group.cancel_scope.cancel()
        outcome.ended = time.monotonic()
        for worker in self.workers.values():
            await worker.stop()
        return outcome

    async def watch(self) -> None:
        """Sample the load average, and start again any worker that died unbidden."""
        next_sample = time.monotonic()
        while True:
            if time.monotonic() >= next_sample:
                self.outcome.load.append(os.getloadavg()[0])
                next_sample += LOAD_SAMPLE_EVERY
            for slot, worker in list(self.workers.items()):
                if worker.process.returncode is not None and not worker.killed:
                    self.outcome.crashes.append(f"worker {worker.key} exited with {worker.process.returncode}")
                    await worker.reader
                    await self.start_worker(slot)
            await anyio.sleep(0.5)

    async def kill_a_holder(self) -> None:
        with anyio.move_on_after(HOLDER_WAIT):
            while not any(worker.holding for worker in self.workers.values()):  # noqa: ASYNC110 -- fed by pipes
                await anyio.sleep(0.005)
        holders = [worker for worker in self.workers.values() if worker.holding] or list(self.workers.values())
        victim = self.rng.choice(holders)
        killed_at = await victim.kill()
        self.outcome.kills.append(Kill(victim.key, killed_at))
        await self.start_worker(victim.slot)

    async def restart_redis(self) -> None:
        kind: RestartKind = "data kept" if len(self.outcome.restarts) % 2 == 0 else "data lost"
        stopped_at = time.monotonic()
        await asyncio.to_thread(self.server.stop)
        if kind == "data lost":
            for name in DATA_FILES:
                path = self.directory / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        await asyncio.to_thread(self.server.start, same_port=True)
        await asyncio.to_thread(until_loaded, self.server)
        self.outcome.restarts.append(Restart(kind, stopped_at, time.monotonic()))


def until_loaded(server: RedisServer) -> None:
    """Wait until ``server`` has loaded its data: it answers INFO before, and every other command with LOADING."""
    probe = redis.Redis(host=server.host, port=server.port, socket_timeout=5)
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT
        while int(probe.info("persistence")["loading"]) and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        probe.close()


# --- what the lines say ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    at: float
    change: int  # +1: a body entered; -1: one left (or its worker died)


def steps(outcome: Outcome) -> list[Step]:
    """Every body's start and end, in time order; a killed worker's open bodies end at its kill."""
    killed_at = {kill.worker: kill.at for kill in outcome.kills}
    open_bodies: Counter[str] = Counter()
    found = []
    for event in outcome.events:
        if event.kind == "enter":
            found.append(Step(event.at, 1))
            open_bodies[event.worker] += 1
        elif event.kind == "exit":
            found.append(Step(event.at, -1))
            open_bodies[event.worker] -= 1
    for kill in outcome.kills:
        kill.held = open_bodies[kill.worker]
        found += [Step(killed_at[kill.worker], -1)] * open_bodies.pop(kill.worker, 0)
    # Whatever is still open was cut short by the end of the run.
    found += [Step(outcome.ended, -1)] * sum(open_bodies.values())
    # At one instant, a body that ends is counted before one that starts: never a false excess.
    return sorted(found, key=lambda step: (step.at, step.change))


@dataclass(frozen=True, slots=True)
class Concurrency:
    most: int
    #: When a body started with the limit's bodies already running.
    excesses: list[float]
    #: The holders after each step, in the steps' order.
    levels: list[int]


def concurrency(found: Sequence[Step], limit: int) -> Concurrency:
    level = most = 0
    excesses = []
    levels = []
    for step in found:
        level += step.change
        levels.append(level)
        most = max(most, level)
        if step.change > 0 and level > limit:
            excesses.append(step.at)
    return Concurrency(most, excesses, levels)


def reclaim(kill: Kill, found: Sequence[Step], levels: Sequence[int], limit: int) -> float | None:
    """From the kill to the first grant that took the holders above ``limit - kill.held``, if any."""
    if not kill.held:
        return None
    start = bisect.bisect_right([step.at for step in found], kill.at)
    for step, level in zip(found[start:], levels[start:], strict=True):
        if step.change > 0 and level > limit - kill.held:
            return step.at - kill.at
    return None


def errors(events: Iterable[Event]) -> dict[str, int]:
    """How many errors of each type, and in which step (entering or leaving the ``async with``)."""
    return dict(Counter(event.error or "?" for event in events if event.kind == "error").most_common())


def in_window(at: float, restart: Restart, lease: float) -> bool:
    return restart.stopped_at <= at <= restart.ready_at + lease


def analyse(outcome: Outcome, plan: Plan) -> dict[str, Any]:
    found = steps(outcome)
    seen = concurrency(found, plan.limit)

    def in_a_window(event: Event) -> bool:
        return any(in_window(event.at, restart, plan.lease) for restart in outcome.restarts)

    for kill in outcome.kills:
        kill.reclaimed_after_s = reclaim(kill, found, seen.levels, plan.limit)
    enters = sorted(event.at for event in outcome.events if event.kind == "enter")
    for restart in outcome.restarts:
        restart.downtime_s = restart.ready_at - restart.stopped_at
        after = bisect.bisect_left(enters, restart.ready_at)
        restart.first_grant_after_s = enters[after] - restart.ready_at if after < len(enters) else None
        restart.over_limit = sum(in_window(at, restart, plan.lease) for at in seen.excesses)
    inside = sum(restart.over_limit for restart in outcome.restarts)
    tokens = Counter(event.token for event in outcome.events if event.kind == "enter")
    reclaims = [kill.reclaimed_after_s for kill in outcome.kills if kill.reclaimed_after_s is not None]
    seconds = outcome.ended - outcome.started
    return {
        "seconds": round(seconds, 1),
        "grants": len(enters),
        "grants_per_s": round(len(enters) / seconds, 1),
        "most_holders_at_once": seen.most,
        "over_limit": {
            "outside_failover_windows": len(seen.excesses) - inside,
            "inside_failover_windows": inside,
            "inside_by_restart_kind": {
                kind: sum(r.over_limit for r in outcome.restarts if r.kind == kind)
                for kind in ("data kept", "data lost")
            },
        },
        "fencing_tokens_handed_out_twice": sum(count > 1 for count in tokens.values()),
        "errors": errors(outcome.events),
        "errors_in_failover_windows": errors(event for event in outcome.events if in_a_window(event)),
        "errors_outside_failover_windows_at_s": [
            [round(event.at - outcome.started, 3), event.error]
            for event in outcome.events
            if event.kind == "error" and not in_a_window(event)
        ],
        "worker_kills": len(outcome.kills),
        "reclaim_s": {
            "median": round(statistics.median(reclaims), 3) if reclaims else None,
            "min": round(min(reclaims), 3) if reclaims else None,
            "max": round(max(reclaims), 3) if reclaims else None,
            "not_reclaimed": sum(kill.held > 0 and kill.reclaimed_after_s is None for kill in outcome.kills),
            "killed_holding_nothing": sum(kill.held == 0 for kill in outcome.kills),
        },
        "redis_restarts": len(outcome.restarts),
        "unexpected_worker_exits": outcome.crashes,
        "load_average_1min": {
            "mean": round(statistics.fmean(outcome.load), 2) if outcome.load else None,
            "max": round(max(outcome.load), 2) if outcome.load else None,
        },
        "restarts": [
            {
                "kind": r.kind,
                "at_s": round(r.stopped_at - outcome.started, 1),
                "downtime_s": round(r.downtime_s, 3),
                "first_grant_after_s": None if r.first_grant_after_s is None else round(r.first_grant_after_s, 3),
                "over_limit_in_window": r.over_limit,
            }
            for r in outcome.restarts
        ],
        "kills": [
            {
                "at_s": round(k.at - outcome.started, 1),
                "held": k.held,
                "reclaimed_after_s": None if k.reclaimed_after_s is None else round(k.reclaimed_after_s, 3),
                # A release that failed leaves its permit held until its lease runs out: one that failed
                # within a lease before the kill, or until the reclaim, may have delayed it.
                "releases_failed_around": sum(
                    event.kind == "error"
                    and (event.error or "").endswith("leaving")
                    and k.at - plan.lease <= event.at <= k.at + (k.reclaimed_after_s or plan.lease)
                    for event in outcome.events
                ),
            }
            for k in outcome.kills
        ],
    }


def print_report(result: dict[str, Any], plan: Plan) -> None:
    over = result["over_limit"]
    reclaim_s = result["reclaim_s"]
    print()
    print(
        markdown_table(
            ["figure", "value"],
            [
                [
                    "run",
                    f"{result['seconds']:g} s, {plan.workers} workers, limit {plan.limit}, lease {plan.lease:g} s, "
                    f"{plan.client} client",
                ],
                ["grants", f"{result['grants']:,} ({result['grants_per_s']:,.1f}/s)"],
                ["most holders at once", str(result["most_holders_at_once"])],
                ["over the limit, outside failover windows", str(over["outside_failover_windows"])],
                ["over the limit, inside (data kept / lost)", _by_kind(over["inside_by_restart_kind"])],
                ["fencing tokens handed out twice", str(result["fencing_tokens_handed_out_twice"])],
                ["worker kills", str(result["worker_kills"])],
                [
                    "reclaim after a kill (median / min / max)",
                    f"{reclaim_s['median']} / {reclaim_s['min']} / {reclaim_s['max']} s",
                ],
                ["Redis restarts", str(result["redis_restarts"])],
                ["errors", ", ".join(f"{name}: {count}" for name, count in result["errors"].items()) or "none"],
                [
                    "errors in failover windows",
                    ", ".join(f"{name}: {count}" for name, count in result["errors_in_failover_windows"].items())
                    or "none",
                ],
                [
                    "load average (1 min): mean / max",
                    f"{result['load_average_1min']['mean']} / {result['load_average_1min']['max']}",
                ],
            ],
        )
    )
    if result["restarts"]:
        print()
        print(
            markdown_table(
                ["restart at", "kind", "downtime", "first grant after", "over limit in window"],
                [
                    [
                        f"{r['at_s']:g} s",
                        r["kind"],
                        f"{r['downtime_s']:.3f} s",
                        "none" if r["first_grant_after_s"] is None else f"{r['first_grant_after_s']:.3f} s",
                        str(r["over_limit_in_window"]),
                    ]
                    for r in result["restarts"]
                ],
            )
        )


def _by_kind(counts: dict[str, int]) -> str:
    return " / ".join(str(counts[kind]) for kind in ("data kept", "data lost"))


async def soak(binary: str, plan: Plan) -> tuple[dict[str, Any], str]:
    with tempfile.TemporaryDirectory(prefix="aiosem-soak-") as name:
        directory = Path(name)
        server = RedisServer(binary, directory, *PERSISTENCE)
        server.start()
        soak = Soak(server, directory, plan)
        try:
            outcome = await soak.run()
        finally:
            for worker in soak.workers.values():
                if worker.process.returncode is None:
                    worker.process.kill()
                    await worker.process.wait()
            server.stop()
    return analyse(outcome, plan), server.version


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--minutes", type=positive, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--workers", type=int, default=8, help="worker processes (default 8)")
    parser.add_argument("--coroutines", type=int, default=1, help="coroutines per worker (default 1)")
    parser.add_argument("--limit", type=int, default=4, help="the semaphore's limit (default 4)")
    parser.add_argument("--lease", type=positive, default=2.0, help="the lease in seconds (default 2)")
    parser.add_argument("--hold", type=positive, default=0.05, help="mean hold in seconds (default 0.05)")
    parser.add_argument("--kill-every", type=positive, default=30.0, help="seconds between kills (default 30)")
    parser.add_argument("--restart-every", type=positive, default=120.0, help="seconds between restarts (default 120)")
    parser.add_argument(
        "--client",
        choices=["url", "retrying"],
        default="url",
        help="the workers' client: as configure(url=...) makes it (default), or redis-py's own, which retries",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument("--role", choices=["worker"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=json.loads, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run_worker(args.port, Plan(**args.plan)))
        return 0

    plan = Plan(
        client=args.client,
        seconds=args.minutes * 60,
        workers=args.workers,
        coroutines=args.coroutines,
        limit=args.limit,
        lease=args.lease,
        hold_mean=args.hold,
        kill_every=args.kill_every,
        restart_every=args.restart_every,
    )
    clock = time.get_clock_info("monotonic")
    if "CLOCK_MONOTONIC" not in clock.implementation:
        print(f"warning: monotonic is {clock.implementation}; times of several processes may not compare")
    binary = redis_server_binary()
    print(f"soaking for {args.minutes:g} min; load average now {os.getloadavg()[0]:.2f}", file=sys.stderr)
    result, version = asyncio.run(soak(binary, plan))
    print_report(result, plan)
    if args.json is not None:
        report = {**environment(version), "plan": asdict(plan), **result}
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
