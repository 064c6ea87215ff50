"""Counting the permits a failover forgets: shared by the Sentinel tests and ``benchmarks/bench_failover.py``.

One round: a task takes permits one after another from a fresh semaphore
(limit a million, lease five minutes, so none is refused or expires), never
giving one back; the master fails over while it does; afterwards, every
permit the task was told it got is looked up on the new master. A permit
missing there was forgotten by the failover.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import anyio
import redis

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, NotReplicated, SemaphoreError
from aiosem._urls import close, connect

if TYPE_CHECKING:
    from aiosem import Permit
    from tests.harness.topology import SentinelGroup

How = Literal["failover", "kill"]
Semaphore = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]

#: Permits taken before, and again after, each failover.
_SAMPLE = 20
#: The bound on each wait of a round.
_ROUND_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class Forgotten:
    """What some rounds of failovers did to the permits granted around them."""

    rounds: int
    granted: int
    forgotten: int
    #: Acquires refused with `NotReplicated` (``replicas`` > 0 only).
    not_replicated: int
    #: Wall-clock seconds of the rounds, failovers included.
    seconds: float
    #: The longest time without a grant in each round: how long the
    #: failover kept the semaphore from granting, as its users saw it.
    outages: tuple[float, ...]


async def fail_over(group: SentinelGroup, how: How) -> None:
    """``SENTINEL FAILOVER``, or SIGKILL of the master; returns once the group is whole again."""
    await anyio.to_thread.run_sync(group.failover if how == "failover" else group.kill_master)


async def count_forgotten(
    group: SentinelGroup, cls: Semaphore, *, replicas: int, rounds: int, how: How = "failover"
) -> Forgotten:
    """Fail ``group``'s master over ``rounds`` times while permits are granted; count those the new master lacks."""
    client = connect(group.url)
    granted_total = forgotten = refused = 0
    outages: list[float] = []
    started = time.perf_counter()
    try:
        for _ in range(rounds):
            semaphore = cls(client, f"forgetful-{secrets.token_hex(4)}", 1_000_000, timeout=300, replicas=replicas)
            granted: list[Permit] = []
            times: list[float] = []
            stop = asyncio.Event()
            counts = {"not_replicated": 0}
            granting = asyncio.create_task(_grant_until_stopped(semaphore, granted, times, stop, counts))
            with anyio.fail_after(_ROUND_TIMEOUT):
                await _wait_for_grants(granted, _SAMPLE)
            await fail_over(group, how)
            with anyio.fail_after(_ROUND_TIMEOUT):
                await _wait_for_grants(granted, len(granted) + _SAMPLE)
            stop.set()
            with anyio.fail_after(_ROUND_TIMEOUT):
                await granting
            held = await semaphore.holders()
            forgotten += sum(permit.identifier not in held for permit in granted)
            granted_total += len(granted)
            refused += counts["not_replicated"]
            outages.append(max(later - earlier for earlier, later in itertools.pairwise(times)))
            await semaphore.aclose()
    finally:
        await close(client)
    return Forgotten(rounds, granted_total, forgotten, refused, time.perf_counter() - started, tuple(outages))


async def _grant_until_stopped(
    semaphore: AsyncFairSemaphore | AsyncLockedSemaphore,
    granted: list[Permit],
    times: list[float],
    stop: asyncio.Event,
    counts: dict[str, int],
) -> None:
    """Take permits one after another, never giving one back; failures during the failover are expected.

    Stopped by an event, not cancelled: redis-py 8 on Python 3.11 can swallow
    a cancellation that lands as a command completes (``asyncio.wait_for``),
    and a loop whose cancellation was swallowed would never end.
    """
    while not stop.is_set():
        try:
            permit = await semaphore.acquire(blocking=False)
        except NotReplicated:
            counts["not_replicated"] += 1
            continue
        except (redis.RedisError, SemaphoreError):
            await asyncio.sleep(0.01)
            continue
        if permit is not None:
            granted.append(permit)
            times.append(time.perf_counter())


async def _wait_for_grants(granted: list[Permit], count: int) -> None:
    while len(granted) < count:  # noqa: ASYNC110 -- the granting task appends; callers bound the wait
        await asyncio.sleep(0.01)
