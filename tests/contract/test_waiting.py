"""Blocked acquirers wait in a queue in Redis and get freed permits handed over at once."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, Permit, PermitLost, SemaphoreStatistics, recipes
from aiosem._coordination import subscriber_of
from aiosem._protocol import Step
from aiosem._scripts import FAIR_ACQUIRE, FAIR_REFRESH
from aiosem._waiting import Waiter
from tests.harness.faults import proxied_client
from tests.harness.support import record_steps, until_idle, until_one_time_checks_done, until_subscribed

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine

    from tests.harness.proxy import TcpProxy
    from tests.harness.support import FakeClock, RedisServer

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: The most any wait in these tests may take before the test fails.
BOUND = 10.0


@pytest.fixture
def make(cls: SemaphoreClass, client: redis.asyncio.Redis) -> Callable[..., Semaphore]:
    """Semaphore objects on one name: each object stands for a process of its own."""

    def make(limit: int = 1, **options: object) -> Semaphore:
        return cls(client, "queue", limit, **options)  # type: ignore[arg-type]

    return make


async def wait_until_queued(sem: Semaphore, count: int) -> None:
    with anyio.fail_after(BOUND):
        while await sem.waiting() < count:  # noqa: ASYNC110 -- the state is in Redis: no event to wait on
            await anyio.sleep(0.002)


async def test_a_release_hands_the_permit_to_the_waiter(make: Callable[..., Semaphore]) -> None:
    holder_side, waiter_side = make(), make()
    held = await holder_side.acquire()
    assert held is not None
    got: list[Permit | None] = []

    async def wait() -> None:
        got.append(await waiter_side.acquire())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await wait_until_queued(holder_side, 1)
        assert await holder_side.release(held)
        # Handed over in the release's own step: nobody can slip in between.
        assert await holder_side.acquire(blocking=False) is None
    assert got[0] is not None
    assert got[0].fencing_token > held.fencing_token
    assert await holder_side.count() == 1
    assert await holder_side.waiting() == 0


class RecordingConnection(redis.asyncio.Connection):
    """Notes each write to the socket in `events` (redis-py's write path: it overrides ``send_packed_command``)."""

    events: list[str] = []  # noqa: RUF012 -- set by the test that uses it

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).events.append("written")
        await super().send_packed_command(command, check_health)


