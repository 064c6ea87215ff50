"""The wait queue of one semaphore object: its waiters, and everything that moves them.

A blocking `acquire` is a `Waiter`, with one of the states of `WaiterState`
(the design page draws them). The object's `WaitQueue` owns its waiters:
it queues them in Redis, proves them alive, hears their grants -- in the
reply to a step, by message from another process, or at a re-check --
claims permits handed over by other processes, gives up for the ones that
stop waiting, and queues again, in order, the ones Redis forgot. One task,
the pump, does the background part: every third of a waiter timeout it
proves all the object's queued waiters alive in one step, it sends claims
at once, and it re-checks the semaphore exactly when its earliest lease runs
out.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import math
import secrets
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import redis

from ._channel import Channel
from ._coordination import Submission, Watchdog, clean_up, raise_if_cancel_swallowed, resolve
from ._exceptions import SemaphoreError
from ._keys import weighted
from ._observing import log_fields
from ._protocol import QUEUED, Reply, Step
from ._timing import Backoff

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._core import Core

logger = logging.getLogger("aiosem")

R = TypeVar("R")

#: How long after a lease runs out its semaphore is re-checked: enough for
#: the server's clock to have passed it too.
RECHECK_DELAY: Final = 0.001
#: The first pause of a failing pump (it doubles, up to a heartbeat).
_RETRY_PAUSE: Final = 0.05


class WaiterState(enum.Enum):
    """Where a waiter is in its life; `docs/design.md` draws the transitions."""

    #: Its acquire step is on its way: neither queued nor granted yet.
    ARRIVING = "arriving"
    #: Queued in Redis; the pump's heartbeats prove it alive.
    QUEUED = "queued"
    #: Another process handed it a permit, with a lease of a waiter timeout:
    #: its claim, which restarts the lease for a whole timeout, is to be sent.
    HANDED = "handed over"
    #: Its claim is on its way.
    CLAIMING = "claiming"
    #: Relayed a mutex by the waiter before it in its run, within this
    #: process: the pass that tells Redis is on its way.
    RELAYED = "relayed"
    #: Gone from the queue: it holds its permit, gave up, or failed.
    DONE = "done"

    # Members are singletons compared by identity: hashed by it too, in C.
    __hash__ = object.__hash__


#: The states of a waiter whose caller may have returned while its permit is
#: still on its way in Redis: its claim, or the pass that relayed it.
_STILL_MOVING: Final = frozenset({WaiterState.HANDED, WaiterState.CLAIMING, WaiterState.RELAYED})


#: How many watchdogs of waiters' deadlines, one per bound, an object keeps before it drops those watching nothing.
_WATCHDOGS_KEPT: Final = 8


class _TimeUp(Exception):
    """Set on a waiter's future when its wait runs out before a grant."""


class Waiter:
    """One blocking acquire, from its arrival until it holds its permit or gives up.

    Attributes:
        identifier: Its identifier in Redis: the object's, a dot, its own.
        future: Resolved with the fencing token when the permit is its own
            (or with the code its first step answered instead), or failed:
            by its step's error, by `WaitQueue.close`, or when its wait
            runs out.
        state: Where it is in its life.
        proven: Loop time when the last step that found it queued was sent:
            a permit handed to it later has a lease from then on.
        lease: How the lease of its permit was confirmed: (loop time the
            confirming step was sent, seconds it lasts).
    """

    __slots__ = ("future", "identifier", "lease", "proven", "state", "timer", "watchdog")

    def __init__(self, identifier: str, future: asyncio.Future[int]) -> None:
        self.identifier = identifier
        self.future = future
        self.state = WaiterState.ARRIVING
        self.proven = -math.inf
        self.lease: tuple[float, float] | None = None
        #: Ends the wait at its deadline once queued: the watchdog of the waits bounded alike.
        self.watchdog: Watchdog | None = None
        #: Ends its arrival at its bound (see `Backend.arrive`).
        self.timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"Waiter({self.identifier!r}, {self.state.value}{', returned' if self.future.done() else ''})"

    @property
    def pending(self) -> bool:
        """Whether its caller is still waiting."""
        return not self.future.done()

    def grant(self, token: int, confirmed_at: float, lease: float) -> bool:
        """Return the permit to the caller, if it still waits: ``True`` if it did."""
        if self.future.done():
            return False
        self.lease = (confirmed_at, lease)
        self.future.set_result(token)
        return True

    def fail(self, error: BaseException) -> None:
        if self.pending:
            self.future.set_exception(error)

    def read_failure(self) -> BaseException | None:
        """What its future failed with, if anything (read, so not logged as never retrieved)."""
        future = self.future
        return future.exception() if future.done() and not future.cancelled() else None

    def give_up_at(self, watchdog: Watchdog, deadline: float) -> None:
        """Have the caller stop waiting at ``deadline`` (loop time), unless a grant comes first.

        ``watchdog`` watches the waits of the object bounded as this one is.
        Not a cancel scope, nor a timer of its own: waiting is what most
        acquires do under contention, a scope costs several times what a
        timer does, and a timer set and cancelled for each waiter stays in
        the loop's heap. A grant that comes first is taken, however late in
        the wait.
        """
        self.watchdog = watchdog
        watchdog.watch(self.future, deadline)

    async def outcome(self) -> int:
        """What the caller gets: a token, a code its first step answered, or 0 if its wait ran out first."""
        try:
            return await self.future
        except _TimeUp:
            return 0
        finally:
            if self.watchdog is not None:
                self.watchdog.unwatch(self.future)
            if self.timer is not None:
                self.timer.cancel()


