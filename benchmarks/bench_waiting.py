"""How aiosem's semaphores wait: hand-off latency, fairness, crash reclaim, and what idle waiters cost.

Four scenarios, each run for `AsyncFairSemaphore` and `AsyncLockedSemaphore`,
each on a fresh private ``redis-server`` (limit 1 throughout):

* ``handoff``: a holder in this process, a waiter in another. The time from
  the start of the holder's ``release()`` to the waiter's ``acquire()``
  returning, next to floors measured on the same server in the same run: one
  EVALSHA round trip of a trivial script (p50 of 1,000 back to back, and of
  calls after the same idle pause), and a plain PUBLISH to an idle listener in
  the other process -- which any hand-off that wakes a process pays.
* ``fairness``: 20 waiters arrive 5 ms apart from two processes in turn; each
  notes when it calls ``acquire`` (``time.perf_counter``, one clock for all
  processes on Linux) and takes a ticket (INCR) right after it returns.
  Grants out of the order of the calls are inversions. Meanwhile a
  third task calls ``acquire(blocking=False)`` every millisecond: a success
  while a waiter is queued jumps the queue. Each waiter process notes its
  garbage collections (``gc.callbacks``): a full one of a process that has
  imported redis-py took 10-40 ms on these machines, and one that starts
  between a call and its step's write sends the step behind later calls of
  the other process. Such inversions are counted apart.
* ``crash``: (a) a holder process is SIGKILLed; how long past its lease a
  waiter in another process gets the permit. (b) the waiter at the head of
  the queue is SIGKILLed just before the permit frees; how long the next
  waiter then waits, against the waiter timeout.
* ``connections``: 1,000 waiters in one process: how many connections they
  hold open, and how many commands per second they send while idle.

The other processes run this file again with a hidden ``--role`` flag and
talk to this one over their stdin and stdout, one JSON line per message, so
coordination sends nothing to Redis. ``time.perf_counter`` is
CLOCK_MONOTONIC on Linux, so times taken in different processes compare.

It starts its servers (``$AIOSEM_REDIS_SERVER``, else the one on ``PATH``) on
free loopback ports, with no persistence, and stops each by its PID; it never
touches port 6379.

Run it::

    python benchmarks/bench_waiting.py                 # about 1 minute
    python benchmarks/bench_waiting.py --quick         # a smoke run, about 30 s
    python benchmarks/bench_waiting.py --json benchmarks/results/waiting.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, TypeAlias, TypeVar

import anyio
import redis
import redis.asyncio
from harness import (
    HOST,
    STEP_TIMEOUT,
    Message,
    Peer,
    environment,
    markdown_table,
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

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

Kind = Literal["fair", "locked"]
Semaphore: TypeAlias = AsyncFairSemaphore | AsyncLockedSemaphore
CrashCase = Literal["holder killed", "head waiter killed"]
T = TypeVar("T")

KINDS: Final[tuple[Kind, ...]] = ("fair", "locked")
#: What ``--only`` may pick.
SCENARIOS: Final = ("handoff", "fairness", "crash", "idle")
LABELS: Final[dict[Kind, str]] = {"fair": "AsyncFairSemaphore", "locked": "AsyncLockedSemaphore"}
SCRIPT: Final = str(Path(__file__).resolve())

#: How long a helper process lives at most, whatever happens to this one.
ROLE_LIFETIME: Final = 300.0
#: Pause between two looks at a condition polled in Redis.
POLL_PAUSE: Final = 0.0005

# handoff
#: Unmeasured repetitions first: scripts loaded, connections open, subscribed.
HANDOFF_WARMUP: Final = 10
#: After the waiter shows up in the queue, let its process settle into waiting.
HANDOFF_SETTLE: Final = 0.002
EVALSHA_CALLS: Final = 1000
TRIVIAL_SCRIPT: Final = "return 1"
HANDOFF_TARGETS: Final[dict[Kind, dict[str, float]]] = {"fair": {"p50": 0.5, "p99": 2.0}, "locked": {"p50": 1.5}}

# fairness
FAIR_WAITERS: Final = 20
FAIR_SPACING: Final = 0.005
#: Each waiter holds longer than the arrival spacing, so the queue never
#: empties before the last arrival: a non-blocking success before the last
#: grant always jumps somebody.
FAIR_HOLD: Final = 0.010
#: The holder that starts each run lets go once this many have queued.
FAIR_RELEASE_AFTER: Final = 10
FAIR_LEAD: Final = 0.05
PROBE_PAUSE: Final = 0.001

# crash
CRASH_LEASE: Final = 1.0
CRASH_WAITER_TIMEOUT: Final = 1.0
CRASH_EXCESS_TARGET: Final = 0.2

# connections
IDLE_WAITERS: Final = 1000
#: Long enough that nobody's lease runs out during the measurement.
IDLE_LEASE: Final = 60.0
WAITERS_CLIENT: Final = "aiosem-bench-waiters"
#: Past the first heartbeat, by this much, before the idle window opens.
IDLE_SETTLE: Final = 0.2
CONTROL_CLIENT: Final = "aiosem-bench-control"


def make(
    kind: Kind, client: redis.asyncio.Redis, name: str, *, timeout: float = 10.0, waiter_timeout: float | None = None
) -> Semaphore:
    if kind == "fair":
        return AsyncFairSemaphore(client, name, 1, timeout=timeout, waiter_timeout=waiter_timeout)
    return AsyncLockedSemaphore(client, name, 1, timeout=timeout, waiter_timeout=waiter_timeout)


def new_client(port: int, client_name: str) -> redis.asyncio.Redis:
    # Unbounded, as users' pools are: the connection count is a result here.
    return redis.asyncio.Redis(host=HOST, port=port, client_name=client_name)


async def until(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``predicate`` until it holds; `TimeoutError` after `STEP_TIMEOUT`."""
    deadline = time.perf_counter() + STEP_TIMEOUT
    while not await predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: not within {STEP_TIMEOUT:g} s")
        await asyncio.sleep(POLL_PAUSE)


