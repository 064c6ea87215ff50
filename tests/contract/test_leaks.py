"""Nothing leaks: not in Redis, not in the process, however many cycles run.

In Redis: after 100,000 acquire/release cycles from four processes -- with
waiters queued, acquires cancelled and timed out -- there are no more keys
than before and ``used_memory`` is back where it was; and every key aiosem
writes expires by itself once the semaphore is idle. In the process: after
20,000 cycles, traced memory and connections are flat, and closing the
semaphore (or `aiosem.aclose`) ends every task and connection.

How Redis's memory is compared. A warm-up first runs every script once (a
cached script stays for the server's life) and creates the fencing
counters. ``used_memory`` is read then and again after the run, each time
with no client connected but the reader (a client's buffers are freed a
moment after it disconnects) and once the keys with a short TTL have
expired. Before each reading the server's bounded diagnostics are emptied:
the slow log, a ring a loaded machine fills with slow calls, and the
statistics (``CONFIG RESETSTAT``), whose per-command latency histograms --
some 20 kB each -- appear the first time a command runs. A tombstone set (an
identifier refused for a minute) and the receipts of release calls (kept
as long as a call may be tried again) are checked to expire within their
bounds and then deleted, as their expiry would, since the test must not
wait that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import secrets
import time
import tracemalloc
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Final, Literal

import anyio
import pytest

import aiosem
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, recipes
from aiosem._rules import TOMBSTONE_TTL_MS, queue_ttl_ms
from aiosem._urls import close, connect
from tests.harness.limiting import assert_no_task_left
from tests.harness.support import FakeClock, two_processes, until_queued, worker_outputs

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    import redis.asyncio

    from tests.harness.support import RedisServer

Kind = Literal["fair", "locked"]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore
CLASSES: Final[dict[Kind, type[Semaphore]]] = {"fair": AsyncFairSemaphore, "locked": AsyncLockedSemaphore}

#: A worker process: runs the `Load` given as JSON, prints its `Tally` as JSON.
WORKER: Final = "import sys; from tests.contract.test_leaks import work_in_process; work_in_process(sys.argv[1])"
#: The longest any one wait of these tests may take.
WAIT: Final = 10.0
#: The default: a worker whose loop a loaded machine holds up past it right
#: after a permit was handed to it has lost that permit (its holder is told,
#: with `PermitLost`), and the queue's keys still expire soon after the last waiter.
WAITER_TIMEOUT: Final = 2.0
#: How long the queue's keys outlive their last waiter at most: a waiter timeout and a second (see the scripts).
QUEUE_TTL_MS: Final = queue_ttl_ms(WAITER_TIMEOUT)
#: A release call's receipt lasts a step bound: the default lease, 10 s.
RECEIPT_TTL_MS: Final = 10_000
#: The keys that outlive a load by a bounded time the tests need not wait for, with that bound in ms.
SHORT_LIVED: Final = {"cancelled": TOMBSTONE_TTL_MS, "receipt": RECEIPT_TTL_MS}
#: Of the cycles of the mixed load: the share that waits with a short
#: ``blocking_timeout``, and the share cancelled at a random point.
TIMEOUT_SHARE: Final = 0.05
CANCEL_SHARE: Final = 0.05
#: How long those waits and cancellations give an acquire: enough for some
#: to get their permit, too little for most of those that queue.
SHORT: Final = 0.003
#: How far ``used_memory`` may move over the run, as a fraction.
MEMORY_TOLERANCE: Final = 0.01
#: How much traced memory one batch of cycles may add once warm.
TRACED_GROWTH: Final = 100_000
#: The connection pool of the in-process test's client: a blocking pool,
#: so that a connection taken and never given back would stall the test.
POOL: Final = 8


# --- the load ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """What one worker process does.

    ``coroutines`` coroutines take ``grants`` permits of a semaphore that
    has enough for every coroutine of every process, so that they never
    wait on each other; meanwhile ``contenders`` coroutines cycle on a
    semaphore of ``contended_limit`` permits, shared with the other
    processes' contenders, so that there is always a queue.
    """

    url: str
    kind: Kind
    name: str
    limit: int
    coroutines: int
    grants: int
    contended_limit: int
    contenders: int
    seed: int


@dataclass(frozen=True, slots=True)
class Tally:
    """What some cycles did: permits granted, waits timed out, acquires cancelled, in how long."""

    grants: int = 0
    timeouts: int = 0
    cancels: int = 0
    seconds: float = 0.0

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.grants + other.grants,
            self.timeouts + other.timeouts,
            self.cancels + other.cancels,
            max(self.seconds, other.seconds),
        )


class Counts:
    """What the coroutines of one `cycles` call did so far."""

    __slots__ = ("cancels", "grants", "timeouts")

    def __init__(self) -> None:
        self.grants = self.timeouts = self.cancels = 0


async def cycles(semaphore: Semaphore, coroutines: int, rng: random.Random, until: Callable[[Counts], bool]) -> Tally:
    """Run cycles on ``coroutines`` coroutines until ``until(counts)`` holds.

    Most cycles hold the permit with ``async with``; some wait with a short
    ``blocking_timeout`` and may give up; some are cancelled at a random
    point: queued, being granted, or holding.
    """
    counts = Counts()
    started = time.perf_counter()

    async def loop() -> None:
        while not until(counts):
            roll = rng.random()
            if roll < TIMEOUT_SHARE:
                permit = await semaphore.acquire(blocking_timeout=rng.uniform(0, SHORT))
                if permit is None:
                    counts.timeouts += 1
                    continue
                await semaphore.release(permit)
            elif roll < TIMEOUT_SHARE + CANCEL_SHARE:
                with anyio.move_on_after(rng.uniform(0, SHORT)) as attempt:
                    async with semaphore:
                        await asyncio.sleep(0)
                if attempt.cancelled_caught:
                    counts.cancels += 1
                    continue
            else:
                async with semaphore:
                    await asyncio.sleep(0)
            counts.grants += 1

    async with anyio.create_task_group() as group:
        for _ in range(coroutines):
            group.start_soon(loop)
    return Tally(counts.grants, counts.timeouts, counts.cancels, time.perf_counter() - started)


def enough(grants: int) -> Callable[[Counts], bool]:
    return lambda counts: counts.grants >= grants


async def run_load(load: Load) -> Tally:
    client = connect(load.url)
    cls = CLASSES[load.kind]
    bulk = cls(client, load.name, load.limit, waiter_timeout=WAITER_TIMEOUT)
    contended = cls(client, f"{load.name}-contended", load.contended_limit, waiter_timeout=WAITER_TIMEOUT)
    rng = random.Random(load.seed)
    done = False
    try:

        async def run_bulk() -> Tally:
            nonlocal done
            try:
                return await cycles(bulk, load.coroutines, rng, enough(load.grants))
            finally:
                done = True

        first, second = await asyncio.gather(run_bulk(), cycles(contended, load.contenders, rng, lambda _: done))
        return first + second
    finally:
        await bulk.aclose()
        await contended.aclose()
        await close(client)


def work_in_process(load: str) -> None:
    """A worker process's body: run the load given as JSON, print its `Tally` as JSON."""
    tally = asyncio.run(run_load(Load(**json.loads(load))))
    print(json.dumps(asdict(tally)), flush=True)  # noqa: T201 -- the answer to the parent


