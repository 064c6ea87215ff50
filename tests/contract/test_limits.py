"""A semaphore is used with one limit at a time: another limit is reported, never mixed in."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, LimitMismatch, recipes

if TYPE_CHECKING:
    import redis.asyncio

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]


async def test_another_limit_is_refused_while_somebody_holds(cls: SemaphoreClass, client: redis.asyncio.Redis) -> None:
    three = cls(client, "db", 3)
    five = cls(client, "db", 5)
    held = await three.acquire()
    assert held is not None
    message = r"semaphore 'db' is in use with limit 3; this client asked for 5"
    with pytest.raises(LimitMismatch, match=message) as caught:
        await five.acquire()
    assert (caught.value.name, caught.value.limit, caught.value.stored_limit) == ("db", 5, 3)
    assert await three.count() == 1
    assert await three.waiting() == 0
    assert await three.release(held)


async def test_hundreds_of_callers_of_another_limit_all_hear_limit_mismatch_on_a_default_client(
    cls: SemaphoreClass, default_client: redis.asyncio.Redis
) -> None:
    # Each used to read the stored limit with a command of its own, all at
    # once: past the 100 connections of redis-py 8's default pool, they
    # raised "Too many connections" instead.
    three = cls(default_client, "db", 3)
    held = await three.acquire()
    assert held is not None
    five = cls(default_client, "db", 5)
    outcomes = await asyncio.gather(*(five.acquire() for _ in range(300)), return_exceptions=True)
    assert all(isinstance(outcome, LimitMismatch) and outcome.stored_limit == 3 for outcome in outcomes)
    assert await three.release(held)


async def test_another_limit_is_refused_while_somebody_waits(cls: SemaphoreClass, client: redis.asyncio.Redis) -> None:
    one = cls(client, "db", 1)
    held = await one.acquire()
    assert held is not None
    assert await one.acquire(blocking_timeout=0.05) is None
    two = cls(client, "db", 2)
    with pytest.raises(LimitMismatch):
        async with two:
            pass
    assert await one.release(held)


async def test_another_limit_takes_over_once_the_semaphore_is_idle(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    three = cls(client, "db", 3)
    async with three:
        pass
    five = cls(client, "db", 5)
    permits = [await five.acquire(blocking=False) for _ in range(5)]
    assert all(permits)
    assert await client.get(f"{five.key}:limit") == b"5"
    with pytest.raises(LimitMismatch):
        await three.acquire(blocking=False)
    for permit in permits:
        assert permit is not None
        assert await five.release(permit)


async def test_an_idle_semaphore_keeps_no_limit(cls: SemaphoreClass, client: redis.asyncio.Redis) -> None:
    sem = cls(client, "db", 3)
    permit = await sem.acquire()
    assert permit is not None
    assert await client.get(f"{sem.key}:limit") == b"3"
    assert await sem.release(permit)
    assert await client.exists(f"{sem.key}:limit") == 0


async def test_the_book_recipe_reports_another_limit_too(client: redis.asyncio.Redis) -> None:
    sem = AsyncFairSemaphore(client, "db", 3, prefix="app")
    held = await sem.acquire()
    assert held is not None
    with pytest.raises(LimitMismatch):
        await recipes.acquire_fair_semaphore(client, sem.key, 5)
    assert await recipes.acquire_fair_semaphore(client, sem.key, 3) is not None