def queued(semaphore: Semaphore, count: int) -> Callable[[], Awaitable[bool]]:
    """A condition: at least ``count`` waiters are queued on ``semaphore``."""

    async def check() -> bool:
        return await semaphore.waiting() >= count

    return check


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# --- the other processes -------------------------------------------------------


async def role_handoff_waiter(client: redis.asyncio.Redis, config: Message, stdin: asyncio.StreamReader) -> None:
    """On each ``go``: wait for the permit, note when it came, give it back.

    On each ``listen``: say so, wait for one message on a plain pub/sub
    channel, and note when it came -- the floor under any hand-off that
    wakes another process.
    """
    semaphore = make(config["kind"], client, config["name"])
    pubsub = client.pubsub()
    await pubsub.subscribe(config["channel"])
    while (message := await pubsub.get_message(timeout=STEP_TIMEOUT)) is None or message["type"] != "subscribe":
        pass
    report(ready=True)
    while (order := await next_message(stdin)) is not None:
        if "listen" in order:
            report(listening=True)
            while await pubsub.get_message(timeout=STEP_TIMEOUT) is None:
                pass
            report(end=time.perf_counter())
            continue
        permit = await semaphore.acquire(blocking_timeout=STEP_TIMEOUT)
        end = time.perf_counter()
        if permit is None:
            report(error=f"no hand-off within {STEP_TIMEOUT:g} s")
            continue
        await semaphore.release(permit)
        report(end=end)
    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8.2


def run_keys(name: str, run: int) -> tuple[str, str]:
    """The counters one fairness run numbers its arrivals and its grants with."""
    return f"bench:{name}:{run}:arrivals", f"bench:{name}:{run}:grants"


async def fair_waiter(client: redis.asyncio.Redis, semaphore: Semaphore, run: int, at: float) -> Message:
    arrivals, grants = run_keys(semaphore.name, run)
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    late = time.perf_counter() - at
    arrival = await client.incr(arrivals)
    called = time.perf_counter()
    permit = await semaphore.acquire(blocking_timeout=STEP_TIMEOUT)
    if permit is None:
        return {"arrival": arrival, "called": called, "grant": None, "late": late}
    grant = await client.incr(grants)
    await asyncio.sleep(FAIR_HOLD)
    released = await semaphore.release(permit)
    return {"arrival": arrival, "called": called, "grant": grant, "late": late, "released": released}


async def role_fair_waiters(client: redis.asyncio.Redis, config: Message, stdin: asyncio.StreamReader) -> None:
    """On each ``run``: this process's half of the arrivals, every other one from ``slot``."""
    semaphore = make(config["kind"], client, config["name"])
    slot = config["slot"]
    collections: list[list[float]] = []

    def note_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append([time.perf_counter(), 0.0])
        elif collections:
            collections[-1][1] = time.perf_counter()

    gc.callbacks.append(note_collection)
    report(ready=True)
    while (message := await next_message(stdin)) is not None:
        run, start = message["run"], message["start"]
        collections.clear()
        arrivals = range(slot, config["waiters"], 2)
        waiters = await asyncio.gather(
            *(fair_waiter(client, semaphore, run, start + k * FAIR_SPACING) for k in arrivals)
        )
        report(slot=slot, waiters=[{**waiter, "slot": slot} for waiter in waiters], collections=collections)


async def role_crash_holder(client: redis.asyncio.Redis, config: Message, stdin: asyncio.StreamReader) -> None:
    """Take the permit, say when, and hold it (never refreshing) until killed."""
    semaphore = make(config["kind"], client, config["name"], timeout=config["timeout"])
    started = time.perf_counter()
    permit = await semaphore.acquire(blocking_timeout=STEP_TIMEOUT)
    if permit is None:
        report(error="the holder found the permit taken")
        return
    report(started=started, acquired=time.perf_counter(), token=permit.fencing_token)
    await stdin.read()


