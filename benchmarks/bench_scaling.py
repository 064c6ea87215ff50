"""How `AsyncFairSemaphore` scales: with worker processes, and with waiters in one process.

Two scenarios, each row on a fresh private ``redis-server``:

* ``processes``: 1, 2, 4 and 8 worker processes (this file run again with a
  hidden ``--role`` flag) on one semaphore of limit 16, 16 coroutines each,
  run ``acquire -> hold -> release`` from a common start for a fixed time.
  Total cycles/s and its ratio to 1 process, the p50/p99 time ``acquire``
  took, and over-limit observations, which must be 0: every hold is a span
  from ``acquire`` returning to ``release`` being called, stamped with
  ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, one clock for all the
  processes), and a sweep over all of them counts holds that began while
  ``limit`` others were in progress. A span lies inside the permit's time in
  Redis, so a count above 0 is a real over-admission. The hold is one pass of
  the event loop (``await asyncio.sleep(0)``). One process of 16 coroutines
  never waits (limit 16); more contend, and on a machine of few cores they
  also contend for the CPU with each other and with Redis.
* ``waiters``: 10, 100, 1,000 and 10,000 waiters -- ``acquire()`` calls
  blocked on the one permit (limit 1), which this process holds -- in one
  other process, on one client whose pool is a ``BlockingConnectionPool`` of
  16 connections. Reported: the connections the server lists under that
  client's name (target: at most the pool size + 2), the Python memory per
  waiter (``tracemalloc``: allocated after the waiters were started and
  queued, less before, over their number), and over an idle window the
  commands Redis ran per second (``INFO`` ``total_commands_processed``, which
  counts those inside scripts too; our own ``INFO`` taken off), and per
  waiter per third of the waiter timeout -- how often a waiter's process
  proves its waiters alive (target: at most 1). Then the permit is released:
  every waiter must get it in turn (each gives it back at once) within a
  bound, and nothing may be left queued in Redis or pending in the process.

The other processes talk to this one over their stdin and stdout, one JSON
line per message, so coordination sends nothing to Redis; each has a bounded
lifetime and is killed by its PID if it outstays it. Servers come from
``$AIOSEM_REDIS_SERVER``, else the ``redis-server`` on ``PATH``, listen on free
loopback ports without persistence, and are stopped by their PIDs; port 6379
is never touched.

Run it::

    python benchmarks/bench_scaling.py                  # about 1 minute
    python benchmarks/bench_scaling.py --quick          # a smoke run, about 30 s
    python benchmarks/bench_scaling.py --json benchmarks/results/scaling.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
import tracemalloc
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import redis.asyncio
from harness import (
    HOST,
    STEP_TIMEOUT,
    Message,
    Peer,
    commandstats_calls,
    environment,
    markdown_table,
    new_client,
    next_message,
    on_fresh_server,
    open_stdin,
    parse_or_play_role,
    percentile,
    redis_server_binary,
    report,
    verdict,
    write_report,
)

from aiosem import AsyncFairSemaphore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

T = TypeVar("T")

SCRIPT: Final = str(Path(__file__).resolve())
#: How long a helper process lives at most, whatever happens to this one.
ROLE_LIFETIME: Final = 300.0
POLL_PAUSE: Final = 0.01

# processes
PROCESS_COUNTS: Final = (1, 2, 4, 8)
LIMIT: Final = 16
COROUTINES_PER_PROCESS: Final = 16
LEASE: Final = 10.0
#: From the start order to the common start: time for every process to read it.
START_LEAD: Final = 0.2

# waiters
WAITER_COUNTS: Final = (10, 100, 1_000, 10_000)
POOL_SIZE: Final = 16
#: Connections a waiters' process may have beyond its pool (target).
EXTRA_CONNECTIONS: Final = 2
#: Commands per waiter per third of the waiter timeout (target).
COMMANDS_PER_WAITER_TARGET: Final = 1.0
#: Long enough that the held permit never runs out during a row.
HOLD_LEASE: Final = 120.0
WAITERS_CLIENT: Final = "aiosem-bench-waiters"
CONTROL_CLIENT: Final = "aiosem-bench-control"
#: Past the first re-check by this much before the idle window opens.
IDLE_SETTLE: Final = 0.2
#: How long the hand-offs through all the waiters may take, per waiter, over `STEP_TIMEOUT`.
HANDOFF_BOUND_PER_WAITER: Final = 0.005


# --- the other processes ----------------------------------------------------------


async def helpers(role: str, port: int, copies: int, **config: Any) -> list[Peer]:
    """Start ``copies`` helpers of one role, one after the other; kill those started if one fails to."""
    started: list[Peer] = []
    try:
        for _ in range(copies):
            helper = await Peer.start(role, port, script=SCRIPT, **config)
            started.append(helper)
    except BaseException:
        for helper in started:
            helper.kill()
        raise
    return started


async def sleep_until(moment: float) -> None:
    await asyncio.sleep(max(0.0, moment - time.perf_counter()))


async def worker_loop(semaphore: AsyncFairSemaphore, end: float, cycles: list[tuple[float, float, float]]) -> None:
    """Cycle until ``end``, noting each cycle's (called, acquired, releasing) times."""
    while time.perf_counter() < end:
        called = time.perf_counter()
        permit = await semaphore.acquire(blocking_timeout=STEP_TIMEOUT)
        acquired = time.perf_counter()
        if permit is None:
            raise RuntimeError(f"no permit within {STEP_TIMEOUT:g} s")
        # The hold: one pass of the event loop, so that holds admitted
        # together overlap in time as they do in Redis.
        await asyncio.sleep(0)
        releasing = time.perf_counter()
        await semaphore.release(permit)
        cycles.append((called, acquired, releasing))