async def in_processes(loads: list[Load], within: float) -> Tally:
    """Run each load in a process of its own, all at once; add up their tallies."""
    total = Tally()
    for stdout in await worker_outputs(WORKER, [json.dumps(asdict(load)) for load in loads], within):
        total += Tally(**json.loads(stdout))
    return total


# --- looking at Redis ----------------------------------------------------------------------


async def ttls(admin: redis.asyncio.Redis) -> dict[str, int]:
    """Every key, with its PTTL in ms (-1: none)."""
    found = {}
    async for key in admin.scan_iter(count=1000):
        found[key.decode()] = await admin.pttl(key)
    return {key: ttl for key, ttl in found.items() if ttl != -2}  # -2: expired since the scan


def kind_of(key: str) -> str:
    """What a key is, by its place in the layout: ``timeout set``, ``counter``, ``queue``, ``lock``..."""
    if key.startswith("lock:"):
        return "lock"
    # A release call's receipt is ``receipt:<call id>``.
    return key.rpartition("}")[2].lstrip(":").partition(":")[0] or "timeout set"


async def clients(admin: redis.asyncio.Redis, name: str | None = None) -> int:
    """How many connections the server has: all but the reader's, or those named ``name``."""
    listed = await admin.client_list()
    if name is None:
        return len(listed) - 1
    return sum(entry["name"] == name for entry in listed)


