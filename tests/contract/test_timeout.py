"""`Timeout` and `Bound`: a deadline for a block, as ``asyncio.timeout_at``, on one timer per event loop.

Every step to Redis runs under a `Bound`, and every batch's replies are
read under a `Timeout` of the socket's. These tests hold them to what
`asyncio.timeout` promises: the block is cancelled at its deadline and
raises a timeout in place of the cancellation; a cancellation from
anywhere else goes through as it came; the task's count of cancellations
is left as it was found. And to what they add: a block that swallows the
cancellation is cancelled again, and blocks entered one after another set
one timer between them, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import weakref
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis

from aiosem._timing import Bound, Timeout

if TYPE_CHECKING:
    from collections.abc import Callable

    from typing_extensions import Self

if sys.version_info >= (3, 11):
    from asyncio import timeout as asyncio_timeout
else:  # pragma: no cover -- redis-py depends on async-timeout there
    from async_timeout import timeout as asyncio_timeout  # type: ignore[import-not-found,no-redef,unused-ignore]

#: Long enough for anything that is going to happen on an idle loop to happen.
SETTLE: float = 5.0
#: A deadline that comes soon, in seconds.
SOON: float = 0.05

counts_cancellations = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="Python 3.10's tasks do not count cancellations: any is taken for the deadline's"
)


def after(seconds: float) -> float:
    """The loop time ``seconds`` from now."""
    return asyncio.get_running_loop().time() + seconds


def cancellations_requested() -> int:
    """How many cancellations of the running task are in force (0 on Python 3.10, which does not count them)."""
    task = asyncio.current_task()
    assert task is not None
    if sys.version_info >= (3, 11):
        return task.cancelling()
    return 0  # pragma: no cover


async def test_a_block_past_its_deadline_raises_a_timeout_at_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()

    with anyio.fail_after(SETTLE), pytest.raises(asyncio.TimeoutError), Timeout(SOON):
        await asyncio.sleep(SETTLE)

    assert loop.time() - started + 0.002 >= SOON
    assert cancellations_requested() == 0


async def test_a_bound_past_its_deadline_raises_a_redis_timeout_that_names_the_call() -> None:
    with anyio.fail_after(SETTLE), pytest.raises(redis.TimeoutError) as raised, Bound(SOON, "a step of 'db'"):
        await asyncio.sleep(SETTLE)

    assert str(raised.value) == f"a step of 'db' got no answer within {SOON:g} s; given up"
    assert raised.value.__cause__ is None
    assert cancellations_requested() == 0


async def test_a_bound_counts_what_its_call_spent_waiting_before_the_block() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()

    with anyio.fail_after(SETTLE), pytest.raises(redis.TimeoutError) as raised, Bound(SETTLE, "a step", spent=SETTLE):
        await asyncio.sleep(SETTLE)

    assert loop.time() - started < SETTLE / 2
    assert "5.00 s of it waiting for an earlier call" in str(raised.value)


async def test_a_block_that_ends_in_time_is_left_alone_after_its_deadline() -> None:
    with Timeout(SOON):
        await asyncio.sleep(0)

    await asyncio.sleep(SOON * 2)  # no cancellation is left for after the block

    assert cancellations_requested() == 0


@counts_cancellations
async def test_a_cancellation_from_elsewhere_goes_through_as_it_came() -> None:
    entered = asyncio.Event()

    async def block() -> None:
        with Timeout(SETTLE):
            entered.set()
            await asyncio.sleep(SETTLE)

    task = asyncio.create_task(block())
    await entered.wait()
    task.cancel()

    with anyio.fail_after(SETTLE), pytest.raises(asyncio.CancelledError):
        await task


@counts_cancellations
async def test_a_cancellation_from_elsewhere_meeting_the_deadline_goes_through_as_it_came() -> None:
    entered = asyncio.Event()
    deadline: list[float] = []

    async def block() -> None:
        with Timeout(SOON) as timeout:
            deadline.append(timeout.when() or 0.0)
            entered.set()
            await asyncio.sleep(SETTLE)

    task = asyncio.create_task(block())
    await entered.wait()
    # Cancelled from a timer due at the same time as the deadline's: both reach the task before it runs.
    asyncio.get_running_loop().call_at(deadline[0], task.cancel)

    with anyio.fail_after(SETTLE), pytest.raises(asyncio.CancelledError):
        await task


async def test_a_block_that_swallows_the_cancellation_is_cancelled_again_until_it_ends() -> None:
    swallowed: list[str] = []

    async def swallow_once() -> None:
        with Timeout(SOON):
            try:
                await asyncio.sleep(SETTLE)
            except asyncio.CancelledError:
                swallowed.append("once")  # as redis-py's wait_for may, on Python 3.10 and 3.11
            await asyncio.sleep(SETTLE)

    with anyio.fail_after(SETTLE), pytest.raises(asyncio.TimeoutError):
        await swallow_once()

    assert swallowed == ["once"]
    assert cancellations_requested() == 0


async def test_a_block_that_swallows_the_cancellation_and_ends_raises_nothing() -> None:
    with Timeout(SOON), contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(SETTLE)

    await asyncio.sleep(SOON * 2)
    assert cancellations_requested() == 0


async def test_an_inner_deadline_that_comes_first_is_the_inners_alone() -> None:
    with Timeout(SETTLE) as outer:
        with pytest.raises(redis.TimeoutError, match="inner"), Bound(SOON, "inner"):
            await asyncio.sleep(SETTLE)
        await asyncio.sleep(0)  # the outer block goes on

    assert outer.when() is not None
    assert cancellations_requested() == 0


async def test_an_outer_deadline_that_comes_first_passes_through_the_inner_block() -> None:
    inner_saw: list[type[BaseException]] = []

    async def nested() -> None:
        with Bound(SOON, "outer"):
            try:
                with Bound(SETTLE, "inner"):
                    await asyncio.sleep(SETTLE)
            except BaseException as error:
                inner_saw.append(type(error))
                raise

    with anyio.fail_after(SETTLE), pytest.raises(redis.TimeoutError, match="outer"):
        await nested()

    assert inner_saw == [asyncio.CancelledError]


@counts_cancellations
async def test_an_asyncio_timeout_around_it_that_comes_first_is_asyncios() -> None:
    async def inside_asyncios() -> None:
        async with asyncio_timeout(SOON):
            with Timeout(SETTLE):
                await asyncio.sleep(SETTLE)

    with anyio.fail_after(SETTLE), pytest.raises(TimeoutError):
        await inside_asyncios()

    assert cancellations_requested() == 0


async def test_an_anyio_scope_around_it_that_comes_first_is_anyios() -> None:
    with anyio.fail_after(SETTLE):
        with anyio.move_on_after(SOON) as scope, Timeout(SETTLE):
            await asyncio.sleep(SETTLE)

    assert scope.cancelled_caught
    assert cancellations_requested() == 0


async def test_a_timeout_inside_a_shielded_anyio_scope_still_ends_its_block() -> None:
    async def shielded() -> None:
        with anyio.CancelScope(shield=True), Timeout(SOON):
            await asyncio.sleep(SETTLE)

    with anyio.fail_after(SETTLE), pytest.raises(asyncio.TimeoutError):
        await shielded()


async def test_rescheduled_to_none_it_never_expires() -> None:
    with Timeout(SOON) as timeout:
        timeout.reschedule(None)
        assert timeout.when() is None
        await asyncio.sleep(SOON * 3)


async def test_rescheduled_earlier_it_expires_at_the_new_deadline() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()

    deadlines: list[float | None] = []

    async def rescheduled() -> None:
        with Timeout(SETTLE) as timeout:
            timeout.reschedule(after(SOON))
            deadlines.append(timeout.when())
            await asyncio.sleep(SETTLE)

    with anyio.fail_after(SETTLE), pytest.raises(asyncio.TimeoutError):
        await rescheduled()

    assert deadlines == [pytest.approx(started + SOON, abs=0.01)]

    assert loop.time() - started < SETTLE / 2


async def test_rescheduled_later_it_expires_at_the_new_deadline_not_the_old() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def rescheduled() -> None:
        with Timeout(SOON) as timeout:
            timeout.reschedule(after(SOON * 4))
            await asyncio.sleep(SETTLE)

    with anyio.fail_after(SETTLE), pytest.raises(asyncio.TimeoutError):
        await rescheduled()

    assert loop.time() - started >= SOON * 4 - 0.002


class CountingTimers:
    """Counts the timers a loop is asked to set, by wrapping its ``call_at``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        call_at = loop.call_at

        def counted(when: float, callback: Callable[..., object], *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            self.count += 1
            return call_at(when, callback, *args, **kwargs)

        monkeypatch.setattr(loop, "call_at", counted)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        pass


async def test_blocks_entered_one_after_another_set_one_timer_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with Timeout(SETTLE):
        pass  # the loop's alarm made and set, as after a first step

    with CountingTimers(asyncio.get_running_loop(), monkeypatch) as timers:
        for _ in range(1_000):
            with Bound(SETTLE, "a step"):
                await asyncio.sleep(0)

    assert timers.count <= 1


async def test_many_blocks_in_force_at_once_each_expire_at_their_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    ended: dict[float, float] = {}

    async def block(seconds: float) -> None:
        with pytest.raises(asyncio.TimeoutError), Timeout(seconds):
            await asyncio.sleep(SETTLE)
        ended[seconds] = loop.time() - started

    with anyio.fail_after(SETTLE):
        await asyncio.gather(*(block(seconds) for seconds in (0.3, 0.1, 0.2, 0.1)))

    assert sorted(ended) == [0.1, 0.2, 0.3]
    for seconds, took in ended.items():
        assert seconds - 0.002 <= took < seconds + 1.0


def test_entered_outside_a_task_it_says_so() -> None:
    loop = asyncio.new_event_loop()
    raised: list[BaseException] = []

    def enter() -> None:
        try:
            Timeout(None).__enter__()
        except RuntimeError as error:
            raised.append(error)
        loop.stop()

    try:
        loop.call_soon(enter)
        loop.run_forever()
    finally:
        loop.close()

    assert [str(error) for error in raised] == ["a Timeout must be entered in a task"]


def test_a_closed_loop_is_not_kept_alive_by_a_deadline_still_to_come() -> None:
    async def step() -> None:
        with Bound(SETTLE, "a step"):
            await asyncio.sleep(0)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(step())  # the loop's timer stays set, SETTLE ahead
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()

    assert gone() is None
