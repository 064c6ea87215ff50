"""What a cycle costs in lookups: of the running event loop, of anyio's backend, and in timers.

On CPython 3.10 and 3.11, `asyncio.get_running_loop` checks the loop's
process id with a ``getpid`` system call each time. A call of the object's
looks the loop up once, when it binds the object, and hands it on; the
steps, which carry many calls each, look it up a few times more.

An ``async with`` block makes a cancel scope, and each step one more: made
through `anyio.CancelScope`, each asks which library runs and for its
backend, several times what the scope itself costs. And the release of
every block is bounded: by one timer for all the releases of a loop, not
one set and cancelled for each.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import redis.asyncio

#: Coroutines, limit and cycles each: the contended loop of the throughput benchmark, shortened.
COROUTINES = 64
LIMIT = 16
CYCLES_EACH = 10
#: Lookups per cycle at most: one for each of the cycle's two calls, and what its share of a step takes.
MOST_PER_CYCLE = 4


class LookupCounter:
    """Counts the calls of `asyncio.get_running_loop` made from aiosem's own code."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = asyncio.get_running_loop

    def __call__(self) -> asyncio.AbstractEventLoop:
        if sys._getframe(1).f_globals.get("__name__", "").startswith("aiosem"):
            self.calls += 1
        return self._original()


async def contend(cycle: Callable[[], Awaitable[None]]) -> None:
    """Run ``cycle`` in `COROUTINES` coroutines at once, all of them within a minute."""
    await asyncio.wait_for(asyncio.gather(*(cycle() for _ in range(COROUTINES))), 60)


@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
async def test_a_contended_cycle_looks_up_the_running_loop_a_few_times(
    real_client: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore],
) -> None:
    sem = cls(real_client, f"lookups-{cls.__name__}", LIMIT)

    async def cycle_repeatedly() -> None:
        for _ in range(CYCLES_EACH):
            permit = await sem.acquire()
            assert permit is not None
            await asyncio.sleep(0)
            assert await sem.release(permit)

    # Warm: the scripts loaded, the lanes made.
    await contend(cycle_repeatedly)
    counter = LookupCounter()
    monkeypatch.setattr(asyncio, "get_running_loop", counter)
    await contend(cycle_repeatedly)
    monkeypatch.undo()
    assert counter.calls > 0  # the count sees aiosem's lookups
    assert counter.calls <= MOST_PER_CYCLE * COROUTINES * CYCLES_EACH
    await sem.aclose()


async def cycle_in_blocks(sem: AsyncFairSemaphore | AsyncLockedSemaphore) -> None:
    for _ in range(CYCLES_EACH):
        async with sem:
            await asyncio.sleep(0)


@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
async def test_a_contended_block_makes_its_cancel_scopes_without_asking_anyio_for_its_backend(
    real_client: redis.asyncio.Redis,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore],
) -> None:
    sem = cls(real_client, f"scopes-{cls.__name__}", LIMIT)
    await contend(lambda: cycle_in_blocks(sem))
    dispatched = 0
    dispatch = anyio.CancelScope.__new__

    def counted_dispatch(scope_class: type[anyio.CancelScope], **options: Any) -> anyio.CancelScope:
        nonlocal dispatched
        dispatched += 1
        return dispatch(scope_class, **options)

    monkeypatch.setattr(anyio.CancelScope, "__new__", counted_dispatch)
    await contend(lambda: cycle_in_blocks(sem))
    monkeypatch.undo()

    assert dispatched == 0
    await sem.aclose()


async def test_a_contended_block_sets_no_timer_of_its_own_for_its_release(
    real_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sem = AsyncFairSemaphore(real_client, "timers", LIMIT)
    await contend(lambda: cycle_in_blocks(sem))
    loop = asyncio.get_running_loop()
    timers = 0
    call_at = loop.call_at

    def counted_call_at(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        nonlocal timers
        if sys._getframe(1).f_globals.get("__name__", "").startswith("aiosem"):
            timers += 1
        return call_at(when, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counted_call_at)
    await contend(lambda: cycle_in_blocks(sem))
    monkeypatch.undo()

    # What is left: the refresher's timer, set again whenever the object's
    # holders all left together, once a step.
    assert timers <= COROUTINES * CYCLES_EACH / 2
    await sem.aclose()
