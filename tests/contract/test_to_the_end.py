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
import sys

import anyio
import pytest

from aiosem._coordination import to_the_end

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
