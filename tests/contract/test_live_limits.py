"""Live limits: a limit set in Redis with `set_limit` is in force for every process, at once.

The limit key holds either a limit a caller *brought* (``n``: its
constructor's, stored while anybody holds or waits, a `LimitMismatch` for
a caller bringing another) or a limit *set* (``=n``: in force for every
object of the name whatever it brings, until cleared, idle or not).
Raising a set limit hands the new permits to the queue, in queue order, in
the very step that raises it; lowering it takes nothing back. An object
made with ``limit=None`` takes the limit in force, and raises
`LimitNotSet` when there is none.

Every test runs on both classes, on a real server and on fakeredis. Each
semaphore object lives on a fresh client of its own, as another process
would have it (`processes`), and its first call is the one under test
wherever that can be arranged. Who waits and who holds is read from Redis
(`until_queued`, the steps' own replies, the keys), never guessed from
time passed.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import anyio
import fakeredis
import pytest
import redis.asyncio

from aiosem import (
    AsyncFairSemaphore,
    AsyncLockedSemaphore,
    LimitMismatch,
    LimitNotSet,
    Permit,
    SemaphoreError,
)
from aiosem._keys import SemaphoreKeys
from aiosem._protocol import Step
from tests.harness.support import until_queued, until_subscribed

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from tests.harness.support import RedisServer

    #: Makes a semaphore object of `NAME` with a limit (or ``None``) on a fresh client of its own.
    Process = Callable[..., AsyncFairSemaphore | AsyncLockedSemaphore]
    #: Joins the queue through a semaphore object, once Redis lists as many waiters as given (see `line`).
    Line = Callable[[AsyncFairSemaphore | AsyncLockedSemaphore, int], Awaitable[asyncio.Task[Permit]]]

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

NAME = "db"
KEYS = SemaphoreKeys.for_name("aiosem", NAME)
#: A generous bound on anything here: a few round trips at most.
BOUND = 10.0


# --- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture
async def processes(
    cls: SemaphoreClass, client: redis.asyncio.Redis, request: pytest.FixtureRequest
) -> AsyncIterator[Process]:
    """Makes semaphore objects of `NAME`, each on a fresh client of `client`'s backend, as separate processes would.

    A real server's clients come from the harness, as a user makes them
    (redis-py's defaults; the suite's user in the ACL mode). All are closed
    at the end, objects first.
    """
    if isinstance(client, fakeredis.FakeAsyncRedis):
        # fakeredis clients share a server when they name the same (made-up) address.
        address = {key: client.connection_pool.connection_kwargs[key] for key in ("host", "port")}

        def connect() -> redis.asyncio.Redis:
            return fakeredis.FakeAsyncRedis(**address)

    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        connect = server.client
    objects: list[Semaphore] = []
    clients: list[redis.asyncio.Redis] = []

    def make(limit: int | None, name: str = NAME, **options: Any) -> Semaphore:
        clients.append(connect())
        objects.append(cls(clients[-1], name, limit, **options))
        return objects[-1]

    yield make
    for semaphore in objects:
        await semaphore.aclose()
    for made in clients:
        await made.aclose()


@pytest.fixture
async def line() -> AsyncIterator[Line]:
    """Joins the queue: starts ``sem.acquire()`` and returns once Redis lists ``queued`` waiters of the name.

    Each call's waiter arrives after the previous one's is queued, so the
    queue's order is the order of the calls. Waiters still waiting at the
    end are cancelled.
    """
    tasks: list[asyncio.Task[Permit]] = []

    async def join(semaphore: Semaphore, queued: int) -> asyncio.Task[Permit]:
        async def acquire() -> Permit:
            permit = await semaphore.acquire()
            assert permit is not None  # blocking, without a timeout: granted or raised
            return permit

        tasks.append(asyncio.create_task(acquire()))
        await until_queued(semaphore, queued)
        return tasks[-1]

    yield join
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def granted(*waiters: asyncio.Task[Permit]) -> list[Permit]:
    """The permits of ``waiters``, each of which Redis has granted: bounded, as a lost wake-up must fail, not hang."""
    with anyio.fail_after(BOUND):
        return list(await asyncio.gather(*waiters))


async def in_redis(admin: redis.asyncio.Redis) -> tuple[int, int, object]:
    """What Redis holds for `NAME`, read directly rather than through a step: (held, queued, limit key)."""
    return await admin.zcard(KEYS.owner_set), await admin.zcard(KEYS.queue), await admin.get(KEYS.limit)


async def take(semaphore: Semaphore, count: int) -> list[Permit]:
    """``count`` permits taken at once through ``semaphore``; each must be granted without waiting."""
    permits = await asyncio.gather(*(semaphore.acquire(blocking=False) for _ in range(count)))
    assert None not in permits, permits
    return [permit for permit in permits if permit is not None]


# --- 1. raising the limit -------------------------------------------------------------------


async def test_raising_the_limit_grants_the_longest_waiters_in_queue_order_within_the_step(
    processes: Process, line: Line, client_admin: redis.asyncio.Redis
) -> None:
    first, second = processes(1), processes(1)
    holder = await first.acquire()
    assert holder is not None
    # Alternating processes, so that both the setter's messages and the order across processes count.
    waiters = [await line(semaphore, queued) for queued, semaphore in enumerate([first, second] * 2, start=1)]
    await until_subscribed(first)
    await until_subscribed(second)
    operator = processes(None)  # a third process: every grant reaches its waiter by message

    assert await operator.set_limit(3) == 1
    # The limit step's own reply, and Redis read directly: two granted by that very step.
    assert (operator.statistics().holders, operator.statistics().waiting) == (3, 2)
    assert await in_redis(client_admin) == (3, 2, b"=3")
    head = await granted(*waiters[:2])
    assert not any(waiter.done() for waiter in waiters[2:])

    assert await operator.set_limit(5) == 3
    tail = await granted(*waiters[2:])
    tokens = [permit.fencing_token for permit in (*head, *tail)]
    assert tokens == sorted(tokens), "granted out of queue order"
    assert head[0].fencing_token > holder.fencing_token


async def test_raising_the_limit_through_a_waiters_own_object_grants_it_in_the_reply(
    processes: Process, line: Line
) -> None:
    holding, waiting = processes(1), processes(1)
    assert await holding.acquire() is not None
    waiter = await line(waiting, 1)
    # No subscription awaited: the raising step's reply itself hands the permit to this process.
    assert await waiting.set_limit(2) == 1
    (permit,) = await granted(waiter)
    assert permit.name == NAME
    assert (waiting.statistics().holders, waiting.statistics().waiting) == (2, 0)


async def test_raising_the_limit_with_nobody_waiting_only_makes_room(
    processes: Process, client_admin: redis.asyncio.Redis
) -> None:
    sem = processes(1)
    await take(sem, 1)
    assert await sem.set_limit(2) == 1
    assert await in_redis(client_admin) == (1, 0, b"=2")
    await take(sem, 1)
    assert await sem.acquire(blocking=False) is None


# --- 2. lowering the limit ------------------------------------------------------------------


async def test_lowering_the_limit_takes_no_permit_back(processes: Process, client_admin: redis.asyncio.Redis) -> None:
    first, second = processes(4), processes(4)
    permits = [*await take(first, 2), *await take(second, 2)]
    operator = processes(None)
    assert await operator.set_limit(2) == 4
    for permit, semaphore in zip(permits, [first, first, second, second], strict=True):
        assert await semaphore.refresh(permit) is True
    assert await first.count() == 4
    assert await in_redis(client_admin) == (4, 0, b"=2")


async def test_after_lowering_nobody_is_granted_until_fewer_than_the_new_limit_hold_then_in_queue_order(
    processes: Process, line: Line, client_admin: redis.asyncio.Redis
) -> None:
    first, second = processes(4), processes(4)
    a1, a2 = await take(first, 2)
    b1, b2 = await take(second, 2)
    early = await line(second, 1)
    late = await line(first, 2)
    assert await processes(None).set_limit(2) == 4

    # Each release step hands off in the same step: its reply, and Redis, are the whole story.
    assert await first.release(a1)
    assert (first.statistics().holders, first.statistics().waiting) == (3, 2)
    assert await first.release(a2)
    assert (first.statistics().holders, first.statistics().waiting) == (2, 2)  # 2 held: not fewer than 2
    assert await in_redis(client_admin) == (2, 2, b"=2")
    assert not early.done()

    assert await second.release(b1)
    assert (second.statistics().holders, second.statistics().waiting) == (2, 1)
    (first_granted,) = await granted(early)
    assert not late.done()
    assert await second.release(b2)
    (then_granted,) = await granted(late)
    assert first_granted.fencing_token < then_granted.fencing_token
    assert await in_redis(client_admin) == (2, 0, b"=2")


# --- 3. idempotence -------------------------------------------------------------------------


async def test_setting_the_limit_in_force_again_changes_nothing(
    processes: Process, line: Line, client_admin: redis.asyncio.Redis
) -> None:
    sem = processes(2)
    await take(sem, 2)
    waiter = await line(sem, 1)
    operator = processes(None)
    assert await operator.set_limit(2) == 2  # brought, now set: the same number
    before = await in_redis(client_admin), await client_admin.get(KEYS.counter)
    assert await operator.set_limit(2) == 2
    assert await operator.set_limit(2) == 2
    assert (await in_redis(client_admin), await client_admin.get(KEYS.counter)) == before == ((2, 1, b"=2"), before[1])
    assert not waiter.done()


async def test_setting_a_limit_where_none_is_in_force_answers_none_whatever_the_object_was_made_with(
    processes: Process,
) -> None:
    # The documented return is "the limit in force before, or None if there was none": on a fresh
    # semaphore there is none, whichever object asks. Answering the object's own limit would make
    # `old = await sem.set_limit(n) ... await sem.set_limit(old)` leave a limit set where none was.
    assert await processes(2).set_limit(3) is None
    assert await processes(2).set_limit(None) == 3
    assert await processes(2).set_limit(None) is None


async def test_setting_a_new_limit_twice_answers_it_the_second_time(processes: Process) -> None:
    sem = processes(3)
    await take(sem, 1)
    assert await sem.set_limit(5) == 3
    assert await sem.set_limit(5) == 5
    assert sem.limit == 5


# --- 4. a set limit wins over every constructor's ---------------------------------------------


async def test_a_set_limit_is_shared_by_objects_made_with_other_limits_without_a_mismatch(
    processes: Process, client_admin: redis.asyncio.Redis
) -> None:
    assert await processes(None).set_limit(3) is None
    two, five = processes(2), processes(5)
    # Blocking acquires, and all three granted: no mismatch, and no wait. (Not tries: the locked
    # class refuses a try that meets another object's step holding its lock.)
    with anyio.fail_after(BOUND):
        held = await asyncio.gather(two.acquire(), two.acquire(), five.acquire())
    assert None not in held
    # Under its own 5, `five` would take another; under the set 3, neither does.
    assert await five.acquire(blocking=False) is None
    assert await two.acquire(blocking=False) is None
    assert two.limit == five.limit == 3
    assert await in_redis(client_admin) == (3, 0, b"=3")  # a limit brought never overwrites one set


async def test_a_set_limit_above_an_objects_own_lets_it_hold_more(processes: Process) -> None:
    two = processes(2)
    assert await processes(None).set_limit(3) is None
    await take(two, 3)
    assert await two.acquire(blocking=False) is None


async def test_a_limit_set_while_in_use_with_a_brought_one_ends_the_mismatch(processes: Process) -> None:
    three, five = processes(3), processes(5)
    await take(three, 1)
    with pytest.raises(LimitMismatch):
        await five.acquire(blocking=False)
    assert await processes(None).set_limit(4) == 3
    await take(five, 3)
    assert await three.acquire(blocking=False) is None


# --- 5. a set limit outlives idleness ---------------------------------------------------------


async def test_a_set_limit_outlives_the_semaphore_falling_idle(
    processes: Process, client_admin: redis.asyncio.Redis
) -> None:
    assert await processes(None).set_limit(3) is None
    assert await client_admin.pttl(KEYS.limit) == -1  # no TTL: it lasts until cleared
    seven = processes(7)
    for permit in await take(seven, 3):
        assert await seven.release(permit)
    assert await in_redis(client_admin) == (0, 0, b"=3")
    assert await client_admin.pttl(KEYS.limit) == -1

    nine = processes(9)  # a fresh object, long after: still bound
    await take(nine, 3)
    assert await nine.acquire(blocking=False) is None
    assert nine.statistics().limit == 3


# --- 6. clearing --------------------------------------------------------------------------------


async def test_clearing_an_idle_semaphores_limit_gives_the_next_acquire_its_own(
    processes: Process, client_admin: redis.asyncio.Redis
) -> None:
    operator = processes(None)
    assert await operator.set_limit(3) is None
    assert await operator.set_limit(None) == 3
    assert await client_admin.exists(KEYS.limit) == 0
    five = processes(5)
    permits = await take(five, 5)
    assert await client_admin.get(KEYS.limit) == b"5"
    for permit in permits:
        assert await five.release(permit)
    assert await client_admin.exists(KEYS.limit) == 0  # brought: gone once idle, as before


async def test_a_limit_cleared_while_in_use_stays_in_force_as_if_brought_until_idle(
    processes: Process, client_admin: redis.asyncio.Redis
) -> None:
    five, two = processes(5), processes(2)
    assert await processes(None).set_limit(3) is None
    held = [*await take(five, 1), *await take(two, 1)]  # no mismatch while the limit is set
    assert await processes(None).set_limit(None) == 3
    assert await in_redis(client_admin) == (2, 0, b"3")
    # Brought now: every constructor that disagrees is told, as between deployments.
    with pytest.raises(LimitMismatch, match=r"semaphore 'db' is in use with limit 3; this client asked for 5"):
        await five.acquire(blocking=False)
    with pytest.raises(LimitMismatch, match=r"semaphore 'db' is in use with limit 3; this client asked for 2"):
        await two.acquire(blocking=False)
    assert await five.release(held[0])
    assert await two.release(held[1])
    assert await client_admin.exists(KEYS.limit) == 0  # idle: gone, as a limit brought goes
    await take(five, 1)  # the first acquire since brings its limit, and stores it
    assert await client_admin.get(KEYS.limit) == b"5"
    with pytest.raises(LimitMismatch, match=r"semaphore 'db' is in use with limit 5; this client asked for 2"):
        await two.acquire(blocking=False)


async def test_clearing_when_no_limit_is_set_changes_nothing(
    processes: Process, client_admin: redis.asyncio.Redis
) -> None:
    three = processes(3)
    await take(three, 1)
    operator = processes(None)
    assert await operator.set_limit(None) == 3  # the brought limit in force, which stays
    assert await in_redis(client_admin) == (1, 0, b"3")
    with pytest.raises(LimitMismatch):
        await processes(5).acquire(blocking=False)


# --- 7. a brought limit still mismatches ----------------------------------------------------------


async def test_a_brought_limit_still_refuses_another_and_the_refusal_takes_nothing(
    processes: Process, line: Line, client_admin: redis.asyncio.Redis
) -> None:
    holder, five = processes(1), processes(5)
    await take(holder, 1)
    waiter = await line(holder, 1)
    with pytest.raises(
        LimitMismatch, match=r"semaphore 'db' is in use with limit 1; this client asked for 5"
    ) as caught:
        await five.acquire()
    assert (caught.value.name, caught.value.limit, caught.value.stored_limit) == ("db", 5, 1)
    # Nothing taken or queued, and no hand-off under the refused caller's 5: the waiter still waits.
    assert await in_redis(client_admin) == (1, 1, b"1")
    assert five.statistics().local_waiters == 0
    assert not waiter.done()


# --- 8. limit=None ----------------------------------------------------------------------------------


async def test_an_object_without_a_limit_takes_the_brought_one(processes: Process) -> None:
    two = processes(2)
    await take(two, 1)
    anonymous = processes(None)
    assert anonymous.limit is None  # before its first step, it knows none
    await take(anonymous, 1)
    assert anonymous.limit == 2
    assert await anonymous.acquire(blocking=False) is None


async def test_an_object_without_a_limit_takes_the_set_one(processes: Process) -> None:
    assert await processes(None).set_limit(3) is None
    anonymous = processes(None)
    await take(anonymous, 3)
    assert await anonymous.acquire(blocking=False) is None
    assert anonymous.limit == 3


async def _enter(semaphore: Semaphore) -> None:
    async with semaphore:
        pass  # pragma: no cover -- never entered


#: The ways into a semaphore, each of which must find the limit first.
ATTEMPTS: dict[str, Callable[[Semaphore], Awaitable[object]]] = {
    "acquire": lambda semaphore: semaphore.acquire(),
    "try": lambda semaphore: semaphore.acquire(blocking=False),
    "async with": _enter,
}


@pytest.mark.parametrize("how", sorted(ATTEMPTS))
async def test_an_object_without_a_limit_finding_none_raises_limit_not_set_and_takes_nothing(
    processes: Process, client_admin: redis.asyncio.Redis, how: str
) -> None:
    anonymous = processes(None)
    message = (
        r"^no limit for semaphore 'db': none was given, configured or declared, and none is in force in Redis; "
        r"pass limit=, or set one with `python -m aiosem limit db N`$"
    )
    with pytest.raises(LimitNotSet, match=message) as caught:
        await ATTEMPTS[how](anonymous)
    assert isinstance(caught.value, LookupError)
    assert isinstance(caught.value, SemaphoreError)
    assert caught.value.name == "db"
    assert await in_redis(client_admin) == (0, 0, None)
    assert anonymous.statistics().local_waiters == 0
    # Only keys that expire are left (the locked class's ticket counter): nothing held, queued or stored.
    for key in await client_admin.keys("*"):
        assert await client_admin.pttl(key) > 0, key


async def test_a_brought_limit_gone_with_idleness_leaves_an_object_without_a_limit_none(processes: Process) -> None:
    three = processes(3)
    (permit,) = await take(three, 1)
    assert await three.release(permit)
    with pytest.raises(LimitNotSet):
        await processes(None).acquire(blocking=False)


# --- 9. what an object reports --------------------------------------------------------------------


async def test_limit_and_statistics_report_the_limit_in_force_as_redis_last_answered(processes: Process) -> None:
    two, operator = processes(2), processes(None)
    assert (two.limit, two.statistics().limit) == (2, 2)  # before any step: the constructor's
    assert (operator.limit, operator.statistics().limit) == (None, None)
    assert await operator.set_limit(6) is None
    assert (operator.limit, operator.statistics().limit) == (6, 6)
    assert two.limit == 2  # it has not heard from Redis since
    assert await two.count() == 0
    assert (two.limit, two.statistics().limit) == (6, 6)
    assert "limit=6" in repr(two)


# --- 10. bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "error", "message"),
    [
        (0, ValueError, r"^limit must be at least 1, got 0$"),
        (-1, ValueError, r"^limit must be at least 1, got -1$"),
        (2**53 + 1, ValueError, r"^limit must be at most 2\*\*53 \(9,007,199,254,740,992\), got 9007199254740993$"),
        ("3", TypeError, r"^limit must be an int, not str$"),
        (2.0, TypeError, r"^limit must be an int, not float$"),
        (True, TypeError, r"^limit must be an int, not bool$"),
    ],
)
async def test_a_bad_limit_is_refused_before_anything_is_sent(
    cls: SemaphoreClass, refusing_port: int, limit: object, error: type[Exception], message: str
) -> None:
    # A Redis that refuses every connection: had anything been sent, this would be a connection error.
    unreachable = redis.asyncio.Redis(port=refusing_port)
    try:
        sem = cls(unreachable, NAME, 2)
        with pytest.raises(error, match=message):
            await sem.set_limit(limit)  # type: ignore[arg-type]
        await sem.aclose()
    finally:
        await unreachable.aclose()


@pytest.mark.parametrize("limit", [0, "3", True])
async def test_a_bad_limit_leaves_the_limit_in_force(
    processes: Process, client_admin: redis.asyncio.Redis, limit: object
) -> None:
    sem = processes(None)
    assert await sem.set_limit(3) is None
    with pytest.raises((TypeError, ValueError)):
        await sem.set_limit(limit)  # type: ignore[arg-type]
    assert await client_admin.get(KEYS.limit) == b"=3"
    assert sem.limit == 3


# --- 11. cancellation -----------------------------------------------------------------------------


async def test_a_set_limit_cancelled_before_it_runs_leaves_the_limit_as_it_was(
    processes: Process, client_admin: redis.asyncio.Redis
) -> None:
    sem = processes(None)
    assert await sem.set_limit(3) is None
    call = asyncio.create_task(sem.set_limit(9))
    call.cancel()  # before the task ever ran: nothing can have been sent
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await client_admin.get(KEYS.limit) == b"=3"
    assert await sem.set_limit(9) == 3
    assert await client_admin.get(KEYS.limit) == b"=9"


async def test_a_set_limit_cancelled_while_waiting_behind_another_is_left_out_of_the_next_step(
    processes: Process, client_admin: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sem = processes(None)
    assert await sem.set_limit(3) is None
    # Hold the first limit step at the backend, before it reaches Redis, until told: the second
    # call then waits its turn in the object's lane, where it is cancelled.
    backend = type(sem._core.backend)
    execute = backend.execute
    entered, proceed = asyncio.Event(), asyncio.Event()

    async def gated(self: Any, step: Step, identifiers: Any, call: str) -> Any:
        if step is Step.LIMIT and not entered.is_set():
            entered.set()
            await proceed.wait()
        return await execute(self, step, identifiers, call)

    monkeypatch.setattr(backend, "execute", gated)
    first = asyncio.create_task(sem.set_limit(4))
    with anyio.fail_after(BOUND):
        await entered.wait()
    joined = asyncio.Event()

    async def second_call() -> int | None:
        joined.set()
        # Runs on, without a pause, into the lane: the test resumes once it waits there.
        return await sem.set_limit(9)

    second = asyncio.create_task(second_call())
    await joined.wait()
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    proceed.set()
    with anyio.fail_after(BOUND):
        assert await first == 3
    assert await client_admin.get(KEYS.limit) == b"=4"
    assert await sem.set_limit(9) == 4  # and calling again works
    assert await client_admin.get(KEYS.limit) == b"=9"


async def test_clearing_a_set_limit_through_an_object_without_a_limit_grants_nobody(
    processes: Process, line: Line, client_admin: redis.asyncio.Redis
) -> None:
    one = processes(1)
    assert await one.set_limit(1) is None  # nothing stored before
    await take(one, 1)
    await line(one, 1)
    assert await processes(None).set_limit(None) == 1
    assert await in_redis(client_admin) == (1, 1, b"1")  # as if its users had brought it


async def test_clearing_a_set_limit_grants_nobody_whatever_the_clearing_object_was_made_with(
    processes: Process, line: Line, client_admin: redis.asyncio.Redis
) -> None:
    one = processes(1)
    assert await one.set_limit(1) is None  # nothing stored before
    await take(one, 1)
    await line(one, 1)
    await line(one, 2)
    # An object made with 10 clears the limit: it brings 10 but acquires nothing, so stores nothing;
    # an operator made without a limit, clearing the same way, grants nobody.
    assert await processes(10).set_limit(None) == 1
    assert await in_redis(client_admin) == (1, 2, b"1")  # as if its users had brought it