async def role_crash_waiter(client: redis.asyncio.Redis, config: Message, stdin: asyncio.StreamReader) -> None:
    """On ``go``, queue for the permit, and stay queued until killed."""
    semaphore = make(config["kind"], client, config["name"], waiter_timeout=config["waiter_timeout"])
    report(ready=True)
    if await next_message(stdin) is None:
        return
    permit = await semaphore.acquire(blocking_timeout=ROLE_LIFETIME)
    report(acquired=permit is not None)
    await stdin.read()


async def role_idle_waiters(client: redis.asyncio.Redis, config: Message, stdin: asyncio.StreamReader) -> None:
    """Start ``count`` waiters on one semaphore object; give up on EOF."""
    semaphore = make(config["kind"], client, config["name"], timeout=config["timeout"])
    tasks = [asyncio.create_task(semaphore.acquire(blocking_timeout=ROLE_LIFETIME)) for _ in range(config["count"])]
    report(ready=True)
    await stdin.read()
    for task in tasks:
        task.cancel()
    with anyio.move_on_after(STEP_TIMEOUT):
        await asyncio.gather(*tasks, return_exceptions=True)


ROLES: Final[dict[str, Callable[[redis.asyncio.Redis, Message, asyncio.StreamReader], Awaitable[None]]]] = {
    "handoff-waiter": role_handoff_waiter,
    "fair-waiters": role_fair_waiters,
    "crash-holder": role_crash_holder,
    "crash-waiter": role_crash_waiter,
    "idle-waiters": role_idle_waiters,
}


async def run_role(role: str, port: int, config: Message) -> None:
    client = new_client(port, config.get("client_name", f"aiosem-bench-{role}"))
    try:
        with anyio.fail_after(ROLE_LIFETIME):
            await client.ping()
            await ROLES[role](client, config, await open_stdin())
    finally:
        await client.aclose()


# --- 1. hand-off latency -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HandoffResult:
    kind: Kind
    repetitions: int
    evalsha_p50_ms: float
    #: The same, each call after the pause a hand-off's waiter idles for.
    idle_evalsha_p50_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    p50_over_evalsha: float
    p99_over_evalsha: float
    #: A plain PUBLISH from this process to an idle listener in the other.
    publish_p50_ms: float
    publish_p99_ms: float
    p50_over_publish: float
    targets_ms: dict[str, float]
    targets_met: bool


async def evalsha_round_trip(client: redis.asyncio.Redis, calls: int) -> float:
    """The p50, in seconds, of ``calls`` sequential EVALSHA calls of a trivial script."""
    sha = await client.script_load(TRIVIAL_SCRIPT)
    for _ in range(10):
        await client.evalsha(sha, 0)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        await client.evalsha(sha, 0)
        times.append(time.perf_counter() - started)
    return percentile(sorted(times), 0.5)


async def measure_handoff(port: int, kind: Kind, repetitions: int) -> HandoffResult:
    client = new_client(port, CONTROL_CLIENT)
    name = channel = f"handoff-{kind}"
    holder = make(kind, client, name)
    latencies: list[float] = []
    publishes: list[float] = []
    idle_evalsha: list[float] = []
    try:
        evalsha = await evalsha_round_trip(client, EVALSHA_CALLS)
        sha = await client.script_load(TRIVIAL_SCRIPT)
        async with await Peer.start(
            "handoff-waiter", port, script=SCRIPT, kind=kind, name=name, channel=channel
        ) as waiter:
            await waiter.receive()
            for repetition in range(HANDOFF_WARMUP + repetitions):
                # The floor first, in the same conditions: the listener idle
                # for about as long as a queued waiter is below.
                await waiter.send(listen=repetition)
                await waiter.receive()
                await asyncio.sleep(HANDOFF_SETTLE)
                start = time.perf_counter()
                await client.publish(channel, "wake")
                end = (await waiter.receive())["end"]
                if repetition >= HANDOFF_WARMUP:
                    publishes.append(end - start)
                await asyncio.sleep(HANDOFF_SETTLE)
                start = time.perf_counter()
                await client.evalsha(sha, 0)
                if repetition >= HANDOFF_WARMUP:
                    idle_evalsha.append(time.perf_counter() - start)
                permit = await holder.acquire(blocking_timeout=STEP_TIMEOUT)
                if permit is None:
                    raise RuntimeError("the holder could not take the free permit")
                await waiter.send(go=repetition)
                await until(queued(holder, 1), "the waiter queued")
                await asyncio.sleep(HANDOFF_SETTLE)
                start = time.perf_counter()
                await holder.release(permit)
                end = (await waiter.receive())["end"]
                if repetition >= HANDOFF_WARMUP:
                    latencies.append(end - start)
    finally:
        await client.aclose()
    ordered, floor = sorted(latencies), sorted(publishes)
    p50, p99 = percentile(ordered, 0.5), percentile(ordered, 0.99)
    targets = HANDOFF_TARGETS[kind]
    met = ms(p50) <= targets["p50"] and ms(p99) <= targets.get("p99", float("inf"))
    return HandoffResult(
        kind=kind,
        repetitions=len(latencies),
        evalsha_p50_ms=ms(evalsha),
        idle_evalsha_p50_ms=ms(percentile(sorted(idle_evalsha), 0.5)),
        p50_ms=ms(p50),
        p90_ms=ms(percentile(ordered, 0.9)),
        p99_ms=ms(p99),
        max_ms=ms(ordered[-1]),
        p50_over_evalsha=round(p50 / evalsha, 2),
        p99_over_evalsha=round(p99 / evalsha, 2),
        publish_p50_ms=ms(percentile(floor, 0.5)),
        publish_p99_ms=ms(percentile(floor, 0.99)),
        p50_over_publish=round(p50 / percentile(floor, 0.5), 2),
        targets_ms=targets,
        targets_met=met,
    )