async def until_no_clients(admin: redis.asyncio.Redis, name: str | None = None) -> None:
    """Wait until the server has closed every connection (or every one named ``name``)."""
    with anyio.fail_after(WAIT):
        while await clients(admin, name):  # noqa: ASYNC110 -- the server's state: no event to wait on
            await anyio.sleep(0.01)


async def used_memory(server: RedisServer) -> int:
    """``used_memory``, read as the module's docstring says, on a connection of its own.

    Each reading opens a new connection, so that the reader's own buffers,
    which the server resizes over time, are the same at every reading.
    """
    async with admin_of(server) as reader:
        await until_no_clients(reader)
        await reader.slowlog_reset()
        await reader.config_resetstat()
        return int((await reader.info("memory"))["used_memory"])


async def drop_short_lived(admin: redis.asyncio.Redis) -> dict[str, int]:
    """Delete the `SHORT_LIVED` keys, as their expiry would, once each is checked to expire within its bound.

    Returns:
        The keys deleted, with the PTTLs they had.
    """
    doomed = {key: ttl for key, ttl in (await ttls(admin)).items() if kind_of(key) in SHORT_LIVED}
    # 0: expiring this very millisecond.
    assert all(0 <= ttl <= SHORT_LIVED[kind_of(key)] for key, ttl in doomed.items()), {
        key: ttl for key, ttl in doomed.items() if not 0 <= ttl <= SHORT_LIVED[kind_of(key)]
    }
    if doomed:
        await admin.delete(*doomed)
    return doomed


async def settled_memory(server: RedisServer, before: int) -> int:
    """``used_memory`` once it has settled within `MEMORY_TOLERANCE` of ``before``, or the last reading after `WAIT`.

    A key space that grew shrinks its hash tables in the server's cron (ten
    times a second), a moment after the keys went: settled is two readings
    alike, 0.2 s apart.
    """
    deadline = time.monotonic() + WAIT
    previous = None
    while True:
        memory = await used_memory(server)
        settled = memory == previous and abs(memory - before) <= MEMORY_TOLERANCE * before
        if settled or time.monotonic() > deadline:
            return memory
        previous = memory
        await anyio.sleep(0.2)


async def until_only(admin: redis.asyncio.Redis, kept: set[str], within: float) -> dict[str, int]:
    """Wait until no key is left but ``kept`` and `SHORT_LIVED` sets; return what is left, with PTTLs."""
    with anyio.fail_after(within):
        while True:
            left = await ttls(admin)
            if all(key in kept or kind_of(key) in SHORT_LIVED for key in left):
                return left
            await anyio.sleep(0.05)


