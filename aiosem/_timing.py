"""Deadlines, bounds and polling back-off, shared by every loop that waits."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Final

import anyio
import redis

if TYPE_CHECKING:
    from types import TracebackType

#: The least time a call to Redis is given before it is presumed stalled.
SHORTEST_STEP_BOUND: Final = 5.0


def step_bound(lease: float) -> float:
    """How long one step of a semaphore with ``lease`` may take, retries included: a lease, and at least 5 s."""
    return max(lease, SHORTEST_STEP_BOUND)


#: The first pause of a polling loop, and the longest.
_FIRST_PAUSE = 0.001
_LONGEST_PAUSE = 0.05


class Deadline:
    """A point on the event loop's clock; ``None`` seconds never arrive."""

    __slots__ = ("_at",)

    def __init__(self, seconds: float | None) -> None:
        self._at = None if seconds is None else anyio.current_time() + seconds

    def remaining(self) -> float | None:
        """Seconds left (never negative), or ``None`` for no deadline."""
        if self._at is None:
            return None
        return max(0.0, self._at - anyio.current_time())

    def passed(self) -> bool:
        return self._at is not None and anyio.current_time() >= self._at


class Backoff:
    """Exponential back-off with jitter for polling loops.

    Pauses double from 1 ms to at most ``longest`` (50 ms unless told), and
    each is drawn uniformly from its upper half so that pollers started
    together drift apart: no hot loop, and no herd arriving in step.
    """

    __slots__ = ("_ceiling", "_longest")

    def __init__(self, longest: float = _LONGEST_PAUSE) -> None:
        self._ceiling = _FIRST_PAUSE
        self._longest = longest

    async def pause(self, deadline: Deadline) -> None:
        """Sleep for the next pause, cut short by ``deadline``."""
        pause = random.uniform(self._ceiling / 2, self._ceiling)  # noqa: S311 -- jitter, not secrets
        self._ceiling = min(self._ceiling * 2, self._longest)
        remaining = deadline.remaining()
        if remaining is not None:
            pause = min(pause, remaining)
        await anyio.sleep(pause)


class Bound:
    """A bound on calls to Redis, so that a stalled connection cannot hang them.

    A client with no ``socket_timeout`` waits for ever on a connection that
    stalls without closing; past ``seconds``, the block is cancelled and
    `redis.TimeoutError` raised, naming ``what``. ``spent`` is how much of
    the bound the call already spent before the block: waiting behind an
    earlier call, say.

        with Bound(5.0, "a step of semaphore 'db'"):
            await client.evalsha(...)
    """

    __slots__ = ("_scope", "_seconds", "_spent", "_what")

    def __init__(self, seconds: float, what: str, *, spent: float = 0.0) -> None:
        self._seconds = seconds
        self._spent = spent
        self._what = what
        self._scope = anyio.move_on_after(max(0.0, seconds - spent))

    def __enter__(self) -> None:
        self._scope.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._scope.__exit__(exc_type, exc, traceback)
        if self._scope.cancelled_caught:
            waited = f", {self._spent:.2f} s of it waiting for an earlier call" if self._spent > 0 else ""
            raise redis.TimeoutError(f"{self._what} got no answer within {self._seconds:g} s{waited}; given up")