# --- 2. fairness ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FairnessResult:
    kind: Kind
    runs: int
    waiters_per_run: int
    #: Runs in which the grant order was not the arrival order.
    runs_with_inversions: int
    #: Waiters granted at another position than they arrived at.
    misplaced_waiters: int
    #: Pairs of waiters granted in the opposite order to their arrival.
    inverted_pairs: int
    #: The widest gap between the acquire calls of an inverted pair: an
    #: inversion narrower than a step is a race to the queue, not a queue
    #: out of order.
    widest_inversion_ms: float | None
    #: How late, at worst, an arrival came after its schedule.
    worst_arrival_lag_ms: float
    #: Inverted pairs whose earlier caller's process began a garbage
    #: collection between the two calls: its step waited for the collection.
    pairs_behind_a_collection: int
    #: The widest gap between the calls of an inverted pair not behind a
    #: collection.
    widest_inversion_elsewhere_ms: float | None
    #: The longest garbage collection of a waiter process in a counted run.
    longest_collection_ms: float
    nowait_attempts: int
    nowait_successes: int
    #: Non-blocking successes while some waiter was queued: must be 0.
    nowait_jumps: int


@dataclass(slots=True)
class Probe:
    attempts: int = 0
    successes: int = 0
    jumps: int = 0


async def probe_nowait(
    semaphore: Semaphore, client: redis.asyncio.Redis, grants: str, stop: asyncio.Event, probe: Probe
) -> None:
    """Try to take the permit without waiting, every millisecond, until ``stop``."""
    with anyio.fail_after(STEP_TIMEOUT):
        while not stop.is_set():
            permit = await semaphore.acquire(blocking=False)
            probe.attempts += 1
            if permit is not None:
                probe.successes += 1
                # The permit is held without a break from the first holder's
                # grant to the last waiter's, so any waiter not yet granted
                # was queued when this success happened.
                if int(await client.get(grants) or 0) < FAIR_WAITERS:
                    probe.jumps += 1
                await semaphore.release(permit)
            await asyncio.sleep(PROBE_PAUSE)


def behind_a_collection(first: Message, second: Message, collections: dict[int, list[list[float]]]) -> bool:
    """Whether ``first``'s process began collecting garbage after its call and before ``second``'s."""
    return any(first["called"] <= start <= second["called"] for start, _ in collections[first["slot"]])


def inverted_pairs(waiters: Sequence[Message]) -> list[tuple[Message, Message]]:
    """Pairs (earlier arrival, later arrival) granted the other way round."""
    ordered = sorted(waiters, key=lambda waiter: waiter["called"])
    return [
        (first, second)
        for i, first in enumerate(ordered)
        for second in ordered[i + 1 :]
        if first["grant"] > second["grant"]
    ]


