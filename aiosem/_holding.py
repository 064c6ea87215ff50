"""Keeping held permits alive: one refresher per event loop, one call per semaphore.

A permit held through ``async with``, the decorator or the limiter -- or
taken with ``acquire(auto_refresh=True)`` -- is a `Hold`: the permit, when
its lease was last confirmed, and what to do if it is lost. Each semaphore
object keeps its holds and refreshes all of them in one step; the
`Refresher` of the event loop only decides *when*, for every semaphore
object of the loop, and starts each due round as a task of its own, so a
semaphore whose Redis stalls never delays another's.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, ClassVar, Protocol

import anyio

from ._coordination import raise_if_cancel_swallowed
from ._exceptions import PermitLost
from ._observing import emit_permit, log_fields

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._semaphore import Permit

logger = logging.getLogger("aiosem")


class Hold:
    """A permit being kept alive, and how its holder hears of its loss.

    Attributes:
        permit: The permit.
        confirmed_at: The event loop's time when the step that last confirmed
            the permit's lease was sent: the lease runs at least until
            ``confirmed_at + lease`` on the server.
        lease: How long the last confirmation lasts: the semaphore's
            ``timeout``, or its ``waiter_timeout`` for a permit handed over by
            another process and not yet claimed.
        scope: The cancel scope around the holder's body, cancelled on loss;
            ``None`` to only notify.
        on_lost: Called with the `PermitLost` when the permit is lost.
        lost: The loss, once it happened.
    """

    __slots__ = ("confirmed_at", "lease", "lost", "on_lost", "permit", "scope")

    def __init__(
        self,
        permit: Permit,
        *,
        confirmed_at: float,
        lease: float,
        scope: anyio.CancelScope | None,
        on_lost: Callable[[PermitLost], object] | None,
    ) -> None:
        self.permit = permit
        self.confirmed_at = confirmed_at
        self.lease = lease
        self.scope = scope
        self.on_lost = on_lost
        self.lost: PermitLost | None = None

    def __repr__(self) -> str:
        state = "lost" if self.lost is not None else f"confirmed for {self.lease:g} s from {self.confirmed_at:.3f}"
        return f"Hold({self.permit.identifier!r} of {self.permit.name!r}, {state})"

    def confirm(self, sent: float, lease: float) -> None:
        """Note that a step sent at ``sent`` restarted the lease for ``lease`` seconds."""
        if sent + lease > self.confirmed_at + self.lease:
            self.confirmed_at, self.lease = sent, lease

    def expired(self, now: float) -> bool:
        """Whether the lease may have run out by ``now``, for all this process can prove."""
        return now >= self.confirmed_at + self.lease

    def lose(self, reason: str) -> None:
        """Mark the permit lost and tell its holder: cancel its body, or call back."""
        if self.lost is not None:
            return
        permit = self.permit
        self.lost = PermitLost(name=permit.name, identifier=permit.identifier)
        logger.warning("%s: %s", self.lost, reason, extra=log_fields(permit.name, permit.identifier))
        emit_permit("lost", permit)
        if self.scope is not None:
            self.scope.cancel()
        if self.on_lost is not None:
            try:
                self.on_lost(self.lost)
            except Exception:
                logger.exception(
                    "the on_lost callback of %s raised", permit, extra=log_fields(permit.name, permit.identifier)
                )


class Refreshable(Protocol):
    """What the refresher asks of a semaphore object."""

    async def _refresh_round(self) -> float | None:
        """Refresh every hold once; return when the next round is due (loop time), or ``None`` if none is."""
        ...


class Refresher:
    """Schedules the refresh rounds of every semaphore object of one event loop.

    One task sleeps until the earliest round is due and starts it as a task
    of its own; it ends when nothing is due and starts again with the next
    hold. Holding no reference to a loop that is gone, it never outlives it.
    """

    __slots__ = ("__weakref__", "_due", "_loop", "_rounds", "_task", "_wake")

    _registry: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Refresher]] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: When each semaphore object's next round is due; absent while one runs.
        self._due: dict[Refreshable, float] = {}
        self._rounds: dict[Refreshable, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @classmethod
    def of_running_loop(cls) -> Refresher:
        """The refresher of the running event loop."""
        loop = asyncio.get_running_loop()
        refresher = cls._registry.get(loop)
        if refresher is None:
            refresher = cls._registry[loop] = cls(loop)
        return refresher

    def schedule(self, semaphore: Refreshable, at: float) -> None:
        """Have ``semaphore`` refresh its holds at loop time ``at`` (or earlier, if already due earlier)."""
        if semaphore in self._rounds:
            return  # a running round schedules the next one itself
        due = self._due.get(semaphore)
        if due is None or at < due:
            self._due[semaphore] = at
            self._wake.set()
        if self._task is None:
            self._task = self._loop.create_task(self._run(), name="aiosem refresher")

    def cancel(self, semaphore: Refreshable) -> None:
        """Stop scheduling ``semaphore``, which holds nothing any more; a round under way ends by itself."""
        if self._due.pop(semaphore, None) is not None:
            self._wake.set()  # the task may have nothing left to wait for

    async def _run(self) -> None:
        task = asyncio.current_task()
        try:
            while self._due or self._rounds:
                raise_if_cancel_swallowed(task)
                now = self._loop.time()
                for semaphore in [s for s, at in self._due.items() if at <= now]:
                    del self._due[semaphore]
                    self._rounds[semaphore] = self._loop.create_task(self._round(semaphore), name="aiosem refresh")
                self._wake.clear()
                if self._due:
                    with anyio.move_on_after(min(self._due.values()) - now):
                        await self._wake.wait()
                else:
                    await self._wake.wait()
        finally:
            self._task = None

    async def _round(self, semaphore: Refreshable) -> None:
        next_at: float | None = None
        try:
            next_at = await semaphore._refresh_round()  # noqa: SLF001 -- the refresher serves the semaphores
        finally:
            if self._rounds.get(semaphore) is asyncio.current_task():
                del self._rounds[semaphore]
                if next_at is not None:
                    self._due[semaphore] = next_at
                self._wake.set()
