"""`to_the_end`: what a cancelled caller must still do is done before its cancellation goes on.

Every release of an ``async with`` block (the future of its step), every
waiter leaving the queue, and every slot a rate limit gives back goes
through it. These tests drive it with a call, or a future, that ends when
the test says, and cancel the caller in each way a user's code can:
``Task.cancel``, ``asyncio.timeout``, an anyio cancel scope -- once, or
again while the call is still under way.
"""

from __future__ import annotations

import asyncio
import gc
import sys
from typing import Any

import anyio
import pytest

from aiosem._coordination import Watchdog, to_the_end

if sys.version_info >= (3, 11):
    from asyncio import timeout as asyncio_timeout
else:  # pragma: no cover -- redis-py depends on async-timeout there
    from async_timeout import timeout as asyncio_timeout  # type: ignore[import-not-found,no-redef,unused-ignore]

#: Long enough for anything that is going to happen on an idle loop to happen.
SETTLE: float = 5.0


class Call:
    """A call that reports when it starts, and ends when the test lets it."""

    def __init__(self, result: object = "done") -> None:
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.finished = asyncio.Event()
        self.result = result

    @property
    def ended(self) -> bool:
        return self.finished.is_set()

    async def run(self) -> object:
        self.started.set()
        await self.gate.wait()
        self.finished.set()
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


async def test_returns_what_the_call_returns() -> None:
    call = Call("released")
    call.gate.set()

    assert await to_the_end(call.run(), name="a call") == "released"


async def test_raises_what_the_call_raises() -> None:
    call = Call(LookupError("gone"))
    call.gate.set()

    with pytest.raises(LookupError, match="gone"):
        await to_the_end(call.run(), name="a call")


@pytest.mark.parametrize("cancellations", [1, 2], ids=["once", "twice"])
async def test_a_task_cancelled_during_the_call_is_cancelled_once_the_call_ends(cancellations: int) -> None:
    call = Call()
    caller = asyncio.create_task(to_the_end(call.run(), name="a call"))
    await call.started.wait()

    for _ in range(cancellations):
        caller.cancel()
        await asyncio.sleep(0)
    assert not caller.done()
    call.gate.set()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, SETTLE)
    assert call.ended


async def test_returns_what_a_future_is_settled_with() -> None:
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(future.set_result, "released")

    assert await to_the_end(future, name="a future") == "released"


@pytest.mark.parametrize("cancellations", [1, 2], ids=["once", "twice"])
async def test_a_future_is_waited_for_through_a_cancellation_and_left_alone(cancellations: int) -> None:
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(to_the_end(future, name="a future"))
    await asyncio.sleep(0)

    for _ in range(cancellations):
        caller.cancel()
        await asyncio.sleep(0)
    assert not caller.done()
    assert not future.cancelled()
    future.set_result("released")

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, SETTLE)


async def test_asyncio_timeout_around_the_call_fires_once_the_call_ends() -> None:
    call = Call()
    outcome: list[str] = []

    async def caller() -> None:
        try:
            async with asyncio_timeout(0.01):
                await to_the_end(call.run(), name="a call")
            outcome.append("went on")  # pragma: no cover -- the timeout skips it
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11, async_timeout's before
            outcome.append("timed out, the call " + ("ended" if call.ended else "not ended"))

    task = asyncio.create_task(caller())
    await call.started.wait()
    await asyncio.sleep(0.05)  # well past the timeout: the call holds it off
    assert not task.done()
    call.gate.set()

    await asyncio.wait_for(task, SETTLE)
    assert outcome == ["timed out, the call ended"]


async def test_an_anyio_cancel_scope_cancelled_during_the_call_ends_the_scope_once_the_call_ends() -> None:
    call = Call()
    after: list[str] = []

    async def caller(scope: anyio.CancelScope) -> None:
        with scope:
            await to_the_end(call.run(), name="a call")
            after.append("went on")  # pragma: no cover -- the scope skips it
        after.append("left the scope")

    scope = anyio.CancelScope()
    task = asyncio.create_task(caller(scope))
    await call.started.wait()

    scope.cancel()
    for _ in range(10):  # anyio would deliver again on every turn of the loop
        await asyncio.sleep(0)
    assert not task.done()
    call.gate.set()

    await asyncio.wait_for(task, SETTLE)
    assert after == ["left the scope"]
    assert call.ended


async def test_a_call_longer_than_its_bound_raises_timeout_and_goes_on_in_the_background() -> None:
    call = Call()

    with pytest.raises(TimeoutError, match=r"a slow call took longer than 0\.05 s"):
        await to_the_end(call.run(), name="a slow call", seconds=0.05)

    assert not call.ended
    call.gate.set()
    await asyncio.wait_for(call.finished.wait(), SETTLE)


