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
from typing import TYPE_CHECKING, ClassVar, Final, Protocol

import anyio

from ._coordination import to_the_end
from ._exceptions import PermitLost
from ._observing import emit_permit, log_fields
from ._protocol import Step
from ._task_stack import TaskStack
from ._timing import CLOCK_SLACK, Backoff, cancel_scope

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

    from ._core import Core
    from ._permit import Permit
    from ._semaphore import _Semaphore

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
        closed: Whether it was lost because the semaphore object was closed.
    """

    __slots__ = ("closed", "confirmed_at", "lease", "lost", "on_lost", "permit", "scope")

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
        self.closed = False

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

    One timer of the loop is set for the earliest round due; when it fires,
    each due round starts as a task of its own. Nothing runs between
    rounds, so a permit given back before its first round -- most are --
    costs a timer set and cancelled, not a task. Holding no reference to a
    loop that is gone, it never outlives it.
    """

    __slots__ = ("__weakref__", "_due", "_loop", "_rounds", "_timer")

    _registry: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Refresher]] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: When each semaphore object's next round is due; absent while one runs.
        self._due: dict[Refreshable, float] = {}
        self._rounds: dict[Refreshable, asyncio.Task[None]] = {}
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def of_running_loop(cls) -> Refresher:
        """The refresher of the running event loop."""
        loop = asyncio.get_running_loop()
        refresher = cls._registry.get(loop)
        if refresher is None:
            refresher = cls._registry[loop] = cls(loop)
        return refresher

    @property
    def busy(self) -> bool:
        """Whether a round is due or under way."""
        return bool(self._due or self._rounds)

    def schedule(self, semaphore: Refreshable, at: float) -> None:
        """Have ``semaphore`` refresh its holds at loop time ``at`` (or earlier, if already due earlier)."""
        if semaphore in self._rounds:
            return  # a running round schedules the next one itself
        due = self._due.get(semaphore)
        if due is None or at < due:
            self._due[semaphore] = at
            self._set_timer()

    def cancel(self, semaphore: Refreshable) -> None:
        """Stop scheduling ``semaphore``, which holds nothing any more; a round under way ends by itself."""
        if self._due.pop(semaphore, None) is not None:
            self._set_timer()

    def _set_timer(self) -> None:
        """Have the timer fire when the earliest round is due, or not at all if none is."""
        earliest = min(self._due.values(), default=None)
        timer = self._timer
        if timer is not None:
            if timer.when() == earliest:
                return
            timer.cancel()
            self._timer = None
        if earliest is not None:
            self._timer = self._loop.call_at(earliest, self._start_due_rounds)

    def _start_due_rounds(self) -> None:
        self._timer = None
        # The loop fires a timer up to its clock's resolution early.
        now = self._loop.time() + CLOCK_SLACK
        for semaphore in [s for s, at in self._due.items() if at <= now]:
            del self._due[semaphore]
            self._rounds[semaphore] = self._loop.create_task(self._round(semaphore), name="aiosem refresh")
        self._set_timer()

    async def _round(self, semaphore: Refreshable) -> None:
        next_at: float | None = None
        try:
            next_at = await semaphore._refresh_round()  # noqa: SLF001 -- the refresher serves the semaphores
        finally:
            if self._rounds.get(semaphore) is asyncio.current_task():
                del self._rounds[semaphore]
                if next_at is not None:
                    self.schedule(semaphore, next_at)


#: The first pause before a failing refresh is tried again (it doubles, up to a refresh interval).
_RETRY_PAUSE: Final = 0.05


