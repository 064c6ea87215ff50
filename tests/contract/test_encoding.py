"""A sorted set that a step grows to `SKIPLIST_AT` members is moved to Redis's skiplist encoding first.

In the compact (listpack) encoding, Redis places each member it adds by a
scan that parses every score on its way, so a step adding many members to a
set pays for the set's size many times over. Both backends -- the scripts
and the Lua-free step's transaction -- move a set growing to `SKIPLIST_AT`
members to the skiplist encoding before they add to it, by a member too long
for the compact one, added first and taken out last. These tests read the
encodings with ``OBJECT ENCODING``, which fakeredis lacks, so they run on a
real server only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._connection import text
from aiosem._fair import fair_step
from aiosem._keys import SemaphoreKeys
from aiosem._protocol import QUEUED, Reply, Step
from aiosem._rules import SKIPLIST_AT, SKIPLIST_MEMBER_BYTES

if TYPE_CHECKING:
    import redis.asyncio

    from tests.harness.support import FakeClock, RedisServer


class Steps:
    """One semaphore's steps, taken straight: by its class's backend, or by the fair scripts."""

    def __init__(self, client: redis.asyncio.Redis, clock: FakeClock, name: str, limit: int, *, locked: bool) -> None:
        cls = AsyncLockedSemaphore if locked else AsyncFairSemaphore
        self.semaphore = cls(client, name, limit, timeout=10, waiter_timeout=5, clock=clock)
        self.client, self.clock, self.limit, self.locked = client, clock, limit, locked
        self.keys = SemaphoreKeys.for_name("aiosem", name)

    def identifiers(self, kind: str, count: int) -> list[str]:
        return [f"{self.semaphore._process}.{kind}{i:02d}" for i in range(count)]

    async def __call__(self, step: Step, identifiers: list[str]) -> Reply:
        if self.locked:
            reply = await self.semaphore._core.backend.execute(step, identifiers, "")
            assert reply is not None, "the step lock was busy"
            return reply
        return await fair_step(
            self.client,
            step,
            self.keys,
            identifiers,
            now=self.clock.now,
            lease=10.0,
            limit=self.limit,
            waiter_ttl=5.0,
            caller=self.semaphore._process,
        )


@pytest.fixture(params=[False, True], ids=["scripts", "lua-free"])
def locked(request: pytest.FixtureRequest) -> bool:
    return request.param  # type: ignore[no-any-return]


async def encodings(admin: redis.asyncio.Redis, *keys: str) -> list[str]:
    return [text(await admin.object("encoding", key)) for key in keys]


async def members(admin: redis.asyncio.Redis, key: str) -> list[str]:
    return [text(member) for member in await admin.zrange(key, 0, -1)]


async def queue_behind_one_holder(steps: Steps, count: int) -> list[str]:
    await steps(Step.WAIT, steps.identifiers("holder", 1))
    waiters = steps.identifiers("waiter", count)
    assert (await steps(Step.WAIT, waiters)).values == (QUEUED,) * count
    return waiters


async def test_a_queue_a_step_grows_to_the_threshold_is_a_skiplist_of_exactly_its_waiters(
    real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis, clock: FakeClock, locked: bool
) -> None:
    steps = Steps(real_client, clock, "grown queue", 1, locked=locked)
    waiters = await queue_behind_one_holder(steps, SKIPLIST_AT)
    assert await encodings(admin_client, steps.keys.queue, steps.keys.waiters) == ["skiplist", "skiplist"]
    assert await members(admin_client, steps.keys.queue) == waiters
    assert sorted(await members(admin_client, steps.keys.waiters)) == waiters


async def test_a_queue_below_the_threshold_stays_compact(
    real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis, clock: FakeClock, locked: bool
) -> None:
    steps = Steps(real_client, clock, "small queue", 1, locked=locked)
    await queue_behind_one_holder(steps, SKIPLIST_AT - 1)
    assert await encodings(admin_client, steps.keys.queue, steps.keys.waiters) == ["listpack", "listpack"]


async def test_permits_one_step_hands_to_the_queue_fill_skiplists_emptied_by_its_releases(
    real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis, clock: FakeClock, locked: bool
) -> None:
    # Every holder releases in one step and as many waiters take their permits: the permit sets are
    # emptied -- deleted -- and made again by the hand-off, as a semaphore's in lockstep are each step.
    steps = Steps(real_client, clock, "handed", SKIPLIST_AT, locked=locked)
    holders, waiters = steps.identifiers("holder", SKIPLIST_AT), steps.identifiers("waiter", SKIPLIST_AT)
    assert all(token > 0 for token in (await steps(Step.WAIT, holders)).values)
    await steps(Step.WAIT, waiters)
    released = await steps(Step.RELEASE, holders)
    assert released.values == (1,) * SKIPLIST_AT
    assert [identifier for identifier, _ in released.granted] == waiters
    keys = steps.keys
    assert await encodings(admin_client, keys.timeout_set, keys.owner_set) == ["skiplist", "skiplist"]
    for key in (keys.timeout_set, keys.owner_set):
        assert sorted(await members(admin_client, key)) == waiters
    assert not await admin_client.exists(keys.queue, keys.waiters)


async def test_a_server_keeping_long_members_compact_answers_the_same(
    fresh_redis_server: RedisServer, clock: FakeClock, locked: bool
) -> None:
    # Tuned to keep members as long as the one that moves a set: the sets stay compact, and nothing else changes.
    admin = fresh_redis_server.admin_client()
    await admin.config_set("zset-max-listpack-value", SKIPLIST_MEMBER_BYTES)
    client = fresh_redis_server.client()
    try:
        steps = Steps(client, clock, "tuned", 1, locked=locked)
        waiters = await queue_behind_one_holder(steps, SKIPLIST_AT)
        assert await encodings(admin, steps.keys.queue, steps.keys.waiters) == ["listpack", "listpack"]
        assert await members(admin, steps.keys.queue) == waiters
        assert sorted(await members(admin, steps.keys.waiters)) == waiters
    finally:
        await client.aclose()
        await admin.aclose()