async def measure_fairness(port: int, kind: Kind, runs: int) -> FairnessResult:
    client = new_client(port, CONTROL_CLIENT)
    name = f"fairness-{kind}"
    # One semaphore object per process for all runs, as a service would have.
    holder, prober = make(kind, client, name), make(kind, client, name)
    probe = Probe()
    runs_with_inversions = misplaced = pairs = pairs_behind_collections = 0
    worst_lag = longest_collection = 0.0
    gaps: list[float] = []
    gaps_elsewhere: list[float] = []
    try:
        async with (
            await Peer.start(
                "fair-waiters", port, script=SCRIPT, kind=kind, name=name, slot=0, waiters=FAIR_WAITERS
            ) as even,
            await Peer.start(
                "fair-waiters", port, script=SCRIPT, kind=kind, name=name, slot=1, waiters=FAIR_WAITERS
            ) as odd,
        ):
            await even.receive()
            await odd.receive()
            # Run 0 warms up (scripts loaded, channels subscribed) and is not counted.
            for run in range(runs + 1):
                _, grants = run_keys(name, run)
                permit = await holder.acquire(blocking_timeout=STEP_TIMEOUT)
                if permit is None:
                    raise RuntimeError("the first holder could not take the free permit")
                stop = asyncio.Event()
                probing = asyncio.create_task(probe_nowait(prober, client, grants, stop, probe if run else Probe()))
                start = time.perf_counter() + FAIR_LEAD
                await even.send(run=run, start=start)
                await odd.send(run=run, start=start)
                await asyncio.sleep(start + (FAIR_RELEASE_AFTER - 0.5) * FAIR_SPACING - time.perf_counter())
                await until(queued(holder, FAIR_RELEASE_AFTER), "half the waiters queued")
                await holder.release(permit)
                reports = [await even.receive(), await odd.receive()]
                waiters = [waiter for report in reports for waiter in report["waiters"]]
                collections = {report["slot"]: report["collections"] for report in reports}
                stop.set()
                await probing
                if any(waiter["grant"] is None for waiter in waiters):
                    raise RuntimeError(f"run {run}: a waiter got no permit within {STEP_TIMEOUT:g} s")
                if run == 0:
                    continue
                ordered = sorted(waiters, key=lambda waiter: waiter["called"])
                displaced = sum(1 for position, waiter in enumerate(ordered, 1) if waiter["grant"] != position)
                inverted = inverted_pairs(waiters)
                runs_with_inversions += displaced > 0
                misplaced += displaced
                pairs += len(inverted)
                for first, second in inverted:
                    if behind_a_collection(first, second, collections):
                        pairs_behind_collections += 1
                    else:
                        gaps_elsewhere.append(second["called"] - first["called"])
                longest_collection = max(
                    longest_collection, *(end - start for run in collections.values() for start, end in run), 0.0
                )
                gaps.extend(second["called"] - first["called"] for first, second in inverted)
                worst_lag = max(worst_lag, *(waiter["late"] for waiter in waiters))
    finally:
        await client.aclose()
    return FairnessResult(
        kind=kind,
        runs=runs,
        waiters_per_run=FAIR_WAITERS,
        runs_with_inversions=runs_with_inversions,
        misplaced_waiters=misplaced,
        inverted_pairs=pairs,
        widest_inversion_ms=ms(max(gaps)) if gaps else None,
        worst_arrival_lag_ms=ms(worst_lag),
        pairs_behind_a_collection=pairs_behind_collections,
        widest_inversion_elsewhere_ms=ms(max(gaps_elsewhere)) if gaps_elsewhere else None,
        longest_collection_ms=ms(longest_collection),
        nowait_attempts=probe.attempts,
        nowait_successes=probe.successes,
        nowait_jumps=probe.jumps,
    )


# --- 3. crash reclaim -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CrashResult:
    kind: Kind
    case: CrashCase
    repetitions: int
    #: The lease (holder killed) or the waiter timeout (head waiter killed).
    bound_s: float
    #: From the lease's start (holder) or the release (waiter) to the next grant.
    delays_s: list[float]
    median_excess_s: float
    max_excess_s: float
    target_excess_s: float
    target_met: bool


def crash_result(kind: Kind, case: CrashCase, bound: float, delays: list[float]) -> CrashResult:
    excess = [delay - bound for delay in delays]
    return CrashResult(
        kind=kind,
        case=case,
        repetitions=len(delays),
        bound_s=bound,
        delays_s=[round(delay, 4) for delay in delays],
        median_excess_s=round(statistics.median(excess), 4),
        max_excess_s=round(max(excess), 4),
        target_excess_s=CRASH_EXCESS_TARGET,
        target_met=max(excess) <= CRASH_EXCESS_TARGET,
    )


async def measure_killed_holder(port: int, kind: Kind, repetitions: int) -> CrashResult:
    """(a) The holder's process dies holding; a waiter in this process gets the permit after the lease."""
    client = new_client(port, CONTROL_CLIENT)
    delays = []
    try:
        for repetition in range(repetitions):
            name = f"crash-holder-{kind}-{repetition}"
            async with await Peer.start(
                "crash-holder", port, script=SCRIPT, kind=kind, name=name, timeout=CRASH_LEASE
            ) as holder:
                # The lease started at the latest when the holder called acquire.
                started = (await holder.receive())["started"]
                waiter = make(kind, client, name, timeout=CRASH_LEASE)
                waiting = asyncio.create_task(waiter.acquire(blocking_timeout=CRASH_LEASE + STEP_TIMEOUT))
                await until(queued(waiter, 1), "the waiter queued")
                holder.kill()
                permit = await waiting
                got = time.perf_counter()
                if permit is None:
                    raise RuntimeError("the dead holder's permit never came")
                delays.append(got - started)
                await waiter.release(permit)
    finally:
        await client.aclose()
    return crash_result(kind, "holder killed", CRASH_LEASE, delays)


