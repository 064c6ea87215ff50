"""`AsyncLockedSemaphore`: another process's stall, crash or partition never takes a healthy holder's permit.

Every step of the locked class takes a short lock, ``lock:`` + the
semaphore's key. A process that stops in the middle of a step -- its event
loop blocked, killed, cut off by the network -- leaves that lock behind, and
everyone else's steps wait for it: their refreshes, their waiters' proofs of
life. These tests stop a process at the worst moment, in a process of its own
or behind a proxy, and check that the holders and waiters of the others,
refreshing as they should, keep their permits and their places (issue 17,
item 3); and what the lock costs those who wait for it.

Each test runs against real ``redis-server`` processes, with a lease of 1 s
so that the faults outlast it quickly, and notes what it measured with
`tests.harness.faults.report` (``pytest -s`` shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import pytest
import redis.asyncio

from aiosem import AsyncLockedSemaphore, PermitLost
from aiosem._coordination import CLEANUP_TIMEOUT
from aiosem._timing import step_bound
from tests.harness.faults import processes, proxied_client, proxied_url, report
from tests.harness.support import until_queued

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from tests.harness.proxy import TcpProxy
    from tests.harness.support import RedisServer, Semaphore

pytestmark = pytest.mark.faults

ROOT: Final = Path(__file__).resolve().parents[2]
#: The lease of every semaphore here: short, so that faults outlast it quickly.
LEASE: Final = 1.0
#: How often the healthy holders refresh: four times a lease.
REFRESH: Final = 0.25
#: How long the healthy holders and waiters are watched once the fault is over.
WATCHED: Final = 3 * LEASE
#: The bound on every wait for something the code promises to do.
BOUND: Final = 20.0
#: The bound on a whole scenario.
SCENARIO: Final = 60.0
#: How many waiters queue behind the holders.
WAITERS: Final = 3

#: A holder whose event loop blocks for two leases inside ``async with``, once told to.
STALLED_HOLDER: Final = textwrap.dedent(
    """
    import asyncio, sys, time
    import redis.asyncio
    import aiosem

    async def main(url, name, lease):
        client = redis.asyncio.Redis.from_url(url)
        sem = aiosem.AsyncLockedSemaphore(client, name, 1, timeout=float(lease))
        try:
            async with sem:
                print("holding", flush=True)
                sys.stdin.readline()  # the loop is blocked from here on...
                time.sleep(2 * float(lease))  # ...for two leases more
                await asyncio.sleep(60)  # the first await: the loss cancels it
        except aiosem.PermitLost:
            print("lost", flush=True)
        await client.aclose()  # as the README does

    asyncio.run(main(*sys.argv[1:]))
    """
)

#: A process that makes one step when told, and waits (it is killed meanwhile).
STEPPER: Final = textwrap.dedent(
    """
    import asyncio, sys
    import redis.asyncio
    import aiosem

    async def main(url, name, lease):
        client = redis.asyncio.Redis.from_url(url)
        sem = aiosem.AsyncLockedSemaphore(client, name, 1, timeout=float(lease))
        await sem.count()  # its connection stays open in the pool
        print("ready", flush=True)
        sys.stdin.readline()
        await sem.count()

    asyncio.run(main(*sys.argv[1:]))
    """
)


@contextlib.asynccontextmanager
async def python(script: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A Python process running ``script``, stdin and stdout piped; killed by its PID if still running at the end."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, *args,
        cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def line_of(process: asyncio.subprocess.Process) -> str:
    """The next line ``process`` prints (bounded)."""
    assert process.stdout is not None
    with anyio.fail_after(BOUND):
        return (await process.stdout.readline()).decode().strip()


def tell(process: asyncio.subprocess.Process) -> None:
    """Send ``process`` the line it waits for."""
    assert process.stdin is not None
    process.stdin.write(b"go\n")


@contextlib.asynccontextmanager
async def late_partition(proxy: TcpProxy) -> AsyncIterator[None]:
    """Cut off every connection through ``proxy``, those opened meanwhile too; deliver what they sent at the end.

    That is what a partition does to TCP: nothing passes while it lasts, and
    once it heals what was sent is retransmitted, requests of steps given up
    long ago included. (`TcpProxy.partition` discards them instead.) A
    connection opened meanwhile is held as it opens, before it forwards a byte.
    """

    def hold_everything() -> bool:
        proxy.hold_requests()
        proxy.hold_replies()
        return False  # never done: applied again at every change in the proxy

    hold_everything()
    holder = asyncio.get_running_loop().create_task(proxy.wait_until(hold_everything))
    try:
        yield
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        proxy.release_requests()
        proxy.release_replies()


class Holders:
    """Tasks that each hold one semaphore object in ``async with`` until released, and what each saw.

    `tokens` holds each one's fencing token once its body began, and `lost`
    when its ``async with`` raised `PermitLost`.
    """

    def __init__(self, semaphores: Sequence[Semaphore]) -> None:
        self.semaphores = semaphores
        self.tokens: dict[int, int] = {}
        self.lost: dict[int, float] = {}
        self.entered = [anyio.Event() for _ in semaphores]
        self.released = [anyio.Event() for _ in semaphores]

    @property
    def granted(self) -> list[int]:
        """The indices of the holders granted so far, in the order Redis granted them (by fencing token)."""
        return sorted(self.tokens, key=self.tokens.__getitem__)

    async def hold(self, index: int) -> None:
        try:
            async with self.semaphores[index] as permit:
                self.tokens[index] = permit.fencing_token
                self.entered[index].set()
                await self.released[index].wait()
        except PermitLost:
            self.lost[index] = anyio.current_time()

    def release_all(self) -> None:
        for event in self.released:
            event.set()


async def queue_of(admin: redis.asyncio.Redis, sem: Semaphore) -> list[tuple[bytes, float]]:
    """The semaphore's queue in Redis: each waiter with its ticket, in order."""
    return cast("list[tuple[bytes, float]]", await admin.zrange(f"{sem.key}:queue", 0, -1, withscores=True))