class Holdings:
    """The permits one semaphore object keeps alive, refreshed together in one step per round.

    The event loop's `Refresher` decides when each round runs
    (`refresh_round`); a round refreshes every hold in one step, and a
    hold whose permit is found gone, or whose lease may have run out while
    Redis did not answer, is lost.
    """

    __slots__ = ("__weakref__", "_backoff", "_core", "_holds", "_refresher")

    def __init__(self, core: Core) -> None:
        self._core = core
        #: Permits kept alive, by identifier.
        self._holds: dict[str, Hold] = {}
        self._backoff = Backoff(core.settings.refresh_interval, first=_RETRY_PAUSE)
        #: The refresher of the event loop the object is bound to, once asked for (see `reset`).
        self._refresher: Refresher | None = None

    def __len__(self) -> int:
        return len(self._holds)

    def get(self, identifier: str) -> Hold | None:
        """The hold of ``identifier``'s permit, if it is kept alive."""
        return self._holds.get(identifier)

    def reset(self) -> None:
        """Forget every hold: the object moved to another event loop (the old one is closed)."""
        self._holds.clear()
        self._refresher = None

    def _loop_refresher(self) -> Refresher:
        """The refresher of the object's event loop: looked up once per loop, not once per permit."""
        refresher = self._refresher
        if refresher is None:
            refresher = self._refresher = Refresher.of_running_loop()
        return refresher

    def keep(
        self,
        permit: Permit,
        confirmed_at: float,
        lease: float,
        *,
        scope: anyio.CancelScope | None,
        on_lost: Callable[[PermitLost], object] | None,
    ) -> Hold:
        """Keep ``permit`` (its lease confirmed at ``confirmed_at`` for ``lease`` s) alive until released or lost."""
        hold = self._holds[permit.identifier] = Hold(
            permit, confirmed_at=confirmed_at, lease=lease, scope=scope, on_lost=on_lost
        )
        self._loop_refresher().schedule(self, self._next_round(hold))
        return hold

    def drop(self, hold: Hold) -> None:
        """Stop keeping a permit alive."""
        if self._holds.get(hold.permit.identifier) is hold:
            del self._holds[hold.permit.identifier]
            if not self._holds:
                self._loop_refresher().cancel(self)

    def confirm(self, identifier: str, sent: float, lease: float) -> None:
        """A step sent at ``sent`` restarted the lease of ``identifier``'s permit, if it is kept alive."""
        hold = self._holds.get(identifier)
        if hold is not None:
            hold.confirm(sent, lease)

    def lose(self, identifier: str, reason: str) -> bool:
        """Stop keeping ``identifier``'s permit alive, and tell its holder it is lost: ``True`` if it was kept."""
        hold = self._holds.get(identifier)
        if hold is None:
            return False
        self.drop(hold)
        hold.lose(reason)
        return True

    def close(self) -> list[Hold]:
        """Stop keeping every permit alive, each marked lost to its holder (which `aclose` releases): the holds."""
        holds = list(self._holds.values())
        for hold in holds:
            self.drop(hold)
            hold.closed = True
            hold.lost = PermitLost(
                name=hold.permit.name,
                identifier=hold.permit.identifier,
                reason="the semaphore object was closed (aclose) while its holder ran, and gave it back",
            )
        return holds

    def _next_round(self, hold: Hold) -> float:
        # A third of the lease still unproven leaves two tries before it runs out.
        return hold.confirmed_at + min(self._core.settings.refresh_interval, hold.lease / 3)

    async def _refresh_round(self) -> float | None:
        """Refresh every hold in one step; return when the next round is due, if any.

        Called by the event loop's `Refresher`. A failure is retried after a
        growing pause, never later than the earliest lease could run out;
        a hold whose lease may have run out meanwhile is lost. A slow step
        is waited for until that moment, however slow: Redis may have
        restarted the leases. A step still stalled then goes on in its lane,
        within its own bound, and its holders hear of their loss at once.
        """
        loop = asyncio.get_running_loop()
        holds = list(self._holds.values())
        if not holds:
            return None
        sent = loop.time()
        values = await self._refresh_step(holds, until=min(hold.confirmed_at + hold.lease for hold in holds))
        now = loop.time()
        relay = self._core.relay
        for index, hold in enumerate(holds):
            identifier = hold.permit.identifier
            if self._holds.get(identifier) is not hold:
                continue  # released meanwhile
            if values is None:
                if hold.expired(now):
                    self.lose(
                        identifier, f"Redis did not answer before its lease ({hold.lease:g} s) could have run out"
                    )
            elif values[index] > 0:
                if relay is not None:
                    relay.confirm(identifier, sent)
                else:
                    hold.confirm(sent, self._core.settings.timeout)
            elif relay is None or not relay.passing(identifier):  # else relayed to it, and not yet heard in Redis
                self.lose(identifier, "a refresh found it gone: its lease ran out, or its keys were deleted")
        if not self._holds:
            return None
        next_round = min(self._next_round(hold) for hold in self._holds.values())
        if values is None:
            pause = self._backoff.next_pause()
            return min(now + pause, next_round, *(h.confirmed_at + h.lease for h in self._holds.values()))
        self._backoff.reset()
        return next_round

    async def _refresh_step(self, holds: list[Hold], until: float) -> Sequence[int] | None:
        """Refresh ``holds`` in one step, waited for until ``until`` (loop time); ``None`` if it failed or stalled.

        A step still under way at ``until`` goes on in its lane, within its
        own bound: its answer only comes too late to matter.
        """
        loop = asyncio.get_running_loop()
        if loop.time() >= until:
            # Too late already (the loop woke from a long block): a step
            # started now could only come too late, and would take the
            # locked class's step lock for nothing.
            return None
        with anyio.move_on_after(until - loop.time()):
            try:
                values, _ = await self._core.submit(Step.REFRESH, [hold.permit.identifier for hold in holds])
            except Exception:
                if not self._backoff.failures:
                    logger.warning(
                        "refreshing the permits held through %r failed; retrying",
                        self._core.semaphore,
                        exc_info=True,
                        extra=log_fields(self._core.settings.name),
                    )
            else:
                return values
        return None

    # --- async with ---------------------------------------------------------------

    def enter(
        self, permit: Permit, confirmed_at: float, lease: float, *, on_lost: Callable[[PermitLost], object] | None
    ) -> None:
        """Keep the permit of an ``async with`` body alive, and cancel the body if it is lost (unless ``on_lost``)."""
        scope = cancel_scope() if on_lost is None else None
        hold = self.keep(permit, confirmed_at, lease, scope=scope, on_lost=on_lost)
        if scope is not None:
            scope.__enter__()
        _entered.push(self._core.semaphore, hold)

    async def exit(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """End the current task's innermost ``async with`` body: see `_Semaphore.__aexit__`."""
        hold = _entered.pop(self._core.semaphore)
        # The body gave its permit back itself with `release`: nothing more to do.
        released = hold.lost is None and self._holds.get(hold.permit.identifier) is not hold
        self.drop(hold)
        permit = hold.permit
        # The scope swallows the cancellation it delivered itself, no other.
        try:
            ours = hold.scope is not None and bool(hold.scope.__exit__(exc_type, exc, traceback))
        except BaseException as error:
            # A scope left out of order (a framework that nests blocks badly)
            # must not keep the permit until its lease runs out.
            if not released:
                await self.end(permit, hold.lost, error)
            raise
        if released:
            return
        lost = await self.end(permit, hold.lost, exc)
        if lost is None:
            return
        if ours:
            raise lost from None
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            if hold.closed:
                return  # closed, then cancelled, as a program ends: nothing went wrong
            logger.warning(
                "%s was lost while its body was being cancelled",
                permit,
                extra=log_fields(permit.name, permit.identifier),
            )
            return
        raise lost

    async def end(self, permit: Permit, lost: PermitLost | None, exc: BaseException | None) -> PermitLost | None:
        """Release a held permit as its holder ends, shielded and bounded; return its loss, if any.

        A permit known lost is not released: it is gone, or its lease may
        have run out while Redis was out of reach, and a release would only
        keep the holder waiting on that. A release that fails after the
        holder raised ``exc`` is logged; after a holder that completed, it
        is raised.
        """
        if lost is not None:
            return lost
        _, sent = self._core.semaphore._send_release(permit)  # noqa: SLF001 -- the object's own release
        # A future already, unless a relayed mutex's coroutine: awaited through
        # any cancellation, with nothing of its own to start.
        answer = asyncio.ensure_future(sent)
        try:
            released = await to_the_end(answer, name=lambda: f"the release of {permit}")
        except asyncio.CancelledError:
            # Cancelled while the release went on to its end: told all the same.
            if answer.done() and not answer.cancelled():
                if (error := answer.exception()) is None:
                    tell_release(permit, None, answer.result())
                else:
                    logger.warning(
                        "releasing %s failed while its holder was being cancelled",
                        permit,
                        exc_info=error,
                        extra=log_fields(permit.name, permit.identifier),
                    )
            raise
        except Exception:
            if exc is None:
                raise
            logger.warning(
                "releasing %s failed after its holder raised",
                permit,
                exc_info=True,
                extra=log_fields(permit.name, permit.identifier),
            )
            return None  # nothing more is known than before
        tell_release(permit, None, released)
        if released == 1:
            return None
        emit_permit("lost", permit)
        return PermitLost(name=permit.name, identifier=permit.identifier)


def tell_release(permit: Permit, hold: Hold | None, released: int) -> None:
    """Tell what a release answered (1: the permit was held until then): released, or -- if it was kept -- lost."""
    if released == 1:
        emit_permit("released", permit)
    elif hold is not None:
        hold.lose("the release found it gone")


#: The holds of the current task's ``async with`` blocks, each under its semaphore object.
_entered: TaskStack[_Semaphore, Hold] = TaskStack("aiosem_held")
