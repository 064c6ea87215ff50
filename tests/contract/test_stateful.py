"""Both semaphores against a reference model, with time driven by hand.

Hypothesis runs random sequences of grants, refreshes, releases and clock
jumps through a semaphore whose ``clock`` the test moves, and checks every
answer -- fencing tokens included -- against a few lines of plain Python
that state what a leased counting semaphore is.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import fakeredis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, Permit
from tests.harness.support import FakeClock, RedisServer

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    import redis.asyncio

LEASE = 10.0
T = TypeVar("T")


@dataclass
class Model:
    """A leased counting semaphore, as simply as it can be said."""

    limit: int
    #: identifier -> (time of grant or last refresh, fencing token)
    holders: dict[str, tuple[float, int]] = field(default_factory=dict)
    counter: int = 0

    def reap(self, now: float) -> None:
        self.holders = {i: held for i, held in self.holders.items() if held[0] > now - LEASE}

    def acquire(self, identifier: str, now: float) -> int:
        self.reap(now)
        if len(self.holders) >= self.limit:
            return 0
        # Tokens never fall below the clock in microseconds.
        self.counter = max(self.counter + 1, math.floor(now * 1_000_000))
        self.holders[identifier] = (now, self.counter)
        return self.counter

    def refresh(self, identifier: str, now: float) -> bool:
        self.reap(now)
        if identifier not in self.holders:
            return False
        self.holders[identifier] = (now, self.holders[identifier][1])
        return True

    def release(self, identifier: str, now: float) -> bool:
        self.reap(now)
        return self.holders.pop(identifier, None) is not None


class SemaphoreMachine(RuleBasedStateMachine):
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore]
    connect: Callable[[], redis.asyncio.Redis]

    permits = Bundle("permits")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.client = self.connect()
        self.clock = FakeClock()
        self.model = Model(limit=0)
        self.sem: AsyncFairSemaphore | AsyncLockedSemaphore | None = None

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def semaphore(self) -> AsyncFairSemaphore | AsyncLockedSemaphore:
        assert self.sem is not None
        return self.sem

    @rule(limit=st.integers(min_value=1, max_value=3))
    def create(self, limit: int) -> None:
        if self.sem is None:
            # A fresh name per run: the counter starts at 0, as the model's does.
            self.sem = self.cls(self.client, f"model-{secrets.token_hex(8)}", limit, timeout=LEASE, clock=self.clock)
            self.model.limit = limit

    @rule(target=permits)
    def acquire(self) -> Any:
        if self.sem is None:
            return multiple()
        permit = self.run(self.semaphore().acquire(blocking=False))
        expected = self.model.acquire(permit.identifier if permit else "", self.clock.now)
        assert (permit.fencing_token if permit else 0) == expected
        return permit if permit is not None else multiple()

    @rule(permit=permits)
    def refresh(self, permit: Permit) -> None:
        assert self.run(self.semaphore().refresh(permit)) == self.model.refresh(permit.identifier, self.clock.now)

    @rule(permit=consumes(permits))
    def release(self, permit: Permit) -> None:
        assert self.run(self.semaphore().release(permit)) == self.model.release(permit.identifier, self.clock.now)

    @rule(permit=permits)
    def release_again(self, permit: Permit) -> None:
        assert self.run(self.semaphore().release(permit)) == self.model.release(permit.identifier, self.clock.now)

    @rule(seconds=st.floats(min_value=0, max_value=2 * LEASE, allow_nan=False))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def advance_to_the_edge_of_a_lease(self) -> None:
        # Land exactly on, or just before, the moment the oldest lease ends.
        if self.model.holders:
            oldest = min(stamp for stamp, _ in self.model.holders.values())
            self.clock.now = oldest + LEASE - 1e-3

    @invariant()
    def count_matches(self) -> None:
        if self.sem is not None:
            self.model.reap(self.clock.now)
            assert self.run(self.sem.count()) == len(self.model.holders)

    def teardown(self) -> None:
        self.run(self.client.aclose())
        self.loop.close()


@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
@pytest.mark.parametrize("backend", ["redis", "fakeredis"])
def test_semaphore_matches_the_model(
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore], backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        connect: Callable[[], redis.asyncio.Redis] = server.client
    else:
        connect = fakeredis.FakeAsyncRedis

    machine = type(f"{cls.__name__}Machine", (SemaphoreMachine,), {"cls": cls, "connect": staticmethod(connect)})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
