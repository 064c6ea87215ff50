"""How a `Lane` coalesces the concurrent steps of one kind.

The lane is pure coordination, so most of these tests drive it with a step
that records its batches and finishes when the test says; the last one
counts the scripts real semaphores send to a real server.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio

from aiosem import AsyncFairSemaphore
from aiosem._coordination import HOLD_TURNS, Lane, LaneOfLoop, Submission

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tests.harness.support import RedisServer

#: Long enough for anything that is going to happen on an idle loop to happen.
SETTLE: float = 5.0


#: What a test's step answers: each identifier's value, and the whole batch.
Result = tuple[tuple[int, ...], tuple[str, ...]]


class Recorder:
    """A step that records each batch, and holds it until the test lets it go."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.since: list[float | None] = []
        self.tasks: list[asyncio.Task[object] | None] = []
        self.started = asyncio.Event()
        self.gate: asyncio.Event | None = None

    async def run(self, identifiers: Sequence[str], waiting_since: float | None) -> Result:
        self.batches.append(list(identifiers))
        self.since.append(waiting_since)
        self.tasks.append(asyncio.current_task())
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        return tuple(int(identifier) for identifier in identifiers), tuple(identifiers)


async def submit(lane: Lane[tuple[str, ...]], *identifiers: str) -> Sequence[int]:
    submission: Submission[tuple[str, ...]] = Submission(identifiers)
    values, _ = await lane.submit(submission, asyncio.get_running_loop())
    return values


async def test_a_batch_runs_in_the_lanes_own_task_never_in_a_callers() -> None:
    recorder = Recorder()
    lane = Lane(recorder.run)
    caller = asyncio.current_task()
    assert await submit(lane, "1") == (1,)
    assert await submit(lane, "2", "3") == (2, 3)
    assert recorder.batches == [["1"], ["2", "3"]]
    assert all(task is not None and task is not caller for task in recorder.tasks)


async def test_calls_made_while_one_is_in_flight_go_together_in_the_next() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    lane = Lane(recorder.run)
    before = asyncio.get_running_loop().time()
    first = asyncio.create_task(submit(lane, "1"))
    await asyncio.wait_for(recorder.started.wait(), SETTLE)
    others = [asyncio.create_task(submit(lane, str(n))) for n in (2, 3, 4)]
    await asyncio.sleep(0)
    assert recorder.batches == [["1"]]
    recorder.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *others), SETTLE)
    assert results == [(1,), (2,), (3,), (4,)]
    assert recorder.batches == [["1"], ["2", "3", "4"]]
    # Each batch says since when its calls waited, so that their bound counts from their calls.
    first_since, then_since = recorder.since
    assert first_since is not None
    assert then_since is not None
    assert before <= first_since <= then_since <= asyncio.get_running_loop().time()


async def test_each_call_reads_its_own_values_and_the_whole_batchs_result() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    lane = Lane(recorder.run)
    loop = asyncio.get_running_loop()
    first = asyncio.create_task(lane.submit(Submission(("1", "2")), loop))
    second = asyncio.create_task(lane.submit(Submission(("3",)), loop))
    await asyncio.wait_for(recorder.started.wait(), SETTLE)
    recorder.gate.set()
    assert await asyncio.wait_for(first, SETTLE) == ((1, 2), ("1", "2", "3"))
    assert await asyncio.wait_for(second, SETTLE) == ((3,), ("1", "2", "3"))


async def test_the_calls_of_one_turn_go_in_one_batch() -> None:
    recorder = Recorder()
    lane = Lane(recorder.run)
    # Woken together, as a reply wakes its callers: not the first alone and the rest after it.
    together = [asyncio.create_task(submit(lane, str(n))) for n in (5, 6, 7)]
    assert await asyncio.wait_for(asyncio.gather(*together), SETTLE) == [(5,), (6,), (7,)]
    assert recorder.batches == [["5", "6", "7"]]


async def test_batches_go_in_the_order_their_calls_were_made() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    lane = Lane(recorder.run)
    calls = []
    for n in range(6):
        calls.append(asyncio.create_task(submit(lane, str(n))))
        for _ in range(n):  # arrivals spread over the turns of the first batch
            await asyncio.sleep(0)
    recorder.gate.set()
    await asyncio.wait_for(asyncio.gather(*calls), SETTLE)
    assert [identifier for batch in recorder.batches for identifier in batch] == [str(n) for n in range(6)]


