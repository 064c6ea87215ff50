"""Sentinel: a semaphore keeps working through a failover, and ``replicas=1`` forgets no permit.

A master, its replica and three sentinels of each test's own
(`tests.harness.topology.SentinelGroup`); clients are made from the group's
``redis+sentinel://`` URL, as an application would make them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, Literal

import anyio
import pytest
import redis

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, PermitLost, SemaphoreError
from aiosem._urls import close, connect
from tests.harness.failover import count_forgotten, fail_over

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from tests.harness.topology import SentinelGroup

pytestmark = pytest.mark.slow

Semaphore = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]


async def wait_until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll an async predicate until it holds (callers bound the wait); errors count as "not yet"."""
    while True:
        with contextlib.suppress(redis.RedisError):
            if await check():
                return
        await asyncio.sleep(0.02)


async def equals(step: Callable[[], Awaitable[int]], expected: int) -> bool:
    return await step() == expected


class Users:
    """Holders and waiters of one semaphore, and how many held at once."""

    def __init__(self, semaphore: AsyncFairSemaphore | AsyncLockedSemaphore) -> None:
        self.semaphore = semaphore
        self.release = asyncio.Event()
        self.outcomes: list[str] = []
        self.in_use = self.peak = 0

    def _enter(self) -> None:
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)

    async def hold(self) -> None:
        """Hold a permit, kept alive, until `release` is set; note whether it was kept or lost."""
        try:
            async with self.semaphore:
                self._enter()
                try:
                    await self.release.wait()
                finally:
                    self.in_use -= 1
        except PermitLost:
            self.outcomes.append("lost")
        else:
            self.outcomes.append("held")

    async def wait_and_use(self) -> None:
        """Wait for a permit (again, if the failover interrupted the wait), use it briefly, give it back."""
        while True:
            with contextlib.suppress(redis.RedisError, SemaphoreError):
                permit = await self.semaphore.acquire(blocking_timeout=60)
                assert permit is not None
                break
            await asyncio.sleep(0.05)
        self._enter()
        await asyncio.sleep(0.01)
        self.in_use -= 1
        with contextlib.suppress(redis.RedisError):
            await self.semaphore.release(permit)


async def test_a_client_made_by_sentinel_itself_serves_a_semaphore_across_a_failover(
    sentinel_group: SentinelGroup, cls: Semaphore
) -> None:
    client = sentinel_group.client()  # Sentinel(...).master_for(...), as an application may make it
    semaphore = cls(client, "made-by-sentinel", 1)
    try:
        async with semaphore as permit:
            assert await semaphore.count() == 1
        await fail_over(sentinel_group, "failover")
        with anyio.fail_after(20):
            while True:
                with contextlib.suppress(redis.ConnectionError):
                    again = await semaphore.acquire(blocking=False)
                    break
                await asyncio.sleep(0.05)
        assert again is not None
        assert again.fencing_token > permit.fencing_token  # the counter came through the failover
        assert await semaphore.release(again)
    finally:
        await semaphore.aclose()
        await client.aclose()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["failover", "kill"])
async def test_holders_and_waiters_come_through_a_failover(
    sentinel_group: SentinelGroup, cls: Semaphore, how: Literal["failover", "kill"]
) -> None:
    client = connect(sentinel_group.url)
    semaphore = cls(client, f"through-{how}", 2, timeout=6, waiter_timeout=1.5)
    users = Users(semaphore)
    try:
        holders = [asyncio.create_task(users.hold()) for _ in range(2)]
        with anyio.fail_after(20):
            await wait_until(functools.partial(equals, semaphore.count, 2))
        waiters = [asyncio.create_task(users.wait_and_use()) for _ in range(3)]
        with anyio.fail_after(20):
            await wait_until(functools.partial(equals, semaphore.waiting, 3))
        await fail_over(sentinel_group, how)
        # A whole lease after the failover: the holders' permits were kept
        # alive on the new master, or their holders were told they lost them.
        await asyncio.sleep(semaphore.timeout)
        users.release.set()
        with anyio.fail_after(30):
            await asyncio.gather(*holders)
        assert sorted(users.outcomes) in (["held", "held"], ["held", "lost"], ["lost", "lost"])
        with anyio.fail_after(90):
            await asyncio.gather(*waiters)
        assert users.peak <= 2
    finally:
        await semaphore.aclose()
        await close(client)


@pytest.mark.failover
@pytest.mark.timeout(600)
async def test_with_replicas_1_no_permit_granted_before_a_failover_is_forgotten(sentinel_group: SentinelGroup) -> None:
    result = await count_forgotten(sentinel_group, AsyncFairSemaphore, replicas=1, rounds=10)
    # The figures for the record (`pytest -s`); without the option, and by
    # SIGKILL: `benchmarks/bench_failover.py`.
    print(f"replicas=1, 10 failovers: {result}")  # noqa: T201
    assert result.granted >= 10 * 40
    assert result.forgotten == 0