@contextlib.asynccontextmanager
async def admin_of(server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """An unrestricted client of ``server``, to look at its keys, memory and clients; closed after."""
    client = server.admin_client()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def admin(fresh_redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """An unrestricted client of the test's own server."""
    async with admin_of(fresh_redis_server) as client:
        yield client


# --- 1. many processes, many cycles: Redis is left as it was ---------------------------------


async def warm_up(url: str, kind: Kind, names: list[str]) -> None:
    """Run every script a semaphore runs once, and create the fencing counters, on a client closed after."""
    client = connect(url)
    try:
        for name in names:
            semaphore = CLASSES[kind](client, name, 1, waiter_timeout=WAITER_TIMEOUT)
            permit = await semaphore.acquire(blocking=False)
            assert permit is not None
            assert await semaphore.refresh(permit)
            assert await semaphore.release(permit)
    finally:
        await close(client)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kind", "grants_per_process"),
    # A locked cycle costs some five fair ones, and this file must stay short.
    [("fair", 25_000), ("locked", 1_500)],
)
async def test_many_cycles_in_four_processes_leave_redis_as_it_was(
    fresh_redis_server: RedisServer, kind: Kind, grants_per_process: int
) -> None:
    name = f"leaks-{kind}"
    await warm_up(fresh_redis_server.url, kind, [name, f"{name}-contended"])
    async with admin_of(fresh_redis_server) as admin:
        await drop_short_lived(admin)
        keys_before = await ttls(admin)
    memory_before = await used_memory(fresh_redis_server)
    loads = [
        Load(
            fresh_redis_server.url,
            kind,
            name,
            limit=256,
            coroutines=48,
            grants=grants_per_process,
            contended_limit=2,
            contenders=4,
            seed=seed,
        )
        for seed in range(4)
    ]

    started = time.perf_counter()
    tally = await in_processes(loads, within=100)
    seconds = time.perf_counter() - started

    assert tally.grants >= 4 * grants_per_process
    assert tally.timeouts > 0
    assert tally.cancels > 0
    async with admin_of(fresh_redis_server) as admin:
        await until_only(admin, set(keys_before), within=QUEUE_TTL_MS / 1000 + WAIT)
        tombstones = await drop_short_lived(admin)
        assert set(await ttls(admin)) == set(keys_before)
    memory_after = await settled_memory(fresh_redis_server, memory_before)
    print(  # noqa: T201 -- the figures for the record, shown with `pytest -s`
        f"\n{kind}: {tally.grants:,} grants, {tally.timeouts:,} timeouts, {tally.cancels:,} cancels "
        f"in {seconds:.1f} s ({tally.grants / seconds:,.0f} cycles/s); keys before and after {sorted(keys_before)}, "
        f"short-lived keys {len(tombstones)} ({sorted({kind_of(key) for key in tombstones})}); "
        f"used_memory {memory_before:,} -> {memory_after:,} B "
        f"({(memory_after - memory_before) / memory_before:+.2%})"
    )
    assert abs(memory_after - memory_before) <= MEMORY_TOLERANCE * memory_before


# --- 2. every key aiosem writes expires once the semaphore is idle ------------------------------

#: Long enough that the queue's keys are still there to be looked at on a slow machine.
IDLE_WAITER_TIMEOUT: Final = 5.0
IDLE_QUEUE_TTL_MS: Final = queue_ttl_ms(IDLE_WAITER_TIMEOUT)


async def use_a_semaphore(server: RedisServer, kind: Kind) -> None:
    """Every step a semaphore takes, from two processes: hold, queue, time out, cancel, hand over, release."""
    pair = two_processes(server.client, CLASSES[kind], f"ttl-{kind}", 1, waiter_timeout=IDLE_WAITER_TIMEOUT)
    async with pair as (holder_side, waiter_side):
        held = await holder_side.acquire()
        assert held is not None
        assert await waiter_side.acquire(blocking_timeout=0.01) is None  # queued, then timed out
        # An acquire cancelled before it reached Redis leaves a tombstone, lest it arrive after all.
        await waiter_side._core.queue.give_up(f"{waiter_side._process}.{secrets.token_hex(8)}")
        async with anyio.create_task_group() as group:
            group.start_soon(hold, waiter_side)  # queued, then handed the permit by the release
            await until_queued(holder_side)
            assert await holder_side.refresh(held)
            assert await holder_side.release(held)
        async with holder_side:
            pass


async def hold(semaphore: Semaphore) -> None:
    async with semaphore:
        pass


async def use_fair(server: RedisServer) -> None:
    await use_a_semaphore(server, "fair")


async def use_locked(server: RedisServer) -> None:
    await use_a_semaphore(server, "locked")


async def use_a_rate_limiter(server: RedisServer) -> None:
    client = server.client()
    try:
        limiter = AsyncRateLimiter(client, "ttl-rate", rate=1, per=1, burst=3)
        for _ in range(3):
            assert await limiter.acquire(blocking=False)
    finally:
        await client.aclose()


async def use_the_recipes(server: RedisServer) -> None:
    """Every recipe, each permit and lock given back (a refused acquire takes nothing)."""
    client = server.client()
    try:
        basic = await recipes.acquire_semaphore(client, "{recipes-basic}", 1)
        assert basic is not None
        assert await recipes.acquire_semaphore(client, "{recipes-basic}", 1) is None
        assert await recipes.release_semaphore(client, "{recipes-basic}", basic)
        fair = await recipes.acquire_fair_semaphore(client, "{recipes-fair}", 1)
        assert fair is not None
        assert await recipes.acquire_fair_semaphore(client, "{recipes-fair}", 1) is None
        assert await recipes.refresh_fair_semaphore(client, "{recipes-fair}", fair)
        assert await recipes.release_fair_semaphore(client, "{recipes-fair}", fair)
        locked = await recipes.acquire_semaphore_with_lock(client, "{recipes-locked}", 1)
        assert locked is not None
        assert await recipes.release_fair_semaphore(client, "{recipes-locked}", locked)
        for acquire in (recipes.acquire_lock, recipes.acquire_lock_with_timeout):
            lock = await acquire(client, "{recipes-lock}", 1)
            assert lock is not None
            assert await recipes.release_lock(client, "{recipes-lock}", lock)
    finally:
        await client.aclose()


USERS: Final[dict[str, Callable[[RedisServer], Awaitable[None]]]] = {
    "fair": use_fair,
    "locked": use_locked,
    "rate limiter": use_a_rate_limiter,
    "recipes": use_the_recipes,
}
#: The keys an idle user leaves, besides fencing counters, by kind; with the longest each may live, in ms.
LEFT_WHEN_IDLE: Final[dict[str, dict[str, int]]] = {
    "fair": {"tickets": IDLE_QUEUE_TTL_MS, **SHORT_LIVED},
    "locked": {"tickets": IDLE_QUEUE_TTL_MS, **SHORT_LIVED},
    "rate limiter": {"rate": 3_000},  # the burst's three emission intervals
    "recipes": {"receipt": RECEIPT_TTL_MS},
}


@pytest.mark.parametrize("user", sorted(USERS))
async def test_every_key_but_the_fencing_counter_expires_by_itself_once_idle(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, user: str
) -> None:
    await USERS[user](fresh_redis_server)
    left = {key: ttl for key, ttl in (await ttls(admin)).items() if kind_of(key) != "counter"}
    longest: dict[str, int] = {}
    for key, ttl in left.items():
        longest[kind_of(key)] = max(ttl, longest.get(kind_of(key), ttl))
    print(f"\n{user}: the longest TTL of each kind of key left, in ms: {longest}")  # noqa: T201 -- for the record
    assert all(ttl > 0 for ttl in left.values()), left
    assert set(longest) == set(LEFT_WHEN_IDLE[user])
    for kind, ttl in longest.items():
        assert ttl <= LEFT_WHEN_IDLE[user][kind], kind


@pytest.mark.parametrize("user", ["fair", "locked", "recipes"])
async def test_the_fencing_counter_expires_by_itself_once_idle(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, user: str
) -> None:
    await USERS[user](fresh_redis_server)
    counters = {key: ttl for key, ttl in (await ttls(admin)).items() if kind_of(key) == "counter"}
    print(f"\n{user}: fencing counters and their TTLs in ms: {counters}")  # noqa: T201 -- for the record
    assert counters
    assert all(ttl > 0 for ttl in counters.values()), counters


@pytest.mark.parametrize("kind", ["fair", "locked"])
async def test_the_keys_of_a_permit_never_given_back_go_with_the_next_step_after_its_lease(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, kind: Kind
) -> None:
    # The keys that bear a live permit carry no TTL (volatile-* eviction must not take them): a permit
    # never given back stays, with the limit and its record, until a step reaps it (see
    # tests/faults/test_eviction.py).
    name, clock = f"abandoned-{kind}", FakeClock()
    client = fresh_redis_server.client()
    try:
        # Never given back, nor kept alive: as its holder's process crashed.
        assert await CLASSES[kind](client, name, 2, timeout=1, clock=clock).acquire(blocking=False) is not None
        without_ttl = {key for key, ttl in (await ttls(admin)).items() if ttl < 0}
        clock.advance(1)
        # The next step on the name, once the lease ran out.
        sem = CLASSES[kind](client, name, 2, timeout=1, clock=clock)
        permit = await sem.acquire(blocking=False)
        assert permit is not None
        assert await sem.release(permit)
    finally:
        await client.aclose()
    base = f"aiosem:{{{name}}}"
    assert without_ttl == {base, f"{base}:owner", f"{base}:limit", f"{base}:holders"}
    assert {key: ttl for key, ttl in (await ttls(admin)).items() if ttl < 0} == {}


# --- 3. in the process: memory, connections and tasks stay flat, and end with aclose ------------


def traced() -> int:
    """The memory Python has allocated and not freed, as tracemalloc counts it, after a full collection."""
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def connections_made(admin: redis.asyncio.Redis) -> int:
    return int((await admin.info("stats"))["total_connections_received"])


#: Contended cycles of `test_contended_cycles_leave_no_garbage_for_the_collector`.
COLLECTED_CYCLES: Final = 400


async def test_contended_cycles_leave_no_garbage_for_the_collector(
    cls: type[AsyncFairSemaphore] | type[AsyncLockedSemaphore], redis_server: RedisServer
) -> None:
    # Objects in a reference cycle outlive their cycle until the collector runs: made at every
    # acquire, they make the collector run every few hundred cycles, a sixth of the throughput.
    client = redis_server.client()
    sem = cls(client, f"collected-{secrets.token_hex(4)}", 2)
    done = 0

    async def cycle(count: int) -> None:
        nonlocal done
        for _ in range(count):
            async with sem:  # 8 coroutines at limit 2: most acquires queue
                await asyncio.sleep(0)
            done += 1

    try:
        with anyio.fail_after(WAIT):
            await asyncio.gather(*(cycle(10) for _ in range(8)))  # caches filled, scripts loaded
        gc.collect()
        gc.disable()
        try:
            with anyio.fail_after(WAIT):
                await asyncio.gather(*(cycle(COLLECTED_CYCLES // 8) for _ in range(8)))
            garbage = gc.collect()
        finally:
            gc.enable()
    finally:
        await sem.aclose()
        await client.aclose()
    assert done == 80 + COLLECTED_CYCLES
    # A cycle made per acquire leaves several objects each: a few in all are the event loop's own.
    assert garbage < COLLECTED_CYCLES / 10, f"{garbage} objects left to the collector by {COLLECTED_CYCLES} cycles"


async def test_waits_bounded_call_by_call_keep_a_bounded_number_of_deadline_watchdogs(
    cls: type[AsyncFairSemaphore] | type[AsyncLockedSemaphore], redis_server: RedisServer
) -> None:
    # What is left of a budget, computed at each call: every waiter's bound differs.
    client = redis_server.client()
    sem = cls(client, f"bounds-{secrets.token_hex(4)}", 1)
    try:
        for round_ in range(5):
            held = await sem.acquire()
            assert held is not None
            waiters = [asyncio.create_task(sem.acquire(blocking_timeout=WAIT + round_ + n / 100)) for n in range(10)]
            await until_queued(sem, 10)
            for _ in range(len(waiters)):
                assert await sem.release(held)
                with anyio.fail_after(WAIT):
                    (done,), _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                waiters.remove(done)
                held = done.result()
                assert held is not None
            assert await sem.release(held)
        assert len(sem._core.queue._watchdogs) <= 8 + 1  # eight kept, and the one made for the last bound
    finally:
        await sem.aclose()
        await client.aclose()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_twenty_thousand_cycles_in_one_process_leave_memory_and_connections_flat(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    name = f"aiosem-leaks-{secrets.token_hex(4)}"
    client = connect(f"{fresh_redis_server.url}?client_name={name}&max_connections={POOL}")
    # Half as many permits as coroutines: waiters queue, time out and are cancelled.
    semaphore = AsyncFairSemaphore(client, "in-process", 16, waiter_timeout=WAITER_TIMEOUT)
    rng = random.Random(20_000)
    batches = []
    tracemalloc.start()
    try:
        await cycles(semaphore, 32, rng, enough(2_000))  # caches filled, connections made, scripts loaded
        memory = [traced()]
        made = [await connections_made(admin)]
        live = []
        for _ in range(2):
            batches.append(await cycles(semaphore, 32, rng, enough(9_000)))
            memory.append(traced())
            made.append(await connections_made(admin))
            live.append(await clients(admin, name))
    finally:
        tracemalloc.stop()
        await semaphore.aclose()
        await close(client)
    print(  # noqa: T201 -- the figures for the record
        f"\n{batches}: traced memory {memory} B, connections made so far {made}, open after each batch {live}"
    )
    assert all(batch.timeouts and batch.cancels for batch in batches)
    # A leak of even a few bytes a cycle would show as growth in both batches.
    assert memory[2] - memory[1] < TRACED_GROWTH
    assert memory[1] - memory[0] < TRACED_GROWTH
    assert max(live) <= POOL  # the pub/sub connection is the pool's too
    await assert_no_task_left(within=WAIT)
    await until_no_clients(admin, name)


@pytest.mark.usefixtures("_isolated")
async def test_the_decorators_leave_no_task_and_no_connection_after_aclose(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis
) -> None:
    name = f"aiosem-leaks-{secrets.token_hex(4)}"
    aiosem.configure(url=f"{fresh_redis_server.url}?client_name={name}", rates={"paced": (10_000, 1.0, 100)})

    @aiosem.limit_concurrency("decorated", 2)
    async def limited() -> None:
        await asyncio.sleep(0)

    @aiosem.limit_rate("paced")
    async def paced() -> None:
        await asyncio.sleep(0)

    async def blocks() -> None:
        async with aiosem.limiter("block", 2), aiosem.rate_limiter("paced"):
            await asyncio.sleep(0)

    for _ in range(50):
        await asyncio.gather(*(call() for _ in range(8) for call in (limited, paced, blocks)))
    assert await clients(admin, name) > 0
    await aiosem.aclose()
    await assert_no_task_left(within=WAIT)
    await until_no_clients(admin, name)


# --- 4. cancelled at random points: nothing left behind after the waiter timeout ---------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fair", "locked"])
async def test_random_cancellations_in_two_processes_leave_nothing_behind_after_the_waiter_timeout(
    fresh_redis_server: RedisServer, admin: redis.asyncio.Redis, kind: Kind
) -> None:
    rng = random.Random(4_000)
    name = f"cancelled-{kind}"
    cancelled = bodies = 0

    async def contend(semaphore: Semaphore) -> None:
        nonlocal cancelled, bodies
        for _ in range(40):
            with anyio.move_on_after(rng.uniform(0, 0.03)) as attempt:
                async with semaphore:
                    await anyio.sleep(rng.uniform(0, 0.002))
                bodies += 1
            cancelled += attempt.cancelled_caught

    base = f"aiosem:{{{name}}}"
    async with two_processes(fresh_redis_server.client, CLASSES[kind], name, 2, waiter_timeout=WAITER_TIMEOUT) as pair:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for semaphore in pair * 12:
                    group.start_soon(contend, semaphore)
        # At once, before closing the objects could give anything back: every
        # acquire given up has left the queue, and every permit is back.
        assert await admin.zcard(base) == await admin.zcard(f"{base}:owner") == 0
        assert await admin.zcard(f"{base}:queue") == await admin.zcard(f"{base}:waiters") == 0
    print(f"\n{kind}: {cancelled} cancelled, {bodies} bodies ran")  # noqa: T201 -- for the record
    assert cancelled >= 200
    assert bodies > 0
    left = await until_only(admin, {f"{base}:counter"}, within=QUEUE_TTL_MS / 1000 + WAIT)
    assert all(0 <= ttl <= SHORT_LIVED[kind_of(key)] for key, ttl in left.items() if kind_of(key) in SHORT_LIVED), left
