"""Helpers of the tests of `limit_concurrency`, `limiter` and `configure`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import anyio

import aiosem
from aiosem import _config, _loop_cache

if TYPE_CHECKING:
    from collections.abc import Callable

    import pytest

#: The environment variables aiosem reads; a test sets them itself, or none is set.
ENVIRONMENT = ("AIOSEM_REDIS_URL", "WEB_CONCURRENCY", "SERVER_SOFTWARE")


def isolate(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Start from a clean configuration and environment.

    The test's own client fixtures are set up here, first, so that they
    are torn down last: aiosem is closed before its clients are.
    """
    for variable in ENVIRONMENT:
        monkeypatch.delenv(variable, raising=False)
    _config._reset()
    for name in ("client", "real_client"):
        if name in request.fixturenames:
            request.getfixturevalue(name)


async def close_and_settle() -> None:
    """Close aiosem in this loop; then every task must end by itself.

    Within 5 s: the loop's refresher may sleep until the round it had
    planned, a refresh interval (by default a third of the 10 s lease)
    after the last permit was dropped. `test_config` checks at once.
    """
    await aiosem.aclose()
    await assert_no_task_left(within=5.0)


async def assert_no_task_left(within: float) -> None:
    """Every task but the current one ends within ``within`` seconds, without anyone's help."""
    others = {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}
    if others:
        _, pending = await asyncio.wait(others, timeout=within)
        assert not pending, f"tasks left running: {pending}"


async def wait_until(condition: Callable[[], object], within: float = 5.0) -> None:
    """Wait until ``condition()`` holds, checking every millisecond or so; fail after ``within`` seconds.

    For states nothing signals (a waiter queued in Redis, a task ended):
    the condition is the proof, never the time waited.
    """
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 -- nothing to wait on: the state is someone else's
            await anyio.sleep(0.001)


class Gate:
    """Counts the calls inside a limited body, and holds them there until opened.

    ``inside`` is how many are in now, ``peak`` the most ever at once;
    `arrived` is set once ``expected`` calls are inside at the same time.
    """

    def __init__(self, expected: int = 1) -> None:
        self.expected = expected
        self.inside = 0
        self.peak = 0
        self.entered = 0
        self.arrived = asyncio.Event()
        self.open = asyncio.Event()

    async def pass_through(self) -> None:
        self.inside += 1
        self.entered += 1
        self.peak = max(self.peak, self.inside)
        if self.inside >= self.expected:
            self.arrived.set()
        try:
            await self.open.wait()
        finally:
            self.inside -= 1


def state() -> _loop_cache.LoopState:
    """The aiosem state of the running event loop (it must exist)."""
    found = _loop_cache._states.get(asyncio.get_running_loop())
    assert found is not None
    return found
