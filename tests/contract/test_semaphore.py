"""The contract both semaphore classes keep, on a real server and on fakeredis."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import pytest
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from aiosem import AcquireTimeout, AsyncFairSemaphore, AsyncLockedSemaphore, Permit, PermitLost
from aiosem._protocol import Step
from aiosem._rules import COUNTER_TTL_MS

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.harness.support import FakeClock

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore


@pytest.fixture
def make(cls: SemaphoreClass, client: redis.asyncio.Redis) -> Callable[..., Semaphore]:
    def make(name: str = "sem", limit: int = 2, **options: object) -> Semaphore:
        return cls(client, name, limit, **options)  # type: ignore[arg-type]

    return make


async def test_grants_up_to_the_limit_then_refuses(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=2)
    assert await sem.acquire(blocking=False) is not None
    assert await sem.acquire(blocking=False) is not None
    assert await sem.acquire(blocking=False) is None
    assert await sem.count() == 2


async def test_a_permit_names_its_semaphore(make: Callable[..., Semaphore]) -> None:
    sem = make(name="db")
    permit = await sem.acquire()
    assert isinstance(permit, Permit)
    assert permit.name == "db"
    assert permit.key == sem.key == "aiosem:{db}"
    process, _, own = permit.identifier.partition(".")
    assert len(process) == len(own) == 16  # the semaphore object's token, then the permit's


async def test_fencing_tokens_strictly_increase(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    tokens = []
    for _ in range(5):
        permit = await sem.acquire()
        assert permit is not None
        tokens.append(permit.fencing_token)
        assert await sem.release(permit)
    assert tokens == sorted(set(tokens))
    assert tokens[0] >= 1


async def test_an_idle_semaphore_leaves_only_keys_that_expire(
    make: Callable[..., Semaphore], client_admin: redis.asyncio.Redis
) -> None:
    sem = make(limit=1)
    first = await sem.acquire()
    assert first is not None
    await sem.release(first)
    # The fencing counter lasts a day after the last grant; the rest far less.
    assert COUNTER_TTL_MS - 400_000 < await client_admin.pttl("aiosem:{sem}:counter") <= COUNTER_TTL_MS
    for key in await client_admin.keys("*"):
        assert await client_admin.pttl(key) > 0, key


async def test_a_fencing_token_is_at_least_the_servers_clock_in_microseconds(
    make: Callable[..., Semaphore], client: redis.asyncio.Redis
) -> None:
    before = await client.time()
    permit = await make(limit=1).acquire()
    after = await client.time()
    assert permit is not None
    assert before[0] * 1_000_000 + before[1] <= permit.fencing_token <= after[0] * 1_000_000 + after[1]


async def test_fencing_tokens_keep_increasing_after_the_counter_expired(
    make: Callable[..., Semaphore], client: redis.asyncio.Redis
) -> None:
    sem = make(limit=1)
    first = await sem.acquire()
    assert first is not None
    await sem.release(first)
    await client.delete("aiosem:{sem}:counter")  # as its TTL would, or a Redis that lost its data
    second = await sem.acquire()
    assert second is not None
    assert second.fencing_token > first.fencing_token


async def test_fencing_tokens_increase_past_a_counter_ahead_of_the_clock(
    make: Callable[..., Semaphore], client: redis.asyncio.Redis
) -> None:
    ahead = 2**52  # far beyond the clock in microseconds, as a book client's INCRs could leave it
    await client.set("aiosem:{sem}:counter", ahead)
    permit = await make(limit=1).acquire()
    assert permit is not None
    assert permit.fencing_token == ahead + 1


async def test_release_frees_the_permit_once(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    permit = await sem.acquire()
    assert permit is not None
    assert await sem.release(permit) is True
    assert await sem.release(permit) is False
    assert await sem.count() == 0
    assert await sem.acquire(blocking=False) is not None


async def test_a_release_tried_again_under_its_call_id_answers_what_the_first_try_released(
    make: Callable[..., Semaphore],
) -> None:
    # As when the first try's reply was lost with its connection and redis-py, or aiosem, sent it again.
    sem = make(limit=2)
    held = await sem.acquire()
    assert held is not None
    never_held = f"{sem._process}.{'0' * 16}"
    first = await sem._core.backend.execute(Step.RELEASE, [held.identifier, never_held], "c0ffee")
    again = await sem._core.backend.execute(Step.RELEASE, [held.identifier, never_held], "c0ffee")
    assert first is not None
    assert again is not None
    assert first.values == again.values == (1, 0)
    assert await sem.count() == 0


async def test_another_release_call_of_a_released_permit_answers_false(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    held = await sem.acquire()
    assert held is not None
    assert await sem._core.backend.execute(Step.RELEASE, [held.identifier], "c0ffee") is not None
    other = await sem._core.backend.execute(Step.RELEASE, [held.identifier], "decaf")
    assert other is not None
    assert other.values == (0,)


async def test_one_release_step_naming_a_permit_twice_releases_it_once(make: Callable[..., Semaphore]) -> None:
    # Two releases of one permit, made at once, go in one step.
    sem = make(limit=3)
    twice, once = await sem.acquire(), await sem.acquire()
    assert twice is not None
    assert once is not None
    never_held = f"{sem._process}.{'0' * 16}"
    identifiers = [twice.identifier, once.identifier, twice.identifier, never_held]
    reply = await sem._core.backend.execute(Step.RELEASE, identifiers, "")
    assert reply is not None
    assert reply.values == (1, 1, 0, 0)
    assert reply.holders == 0
    assert await sem.count() == 0


async def test_one_release_step_frees_the_whole_weight_of_each_permit(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=6)
    permits = [await sem.acquire(weight=weight) for weight in (3, 1, 2)]
    assert await sem.count() == 6
    reply = await sem._core.backend.execute(Step.RELEASE, [p.identifier for p in permits if p is not None], "")
    assert reply is not None
    assert reply.values == (1, 1, 1)
    assert reply.holders == 0
    assert await sem.acquire(blocking=False, weight=6) is not None


async def test_a_release_receipt_lasts_as_long_as_the_call_may_be_tried_again(
    make: Callable[..., Semaphore], client_admin: redis.asyncio.Redis
) -> None:
    sem = make(limit=1, timeout=7)
    held = await sem.acquire()
    assert held is not None
    assert await sem._core.backend.execute(Step.RELEASE, [held.identifier], "c0ffee") is not None
    assert 6_000 < await client_admin.pttl(f"{sem.key}:receipt:c0ffee") <= 7_000  # the step bound: the lease
    assert await sem._core.backend.execute(Step.RELEASE, [held.identifier], "decaf") is not None
    assert not await client_admin.exists(f"{sem.key}:receipt:decaf")  # it released nothing


async def test_refresh_keeps_a_permit_past_its_first_lease(make: Callable[..., Semaphore], clock: FakeClock) -> None:
    sem = make(limit=1, timeout=10, clock=clock)
    permit = await sem.acquire()
    assert permit is not None
    clock.advance(9)
    assert await sem.refresh(permit) is True
    clock.advance(9)
    assert await sem.count() == 1
    assert await sem.acquire(blocking=False) is None


async def test_an_expired_permit_is_reclaimed(make: Callable[..., Semaphore], clock: FakeClock) -> None:
    sem = make(limit=1, timeout=10, clock=clock)
    permit = await sem.acquire()
    assert permit is not None
    clock.advance(10)
    assert await sem.count() == 0
    other = await sem.acquire(blocking=False)
    assert other is not None
    assert other.fencing_token > permit.fencing_token


async def test_a_permit_lasts_its_own_lease_whoever_steps_with_a_shorter_one(
    make: Callable[..., Semaphore], clock: FakeClock
) -> None:
    long, short = make(limit=1, timeout=30, clock=clock), make(limit=1, timeout=10, clock=clock)
    permit = await long.acquire()
    assert permit is not None
    clock.advance(20)
    assert await short.acquire(blocking=False) is None
    assert await short.count() == 1
    clock.advance(10)
    taken = await short.acquire(blocking=False)
    assert taken is not None
    assert taken.fencing_token > permit.fencing_token


async def test_a_permit_with_a_shorter_lease_is_reaped_once_the_stepping_ones_runs_out(
    make: Callable[..., Semaphore], clock: FakeClock
) -> None:
    short, long = make(limit=1, timeout=5, clock=clock), make(limit=1, timeout=10, clock=clock)
    assert await short.acquire() is not None
    clock.advance(7)
    # Its own lease ran out, but a step reaps with the longer of the two: a holder is never cut short.
    assert await long.acquire(blocking=False) is None
    clock.advance(3)
    assert await long.acquire(blocking=False) is not None


async def test_a_waiter_wakes_when_a_longer_lease_of_its_holder_runs_out(
    make: Callable[..., Semaphore], clock: FakeClock
) -> None:
    long, short = make(limit=1, timeout=30, clock=clock), make(limit=1, timeout=10, clock=clock)
    assert await long.acquire() is not None
    clock.advance(20)
    # The next expiry a step answers is the holder's own, not the caller's lease (long past): no busy recheck.
    assert await short.count() == 1
    assert short._core.last.next_expiry == pytest.approx(10, abs=1e-6)


async def test_refresh_never_revives_an_expired_permit(
    make: Callable[..., Semaphore], clock: FakeClock, client: redis.asyncio.Redis
) -> None:
    sem = make(limit=1, timeout=10, clock=clock)
    permit = await sem.acquire()
    assert permit is not None
    clock.advance(10.5)
    assert await sem.refresh(permit) is False
    assert await client.zscore(sem.key, permit.identifier) is None
    assert await client.zscore(f"{sem.key}:owner", permit.identifier) is None
    assert await sem.release(permit) is False


async def test_time_comes_from_the_server_not_the_client(
    cls: SemaphoreClass, real_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fakeredis runs in this process and reads this clock: real servers only.
    sem = cls(real_client, "sem", 1, timeout=10)
    permit = await sem.acquire()
    assert permit is not None
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    assert await sem.refresh(permit) is True
    assert await sem.acquire(blocking=False) is None


async def test_blocking_timeout_returns_none_in_time(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    assert await sem.acquire() is not None
    started = anyio.current_time()
    assert await sem.acquire(blocking_timeout=0.2) is None
    elapsed = anyio.current_time() - started
    assert 0.2 <= elapsed < 2.0


async def test_a_waiter_gets_the_permit_once_it_is_released(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    holder = await sem.acquire()
    assert holder is not None
    got: list[Permit | None] = []

    async def wait() -> None:
        got.append(await sem.acquire(blocking_timeout=10))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await anyio.sleep(0.05)
        assert got == []
        await sem.release(holder)
    assert got[0] is not None
    assert got[0].fencing_token > holder.fencing_token


async def test_async_with_yields_a_permit_and_releases_it(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    async with sem as permit:
        assert isinstance(permit, Permit)
        assert await sem.count() == 1
    assert await sem.count() == 0


async def test_async_with_raises_acquire_timeout(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1, blocking_timeout=0.05)
    assert await sem.acquire() is not None
    with pytest.raises(AcquireTimeout, match=r"no permit of semaphore 'sem' within 0\.05 s") as caught:
        async with sem:
            pytest.fail("the body must not run")
    assert caught.value.name == "sem"
    assert isinstance(caught.value, TimeoutError)


async def test_one_object_shared_by_many_tasks_gives_each_its_own_permit(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=3)
    seen: list[str] = []
    inside = 0
    peak = 0

    async def work() -> None:
        nonlocal inside, peak
        async with sem as permit:
            inside += 1
            peak = max(peak, inside)
            seen.append(permit.identifier)
            await anyio.sleep(0.01)
            inside -= 1

    async with anyio.create_task_group() as tasks:
        for _ in range(9):
            tasks.start_soon(work)
    assert len(set(seen)) == 9
    assert peak <= 3
    assert await sem.count() == 0


async def test_nested_async_with_in_one_task_releases_innermost_first(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=2)
    async with sem as outer:
        async with sem as inner:
            assert inner.identifier != outer.identifier
            assert await sem.count() == 2
        assert await sem.count() == 1
        assert await sem.refresh(outer)
    assert await sem.count() == 0


async def test_async_with_raises_permit_lost_when_the_lease_ran_out(
    make: Callable[..., Semaphore], clock: FakeClock
) -> None:
    sem = make(limit=1, timeout=10, clock=clock)
    with pytest.raises(PermitLost, match="lease ran out") as caught:
        async with sem as permit:
            clock.advance(11)
    assert caught.value.identifier == permit.identifier
    assert caught.value.name == "sem"


async def test_a_lost_permit_is_raised_with_the_failing_body_as_its_context(
    make: Callable[..., Semaphore], clock: FakeClock
) -> None:
    sem = make(limit=1, timeout=10, clock=clock)
    with pytest.raises(PermitLost) as caught:  # noqa: PT012 -- the permit is lost inside the body
        async with sem:
            clock.advance(11)
            raise KeyError("body")
    assert isinstance(caught.value.__context__, KeyError)


async def test_a_cancelled_body_still_releases(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    entered = anyio.Event()

    async def hold_forever() -> None:
        async with sem:
            entered.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(hold_forever)
        await entered.wait()
        assert await sem.count() == 1
        tasks.cancel_scope.cancel()
    assert await sem.count() == 0


async def test_a_cancelled_waiter_leaves_no_permit(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=1)
    holder = await sem.acquire()
    assert holder is not None
    with anyio.move_on_after(0.1):
        await sem.acquire()
    await sem.release(holder)
    assert await sem.count() == 0


async def test_fair_and_locked_semaphores_of_one_name_share_permits(client: redis.asyncio.Redis) -> None:
    fair = AsyncFairSemaphore(client, "shared", 2)
    locked = AsyncLockedSemaphore(client, "shared", 2)
    a = await fair.acquire(blocking=False)
    b = await locked.acquire(blocking=False)
    assert a is not None
    assert b is not None
    assert await fair.acquire(blocking=False) is None
    assert await locked.acquire(blocking=False) is None
    assert b.fencing_token > a.fencing_token
    assert await locked.release(a)
    assert await fair.release(b)


async def test_repr_shows_the_configuration(make: Callable[..., Semaphore]) -> None:
    sem = make(name="api", limit=5, timeout=30, blocking_timeout=2)
    assert repr(sem) == (
        f"{type(sem).__name__}(name='api', limit=5, timeout=30, blocking_timeout=2.0, "
        "waiter_timeout=2, refresh_interval=10, held=0, waiting=0, key='aiosem:{api}')"
    )


async def test_an_unreachable_server_raises_promptly(cls: SemaphoreClass, redis_binary: str) -> None:
    import socket  # noqa: PLC0415

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = redis.asyncio.Redis(port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    sem = cls(client, "sem", 1)
    with anyio.fail_after(2), pytest.raises(redis.ConnectionError):
        await sem.acquire()
    await client.aclose()