async def role_worker(port: int, config: Message, stdin: asyncio.StreamReader) -> None:
    """On ``go``: cycle from ``start`` to ``end``, report every cycle, and wait for EOF."""
    client = new_client(port)
    semaphore = AsyncFairSemaphore(client, config["name"], config["limit"], timeout=config["lease"])
    try:
        # Loads the scripts and opens a connection before the clock starts.
        permit = await semaphore.acquire(blocking_timeout=STEP_TIMEOUT)
        if permit is not None:
            await semaphore.release(permit)
        report(ready=True)
        order = await next_message(stdin)
        if order is None:
            return
        await sleep_until(order["start"])
        cycles: list[tuple[float, float, float]] = []
        loops = [worker_loop(semaphore, order["end"], cycles) for _ in range(config["coroutines"])]
        await asyncio.gather(*loops)
        report(cycles=cycles, finished=time.perf_counter())
        await stdin.read()
    finally:
        await semaphore.aclose()
        await client.aclose()


async def role_waiters(port: int, config: Message, stdin: asyncio.StreamReader) -> None:
    """Start ``count`` waiters; on ``measure`` report their memory, on ``drain`` wait for them all to pass."""
    pool = redis.asyncio.BlockingConnectionPool(
        host=HOST, port=port, max_connections=config["pool"], timeout=STEP_TIMEOUT, client_name=config["client_name"]
    )
    client = redis.asyncio.Redis.from_pool(pool)
    semaphore = AsyncFairSemaphore(client, config["name"], 1, timeout=config["lease"])
    count: int = config["count"]

    async def wait_and_pass() -> None:
        permit = await semaphore.acquire(blocking_timeout=ROLE_LIFETIME)
        if permit is None:
            raise RuntimeError("a waiter gave up")
        await semaphore.release(permit)

    tasks: list[asyncio.Task[None]] = []
    try:
        # The connection opened and the scripts loaded before the count starts.
        await semaphore.waiting()
        tracemalloc.start()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        tasks = [asyncio.create_task(wait_and_pass()) for _ in range(count)]
        report(ready=True, waiter_timeout=semaphore.waiter_timeout)
        if await next_message(stdin) is None:  # measure: they are all queued
            return
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        # Off again: the hand-offs are timed without it.
        tracemalloc.stop()
        report(bytes_per_waiter=grown / count)
        if (order := await next_message(stdin)) is None:  # drain: the permit is free
            return
        started = time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=order["bound"])
        drained = time.perf_counter() - started
        failed = sum(1 for task in tasks if task.done() and task.exception() is not None)
        report(
            passed=sum(1 for task in tasks if task.done() and task.exception() is None),
            failed=failed,
            pending=len(pending),
            local_waiters=semaphore.statistics().local_waiters,
            seconds=drained,
        )
        await stdin.read()
    finally:
        for task in tasks:
            task.cancel()
        with anyio.move_on_after(STEP_TIMEOUT):
            await asyncio.gather(*tasks, return_exceptions=True)
        await semaphore.aclose()
        await client.aclose()
        await pool.aclose()


ROLES: Final[dict[str, Callable[[int, Message, asyncio.StreamReader], Awaitable[None]]]] = {
    "worker": role_worker,
    "waiters": role_waiters,
}