async def test_a_cancelled_caller_whose_call_outlasts_the_bound_is_cancelled_at_the_bound() -> None:
    call = Call()
    caller = asyncio.create_task(to_the_end(call.run(), name="a slow call", seconds=0.05))
    await call.started.wait()

    caller.cancel()

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, SETTLE)
    assert not call.ended
    call.gate.set()


# --- the bound: one timer for the calls of a loop bounded alike ------------------------------


async def test_calls_bounded_alike_share_one_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[int]] = [loop.create_future() for _ in range(50)]
    timers: list[float] = []
    call_at = loop.call_at

    def counted_call_at(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        timers.append(when)
        return call_at(when, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counted_call_at)
    callers = [asyncio.create_task(to_the_end(future, name="a release", seconds=30)) for future in futures]
    await asyncio.sleep(0)  # all of them waiting
    monkeypatch.undo()

    assert len(timers) == 1
    for value, future in enumerate(futures):
        future.set_result(value)
    assert await asyncio.wait_for(asyncio.gather(*callers), SETTLE) == list(range(50))


async def test_a_call_times_out_at_its_own_bound_after_the_call_before_it_ended() -> None:
    loop = asyncio.get_running_loop()
    first, second = Call(), Call()
    earlier = asyncio.create_task(to_the_end(first.run(), name="the first call", seconds=0.2))
    await first.started.wait()
    await asyncio.sleep(0.1)
    started = loop.time()
    later = asyncio.create_task(to_the_end(second.run(), name="the second call", seconds=0.2))
    await second.started.wait()
    first.gate.set()
    assert await asyncio.wait_for(earlier, SETTLE) == "done"

    with pytest.raises(TimeoutError, match="the second call took longer"):
        await asyncio.wait_for(later, SETTLE)
    # Not at the first call's bound, which the one timer was set for first.
    assert loop.time() - started >= 0.2 - 0.01
    second.gate.set()


async def test_a_future_that_fails_after_its_waiter_timed_out_is_not_reported_as_never_retrieved() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    future: asyncio.Future[int] = loop.create_future()

    with pytest.raises(TimeoutError):
        await to_the_end(future, name="a release", seconds=0.01)
    future.set_exception(ConnectionError("the connection failed"))
    await asyncio.sleep(0)  # its done callbacks run
    del future
    gc.collect()

    assert reported == []


async def test_a_name_given_as_a_callable_is_made_only_for_a_timeout() -> None:
    made: list[str] = []

    def name() -> str:
        made.append("the release of a permit")
        return made[-1]

    call = Call("released")
    call.gate.set()
    assert await to_the_end(call.run(), name=name) == "released"  # a task: named after it
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    future.set_result("released")
    assert await to_the_end(future, name=name) == "released"
    assert made == ["the release of a permit"]

    with pytest.raises(TimeoutError, match=r"the release of a permit took longer than 0\.01 s"):
        await to_the_end(asyncio.get_running_loop().create_future(), name=name, seconds=0.01)
    assert len(made) == 2


# --- the watchdog that bounds these waits, and queued waiters' deadlines ---------------------


class _Due(Exception):
    """What the watchdog under test fails a future with when it comes due."""


async def test_a_watchdog_settles_each_future_it_watches_when_due_and_none_unwatched() -> None:
    loop = asyncio.get_running_loop()
    watchdog = Watchdog(_Due)
    now = loop.time()
    first, unwatched, last = loop.create_future(), loop.create_future(), loop.create_future()
    watchdog.watch(first, now + 0.05)
    watchdog.watch(unwatched, now + 0.1)
    watchdog.watch(last, now + 0.2)
    watchdog.unwatch(unwatched)
    with pytest.raises(_Due):
        await asyncio.wait_for(first, SETTLE)
    assert not last.done()  # one timer, moved on to the next still watched
    with pytest.raises(_Due):
        await asyncio.wait_for(last, SETTLE)
    assert loop.time() >= now + 0.2 - 0.001  # the loop's clock may fire a timer a resolution early
    await asyncio.sleep(0.05)
    assert not unwatched.done()


async def test_a_watchdog_leaves_a_future_settled_meanwhile_as_it_is() -> None:
    loop = asyncio.get_running_loop()
    watchdog = Watchdog(_Due)
    settled = loop.create_future()
    watchdog.watch(settled, loop.time() + 0.01)
    settled.set_result("granted")
    await asyncio.sleep(0.05)
    assert settled.result() == "granted"
