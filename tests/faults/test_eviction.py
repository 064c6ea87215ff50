"""The limit under eviction: what a full Redis may delete or refuse, and what callers see then.

Each test runs real ``redis-server`` processes of its own, sets a
``maxmemory`` and a ``maxmemory-policy``, fills memory or deletes keys as
eviction would, while semaphores are in use, and checks what
``docs/faults.md`` says of it ("Memory full" and "Keys evicted"): no key
that bears a live permit has a TTL, so ``noeviction`` and every
``volatile-*`` policy keep the limit; an ``allkeys-*`` policy is warned
about whatever the memory; a refusal for memory is an `aiosem.OutOfMemory`
that names the semaphore; each row of the table of keys holds; and what an
abandoned semaphore leaves is bounded. Each test notes what it measured
with `tests.harness.faults.report` (``pytest -s`` shows it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import signal
import sys
import textwrap
from typing import TYPE_CHECKING, Any, Final

import anyio
import pytest
import redis
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, LimitMismatch, OutOfMemory
from aiosem._connection import check_eviction_policy
from aiosem._locked import WatchedSteps
from aiosem._protocol import Step
from aiosem._rules import COUNTER_TTL_MS
from tests.harness.faults import (
    Load,
    evict_until_gone,
    exhaust_memory,
    free_memory,
    processes,
    report,
    snapshot,
)
from tests.harness.support import until_queued

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from tests.harness.support import FakeClock, RedisServer

pytestmark = pytest.mark.faults

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: The lease of the semaphores here: short, so that a test need not wait long for one to run out.
LEASE: Final = 1.0
#: A third of the lease: how often a permit kept alive is refreshed.
REFRESH: Final = LEASE / 3
#: Slack on top of every bound the code promises, for a busy machine.
MARGIN: Final = 0.5
#: The bound on every wait a test makes for something the code promises to do.
BOUND: Final = 20.0
#: The bound on a whole scenario under load.
SCENARIO: Final = 40.0
#: How long a load's callers wait in the queue at most.
PATIENCE: Final = 5.0
LIMIT: Final = 2

#: The prefix of the keys that fill memory: that of `tests.harness.faults`, whose `snapshot` leaves them out.
FILLER: Final = "filler:"
#: How many keys without a TTL fill memory, and how large each is.
FILLER_KEYS: Final = 200
FILLER_BYTES: Final = 10_000


def over_limit(load: Load) -> str:
    """The over-limit observations of a load, for `report`."""
    if not load.overlaps:
        return f"none (peak {load.peak} of {load.limit})"
    total = sum(end - start for start, end in load.overlaps)
    return f"peak {load.peak} of {load.limit}; over for {total:.3f} s in {len(load.overlaps)} stretch(es)"


async def fill_memory_without_ttl(admin: redis.asyncio.Redis, policy: str) -> None:
    """Fill the server with keys that have no TTL and cap its memory where it stands, under ``policy``.

    From then on every write that grows memory makes the server evict; under
    a ``volatile-*`` policy only keys with a TTL are candidates.
    """
    await admin.config_set("maxmemory-policy", policy)
    async with admin.pipeline(transaction=False) as pipe:
        for index in range(FILLER_KEYS):
            pipe.set(f"{FILLER}{index}", b"x" * FILLER_BYTES)
        await pipe.execute()
    await admin.config_set("maxmemory", int((await admin.info("memory"))["used_memory"]))


# --- 1. No key that bears a live permit carries a TTL -----------------------------------------

#: The keys that bear the permits: the timeout set (the base key), the owner set, and the limit.
PERMIT_SUFFIXES: Final = ("", ":owner", ":limit")


async def permit_ttls(admin: redis.asyncio.Redis, sem: Semaphore) -> dict[str, int]:
    """The PTTL of each key that bears ``sem``'s permits, by suffix (-1: none, -2: no such key)."""
    return {suffix: await admin.pttl(sem.key + suffix) for suffix in PERMIT_SUFFIXES}