async def test_a_call_cancelled_before_its_batch_starts_is_left_out_and_not_sent() -> None:
    recorder = Recorder()
    lane = Lane(recorder.run)
    cancelled: Submission[tuple[str, ...]] = Submission(("8",))
    doomed = asyncio.create_task(lane.submit(cancelled, asyncio.get_running_loop()))
    kept = asyncio.create_task(submit(lane, "9"))
    await asyncio.sleep(0)  # both are waiting for the batch that starts next turn
    doomed.cancel()
    assert await asyncio.wait_for(kept, SETTLE) == (9,)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert not cancelled.sent
    assert recorder.batches == [["9"]]


async def test_a_caller_cancelled_while_its_batch_runs_raises_at_once_and_the_batch_goes_on() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    lane = Lane(recorder.run)
    submission: Submission[tuple[str, ...]] = Submission(("4",))
    caller = asyncio.create_task(lane.submit(submission, asyncio.get_running_loop()))
    await asyncio.wait_for(recorder.started.wait(), SETTLE)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, SETTLE)  # at once: the batch is still held at its gate
    assert submission.sent  # so the caller knows to undo what the step may do
    later = asyncio.create_task(submit(lane, "5"))
    recorder.gate.set()
    assert await asyncio.wait_for(later, SETTLE) == (5,)
    assert recorder.batches == [["4"], ["5"]]


async def test_a_failing_batch_fails_every_call_in_it_and_the_lane_goes_on() -> None:
    batches: list[list[str]] = []
    gate = asyncio.Event()

    async def run(identifiers: Sequence[str], _waiting_since: float | None) -> Result:
        batches.append(list(identifiers))
        await gate.wait()
        if "bad" in identifiers:
            raise RuntimeError("the step failed")
        return tuple(0 for _ in identifiers), tuple(identifiers)

    lane = Lane(run)
    first = asyncio.create_task(submit(lane, "first"))
    await asyncio.sleep(0)
    failing = [asyncio.create_task(submit(lane, name)) for name in ("bad", "other")]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.wait_for(first, SETTLE) == (0,)
    for task in failing:
        with pytest.raises(RuntimeError, match="the step failed"):
            await asyncio.wait_for(task, SETTLE)
    assert await asyncio.wait_for(submit(lane, "later"), SETTLE) == (0,)
    assert batches == [["first"], ["bad", "other"], ["later"]]


async def test_a_lane_behind_another_lets_the_others_calls_of_its_turn_go_first() -> None:
    started: list[str] = []
    freeing, taking = Recorder(), Recorder()

    async def free(identifiers: Sequence[str], waiting_since: float | None) -> Result:
        started.append("free")
        return await freeing.run(identifiers, waiting_since)

    async def take(identifiers: Sequence[str], waiting_since: float | None) -> Result:
        started.append("take")
        return await taking.run(identifiers, waiting_since)

    frees = Lane(free)
    takes = Lane(take, behind=lambda: frees.about_to_go)
    # The take is called first; the free, in the same turn, goes first all the same.
    calls = [asyncio.create_task(submit(takes, "1")), asyncio.create_task(submit(frees, "2"))]
    assert await asyncio.wait_for(asyncio.gather(*calls), SETTLE) == [(1,), (2,)]
    assert started == ["free", "take"]


async def test_a_lane_behind_another_waits_for_no_batch_of_the_others_in_flight() -> None:
    freeing, taking = Recorder(), Recorder()
    freeing.gate = asyncio.Event()
    frees = Lane(freeing.run)
    takes = Lane(taking.run, behind=lambda: frees.about_to_go)
    in_flight = asyncio.create_task(submit(frees, "1"))
    await asyncio.wait_for(freeing.started.wait(), SETTLE)
    # Held up behind the batch in flight, the next free goes later: the take does not wait for it.
    held_up = asyncio.create_task(submit(frees, "2"))
    await asyncio.sleep(0)
    assert not frees.about_to_go
    assert await asyncio.wait_for(submit(takes, "3"), SETTLE) == (3,)
    assert freeing.batches == [["1"]]
    freeing.gate.set()
    assert list(await asyncio.wait_for(asyncio.gather(in_flight, held_up), SETTLE)) == [(1,), (2,)]
    assert freeing.batches == [["1"], ["2"]]


async def turns_until_done(task: asyncio.Task[Any], most: int = 100) -> int:
    """How many passes of the loop the test waits, from now, until ``task`` is done (at most ``most``)."""
    for turns in range(most):
        if task.done():
            return turns
        await asyncio.sleep(0)
    return most