async def measure_killed_waiter(port: int, kind: Kind, repetitions: int) -> CrashResult:
    """(b) The head of the queue dies just before the permit frees; the next waiter waits a waiter timeout at most."""
    client = new_client(port, CONTROL_CLIENT)
    heartbeat = CRASH_WAITER_TIMEOUT / 3
    delays = []
    try:
        for repetition in range(repetitions):
            name = f"crash-waiter-{kind}-{repetition}"
            holder = make(kind, client, name, waiter_timeout=CRASH_WAITER_TIMEOUT)
            permit = await holder.acquire(blocking_timeout=STEP_TIMEOUT)
            if permit is None:
                raise RuntimeError("the holder could not take the free permit")
            async with await Peer.start(
                "crash-waiter", port, script=SCRIPT, kind=kind, name=name, waiter_timeout=CRASH_WAITER_TIMEOUT
            ) as head:
                await head.receive()
                await head.send(go=True)
                await until(queued(holder, 1), "the head waiter queued")
                second = make(kind, client, name, waiter_timeout=CRASH_WAITER_TIMEOUT)
                waiting = asyncio.create_task(second.acquire(blocking_timeout=STEP_TIMEOUT))
                await until(queued(holder, 2), "the second waiter queued")
                # Kill at a different point of the head's heartbeat each time.
                await asyncio.sleep(heartbeat * repetition / max(1, repetitions))
                head.kill()
                freed = time.perf_counter()
                await holder.release(permit)
                granted = await waiting
                got = time.perf_counter()
                if granted is None:
                    raise RuntimeError("the second waiter never got the permit")
                delays.append(got - freed)
                await second.release(granted)
    finally:
        await client.aclose()
    return crash_result(kind, "head waiter killed", CRASH_WAITER_TIMEOUT, delays)


# --- 4. connections and idle traffic ------------------------------------------------


@dataclass(frozen=True, slots=True)
class IdleResult:
    kind: Kind
    waiters: int
    #: From the helper's start of its waiters to all of them queued.
    queue_fill_s: float
    #: Connections open under the waiters' client name (the more of two looks).
    waiter_connections: int
    all_connections: int
    window_s: float
    #: INFO total_commands_processed, less our INFO: counts commands inside scripts too.
    commands_per_s: float
    #: Commands the waiters' process sent (MONITOR, scripts' inner commands excluded).
    client_commands_per_s: float
    scripts_per_s: float
    #: One re-check of all the process's waiters every third of a waiter timeout.
    expected_heartbeats_per_s: float
    client_commands_per_heartbeat: float
    commands_by_name: dict[str, int]


async def monitor_commands(client: redis.asyncio.Redis, seen: list[tuple[str, str]], ready: asyncio.Event) -> None:
    """Note (client address, command name) of every command MONITOR shows, except those scripts run."""
    async with client.monitor() as monitor:
        ready.set()
        while True:
            command = await monitor.next_command()
            if command["client_type"] != "lua":
                name = command["command"].split(" ", 1)[0].lower()
                seen.append((f"{command['client_address']}:{command['client_port']}", name))


