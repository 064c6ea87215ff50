"""`AsyncRateLimiter`: GCRA in one script, slots in arrival order, one sleep per wait."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING
from unittest import mock

import anyio
import fakeredis
import fakeredis._socket._base
import pytest
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiosem import AcquireTimeout, AsyncRateLimiter

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.harness.support import FakeClock

#: The most any wait in these tests may take before the test fails.
BOUND = 30.0


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"rate": 0}, ValueError, "rate must be a positive, finite number, got 0"),
        ({"rate": -1}, ValueError, "rate must be a positive"),
        ({"rate": float("nan")}, ValueError, "rate must be a positive, finite number, got nan"),
        ({"rate": float("inf")}, ValueError, "rate must be a positive"),
        ({"rate": "5"}, TypeError, "rate must be a number, not str"),
        ({"rate": True}, TypeError, "rate must be a number, not bool"),
        ({"per": 0}, ValueError, "per must be a positive"),
        ({"per": float("nan")}, ValueError, "per must be a positive"),
        ({"burst": 0}, ValueError, "burst must be between 1 and"),
        ({"burst": 1.5}, TypeError, "burst must be an int, not float"),
        ({"blocking_timeout": -1}, ValueError, "blocking_timeout must not be negative"),
        ({"name": ""}, ValueError, "name must not be empty"),
        ({"prefix": "a{b"}, ValueError, "prefix must not contain"),
        ({"clock": 3}, TypeError, "clock must be callable"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(
    arguments: dict[str, object], error: type[Exception], message: str
) -> None:
    given_arguments: dict[str, object] = {"name": "api", "rate": 5, **arguments}
    with pytest.raises(error, match=message):
        AsyncRateLimiter(redis.asyncio.Redis(), **given_arguments)  # type: ignore[arg-type]


def test_the_key_shares_the_hash_tag_of_the_semaphore_of_the_same_name() -> None:
    limiter = AsyncRateLimiter(redis.asyncio.Redis(), "host{1}", 5)
    assert limiter.key == "aiosem:{host%7B1%7D}:rate"
    assert "rate=5, per=1, burst=1" in repr(limiter)


async def test_an_idle_limiter_lets_burst_calls_through_then_spaces_them(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "api", 5, burst=3, clock=clock)
    assert [await limiter.try_acquire() for _ in range(4)] == [True, True, True, False]
    clock.advance(0.2)  # one emission interval: one more slot
    assert [await limiter.try_acquire() for _ in range(2)] == [True, False]


async def test_each_reservation_is_told_the_wait_for_the_next_slot_in_arrival_order(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "api", 10, clock=clock)  # a slot every 0.1 s
    waits = [(await limiter._run("reserve", ""))[1] for _ in range(4)]
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3])


async def test_calls_made_together_are_reserved_in_the_order_they_were_made(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "api", 10, clock=clock)
    calls = [limiter._run("reserve", "", cost) for cost in (1, 3, 1, 2)]
    waits = [wait for _, wait, _ in await asyncio.gather(*calls)]
    # As one after another: a call of cost k comes k - 1 intervals into its slots.
    assert waits == pytest.approx([0.0, 0.3, 0.4, 0.6])


async def test_a_refused_call_between_granted_ones_takes_nothing(client: redis.asyncio.Redis, clock: FakeClock) -> None:
    limiter = AsyncRateLimiter(client, "api", 10, burst=2, clock=clock)
    tries = [limiter.try_acquire() for _ in range(3)]
    assert await asyncio.gather(*tries) == [True, True, False]
    clock.advance(0.1)
    assert await limiter.try_acquire()


async def test_a_thousand_calls_at_once_on_redis_pys_default_client_all_get_their_slots(
    default_client: redis.asyncio.Redis,
) -> None:
    # Each used to send its own script, a connection each: past the 100 of
    # redis-py 8's default pool they failed with "Too many connections".
    limiter = AsyncRateLimiter(default_client, "crawl", 100_000, burst=1000)
    with anyio.fail_after(BOUND):
        granted = await asyncio.gather(*(limiter.acquire() for _ in range(1000)))
    assert all(granted)


async def test_a_slot_further_than_the_blocking_timeout_is_not_reserved(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "api", 1, clock=clock)
    assert await limiter.acquire()
    before = await client.get(limiter.key)
    assert not await limiter.acquire(blocking_timeout=0.5)
    assert await client.get(limiter.key) == before
    with pytest.raises(AcquireTimeout, match=r"^no slot of rate limiter 'api' within 0\.5 s$"):
        async with AsyncRateLimiter(client, "api", 1, clock=clock, blocking_timeout=0.5):
            pass


async def test_acquire_sleeps_once_until_its_slot(client: redis.asyncio.Redis) -> None:
    limiter = AsyncRateLimiter(client, "api", 20)  # a slot every 50 ms
    started = anyio.current_time()
    granted = []
    with anyio.fail_after(BOUND):
        for _ in range(5):
            async with limiter:
                granted.append(anyio.current_time() - started)
    # A slot never comes early (the loop's clock only moves on).
    for index, at in enumerate(granted):
        assert at >= index * 0.05 - 0.005


async def test_a_cancelled_wait_gives_its_slot_back(client: redis.asyncio.Redis, clock: FakeClock) -> None:
    limiter = AsyncRateLimiter(client, "api", 1, clock=clock)
    assert await limiter.acquire()
    after_first = await client.get(limiter.key)
    with anyio.move_on_after(0.2) as scope:
        await limiter.acquire()  # its slot is 1 s away
    assert scope.cancelled_caught
    assert await client.get(limiter.key) == after_first


async def test_a_give_back_that_fails_after_its_wait_was_cancelled_is_logged(
    client: redis.asyncio.Redis, clock: FakeClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scope cancels the call again as it waits for the give-back: the
    # give-back's failure, which the caller no longer hears of, used to go untold.
    limiter = AsyncRateLimiter(client, "api", 1, clock=clock)
    assert await limiter.acquire()
    run = AsyncRateLimiter._run

    async def return_fails(self: AsyncRateLimiter, mode: str, argument: str, cost: int = 1) -> tuple[bool, float, int]:
        if mode == "return":
            raise redis.ConnectionError("Connection refused")
        return await run(self, mode, argument, cost)

    monkeypatch.setattr(AsyncRateLimiter, "_run", return_fails)
    with caplog.at_level(logging.WARNING, logger="aiosem"), anyio.move_on_after(0.2) as scope:
        await limiter.acquire()  # its slot is 1 s away

    assert scope.cancelled_caught
    (record,) = [record for record in caplog.records if "could not give back" in record.getMessage()]
    assert record.exc_info is not None
    assert "Connection refused" in str(record.exc_info[1])


async def test_a_cancelled_wait_keeps_the_slots_reserved_after_it(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "api", 1, clock=clock)
    assert await limiter.acquire()
    async with anyio.create_task_group() as tasks:
        first = anyio.CancelScope()

        async def wait_in(scope: anyio.CancelScope) -> None:
            with scope:
                await limiter.acquire()

        tasks.start_soon(wait_in, first)
        with anyio.fail_after(BOUND):
            while int(await client.get(limiter.key) or 0) < int(clock() * 1e6) + 2_000_000:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        second_reserved = await limiter._run("reserve", "")  # the slot after the first waiter's
        first.cancel()
    # Somebody reserved after the cancelled waiter: its slot is not taken back.
    assert int(await client.get(limiter.key) or 0) == second_reserved[2]


async def test_the_key_expires_when_the_limiter_comes_to_rest(client: redis.asyncio.Redis) -> None:
    limiter = AsyncRateLimiter(client, "idle", 10)
    assert await limiter.try_acquire()
    assert await client.pttl(limiter.key) <= 100  # at most one interval; gone already after a pause
    with anyio.fail_after(BOUND):
        while await client.exists(limiter.key):  # noqa: ASYNC110 -- the key's TTL runs on the server
            await anyio.sleep(0.02)


# --- calls that cost more than one ---------------------------------------------------


@pytest.fixture
def unreachable(tmp_path: Path) -> redis.asyncio.Redis:
    """A client of no server at all: any command it sends fails, so a refusal it gives was made before sending."""
    return redis.asyncio.Redis(unix_socket_path=str(tmp_path / "no-server.sock"))


@pytest.mark.parametrize(
    ("cost", "error", "message"),
    [
        (0, ValueError, r"^cost must be at least 1, got 0$"),
        (-2, ValueError, r"^cost must be at least 1, got -2$"),
        (4, ValueError, r"^cost must be at most burst \(3\), got 4: a call of that cost could never be granted$"),
        (2.0, TypeError, r"^cost must be an int, not float$"),
        (True, TypeError, r"^cost must be an int, not bool$"),
        ("2", TypeError, r"^cost must be an int, not str$"),
    ],
)
async def test_a_bad_cost_is_refused_before_anything_is_sent(
    unreachable: redis.asyncio.Redis, cost: object, error: type[Exception], message: str
) -> None:
    limiter = AsyncRateLimiter(unreachable, "api", 5, burst=3)
    with pytest.raises(error, match=message):
        await limiter.acquire(cost=cost)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        await limiter.try_acquire(cost=cost)  # type: ignore[arg-type]


async def test_a_call_of_cost_k_takes_k_slots(client: redis.asyncio.Redis, clock: FakeClock) -> None:
    limiter = AsyncRateLimiter(client, "batch", 10, burst=10, clock=clock)  # a slot every 0.1 s
    assert await limiter.try_acquire(cost=10)  # the whole burst, from rest
    assert not await limiter.try_acquire()
    _, wait, _ = await limiter._run("reserve", "")
    assert wait == pytest.approx(0.1)  # as after ten calls of cost 1


async def test_a_costly_try_is_refused_until_enough_slots_are_free(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "batch", 10, burst=5, clock=clock)
    assert await limiter.try_acquire(cost=3)
    before = await client.get(limiter.key)
    assert not await limiter.try_acquire(cost=3)  # two of five slots are left
    assert await client.get(limiter.key) == before  # a refusal takes nothing
    assert await limiter.try_acquire(cost=2)
    clock.advance(0.2)  # two intervals: two slots come back
    assert not await limiter.try_acquire(cost=3)
    assert await limiter.try_acquire(cost=2)


async def test_costly_and_cheap_calls_are_served_in_arrival_order(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "batch", 10, burst=5, clock=clock)  # a slot every 0.1 s
    waits = [(await limiter._run("reserve", "", cost))[1] for cost in (5, 1, 5, 1)]
    # Neither jumps the other: the cheap call after a costly one waits one
    # interval, the costly one after it waits for its five slots, and the
    # cheap one behind that waits for those.
    assert waits == pytest.approx([0.0, 0.1, 0.6, 0.7])


async def test_a_costly_slot_further_than_the_blocking_timeout_is_not_reserved(
    client: redis.asyncio.Redis, clock: FakeClock
) -> None:
    limiter = AsyncRateLimiter(client, "batch", 10, burst=5, clock=clock)
    assert await limiter.acquire(cost=5)
    before = await client.get(limiter.key)
    assert not await limiter.acquire(blocking_timeout=0.25, cost=3)  # its three slots are 0.3 s away
    assert await client.get(limiter.key) == before


async def test_a_cancelled_costly_wait_gives_all_its_slots_back(client: redis.asyncio.Redis, clock: FakeClock) -> None:
    limiter = AsyncRateLimiter(client, "batch", 1, burst=5, clock=clock)  # a slot a second
    assert await limiter.acquire(cost=5)
    after_first = await client.get(limiter.key)
    with anyio.move_on_after(0.2) as scope:
        await limiter.acquire(cost=3)  # its slots are 3 s away
    assert scope.cancelled_caught
    assert await client.get(limiter.key) == after_first
    _, wait, _ = await limiter._run("reserve", "")
    assert wait == pytest.approx(1.0)  # the next call is not delayed by the three given back


# --- the script against a model --------------------------------------------------


@dataclass
class Model:
    """GCRA with a cost, as a few lines of Python, in integer microseconds.

    Written from the definition rather than from the script: a call of
    cost k moves the TAT on by k intervals, and is allowed once the new
    TAT is no more than ``burst`` intervals ahead.
    """

    interval: int
    burst: int
    tat: int = 0

    def stored(self, now: int) -> int:
        """The TAT in Redis: its key expires when it is reached."""
        return self.tat if self.tat > now else 0

    def take(self, now: int, longest: int | None, cost: int) -> tuple[bool, int, int]:
        new_tat = max(self.stored(now), now) + cost * self.interval
        wait = max(0, new_tat - self.burst * self.interval - now)
        if longest is not None and wait > longest:
            return False, wait, self.stored(now)
        self.tat = new_tat
        return True, wait, new_tat

    def give_back(self, now: int, reserved: int, cost: int) -> tuple[bool, int, int]:
        if self.stored(now) != reserved:
            return False, 0, self.stored(now)
        self.tat = reserved - cost * self.interval
        return True, 0, self.tat


@contextlib.contextmanager
def server_clock(clock: Callable[[], float]) -> Iterator[None]:
    """Have fakeredis read ``clock`` as its server's time (it reads `time.time` before each command)."""
    with mock.patch.object(fakeredis._socket._base, "time", SimpleNamespace(time=clock)):
        yield


