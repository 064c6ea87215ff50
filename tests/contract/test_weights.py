"""Weighted permits: a permit of weight k counts k against the limit, and waiters are served in queue order.

Both classes, on a real server and (where the `client` fixture gives it)
on fakeredis. Each test starts from a fresh client and fresh semaphore
objects, so that the weighted call under test is the object's first.
What the server holds is read from Redis itself: `count` (the weight held),
`waiting`, and the ``:owner``, ``:queue`` and ``:weight`` keys.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import textwrap
from typing import TYPE_CHECKING, Any, Literal

import anyio
import pytest
import redis.asyncio

import aiosem
from aiosem import (
    AsyncFairSemaphore,
    AsyncLockedSemaphore,
    LimiterEvent,
    Permit,
    PermitLost,
    current_permit,
    limit_concurrency,
    limiter,
)
from aiosem._urls import close, connect
from aiosem._waiting import WaitQueue
from tests.contract.test_cancellation import (
    CANCEL_AFTER,
    SWEEP_LEASE,
    assert_cancelled,
    assert_nothing_left,
    cancelled_after,
)
from tests.frontend.configured.test_bad_input import redis_unchanged
from tests.harness.limiting import close_and_settle
from tests.harness.support import until_queued

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from aiosem._protocol import Reply
    from tests.frontend.test_observing import Telemetry
    from tests.harness.support import FakeClock, RedisServer

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: The most any one wait of these tests may take before the test fails.
WAIT = 10.0


@pytest.fixture
def make(cls: SemaphoreClass, client: redis.asyncio.Redis) -> Callable[..., Semaphore]:
    """A new object of the semaphore, as another process would have one: ``make(limit=4, timeout=...)``."""

    def make(name: str = "db", limit: int = 4, **options: Any) -> Semaphore:
        return cls(client, name, limit, **options)

    return make


def kind_of(cls: SemaphoreClass) -> Literal["fair", "locked"]:
    """The ``kind=`` of `limiter` and `limit_concurrency` that makes ``cls``."""
    return "fair" if cls is AsyncFairSemaphore else "locked"


async def granted(task: asyncio.Task[Permit | None]) -> Permit:
    """The permit ``task`` was granted (bounded to `WAIT`)."""
    with anyio.fail_after(WAIT):
        permit = await task
    assert permit is not None
    return permit


async def extra_weight(admin: redis.asyncio.Redis, sem: Semaphore) -> int:
    """What ``:weight`` holds: how much more than 1 each permit held weighs, together (0: no key)."""
    return int(await admin.get(f"{sem.key}:weight") or 0)


# --- a permit of weight k takes k ----------------------------------------------------------


async def test_a_permit_of_weight_three_leaves_room_for_exactly_two_of_one(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=5)
    heavy = await sem.acquire(weight=3, blocking=False)
    assert heavy is not None
    assert heavy.weight == 3
    assert await sem.count() == 3
    light = [await sem.acquire(blocking=False) for _ in range(2)]
    assert all(permit is not None and permit.weight == 1 for permit in light)
    assert await sem.acquire(blocking=False) is None
    assert await sem.count() == 5  # the weights held, not the 3 permits


async def test_a_try_of_a_weight_that_does_not_fit_is_refused_and_a_lighter_one_granted(
    make: Callable[..., Semaphore],
) -> None:
    sem = make(limit=5)
    assert await sem.acquire(weight=3, blocking=False) is not None
    assert await sem.acquire(weight=3, blocking=False) is None  # 2 are free
    assert await sem.waiting() == 0  # a try never queues
    assert await sem.acquire(weight=2, blocking=False) is not None
    assert await sem.count() == 5


async def test_a_permit_as_heavy_as_the_limit_holds_all_of_it(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=4)
    whole = await sem.acquire(weight=4, blocking=False)
    assert whole is not None
    assert await sem.acquire(blocking=False) is None
    assert await sem.release(whole)
    assert await sem.count() == 0
    assert await sem.acquire(weight=4, blocking=False) is not None


async def test_the_weight_is_part_of_the_identifier_and_what_it_adds_is_kept_in_one_key(
    make: Callable[..., Semaphore], client_admin: redis.asyncio.Redis
) -> None:
    sem = make(limit=5)
    heavy = await sem.acquire(weight=3)
    light = await sem.acquire()
    assert heavy is not None
    assert light is not None
    assert heavy.identifier.endswith("*3")
    assert "*" not in light.identifier
    assert await extra_weight(client_admin, sem) == 2  # 3 - 1; a permit of 1 adds nothing
    assert await sem.release(heavy)
    assert await client_admin.exists(f"{sem.key}:weight") == 0  # at 0, the key goes
    assert await sem.count() == 1
    assert await sem.release(light)
    assert await client_admin.exists(f"{sem.key}:weight") == 0


async def test_a_released_weight_is_free_again_whole(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=4)
    heavy = await sem.acquire(weight=3)
    assert heavy is not None
    assert await sem.release(heavy) is True
    assert await sem.release(heavy) is False  # released once: it frees 3, not 6
    assert await sem.count() == 0
    assert await sem.acquire(weight=4, blocking=False) is not None


# --- head-of-line blocking ------------------------------------------------------------------


async def test_a_head_that_does_not_fit_holds_back_a_lighter_waiter_until_it_is_served(
    make: Callable[..., Semaphore],
) -> None:
    holder, waiters = make(limit=4), make(limit=4)
    three = await holder.acquire(weight=3)
    assert three is not None
    two = asyncio.create_task(waiters.acquire(weight=2))
    await until_queued(waiters, 1)
    one = asyncio.create_task(waiters.acquire(weight=1))
    await until_queued(waiters, 2)

    # A step hands what is free to the queue: 1 is free, and the head needs 2.
    assert await holder.count() == 3
    assert await holder.waiting() == 2
    assert await holder.acquire(blocking=False) is None  # a try never jumps the queue either
    assert not two.done()
    assert not one.done()

    assert await holder.release(three)
    first, second = await granted(two), await granted(one)
    assert (first.weight, second.weight) == (2, 1)
    assert three.fencing_token < first.fencing_token < second.fencing_token  # granted in queue order
    assert await holder.count() == 3
    assert await holder.waiting() == 0


async def test_waiters_behind_a_heavy_head_are_served_as_far_as_the_free_weight_goes(
    make: Callable[..., Semaphore],
) -> None:
    holder, waiters = make(limit=4), make(limit=4)
    whole = await holder.acquire(weight=4)
    assert whole is not None
    queued = []
    for weight in (1, 2, 3):  # 1 and 2 fit in 4; the 3 must wait for both
        queued.append(asyncio.create_task(waiters.acquire(weight=weight)))
        await until_queued(waiters, len(queued))

    assert await holder.release(whole)
    one, two = await granted(queued[0]), await granted(queued[1])
    assert await holder.count() == 3
    assert await holder.waiting() == 1
    assert not queued[2].done()

    assert await waiters.release(one)  # 2 free: still not 3
    assert await holder.count() == 2
    assert await holder.waiting() == 1
    assert await waiters.release(two)
    last = await granted(queued[2])
    assert one.fencing_token < two.fencing_token < last.fencing_token


# --- a weight above the limit --------------------------------------------------------------


def too_heavy(name: str, limit: int, weight: int) -> str:
    """The message of the `ValueError` an acquire heavier than the limit in force raises."""
    return re.escape(
        f"weight must be at most the limit in force for semaphore {name!r} ({limit}), got {weight}: "
        "a permit that heavy could never be granted"
    )


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "try"])
async def test_a_weight_above_the_limit_is_refused_at_once_having_taken_nothing(
    make: Callable[..., Semaphore], client_admin: redis.asyncio.Redis, blocking: bool
) -> None:
    sem = make(limit=3)
    with anyio.fail_after(WAIT), pytest.raises(ValueError, match=f"^{too_heavy('db', 3, 4)}$"):
        await sem.acquire(blocking, weight=4)  # refused by Redis at once, not after a wait
    assert await sem.count() == 0
    assert await sem.waiting() == 0
    for suffix in ("", ":owner", ":queue", ":waiters", ":holders", ":weight", ":limit"):
        assert await client_admin.exists(f"{sem.key}{suffix}") == 0, suffix


async def test_a_weight_above_the_limit_is_refused_while_others_hold_and_wait_leaving_them_be(
    make: Callable[..., Semaphore], client_admin: redis.asyncio.Redis
) -> None:
    sem, other = make(limit=3), make(limit=3)
    held = await sem.acquire(weight=3)
    assert held is not None
    waiter = asyncio.create_task(sem.acquire(weight=2))
    await until_queued(sem, 1)
    (queued,) = await client_admin.zrange(f"{sem.key}:queue", 0, -1)

    with pytest.raises(ValueError, match=too_heavy("db", 3, 4)):
        await other.acquire(weight=4)

    assert await client_admin.zrange(f"{sem.key}:owner", 0, -1) == [held.identifier.encode()]
    assert await client_admin.zrange(f"{sem.key}:queue", 0, -1) == [queued]
    assert set(await client_admin.hkeys(f"{sem.key}:holders")) == {held.identifier.encode(), queued}
    assert await extra_weight(client_admin, sem) == 2
    assert await sem.release(held)
    assert (await granted(waiter)).weight == 2


async def test_async_with_a_weight_above_the_limit_raises_without_running_the_body(
    make: Callable[..., Semaphore],
) -> None:
    sem = make(limit=3)
    with pytest.raises(ValueError, match=too_heavy("db", 3, 5)):
        async with sem(weight=5):
            pytest.fail("the body must not run")
    assert await sem.count() == 0
    assert await sem.waiting() == 0


async def test_the_limit_named_is_the_one_in_force_not_the_one_the_object_brought(
    make: Callable[..., Semaphore],
) -> None:
    sem = make(limit=5)
    await sem.set_limit(2)
    with pytest.raises(ValueError, match=too_heavy("db", 2, 3)):
        await sem.acquire(weight=3)
    assert await sem.acquire(weight=2, blocking=False) is not None


# --- a bad weight ------------------------------------------------------------------------------

BAD_WEIGHTS = [
    pytest.param(0, (ValueError, "weight must be at least 1, got 0"), id="0"),
    pytest.param(-1, (ValueError, "weight must be at least 1, got -1"), id="-1"),
    pytest.param(True, (TypeError, "weight must be an int, not bool"), id="True"),
    pytest.param(2.0, (TypeError, "weight must be an int, not float"), id="2.0"),
    pytest.param("3", (TypeError, "weight must be an int, not str"), id="'3'"),
    pytest.param(None, (TypeError, "weight must be an int, not NoneType"), id="None"),
    pytest.param(2**53 + 1, (ValueError, "weight must be at most 2**53 (9,007,199,254,740,992), got "), id="2**53+1"),
]


@pytest.fixture
async def users_client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A new client of the session's emptied server, as users make one from a URL (nothing sent yet)."""
    admin = redis_server.admin_client()
    await admin.flushdb()
    await admin.aclose()
    client = connect(redis_server.url)
    assert isinstance(client, redis.asyncio.Redis)
    yield client
    await close(client)