async def measure_idle(port: int, kind: Kind, waiters: int, window: float) -> IdleResult:
    client = new_client(port, CONTROL_CLIENT)
    name = f"idle-{kind}"
    holder = make(kind, client, name, timeout=IDLE_LEASE)
    try:
        permit = await holder.acquire(blocking_timeout=STEP_TIMEOUT)
        if permit is None:
            raise RuntimeError("the holder could not take the free permit")
        async with await Peer.start(
            "idle-waiters",
            port,
            script=SCRIPT,
            kind=kind,
            name=name,
            count=waiters,
            timeout=IDLE_LEASE,
            client_name=WAITERS_CLIENT,
        ) as process:
            await process.receive()
            started = time.perf_counter()
            await until(queued(holder, waiters), f"{waiters} waiters queued")
            queue_fill = time.perf_counter() - started
            # Past the first heartbeat, which loads its script and may open a
            # connection: the window sees the steady state.
            await asyncio.sleep(holder.waiter_timeout / 3 + IDLE_SETTLE)
            connections = await client.client_list()
            seen: list[tuple[str, str]] = []
            ready = asyncio.Event()
            monitoring = asyncio.create_task(monitor_commands(client, seen, ready))
            try:
                await asyncio.wait_for(ready.wait(), STEP_TIMEOUT)
                before = await client.info("stats", "commandstats")
                begin = time.perf_counter()
                await asyncio.sleep(window)
                after = await client.info("stats", "commandstats")
                elapsed = time.perf_counter() - begin
                connections_after = await client.client_list()
            finally:
                monitoring.cancel()
                with anyio.move_on_after(STEP_TIMEOUT):
                    await asyncio.gather(monitoring, return_exceptions=True)
        await holder.release(permit)
    finally:
        await client.aclose()

    def calls(info: Message, command: str) -> int:
        return int(info.get(f"cmdstat_{command}", {}).get("calls", 0))

    # The first INFO counts itself only once it has run, so it shows in the second.
    total = int(after["total_commands_processed"]) - int(before["total_commands_processed"]) - 1
    scripts = sum(calls(after, command) - calls(before, command) for command in ("evalsha", "eval"))
    # Every command not from one of our own connections came from the waiters' process.
    ours = {entry["addr"] for entry in (*connections, *connections_after) if entry.get("name") == CONTROL_CLIENT}
    counts: dict[str, int] = {}
    for address, command in seen:
        if address not in ours:
            counts[command] = counts.get(command, 0) + 1
    client_commands = sum(counts.values())
    heartbeats = 3 / holder.waiter_timeout
    return IdleResult(
        kind=kind,
        waiters=waiters,
        queue_fill_s=round(queue_fill, 3),
        waiter_connections=max(
            sum(1 for connection in listed if connection.get("name") == WAITERS_CLIENT)
            for listed in (connections, connections_after)
        ),
        all_connections=max(len(connections), len(connections_after)),
        window_s=round(elapsed, 3),
        commands_per_s=round(total / elapsed, 1),
        client_commands_per_s=round(client_commands / elapsed, 1),
        scripts_per_s=round(scripts / elapsed, 1),
        expected_heartbeats_per_s=round(heartbeats, 2),
        client_commands_per_heartbeat=round(client_commands / elapsed / heartbeats, 1),
        commands_by_name=dict(sorted(counts.items(), key=lambda item: -item[1])),
    )


# --- the report ------------------------------------------------------------


def handoff_table(results: Sequence[HandoffResult]) -> str:
    header = (
        "class",
        "reps",
        "p50",
        "p90",
        "p99",
        "max",
        "EVALSHA p50",
        "idle EVALSHA p50",
        "p50/EVALSHA",
        "p99/EVALSHA",
        "PUBLISH p50",
        "PUBLISH p99",
        "p50/PUBLISH",
        "target",
        "met",
    )
    rows = [
        (
            LABELS[r.kind],
            str(r.repetitions),
            f"{r.p50_ms:.3f}",
            f"{r.p90_ms:.3f}",
            f"{r.p99_ms:.3f}",
            f"{r.max_ms:.3f}",
            f"{r.evalsha_p50_ms:.3f}",
            f"{r.idle_evalsha_p50_ms:.3f}",
            f"{r.p50_over_evalsha:.1f}x",
            f"{r.p99_over_evalsha:.1f}x",
            f"{r.publish_p50_ms:.3f}",
            f"{r.publish_p99_ms:.3f}",
            f"{r.p50_over_publish:.1f}x",
            ", ".join(f"{key} <= {value:g}" for key, value in r.targets_ms.items()),
            verdict(r.targets_met),
        )
        for r in results
    ]
    return (
        "Hand-off latency (ms): start of release() in one process -> acquire() returns in another; "
        f"EVALSHA: one round trip of a trivial script ({EVALSHA_CALLS:,} back to back; idle: each after "
        f"{HANDOFF_SETTLE * 1000:g} ms idle, as the waiter is); "
        "PUBLISH: a plain PUBLISH -> an idle listener in the other process\n\n" + markdown_table(header, rows)
    )


def fairness_table(results: Sequence[FairnessResult]) -> str:
    header = (
        "class",
        "runs x waiters",
        "runs with inversions",
        "misplaced waiters",
        "inverted pairs",
        "widest inversion ms",
        "of which behind a GC",
        "widest of the others ms",
        "worst arrival lag ms",
        "longest GC ms",
        "nowait tries",
        "nowait successes",
        "successes while queued",
    )
    rows = [
        (
            LABELS[r.kind],
            f"{r.runs} x {r.waiters_per_run}",
            str(r.runs_with_inversions),
            str(r.misplaced_waiters),
            str(r.inverted_pairs),
            "-" if r.widest_inversion_ms is None else f"{r.widest_inversion_ms:.2f}",
            str(r.pairs_behind_a_collection),
            "-" if r.widest_inversion_elsewhere_ms is None else f"{r.widest_inversion_elsewhere_ms:.2f}",
            f"{r.worst_arrival_lag_ms:.1f}",
            f"{r.longest_collection_ms:.1f}",
            str(r.nowait_attempts),
            str(r.nowait_successes),
            str(r.nowait_jumps) if r.nowait_jumps == 0 else f"**{r.nowait_jumps}**",
        )
        for r in results
    ]
    return (
        f"Fairness: {FAIR_WAITERS} waiters {FAIR_SPACING * 1000:g} ms apart from 2 processes, "
        "grant order against arrival order (must be 0 inversions but those behind a garbage collection "
        "in the earlier caller's process, 0 successes while queued)\n\n" + markdown_table(header, rows)
    )