async def test_a_lane_that_holds_answers_gives_them_with_its_next_batch() -> None:
    recorder = Recorder()
    recorder.gate = asyncio.Event()
    lane = Lane(recorder.run, hold=lambda _result: True)
    first = asyncio.create_task(submit(lane, "1"))
    await asyncio.wait_for(recorder.started.wait(), SETTLE)
    second = asyncio.create_task(submit(lane, "2"))
    await asyncio.sleep(0)  # made while the first is in flight: it goes next
    recorder.gate.set()
    recorder.gate = asyncio.Event()  # the second batch waits

    # Answered as the next batch went: sooner than held answers are given without one.
    assert await turns_until_done(first) < HOLD_TURNS
    assert await first == (1,)
    assert recorder.batches == [["1"], ["2"]]
    assert not second.done()
    recorder.gate.set()
    assert await asyncio.wait_for(second, SETTLE) == (2,)


async def test_a_lane_that_holds_answers_gives_them_a_few_turns_later_without_a_next_batch() -> None:
    held = Lane(Recorder().run, hold=lambda _result: True)
    not_held = Lane(Recorder().run)

    held_turns = await turns_until_done(asyncio.create_task(submit(held, "1")))
    turns = await turns_until_done(asyncio.create_task(submit(not_held, "1")))

    assert held_turns == turns + HOLD_TURNS


async def test_a_lane_holds_only_the_answers_its_hold_picks() -> None:
    picky = Lane(Recorder().run, hold=lambda result: "held" in result)
    not_held = Lane(Recorder().run)

    picked_turns = await turns_until_done(asyncio.create_task(submit(picky, "1")))
    turns = await turns_until_done(asyncio.create_task(submit(not_held, "1")))

    assert picked_turns == turns


async def test_a_failed_batch_is_answered_at_once_whatever_the_lane_holds() -> None:
    async def fail(_identifiers: Sequence[str], _waiting_since: float | None) -> Result:
        raise RuntimeError("the step failed")

    async def succeed(identifiers: Sequence[str], _waiting_since: float | None) -> Result:
        return tuple(0 for _ in identifiers), tuple(identifiers)

    failing = asyncio.create_task(submit(Lane(fail, hold=lambda _result: True), "1"))
    failed_turns = await turns_until_done(failing)
    turns = await turns_until_done(asyncio.create_task(submit(Lane(succeed), "1")))

    assert failed_turns == turns
    with pytest.raises(RuntimeError, match="the step failed"):
        await failing


class CountingConnection(redis.asyncio.Connection):
    """Counts the scripts written to the socket."""

    scripts = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        packed = command if isinstance(command, bytes) else b"".join(command)
        type(self).scripts += packed.count(b"EVALSHA")
        await super().send_packed_command(command, check_health)


def test_a_lane_of_loop_serves_each_event_loop_with_a_lane_of_its_own() -> None:
    recorder = Recorder()
    lanes = LaneOfLoop(recorder.run, lambda error: error)
    seen: list[Lane[tuple[str, ...]]] = []

    async def use(identifier: str) -> Sequence[int]:
        loop = asyncio.get_running_loop()
        lane = lanes.of(loop)
        assert lanes.of(loop) is lane
        seen.append(lane)
        values, _ = await asyncio.wait_for(lane.submit(Submission((identifier,)), loop), SETTLE)
        return values

    assert asyncio.run(use("1")) == (1,)
    assert asyncio.run(use("2")) == (2,)
    first, second = seen
    assert first is not second
    assert recorder.batches == [["1"], ["2"]]


async def test_holders_woken_together_release_in_one_script(redis_server: RedisServer) -> None:
    pool = redis.asyncio.ConnectionPool(
        host=redis_server.host, port=redis_server.port, connection_class=CountingConnection
    )
    client = redis.asyncio.Redis.from_pool(pool)
    sem = AsyncFairSemaphore(client, "lane-crowd", 8)
    try:
        permits = [await sem.acquire() for _ in range(8)]
        waiters = [asyncio.create_task(sem.acquire()) for _ in range(8)]
        for _ in range(100):  # bounded: all eight queue within a few round trips
            if (await sem.waiting()) == 8:
                break
            await asyncio.sleep(0.01)
        assert await sem.waiting() == 8

        async def release_all() -> list[bool]:
            return list(await asyncio.gather(*(sem.release(p) for p in permits if p is not None)))

        # The first release goes alone and the other seven together; that crowd
        # hands all eight permits over in one reply, whose eight new holders
        # then release together: one script, not one alone and then seven.
        assert all(await asyncio.wait_for(release_all(), SETTLE))
        granted = await asyncio.wait_for(asyncio.gather(*waiters), SETTLE)
        CountingConnection.scripts = 0
        assert all(await asyncio.wait_for(asyncio.gather(*(sem.release(p) for p in granted if p)), SETTLE))
        assert CountingConnection.scripts == 1
    finally:
        await client.aclose()