@pytest.fixture
async def busy(users_client: redis.asyncio.Redis, redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """The session's server with a heavy permit held for ten minutes by another client, so that state is there."""
    other = redis_server.client()
    holder = AsyncFairSemaphore(other, "db", 4, timeout=600)
    assert await holder.acquire(weight=2, blocking=False) is not None
    yield other
    await other.aclose()


def connections_made(client: redis.asyncio.Redis) -> int:
    """How many connections ``client``'s pool has made: none, if it never sent anything."""
    pool = client.connection_pool
    return len(pool._available_connections) + len(pool._in_use_connections)


@pytest.mark.parametrize(("weight", "refusal"), BAD_WEIGHTS)
async def test_a_bad_weight_is_refused_before_anything_is_sent(
    cls: SemaphoreClass,
    users_client: redis.asyncio.Redis,
    busy: redis.asyncio.Redis,
    weight: object,
    refusal: tuple[type[Exception], str],
) -> None:
    error, message = refusal
    sem = cls(users_client, "db", 4)
    async with redis_unchanged(busy):
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            await sem.acquire(weight=weight)  # type: ignore[arg-type]
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            await sem.acquire(blocking=False, weight=weight)  # type: ignore[arg-type]
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            sem(weight=weight)  # type: ignore[arg-type]  # refused as the block is made, not entered
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            limiter("db", 4, weight=weight, client=users_client, kind=kind_of(cls))  # type: ignore[arg-type]
        if isinstance(weight, int):  # what is neither an int nor a function is refused as such: see the next test
            with pytest.raises(error, match=f"^{re.escape(message)}"):
                limit_concurrency("db", 4, weight=weight, client=users_client)
    assert connections_made(users_client) == 0


@pytest.mark.parametrize("weight", [None, "3", 2.5], ids=["None", "'3'", "2.5"])
def test_a_decorator_weight_must_be_an_int_or_a_function(weight: object) -> None:
    name = type(weight).__name__
    with pytest.raises(TypeError, match=f"^weight must be an int or a function returning one, not {name}$"):
        limit_concurrency("db", 4, weight=weight)  # type: ignore[arg-type]


# --- async with sem(weight=k) ----------------------------------------------------------------------


async def test_async_with_a_weight_holds_it_for_the_block_and_releases_it(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=4)
    async with sem(weight=3) as permit:
        assert isinstance(permit, Permit)
        assert permit.weight == 3
        assert await sem.count() == 3
        assert await sem.acquire(weight=2, blocking=False) is None
    assert await sem.count() == 0


async def test_one_weighted_block_can_be_entered_again_and_nested(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=4)
    block = sem(weight=2)
    async with block as first:
        pass
    async with block as outer:
        async with block as inner:
            assert await sem.count() == 4
            assert inner.identifier != outer.identifier
        assert await sem.count() == 2
    assert await sem.count() == 0
    assert first.fencing_token < outer.fencing_token < inner.fencing_token


async def test_a_weighted_block_nests_with_a_plain_one_innermost_released_first(
    make: Callable[..., Semaphore],
) -> None:
    sem = make(limit=4)
    async with sem(weight=3) as heavy:
        async with sem as light:
            assert (heavy.weight, light.weight) == (3, 1)
            assert await sem.count() == 4
        assert await sem.count() == 3
        assert await sem.refresh(heavy)
    assert await sem.count() == 0
    async with sem as light, sem(weight=3) as heavy:  # and the other way round
        assert await sem.count() == 4
    assert await sem.count() == 0


async def test_a_weighted_block_shows_its_weight(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=4)
    assert repr(sem(weight=3)) == f"{sem!r}(weight=3)"


async def test_a_heavy_permit_released_through_another_object_frees_its_whole_weight(
    make: Callable[..., Semaphore],
) -> None:
    # The weight travels in the identifier: whoever releases the permit knows what it frees.
    taker, releaser = make(limit=4), make(limit=4)
    heavy = await taker.acquire(weight=3)
    assert heavy is not None
    assert await releaser.release(heavy)
    assert await releaser.count() == 0
    assert await releaser.acquire(weight=4, blocking=False) is not None


# --- leases: crash, refresh, loss ------------------------------------------------------------------


async def test_an_unrefreshed_heavy_permit_frees_its_whole_weight_when_its_lease_runs_out(
    make: Callable[..., Semaphore], clock: FakeClock, client_admin: redis.asyncio.Redis
) -> None:
    # A holder whose process died: it acquired without auto_refresh and will never refresh nor release.
    sem = make(limit=4, timeout=10, clock=clock)
    dead = await sem.acquire(weight=3)
    assert dead is not None
    clock.advance(9.9)
    assert await sem.acquire(weight=2, blocking=False) is None
    clock.advance(0.2)
    assert await sem.count() == 0
    taken = await sem.acquire(weight=4, blocking=False)
    assert taken is not None
    assert taken.fencing_token > dead.fencing_token
    assert await extra_weight(client_admin, sem) == 3  # the dead holder's weight went with it


HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    import aiosem
    from aiosem._urls import connect

    async def main(url, cls, name, limit, weight, lease):
        sem = getattr(aiosem, cls)(connect(url), name, int(limit), timeout=float(lease))
        permit = await sem.acquire(weight=int(weight))
        print(permit.fencing_token, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main(*sys.argv[1:]))
    """
)

#: The lease of the killed holder.
CRASH_LEASE = 1.0


@pytest.mark.slow
async def test_a_killed_heavy_holders_weight_goes_to_a_queued_waiter_after_its_lease(
    cls: SemaphoreClass, redis_server: RedisServer, users_client: redis.asyncio.Redis
) -> None:
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, redis_server.url, cls.__name__, "crash", "4", "3", str(CRASH_LEASE),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout is not None
    try:
        with anyio.fail_after(30):
            token = int(await holder.stdout.readline())
    finally:
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
    killed_at = anyio.current_time()

    sem = cls(users_client, "crash", 4, timeout=CRASH_LEASE)
    assert await sem.acquire(weight=2, blocking=False) is None  # the dead holder's 3 still count
    # Queued behind nobody, the waiter is woken by the lease's end, not by a release.
    permit = await sem.acquire(weight=3, blocking_timeout=CRASH_LEASE + 5)
    assert permit is not None
    assert anyio.current_time() - killed_at < CRASH_LEASE + 1.5  # the lease, and scheduling noise
    assert permit.fencing_token > token
    assert await sem.count() == 3
    assert await sem.release(permit)


async def test_refresh_keeps_a_heavy_permit_past_its_lease(make: Callable[..., Semaphore], clock: FakeClock) -> None:
    sem = make(limit=4, timeout=10, clock=clock)
    permit = await sem.acquire(weight=3)
    assert permit is not None
    for _ in range(3):
        clock.advance(9)
        assert await sem.refresh(permit) is True
    clock.advance(9)
    assert await sem.count() == 3
    assert await sem.acquire(weight=2, blocking=False) is None


async def test_a_kept_alive_heavy_permit_outlasts_several_leases(
    cls: SemaphoreClass, real_client: redis.asyncio.Redis
) -> None:
    holder, other = cls(real_client, "db", 4, timeout=0.6), cls(real_client, "db", 4, timeout=0.6)
    async with holder(weight=3):
        end = anyio.current_time() + 3 * 0.6
        tries = 0
        while anyio.current_time() < end:
            assert await other.acquire(weight=2, blocking=False) is None
            tries += 1
            await anyio.sleep(0.05)
        assert await other.count() == 3
    assert tries > 5
    assert await other.count() == 0


async def test_a_heavy_permit_whose_lease_ran_out_ends_its_block_with_permit_lost(
    make: Callable[..., Semaphore], clock: FakeClock
) -> None:
    sem = make(limit=4, timeout=10, clock=clock)
    with pytest.raises(PermitLost, match="lease ran out") as caught:
        async with sem(weight=3) as permit:
            clock.advance(11)
    assert caught.value.identifier == permit.identifier
    assert await sem.count() == 0


async def test_a_heavy_permit_taken_away_cancels_its_block_and_its_stray_weight_counts_no_more(
    cls: SemaphoreClass, real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis
) -> None:
    sem = cls(real_client, "db", 4, timeout=1.5)
    with anyio.fail_after(WAIT), pytest.raises(PermitLost) as caught:  # noqa: PT012 -- the loss comes mid-body
        async with sem(weight=3) as permit:
            # The permit goes, as eviction would take it; what it weighed stays behind in :weight.
            await admin_client.delete(sem.key, f"{sem.key}:owner")
            assert await extra_weight(admin_client, sem) == 2
            await anyio.sleep_forever()
    assert caught.value.identifier == permit.identifier
    whole = await sem.acquire(weight=4, blocking=False)  # with nobody holding, the stray weight goes
    assert whole is not None
    assert await extra_weight(admin_client, sem) == 3


# --- cancellation at every point ---------------------------------------------------------------------


@pytest.fixture
def direct(users_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis) -> redis.asyncio.Redis:
    """An unrestricted client of the same server as `users_client` (whose fixture emptied it)."""
    return admin_client


@pytest.mark.parametrize("contended", [False, True], ids=["free", "contended"])
async def test_a_cancelled_heavy_acquire_raises_and_leaves_nothing_wherever_it_lands(
    cls: SemaphoreClass, users_client: redis.asyncio.Redis, direct: redis.asyncio.Redis, contended: bool
) -> None:
    # Contended, 2 of 4 are held by a permit never refreshed (its lease outlasts the test): 3 must queue.
    holder_sem = cls(direct, "sweep", 4, timeout=SWEEP_LEASE)
    holder = await holder_sem.acquire(weight=2) if contended else None
    for turns in CANCEL_AFTER:
        sem = cls(users_client, "sweep", 4, timeout=SWEEP_LEASE)  # fresh each time: its first call
        running, outcome = await cancelled_after(turns, sem.acquire(weight=3))
        assert_cancelled(running, outcome, turns)
        if isinstance(outcome, Permit):
            assert not contended
            assert await sem.release(outcome)
        assert (await sem.count(), await sem.waiting()) == (2 if contended else 0, 0), f"after {turns} turns"
        extra = await extra_weight(direct, sem)
        assert extra == (1 if holder else 0), f"cancelled after {turns} turns"
        await sem.aclose()
    if holder is not None:
        assert await holder_sem.release(holder)
    await holder_sem.aclose()
    await assert_nothing_left(holder_sem, direct, tombstones=True)  # :weight included


async def test_a_cancelled_heavy_async_with_raises_and_leaves_nothing_wherever_it_lands(
    cls: SemaphoreClass, users_client: redis.asyncio.Redis, direct: redis.asyncio.Redis
) -> None:
    async def body(sem: Semaphore) -> None:
        async with sem(weight=3):
            await asyncio.sleep(0)

    for turns in CANCEL_AFTER:
        sem = cls(users_client, "sweep-with", 4)
        running, outcome = await cancelled_after(turns, body(sem))
        assert_cancelled(running, outcome, turns)
        assert (await sem.count(), await sem.waiting()) == (0, 0), f"cancelled after {turns} turns"
        await sem.aclose()
    await assert_nothing_left(cls(direct, "sweep-with", 4), direct, tombstones=True)


async def test_a_heavy_waiter_cancelled_right_after_its_grant_passes_its_weight_on(
    cls: SemaphoreClass, users_client: redis.asyncio.Redis, direct: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sem = cls(users_client, "db", 4)
    whole = await sem.acquire(weight=4)
    assert whole is not None
    first = asyncio.create_task(sem.acquire(weight=3))
    await until_queued(sem, 1)
    with anyio.fail_after(WAIT):
        while not sem._core.queue.queued():  # noqa: ASYNC110 -- `first` may not have read its reply yet
            await asyncio.sleep(0.002)
    (first_identifier,) = sem._core.queue.queued()
    second = asyncio.create_task(sem.acquire(weight=2))  # 3 + 2 > 4: it waits for `first`'s weight
    await until_queued(sem, 2)
    observe = WaitQueue.observe

    def cancel_first_on_its_grant(self: WaitQueue, reply: Reply, sent: float) -> None:
        observe(self, reply, sent)
        if first_identifier in dict(reply.granted):
            first.cancel()  # granted, and `first` has not run since

    monkeypatch.setattr(WaitQueue, "observe", cancel_first_on_its_grant)
    assert await sem.release(whole)  # its own reply grants `first` 3 of the 4
    permit = await granted(second)

    with anyio.fail_after(WAIT):
        await asyncio.wait({first})
    assert first.cancelled()
    assert permit.weight == 2
    assert await sem.count() == 2
    assert await sem.release(permit)
    await assert_nothing_left(sem, direct)


async def test_a_heavy_head_cancelled_while_queued_lets_the_lighter_waiters_behind_it_in(
    make: Callable[..., Semaphore],
) -> None:
    holder, waiters = make(limit=4), make(limit=4)
    three = await holder.acquire(weight=3)
    assert three is not None
    head = asyncio.create_task(waiters.acquire(weight=2))
    await until_queued(waiters, 1)
    behind = asyncio.create_task(waiters.acquire(weight=1))
    await until_queued(waiters, 2)

    head.cancel()  # the 1 free goes to the waiter it held back, in the cancellation's own step
    with anyio.fail_after(WAIT):
        await asyncio.wait({head})
    assert head.cancelled()
    assert (await granted(behind)).weight == 1
    assert await holder.count() == 4
    assert await holder.waiting() == 0


# --- live limits ------------------------------------------------------------------------------


async def test_a_waiter_heavier_than_a_lowered_limit_is_passed_over_until_the_limit_rises(
    make: Callable[..., Semaphore], client_admin: redis.asyncio.Redis
) -> None:
    holder, waiters = make(limit=4), make(limit=4)
    whole = await holder.acquire(weight=4)
    assert whole is not None
    heavy = asyncio.create_task(waiters.acquire(weight=3))
    await until_queued(waiters, 1)
    light = asyncio.create_task(waiters.acquire(weight=1))
    await until_queued(waiters, 2)

    assert await holder.set_limit(2) == 4
    assert await holder.release(whole)  # 2 free: `heavy` can never fit under 2, so `light` is served
    served = await granted(light)
    assert await holder.count() == 1
    assert await holder.waiting() == 1
    assert not heavy.done()
    with pytest.raises(ValueError, match=too_heavy("db", 2, 3)):
        await holder.acquire(weight=3)  # a newcomer that heavy is refused, while the queued one waits on

    assert await holder.set_limit(4) == 2  # 3 fit beside `light`'s 1: granted in the limit's own step
    raised = await granted(heavy)
    assert raised.fencing_token > served.fencing_token
    assert await holder.count() == 4
    assert await extra_weight(client_admin, holder) == 2


async def test_a_passed_over_waiter_keeps_its_place_ahead_of_later_ones(make: Callable[..., Semaphore]) -> None:
    holder, waiters = make(limit=4), make(limit=4)
    whole = await holder.acquire(weight=4)
    assert whole is not None
    heavy = asyncio.create_task(waiters.acquire(weight=3))  # queued under 4: under 2 it would be refused
    await until_queued(waiters, 1)
    assert await holder.set_limit(2) == 4
    later = asyncio.create_task(waiters.acquire(weight=2))
    await until_queued(waiters, 2)

    assert await holder.release(whole)
    served = await granted(later)  # 2 fit under 2; `heavy` is passed over
    assert await holder.set_limit(4) == 2  # 3 do not fit beside 2: `heavy` is the head again, and waits
    assert await holder.count() == 2
    assert await holder.acquire(blocking=False) is None  # 2 are free, but `heavy` is ahead
    assert await waiters.release(served)
    assert (await granted(heavy)).weight == 3


async def test_a_passed_over_waiter_does_not_make_a_try_on_a_free_semaphore_fail(
    make: Callable[..., Semaphore],
) -> None:
    holder, waiters = make(limit=4), make(limit=4)
    whole = await holder.acquire(weight=4)
    assert whole is not None
    heavy = asyncio.create_task(waiters.acquire(weight=3))
    await until_queued(waiters, 1)
    await holder.set_limit(2)
    assert await holder.release(whole)
    assert (await holder.count(), await holder.waiting()) == (0, 1)  # free, and `heavy` passed over
    blocking = await holder.acquire()  # queued behind `heavy`, and served at once: it is passed over
    assert blocking is not None
    assert await holder.release(blocking)
    try:
        # A try is refused only where a blocking acquire would have to wait.
        assert await holder.acquire(blocking=False) is not None
    finally:
        heavy.cancel()
        with anyio.fail_after(WAIT):
            await asyncio.wait({heavy})


# --- observers and telemetry ----------------------------------------------------------------------


@pytest.fixture
def events() -> Iterator[list[LimiterEvent]]:
    seen: list[LimiterEvent] = []
    aiosem.add_observer(seen.append)
    yield seen
    aiosem.remove_observer(seen.append)


async def test_observers_are_told_each_permits_weight_as_its_cost(
    make: Callable[..., Semaphore], events: list[LimiterEvent]
) -> None:
    sem = make(limit=4)
    async with sem(weight=3) as heavy:
        pass
    light = await sem.acquire()
    assert light is not None
    assert await sem.release(light)
    assert [(event.kind, event.identifier, event.cost) for event in events] == [
        ("acquired", heavy.identifier, 3),
        ("released", heavy.identifier, 3),
        ("acquired", light.identifier, 1),
        ("released", light.identifier, 1),
    ]


async def test_otel_spans_of_a_heavy_permit_carry_its_weight(
    make: Callable[..., Semaphore], telemetry: Telemetry
) -> None:
    sem = make(limit=4)
    async with sem(weight=3):
        pass
    async with sem:
        pass
    spans = [span for span in telemetry.spans.get_finished_spans() if span.name.startswith("aiosem.")]
    weights = [(span.name, (span.attributes or {}).get("aiosem.weight")) for span in spans]
    assert weights == [("aiosem.wait", 3), ("aiosem.hold", 3), ("aiosem.wait", 1), ("aiosem.hold", 1)]


# --- limiter and limit_concurrency ------------------------------------------------------------


@pytest.fixture
async def backend(_isolated: None, client: redis.asyncio.Redis) -> AsyncIterator[redis.asyncio.Redis]:
    """The test's client, configured as aiosem's; aiosem closed, and its tasks ended, at the end."""
    aiosem.configure(client=client)
    yield client
    await close_and_settle()


async def test_a_limiter_holds_a_permit_of_its_weight(cls: SemaphoreClass, backend: redis.asyncio.Redis) -> None:
    observer = cls(backend, "db", 4)
    block = limiter("db", 4, weight=3, kind=kind_of(cls))
    assert repr(block) == "limiter('db', limit=4, weight=3)"
    async with block as permit:
        assert permit.weight == 3
        assert await observer.count() == 3
        assert await observer.acquire(weight=2, blocking=False) is None
    assert await observer.count() == 0


async def test_a_limiter_heavier_than_the_limit_raises_having_taken_nothing(
    cls: SemaphoreClass, backend: redis.asyncio.Redis
) -> None:
    with pytest.raises(ValueError, match=too_heavy("db", 4, 5)):
        async with limiter("db", 4, weight=5, kind=kind_of(cls)):
            pytest.fail("the body must not run")
    observer = cls(backend, "db", 4)
    assert (await observer.count(), await observer.waiting()) == (0, 0)


async def test_a_decorated_call_weighs_what_its_weight_function_says_of_its_arguments(
    cls: SemaphoreClass, backend: redis.asyncio.Redis
) -> None:
    observer = cls(backend, "db", 10)

    @limit_concurrency("db", 10, kind=kind_of(cls), weight=lambda sql, report=False: 5 if report else 1)
    async def query(sql: str, report: bool = False) -> tuple[int, int]:
        return current_permit("db").weight, await observer.count()

    assert await query("SELECT 1") == (1, 1)
    assert await query("SELECT *", report=True) == (5, 5)
    assert await observer.count() == 0


async def test_a_decorated_call_of_a_fixed_weight(cls: SemaphoreClass, backend: redis.asyncio.Redis) -> None:
    observer = cls(backend, "db", 4)

    @limit_concurrency("db", 4, kind=kind_of(cls), weight=4)
    async def exclusive() -> int:
        return await observer.count()

    assert await exclusive() == 4
    assert await observer.count() == 0


@pytest.mark.parametrize(("weight", "refusal"), BAD_WEIGHTS)
async def test_a_weight_function_returning_a_bad_weight_is_refused_naming_the_function(
    cls: SemaphoreClass, backend: redis.asyncio.Redis, weight: object, refusal: tuple[type[Exception], str]
) -> None:
    error, message = refusal
    ran = False

    def weigh() -> int:
        return weight  # type: ignore[return-value]  # the bad value under test

    @limit_concurrency("db", 4, kind=kind_of(cls), weight=weigh)
    async def query() -> None:
        nonlocal ran
        ran = True

    prefix = "the weight function of @limit_concurrency on " + query.__qualname__ + ": "
    async with redis_unchanged(backend):
        with pytest.raises(error, match=f"^{re.escape(prefix + message)}"):
            await query()
    assert not ran


async def test_a_weight_function_heavier_than_the_limit_is_refused_having_taken_nothing(
    cls: SemaphoreClass, backend: redis.asyncio.Redis
) -> None:
    @limit_concurrency("db", 4, kind=kind_of(cls), weight=lambda: 5)
    async def query() -> None:
        pytest.fail("the call must not run")

    with pytest.raises(ValueError, match=too_heavy("db", 4, 5)):
        await query()
    observer = cls(backend, "db", 4)
    assert (await observer.count(), await observer.waiting()) == (0, 0)


async def test_a_decorated_async_generator_holds_its_weight_while_it_runs(
    cls: SemaphoreClass, backend: redis.asyncio.Redis
) -> None:
    observer = cls(backend, "db", 4)

    @limit_concurrency("db", 4, kind=kind_of(cls), weight=lambda rows: min(rows, 4))
    async def stream(rows: int) -> AsyncIterator[int]:
        for row in range(rows):
            yield row

    seen = [(row, await observer.count()) async for row in stream(3)]
    assert seen == [(0, 3), (1, 3), (2, 3)]
    assert await observer.count() == 0


# --- the relay -----------------------------------------------------------------------------------


async def test_a_mutex_relayed_among_one_objects_waiters_passes_over_a_heavy_one(
    real_client: redis.asyncio.Redis,
) -> None:
    # The relay runs at limit 1 only, which no weight above 1 fits: such a waiter is there only
    # if it queued before the limit was lowered, and the relay must not hand it the mutex.
    sem = AsyncFairSemaphore(real_client, "mutex", 2)
    whole = await sem.acquire(weight=2)
    assert whole is not None
    tasks = []
    for weight in (1, 2, 1):
        tasks.append(asyncio.create_task(sem.acquire(weight=weight)))
        await until_queued(sem, len(tasks))
    first, heavy, last = tasks
    assert await sem.set_limit(1) == 2

    assert await sem.release(whole)  # this object's own waiter at the head: a relay run behind it
    one = await granted(first)
    assert await sem.count() == 1
    assert await sem.release(one)
    other = await granted(last)
    assert await sem.count() == 1
    assert not heavy.done()
    assert await sem.release(other)

    assert await sem.set_limit(2) == 1
    assert (await granted(heavy)).weight == 2
    assert one.fencing_token < other.fencing_token