def crash_table(results: Sequence[CrashResult]) -> str:
    header = ("class", "case", "reps", "bound s", "median delay s", "max delay s", "max excess s", "target", "met")
    rows = [
        (
            LABELS[r.kind],
            r.case,
            str(r.repetitions),
            f"{r.bound_s:g}",
            f"{statistics.median(r.delays_s):.3f}",
            f"{max(r.delays_s):.3f}",
            f"{r.max_excess_s:+.3f}",
            f"<= {r.target_excess_s:g}",
            verdict(r.target_met),
        )
        for r in results
    ]
    return (
        "Crash reclaim: holder killed -> delay from its lease start to the next grant (bound: lease); "
        "head waiter killed -> delay from the release to the next waiter's grant (bound: waiter timeout)\n\n"
        + markdown_table(header, rows)
    )


def idle_table(results: Sequence[IdleResult]) -> str:
    header = (
        "class",
        "waiters",
        "queued in s",
        "their connections",
        "all connections",
        "commands/s (all)",
        "scripts/s",
        "client commands/s",
        "heartbeats/s",
        "client commands/heartbeat",
    )
    rows = [
        (
            LABELS[r.kind],
            f"{r.waiters:,}",
            f"{r.queue_fill_s:.2f}",
            str(r.waiter_connections),
            str(r.all_connections),
            f"{r.commands_per_s:,.1f}",
            f"{r.scripts_per_s:,.1f}",
            f"{r.client_commands_per_s:,.1f}",
            f"{r.expected_heartbeats_per_s:g}",
            f"{r.client_commands_per_heartbeat:,.1f}",
        )
        for r in results
    ]
    return (
        "Idle waiters in one process (limit 1, held elsewhere): connections, and traffic over "
        f"{results[0].window_s if results else 0:g} s; commands/s (all) counts commands run inside scripts too\n\n"
        + markdown_table(header, rows)
    )


# --- running ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    handoff_repetitions: int
    fairness_runs: int
    crash_repetitions: int
    idle_waiters: int
    idle_window_s: float


FULL: Final = Plan(
    handoff_repetitions=200, fairness_runs=20, crash_repetitions=5, idle_waiters=IDLE_WAITERS, idle_window_s=3
)
QUICK: Final = Plan(
    handoff_repetitions=30, fairness_runs=3, crash_repetitions=2, idle_waiters=IDLE_WAITERS, idle_window_s=1.5
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions: a smoke run")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument("--only", choices=SCENARIOS, action="append", help="run this scenario only (again for more)")
    args = parse_or_play_role(parser, argv, ROLES, run_role)
    if args is None:
        return 0
    binary = redis_server_binary()
    plan = QUICK if args.quick else FULL
    versions: set[str] = set()
    scenarios = set(args.only or SCENARIOS)

    handoff = [
        on_fresh_server(
            binary,
            versions,
            f"hand-off, {LABELS[kind]}",
            partial(measure_handoff, kind=kind, repetitions=plan.handoff_repetitions),
        )
        for kind in (KINDS if "handoff" in scenarios else ())
    ]
    fairness = [
        on_fresh_server(
            binary, versions, f"fairness, {LABELS[kind]}", partial(measure_fairness, kind=kind, runs=plan.fairness_runs)
        )
        for kind in (KINDS if "fairness" in scenarios else ())
    ]
    crash = [
        on_fresh_server(
            binary, versions, f"{case}, {LABELS[kind]}", partial(measure, kind=kind, repetitions=plan.crash_repetitions)
        )
        for kind in (KINDS if "crash" in scenarios else ())
        for case, measure in (("killed holder", measure_killed_holder), ("killed head waiter", measure_killed_waiter))
    ]
    idle = [
        on_fresh_server(
            binary,
            versions,
            f"{plan.idle_waiters:,} idle waiters, {LABELS[kind]}",
            partial(measure_idle, kind=kind, waiters=plan.idle_waiters, window=plan.idle_window_s),
        )
        for kind in (KINDS if "idle" in scenarios else ())
    ]

    tables = (
        handoff_table(handoff) if handoff else None,
        fairness_table(fairness) if fairness else None,
        crash_table(crash) if crash else None,
        idle_table(idle) if idle else None,
    )
    for table in tables:
        if table is not None:
            print()
            print(table)

    if args.json is not None:
        report = {
            **environment(sorted(versions)),
            "quick": args.quick,
            "scenarios": sorted(scenarios),
            "plan": asdict(plan),
            "handoff": [asdict(result) for result in handoff],
            "fairness": [asdict(result) for result in fairness],
            "crash": [asdict(result) for result in crash],
            "connections": [asdict(result) for result in idle],
        }
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