class WaiterStep(Submission[R]):
    """A step of one blocking acquire's, answered straight into its waiter: the caller awaits the waiter's future.

    Its outcome, read in the lane's task, goes to ``answered``, which
    grants the waiter, fails it, or sends its next step -- and the caller
    is woken once, by its grant, where a lane's answer and then the grant
    took two. Once the caller stops waiting, a step not yet sent is left
    out of its batch.
    """

    __slots__ = ("_answered", "waiter")

    def __init__(self, waiter: Waiter, answered: Callable[[tuple[Sequence[int], R] | BaseException], None]) -> None:
        super().__init__((waiter.identifier,))
        self.answer = waiter.future
        self.waiter = waiter
        self._answered = answered

    def settle(self, outcome: tuple[Sequence[int], R] | BaseException) -> None:
        self._answered(outcome)


class WaitQueue:
    """The waiters of one semaphore object, and the pump that serves them (see the module's docstring)."""

    __slots__ = (
        "_all_gone",
        "_channel",
        "_claims",
        "_core",
        "_giving_up",
        "_pump",
        "_queued",
        "_recheck_at",
        "_waiters",
        "_wake",
        "_watchdogs",
    )

    def __init__(self, core: Core) -> None:
        self._core = core
        #: Every waiting acquire, and those of them known to be queued, in arrival order.
        self._waiters: dict[str, Waiter] = {}
        self._queued: dict[str, Waiter] = {}
        #: Permits handed over by other processes: to claim, or being claimed
        #: (their waiters may have returned already).
        self._claims: dict[str, Waiter] = {}
        self._pump: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._recheck_at: float | None = None
        self._channel = Channel(core, self)
        #: The tasks giving up an acquire, and what `until_all_gone` waits on once `close` failed the waiters.
        self._giving_up: set[asyncio.Task[Any] | None] = set()
        self._all_gone: asyncio.Event | None = None
        #: What ends the waits of each bound (seconds) at their deadlines.
        self._watchdogs: dict[float, Watchdog] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    def reset(self) -> None:
        """Forget everything: the object moved to another event loop (the old one is closed)."""
        self._waiters.clear()
        self._queued.clear()
        self._claims.clear()
        self._pump = None
        self._wake = asyncio.Event()
        self._recheck_at = None
        self._channel.reset()
        self._giving_up.clear()
        self._all_gone = None
        self._watchdogs.clear()

    @property
    def has_waiters(self) -> bool:
        return bool(self._waiters)

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def recheck_at(self) -> float | None:
        """When the pump re-checks the semaphore next, ahead of its heartbeat (loop time)."""
        return self._recheck_at

    def waiter(self, identifier: str) -> Waiter | None:
        """The waiter still waiting under ``identifier``, if any."""
        waiter = self._waiters.get(identifier)
        return waiter if waiter is not None and not waiter.future.done() else None

    def wakes_here(self, reply: Reply) -> bool:
        """Whether ``reply``, just observed, granted permits to waiters of this object here, who wake now.

        Those of a release's reply hold their permits and release them again
        before the release's callers hear its answer (see `Lane`'s ``hold``).
        """
        waiters = self._waiters
        return any(identifier in waiters for identifier, _ in reply.granted)

    def queued(self) -> list[str]:
        """The identifiers of the waiters known to be queued, in arrival order."""
        return list(self._queued)

    # --- a waiter's life ------------------------------------------------------

    async def wait(
        self, loop: asyncio.AbstractEventLoop, wait: float | None, weight: int = 1
    ) -> tuple[str, int, tuple[float, float]]:
        """Take a permit of ``weight``, queueing for it for up to ``wait`` seconds (0: try once; ``None``: for ever).

        Returns the identifier, what the step answered (a token, or a code),
        and how the lease was confirmed. Nothing is awaited before the call
        joins its lane, so calls are sent -- and queued -- in the order they
        were made, and the wait in the queue ends ``wait`` seconds after the
        call, whatever came before.
        """
        core = self._core
        due = None if not wait else (loop.time() + wait, self._watchdog(wait))
        identifier = weighted(f"{core.process}.{secrets.token_hex(8)}", weight)
        submission: Submission[Reply] | None = None
        waiter: Waiter | None = None
        try:
            if wait == 0:
                submission = Submission((identifier,))
                confirmed = (loop.time(), core.settings.timeout)  # a lease from before the step was sent
                (value,), _ = await core.submit(Step.TRY, submission)
            else:
                waiter = self._waiters[identifier] = Waiter(identifier, loop.create_future())
                # Its first step: a grant, or a code, settles it; one that queues it leaves it waiting. (A
                # partial, not a closure over the step: that would be a cycle, left to the garbage collector.)
                first: WaiterStep[Reply] = WaiterStep(waiter, functools.partial(self._arrived, waiter, due))
                submission = first
                core.backend.arrive(waiter, lambda: self._noted(first))
                value = await waiter.outcome()
        except (redis.ConnectionError, redis.ResponseError):
            # The server is out of reach or refused the script: a grant that
            # did happen ends with its lease, and a cancel would only delay
            # this error.
            raise
        except BaseException:
            # No longer a waiter from here on: a re-check answering meanwhile
            # must not queue it again.
            self._waiters.pop(identifier, None)
            self._queued.pop(identifier, None)
            sent = submission is not None and submission.sent
            if sent or waiter is not None:
                await self.give_up(identifier, sent=sent)
            raise
        finally:
            self._leave(identifier, waiter)
        if value == 0 and waiter is not None:
            await self.give_up(identifier)  # its wait ran out
        if waiter is not None:
            confirmed = waiter.lease or (waiter.proven, core.settings.timeout)
        return identifier, value, confirmed

    def _noted(self, first: WaiterStep[Reply]) -> None:
        """A blocking acquire's arrival is noted (see `Backend.arrive`): its first step goes."""
        if first.waiter.pending:
            # Queued, if at all, after this: so was any grant handed over by message.
            loop = first.waiter.future.get_loop()
            first.waiter.proven = loop.time()
            self._core.enqueue(Step.WAIT, first, loop)

    def _arrived(
        self,
        waiter: Waiter,
        due: tuple[float, Watchdog] | None,
        outcome: tuple[Sequence[int], Reply] | BaseException,
    ) -> None:
        """What the first step of a blocking acquire answered, read in the lane's task; ``due``: its deadline."""
        if not waiter.pending:
            return  # granted by the reply (`observe`) or a message, or given up on, or failed by `close`
        if isinstance(outcome, BaseException):
            resolve(waiter.future, outcome)
            return
        (value,), reply = outcome
        if value != QUEUED:
            waiter.future.set_result(value)  # a code: neither granted nor queued
            return
        if waiter.state is WaiterState.ARRIVING:
            waiter.state = WaiterState.QUEUED
        self._queued[waiter.identifier] = waiter
        self._listen()  # the pump's next heartbeat proves this waiter alive too
        self.recheck_when(reply, waiter.future.get_loop())
        if due is not None:
            waiter.give_up_at(due[1], due[0])

    def _watchdog(self, seconds: float) -> Watchdog:
        """What ends the waits bounded to ``seconds`` at their deadlines: they come due in the order they queued."""
        watchdogs = self._watchdogs
        watchdog = watchdogs.get(seconds)
        if watchdog is None:
            if len(watchdogs) >= _WATCHDOGS_KEPT:
                # Bounds computed call by call (what is left of a budget) would each keep one.
                for idle in [bound for bound, kept in watchdogs.items() if kept.idle]:
                    del watchdogs[idle]
            watchdog = watchdogs[seconds] = Watchdog(_TimeUp)
        return watchdog

    def _leave(self, identifier: str, waiter: Waiter | None) -> None:
        """Forget an acquire that has ended, whichever way; a claim of its permit goes on."""
        self._waiters.pop(identifier, None)
        self._queued.pop(identifier, None)
        self._core.backend.forget(identifier)
        if waiter is not None:
            waiter.read_failure()  # failed by `close` for a caller gone meanwhile, it is not news
            if waiter.state not in _STILL_MOVING:
                waiter.state = WaiterState.DONE
        if not self._waiters:
            self._unlisten()
        self._note_if_all_gone()

    def _note_if_all_gone(self) -> None:
        if self._all_gone is not None and not self._waiters and not self._giving_up:
            self._all_gone.set()

    async def until_all_gone(self) -> None:
        """Wait until the acquires `close` failed have ended, and what they took is given back."""
        if self._all_gone is not None:
            await self._all_gone.wait()

    async def give_up(self, *identifiers: str, sent: bool = True) -> None:
        """Leave the queue, give back any permit, and refuse a grant still on its way.

        A permit relayed to a waiter is relayed on; a waiter of a run that
        has not had it yet is passed over by the relay, and leaves the queue
        as any other. Without ``sent`` -- their first step was never sent --
        only what their arrival wrote is taken back.
        """
        for identifier in identifiers:
            self.forget_claim(identifier)
        relay = self._core.relay
        relayed = [identifier for identifier in identifiers if relay is not None and relay.holds(identifier)]
        others = [identifier for identifier in identifiers if identifier not in relayed]
        # By task, not by count: a give-up that began before the object was
        # first used here (bound, and so reset) ends after it all the same.
        task = asyncio.current_task()
        self._giving_up.add(task)
        try:
            await clean_up(
                self._hand_back(relayed, others, sent=sent),
                name=f"giving back what an acquire of {self._core.semaphore!r} took",
                failed=self._could_not_give_back,
            )
        finally:
            self._giving_up.discard(task)
            self._note_if_all_gone()

    async def _hand_back(self, relayed: Sequence[str], others: Sequence[str], *, sent: bool) -> None:
        relay = self._core.relay
        for identifier in relayed:
            assert relay is not None  # noqa: S101 -- only a relay holds a relayed permit
            await relay.relay(identifier)
        if others:
            if sent:
                await self._core.submit(Step.CANCEL, others)
            # Behind the cancel: a waiter whose first step is still on its way may be noted arriving after it.
            await self._core.backend.withdraw(others)

    def _could_not_give_back(self) -> None:
        logger.warning(
            "could not give back what an interrupted acquire of %r took",
            self._core.semaphore,
            exc_info=True,
            extra=log_fields(self._core.settings.name),
        )

    def forget_claim(self, identifier: str) -> None:
        """Stop claiming the permit of ``identifier``: given up, or released before its claim."""
        claim = self._claims.pop(identifier, None)
        if claim is not None and not claim.pending:
            claim.state = WaiterState.DONE

    # --- hearing of grants ----------------------------------------------------

    def observe(self, reply: Reply, sent: float) -> None:
        """Learn what a reply to a step sent at ``sent`` says about this object's waiters."""
        core = self._core
        settings = core.settings
        resolved = []
        for identifier, token in reply.granted:
            # Granted by this object's own call: a full lease, nothing to
            # claim -- unless replicas must have the grant and this step did
            # not wait for them: then a claim that does confirms it first.
            waiter = self.waiter(identifier)
            if waiter is None:
                continue
            if settings.replicas and reply.replicated is None:
                self._hand_over(waiter)
                continue
            waiter.grant(token, sent, settings.timeout)
            resolved.append(identifier)
        if reply.relayed and len(resolved) == 1 and core.relay is not None:
            # (Granted to an acquire given up meanwhile, the permit goes back
            # by its cancel, to the head of the queue: the run's waiters are
            # queued there still, in their places.)
            core.relay.start(resolved[0], sent, reply.relayed)
        if self._queued:
            self.recheck_when(reply, asyncio.get_running_loop())

    def on_message(self, message: str) -> None:
        """A permit was handed to some of this object's waiters by another process."""
        settings = self._core.settings
        now = asyncio.get_running_loop().time()
        for grant in message.split():
            identifier, _, token = grant.partition(":")
            # The permit is the waiter's from the grant on: it returns at once,
            # and the pump claims the whole lease behind it well within the
            # waiter timeout the grant was stamped with. A waiter no longer
            # here gave up, and its cancel step gives the permit back; one
            # resolved already was claimed by the re-check that resolved it.
            waiter = self.waiter(identifier)
            if waiter is None or not token.isdigit():
                continue
            # Granted after the last step that found it queued was sent, for
            # a waiter timeout: a lease at least that long. Unless a third of
            # it is sure to be left -- as a heartbeat a third of a waiter
            # timeout ago makes it, and a process slow to hear, or stalled,
            # does not -- the waiter returns only once its claim has found
            # the permit still there, and restarted its lease. (So it does
            # with replicas: the grant may not have reached them yet, and the
            # claim waits for them.) The waiter is woken before the pump, so
            # that the claim's step is not made ahead of its return.
            if not settings.replicas and now < waiter.proven + settings.waiter_ttl * 2 / 3:
                waiter.grant(int(token), waiter.proven, settings.waiter_ttl)
            self._hand_over(waiter)

    def _hand_over(self, waiter: Waiter) -> None:
        waiter.state = WaiterState.HANDED
        self._claims[waiter.identifier] = waiter
        self._start_pump()

    def recheck_when(self, reply: Reply, loop: asyncio.AbstractEventLoop) -> None:
        """Have the pump re-check when the earliest lease a reply reports runs out (``loop``: the running one)."""
        if reply.next_expiry is not None:
            self._schedule_recheck(loop.time() + reply.next_expiry + RECHECK_DELAY)

    def recheck_now(self) -> None:
        """Have the pump re-check at once, if anybody is queued: who holds may have changed unheard."""
        if self._queued:
            self._schedule_recheck(asyncio.get_running_loop().time())

    def _schedule_recheck(self, at: float) -> None:
        if self._recheck_at is None or at < self._recheck_at:
            self._recheck_at = at
            self._start_pump()

    # --- the pump ---------------------------------------------------------------

    def _start_pump(self, *, wake: bool = True) -> None:
        """Run the pump, and have it look at once at its claims and due re-checks, unless ``wake`` is false."""
        if wake:
            self._wake.set()
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    def _claims_due(self) -> bool:
        return any(claim.state is WaiterState.HANDED for claim in self._claims.values())

    async def _run_pump(self) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = self._core.settings.waiter_ttl / 3
        next_beat = loop.time() + heartbeat
        backoff = Backoff(heartbeat, first=_RETRY_PAUSE)
        task = asyncio.current_task()
        try:
            while self._queued or self._claims_due():
                raise_if_cancel_swallowed(task)
                due = next_beat if self._recheck_at is None else min(next_beat, self._recheck_at)
                if not self._claims_due() and loop.time() < due:
                    self._wake.clear()
                    with anyio.move_on_after(due - loop.time()):
                        await self._wake.wait()
                    # Looked at afresh: the last waiter may have left meanwhile,
                    # and a re-check then has nobody to send.
                    continue
                # A claim goes at once, alone unless a heartbeat or re-check is
                # due too: then every queued waiter goes with it.
                everyone = loop.time() >= due
                if everyone:
                    self._recheck_at = None
                if await self._pump_once(everyone, log=not backoff.failures):
                    backoff.reset()
                    if everyone:
                        next_beat = loop.time() + heartbeat
                    continue
                await backoff.pause()
            self._recheck_at = None  # nobody is left for it; the next waiter's first step is its first look
        finally:
            self._pump = None

    async def _pump_once(self, everyone: bool, *, log: bool) -> bool:
        """Send the claims due -- and, if ``everyone``, prove every queued waiter alive: ``False`` if it failed.

        A failure is logged if ``log`` (the first of a series).
        """
        claims = [claim for claim in self._claims.values() if claim.state is WaiterState.HANDED]
        for claim in claims:
            claim.state = WaiterState.CLAIMING
        identifiers = [claim.identifier for claim in claims]
        if everyone:
            identifiers += [identifier for identifier in self._queued if identifier not in self._claims]
        try:
            sent = asyncio.get_running_loop().time()
            values, _ = await self._core.submit(Step.REFRESH, identifiers)
            await self._settle(identifiers, values, sent)
        except Exception:  # never let the pump die: waiters depend on it
            for claim in claims:
                if claim.state is WaiterState.CLAIMING:
                    claim.state = WaiterState.HANDED
            if log:
                logger.warning(
                    "re-checking the waiters of %r failed; retrying",
                    self._core.semaphore,
                    exc_info=True,
                    extra=log_fields(self._core.settings.name),
                )
            return False
        return True

    async def _settle(self, identifiers: Sequence[str], values: Sequence[int], sent: float) -> None:
        """Act on what a re-check sent at ``sent`` answered for each identifier."""
        core = self._core
        settings = core.settings
        dropped = []
        for identifier, value in zip(identifiers, values, strict=True):
            waiter = self.waiter(identifier)
            claim = self._claims.get(identifier)
            claiming = claim is not None and claim.state is WaiterState.CLAIMING
            if claiming:
                del self._claims[identifier]
                assert claim is not None  # noqa: S101 -- claiming says so
                claim.state = WaiterState.QUEUED if claim.pending else WaiterState.DONE
            if value > 0:
                if waiter is not None:
                    waiter.grant(value, sent, settings.timeout)
                else:
                    core.holdings.confirm(identifier, sent, settings.timeout)
            elif value == QUEUED and waiter is not None:
                waiter.proven = sent
            elif value < 0:
                if waiter is not None:
                    dropped.append(identifier)
                elif claiming:
                    self._lost_before_claim(identifier)
        if dropped:
            await self._requeue(dropped)

    async def _requeue(self, dropped: Sequence[str]) -> None:
        """Queue again, last, waiters the queue forgot (presumed dead: this process did not answer in time)."""
        semaphore = self._core.semaphore
        settings = self._core.settings
        logger.warning(
            "%d waiter(s) of %r lost their place in the queue; queueing again",
            len(dropped),
            semaphore,
            extra=log_fields(settings.name),
        )
        sent = asyncio.get_running_loop().time()
        requeued, _ = await self._core.submit(Step.WAIT, dropped)
        for identifier, value in zip(dropped, requeued, strict=True):
            # A waiter returned meanwhile was granted (by a message that
            # overtook this reply), and holds now; or gave up, and its own
            # cancel undoes what this step did, whichever of the two Redis saw
            # first (a cancel that came first left a tombstone, which refused
            # this step).
            waiter = self.waiter(identifier)
            if waiter is None:
                continue
            if value > 0:
                waiter.grant(value, sent, settings.timeout)
            elif value == QUEUED:
                waiter.proven = sent
            else:
                waiter.fail(SemaphoreError(f"a waiter of semaphore {settings.name!r} was refused", name=settings.name))

    def _lost_before_claim(self, identifier: str) -> None:
        if not self._core.holdings.lose(
            identifier, "it was handed over by another process and lost before it was claimed"
        ):
            logger.warning(
                "a permit of %r handed to this process was lost before it was claimed",
                self._core.semaphore,
                extra=log_fields(self._core.settings.name),
            )

    # --- the channel --------------------------------------------------------------

    def _listen(self) -> None:
        """Have the channel subscribed, and the pump running, for a waiter just queued."""
        self._channel.listen()
        self._start_pump(wake=False)

    def _unlisten(self) -> None:
        """The last waiter has gone: the pump ends, and the channel goes unless a waiter comes soon."""
        self._wake.set()
        self._channel.unlisten()

    # --- closing ------------------------------------------------------------------

    def close(self, error: SemaphoreError) -> list[asyncio.Task[None]]:
        """Fail every waiting acquire with ``error`` and stop the pump and the channel: the tasks to wait for.

        The failed acquires give back what they took in their own tasks;
        `until_all_gone` waits for them.
        """
        self._all_gone = asyncio.Event()
        self._note_if_all_gone()
        for waiter in self._waiters.values():
            waiter.fail(error)
        background = [] if self._pump is None else [self._pump]
        for task in background:
            task.cancel()
        return background + self._channel.stop()