async def test_the_keys_of_held_permits_carry_no_ttl(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    sem = cls(client, "held", LIMIT, timeout=LEASE)
    try:
        permit = await sem.acquire()
        assert permit is not None
        after_grant = await permit_ttls(admin, sem)
        assert await sem.refresh(permit)
        after_refresh = await permit_ttls(admin, sem)
        assert await sem.release(permit)
    finally:
        await sem.aclose()
        await client.aclose()
    assert after_grant == {"": -1, ":owner": -1, ":limit": -1}
    assert after_refresh == after_grant


async def test_the_keys_of_permits_with_a_waiter_queued_carry_no_ttl(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    sem = cls(client, "queued", 1, timeout=LEASE)
    try:
        permit = await sem.acquire()
        assert permit is not None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(sem.acquire, blocking_timeout=BOUND))
            await until_queued(sem)
            ttls = await permit_ttls(admin, sem)
            assert await sem.release(permit)  # hands the permit to the waiter, which keeps it
    finally:
        await sem.aclose()
        await client.aclose()
    assert ttls == {"": -1, ":owner": -1, ":limit": -1}


async def test_a_ttl_left_on_a_permit_key_is_removed_by_the_next_step(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    sem = cls(client, "persisted", LIMIT, timeout=LEASE)
    try:
        permit = await sem.acquire()
        assert permit is not None
        for suffix in PERMIT_SUFFIXES:  # as an older aiosem left them: a day
            assert await admin.pexpire(sem.key + suffix, 86_400_000)
        assert await sem.refresh(permit)
        ttls = await permit_ttls(admin, sem)
        assert await sem.release(permit)
    finally:
        await sem.aclose()
        await client.aclose()
    assert ttls == {"": -1, ":owner": -1, ":limit": -1}


# --- 2. Memory full of keys without a TTL, under every volatile-* policy ---------------------

#: The contention of the issue that found the fault: 4 processes of 10 coroutines each, 3 permits.
PROCESSES: Final = 4
COROUTINES: Final = 10
CONTENDED_LIMIT: Final = 3
#: How long the contention runs on a full memory.
FULL_FOR: Final = 3.0
#: How long each body holds its permit: short, so that permits change hands often.
HOLD: Final = 0.02


@contextlib.asynccontextmanager
async def evictions(admin: redis.asyncio.Redis) -> AsyncIterator[list[str]]:
    """The keys the server evicts while the block runs, as its keyspace notifications tell; filled as it ends."""
    await admin.config_set("notify-keyspace-events", "Ee")
    evicted: list[str] = []
    pubsub = admin.pubsub()
    try:
        await pubsub.subscribe("__keyevent@0__:evicted")
        yield evicted
        # The notifications wait on the connection; every one of the block comes before this PING's answer.
        await pubsub.ping()
        with anyio.fail_after(BOUND):
            while (message := await pubsub.get_message(timeout=BOUND)) is not None and message["type"] != "pong":
                if message["type"] == "message":
                    evicted.append(message["data"].decode())
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8.2


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"])
async def test_under_volatile_eviction_with_memory_full_nobody_runs_over_the_limit(
    cls: SemaphoreClass, policy: str, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    options = {"timeout": LEASE, "blocking_timeout": PATIENCE}
    name, base = "volatile", "aiosem:{volatile}"
    async with processes(fresh_redis_server.client, cls, name, CONTENDED_LIMIT, PROCESSES, **options) as semaphores:
        load = Load([sem for sem in semaphores for _ in range(COROUTINES)], hold=HOLD)
        with anyio.fail_after(SCENARIO):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(load.run)
                await load.until(lambda: len(load.holding) == load.limit)
                async with evictions(admin) as evicted:
                    await fill_memory_without_ttl(admin, policy)
                    filled = anyio.current_time()
                    await anyio.sleep(FULL_FOR)  # the fault lasts this long: there is no event to wait for
                    await admin.config_set("maxmemory", 0)
                load.stop()
    granted = load.granted_after(filled)
    evicted_kinds = sorted({key.removeprefix(base).lstrip(":").partition(":")[0] or "timeout set" for key in evicted})
    report(
        f"{cls.__name__}: {policy}, memory full of keys without a TTL for {FULL_FOR:g} s, "
        f"{PROCESSES} processes x {COROUTINES} coroutines on limit {CONTENDED_LIMIT}",
        caller_saw=f"{len(granted)} grants; outcomes {load.outcomes()}; {len(evicted)} keys evicted: {evicted_kinds}",
        recovered_in=None,
        over_limit=over_limit(load),
    )
    assert evicted  # memory was full: the server evicted what it could
    assert {base, f"{base}:owner", f"{base}:limit"}.isdisjoint(evicted)
    assert load.overlaps == []
    assert load.peak <= CONTENDED_LIMIT


# --- 3. The eviction-policy warning -------------------------------------------------------------

#: The policies under which Redis may evict any key, a live permit included: warned about.
ALLKEYS: Final = ["allkeys-lru", "allkeys-lfu", "allkeys-random"]
#: The policies under which no live permit can be evicted: not warned about.
KEEPING: Final = ["noeviction", "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"]
#: How long a test waits for the warning: the check may run in the background of the first acquire.
WARNED_WITHIN: Final = 5.0


def warnings_naming(caplog: pytest.LogCaptureFixture, policy: str) -> list[logging.LogRecord]:
    """The warnings aiosem logged that name ``policy``."""
    return [
        record
        for record in caplog.records
        if record.name == "aiosem" and record.levelno >= logging.WARNING and policy in record.getMessage()
    ]


async def until_warned(caplog: pytest.LogCaptureFixture, policy: str) -> None:
    """Wait until aiosem has warned about ``policy`` (bounded to `WARNED_WITHIN`)."""
    with anyio.fail_after(WARNED_WITHIN):
        while not warnings_naming(caplog, policy):  # noqa: ASYNC110 -- a log record has no event to wait on
            await anyio.sleep(0.01)


@pytest.mark.parametrize("policy", ALLKEYS)
async def test_an_allkeys_policy_is_warned_about_once_per_client(
    policy: str, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await admin.config_set("maxmemory", 1 << 30)
    await admin.config_set("maxmemory-policy", policy)
    # Semaphores of both classes and a rate limiter, on one client allowed to read the policy.
    client = fresh_redis_server.admin_client()
    try:
        with caplog.at_level(logging.WARNING, logger="aiosem"):
            for name in ("first", "second"):
                for cls in (AsyncFairSemaphore, AsyncLockedSemaphore):
                    sem = cls(client, name, 1)
                    permit = await sem.acquire()
                    assert permit is not None
                    await sem.release(permit)
                    await sem.aclose()
            assert await AsyncRateLimiter(client, "third", 100).acquire()
            await until_warned(caplog, policy)
            await check_eviction_policy(client, "aiosem:{fourth}")  # checked already: says nothing
    finally:
        await client.aclose()
    assert len(warnings_naming(caplog, policy)) == 1


@pytest.mark.parametrize("policy", ALLKEYS)
async def test_an_allkeys_policy_is_warned_about_when_memory_is_already_full(
    cls: SemaphoreClass,
    policy: str,
    fresh_redis_server: RedisServer,
    admin: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Below what the server uses besides its keys: nothing it may evict brings it under, so it refuses.
    await admin.config_set("maxmemory-policy", policy)
    await admin.config_set("maxmemory", 1)
    client = fresh_redis_server.admin_client()
    sem = cls(client, "full", 1)
    try:
        with caplog.at_level(logging.WARNING, logger="aiosem"):
            with contextlib.suppress(redis.exceptions.OutOfMemoryError):  # the locked class's step is refused
                await sem.acquire(blocking=False)
            await until_warned(caplog, policy)
    finally:
        await admin.config_set("maxmemory", 0)
        await sem.aclose()
        await client.aclose()
    assert len(warnings_naming(caplog, policy)) == 1


@pytest.mark.parametrize("policy", KEEPING)
async def test_a_policy_that_never_evicts_a_live_permit_is_not_warned_about(
    policy: str, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await admin.config_set("maxmemory", 1 << 30)
    await admin.config_set("maxmemory-policy", policy)
    client = fresh_redis_server.admin_client()
    try:
        with caplog.at_level(logging.DEBUG, logger="aiosem"):
            await check_eviction_policy(client, "aiosem:{kept}")
    finally:
        await client.aclose()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []


async def test_an_allkeys_policy_without_maxmemory_is_not_warned_about(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await admin.config_set("maxmemory", 0)  # no limit: nothing is ever evicted
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    client = fresh_redis_server.admin_client()
    try:
        with caplog.at_level(logging.DEBUG, logger="aiosem"):
            await check_eviction_policy(client, "aiosem:{unbounded}")
    finally:
        await client.aclose()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []


# --- 4. Memory full under noeviction: OutOfMemory -------------------------------------------------


async def prepared_step(client: redis.asyncio.Redis, step: str) -> Callable[[], Awaitable[object]]:
    """A step of some state in Redis, ready to run (its script loaded): ``"<fair|locked|rate>-<operation>"``.

    ``locked-wait`` is a blocking acquire, which first draws its waiter's ticket; ``locked-acquire`` tries once.
    """
    kind, _, operation = step.partition("-")
    if kind == "rate":
        # One call every 10 s: the first one's key lasts for the whole test, and the next one reserves.
        limiter = AsyncRateLimiter(client, "pressed", 0.1, blocking_timeout=60)
        assert await limiter.acquire()
        return limiter.acquire
    sem = (AsyncFairSemaphore if kind == "fair" else AsyncLockedSemaphore)(client, "pressed", LIMIT, timeout=10.0)
    permit = await sem.acquire()
    assert permit is not None
    steps: dict[str, Callable[[], Awaitable[object]]] = {
        "acquire": functools.partial(sem.acquire, blocking=False),
        "wait": functools.partial(sem.acquire, blocking_timeout=BOUND),
        "refresh": functools.partial(sem.refresh, permit),
        "release": functools.partial(sem.release, permit),
    }
    return steps[operation]


# The fair scripts are never refused: their first write frees memory (see the next test).
@pytest.mark.parametrize("step", ["locked-acquire", "locked-wait", "locked-refresh", "locked-release", "rate-acquire"])
async def test_a_step_refused_for_memory_raises_out_of_memory_and_writes_nothing(
    step: str, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    try:
        run = await prepared_step(client, step)
        await exhaust_memory(admin)
        before = await snapshot(admin)
        with pytest.raises(OutOfMemory) as refused:
            await run()
        after = await snapshot(admin)
        await free_memory(admin)
    finally:
        await client.aclose()
    error = refused.value
    report(
        f"{step}: over maxmemory under noeviction",
        caller_saw=f"{type(error).__module__}.{type(error).__name__}: {error}",
        recovered_in=None,
        over_limit="none; nothing written",
    )
    what = "rate limiter" if step.startswith("rate") else "semaphore"
    assert str(error) == (
        f"Redis refused a step of {what} 'pressed': its memory is full (used memory > maxmemory, and its "
        "maxmemory-policy evicts nothing more); free memory or raise maxmemory"
    )
    assert error.name == "pressed"
    assert "maxmemory" in error.reply  # Redis's own words, kept
    assert isinstance(error, redis.exceptions.OutOfMemoryError)  # still what redis-py's callers catch
    assert error.__cause__ is None
    assert error.__suppress_context__  # one traceback: redis-py's, naming internal keys, is not shown
    assert after == before


async def test_a_look_at_the_holders_while_memory_is_full_raises_out_of_memory_where_the_server_refuses_it(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    # `holders` reads in a MULTI. Redis before 7.4 queues nothing in a MULTI while memory is full, reads
    # included; Redis 7.4 and later, and Valkey 8 and later, run a transaction that needs no memory.
    software = fresh_redis_server.software
    assert software is not None
    client = fresh_redis_server.client()
    sem = cls(client, "pressed", LIMIT, timeout=10.0)
    try:
        permit = await sem.acquire()
        assert permit is not None
        await exhaust_memory(admin)
        if software.refuses_reads_in_a_transaction_when_full:
            with pytest.raises(OutOfMemory, match=r"^Redis refused a step of semaphore 'pressed': its memory is full"):
                await sem.holders()
        else:
            assert list(await sem.holders()) == [permit.identifier]
        await free_memory(admin)
        assert list(await sem.holders()) == [permit.identifier]
    finally:
        await client.aclose()


async def test_a_locked_step_whose_commit_is_refused_for_memory_raises_out_of_memory_and_writes_nothing(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Memory fills between the step's reads, which pass, and its MULTI, which Redis refuses whole.
    client = fresh_redis_server.client()
    sem = AsyncLockedSemaphore(client, "committed", LIMIT, timeout=10.0)
    commit = WatchedSteps._commit
    before: dict[bytes, tuple[bytes | None, bool]] = {}

    async def commit_on_a_full_server(self: WatchedSteps, *args: Any) -> Any:
        await exhaust_memory(admin)
        before.update(await snapshot(admin))
        return await commit(self, *args)

    try:
        monkeypatch.setattr(WatchedSteps, "_commit", commit_on_a_full_server)
        with pytest.raises(OutOfMemory, match=r"^Redis refused a step of semaphore 'committed': its memory is full"):
            await sem.acquire(blocking=False)
        monkeypatch.undo()
        after = await snapshot(admin)
        await free_memory(admin)
        # The step lock, which a full Redis would not let the step delete either (MULTI), expires.
        with anyio.fail_after(BOUND):
            assert await sem.acquire(blocking_timeout=BOUND) is not None
    finally:
        await sem.aclose()
        await client.aclose()
    assert {key: value for key, value in after.items() if not key.startswith(b"lock:")} == {
        key: value for key, value in before.items() if not key.startswith(b"lock:")
    }


async def test_under_memory_pressure_fair_acquires_and_releases_go_through_within_the_limit(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    # Redis checks a script for memory only until its first write, and the
    # first write of the fair acquire and release is a ZREM, which needs none.
    client = fresh_redis_server.client()
    sem = AsyncFairSemaphore(client, "pressed", LIMIT, timeout=10.0)
    first = await sem.acquire()
    assert first is not None
    assert await sem.release(first)  # both scripts are loaded now
    await exhaust_memory(admin)
    permits = [await sem.acquire(blocking=False) for _ in range(LIMIT + 1)]
    assert [permit is not None for permit in permits] == [True] * LIMIT + [False]
    assert permits[0] is not None
    assert await sem.release(permits[0])
    assert await sem.count() == LIMIT - 1
    await free_memory(admin)
    await client.aclose()


async def test_a_fair_holder_keeps_its_permit_under_memory_pressure(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    sem = AsyncFairSemaphore(client, "pressed", 1, timeout=LEASE)
    try:
        with anyio.fail_after(BOUND):
            async with sem:
                await exhaust_memory(admin)
                await anyio.sleep(2 * LEASE)  # the fault lasts two leases
                await free_memory(admin)
    finally:
        await sem.aclose()
        await client.aclose()


async def test_once_memory_is_freed_every_step_works_again(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    # The locked class, whose every step is refused over maxmemory (the fair class's never are).
    cls = AsyncLockedSemaphore
    client = fresh_redis_server.client()
    sem = cls(client, "freed", LIMIT, timeout=10.0)
    permit = await sem.acquire()
    assert permit is not None
    await exhaust_memory(admin)
    with pytest.raises(OutOfMemory):
        await sem.refresh(permit)
    await free_memory(admin)
    freed = anyio.current_time()
    second = await sem.acquire(blocking=False)
    recovered = anyio.current_time() - freed
    assert second is not None
    assert await sem.refresh(permit)
    assert await sem.release(permit)
    assert await sem.release(second)
    await client.aclose()
    report(
        f"{cls.__name__}: memory freed after refusals",
        caller_saw="refresh refused with OutOfMemory, then every step works",
        recovered_in=recovered,
        over_limit="none",
    )


# --- 5. Keys evicted: each row of the table of docs/faults.md -------------------------------------
#
# Each test deletes keys as eviction would -- at random under allkeys-random, or by DEL, which is
# what an eviction does -- while semaphores are in use, and checks the consequence the row states.


async def evicted_or_refused(admin: redis.asyncio.Redis, keys: list[str]) -> bool:
    """Have the server evict at random until one of ``keys`` is gone; whether it then refused a write for memory.

    Valkey counts a client's pipelined writes against ``maxmemory`` at more than
    twice what Redis does (measured: 20 SETs of 1 kB left 56 kB more in use on
    Valkey 9.1.2, 22 kB on Redis 7.0.15, and no less once their keys were
    deleted), more than the room `evict_until_gone` leaves: Valkey evicts every
    key there is, the semaphore's among them, and refuses the write, as a
    server does once nothing is left to evict. Redis evicts some and takes it.
    """
    try:
        await evict_until_gone(admin, keys)
    except redis.OutOfMemoryError:
        return True
    return False


async def test_holders_whose_permit_sets_are_evicted_get_permit_lost_within_a_refresh_interval(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    software = fresh_redis_server.software
    assert software is not None
    options = {"timeout": LEASE, "blocking_timeout": PATIENCE}
    async with processes(fresh_redis_server.client, cls, "evicted", 3, 3, **options) as semaphores:
        load = Load(semaphores, hold=SCENARIO)
        key = semaphores[0].key
        with anyio.fail_after(SCENARIO):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(load.run)
                await load.until(lambda: len(load.holding) == load.limit)
                old = list(load.holding)
                refused = await evicted_or_refused(admin, [key, f"{key}:owner"])
                evicted = anyio.current_time()
                counter_kept = await admin.exists(f"{key}:counter") == 1
                await load.until(lambda: all(attempt.ended is not None for attempt in old))
                load.stop()
    assert [attempt.outcome for attempt in old] == ["PermitLost"] * load.limit
    told = max(attempt.body_ended or 0 for attempt in old) - evicted
    assert told <= REFRESH + MARGIN
    assert refused == (software.name == "valkey")
    report(
        f"{cls.__name__}: permit keys evicted (allkeys-random, {software})",
        caller_saw=f"holders {load.outcomes(old)}, the last told {told:.3f} s after; counter kept: {counter_kept};"
        f" the filler write refused once nothing was left to evict: {refused}",
        recovered_in=None,
        over_limit=over_limit(load),
    )


async def test_with_its_limit_evicted_a_semaphore_in_use_takes_another_limit_at_once(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    two, three = cls(client, "limited", 2), cls(client, "limited", 3)
    try:
        held = [await two.acquire(blocking=False) for _ in range(2)]
        assert None not in held
        with pytest.raises(LimitMismatch):
            await three.acquire(blocking=False)
        await admin.delete(f"{two.key}:limit")
        third = await three.acquire(blocking=False)
        count = await three.count()
    finally:
        await two.aclose()
        await three.aclose()
        await client.aclose()
    assert third is not None
    assert count == 3


async def test_with_its_counter_evicted_fencing_tokens_still_increase(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    sem = cls(client, "counted", LIMIT)
    try:
        first = await sem.acquire(blocking=False)
        assert first is not None
        await admin.delete(f"{sem.key}:counter")
        second = await sem.acquire(blocking=False)
    finally:
        await sem.aclose()
        await client.aclose()
    assert second is not None
    assert second.fencing_token > first.fencing_token


async def served_in_order(
    fresh_redis_server: RedisServer, cls: SemaphoreClass, name: str, evict: Callable[[str], Awaitable[object]]
) -> list[str]:
    """Who is served first of a waiter queued before ``evict(key)`` and one queued right after it.

    A holder holds the only permit; the first waiter queues; ``evict`` deletes keys; the second waiter
    queues; once both are queued, the holder releases, and each waiter releases as it is served.
    Waiters are proven alive every second: the second queues long before the first is checked again.
    """
    options = {"timeout": 10.0, "waiter_timeout": 3.0}
    order: list[str] = []

    async def wait(side: Semaphore, who: str) -> None:
        permit = await side.acquire(blocking_timeout=BOUND)
        assert permit is not None
        order.append(who)
        assert await side.release(permit)

    async with processes(fresh_redis_server.client, cls, name, 1, 3, **options) as (holder_side, first, second):
        held = await holder_side.acquire()
        assert held is not None
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(wait, first, "first")
                await until_queued(holder_side)
                await evict(holder_side.key)
                tasks.start_soon(wait, second, "second")
                await until_queued(holder_side, 2)
                assert await holder_side.release(held)
    return order


async def test_with_its_queue_evicted_waiters_queue_again_at_the_back(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    async def evict(key: str) -> None:
        await admin.delete(f"{key}:queue", f"{key}:waiters", f"{key}:tickets")

    assert await served_in_order(fresh_redis_server, cls, "requeued", evict) == ["second", "first"]


async def test_with_its_ticket_counter_evicted_the_next_waiters_are_queued_ahead(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    async def evict(key: str) -> None:
        await admin.delete(f"{key}:tickets")

    # As after many waits: the first waiter's ticket is far from 1.
    await admin.set("aiosem:{overtaken}:tickets", 100)
    assert await served_in_order(fresh_redis_server, cls, "overtaken", evict) == ["second", "first"]


async def test_with_arriving_evicted_a_locked_waiter_on_its_way_draws_its_ticket_again_behind_everyone(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    sem = AsyncLockedSemaphore(client, "arriving-evicted", 1)
    keys = sem._core.keys
    held = await sem.acquire()
    assert held is not None
    # Its step waits for a step lock held by hand, its ticket drawn (the holder's acquire drew ticket 1).
    assert await admin.set(keys.lock, "held by the test", px=60_000)
    try:
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(sem.acquire)
                while await admin.get(keys.tickets) != b"2":  # noqa: ASYNC110 -- Redis's state: no event
                    await anyio.sleep(0.01)
                await admin.delete(keys.arriving)
                await admin.delete(keys.lock)
                await until_queued(sem)
                assert await admin.zcard(keys.queue) == 1
                assert await admin.zcount(keys.queue, 3, 3) == 1  # its ticket drawn again
                assert await sem.release(held)
    finally:
        await sem.aclose()
        await client.aclose()


async def test_with_its_tombstones_evicted_an_acquire_cancelled_on_its_way_takes_a_permit_until_its_lease(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, clock: FakeClock
) -> None:
    client = fresh_redis_server.client()
    sem = cls(client, "tombstoned", 1, timeout=LEASE, clock=clock)
    late = f"{sem._process}.{secrets.token_hex(8)}"
    try:
        await sem._core.queue.give_up(late)  # given up before its request reached Redis: refused for a minute
        assert await admin.zcard(f"{sem.key}:cancelled") == 1
        await admin.delete(f"{sem.key}:cancelled")
        (token,), _ = await sem._core.submit(Step.TRY, (late,))  # the request arrives after all
        held = await sem.acquire(blocking=False)
        clock.advance(LEASE)
        after_the_lease = await sem.acquire(blocking=False)
    finally:
        await sem.aclose()
        await client.aclose()
    assert token > 0  # granted to nobody
    assert held is None  # and held, as long as its lease
    assert after_the_lease is not None


async def test_with_its_state_evicted_a_rate_limiter_forgets_its_schedule(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    client = fresh_redis_server.client()
    limiter = AsyncRateLimiter(client, "scheduled", rate=1, per=60)  # one call a minute
    try:
        assert await limiter.acquire(blocking=False)
        assert not await limiter.acquire(blocking=False)
        await admin.delete(limiter.key)
        forgotten = await limiter.acquire(blocking=False)
    finally:
        await client.aclose()
    assert forgotten  # as at rest: at once


async def test_with_its_receipt_evicted_a_release_tried_again_answers_that_it_released_nothing(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    # As when the first try's reply was lost with its connection and the call was sent again.
    client = fresh_redis_server.client()
    sem = cls(client, "receipted", 1)
    try:
        held = await sem.acquire(blocking=False)
        assert held is not None
        first = await sem._core.backend.execute(Step.RELEASE, [held.identifier], "c0ffee")
        await admin.delete(f"{sem.key}:receipt:c0ffee")
        again = await sem._core.backend.execute(Step.RELEASE, [held.identifier], "c0ffee")
    finally:
        await sem.aclose()
        await client.aclose()
    assert first is not None
    assert again is not None
    assert (first.values, again.values) == ((1,), (0,))


async def test_with_its_step_lock_evicted_mid_step_the_step_is_tried_again(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = fresh_redis_server.client()
    sem = AsyncLockedSemaphore(client, "unlocked", LIMIT)
    commit = WatchedSteps._commit
    committed: list[object] = []

    async def commit_after_an_eviction(self: WatchedSteps, *args: Any) -> Any:
        if not committed:
            # The lock is evicted, and another step takes it, while this one runs.
            await admin.delete(self._core.keys.lock)
            await admin.set(self._core.keys.lock, "another step", px=50)
        result = await commit(self, *args)
        committed.append(result[0])
        return result

    monkeypatch.setattr(WatchedSteps, "_commit", commit_after_an_eviction)
    try:
        with anyio.fail_after(BOUND):
            permit = await sem.acquire(blocking_timeout=BOUND)
        count = await sem.count()
    finally:
        await sem.aclose()
        await client.aclose()
    assert permit is not None
    assert committed[0] is None  # the EXEC aborted: the lock it watched changed
    assert committed[-1] is not None
    assert count == 1


# --- 6. What an abandoned semaphore leaves ------------------------------------------------------

#: A process that takes every permit of a semaphore and queues one more waiter, then sleeps until killed.
ABANDONING = textwrap.dedent(
    """
    import asyncio, sys
    import redis.asyncio
    import aiosem

    async def main(url, cls, name, limit, lease, waiter_timeout):
        client = redis.asyncio.Redis.from_url(url)
        sem = getattr(aiosem, cls)(
            client, name, int(limit), timeout=float(lease), waiter_timeout=float(waiter_timeout)
        )
        for _ in range(int(limit)):
            assert await sem.acquire(blocking=False) is not None
        waiting = asyncio.ensure_future(sem.acquire())
        print("held", flush=True)
        await waiting

    asyncio.run(main(*sys.argv[1:]))
    """
)
#: The abandoned semaphore's waiter timeout: its queue's keys expire a second after it.
ABANDONED_WAITER_TIMEOUT: Final = 0.5


async def keys_with_ttls(admin: redis.asyncio.Redis) -> dict[str, int]:
    """Every key but the fillers, with its PTTL in ms (-1: none)."""
    found = {key.decode(): await admin.pttl(key) async for key in admin.scan_iter()}
    return {key: ttl for key, ttl in found.items() if ttl != -2 and not key.startswith(FILLER)}


@pytest.mark.slow
async def test_an_abandoned_semaphore_leaves_its_dead_permits_and_the_next_step_reaps_them(
    cls: SemaphoreClass, fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    name, base = "abandoned", "aiosem:{abandoned}"
    process = await anyio.open_process(
        [sys.executable, "-c", ABANDONING, fresh_redis_server.url, cls.__name__, name, str(LIMIT), str(LEASE),
         str(ABANDONED_WAITER_TIMEOUT)],
    )  # fmt: skip
    try:
        assert process.stdout is not None
        with anyio.fail_after(BOUND):
            printed = b""
            while not printed.endswith(b"\n"):
                printed += await process.stdout.receive()
            assert printed == b"held\n"
            while await admin.zcard(f"{base}:queue") == 0:  # noqa: ASYNC110 -- Redis's state: no event
                await anyio.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    # Once no waiter can be alive, the queue's keys go by themselves.
    with anyio.fail_after(ABANDONED_WAITER_TIMEOUT + 1 + BOUND):
        while {f"{base}:queue", f"{base}:waiters", f"{base}:tickets"} & set(await keys_with_ttls(admin)):  # noqa: ASYNC110 -- Redis's state: no event
            await anyio.sleep(0.05)
    left = await keys_with_ttls(admin)
    dead_permits = {suffix: await admin.zcard(base + suffix) for suffix in ("", ":owner")}

    # The next step on the name, once the dead permits' leases ran out, reaps them.
    client = fresh_redis_server.client()
    sem = cls(client, name, LIMIT, timeout=LEASE)
    try:
        with anyio.fail_after(LEASE + BOUND):
            permit = await sem.acquire(blocking_timeout=LEASE + BOUND)
        assert permit is not None
        assert await sem.release(permit)
    finally:
        await sem.aclose()
        await client.aclose()
    reaped = await keys_with_ttls(admin)
    report(
        f"{cls.__name__}: a semaphore abandoned by a killed process (limit {LIMIT})",
        caller_saw=f"left {left}; after the next step: {reaped}",
        recovered_in=None,
        over_limit="none",
    )
    # The records of the dead holders, and of the dead waiter, whose queue went: until the next step.
    assert set(left) == {base, f"{base}:owner", f"{base}:limit", f"{base}:holders", f"{base}:counter"}
    assert [left[base], left[f"{base}:owner"], left[f"{base}:limit"], left[f"{base}:holders"]] == [-1, -1, -1, -1]
    assert 0 < left[f"{base}:counter"] <= COUNTER_TTL_MS
    assert dead_permits == {"": LIMIT, ":owner": LIMIT}  # bounded by the limit
    assert {key: ttl for key, ttl in reaped.items() if ttl < 0} == {}
    assert {base, f"{base}:owner", f"{base}:limit", f"{base}:holders"}.isdisjoint(reaped)
