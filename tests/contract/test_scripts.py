"""Scripts are loaded once and reloaded when the server forgets them; no Lua is needed by the locked class."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from importlib.resources import files
from typing import TYPE_CHECKING, Any

import pytest
import redis
import redis.asyncio
from redis.exceptions import NoPermissionError

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, recipes
from aiosem._fair import fair_step
from aiosem._keys import SemaphoreKeys
from aiosem._protocol import QUEUED, Step
from aiosem._rules import COUNTER_TTL_MS, TOMBSTONE_SECONDS, TOMBSTONE_TTL_MS, queue_ttl_ms
from aiosem._scripts import ALL_SCRIPTS, FAIR_ACQUIRE, LUA_CONSTANTS

if TYPE_CHECKING:
    from tests.harness.support import FakeClock, RedisServer


async def test_a_flushed_script_cache_is_reloaded(
    client: redis.asyncio.Redis, client_admin: redis.asyncio.Redis
) -> None:
    sem = AsyncFairSemaphore(client, "reload", 1)
    first = await sem.acquire()
    assert first is not None
    await client_admin.script_flush()
    assert await sem.release(first)
    assert await sem.acquire() is not None


async def test_recipes_reload_a_flushed_script_cache(
    client: redis.asyncio.Redis, client_admin: redis.asyncio.Redis
) -> None:
    identifier = await recipes.acquire_fair_semaphore(client, "reload", 1)
    assert identifier is not None
    await client_admin.script_flush()
    assert await recipes.release_fair_semaphore(client, "reload", identifier)


@pytest.fixture
async def no_scripting_client(fresh_redis_server: RedisServer) -> redis.asyncio.Redis:
    admin = fresh_redis_server.admin_client()
    await admin.acl_setuser(
        "worker", enabled=True, passwords=["+secret"], keys=["*"], channels=["*"], commands=["+@all", "-@scripting"]
    )
    await admin.aclose()
    return fresh_redis_server.client(username="worker", password="secret")


async def test_the_fair_semaphore_needs_scripting(no_scripting_client: redis.asyncio.Redis) -> None:
    sem = AsyncFairSemaphore(no_scripting_client, "acl", 1)
    with pytest.raises(NoPermissionError):
        await sem.acquire()
    await no_scripting_client.aclose()


async def test_the_locked_semaphore_works_where_scripting_is_forbidden(
    no_scripting_client: redis.asyncio.Redis,
) -> None:
    sem = AsyncLockedSemaphore(no_scripting_client, "acl", 1)
    async with sem as permit:
        assert await sem.count() == 1
        assert await sem.refresh(permit)
        assert await sem.acquire(blocking=False) is None
    assert await sem.count() == 0
    await no_scripting_client.aclose()


def test_the_locked_semaphore_works_on_fakeredis_without_lupa() -> None:
    # fakeredis decides at import whether it can run Lua, so hide lupa from a
    # fresh interpreter before it imports fakeredis.
    program = textwrap.dedent(
        """
        import asyncio, sys
        sys.modules["lupa"] = None
        import fakeredis
        from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore

        async def main():
            client = fakeredis.FakeAsyncRedis()
            try:
                await AsyncFairSemaphore(client, "s", 1).acquire()
            except Exception as error:
                print("fair:", type(error).__name__)
            sem = AsyncLockedSemaphore(client, "s", 1)
            async with sem as permit:
                assert await sem.acquire(blocking=False) is None
                assert await sem.refresh(permit)
            print("locked: ok", await sem.count())

        asyncio.run(main())
        """
    )
    completed = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert "locked: ok 0" in completed.stdout
    assert "fair: " in completed.stdout


async def test_a_script_wakes_processes_only_by_publish_or_spublish_and_refuses_before_writing(
    real_client: redis.asyncio.Redis,
) -> None:
    keys = SemaphoreKeys.for_name("aiosem", "guarded")
    # A permit whose lease ran out long ago: any step would reap it first.
    await real_client.zadd(keys.timeout_set, {"expired": 1})
    await real_client.zadd(keys.owner_set, {"expired": 1})
    # now, lease, limit, waiter TTL, caller, channels, how to wake, mode, identifier
    args = ["", "10", "1", "2", "", keys.channels, "DEL", "try", "someone"]
    with pytest.raises(redis.ResponseError, match=r"ARGV\[7\] must be PUBLISH or SPUBLISH"):
        await FAIR_ACQUIRE.run(real_client, keys.fair, args)
    assert await real_client.zrange(keys.timeout_set, 0, -1) == [b"expired"]
    await real_client.delete(*keys.fair)


def test_every_script_is_given_the_rules_constants_and_no_lua_file_spells_one() -> None:
    for script in ALL_SCRIPTS:
        header = script.source.split("\n-- Shared by every aiosem script", 1)[0]
        assert [line.split(" = ")[0] for line in header.splitlines()[1:] if line] == [
            f"local {name}" for name in LUA_CONSTANTS
        ]
        assert script.sha == hashlib.sha1(script.source.encode()).hexdigest()  # noqa: S324 -- as Redis names it
    for path in (files("aiosem") / "lua").iterdir():
        text = path.read_text(encoding="utf-8")
        assert not [name for name in LUA_CONSTANTS if f"local {name} =" in text], path.name


async def test_the_scripts_follow_the_injected_rules(client: redis.asyncio.Redis, clock: FakeClock) -> None:
    keys = SemaphoreKeys.for_name("aiosem", "rules")
    options: dict[str, Any] = {"now": clock.now, "lease": 10.0, "limit": 1, "waiter_ttl": 2.0, "caller": "ab12"}
    await fair_step(client, Step.WAIT, keys, ["ab12.holder"], **options)
    assert (await fair_step(client, Step.WAIT, keys, ["ab12.waiter"], **options)).values == (QUEUED,)
    await fair_step(client, Step.CANCEL, keys, ["ab12.unseen"], **options)
    assert await client.zscore(keys.cancelled, "ab12.unseen") == clock.now + TOMBSTONE_SECONDS
    assert TOMBSTONE_TTL_MS - 1000 < await client.pttl(keys.cancelled) <= TOMBSTONE_TTL_MS
    assert COUNTER_TTL_MS - 1000 < await client.pttl(keys.counter) <= COUNTER_TTL_MS
    for key in (keys.queue, keys.waiters, keys.tickets):
        assert queue_ttl_ms(2.0) - 1000 < await client.pttl(key) <= queue_ttl_ms(2.0)
    await client.delete(*keys.fair)
