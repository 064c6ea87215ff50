"""How fast a raised limit reaches a waiter in another process, next to a plain hand-off.

For `AsyncFairSemaphore` and `AsyncLockedSemaphore`, each on a fresh private
``redis-server``: the limit is set to 1 and this process holds the permit;
a waiter queues in another process. Then, alternately, 200 times each:

* ``raise``: this process calls ``set_limit(2)``; the time from the start
  of that call to the waiter's ``acquire()`` returning in the other
  process. The waiter gives its permit back, and the limit is set to 1
  again (which grants nothing: this process still holds).
* ``hand-off`` (the baseline, measured in the same run): this process
  releases its permit; the time from the start of ``release()`` to the
  waiter's ``acquire()`` returning. The waiter gives it back and this
  process takes it again.

Both are a step in Redis that grants the head of the queue and publishes
to the waiter's process: the raise should cost what a hand-off costs. The
figures are p50/p90/p99/max in ms, and raise over hand-off at p50 and p99.

The waiter's process runs this file again with a hidden ``--role`` flag and
talks to this one over its stdin and stdout, one JSON line per message, so
coordination sends nothing to Redis. Both ends read ``time.perf_counter``,
which on Linux is ``CLOCK_MONOTONIC``: one system-wide clock, so times
taken in different processes compare (`parse_or_play_role` warns if not).

Run it::

    python benchmarks/bench_live_limit.py                    # about 15 s
    python benchmarks/bench_live_limit.py --quick            # a smoke run
    python benchmarks/bench_live_limit.py --json benchmarks/results/live_limit.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

import anyio
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
    write_report,
)

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

Kind = Literal["fair", "locked"]
Semaphore: TypeAlias = AsyncFairSemaphore | AsyncLockedSemaphore

KINDS: Final[tuple[Kind, ...]] = ("fair", "locked")
LABELS: Final[dict[Kind, str]] = {"fair": "AsyncFairSemaphore", "locked": "AsyncLockedSemaphore"}
SCRIPT: Final = str(Path(__file__).resolve())

#: How long the waiter's process lives at most, whatever happens to this one.
ROLE_LIFETIME: Final = 300.0
#: Unmeasured repetitions first: scripts loaded, connections open, subscribed.
WARMUP: Final = 10
#: After the waiter shows up in the queue, let its process settle into waiting.
SETTLE: Final = 0.002
POLL_PAUSE: Final = 0.0005
LOW, HIGH = 1, 2


def make(kind: Kind, client: redis.asyncio.Redis, name: str) -> Semaphore:
    # Without a limit of their own: both take the one in force.
    if kind == "fair":
        return AsyncFairSemaphore(client, name, None)
    return AsyncLockedSemaphore(client, name, None)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# --- the waiter's process ---------------------------------------------------------


async def role_waiter(client: redis.asyncio.Redis, config: Message, stdin: asyncio.StreamReader) -> None:
    """On each ``go``: wait for a permit, note when it came, give it back, say when it came."""
    semaphore = make(config["kind"], client, config["name"])
    report(ready=True)
    while await next_message(stdin) is not None:
        permit = await semaphore.acquire(blocking_timeout=STEP_TIMEOUT)
        end = time.perf_counter()
        if permit is None:
            report(error=f"no permit within {STEP_TIMEOUT:g} s")
            continue
        await semaphore.release(permit)
        report(end=end)
    await semaphore.aclose()


ROLES: Final[dict[str, Callable[[redis.asyncio.Redis, Message, asyncio.StreamReader], Awaitable[None]]]] = {
    "waiter": role_waiter,
}


async def run_role(role: str, port: int, config: Message) -> None:
    client = redis.asyncio.Redis(host=HOST, port=port)
    try:
        with anyio.fail_after(ROLE_LIFETIME):
            await client.ping()
            await ROLES[role](client, config, await open_stdin())
    finally:
        await client.aclose()


# --- measuring --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    kind: Kind
    repetitions: int
    #: From the start of ``set_limit(2)`` here to the waiter's ``acquire()`` returning there.
    raise_p50_ms: float
    raise_p90_ms: float
    raise_p99_ms: float
    raise_max_ms: float
    #: The baseline: from the start of ``release()`` here to the waiter's ``acquire()`` returning there.
    handoff_p50_ms: float
    handoff_p90_ms: float
    handoff_p99_ms: float
    handoff_max_ms: float
    p50_ratio: float
    p99_ratio: float


async def until_queued(semaphore: Semaphore) -> None:
    """Poll until a waiter is queued; `TimeoutError` after `STEP_TIMEOUT`."""
    with anyio.fail_after(STEP_TIMEOUT):
        while await semaphore.waiting() < 1:  # noqa: ASYNC110 -- a bounded poll of Redis's own state
            await asyncio.sleep(POLL_PAUSE)


async def measure(port: int, kind: Kind, repetitions: int) -> Result:
    client = redis.asyncio.Redis(host=HOST, port=port)
    name = f"live-limit-{kind}"
    holder = make(kind, client, name)
    raises: list[float] = []
    handoffs: list[float] = []
    try:
        await holder.set_limit(LOW)
        permit = await holder.acquire(blocking_timeout=STEP_TIMEOUT)
        if permit is None:
            raise RuntimeError("the holder could not take the free permit")
        async with await Peer.start("waiter", port, script=SCRIPT, kind=kind, name=name) as waiter:
            await waiter.receive()
            for repetition in range(WARMUP + repetitions):
                # The raise: the waiter queued behind our permit gets the new one.
                await waiter.send(go=repetition)
                await until_queued(holder)
                await asyncio.sleep(SETTLE)
                start = time.perf_counter()
                await holder.set_limit(HIGH)
                # As the step of the raise answered: the waiter holds already.
                after = holder.statistics()
                end = (await waiter.receive())["end"]
                if (after.holders, after.waiting) != (HIGH, 0):
                    raise RuntimeError(f"the raise left {after.holders} held, {after.waiting} waiting")
                if repetition >= WARMUP:
                    raises.append(end - start)
                # We still hold: lowering again grants nothing.
                await holder.set_limit(LOW)
                # The baseline: the same waiter, the same queue, a release.
                await waiter.send(go=repetition)
                await until_queued(holder)
                await asyncio.sleep(SETTLE)
                start = time.perf_counter()
                await holder.release(permit)
                end = (await waiter.receive())["end"]
                if repetition >= WARMUP:
                    handoffs.append(end - start)
                permit = await holder.acquire(blocking_timeout=STEP_TIMEOUT)
                if permit is None:
                    raise RuntimeError("the holder could not take the permit back")
        await holder.release(permit)
    finally:
        await holder.aclose()
        await client.aclose()
    up, down = sorted(raises), sorted(handoffs)
    return Result(
        kind=kind,
        repetitions=len(raises),
        raise_p50_ms=ms(percentile(up, 0.5)),
        raise_p90_ms=ms(percentile(up, 0.9)),
        raise_p99_ms=ms(percentile(up, 0.99)),
        raise_max_ms=ms(up[-1]),
        handoff_p50_ms=ms(percentile(down, 0.5)),
        handoff_p90_ms=ms(percentile(down, 0.9)),
        handoff_p99_ms=ms(percentile(down, 0.99)),
        handoff_max_ms=ms(down[-1]),
        p50_ratio=round(percentile(up, 0.5) / percentile(down, 0.5), 2),
        p99_ratio=round(percentile(up, 0.99) / percentile(down, 0.99), 2),
    )


def table(results: Sequence[Result]) -> str:
    header = (
        "class",
        "reps",
        "raise p50",
        "p90",
        "p99",
        "max",
        "hand-off p50",
        "p90",
        "p99",
        "max",
        "p50 ratio",
        "p99 ratio",
    )
    rows = [
        (
            LABELS[r.kind],
            str(r.repetitions),
            f"{r.raise_p50_ms:.3f}",
            f"{r.raise_p90_ms:.3f}",
            f"{r.raise_p99_ms:.3f}",
            f"{r.raise_max_ms:.3f}",
            f"{r.handoff_p50_ms:.3f}",
            f"{r.handoff_p90_ms:.3f}",
            f"{r.handoff_p99_ms:.3f}",
            f"{r.handoff_max_ms:.3f}",
            f"{r.p50_ratio:.2f}x",
            f"{r.p99_ratio:.2f}x",
        )
        for r in results
    ]
    return (
        "Live limit (ms): start of set_limit(2) in one process -> a waiter's acquire() returns in another; "
        "hand-off: start of release() -> the same\n\n" + markdown_table(header, rows)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="30 repetitions: a smoke run")
    parser.add_argument("--repetitions", type=int, default=200, help="measured raises and hand-offs (default 200)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    args = parse_or_play_role(parser, argv, ROLES, run_role)
    if args is None:
        return 0
    repetitions = 30 if args.quick else args.repetitions
    binary = redis_server_binary()
    versions: set[str] = set()
    results = [
        on_fresh_server(
            binary, versions, f"live limit, {LABELS[kind]}", partial(measure, kind=kind, repetitions=repetitions)
        )
        for kind in KINDS
    ]
    print()
    print(table(results))
    if args.json is not None:
        write_report(
            args.json,
            {
                **environment(sorted(versions)),
                "quick": args.quick,
                "plan": {"repetitions": repetitions, "warmup": WARMUP, "settle_s": SETTLE},
                "results": [asdict(result) for result in results],
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
