"""Held permits are kept alive in the background, and a lost one is never silent."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, PermitLost, SemaphoreError
from aiosem._core import Core
from aiosem._holding import Refresher
from aiosem._protocol import Step
from tests.harness.support import flushed_client

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tests.harness.support import RedisServer

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: The most any wait in these tests may take before the test fails.
BOUND = 15.0


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    connection = await flushed_client(redis_server)
    yield connection
    await connection.aclose()


def refreshing() -> bool:
    """Whether the loop's refresher has a round due, or one under way."""
    return Refresher.of_running_loop().busy


async def until_no_refresher() -> None:
    with anyio.fail_after(BOUND):
        while refreshing():  # noqa: ASYNC110 -- the refresher ends on its own: no event says so
            await anyio.sleep(0.01)


async def test_a_body_holding_for_five_leases_keeps_its_permit(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    # A refresh every 1/3 s: a pause of up to 2/3 s cannot lose the permit.
    holder = cls(client, "long", 1, timeout=1.0)
    other = cls(client, "long", 1, timeout=1.0)
    tries = 0
    async with holder as permit:
        end = anyio.current_time() + 5 * 1.0
        while anyio.current_time() < end:
            assert await other.acquire(blocking=False) is None
            tries += 1
            await anyio.sleep(0.05)
        assert await other.count() == 1
    assert tries > 10
    assert await other.count() == 0
    assert permit.identifier not in await other.holders()


async def test_deleting_the_keys_cancels_the_body_with_permit_lost(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "deleted", 1, timeout=1.5)
    entered = anyio.Event()
    started = 0.0
    with anyio.fail_after(BOUND), pytest.raises(PermitLost) as caught:  # noqa: PT012 -- the loss comes mid-body
        async with sem as permit:
            entered.set()
            await client.delete(sem.key, f"{sem.key}:owner")
            started = anyio.current_time()
            await anyio.sleep_forever()
    assert caught.value.identifier == permit.identifier
    # Noticed by the next refresh: within a refresh interval (0.5 s), and
    # ample slack for a busy machine.
    assert anyio.current_time() - started < 0.5 + 3.0
    await until_no_refresher()


async def test_an_outside_cancellation_stays_a_cancellation(cls: SemaphoreClass, client: redis.asyncio.Redis) -> None:
    sem = cls(client, "outside", 1, timeout=1.5)
    entered = anyio.Event()
    with anyio.CancelScope() as scope:
        async with sem:
            entered.set()
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert await sem.count() == 0
    await until_no_refresher()


async def test_an_outside_cancellation_of_a_body_whose_permit_was_lost_stays_a_cancellation(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    lost = anyio.Event()
    sem = cls(client, "both", 1, timeout=1.5, on_lost=lambda _: lost.set())
    with anyio.CancelScope() as scope:
        async with sem:
            await client.delete(sem.key, f"{sem.key}:owner")
            with anyio.fail_after(BOUND):
                await lost.wait()
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught


async def test_with_on_lost_the_body_runs_on_and_its_end_raises_permit_lost(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    losses: list[PermitLost] = []
    noticed = anyio.Event()

    def on_lost(loss: PermitLost) -> None:
        losses.append(loss)
        noticed.set()

    sem = cls(client, "notified", 1, timeout=1.5, on_lost=on_lost)
    finished = False
    with pytest.raises(PermitLost) as caught:  # noqa: PT012 -- raised as the block ends
        async with sem:
            await client.delete(sem.key, f"{sem.key}:owner")
            with anyio.fail_after(BOUND):
                await noticed.wait()
            finished = True
    assert finished
    assert losses == [caught.value]


async def test_acquire_with_auto_refresh_keeps_the_permit_until_it_is_released(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "kept", 1, timeout=1.0)
    permit = await sem.acquire(auto_refresh=True)
    assert permit is not None
    await anyio.sleep(3 * 1.0)
    assert permit.identifier in await sem.holders()
    assert await sem.release(permit)
    await until_no_refresher()


async def test_acquire_with_auto_refresh_calls_on_lost_when_the_permit_is_lost(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "kept-lost", 1, timeout=1.5)
    noticed = anyio.Event()
    losses: list[PermitLost] = []

    def on_lost(loss: PermitLost) -> None:
        losses.append(loss)
        noticed.set()

    permit = await sem.acquire(auto_refresh=True, on_lost=on_lost)
    assert permit is not None
    await client.delete(sem.key, f"{sem.key}:owner")
    with anyio.fail_after(BOUND):
        await noticed.wait()
    assert losses[0].identifier == permit.identifier
    assert not await sem.release(permit)
    await until_no_refresher()


async def test_on_lost_without_auto_refresh_is_refused(client: redis.asyncio.Redis) -> None:
    sem = AsyncFairSemaphore(client, "refused", 1)
    with pytest.raises(ValueError, match="auto_refresh=True"):
        await sem.acquire(on_lost=lambda _: None)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"refresh_interval": 0}, ValueError, "refresh_interval must be a positive"),
        ({"refresh_interval": 10}, ValueError, r"refresh_interval must be shorter than timeout \(10 s\)"),
        ({"refresh_interval": "1"}, TypeError, "refresh_interval must be a number"),
        ({"on_lost": 3}, TypeError, "on_lost must be callable"),
    ],
)
def test_bad_holding_options_are_refused(
    cls: SemaphoreClass, options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        cls(redis.asyncio.Redis(), "bad", 1, timeout=10, **options)  # type: ignore[arg-type]


async def test_a_thousand_held_permits_are_refreshed_in_one_call_per_round(
    client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis
) -> None:
    sem = AsyncFairSemaphore(client, "many", 1000, timeout=0.9)  # a round every 0.3 s
    permits = [await sem.acquire(auto_refresh=True) for _ in range(1000)]
    await admin_client.config_resetstat()
    await anyio.sleep(1.5)
    stats = await admin_client.info("commandstats")
    scripts = stats.get("cmdstat_evalsha", {"calls": 0})["calls"]
    # About 5 rounds, each one call for all 1,000 (a call per permit would be thousands).
    assert 1 <= scripts <= 12
    holders = await sem.holders()
    assert all(permit is not None and permit.identifier in holders for permit in permits)
    await sem.aclose()
    assert await sem.count() == 0


async def test_redis_stopped_and_restarted_within_the_lease_costs_nothing(
    cls: SemaphoreClass, fresh_redis_server: RedisServer
) -> None:
    client = fresh_redis_server.client()
    sem = cls(client, "restarted", 1, timeout=4.0)
    async with sem as permit:
        await anyio.to_thread.run_sync(fresh_redis_server.save_and_stop)
        await anyio.sleep(1.0)  # refreshes fail meanwhile
        await anyio.to_thread.run_sync(lambda: fresh_redis_server.start(same_port=True))
        with anyio.fail_after(BOUND):
            while permit.identifier not in await sem.holders() or (await sem.holders())[permit.identifier] < 3.5:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    assert await sem.count() == 0
    await client.aclose()


async def test_redis_stopped_past_the_lease_raises_permit_lost(
    cls: SemaphoreClass, fresh_redis_server: RedisServer
) -> None:
    client = fresh_redis_server.client()
    sem = cls(client, "stopped", 1, timeout=1.5)
    started = 0.0
    with anyio.fail_after(BOUND), pytest.raises(PermitLost):  # noqa: PT012 -- the loss comes mid-body
        async with sem:
            await anyio.to_thread.run_sync(fresh_redis_server.stop)
            started = anyio.current_time()
            await anyio.sleep_forever()
    # Told when the lease may have run out (1.5 s), with ample slack for a busy machine.
    assert anyio.current_time() - started < 1.5 + 2.0
    await client.aclose()


async def test_nothing_keeps_refreshing_after_a_hold_ends(
    cls: SemaphoreClass, client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "ended", 1, timeout=0.6)
    async with sem:
        assert refreshing()
    await until_no_refresher()
    await admin_client.config_resetstat()
    await anyio.sleep(0.5)
    stats = await admin_client.info("commandstats")
    assert "cmdstat_evalsha" not in stats
    assert "cmdstat_exec" not in stats


async def test_aclose_gives_back_kept_permits_and_fails_waiters(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "closed", 1, timeout=5)
    permit = await sem.acquire(auto_refresh=True)
    assert permit is not None
    failures: list[BaseException] = []

    async def wait() -> None:
        try:
            await sem.acquire()
        except SemaphoreError as error:
            failures.append(error)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait)
        with anyio.fail_after(BOUND):
            while await sem.waiting() < 1:  # noqa: ASYNC110 -- the queue is in Redis
                await anyio.sleep(0.01)
        await sem.aclose()
    assert len(failures) == 1
    assert "was closed" in str(failures[0])
    assert await sem.count() == 0
    assert await sem.waiting() == 0
    await until_no_refresher()