async def run_role(role: str, port: int, config: Message) -> None:
    try:
        with anyio.fail_after(ROLE_LIFETIME):
            await ROLES[role](port, config, await open_stdin())
    except Exception as error:
        report(error=f"{type(error).__name__}: {error}")
        raise


# --- 1. processes -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessesResult:
    processes: int
    coroutines: int
    limit: int
    cycles: int
    seconds: float
    cycles_per_second: float
    acquire_p50_ms: float
    acquire_p99_ms: float
    #: Holds, warm-up included, that began with ``limit`` others in progress (must be 0).
    over_limit: int
    most_in_use: int
    #: cycles/s over that of 1 process, in this run.
    ratio_to_one: float | None = None


def sweep(holds: Sequence[tuple[float, float]], limit: int) -> tuple[int, int]:
    """Over-limit observations and the most holds at once, from (start, end) spans."""
    # At equal times an end goes first: a permit freed and taken again in the same tick is no overlap.
    events = sorted([(start, 1) for start, _ in holds] + [(end, -1) for _, end in holds])
    in_use = most = over = 0
    for _, step in events:
        in_use += step
        if step > 0:
            most = max(most, in_use)
            over += in_use > limit
    return over, most


async def measure_processes(port: int, *, processes: int, duration: float, warmup: float) -> ProcessesResult:
    workers = await helpers(
        "worker", port, processes, name="scaling", limit=LIMIT, lease=LEASE, coroutines=COROUTINES_PER_PROCESS
    )
    try:
        for worker in workers:
            await worker.receive()
        start = time.perf_counter() + START_LEAD
        measure_from, end = start + warmup, start + warmup + duration
        for worker in workers:
            await worker.send(start=start, end=end)
        reports = [await worker.receive(within=START_LEAD + warmup + duration + STEP_TIMEOUT) for worker in workers]
    except BaseException:
        # Whatever went wrong, no worker is left cycling.
        for worker in workers:
            worker.kill()
        raise
    finally:
        for worker in workers:
            await worker.close()

    holds: list[tuple[float, float]] = []
    latencies: list[float] = []
    cycles = 0
    rate = 0.0
    for message in reports:
        spans = [(called, acquired, releasing) for called, acquired, releasing in message["cycles"]]
        holds.extend((acquired, releasing) for _, acquired, releasing in spans)
        measured = [(called, acquired) for called, acquired, _ in spans if called >= measure_from]
        latencies.extend(acquired - called for called, acquired in measured)
        cycles += len(measured)
        # Cycles begun before the end count, so the time they took does too.
        rate += len(measured) / (max(message["finished"], end) - measure_from)
    over, most = sweep(holds, LIMIT)
    latencies.sort()
    return ProcessesResult(
        processes=processes,
        coroutines=processes * COROUTINES_PER_PROCESS,
        limit=LIMIT,
        cycles=cycles,
        seconds=round(duration, 3),
        cycles_per_second=round(rate, 1),
        acquire_p50_ms=round(percentile(latencies, 0.50) * 1000, 3),
        acquire_p99_ms=round(percentile(latencies, 0.99) * 1000, 3),
        over_limit=over,
        most_in_use=most,
    )


# --- 2. waiters in one process ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class WaitersResult:
    waiters: int
    pool_size: int
    #: The most connections listed under the waiters' client name, over three looks.
    connections: int
    connections_target_met: bool
    queue_fill_s: float
    bytes_per_waiter: float
    window_s: float
    commands_per_s: float
    #: EVALSHA and EVAL calls: what the waiters' process sent, as aiosem's fair steps are scripts.
    scripts_per_s: float
    #: Every command Redis ran in the window, by name, per second (commandstats).
    commands_by_name: dict[str, float]
    waiter_timeout_s: float
    #: Commands per waiter per third of the waiter timeout (the target's measure), and scripts.
    commands_per_waiter_per_recheck: float
    scripts_per_waiter_per_recheck: float
    commands_target_met: bool
    passed: int
    failed: int
    pending: int
    handoffs_s: float
    #: Left queued in Redis, holders in Redis, and waiters of the process's semaphore object, after the hand-offs.
    left_queued: int
    left_holders: int
    left_local: int
    all_passed: bool


async def until(predicate: Callable[[], Awaitable[bool]], what: str, within: float = STEP_TIMEOUT) -> None:
    """Poll ``predicate`` until it holds; `TimeoutError` if it does not ``within`` seconds."""
    deadline = time.perf_counter() + within
    while not await predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not within {within:g} s")
        await asyncio.sleep(POLL_PAUSE)