operations = st.lists(
    st.tuples(
        # Microseconds to advance first: often none or little, so that a
        # return finds its slots still ahead.
        st.just(0) | st.integers(min_value=0, max_value=100_000) | st.integers(min_value=0, max_value=3_000_000),
        st.sampled_from(["try", "reserve", "return"]),
        st.one_of(st.none(), st.integers(min_value=0, max_value=2_000_000)),
        st.integers(min_value=0, max_value=4),  # the cost, less one, modulo the burst
        st.integers(min_value=0, max_value=3),  # which grant a return gives back, counted from the last
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rate=st.integers(min_value=1, max_value=50),
    per=st.sampled_from([0.5, 1.0, 2.0]),
    burst=st.integers(min_value=1, max_value=5),
    steps=operations,
)
def test_the_script_matches_the_model(
    rate: int, per: float, burst: int, steps: list[tuple[int, str, int | None, int, int]]
) -> None:
    now = [1_700_000_000_000_000]

    async def run() -> None:
        client = fakeredis.FakeAsyncRedis()
        limiter = AsyncRateLimiter(client, "model", rate, per, burst=burst, clock=lambda: now[0] / 1e6)
        model = Model(limiter._interval_us, burst)
        granted_so_far: list[tuple[int, int]] = []  # (the TAT each grant left, its cost)
        for advance, mode, longest, extra, back in steps:
            now[0] += advance
            if mode == "return":
                if not granted_so_far:
                    continue
                reserved, cost = granted_so_far[-1 - back % len(granted_so_far)]
                if reserved <= now[0]:
                    continue  # a wait is cancelled before its slot, so before the TAT it left
                expected = model.give_back(now[0], reserved, cost)
                argument = str(reserved)
            else:
                cost = 1 + extra % burst
                expected = model.take(now[0], 0 if mode == "try" else longest, cost)
                argument = "" if mode == "try" or longest is None else str(longest)
            granted, wait, tat = await limiter._run(mode, argument, cost)
            # A refusal's TAT is the key as read, which may outlive its TAT by
            # up to a millisecond (its TTL is in whole ones): not the model's.
            assert (granted, round(wait * 1e6), tat if granted else None) == (
                expected[0],
                expected[1],
                expected[2] if expected[0] else None,
            )
            if granted and mode != "return":
                granted_so_far.append((tat, cost))
        await client.aclose()

    # The limiter's key expires when its TAT is reached, on the server's clock;
    # the model's premise is that the server's clock is the one the limiter is
    # given. On fakeredis's own (real) clock, a step slower than the key's few
    # milliseconds to live -- on a loaded machine -- would find it gone early.
    with server_clock(lambda: now[0] / 1e6):
        asyncio.run(run())


# --- many processes ----------------------------------------------------------------

RATE, BURST, SECONDS, WORKERS = 5, 1, 10.0, 4

WORKER = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from aiosem import AsyncRateLimiter
    from aiosem._urls import close, connect

    async def main(url):
        client = connect(url)
        limiter = AsyncRateLimiter(client, "crawl", {rate}, burst={burst})
        grants = []
        async def loop(until):
            while (left := until - time.perf_counter()) > 0:
                if await limiter.acquire(blocking_timeout=left):
                    grants.append(time.perf_counter())
        await client.ping()
        print("ready", flush=True)
        start = float(await asyncio.to_thread(sys.stdin.readline))
        await asyncio.sleep(start - time.perf_counter())
        await asyncio.gather(*(loop(start + {seconds}) for _ in range(3)))
        print(json.dumps(grants))
        await close(client)

    asyncio.run(main(sys.argv[1]))
    """
).format(rate=RATE, burst=BURST, seconds=SECONDS)


def check_windows(grants: list[float], started: float) -> None:
    """No 1 s window holds more than rate + burst grants; the total is at most the ideal, and not far below it.

    A slot nobody asks for in time is lost -- as on a machine so loaded that
    every worker is between calls -- so only the upper bound is exact.
    """
    grants.sort()
    most = max(sum(1 for other in grants[i:] if other < at + 1.0) for i, at in enumerate(grants))
    assert most <= RATE + BURST, most
    ideal = RATE * SECONDS + BURST
    assert 0.9 * ideal <= len(grants) <= 1.02 * ideal, (len(grants), ideal)
    assert grants[0] >= started


@pytest.mark.slow
async def test_four_processes_share_one_rate(topology_url: str) -> None:
    workers = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER,
            topology_url,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for _ in range(WORKERS)
    ]
    grants: list[float] = []
    with anyio.fail_after(SECONDS + BOUND):
        # The window opens once every worker has started and connected: a
        # loaded machine may take seconds to start four interpreters, and the
        # slots of a window nobody is there to ask for yet are lost.
        for worker in workers:
            assert worker.stdout is not None
            assert await worker.stdout.readline() == b"ready\n"
        # time.perf_counter and the event loop's clock are both CLOCK_MONOTONIC on Linux.
        started = anyio.current_time() + 0.2
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write(f"{started!r}\n".encode())
            await worker.stdin.drain()
        for worker in workers:
            stdout, _ = await worker.communicate()
            assert worker.returncode == 0
            grants += json.loads(stdout)
    check_windows(grants, started)


@pytest.mark.slow
async def test_four_clients_share_one_rate_on_fakeredis() -> None:
    server = fakeredis.FakeServer()
    clients = [fakeredis.FakeAsyncRedis(server=server) for _ in range(WORKERS)]
    started = anyio.current_time()
    until = started + SECONDS
    grants: list[float] = []

    async def work(client: redis.asyncio.Redis) -> None:
        limiter = AsyncRateLimiter(client, "crawl", RATE, burst=BURST)
        while (left := until - anyio.current_time()) > 0:
            if await limiter.acquire(blocking_timeout=left):
                grants.append(anyio.current_time())

    with anyio.fail_after(SECONDS + BOUND):
        async with anyio.create_task_group() as tasks:
            for client in clients:
                for _ in range(3):
                    tasks.start_soon(work, client)
    check_windows(grants, started)
    for client in clients:
        await client.aclose()