async def test_a_body_whose_cancel_scope_is_left_out_of_order_still_gives_its_permit_back(
    cls: SemaphoreClass, client: redis.asyncio.Redis
) -> None:
    sem = cls(client, "misnested", 1)
    await sem.__aenter__()
    # A scope entered inside the block and never left: leaving the block's own scope now is out of order.
    inner = anyio.CancelScope()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="cancel scope"):
        await sem.__aexit__(None, None, None)
    inner.__exit__(None, None, None)
    assert await sem.count() == 0


async def test_a_release_that_fails_while_its_body_is_being_cancelled_is_logged(
    cls: SemaphoreClass, client: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scope cancels the block's end again as it waits for the release:
    # the release's failure, which the cancellation wins over, used to go untold.
    sem = cls(client, "failing", 1)
    send = Core.send

    def release_fails_later(self: Core, step: Step, identifier: str, loop: asyncio.AbstractEventLoop) -> Any:
        if step is not Step.RELEASE:
            return send(self, step, identifier, loop)
        answer: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.05, answer.set_exception, redis.ConnectionError("Connection refused"))
        return answer

    monkeypatch.setattr(Core, "send", release_fails_later)
    with caplog.at_level(logging.WARNING, logger="aiosem"), anyio.fail_after(BOUND):
        with anyio.CancelScope() as scope:
            async with sem as permit:
                scope.cancel()
                await anyio.sleep_forever()

    (record,) = [record for record in caplog.records if "being cancelled" in record.getMessage()]
    assert permit.identifier in record.getMessage()
    assert record.exc_info is not None
    assert "Connection refused" in str(record.exc_info[1])
    monkeypatch.undo()
    assert await sem.release(permit)


def test_an_object_used_again_in_a_new_event_loop_keeps_its_permits_alive_there(
    cls: SemaphoreClass, redis_server: RedisServer
) -> None:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    sem = cls(client, "moved", 1, timeout=0.6)
    refreshed: list[bool] = []

    async def hold_past_a_refresh() -> None:
        async with sem as permit:
            hold = sem._core.holdings.get(permit.identifier)
            assert hold is not None
            confirmed = hold.confirmed_at
            with anyio.fail_after(BOUND):
                while hold.confirmed_at == confirmed:  # noqa: ASYNC110 -- the refresher's own record
                    await anyio.sleep(0.01)
            refreshed.append(True)
        # The loop closes with this run: its connections go with it.
        await client.connection_pool.disconnect()

    asyncio.run(hold_past_a_refresh())
    asyncio.run(hold_past_a_refresh())

    assert refreshed == [True, True]