@dataclass(frozen=True, slots=True)
class Traffic:
    seconds: float
    #: INFO total_commands_processed: every command, those inside scripts too.
    commands_per_s: float
    #: From INFO commandstats, by command name.
    by_name: dict[str, float]


async def idle_traffic(control: redis.asyncio.Redis, window: float) -> Traffic:
    """What Redis ran over ``window`` seconds, our own INFO left out."""
    before = await control.info("stats", "commandstats")
    begin = time.perf_counter()
    await asyncio.sleep(window)
    after = await control.info("stats", "commandstats")
    elapsed = time.perf_counter() - begin
    # The first INFO counts itself only once it has run, so it shows in the second.
    commands = int(after["total_commands_processed"]) - int(before["total_commands_processed"]) - 1
    calls_before = commandstats_calls(before)
    by_name = {
        command: (calls - calls_before.get(command, 0)) / elapsed
        for command, calls in commandstats_calls(after).items()
        if command != "info" and calls > calls_before.get(command, 0)
    }
    return Traffic(elapsed, commands / elapsed, dict(sorted(by_name.items(), key=lambda item: -item[1])))


async def measure_waiters(port: int, *, waiters: int, window: float) -> WaitersResult:
    control = redis.asyncio.Redis(host=HOST, port=port, client_name=CONTROL_CLIENT)
    holder = AsyncFairSemaphore(control, "waiters", 1, timeout=HOLD_LEASE)

    async def connections() -> int:
        return sum(1 for entry in await control.client_list() if entry.get("name") == WAITERS_CLIENT)

    async def all_queued() -> bool:
        return await holder.waiting() >= waiters

    bound = STEP_TIMEOUT + waiters * HANDOFF_BOUND_PER_WAITER
    permit = None
    try:
        permit = await holder.acquire(blocking_timeout=STEP_TIMEOUT)
        if permit is None:
            raise RuntimeError("the holder could not take the free permit")
        (process,) = await helpers(
            "waiters", port, 1, name="waiters", count=waiters, lease=HOLD_LEASE, pool=POOL_SIZE,
            client_name=WAITERS_CLIENT,
        )  # fmt: skip
        try:
            ready = await process.receive()
            started = time.perf_counter()
            await until(all_queued, f"{waiters:,} waiters queued", within=bound)
            queue_fill = time.perf_counter() - started
            seen = [await connections()]
            await process.send(measure=True)
            memory = await process.receive()
            # Past the first re-check, which may load a script or open a connection: the window sees the steady state.
            await asyncio.sleep(ready["waiter_timeout"] / 3 + IDLE_SETTLE)
            seen.append(await connections())
            traffic = await idle_traffic(control, window)
            seen.append(await connections())
            await holder.release(permit)
            permit = None
            await process.send(drain=True, bound=bound)
            drained = await process.receive(within=bound + STEP_TIMEOUT)
            left_queued = await holder.waiting()
            left_holders = len(await holder.holders())
        except BaseException:
            process.kill()
            raise
        finally:
            await process.close()
    finally:
        if permit is not None:
            await holder.release(permit)
        await holder.aclose()
        await control.aclose()

    scripts_per_s = traffic.by_name.get("evalsha", 0.0) + traffic.by_name.get("eval", 0.0)
    recheck = ready["waiter_timeout"] / 3
    per_waiter = traffic.commands_per_s * recheck / waiters
    most_connections = max(seen)
    return WaitersResult(
        waiters=waiters,
        pool_size=POOL_SIZE,
        connections=most_connections,
        connections_target_met=most_connections <= POOL_SIZE + EXTRA_CONNECTIONS,
        queue_fill_s=round(queue_fill, 3),
        bytes_per_waiter=round(memory["bytes_per_waiter"]),
        window_s=round(traffic.seconds, 3),
        commands_per_s=round(traffic.commands_per_s, 1),
        scripts_per_s=round(scripts_per_s, 1),
        commands_by_name={command: round(rate, 1) for command, rate in traffic.by_name.items()},
        waiter_timeout_s=ready["waiter_timeout"],
        commands_per_waiter_per_recheck=round(per_waiter, 4),
        scripts_per_waiter_per_recheck=round(scripts_per_s * recheck / waiters, 4),
        commands_target_met=per_waiter <= COMMANDS_PER_WAITER_TARGET,
        passed=drained["passed"],
        failed=drained["failed"],
        pending=drained["pending"],
        handoffs_s=round(drained["seconds"], 3),
        left_queued=left_queued,
        left_holders=left_holders,
        left_local=drained["local_waiters"],
        all_passed=(
            drained["passed"] == waiters and not drained["pending"] and not left_queued and not left_holders
            and not drained["local_waiters"]
        ),
    )  # fmt: skip