async def lock_stays(admin: redis.asyncio.Redis, lock: str, within: float) -> float:
    """How long ``lock`` stays once it appears within ``within`` seconds (0 if it does not); a bounded poll of Redis."""
    with anyio.move_on_after(within):
        while not await admin.exists(lock):  # noqa: ASYNC110 -- a bounded poll of Redis's own state
            await anyio.sleep(0.002)
    if not await admin.exists(lock):
        return 0.0
    appeared = anyio.current_time()
    with anyio.fail_after(BOUND):
        while await admin.exists(lock):  # noqa: ASYNC110 -- a bounded poll of Redis's own state
            await anyio.sleep(0.002)
    return anyio.current_time() - appeared


# --- another process's stall, crash or partition -------------------------------------------------


@pytest.mark.slow
async def test_a_holder_whose_loop_was_blocked_past_its_lease_costs_the_next_holder_nothing_when_it_wakes(
    redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    name = "stalled-holder"
    client = redis_server.client()
    sem = AsyncLockedSemaphore(client, name, 1, timeout=LEASE, refresh_interval=REFRESH)
    lock = f"lock:{sem.key}"
    holders = Holders([sem])
    lock_ms_at_exit = -2
    try:
        with anyio.fail_after(SCENARIO):
            async with (
                python(STALLED_HOLDER, redis_server.url, name, str(LEASE)) as stalled,
                anyio.create_task_group() as tasks,
            ):
                assert await line_of(stalled) == "holding"
                tasks.start_soon(holders.hold, 0)
                await until_queued(sem, 1)
                tell(stalled)  # its loop blocks for two leases: the permit goes on to the waiter meanwhile
                await holders.entered[0].wait()
                assert await line_of(stalled) == "lost"
                await stalled.wait()
                exited = anyio.current_time()
                lock_ms_at_exit = await admin_client.pttl(lock)
                await anyio.sleep(WATCHED)  # the fault is over: the next holder is watched this long
                holders.release_all()
    finally:
        await sem.aclose()
        await client.aclose()
    lost_after = {index: at - exited for index, at in holders.lost.items()}
    report(
        f"AsyncLockedSemaphore: a holder's loop blocked {2 * LEASE:g} s (lease {LEASE:g} s), then it exits",
        caller_saw=f"the next holder (refreshing every {REFRESH:g} s): "
        + (f"PermitLost {lost_after[0]:.2f} s after the stalled process exited" if lost_after else "kept its permit")
        + f"; step lock's PTTL as it exited: {lock_ms_at_exit} ms",
        recovered_in=None,
        over_limit="none",
    )
    assert stalled.returncode == 0
    assert not lost_after, f"the next holder lost its permit {lost_after[0]:.2f} s after the stalled process exited"


@pytest.mark.slow
async def test_a_process_killed_holding_the_step_lock_costs_no_holder_its_permit_and_no_waiter_its_place(
    proxy: TcpProxy, redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    name = "killed-mid-step"
    options = {"timeout": LEASE, "refresh_interval": REFRESH}
    async with processes(redis_server.client, AsyncLockedSemaphore, name, 1, 1 + WAITERS, **options) as semaphores:
        holders = Holders(semaphores)  # the first holds, the others queue in order behind it
        lock = f"lock:{semaphores[0].key}"
        with anyio.fail_after(SCENARIO):
            async with python(STEPPER, proxied_url(proxy, redis_server), name, str(LEASE)) as killed:
                assert await line_of(killed) == "ready"
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(holders.hold, 0)
                    await holders.entered[0].wait()
                    for waiter in range(1, 1 + WAITERS):
                        tasks.start_soon(holders.hold, waiter)
                        await until_queued(semaphores[0], waiter)
                    queued = await queue_of(admin_client, semaphores[0])

                    # Its next step's first batch reaches Redis -- the lock is taken -- and its replies
                    # are held: killed now, it dies holding the lock.
                    proxy.hold_replies(after=b"WATCH")
                    tell(killed)
                    await proxy.wait_until(lambda: proxy.held_replies > 0)
                    killed.send_signal(signal.SIGKILL)
                    await killed.wait()
                    lock_ms_at_kill = await admin_client.pttl(lock)
                    await anyio.sleep(WATCHED)  # the others are watched this long
                    queued_after = await queue_of(admin_client, semaphores[0])

                    # Then the holder leaves, and each waiter as soon as it gets the permit.
                    holders.release_all()
    report(
        f"AsyncLockedSemaphore: a process SIGKILLed holding the step lock (lease {LEASE:g} s)",
        caller_saw=f"step lock's PTTL at the kill: {lock_ms_at_kill} ms; holder (refreshing every {REFRESH:g} s): "
        + ("kept its permit" if 0 not in holders.lost else "PermitLost")
        + f"; waiters kept their places: {queued_after == queued}; served in order {holders.granted}",
        recovered_in=None,
        over_limit="none",
    )
    assert not holders.lost, f"lost their permits: {holders.lost}"
    assert queued_after == queued
    assert holders.granted == list(range(1 + WAITERS))


#: How long the partitioned process stays cut off: three leases.
PARTITION: Final = 3 * LEASE


@pytest.mark.slow
async def test_a_partitioned_holder_costs_no_one_their_permit_or_their_place_when_the_network_heals(
    proxy: TcpProxy,
    redis_server: RedisServer,
    admin_client: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aiosem")
    name = "partitioned-holder"
    cut_off_client = proxied_client(proxy, redis_server)
    cut_off = AsyncLockedSemaphore(cut_off_client, name, 2, timeout=LEASE)
    lock = f"lock:{cut_off.key}"
    options = {"timeout": LEASE, "refresh_interval": REFRESH}
    try:
        async with processes(redis_server.client, AsyncLockedSemaphore, name, 2, 1 + WAITERS, **options) as others:
            # 0: the partitioned holder; 1: a healthy holder; 2, 3, 4: waiters, in that order.
            holders = Holders([cut_off, *others])
            with anyio.fail_after(SCENARIO):
                async with anyio.create_task_group() as tasks:
                    for index in (0, 1):
                        tasks.start_soon(holders.hold, index)
                        await holders.entered[index].wait()
                    for waiter in range(WAITERS):
                        tasks.start_soon(holders.hold, 2 + waiter)
                        await until_queued(others[0], waiter + 1)
                    queued = await queue_of(admin_client, cut_off)

                    async with late_partition(proxy):
                        await anyio.sleep(PARTITION)  # the fault: cut off this long
                        # Meanwhile, its lease ran out: the first waiter has its permit.
                        assert 0 in holders.lost
                        assert holders.granted[2:] == [2]
                    healed = anyio.current_time()
                    stayed = 0.0

                    async def measure_the_lock() -> None:
                        nonlocal stayed
                        stayed = await lock_stays(admin_client, lock, within=0.5)

                    async with anyio.create_task_group() as watching:
                        watching.start_soon(measure_the_lock)
                        await anyio.sleep(WATCHED)  # the others are watched this long
                    queued_after = await queue_of(admin_client, cut_off)

                    # Then everyone leaves, each waiter as soon as it gets a permit.
                    holders.release_all()
    finally:
        await cut_off.aclose()
        await cut_off_client.aclose()
    lost_after_heal = {index: round(at - healed, 2) for index, at in holders.lost.items() if index != 0}
    gave_up = [r.getMessage() for r in caplog.records if "lock" in r.getMessage() and "free" in r.getMessage()]
    report(
        f"AsyncLockedSemaphore: a holder partitioned {PARTITION:g} s (lease {LEASE:g} s), its requests delivered late",
        caller_saw=f"the late step lock stayed {stayed:.3f} s after the heal; "
        f"PermitLost after the heal: {lost_after_heal or 'none'}; waiters kept their places: "
        f"{queued_after == queued[1:]}; served in order {holders.granted}; unlock warnings: {len(gave_up)}",
        recovered_in=None,
        over_limit="none",
    )
    assert not lost_after_heal, f"lost their permits after the heal (s): {lost_after_heal}"
    assert queued_after == queued[1:]  # the first waiter took the partitioned holder's permit
    assert holders.granted == [0, 1, 2, 3, 4]


@pytest.mark.slow
async def test_a_waiters_ticket_draw_that_gets_no_answer_raises_within_its_bound_and_spoils_nothing(
    proxy: TcpProxy, redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    # No socket timeout: nothing but aiosem's own bound ends the draw.
    client = proxied_client(proxy, redis_server, socket_timeout=None)
    sem = AsyncLockedSemaphore(client, "undrawn", 1, timeout=LEASE)
    keys = sem._core.keys
    try:
        warm = await sem.acquire(blocking=False)  # the connections are open
        assert warm is not None
        assert await sem.release(warm)
        proxy.hold_replies()
        started = anyio.current_time()
        waiting = asyncio.ensure_future(sem.acquire(blocking_timeout=BOUND))
        with anyio.fail_after(step_bound(LEASE) + BOUND):
            await proxy.wait_until(lambda: proxy.held_replies > 0)  # the draw went out
            while len(sem._core.queue):  # noqa: ASYNC110 -- until its bound ends the wait, and the give-up begins
                await anyio.sleep(0.01)
        took = anyio.current_time() - started
        # The draw ends: the give-up, which waited for it, takes the waiter out of :arriving again.
        proxy.release_replies()
        with anyio.fail_after(BOUND), pytest.raises(redis.TimeoutError) as overdue:
            await waiting
        arriving = await admin_client.zcard(keys.arriving)
        with anyio.fail_after(BOUND):
            permit = await sem.acquire(blocking_timeout=BOUND)
        assert permit is not None
        assert await sem.release(permit)
    finally:
        proxy.release_replies()
        await sem.aclose()
        await client.aclose(close_connection_pool=True)
    report(
        "AsyncLockedSemaphore: a waiter's ticket draw whose replies are held",
        caller_saw=f"{type(overdue.value).__name__} after {took:.2f} s: {overdue.value}",
        recovered_in=None,
        over_limit="none",
    )
    assert str(overdue.value) == (
        f"drawing a ticket of semaphore 'undrawn' got no answer within {step_bound(LEASE):g} s; given up"
    )
    assert step_bound(LEASE) <= took <= step_bound(LEASE) + BOUND / 4
    assert arriving == 0  # left there, it would stop every relay until a step found it stale


@pytest.mark.slow
async def test_a_ticket_draw_stalled_for_good_holds_up_no_later_acquire(
    proxy: TcpProxy, redis_server: RedisServer
) -> None:
    # No socket timeout, and a connection that never answers again: the
    # draws' lane used to wait on it for ever, and every later acquire of
    # the object timed out behind it, long after the network healed.
    client = proxied_client(proxy, redis_server, socket_timeout=None)
    sem = AsyncLockedSemaphore(client, "stalled-draw", 1, timeout=LEASE)
    try:
        warm = await sem.acquire(blocking=False)  # the connections are open
        assert warm is not None
        assert await sem.release(warm)
        proxy.partition()
        started = anyio.current_time()
        with anyio.fail_after(step_bound(LEASE) + BOUND), pytest.raises(redis.TimeoutError):
            await sem.acquire(blocking_timeout=BOUND)
        took = anyio.current_time() - started
        proxy.heal()
        healed = anyio.current_time()
        with anyio.fail_after(BOUND):
            permit = await sem.acquire(blocking_timeout=BOUND)
        recovered = anyio.current_time() - healed
        assert permit is not None
        assert await sem.release(permit)
    finally:
        proxy.heal()
        await sem.aclose()
        await client.aclose(close_connection_pool=True)
    report(
        "AsyncLockedSemaphore: a waiter's ticket draw on a connection stalled for good",
        caller_saw=f"TimeoutError after {took:.2f} s",
        recovered_in=recovered,
        over_limit="none",
    )
    # The draw's bound, then the give-up's, which cannot reach Redis either.
    assert took <= step_bound(LEASE) + CLEANUP_TIMEOUT + BOUND / 4


# --- what waiting for a busy lock costs ----------------------------------------------------------

#: How long the lock is held by hand while a step waits for it.
HELD: Final = 0.5


async def test_a_step_waits_for_a_busy_lock_cheaply_and_goes_on_once_it_is_freed(
    fresh_redis_server: RedisServer,
) -> None:
    server = fresh_redis_server
    admin = server.admin_client()
    client = server.client()
    sem = AsyncLockedSemaphore(client, "busy", 1, timeout=LEASE)
    lock = f"lock:{sem.key}"
    try:
        await sem.count()  # a connection of its own, open
        await admin.config_resetstat()
        await admin.set(lock, "held by hand", px=round(10 * LEASE * 1000))
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(sem.count)
                await anyio.sleep(HELD)  # the lock is held this long
                stats = await admin.info("commandstats")
                await admin.delete(lock)
                freed = anyio.current_time()
            took = anyio.current_time() - freed
    finally:
        await sem.aclose()
        await client.aclose()
        await admin.aclose()
    calls = {key.removeprefix("cmdstat_"): int(value["calls"]) for key, value in stats.items()}
    calls["set"] -= 1  # the lock set by hand
    calls.pop("config|resetstat", None)
    sent = sum(calls.values())
    tries = calls["set"]
    report(
        f"AsyncLockedSemaphore: a step waiting {HELD:g} s for a lock held by hand",
        caller_saw=f"{tries / HELD:.0f} tries/s, {sent / HELD:.0f} commands/s ({calls}); "
        f"went on {took * 1000:.1f} ms after the lock was freed",
        recovered_in=took,
        over_limit="none",
    )
    assert sent / HELD <= MOST_COMMANDS_PER_SECOND, calls
    assert took <= PROMPTLY


#: The most commands a second a step waiting for a busy lock may send.
MOST_COMMANDS_PER_SECOND: Final = 500
#: How soon a step waiting for a lock goes on once it is freed: its back-off (at most 5 ms) and a step.
PROMPTLY: Final = 0.1


# --- the lock's life ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "lifetime_ms"),
    [
        ({"timeout": LEASE}, 250),  # a quarter of the lease (the waiter timeout is the lease)
        ({}, 500),  # a quarter of the default waiter timeout, 2 s
        ({"timeout": 60.0, "waiter_timeout": 30.0}, 1000),  # the default lock_timeout
        ({"timeout": 60.0, "waiter_timeout": 30.0, "lock_timeout": 0.3}, 300),
    ],
    ids=["lease", "waiter-timeout", "lock-timeout-default", "lock-timeout"],
)
async def test_the_step_lock_lives_a_quarter_of_the_shorter_of_lease_and_waiter_timeout_at_most_lock_timeout(
    options: dict[str, Any],
    lifetime_ms: int,
    proxy: TcpProxy,
    redis_server: RedisServer,
    admin_client: redis.asyncio.Redis,
) -> None:
    client = proxied_client(proxy, redis_server)
    sem = AsyncLockedSemaphore(client, f"lifetime-{lifetime_ms}", 1, **options)
    try:
        await sem.count()  # its connection is open: the replies on it can be held
        proxy.hold_replies(after=b"WATCH")
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(sem.count)
                await proxy.wait_until(lambda: proxy.held_replies > 0)  # the lock is taken
                ttl = await admin_client.pttl(f"lock:{sem.key}")
                proxy.release_replies()
    finally:
        await sem.aclose()
        await client.aclose()
    assert lifetime_ms - 100 < ttl <= lifetime_ms


async def interrupted_holding_the_lock(proxy: TcpProxy, sem: AsyncLockedSemaphore, *, cut_off: bool = False) -> None:
    """Run a step of ``sem`` until it holds the lock, then cut its connection: the step fails, its unlock goes on.

    With ``cut_off``, the network is partitioned first: the unlock, on a new
    connection, gets no answer.

    (A caller's cancellation no longer interrupts a step, which runs to its
    end in its lane's task: a failure, or the step's bound, does.)
    """
    await sem.count()  # its connection is open: the replies on it can be held
    proxy.hold_replies(after=b"WATCH")
    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tasks:

            async def step() -> None:
                with pytest.raises(redis.ConnectionError):
                    await sem.count()

            tasks.start_soon(step)
            await proxy.wait_until(lambda: proxy.held_replies > 0)  # the lock is taken
            if cut_off:
                proxy.partition()
            proxy.drop()


async def test_aclose_waits_for_the_unlock_of_an_interrupted_step(
    proxy: TcpProxy, redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    client = proxied_client(proxy, redis_server)
    # A long lease: the lock outlives the whole test unless it is freed.
    sem = AsyncLockedSemaphore(client, "interrupted", 1, timeout=60.0, waiter_timeout=30.0, lock_timeout=5.0)
    lock = f"lock:{sem.key}"
    try:
        proxy.delay(0.02)  # every round trip through the proxy, the unlock's too, takes a while
        await interrupted_holding_the_lock(proxy, sem)
        assert await admin_client.exists(lock)
        await sem.aclose()
        left = await admin_client.exists(lock)
    finally:
        await sem.aclose()
        await client.aclose()
    assert not left


async def test_an_unlock_that_gives_up_says_so(
    proxy: TcpProxy, redis_server: RedisServer, admin_client: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    client = proxied_client(proxy, redis_server)
    sem = AsyncLockedSemaphore(client, "unlock-gives-up", 1, timeout=LEASE)
    lock = f"lock:{sem.key}"
    try:
        with caplog.at_level(logging.WARNING, logger="aiosem"):
            await interrupted_holding_the_lock(proxy, sem, cut_off=True)
            with anyio.fail_after(BOUND):
                while not [r for r in caplog.records if "could not free the step lock" in r.getMessage()]:  # noqa: ASYNC110 -- logging has no event to wait on
                    await anyio.sleep(0.01)
        assert not await admin_client.exists(lock)  # it expired by itself, as the warning says, within its lifetime
    finally:
        proxy.heal()
        await sem.aclose()
        await client.aclose()


async def test_a_step_whose_bound_has_passed_sends_nothing(fresh_redis_server: RedisServer) -> None:
    server = fresh_redis_server
    admin = server.admin_client()
    client = server.client()
    sem = AsyncLockedSemaphore(client, "too-late", 1, timeout=LEASE)
    try:
        await sem.count()  # a connection of its own, open: nothing left to wait for before a step sends
        await admin.config_resetstat()
        with anyio.CancelScope(deadline=anyio.current_time() - 1):  # a loop that woke from a long block
            await sem.count()
        stats = await admin.info("commandstats")
    finally:
        await sem.aclose()
        await client.aclose()
        await admin.aclose()
    assert "cmdstat_set" not in stats  # the lock was never taken
