"""Deadlines, bounds and the one retry back-off, shared by every loop that waits or tries again."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import math
import random
import sys
import weakref
from typing import TYPE_CHECKING, ClassVar, Final

import anyio
import redis

if TYPE_CHECKING:
    from types import TracebackType

    from typing_extensions import Self

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


#: More than an event loop's clock resolution (the loop fires a timer up to that much early), nothing beside
#: a bound of seconds.
CLOCK_SLACK: Final = 0.001

#: How soon a cancellation sent to a block past its deadline is sent again, while the block swallows it:
#: redis-py's ``wait_for`` does, on Python 3.10 and 3.11, when a reply arrives with the cancellation.
_RESEND_CANCELLATION: Final = 0.01


class Timeout:
    """A deadline for a block, as ``asyncio.timeout(seconds)``, but a plain ``with`` served by one timer per event loop.

    ``seconds`` after the block is entered (``None``: never), its task is
    cancelled, and the block raises `_error` -- `asyncio.TimeoutError`,
    unless a subclass says otherwise -- in place of the cancellation. A
    cancellation from anywhere else goes through as it came, as with
    `asyncio.timeout`; on Python 3.10, whose tasks do not count them, a
    cancellation that meets the deadline is taken for the deadline's, as
    ``async_timeout`` takes it. A block that swallows the cancellation is
    sent another every 10 ms until it ends.

    A step to Redis is bounded twice, as a whole and each read. With
    `asyncio.timeout`, each bound sets a timer of its own and cancels it:
    pushed into the loop's heap by Python-level comparisons, and left there
    cancelled; an anyio cancel scope costs more again. Together they took a
    sixth of a lone step's instructions. Here one timer per event loop,
    set for the earliest deadline in force, serves them all: a deadline
    later than the one it is set for -- every bound of the same length
    entered after it -- sets nothing.

    ``when`` and ``reschedule`` are `asyncio.Timeout`'s: redis-py calls
    them on the timeout of a read whose deadline it relaxes.
    """

    __slots__ = ("_alarm", "_at", "_cancelling", "_cancels", "_seconds", "_task")

    def __init__(self, seconds: float | None) -> None:
        self._seconds = seconds
        self._at = math.inf
        self._alarm: _Alarm | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._cancels = 0

    def when(self) -> float | None:
        """The deadline, on the loop's clock; ``None`` for none."""
        return None if self._at == math.inf else self._at

    def reschedule(self, at: float | None) -> None:
        """Move the deadline to loop time ``at`` (``None``: none)."""
        self._seconds = None  # what the block is entered with, if it is not yet
        self._at = math.inf if at is None else at
        if self._alarm is not None and self._task is not None:
            self._alarm.arm(self._at, self._task.get_loop())

    def __enter__(self) -> Self:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Timeout must be entered in a task")
        self._task = task
        loop = task.get_loop()
        if self._seconds is not None:
            self._at = loop.time() + self._seconds
        if sys.version_info >= (3, 11):  # 3.10's tasks do not count cancellations
            self._cancelling = task.cancelling()
        self._alarm = _Alarm.of(loop)
        self._alarm.enter(self, loop)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._alarm is not None  # noqa: S101 -- entered
        self._alarm.leave(self)
        self._alarm = None
        task, self._task = self._task, None
        if not self._cancels or task is None:
            return
        if sys.version_info >= (3, 11):
            for _ in range(self._cancels):
                task.uncancel()
            if task.cancelling() > self._cancelling:
                return  # somebody else's cancellation came too: it goes on
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            raise self._error() from None

    def _error(self) -> BaseException:
        """What the block raises past its deadline."""
        return asyncio.TimeoutError()

    def expire(self, now: float) -> None:
        """The deadline has passed (loop time ``now``): cancel the block's task, and again soon if it goes on."""
        if self._task is None:
            return
        self._cancels += 1
        self._task.cancel()
        self._at = now + _RESEND_CANCELLATION


class _Alarm:
    """The one timer of an event loop for the `Timeout` blocks in force in it."""

    __slots__ = ("_armed_at", "_timeouts")

    #: Held weakly: the loop holds nothing of an alarm but its timer.
    _registry: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Alarm]] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        #: The blocks in force, as an ordered set.
        self._timeouts: dict[Timeout, None] = {}
        self._armed_at = math.inf

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Alarm:
        alarm = cls._registry.get(loop)
        if alarm is None:
            alarm = cls._registry[loop] = cls()
        return alarm

    def enter(self, timeout: Timeout, loop: asyncio.AbstractEventLoop) -> None:
        self._timeouts[timeout] = None
        self.arm(timeout._at, loop)  # noqa: SLF001 -- the two classes are one mechanism

    def leave(self, timeout: Timeout) -> None:
        # The timer stays set: it finds nothing due, and is set for what is left.
        self._timeouts.pop(timeout, None)

    def arm(self, at: float, loop: asyncio.AbstractEventLoop) -> None:
        """Have the timer go off by loop time ``at``."""
        if at < self._armed_at:
            # A timer set for later is not cancelled -- it would keep the loop alive through
            # the registry -- but goes off to find it was superseded.
            self._armed_at = at
            loop.call_at(at, self._fire, loop, at)

    def _fire(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if at != self._armed_at:
            return
        self._armed_at = math.inf
        now = loop.time()
        earliest = math.inf
        for timeout in list(self._timeouts):
            if timeout._at <= now + CLOCK_SLACK:  # noqa: SLF001
                timeout.expire(now)
            earliest = min(earliest, timeout._at)  # noqa: SLF001
        if earliest < math.inf:
            self.arm(earliest, loop)


class Bound(Timeout):
    """A bound on calls to Redis, so that a stalled connection cannot hang them.

    A client with no ``socket_timeout`` waits for ever on a connection that
    stalls without closing; past ``seconds``, the block is cancelled and
    `redis.TimeoutError` raised, naming ``what``. ``spent`` is how much of
    the bound the call already spent before the block: waiting behind an
    earlier call, say. A `Timeout`: a cancellation from elsewhere goes on
    as it came.

        with Bound(5.0, "a step of semaphore 'db'"):
            await client.evalsha(...)
    """

    __slots__ = ("_bound", "_spent", "_what")

    def __init__(self, seconds: float, what: str, *, spent: float = 0.0) -> None:
        super().__init__(max(0.0, seconds - spent))
        self._bound = seconds
        self._spent = spent
        self._what = what

    def _error(self) -> BaseException:
        return overdue(self._what, self._bound, spent=self._spent)


def overdue(what: str, seconds: float, *, spent: float = 0.0) -> redis.TimeoutError:
    """The error of a call to Redis, ``what``, that got no answer within its bound of ``seconds``.

    ``spent`` is how much of the bound went on waiting behind an earlier call.
    """
    waited = f", {spent:.2f} s of it waiting for an earlier call" if spent > 0 else ""
    return redis.TimeoutError(f"{what} got no answer within {seconds:g} s{waited}; given up")