# --- the report ------------------------------------------------------------


def processes_table(results: Sequence[ProcessesResult]) -> str:
    header = (
        "processes",
        "coroutines",
        "cycles/s",
        "vs 1 process",
        "acquire p50 ms",
        "acquire p99 ms",
        "over limit",
        "most in use",
    )
    rows = [
        (
            str(r.processes),
            str(r.coroutines),
            f"{r.cycles_per_second:,.0f}",
            "n/a" if r.ratio_to_one is None else f"{r.ratio_to_one:.2f}",
            f"{r.acquire_p50_ms:.3f}",
            f"{r.acquire_p99_ms:.3f}",
            str(r.over_limit) if r.over_limit == 0 else f"**{r.over_limit}**",
            str(r.most_in_use),
        )
        for r in results
    ]
    return (
        f"Processes on one AsyncFairSemaphore (limit {LIMIT}, {COROUTINES_PER_PROCESS} coroutines each, "
        f"{os.cpu_count()} CPUs): over limit must be 0\n\n" + markdown_table(header, rows)
    )


def waiters_table(results: Sequence[WaitersResult]) -> str:
    header = (
        "waiters",
        "connections",
        "pool",
        "<= pool + 2",
        "queued in s",
        "bytes/waiter",
        "commands/s idle",
        "per waiter per recheck",
        "<= 1",
        "scripts/s",
        "scripts per waiter per recheck",
        "passed",
        "hand-offs s",
        "left",
        "all passed",
    )
    rows = [
        (
            f"{r.waiters:,}",
            str(r.connections),
            str(r.pool_size),
            verdict(r.connections_target_met),
            f"{r.queue_fill_s:.2f}",
            f"{r.bytes_per_waiter:,.0f}",
            f"{r.commands_per_s:,.1f}",
            f"{r.commands_per_waiter_per_recheck:.4f}",
            verdict(r.commands_target_met),
            f"{r.scripts_per_s:,.1f}",
            f"{r.scripts_per_waiter_per_recheck:.4f}",
            f"{r.passed:,}",
            f"{r.handoffs_s:.2f}",
            f"{r.left_queued + r.left_holders + r.left_local + r.pending}",
            verdict(r.all_passed),
        )
        for r in results
    ]
    recheck = results[0].waiter_timeout_s / 3 if results else 0
    return (
        "Waiters in one process on one permit held elsewhere (limit 1, a BlockingConnectionPool of "
        f"{POOL_SIZE}); recheck: a third of the waiter timeout ({recheck:.3g} s); commands: every command Redis "
        f"ran over {results[0].window_s if results else 0:g} s idle, scripts' included\n\n"
        + markdown_table(header, rows)
    )


# --- running ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    duration: float
    warmup: float
    idle_window: float


FULL: Final = Plan(duration=3.0, warmup=0.5, idle_window=4.0)
QUICK: Final = Plan(duration=1.0, warmup=0.25, idle_window=2.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="shorter rows: a smoke run")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    args = parse_or_play_role(parser, argv, ROLES, run_role)
    if args is None:
        return 0
    binary = redis_server_binary()
    plan = QUICK if args.quick else FULL
    versions: set[str] = set()

    processes = [
        on_fresh_server(
            binary,
            versions,
            f"{count} process(es)",
            partial(measure_processes, processes=count, duration=plan.duration, warmup=plan.warmup),
        )
        for count in PROCESS_COUNTS
    ]
    one = processes[0].cycles_per_second
    processes = [replace(r, ratio_to_one=round(r.cycles_per_second / one, 3)) if one else r for r in processes]
    waiters = [
        on_fresh_server(
            binary, versions, f"{count:,} waiters", partial(measure_waiters, waiters=count, window=plan.idle_window)
        )
        for count in WAITER_COUNTS
    ]

    for table in (processes_table(processes), waiters_table(waiters)):
        print()
        print(table)

    if args.json is not None:
        report = {
            **environment(sorted(versions)),
            "quick": args.quick,
            "plan": asdict(plan),
            "processes": [asdict(result) for result in processes],
            "waiters": [asdict(result) for result in waiters],
        }
        write_report(args.json, report)
    # The targets are reported; a correctness failure fails the run.
    return 0 if all(r.over_limit == 0 for r in processes) and all(r.all_passed for r in waiters) else 1


if __name__ == "__main__":
    raise SystemExit(main())
