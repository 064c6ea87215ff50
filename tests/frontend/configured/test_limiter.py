"""`limiter`: a limit by name for a block, and where its limit comes from."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import anyio
import fakeredis
import pytest

import aiosem
from aiosem import AcquireTimeout, AsyncFairSemaphore, Permit, limit_concurrency, limiter
from tests.harness.limiting import Gate, state, wait_until

if TYPE_CHECKING:
    import redis.asyncio


async def held(client: redis.asyncio.Redis, name: str) -> int:
    return await AsyncFairSemaphore(client, name, 1).count()


async def test_a_limiter_holds_a_permit_for_its_block(backend: redis.asyncio.Redis) -> None:
    async with limiter("api", 2) as permit:
        assert isinstance(permit, Permit)
        assert permit.name == "api"
        assert await held(backend, "api") == 1
    assert await held(backend, "api") == 0


@pytest.mark.usefixtures("backend")
async def test_a_limiter_takes_the_limit_it_is_given() -> None:
    async with limiter("api", 2):
        pass
    (entry,) = state().idle.values()
    assert entry.cached.limit == 2


@pytest.mark.usefixtures("backend")
async def test_a_limiter_takes_the_configured_limit() -> None:
    aiosem.configure(limits={"api": 4})
    async with limiter("api"):
        pass
    (entry,) = state().idle.values()
    assert entry.cached.limit == 4


@pytest.mark.usefixtures("backend")
async def test_a_limiter_takes_the_limit_a_decorator_declared() -> None:
    @limit_concurrency("api", 5)
    async def call_api() -> None: ...

    async with limiter("api"):
        pass
    (entry,) = state().idle.values()
    assert entry.cached.limit == 5


@pytest.mark.usefixtures("backend")
async def test_the_given_limit_wins_over_the_configured_one_which_wins_over_a_declared_one() -> None:
    @limit_concurrency("api", 5)
    async def call_api() -> None: ...

    aiosem.configure(limits={"api": 4})
    async with limiter("api"):
        pass
    async with limiter("api", 3):
        pass
    assert sorted(entry.cached.limit for entry in state().idle.values()) == [3, 4]


#: What a limiter given, configured and declared no limit says when Redis has none in force either.
NO_LIMIT_FOR_API = (
    r"^no limit for semaphore 'api': none was given, configured or declared, and none is in force in Redis; "
    r"pass limit=, or set one with `python -m aiosem limit api N`$"
)


@pytest.mark.usefixtures("backend")
async def test_a_limiter_with_no_limit_anywhere_says_how_to_give_one() -> None:
    # Nothing given, configured or declared: Redis is asked, on entering, and has none either.
    with pytest.raises(aiosem.LimitNotSet, match=NO_LIMIT_FOR_API) as caught:
        async with limiter("api"):
            pass  # pragma: no cover -- never entered
    assert isinstance(caught.value, LookupError)  # as a limiter with no limit anywhere always raised


@pytest.mark.usefixtures("backend")
async def test_decorators_declaring_different_limits_leave_a_limiter_without_one() -> None:
    @limit_concurrency("api", 5)
    async def first() -> None: ...

    @limit_concurrency("api", 6)
    async def second() -> None: ...

    # Ambiguous, and said so at once: Redis is not asked.
    with pytest.raises(LookupError, match=r"decorators declare it with different limits \[5, 6\]") as caught:
        async with limiter("api"):
            pass  # pragma: no cover -- never entered
    assert not isinstance(caught.value, aiosem.LimitNotSet)


@pytest.mark.usefixtures("backend")
async def test_a_per_key_decorator_declares_no_limit() -> None:
    @limit_concurrency(lambda host: host, 5)
    async def fetch(host: str) -> None: ...

    await fetch("api")
    # Its 5 was the decorator's own: a limiter of the name finds none, in this process or in Redis
    # (the decorator's permit is back, the semaphore idle, its brought limit gone).
    with pytest.raises(aiosem.LimitNotSet, match=NO_LIMIT_FOR_API):
        async with limiter("api"):
            pass  # pragma: no cover -- never entered


async def test_a_limiter_with_no_limit_takes_the_one_set_in_redis(backend: redis.asyncio.Redis) -> None:
    assert await AsyncFairSemaphore(backend, "api", None).set_limit(2) is None
    gate = Gate(expected=2)

    async def call() -> None:
        async with limiter("api"):
            await gate.pass_through()

    calls = [asyncio.create_task(call()) for _ in range(2)]
    with anyio.fail_after(5):
        await gate.arrived.wait()
    # Both inside: the set limit, 2, is reached; a third is refused.
    assert await AsyncFairSemaphore(backend, "api", None).acquire(blocking=False) is None
    gate.open.set()
    with anyio.fail_after(5):
        await asyncio.gather(*calls)
    (entry,) = state().idle.values()
    assert entry.cached.limit == 2


async def test_a_limit_set_in_redis_wins_over_the_given_one(backend: redis.asyncio.Redis) -> None:
    async with limiter("api", 1) as permit:
        assert await AsyncFairSemaphore(backend, "api", None).set_limit(3) == 1
        # Under its own 1 this limiter would wait; under the set 3 it is let in twice more.
        async with limiter("api", 1, blocking_timeout=5), limiter("api", 1, blocking_timeout=5):
            assert permit.name == "api"
    # Each limiter's semaphore reports the limit in force, not the one it was given.
    assert {entry.cached.limit for entry in state().idle.values()} == {3}


async def test_a_decorator_with_no_limit_takes_the_one_set_in_redis(backend: redis.asyncio.Redis) -> None:
    assert await AsyncFairSemaphore(backend, "api", None).set_limit(1) is None

    @limit_concurrency("api", blocking_timeout=0.1)
    async def call_api() -> int:
        return await held(backend, "api")

    assert await call_api() == 1
    async with limiter("api"):
        # The one permit the set limit allows is taken: the decorated call times out.
        with pytest.raises(AcquireTimeout):
            await call_api()


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"name": ""}, ValueError, "name must not be empty"),
        ({"name": 1}, TypeError, "name must be a str, not int"),
        ({"name": "api", "limit": 0}, ValueError, "limit must be at least 1, got 0"),
        ({"name": "api", "timeout": 0}, ValueError, "timeout must be a positive, finite number of seconds, got 0"),
        ({"name": "api", "kind": "other"}, ValueError, "kind must be 'fair' or 'locked'"),
    ],
)
def test_a_limiter_refuses_bad_arguments_at_once(
    arguments: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        limiter(**arguments)  # type: ignore[arg-type]


@pytest.mark.usefixtures("backend")
async def test_a_limiter_is_enforced_across_the_tasks_that_share_it() -> None:
    limit = 2
    gate = Gate(expected=limit)
    shared = limiter("api", limit)

    async def call() -> None:
        async with shared:
            await gate.pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            for _ in range(limit + 1):
                tasks.start_soon(call)
            await gate.arrived.wait()
            (entry,) = state().busy.values()
            await wait_until(lambda: entry.cached.statistics().waiting == 1)
            assert gate.inside == limit
            gate.open.set()
    assert gate.peak == limit
    assert gate.entered == limit + 1


@pytest.mark.usefixtures("backend")
async def test_a_limiter_raises_acquire_timeout_after_its_blocking_timeout() -> None:
    async with limiter("api", 1):
        with pytest.raises(AcquireTimeout, match="'api'"):
            async with limiter("api", 1, blocking_timeout=0):
                pass  # pragma: no cover -- never entered
    assert not state().busy


@pytest.mark.usefixtures("backend")
async def test_one_limiter_nests_in_one_task() -> None:
    shared = limiter("api", 2)
    async with shared as outer, shared as inner:
        assert outer != inner
    assert not state().busy


@pytest.mark.usefixtures("backend")
async def test_leaving_a_limiter_never_entered_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="without a matching __aenter__"):
        await limiter("api", 1).__aexit__(None, None, None)


@pytest.mark.usefixtures("backend")
async def test_a_limiter_gives_its_permit_back_when_its_block_raises(backend: redis.asyncio.Redis) -> None:
    with pytest.raises(KeyError):
        async with limiter("api", 1):
            raise KeyError
    assert await held(backend, "api") == 0
    assert not state().busy


async def test_a_limiter_uses_the_client_it_is_given_over_the_configured_one() -> None:
    configured, given = fakeredis.FakeAsyncRedis(), fakeredis.FakeAsyncRedis()
    aiosem.configure(client=configured)
    try:
        async with limiter("api", 1, client=given):
            assert await held(given, "api") == 1
            assert await held(configured, "api") == 0
        await aiosem.aclose()
    finally:
        await configured.aclose()
        await given.aclose()


def test_a_limiter_shows_its_name_and_limit() -> None:
    assert repr(limiter("api", 3)) == "limiter('api', limit=3)"
