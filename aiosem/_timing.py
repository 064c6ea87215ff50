"""Deadlines, bounds and the one retry back-off, shared by every loop that waits or tries again."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
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


#: The first pause of a polling loop, and the longest, unless told.
_FIRST_PAUSE: Final = 0.001
_LONGEST_PAUSE: Final = 0.05


#: The class of the running backend's cancel scopes, once one was made (see `cancel_scope`).
_scope_class: type[anyio.CancelScope] | None = None

# anyio imports its asyncio backend when the first scope is made in a running
# loop: 30-110 ms here, during which that loop -- a web server's at its
# first limited request -- runs nothing else. Imported with aiosem instead, at
# start-up; the module's name is anyio's own rule (`anyio._backends._<name>`),
# and should it change, the first scope imports the backend as before.
with contextlib.suppress(ImportError):
    importlib.import_module("anyio._backends._asyncio")


def cancel_scope(*, deadline: float = math.inf, shield: bool = False) -> anyio.CancelScope:
    """``anyio.CancelScope(deadline=..., shield=...)``, made as cheaply as a call that makes one per cycle needs.

    `anyio.CancelScope` asks which async library runs, and for its backend,
    each time: some 2 µs, where making the scope itself takes 0.7. The
    first scope tells the class the backend makes them of, and the others
    are made of it directly (aiosem runs on asyncio only, so it never
    changes). ``deadline`` is on the event loop's clock.
    """
    global _scope_class  # noqa: PLW0603 -- a cache, filled once
    if _scope_class is None:
        scope = anyio.CancelScope(deadline=deadline, shield=shield)
        _scope_class = type(scope)
        return scope
    return _scope_class(deadline=deadline, shield=shield)


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
    """The one retry policy: a pause that doubles with each failure in a row, capped, jittered.

    Every loop that tries again after a failure -- a poller finding a lock
    busy, a reader whose connection failed, a step turned away by a moving
    slot -- pauses through one of these. Pauses double from ``first`` (1 ms
    unless told) to at most ``longest`` (50 ms unless told), and each is
    drawn uniformly from the upper half of its ceiling, so that callers that
    failed together drift apart: no hot loop, and no herd arriving in step.
    A pause is cut short by a `Deadline`, if given; `reset` after a success
    starts again from ``first``.

        backoff = Backoff(1.0, first=0.05)
        while True:
            try:
                await read()
            except redis.ConnectionError:
                if not backoff.failures:
                    logger.warning("reading failed; retrying")  # once per run of failures
                await backoff.pause()
                continue
            backoff.reset()
    """

    __slots__ = ("_ceiling", "_first", "_longest", "failures")

    def __init__(self, longest: float = _LONGEST_PAUSE, *, first: float = _FIRST_PAUSE) -> None:
        self._first = first
        self._longest = longest
        self._ceiling = min(first, longest)
        #: How many pauses were taken since the start or the last `reset`: the failures in a row.
        self.failures = 0

    def __repr__(self) -> str:
        return f"Backoff(first={self._first:g}, longest={self._longest:g}, failures={self.failures})"

    def next_pause(self, deadline: Deadline | None = None) -> float:
        """Count a failure, and return how long to pause before the next try (never past ``deadline``).

        For a loop that sleeps by other means -- a timer, a wait on an event
        bounded by the pause -- rather than through `pause`.
        """
        pause = random.uniform(self._ceiling / 2, self._ceiling)  # noqa: S311 -- jitter, not secrets
        self._ceiling = min(self._ceiling * 2, self._longest)
        self.failures += 1
        remaining = None if deadline is None else deadline.remaining()
        return pause if remaining is None else min(pause, remaining)

    async def pause(self, deadline: Deadline | None = None) -> None:
        """Count a failure, and sleep before the next try, cut short by ``deadline``."""
        await anyio.sleep(self.next_pause(deadline))

    def reset(self) -> None:
        """A try succeeded: the next failure pauses ``first`` again."""
        self._ceiling = min(self._first, self._longest)
        self.failures = 0


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
        self._scope = cancel_scope(deadline=asyncio.get_running_loop().time() + max(0.0, seconds - spent))

    def __enter__(self) -> None:
        self._scope.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._scope.__exit__(exc_type, exc, traceback)
        if self._scope.cancelled_caught:
            raise overdue(self._what, self._seconds, spent=self._spent)


def overdue(what: str, seconds: float, *, spent: float = 0.0) -> redis.TimeoutError:
    """The error of a call to Redis, ``what``, that got no answer within its bound of ``seconds``.

    ``spent`` is how much of the bound went on waiting behind an earlier call.
    """
    waited = f", {spent:.2f} s of it waiting for an earlier call" if spent > 0 else ""
    return redis.TimeoutError(f"{what} got no answer within {seconds:g} s{waited}; given up")