async def test_a_waiter_handed_its_permit_by_message_resumes_before_its_claim_is_written(
    cls: SemaphoreClass, redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    # The permit is the waiter's from the message on; the claim that restarts
    # its lease follows in the background, and its step -- a connection, a
    # write -- must not run ahead of the return of a task that awaits the
    # acquire in a task of its own. (The release is awaited in a task of its
    # own too: the locked class's takes more round trips after its grant is
    # published, and the waiter may be back, and its claim written, before
    # the release returns. Only the waiter's writes are recorded: a
    # heartbeat every 10 s, none in between. Nor the re-check an object
    # makes once subscribed, nor the one-time check of the eviction policy:
    # with redis-py 5.3 a new connection's handshake is three round trips,
    # and could span the release.)
    await admin_client.flushdb()
    events: list[str] = []
    RecordingConnection.events = events
    options = redis_server.client().connection_pool.connection_kwargs
    waiter_client = redis.asyncio.Redis.from_pool(
        redis.asyncio.ConnectionPool(connection_class=RecordingConnection, **options)
    )
    holder_side = cls(admin_client, "resumes-first", 1, timeout=30, waiter_timeout=30)
    waiter_side = cls(waiter_client, "resumes-first", 1, timeout=30, waiter_timeout=30)

    async def await_the_acquire(acquiring: asyncio.Task[Permit | None]) -> Permit | None:
        permit = await acquiring
        events.append("resumed")
        return permit

    try:
        held = await holder_side.acquire()
        assert held is not None
        with anyio.fail_after(BOUND):
            acquiring = asyncio.create_task(waiter_side.acquire())
            await wait_until_queued(holder_side, 1)
            await until_subscribed(waiter_side)
            await until_one_time_checks_done()
            await until_idle(waiter_side)
            resuming = asyncio.create_task(await_the_acquire(acquiring))
            events.append("releasing")
            assert await holder_side.release(held)
            permit = await resuming
            while "written" not in events[events.index("resumed") :]:  # noqa: ASYNC110 -- the claim, on its way
                await asyncio.sleep(0.002)
        assert events[events.index("releasing") + 1] == "resumed", events
        assert permit is not None
        assert await waiter_side.release(permit)
    finally:
        await waiter_side.aclose()
        await holder_side.aclose()
        await waiter_client.aclose()


async def test_a_waiter_handed_its_permit_by_message_returns_before_its_reader_reads_on(
    cls: SemaphoreClass,
    redis_server: RedisServer,
    admin_client: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The reader that heard the grant sets up its next read -- redis-py's
    # `get_message` -- only once the waiters the grant woke have run: a
    # hand-off's latency does not include it.
    await admin_client.flushdb()
    waiter_client = redis_server.client()
    events: list[str] = []
    # Made before the first waiter subscribes, so that every read the reader starts goes through the spy.
    pubsub = subscriber_of(waiter_client)._pubsub  # type: ignore[union-attr]  # one server: a Subscriber
    read = pubsub.get_message

    async def get_message(*args: Any, **kwargs: Any) -> Any:
        events.append("read")
        message = await read(*args, **kwargs)
        if message is not None and message["type"] == "message":
            events.append("heard")
        return message

    monkeypatch.setattr(pubsub, "get_message", get_message)
    holder_side = cls(admin_client, "returns-first", 1, timeout=30, waiter_timeout=30)
    waiter_side = cls(waiter_client, "returns-first", 1, timeout=30, waiter_timeout=30)

    async def acquire() -> Permit | None:
        permit = await waiter_side.acquire()
        events.append("returned")  # in the acquire's own task, with nothing awaited in between
        return permit

    try:
        held = await holder_side.acquire()
        assert held is not None
        with anyio.fail_after(BOUND):
            acquiring = asyncio.create_task(acquire())
            await wait_until_queued(holder_side, 1)
            await until_subscribed(waiter_side)
            assert await holder_side.release(held)
            permit = await acquiring
            while "read" not in events[events.index("heard") :]:  # noqa: ASYNC110 -- the reader reads on
                await asyncio.sleep(0.002)
        after = events[events.index("heard") + 1 :]
        assert after.index("returned") < after.index("read"), events
        assert permit is not None
        assert await waiter_side.release(permit)
    finally:
        await waiter_side.aclose()
        await holder_side.aclose()
        await waiter_client.aclose()


async def test_waiters_are_served_in_arrival_order_across_processes(make: Callable[..., Semaphore]) -> None:
    sides = [make(), make()]
    held = await sides[0].acquire()
    assert held is not None
    served: list[int] = []

    async def wait(number: int) -> None:
        permit = await sides[number % 2].acquire()
        assert permit is not None
        served.append(number)
        await sides[number % 2].release(permit)

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tasks:
            for number in range(10):
                tasks.start_soon(wait, number)
                await wait_until_queued(sides[0], number + 1)
            await sides[0].release(held)
    assert served == list(range(10))


async def test_a_non_blocking_acquire_never_jumps_the_queue(
    cls: SemaphoreClass, client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    holder_side = cls(client, "queue", 1, timeout=10, clock=clock, waiter_timeout=10)
    waiter_side = cls(client, "queue", 1, timeout=10, clock=clock, waiter_timeout=10)
    newcomer = cls(client, "queue", 1, timeout=10, clock=clock, waiter_timeout=10)
    assert await holder_side.acquire() is not None
    got: list[Permit | None] = []

    async def wait() -> None:
        got.append(await waiter_side.acquire())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await wait_until_queued(holder_side, 1)
        with anyio.fail_after(BOUND):
            while not waiter_side._core.queue.queued():  # the waiter's task may not have read its reply yet
                await anyio.lowlevel.checkpoint()
        clock.advance(6)
        await waiter_side._core.submit(Step.REFRESH, waiter_side._core.queue.queued())  # its heartbeat, on this clock
        clock.advance(5)  # the holder's lease ran out: no event tells anyone
        assert await newcomer.acquire(blocking=False) is None
    assert got[0] is not None


async def test_a_lease_running_out_wakes_the_waiter(cls: SemaphoreClass, redis_server: RedisServer) -> None:
    client = redis_server.client()
    crashed = cls(client, f"expiry-{cls.__name__}", 1, timeout=1.0)
    waiter_side = cls(client, f"expiry-{cls.__name__}", 1, timeout=1.0)
    assert await crashed.acquire() is not None  # never released
    started = anyio.current_time()
    with anyio.fail_after(BOUND):
        permit = await waiter_side.acquire()
    assert permit is not None
    assert 0.9 <= anyio.current_time() - started < 1.0 + 1.0
    await waiter_side.release(permit)
    await client.aclose()


async def test_queued_waiters_give_up_each_at_their_own_deadline_whatever_their_bounds(
    make: Callable[..., Semaphore],
) -> None:
    sem = make(limit=1)
    held = await sem.acquire()
    assert held is not None
    started = anyio.current_time()
    ended: dict[str, float] = {}

    async def wait(label: str, blocking_timeout: float | None) -> Permit | None:
        try:
            return await sem.acquire(blocking_timeout=blocking_timeout)
        finally:
            ended[label] = anyio.current_time() - started

    # Queued in this order: the short bound comes due first, behind a long one.
    long_first = asyncio.create_task(wait("long first", 1.0))
    short = asyncio.create_task(wait("short", 0.3))
    long_then = asyncio.create_task(wait("long then", 1.0))
    unbounded = asyncio.create_task(wait("unbounded", None))
    with anyio.fail_after(BOUND):
        assert await short is None
        assert not long_first.done()
        assert await long_first is None
        assert await long_then is None
    assert 0.3 <= ended["short"] < 1.0
    assert 1.0 <= ended["long first"] < 1.0 + 1.0
    assert 1.0 <= ended["long then"] < 1.0 + 1.0
    assert not unbounded.done()
    assert await sem.waiting() == 1
    assert await sem.release(held)
    with anyio.fail_after(BOUND):
        permit = await unbounded
    assert permit is not None
    assert await sem.release(permit)


async def test_a_queued_waiter_is_re_checked_when_the_earliest_lease_ends(make: Callable[..., Semaphore]) -> None:
    # No event says that a lease ran out: the waiter's process looks then.
    holder_side, waiter_side = make(timeout=10), make(timeout=10)
    assert await holder_side.acquire() is not None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waiter_side.acquire)
        await wait_until_queued(holder_side, 1)
        # Redis may say "queued" before the waiter's task has read its reply; and
        # the subscription, once confirmed, has the waiter re-checked at once first.
        with anyio.fail_after(BOUND):
            while (recheck_at := waiter_side._core.queue.recheck_at) is None or recheck_at - anyio.current_time() < 1:
                await anyio.lowlevel.checkpoint()
        assert 9 < recheck_at - anyio.current_time() <= 10.01
        tasks.cancel_scope.cancel()


async def queued_and_quiet(
    holder_side: Semaphore, waiter_side: Semaphore, acquire: Callable[[], Coroutine[Any, Any, object]]
) -> asyncio.Task[object]:
    """Run ``acquire`` in a task of its own, and return it once queued, subscribed, and with no step in flight."""
    assert await holder_side.acquire() is not None
    waiting = asyncio.create_task(acquire())
    await wait_until_queued(holder_side, 1)
    with anyio.fail_after(BOUND):
        while not waiter_side._core.queue.queued():  # the waiter's task may not have read its reply yet
            await anyio.lowlevel.checkpoint()
    await until_subscribed(waiter_side)
    await until_idle(waiter_side)
    return waiting


async def test_a_heartbeat_due_as_the_last_waiter_gives_up_sends_nothing(
    make: Callable[..., Semaphore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loop that stalls lets the waiter's deadline and the heartbeat come due
    # together: the heartbeat, run after the waiter has left, finds nobody.
    holder_side, waiter_side = make(timeout=60), make(waiter_timeout=0.6)  # a heartbeat every 0.2 s
    deadline = anyio.CancelScope()

    async def acquire() -> None:
        with deadline:
            await waiter_side.acquire()

    waiting = await queued_and_quiet(holder_side, waiter_side, acquire)
    sent = record_steps(type(waiter_side), monkeypatch)
    deadline.deadline = anyio.current_time()  # comes first: the waiter's task runs before the pump's
    time.sleep(0.3)  # noqa: ASYNC251 -- the stall: the next heartbeat comes due during it
    await waiting
    await until_idle(waiter_side)
    # A heartbeat due before the deadline (on a busy machine, during the
    # set-up) went out while the waiter was queued: none may come after.
    assert sent[-1] == Step.CANCEL
    assert sent.count(Step.CANCEL) == 1


async def test_a_re_check_asked_for_as_the_last_waiter_gives_up_sends_nothing_and_is_not_kept(
    make: Callable[..., Semaphore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A subscription confirmed late asks for a re-check just as the last
    # waiter gives up: nobody is left for it, and the next waiter must not
    # inherit it as a re-check already due. No heartbeat or refresh comes due
    # during the test: any other step would be the re-check's.
    holder_side, waiter_side = make(timeout=60), make(timeout=60, waiter_timeout=60)
    waiting = await queued_and_quiet(holder_side, waiter_side, waiter_side.acquire)
    sent = record_steps(type(waiter_side), monkeypatch)
    waiting.cancel()  # its task runs first, and leaves the queue before the pump wakes
    waiter_side._core.queue.recheck_now()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await until_idle(waiter_side)
    assert sent == [Step.CANCEL]
    assert waiter_side._core.queue.recheck_at is None


async def test_a_dead_waiter_holds_the_line_for_no_longer_than_its_waiter_timeout(
    cls: SemaphoreClass, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    name = f"dead-{cls.__name__}"
    holder_side = cls(client, name, 1, timeout=10, waiter_timeout=0.5)
    dead_side = cls(client, name, 1, timeout=10, waiter_timeout=0.5)
    live_side = cls(client, name, 1, timeout=10, waiter_timeout=0.5)
    held = await holder_side.acquire()
    assert held is not None
    # A waiter whose process is gone: queued by hand, never proving it is alive.
    dead = dead_side._process + ".deadbeefdeadbeef"
    await dead_side._core.submit(Step.WAIT, (dead,))
    got: list[Permit | None] = []

    async def wait() -> None:
        got.append(await live_side.acquire())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await wait_until_queued(holder_side, 2)
        released_at = anyio.current_time()
        await holder_side.release(held)  # handed to the dead waiter first
        with anyio.fail_after(BOUND):
            while not got:  # noqa: ASYNC110 -- the waiter's own task appends it
                await anyio.sleep(0.01)
    assert got[0] is not None
    assert anyio.current_time() - released_at < 0.5 + 0.5
    await client.aclose()


async def test_a_dead_waiter_leaves_the_queue_after_its_waiter_timeout(make: Callable[..., Semaphore]) -> None:
    sem = make(waiter_timeout=0.2)
    assert await sem.acquire() is not None
    await sem._core.submit(Step.WAIT, ("0123456789abcdef.0123456789abcdef",))
    assert await sem.waiting() == 1
    await anyio.sleep(0.3)
    assert await sem.waiting() == 0


async def test_waiters_wake_without_pub_sub(cls: SemaphoreClass, fresh_redis_server: RedisServer) -> None:
    # A user who may not subscribe (no channels in its ACL) still gets permits,
    # from the re-check that runs when the holder's lease ends.
    admin = fresh_redis_server.admin_client()
    await admin.acl_setuser("nochannels", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
    client = fresh_redis_server.client(username="nochannels", password="pw")
    holder_side = cls(client, "quiet", 1, timeout=0.5)
    waiter_side = cls(client, "quiet", 1, timeout=0.5)
    assert await holder_side.acquire() is not None
    with anyio.fail_after(BOUND):
        assert await waiter_side.acquire() is not None
    await client.aclose()
    await admin.aclose()


async def test_fair_and_locked_waiters_share_one_queue(client: redis.asyncio.Redis) -> None:
    fair = AsyncFairSemaphore(client, "mixed", 1)
    locked = AsyncLockedSemaphore(client, "mixed", 1)
    held = await fair.acquire()
    assert held is not None
    got: list[Permit | None] = []

    async def wait() -> None:
        got.append(await locked.acquire())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await wait_until_queued(fair, 1)
        await fair.release(held)
    assert got[0] is not None


async def test_a_recipe_release_hands_over_to_a_waiter(
    make: Callable[..., Semaphore], client: redis.asyncio.Redis
) -> None:
    sem = make()
    identifier = await recipes.acquire_fair_semaphore(client, sem.key, 1)
    assert identifier is not None
    got: list[Permit | None] = []

    async def wait() -> None:
        got.append(await sem.acquire())

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        await wait_until_queued(sem, 1)
        assert await recipes.release_fair_semaphore(client, sem.key, identifier)
    assert got[0] is not None


async def test_holders_lists_identifiers_with_their_remaining_lease(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=2, timeout=30)
    first, second = await sem.acquire(), await sem.acquire()
    assert first is not None
    assert second is not None
    holders = await sem.holders()
    assert set(holders) == {first.identifier, second.identifier}
    assert all(25 < remaining <= 30 for remaining in holders.values())


async def test_hundreds_of_looks_at_the_holders_at_once_answer_on_a_default_client(
    cls: SemaphoreClass, default_client: redis.asyncio.Redis
) -> None:
    # Each used to take a connection of its own: past the 100 of redis-py
    # 8's default pool, they raised "Too many connections".
    sem = cls(default_client, "looked-at", 2)
    permit = await sem.acquire()
    assert permit is not None
    looks = await asyncio.gather(*(sem.holders() for _ in range(300)))
    assert all(set(look) == {permit.identifier} for look in looks)
    looks[0].clear()  # each caller has a dict of its own
    assert looks[1]
    assert await sem.release(permit)


async def test_statistics_is_a_frozen_snapshot(make: Callable[..., Semaphore]) -> None:
    sem = make(limit=2)
    permit = await sem.acquire()
    assert permit is not None
    statistics = sem.statistics()
    assert statistics == SemaphoreStatistics(name="queue", limit=2, holders=1, waiting=0, local_waiters=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        statistics.holders = 5  # type: ignore[misc]


async def test_statistics_counts_this_processes_waiters(make: Callable[..., Semaphore]) -> None:
    sem = make()
    held = await sem.acquire()
    assert held is not None
    async with anyio.create_task_group() as tasks:
        for _ in range(3):
            tasks.start_soon(sem.acquire)
        await wait_until_queued(sem, 3)
        assert sem.statistics().local_waiters == 3
        assert sem.statistics().waiting == 3
        tasks.cancel_scope.cancel()
    assert sem.statistics().local_waiters == 0
    assert await sem.waiting() == 0


@pytest.mark.slow
async def test_a_thousand_waiters_use_a_bounded_number_of_connections(
    cls: SemaphoreClass, redis_server: RedisServer
) -> None:
    client = redis_server.client(client_name="thousand")
    admin = redis_server.admin_client()
    sem = cls(client, f"thousand-{cls.__name__}", 1)
    held = await sem.acquire()
    assert held is not None
    async with anyio.create_task_group() as tasks:
        for _ in range(1000):
            tasks.start_soon(sem.acquire)
        await wait_until_queued(sem, 1000)
        connections = [c for c in await admin.client_list() if c["name"] == "thousand"]
        assert len(connections) <= 8, connections
        tasks.cancel_scope.cancel()
    assert await sem.waiting() == 0
    await sem.release(held)
    await client.aclose()
    await admin.aclose()


async def test_a_stream_of_claims_does_not_starve_the_heartbeat(
    make: Callable[..., Semaphore], caplog: pytest.LogCaptureFixture
) -> None:
    holder_side, waiter_side = make(waiter_timeout=0.8), make(waiter_timeout=0.8)
    assert await holder_side.acquire() is not None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waiter_side.acquire)
        await wait_until_queued(holder_side, 1)
        # Claims arriving without pause for three waiter timeouts: the queued
        # waiter must still be proven alive, not dropped and queued again.
        end = anyio.current_time() + 2.4
        while anyio.current_time() < end:
            # A permit returned already, to claim: as one handed over by message.
            claim = Waiter(f"{waiter_side._process}.0000000000000000", asyncio.get_running_loop().create_future())
            claim.future.set_result(1)
            waiter_side._core.queue._hand_over(claim)
            await anyio.lowlevel.checkpoint()
        assert await holder_side.waiting() == 1
        tasks.cancel_scope.cancel()
    assert "lost their place" not in caplog.text


@pytest.fixture
async def proxied_waiter_client(proxy: TcpProxy) -> AsyncIterator[redis.asyncio.Redis]:
    """A client through the proxy with one connection for commands and one for pub/sub."""
    pool = redis.asyncio.BlockingConnectionPool(host=proxy.host, port=proxy.port, max_connections=2)
    client = redis.asyncio.Redis(connection_pool=pool)
    yield client
    await client.aclose()
    await pool.aclose()


async def handed_over(
    name: str, waiter_side_client: redis.asyncio.Redis, direct: redis.asyncio.Redis, proxy: TcpProxy
) -> tuple[AsyncFairSemaphore, AsyncFairSemaphore, Permit]:
    """A permit handed from one process to another, whose claim the proxy holds."""
    holder_side = AsyncFairSemaphore(direct, name, 1, timeout=10, waiter_timeout=0.5)
    waiter_side = AsyncFairSemaphore(waiter_side_client, name, 1, timeout=10, waiter_timeout=0.5)
    held = await holder_side.acquire()
    assert held is not None
    got: list[Permit | None] = []

    async def wait() -> None:
        got.append(await waiter_side.acquire())

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(wait)
            await wait_until_queued(holder_side, 1)
            await until_subscribed(waiter_side)  # the grant comes by message
            # The proxy holds the connections open now, and the eviction-policy check closes the one it
            # used: once it has, the command connection is opened again, for the claim to go on.
            await until_one_time_checks_done()
            await waiter_side_client.ping()
            proxy.hold_requests(at=FAIR_REFRESH.sha.encode())  # every claim and heartbeat from now on
            assert await holder_side.release(held)
    assert got[0] is not None
    return holder_side, waiter_side, got[0]


async def test_a_permit_handed_over_returns_before_its_claim_and_the_claim_restarts_its_lease(
    proxy: TcpProxy, proxied_waiter_client: redis.asyncio.Redis, real_client: redis.asyncio.Redis
) -> None:
    holder_side, _, permit = await handed_over("claimed", proxied_waiter_client, real_client, proxy)
    # Returned on the message alone: the permit still has its hand-off lease.
    assert 0 < (await holder_side.holders())[permit.identifier] <= 0.5
    with anyio.fail_after(BOUND):
        await proxy.wait_until(lambda: proxy.held_requests > 0)
    proxy.release_requests()
    with anyio.fail_after(BOUND):
        while (await holder_side.holders())[permit.identifier] <= 0.5:  # noqa: ASYNC110 -- the lease is in Redis
            await anyio.sleep(0.002)
    assert (await holder_side.holders())[permit.identifier] > 9


async def test_a_claim_that_lands_after_the_waiter_timeout_finds_the_permit_lost(
    proxy: TcpProxy,
    proxied_waiter_client: redis.asyncio.Redis,
    real_client: redis.asyncio.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    holder_side, waiter_side, permit = await handed_over("late-claim", proxied_waiter_client, real_client, proxy)
    with anyio.fail_after(BOUND):
        await proxy.wait_until(lambda: proxy.held_requests > 0)
        # The process stalls past its waiter timeout: the hand-off lease runs out.
        while await holder_side.count() > 0:  # noqa: ASYNC110 -- the lease is in Redis
            await anyio.sleep(0.01)
    proxy.release_requests()
    with anyio.fail_after(BOUND):
        while "lost before it was claimed" not in caplog.text:  # noqa: ASYNC110 -- logged by the pump
            await anyio.sleep(0.002)
    assert not await waiter_side.release(permit)


async def test_the_queue_keys_outlive_the_waiter_with_the_longest_waiter_timeout(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    holder_side = cls(client, "queue", 1, timeout=30)
    patient = cls(client, "queue", 1, timeout=30, waiter_timeout=20)
    hasty = cls(client, "queue", 1, timeout=30, waiter_timeout=0.5)
    assert await holder_side.acquire() is not None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(patient.acquire)
        await wait_until_queued(holder_side, 1)
        tasks.start_soon(hasty.acquire)
        await wait_until_queued(holder_side, 2)
        for suffix in ("queue", "waiters", "tickets"):
            assert 20_000 < await client.pttl(f"{holder_side.key}:{suffix}") <= 21_000, suffix
        tasks.cancel_scope.cancel()


async def test_a_waiter_handed_its_permit_while_it_is_queued_again_keeps_it(
    redis_server: RedisServer, proxy: TcpProxy, admin_client: redis.asyncio.Redis
) -> None:
    # The queue forgot a waiter (its keys evicted, say): its object queues it
    # again -- and, that step's reply still on its way, another process hands
    # it the freed permit by message. The reply then finds the waiter holding:
    # the permit is its own, not an abandoned grant to give back. (The fair
    # class: a Lua-free step holds its lock meanwhile, and nobody could hand
    # anything over.) The permit is the waiter's at once only if the message
    # comes within two thirds of a waiter timeout of the last step that found
    # it queued; a heartbeat (a third) and the test's own steps come before
    # the message, so the timeout leaves a loaded machine a second to spare.
    await admin_client.flushdb()
    client = proxied_client(proxy, redis_server)
    other = AsyncFairSemaphore(admin_client, "requeued", 1, waiter_timeout=3)
    sem = AsyncFairSemaphore(client, "requeued", 1, waiter_timeout=3)
    entered, leave = anyio.Event(), anyio.Event()
    lost: list[BaseException] = []

    async def hold() -> None:
        try:
            async with sem:
                entered.set()
                await leave.wait()
        except BaseException as error:
            lost.append(error)
            raise

    try:
        warm = await sem.acquire()  # the scripts are loaded: no NOSCRIPT is held below
        assert warm is not None
        assert await sem.release(warm)
        holder = await other.acquire()
        assert holder is not None
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(hold)
                await wait_until_queued(other, 1)
                await until_subscribed(sem)
                proxy.hold_replies(after=FAIR_ACQUIRE.sha.encode())  # the queueing again, answered late
                await admin_client.delete(f"{sem.key}:queue", f"{sem.key}:waiters")
                await wait_until_queued(other, 1)  # queued again by the next re-check
                assert await other.release(holder)  # handed over, by message
                await entered.wait()
                proxy.release_replies()
                await anyio.sleep(0.3)  # the reply is read, and the pump's next round runs
                assert await other.count() == 1
                assert await other.acquire(blocking=False) is None
                leave.set()
        assert not lost
        assert await other.count() == 0
    finally:
        proxy.release_replies()
        await sem.aclose()
        await other.aclose()
        await client.aclose()


async def test_a_grant_heard_after_a_stall_past_the_waiter_timeout_is_claimed_before_it_is_returned(
    cls: SemaphoreClass, redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> None:
    # Another process hands the waiter the permit, and the waiter's process
    # stalls (its event loop blocked) past the waiter timeout the grant was
    # stamped with: the grant may be gone by the time the message is read.
    # The waiter returns only once its claim has answered -- here, with a
    # permit of its own, queued again and granted at once -- and never with
    # one already reaped, which would end its block with `PermitLost`.
    await admin_client.flushdb()
    waiter_client = redis_server.client()
    other = cls(admin_client, "stalled-hand-off", 1, waiter_timeout=0.3)
    sem = cls(waiter_client, "stalled-hand-off", 1, waiter_timeout=0.3)
    outcome: list[object] = []

    async def hold() -> None:
        try:
            async with sem as permit:
                outcome.append(permit)
        except PermitLost as lost:
            outcome.append(lost)

    def release_from_another_process(permit: Permit) -> None:
        async def release() -> None:
            client = redis_server.admin_client()
            try:
                assert await cls(client, "stalled-hand-off", 1, waiter_timeout=0.3).release(permit)
            finally:
                await client.aclose()

        time.sleep(0.05)  # once the waiter's process has stalled
        asyncio.run(release())

    try:
        holder = await other.acquire()
        assert holder is not None
        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(hold)
                await wait_until_queued(other, 1)
                await until_subscribed(sem)
                releasing = threading.Thread(target=release_from_another_process, args=(holder,))
                releasing.start()
                # The waiter's process stalls; meanwhile the permit is handed to it, by message.
                time.sleep(0.6)  # noqa: ASYNC251 -- the fault, on purpose
                releasing.join()
        assert len(outcome) == 1
        assert isinstance(outcome[0], Permit)
        assert await other.count() == 0
    finally:
        await sem.aclose()
        await other.aclose()
        await waiter_client.aclose()
