"""The mechanism both semaphores share: permits, waiting, holding, releasing.

`AsyncFairSemaphore` and `AsyncLockedSemaphore` differ only in how one step
-- grant, queue, release, cancel or refresh some identifiers, and hand freed
permits to the queue -- is carried out atomically in Redis
(`_Semaphore._execute`); everything a caller sees is here.

Per semaphore object, and so per process in the usual case of one object per
name: concurrent steps of one kind are coalesced into one call at a time
(`Lane`); waiters wait on futures, resolved by the reply that handed them a
permit, by a message on the object's channel, or by the pump -- one task that
proves all the object's waiters alive in one call every third of a waiter
timeout, claims permits handed over by other processes, and re-checks the
semaphore exactly when its earliest lease runs out.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
import redis

from ._connection import (
    REDIRECTS,
    Client,
    check_cluster_support,
    reroute,
    scored,
    text,
    transaction,
    watch_eviction_policy,
)
from ._coordination import Lane, Submission, detached, raise_if_cancel_swallowed, subscriber_of, to_the_end
from ._exceptions import AcquireTimeout, LimitMismatch, NotReplicated, PermitLost, SemaphoreError, out_of_memory
from ._holding import Hold, Refresher
from ._keys import SemaphoreKeys, check_prefix
from ._observing import emit, emit_permit, log_fields
from ._options import DEFAULT_PREFIX, DEFAULT_TIMEOUT
from ._protocol import LIMIT_MISMATCH, Reply, Step
from ._task_stack import TaskStack
from ._timing import Backoff, Bound, Deadline, step_bound
from ._validation import (
    check_callable,
    check_client,
    check_limit,
    check_name,
    check_now,
    check_replicas,
    check_timeout,
    check_upkeep,
    check_wait,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

    from ._options import LostCallback, SemaphoreOptions

logger = logging.getLogger("aiosem")

#: How long after a lease runs out its semaphore is re-checked: enough for
#: the server's clock to have passed it too.
_RECHECK_DELAY: Final = 0.001


#: How long an object keeps its channel subscribed once its last waiter has
#: gone: waits that follow one another closely share one subscription, and
#: a client closed meanwhile is let go of well within half a second.
_SUBSCRIPTION_LINGER: Final = 0.25


#: The longest pause between tries of a step that has to happen.
_MUST_STEP_PAUSE: Final = 0.005
#: Pauses of a failing pump or refresher grow by this much, up to a heartbeat;
#: so do those between tries of a release whose connection failed.
_RETRY_PAUSE: Final = 0.05
#: How often a release whose connection failed is tried again: enough for a
#: connection closed under it, not to wait out a server that is down.
_RELEASE_RETRIES: Final = 3


class _TimeUp(Exception):
    """Set on a waiter's future when its wait runs out before a grant."""


def _time_up(waiter: asyncio.Future[int]) -> None:
    if not waiter.done():
        waiter.set_exception(_TimeUp())


async def _granted_within(waiter: asyncio.Future[int], wait: float | None) -> int:
    """The token ``waiter`` is granted within ``wait`` seconds (``None``: for ever), or 0 if none was.

    A timer, not a cancel scope: waiting is what most acquires do under
    contention, and a scope costs several times what a timer does. A grant
    that comes first is taken, however late in the wait.
    """
    if wait is None:
        return await waiter
    timer = asyncio.get_running_loop().call_later(wait, _time_up, waiter)
    try:
        return await waiter
    except _TimeUp:
        return 0
    finally:
        timer.cancel()


def _failure(future: asyncio.Future[Any]) -> BaseException | None:
    """What ``future`` failed with, if it is done and failed (read, so not logged as never retrieved)."""
    return future.exception() if future.done() and not future.cancelled() else None


def _raise_failure(future: asyncio.Future[Any]) -> None:
    """Raise what ``future`` failed with, if it is done and failed."""
    failure = _failure(future)
    if failure is not None:
        raise failure


class _Default(enum.Enum):
    token = 0


#: Stands for "the semaphore's own ``blocking_timeout``" in `acquire`.
DEFAULT: Final = _Default.token


@dataclass(frozen=True, slots=True)
class Permit:
    """One permit of a semaphore, held by whoever has this object.

    The permit is the only token: nothing about it is stored in the semaphore
    object, so one semaphore object can be shared by any number of tasks.

    Attributes:
        name: The name of the semaphore.
        identifier: The holder's identifier in Redis, unique per grant.
        fencing_token: The semaphore's counter at the grant: one more than
            the last, or the server's clock in microseconds if that is
            higher. (A mutex relayed through a run of one object's
            waiters gets the run's tokens at the step that formed it, in
            the order they are used.) It strictly increases over the whole life of the
            semaphore -- even after the counter expired, a day after the
            last grant, or Redis lost its data -- so a resource that
            remembers the highest token it has seen can refuse a write that
            carries a lower one. With ``limit == 1`` this fences off a holder
            whose lease ran out while it was paused; with a larger limit
            several holders legitimately hold different tokens at once, so the
            token orders grants but does not prove which are still live.
        key: The Redis key the semaphore is stored under; a permit is only
            accepted by a semaphore with the same key.
        acquired_at: `time.monotonic` when this process got the permit
            (NaN for a permit made by hand), for measuring how long it is held.
    """

    name: str
    identifier: str
    fencing_token: int
    key: str
    acquired_at: float = field(default=math.nan, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class SemaphoreStatistics:
    """A snapshot of a semaphore, from this process's point of view.

    Attributes:
        name: The semaphore's name.
        limit: How many permits may be held at once.
        holders: Permits held, as Redis last answered this object.
        waiting: Waiters queued in all processes, as Redis last answered.
        local_waiters: Tasks of this process waiting through this object.
    """

    name: str
    limit: int
    holders: int
    waiting: int
    local_waiters: int


#: The holds of the current task's ``async with`` blocks, innermost last.
#: Each task runs in a context of its own, so tasks sharing one semaphore
#: object never see each other's permits.
_held: TaskStack[_Semaphore, Hold] = TaskStack("aiosem_held")


class _Semaphore(ABC):
    __slots__ = (
        "__weakref__",
        "_blocking_timeout",
        "_claiming",
        "_claims",
        "_client",
        "_clock",
        "_confirmed",
        "_holds",
        "_keys",
        "_lanes",
        "_last",
        "_limit",
        "_linger",
        "_loop",
        "_name",
        "_on_lost",
        "_passing",
        "_process",
        "_proven",
        "_pump",
        "_queued",
        "_recheck_at",
        "_refresh_failures",
        "_refresh_interval",
        "_relayed",
        "_replicas",
        "_run_timer",
        "_runs",
        "_subscribed",
        "_subscribing",
        "_timeout",
        "_unsubscribing",
        "_waiter_ttl",
        "_waiters",
        "_wake",
    )

    def __init__(self, client: Client, name: str, limit: int, options: SemaphoreOptions) -> None:
        # Each public class takes ``**options`` and refuses unknown ones in its own name.
        check_cluster_support(check_client(client))
        self._name = check_name(name)
        self._limit = check_limit(limit)
        self._timeout = check_timeout(options.get("timeout", DEFAULT_TIMEOUT))
        self._blocking_timeout = check_wait(options.get("blocking_timeout"))
        self._keys = SemaphoreKeys.for_name(check_prefix(options.get("prefix", DEFAULT_PREFIX)), name)
        clock = check_callable(options.get("clock"), "clock")
        self._waiter_ttl, self._refresh_interval = check_upkeep(
            options.get("waiter_timeout"), options.get("refresh_interval"), self._timeout
        )
        self._on_lost: LostCallback | None = check_callable(options.get("on_lost"), "on_lost")
        self._replicas = check_replicas(options.get("replicas", 0))
        self._client = client
        self._clock = clock
        #: This object's identity in Redis: its waiters' identifiers and its
        #: channel begin with it.
        self._process = secrets.token_hex(8)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lanes: dict[Step, Lane[Reply]] = {}
        #: Every waiting acquire's future, and those of them known to be queued.
        self._waiters: dict[str, asyncio.Future[int]] = {}
        self._queued: set[str] = set()
        #: Permits handed over by other processes, to claim; and being claimed.
        self._claims: set[str] = set()
        self._claiming: set[str] = set()
        self._pump: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._recheck_at: float | None = None
        #: The channel: subscribed (or failed to, and not tried again yet);
        #: being subscribed, or unsubscribed; and when it goes, unused.
        self._subscribed = False
        self._subscribing: asyncio.Task[None] | None = None
        self._unsubscribing: asyncio.Task[None] | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._last = Reply(0, 0, None, ())
        #: Permits kept alive by the refresher, by identifier.
        self._holds: dict[str, Hold] = {}
        self._refresh_failures = 0
        #: For each queued waiter, when the last step that found it queued
        #: was sent: a permit handed to it later has a lease from then on.
        self._proven: dict[str, float] = {}
        #: For each waiter resolved, how its lease was confirmed: (sent, lease).
        self._confirmed: dict[str, tuple[float, float]] = {}
        #: A mutex relayed through runs of this object's waiters (see
        #: `_relay`): the identifiers holding it, with how their lease was
        #: last confirmed; the run behind each (its waiters stay queued in
        #: Redis until a pass reaches them); and those whose relay is on its
        #: way there.
        self._relayed: dict[str, tuple[float, float]] = {}
        self._runs: dict[str, list[tuple[str, int]]] = {}
        self._passing: set[str] = set()
        self._run_timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        """The semaphore's name."""
        return self._name

    @property
    def limit(self) -> int:
        """How many permits may be held at once."""
        return self._limit

    @property
    def timeout(self) -> float:
        """The lease, in seconds: a permit neither refreshed nor released within it is reclaimed."""
        return self._timeout

    @property
    def blocking_timeout(self) -> float | None:
        """How long `acquire` and ``async with`` wait by default (``None``: for ever)."""
        return self._blocking_timeout

    @property
    def waiter_timeout(self) -> float:
        """How long a waiter whose process stopped answering keeps its place, in seconds."""
        return self._waiter_ttl

    @property
    def refresh_interval(self) -> float:
        """How often held permits are refreshed, in seconds (default: a third of ``timeout``)."""
        return self._refresh_interval

    @property
    def replicas(self) -> int:
        """How many replicas must acknowledge each acquire and refresh (0: none are waited for)."""
        return self._replicas

    @property
    def key(self) -> str:
        """The Redis key the semaphore is stored under (its other keys extend it)."""
        return self._keys.base

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, limit={self._limit}, "
            f"timeout={self._timeout:g}, blocking_timeout={self._blocking_timeout!r}, "
            f"waiter_timeout={self._waiter_ttl:g}, refresh_interval={self._refresh_interval:g}, "
            f"held={len(self._holds)}, waiting={len(self._waiters)}, key={self.key!r})"
        )

    @abstractmethod
    async def _execute(self, step: Step, identifiers: Sequence[str], call: str) -> Reply | None:
        """Carry out one step atomically; ``None`` if it could not run now and should be retried.

        A release with a ``call`` id leaves receipts of what it released, so
        that the same call tried again answers the same (see `_step`).
        """

    def _replicas_for(self, step: Step) -> int:
        """How many replicas a step must reach: acquires and refreshes wait for them, releases and counts do not."""
        return self._replicas if step.waits_for_replicas else 0

    @property
    def _step_bound(self) -> float:
        """How long one step may take before it is presumed stalled: a lease, and at least 5 s."""
        return step_bound(self._timeout)

    def _now(self) -> float | None:
        return None if self._clock is None else check_now(self._clock(), "clock()")

    async def _arrive(self, identifier: str) -> None:  # noqa: B027 -- a hook: a script queues on arrival
        """Note a blocking acquire's arrival, before its first step."""

    def _forget(self, identifier: str) -> None:  # noqa: B027 -- a hook: the fair strategy keeps nothing
        """Drop what a strategy keeps about an identifier whose acquire ended."""

    # --- steps -----------------------------------------------------------------

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError(f"{self!r} is in use by another event loop; create one semaphore object per loop")
        self._loop = loop
        self._lanes.clear()
        self._waiters.clear()
        self._queued.clear()
        self._claims.clear()
        self._claiming.clear()
        self._pump = None
        self._wake = asyncio.Event()
        self._subscribed = False
        self._subscribing = self._unsubscribing = self._linger = None
        self._holds.clear()
        self._proven.clear()
        self._confirmed.clear()
        self._relayed.clear()
        self._runs.clear()
        self._passing.clear()
        self._run_timer = None

    async def _submit(self, step: Step, identifiers: Sequence[str] | Submission[Reply]) -> tuple[Sequence[int], Reply]:
        self._bind()
        lane = self._lanes.get(step)
        if lane is None:
            lane = self._lanes[step] = Lane(lambda ids, since: self._step(step, ids, since))
        submission = identifiers if isinstance(identifiers, Submission) else Submission(identifiers)
        return await lane.submit(submission)

    async def _step(self, step: Step, identifiers: Sequence[str], waiting_since: float | None = None) -> Reply:
        """Carry out a step; a call that waited in its lane since ``waiting_since`` has that much less of its bound."""
        deadline: Deadline | None = None
        # A busy lock is held for a round trip or two; a step that backed off
        # as far as a polling waiter would lose it to every poller.
        backoff = Backoff(longest=_MUST_STEP_PAUSE)
        loop = asyncio.get_running_loop()
        # A release whose reply is lost with its connection may have been
        # carried out: tried again -- by redis-py or here -- under the same
        # id, it reads the first try's receipts, and a permit it released is
        # not mistaken for one lost.
        call = secrets.token_hex(8) if step.leaves_receipts else ""
        spent = 0.0 if waiting_since is None else loop.time() - waiting_since
        while True:
            sent = loop.time()
            if (reply := await self._bounded_execute(step, identifiers, call, spent)) is not None:
                break
            spent = 0.0
            if step is Step.TRY:
                reply = Reply(self._last.holders, self._last.waiting, None, (-1,) * len(identifiers))
                break
            # A step that has to happen may wait out a busy lock for as long
            # as a lease: by then the answer is moot.
            deadline = deadline or Deadline(self._timeout)
            if deadline.passed():
                raise SemaphoreError(
                    f"semaphore {self._name!r} stayed busy for {self._timeout:g} s; {step.operation.value} not done",
                    name=self._name,
                )
            await backoff.pause(deadline)
        self._observe(reply, sent)
        return reply

    async def _bounded_execute(
        self, step: Step, identifiers: Sequence[str], call: str, spent: float = 0.0
    ) -> Reply | None:
        """`_execute`, bounded so that a stalled connection cannot hang a step.

        On a cluster, a step turned away because the semaphore's slot moved
        or is moving did nothing, and is tried again on the slot's owner
        within the same bound. A release with a call id whose connection
        failed is tried again too, a few times: its receipts tell what a try
        whose reply was lost did.
        """
        redirect: Exception | None = None
        failures = 0
        try:
            with Bound(self._step_bound, f"a {step.operation.value} step of semaphore {self._name!r}", spent=spent):
                for attempt in itertools.count():
                    try:
                        reply = await self._execute(step, identifiers, call)
                    except REDIRECTS as error:
                        redirect = error
                        await reroute(self._client, error, attempt)
                        continue
                    except redis.ConnectionError:
                        failures += 1
                        if not call or failures > _RELEASE_RETRIES:
                            raise
                        await anyio.sleep(_RETRY_PAUSE * (failures - 1))
                        continue
                    break
        except redis.TimeoutError as error:
            if redirect is None:
                raise
            raise error from redirect  # on a cluster, why it took so long: the slot kept moving
        except redis.exceptions.OutOfMemoryError as error:
            raise out_of_memory(error, self._name) from None  # one short traceback that names the semaphore
        if reply is not None and reply.replicated is not None and reply.replicated < self._replicas:
            raise NotReplicated(name=self._name, replicas=self._replicas, acknowledged=reply.replicated)
        return reply

    def _observe(self, reply: Reply, sent: float) -> None:
        """Learn what a reply to a step sent at ``sent`` says about this object's waiters."""
        self._last = reply
        resolved = []
        for identifier, token in reply.granted:
            # Granted by this object's own call: a full lease, nothing to
            # claim -- unless replicas must have the grant and this step did
            # not wait for them: then a claim that does confirms it first.
            waiter = self._waiters.get(identifier)
            if waiter is not None and not waiter.done():
                if self._replicas and reply.replicated is None:
                    self._claims.add(identifier)
                    self._start_pump()
                    continue
                self._confirmed[identifier] = (sent, self._timeout)
                waiter.set_result(token)
                resolved.append(identifier)
        if reply.relayed and len(resolved) == 1:
            # (Granted to an acquire given up meanwhile, the permit goes back
            # by its cancel, to the head of the queue: the run's waiters are
            # queued there still, in their places.)
            (head,) = resolved
            self._relayed[head] = (sent, self._timeout)
            self._runs[head] = list(reply.relayed)
            self._watch_runs()
        if self._queued:
            self._recheck_when(reply)

    def _recheck_when(self, reply: Reply) -> None:
        """Have the pump re-check when the earliest lease a reply reports runs out."""
        if reply.next_expiry is not None:
            at = asyncio.get_running_loop().time() + reply.next_expiry + _RECHECK_DELAY
            if self._recheck_at is None or at < self._recheck_at:
                self._recheck_at = at
                self._wake.set()

    def _on_message(self, message: str) -> None:
        """A permit was handed to some of this object's waiters by another process."""
        now = asyncio.get_running_loop().time()
        for grant in message.split():
            identifier, _, token = grant.partition(":")
            # The permit is the waiter's from the grant on: it returns at once,
            # and the pump claims the whole lease behind it well within the
            # waiter timeout the grant was stamped with. A waiter no longer
            # here gave up, and its cancel step gives the permit back; one
            # resolved already was claimed by the re-check that resolved it.
            waiter = self._waiters.get(identifier)
            if waiter is None or waiter.done() or not token.isdigit():
                continue
            self._claims.add(identifier)
            # Granted after the last step that found it queued was sent, for
            # a waiter timeout: a lease at least that long. Unless a third of
            # it is sure to be left -- as a heartbeat a third of a waiter
            # timeout ago makes it, and a process slow to hear, or stalled,
            # does not -- the waiter returns only once its claim has found
            # the permit still there, and restarted its lease. (So it does
            # with replicas: the grant may not have reached them yet, and the
            # claim waits for them.)
            proven = self._proven.get(identifier, -math.inf)
            if not self._replicas and now < proven + self._waiter_ttl * 2 / 3:
                self._confirmed[identifier] = (proven, self._waiter_ttl)
                waiter.set_result(int(token))
        if self._claims:
            self._start_pump()

    # --- the pump --------------------------------------------------------------

    def _start_pump(self, *, wake: bool = True) -> None:
        """Run the pump, and have it look at once at its claims and due re-checks, unless ``wake`` is false."""
        if wake:
            self._wake.set()
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def _run_pump(self) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = self._waiter_ttl / 3
        next_beat = loop.time() + heartbeat
        failures = 0
        task = asyncio.current_task()
        try:
            while self._queued or self._claims:
                raise_if_cancel_swallowed(task)
                due = next_beat if self._recheck_at is None else min(next_beat, self._recheck_at)
                if not self._claims:
                    self._wake.clear()
                    with anyio.move_on_after(due - loop.time()):
                        await self._wake.wait()
                    if not self._claims and loop.time() < due:
                        continue
                claims, self._claims = self._claims, set()
                self._claiming |= claims
                # A claim goes at once, alone unless a heartbeat or re-check is
                # due too: then every queued waiter goes with it.
                everyone = loop.time() >= due
                identifiers = [*claims, *(i for i in self._queued if i not in claims)] if everyone else list(claims)
                if everyone:
                    self._recheck_at = None
                try:
                    sent = loop.time()
                    values, _ = await self._submit(Step.REFRESH, identifiers)
                    if everyone:
                        next_beat = loop.time() + heartbeat
                    await self._settle(identifiers, values, sent)
                except Exception:  # never let the pump die: waiters depend on it
                    failures += 1
                    self._claims |= claims & self._claiming
                    self._claiming -= claims
                    if failures == 1:
                        logger.warning(
                            "re-checking the waiters of %r failed; retrying",
                            self,
                            exc_info=True,
                            extra=log_fields(self._name),
                        )
                    await anyio.sleep(min(_RETRY_PAUSE * failures, heartbeat))
                    continue
                failures = 0
        finally:
            self._pump = None

    async def _settle(self, identifiers: Sequence[str], values: Sequence[int], sent: float) -> None:
        """Act on what a re-check sent at ``sent`` answered for each identifier."""
        dropped = []
        for identifier, value in zip(identifiers, values, strict=True):
            waiter = self._waiters.get(identifier)
            pending = waiter is not None and not waiter.done()
            hold = self._holds.get(identifier)
            if value > 0:
                if pending:
                    assert waiter is not None  # noqa: S101 -- pending says so
                    self._confirmed[identifier] = (sent, self._timeout)
                    waiter.set_result(value)
                elif hold is not None:
                    hold.confirm(sent, self._timeout)
            elif value == 0 and pending:
                self._proven[identifier] = sent
            elif value < 0:
                if pending:
                    dropped.append(identifier)
                elif identifier in self._claiming:
                    self._lost_before_claim(identifier)
            self._claiming.discard(identifier)
        if dropped:
            await self._requeue(dropped)

    async def _requeue(self, dropped: Sequence[str]) -> None:
        """Queue again, last, waiters the queue forgot (presumed dead: this process did not answer in time)."""
        logger.warning(
            "%d waiter(s) of %r lost their place in the queue; queueing again",
            len(dropped),
            self,
            extra=log_fields(self._name),
        )
        sent = asyncio.get_running_loop().time()
        requeued, _ = await self._submit(Step.WAIT, dropped)
        for identifier, value in zip(dropped, requeued, strict=True):
            waiter = self._waiters.get(identifier)
            if waiter is None or waiter.done():
                # Returned meanwhile: granted (by a message that overtook this
                # reply), and a holder now; or given up, and its own cancel
                # undoes what this step did, whichever of the two Redis saw
                # first (a cancel that came first left a tombstone, which
                # refused this step).
                continue
            if value > 0:
                self._confirmed[identifier] = (sent, self._timeout)
                waiter.set_result(value)
            elif value == 0:
                self._proven[identifier] = sent
            else:
                waiter.set_exception(
                    SemaphoreError(f"a waiter of semaphore {self._name!r} was refused", name=self._name)
                )

    def _lost_before_claim(self, identifier: str) -> None:
        hold = self._holds.get(identifier)
        if hold is None:
            logger.warning(
                "a permit of %r handed to this process was lost before it was claimed",
                self,
                extra=log_fields(self._name),
            )
        else:
            self._drop_hold(hold)
            hold.lose("it was handed over by another process and lost before it was claimed")

    # --- the object's channel -----------------------------------------------------

    @property
    def _channel(self) -> str:
        """The pub/sub channel other processes wake this object's waiters on."""
        return self._keys.channels + self._process

    @property
    def _listening(self) -> bool:
        """Whether the object needs its channel now: it has waiters."""
        return bool(self._waiters)

    def _listen(self) -> None:
        """Have the channel subscribed, and the pump running, for a waiter just queued.

        The subscription is made in the background, never in a caller's way:
        a grant published before the server confirmed it went unheard, so
        the confirmation has the pump look at once.
        """
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if not self._subscribed and self._subscribing is None:
            self._subscribing = asyncio.get_running_loop().create_task(self._subscribe(), name="aiosem subscribe")
        self._start_pump(wake=False)

    def _unlisten(self) -> None:
        """The last waiter has gone: the pump ends, and the channel goes unless a waiter comes soon."""
        self._wake.set()
        if (self._subscribed or self._subscribing is not None) and self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(_SUBSCRIPTION_LINGER, self._stop_listening)

    def _stop_listening(self) -> None:
        self._linger = None
        if not self._waiters and self._unsubscribing is None:
            self._unsubscribing = asyncio.get_running_loop().create_task(self._unsubscribe(), name="aiosem unsubscribe")

    def _channel_lost(self) -> None:
        """The subscriber dropped the channel (its connection failed while the object had no waiter)."""
        self._subscribed = False

    async def _subscribe(self) -> None:
        try:
            if self._unsubscribing is not None:
                await asyncio.shield(self._unsubscribing)
            await subscriber_of(self._client).subscribe(self._channel, self)
        except (TimeoutError, redis.RedisError, redis.exceptions.RedisClusterException):
            # Waiters still get their permits, from the pump's re-checks; the
            # object tries again once it has had no waiter for a while.
            logger.warning(
                "could not subscribe for %r; waiters will be slower to wake",
                self,
                exc_info=True,
                extra=log_fields(self._name),
            )
        finally:
            self._subscribing = None
        self._subscribed = True
        if self._queued:
            self._recheck_at = asyncio.get_running_loop().time()
            self._start_pump()

    async def _unsubscribe(self) -> None:
        try:
            if self._subscribing is not None:
                await asyncio.shield(self._subscribing)
            if self._waiters:
                return  # one came meanwhile, and finds the channel subscribed
            self._subscribed = False
            await subscriber_of(self._client).unsubscribe(self._channel)
        finally:
            self._unsubscribing = None

    # --- the interface ---------------------------------------------------------

    def _check_permit(self, permit: Permit) -> Permit:
        if not isinstance(permit, Permit):
            raise TypeError(f"permit must be a Permit, not {type(permit).__name__}")
        check_name(permit.identifier, "permit.identifier")
        if permit.key != self._keys.base:
            raise ValueError(
                f"permit belongs to the semaphore at {permit.key!r}, not to this one at {self._keys.base!r}"
            )
        return permit

    async def acquire(
        self,
        blocking: bool = True,
        blocking_timeout: float | _Default | None = DEFAULT,
        *,
        auto_refresh: bool = False,
        on_lost: LostCallback | None = None,
    ) -> Permit | None:
        """Take a permit, waiting for one if ``blocking``.

        A waiter joins a queue in Redis shared by every process; permits go
        to the queue in arrival order, and a non-blocking call never takes
        one while anybody is queued. When a permit frees, the step that frees
        it hands it to the head of the queue at once; the waiter's process
        hears of it by pub/sub (or at the latest at its next re-check), and
        returns it. A permit handed over by another process starts with a
        lease of ``waiter_timeout``, restarted for a whole ``timeout`` by a
        claim sent at once in the background. ``blocking_timeout`` bounds
        the whole call, counted from the call: nothing set up once (an
        object's subscription, a check of the server) is waited for, but
        `AsyncLockedSemaphore` may wait out a busy step lock before it is
        queued. Calls made in order in one process are sent, and served, in
        that order, from the first call on.

        With ``auto_refresh``, the permit is kept alive in the background
        (every ``refresh_interval``) until it is released; if it is lost
        meanwhile, ``on_lost`` -- or else the semaphore's ``on_lost`` -- is
        called with the `PermitLost`, a warning is logged, and `release`
        returns ``False``. (``async with`` does this and more: it cancels
        its body.) A permit kept alive and never released is kept alive for
        as long as the event loop runs, like a lock never unlocked.

        Args:
            blocking: Wait for a permit; with ``False``, try once and return.
            blocking_timeout: How long to wait at most, in seconds; ``None``
                or infinity waits for ever. Defaults to the semaphore's.
            auto_refresh: Keep the permit alive until it is released.
            on_lost: With ``auto_refresh``: called (in the refresher's task,
                so it must not block) with the `PermitLost` if the permit is
                lost; defaults to the semaphore's ``on_lost``.

        Returns:
            The `Permit`, or ``None`` if none could be had in time.

        Raises:
            TypeError: ``blocking_timeout`` is not a number, or ``on_lost``
                not callable.
            ValueError: ``blocking_timeout`` is negative or NaN, or
                ``on_lost`` is given without ``auto_refresh``.
            RuntimeError: The semaphore is in use by another event loop.
            LimitMismatch: The semaphore is in use -- somebody holds or
                waits -- with another limit; nothing was taken.
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease; or the queue forgot this waiter and would
                not take it back.
            OutOfMemory: Redis's memory is full, and it refused the step, which
                wrote nothing (see the faults page).
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            Nothing is left behind: a cancelled call leaves the queue, and a
            permit it was granted -- even one whose grant was still on its way
            to Redis -- is given back before the cancellation propagates
            (shielded, and bounded to 5 s). A permit granted just before
            Redis became unreachable ends with its lease.
        """
        if on_lost is not None:
            if not callable(on_lost):
                raise TypeError(f"on_lost must be callable or None, not {type(on_lost).__name__}")
            if not auto_refresh:
                raise ValueError("on_lost is only called for a permit kept alive: pass auto_refresh=True")
        taken = await self._take(blocking, blocking_timeout)
        if taken is None:
            return None
        permit, confirmed_at, lease = taken
        if auto_refresh:
            self._keep(permit, confirmed_at, lease, scope=None, on_lost=on_lost or self._on_lost)
        return permit

    async def _take(
        self, blocking: bool, blocking_timeout: float | _Default | None
    ) -> tuple[Permit, float, float] | None:
        """Acquire: the permit, when its lease was confirmed (loop time) and for how long."""
        wait = self._blocking_timeout if blocking_timeout is DEFAULT else check_wait(blocking_timeout)
        if not blocking:
            wait = 0.0
        self._bind()
        started = time.monotonic()
        # In the background: a call's order and its timeout owe nothing to a one-time check.
        watch_eviction_policy(self._client, self._keys.base)
        taken = await self._wait_for_permit(wait)
        if taken is None:
            emit("timed_out", "semaphore", self._name, time.monotonic() - started)
            return None
        permit, *_ = taken
        emit(
            "acquired",
            "semaphore",
            self._name,
            permit.acquired_at - started,
            identifier=permit.identifier,
            fencing_token=permit.fencing_token,
        )
        return taken

    async def _wait_for_permit(self, wait: float | None) -> tuple[Permit, float, float] | None:
        """`_take`, once its arguments are checked.

        Nothing is awaited before the call joins its lane, so calls are sent
        -- and queued -- in the order they were made, and the wait in the
        queue ends ``wait`` seconds after the call, whatever came before.
        """
        loop = asyncio.get_running_loop()
        deadline = None if wait is None else loop.time() + wait
        identifier = f"{self._process}.{secrets.token_hex(8)}"
        submission: Submission[Reply] = Submission((identifier,))
        waiter: asyncio.Future[int] | None = None
        try:
            if wait != 0:
                waiter = self._waiters[identifier] = loop.create_future()
                await self._arrive(identifier)
            sent = loop.time()
            if waiter is not None:
                # Queued, if at all, after this: so was any grant handed over by message.
                self._proven[identifier] = sent
            (value,), reply = await self._submit(Step.TRY if waiter is None else Step.WAIT, submission)
            confirmed = (sent, self._timeout)
            if waiter is not None:
                _raise_failure(waiter)  # the object was closed meanwhile: what was granted goes back
            if value == 0 and waiter is not None:
                value = await self._wait_in_queue(identifier, waiter, reply, deadline)
                confirmed = self._confirmed.get(identifier, confirmed)
        except (redis.ConnectionError, redis.ResponseError):
            # The server is out of reach or refused the script: a grant that
            # did happen ends with its lease, and a cancel would only delay
            # this error.
            raise
        except BaseException:
            # No longer a waiter from here on: a re-check answering meanwhile
            # must not queue it again.
            self._waiters.pop(identifier, None)
            self._queued.discard(identifier)
            if submission.sent:
                await self._give_up(identifier)
            raise
        finally:
            self._leave(identifier, waiter)
        if value > 0:
            return Permit(self._name, identifier, value, self._keys.base, time.monotonic()), *confirmed
        if value == LIMIT_MISMATCH:
            # Neither granted nor queued: nothing to give up.
            stored = await detached(self._client.get(self._keys.limit), name="aiosem limit")
            raise LimitMismatch(name=self._name, limit=self._limit, stored_limit=int(stored or 0))
        if waiter is not None:
            await self._give_up(identifier)
        return None

    def _leave(self, identifier: str, waiter: asyncio.Future[int] | None) -> None:
        """Forget an acquire that has ended, whichever way."""
        self._waiters.pop(identifier, None)
        self._queued.discard(identifier)
        self._proven.pop(identifier, None)
        self._confirmed.pop(identifier, None)
        self._forget(identifier)
        if waiter is not None:
            _failure(waiter)  # read: failed by `aclose` for a caller gone meanwhile, it is not news
        if not self._waiters:
            self._unlisten()

    async def _wait_in_queue(
        self, identifier: str, waiter: asyncio.Future[int], reply: Reply, deadline: float | None
    ) -> int:
        """Wait, queued, for ``waiter`` to be granted until ``deadline`` (loop time): its token, or 0 if too late."""
        self._queued.add(identifier)
        self._listen()  # the pump's next heartbeat proves this waiter alive too
        self._recheck_when(reply)
        loop = asyncio.get_running_loop()
        return await _granted_within(waiter, None if deadline is None else max(0.0, deadline - loop.time()))

    async def _give_up(self, *identifiers: str) -> None:
        """Leave the queue, give back any permit, and refuse a grant still on its way.

        A permit relayed to a waiter is relayed on; a waiter of a run that
        has not had it yet is passed over by the relay, and leaves the queue
        as any other.
        """
        self._claims.difference_update(identifiers)
        self._claiming.difference_update(identifiers)
        relayed = [identifier for identifier in identifiers if identifier in self._relayed]
        others = [identifier for identifier in identifiers if identifier not in self._relayed]
        try:
            await to_the_end(self._hand_back(relayed, others), name=f"giving back what an acquire of {self!r} took")
        except Exception:
            logger.warning(
                "could not give back what an interrupted acquire of %r took",
                self,
                exc_info=True,
                extra=log_fields(self._name),
            )

    async def _hand_back(self, relayed: Sequence[str], others: Sequence[str]) -> None:
        for identifier in relayed:
            await self._relay(identifier)
        if others:
            await self._submit(Step.CANCEL, others)

    async def _relay(self, identifier: str) -> bool:
        """Give up a relayed mutex: to the next waiter of its run at once, else to the queue; ``True`` if it was held.

        The next waiter returns before Redis hears of it: Redis moves the
        permit in a 'pass' release, sent at once and in order with every
        other pass of this object, and the waiter gets its token from the
        run and the rest of the holder's lease, restarted when the pass
        lands. It is told if the pass finds the permit gone. A holder whose
        lease may have run out passes nothing: Redis may have reaped the
        permit and handed it to the head of the queue, where the run's
        waiters still are, in their places.
        """
        loop = asyncio.get_running_loop()
        lease_from, lease = self._relayed.pop(identifier)
        run = self._runs.pop(identifier, [])
        successor, token = "", 0
        while run and loop.time() < lease_from + lease:
            candidate, candidate_token = run.pop(0)
            waiter = self._waiters.get(candidate)
            if waiter is not None and not waiter.done():
                successor, token = candidate, candidate_token
                if run:
                    self._runs[successor] = run
                self._relayed[successor] = self._confirmed[successor] = (lease_from, lease)
                self._passing.add(successor)
                waiter.set_result(token)
                self._watch_runs()
                break
        sent = loop.time()
        try:
            values, _ = await self._submit(Step.PASS, (identifier, successor, str(token) if token else ""))
        finally:
            self._passing.discard(successor)
        if successor and values[1] > 0:
            self._confirm_relayed(successor, sent)
        elif successor:
            self._relay_lost(successor)
        return values[0] == 1

    def _confirm_relayed(self, identifier: str, sent: float) -> None:
        """A pass sent at ``sent`` gave ``identifier`` the permit in Redis: its lease runs from then."""
        if identifier in self._relayed:
            self._relayed[identifier] = (sent, self._timeout)
        if identifier in self._confirmed:
            self._confirmed[identifier] = (sent, self._timeout)
        hold = self._holds.get(identifier)
        if hold is not None:
            hold.confirm(sent, self._timeout)

    def _relay_lost(self, identifier: str) -> None:
        """A pass found the permit relayed to ``identifier`` gone: it holds nothing, and its run ends."""
        if self._relayed.pop(identifier, None) is None:
            return  # relayed on already: that pass found it gone too
        self._end_run(self._runs.pop(identifier, []))
        hold = self._holds.get(identifier)
        if hold is not None:
            self._drop_hold(hold)
            hold.lose("the permit relayed to it was gone: its previous holder's lease had run out")

    def _lease_end(self, holder: str) -> float:
        """When the lease of a relayed permit may run out, as last confirmed (loop time)."""
        lease_from, lease = self._relayed.get(holder, (-math.inf, 0.0))
        return lease_from + lease

    def _watch_runs(self) -> None:
        """Look at the runs again when the earliest of their holders' leases may have run out."""
        if self._run_timer is None and self._runs:
            at = min(self._lease_end(holder) for holder in self._runs) + _RECHECK_DELAY
            self._run_timer = asyncio.get_running_loop().call_at(at, self._check_runs)

    def _check_runs(self) -> None:
        """End the runs whose holder's lease may have run out: Redis may have reaped it, and will not tell."""
        self._run_timer = None
        now = asyncio.get_running_loop().time()
        for holder in list(self._runs):
            if self._lease_end(holder) <= now:
                self._end_run(self._runs.pop(holder))
        self._watch_runs()

    def _end_run(self, run: Sequence[tuple[str, int]]) -> None:
        """Stop relaying to ``run``, whose waiters the permit may not reach: ask Redis at once who holds now.

        They are queued in Redis still, in their places, and Redis hands
        the permit on to the first of them when it frees.
        """
        if any(identifier in self._queued for identifier, _ in run):
            self._recheck_at = asyncio.get_running_loop().time()
            self._start_pump()

    async def release(self, permit: Permit) -> bool:
        """Give a permit back; the longest waiter, if any, gets it in the same step.

        Returns:
            ``True`` if the permit was held until now; ``False`` if it was
            lost (its lease ran out) or released before.

        Raises:
            TypeError: ``permit`` is not a `Permit`.
            ValueError: ``permit`` belongs to another semaphore.
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            OutOfMemory: Redis's memory is full, and it refused the step, which
                wrote nothing (see the faults page).
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            Not shielded: a cancelled release may or may not have reached
            Redis. ``async with`` shields its release for you.
        """
        permit = self._check_permit(permit)
        # Before anything is dropped: another loop's call must leave this loop's hold alone.
        self._bind()
        self._claims.discard(permit.identifier)
        self._claiming.discard(permit.identifier)
        hold = self._holds.get(permit.identifier)
        if hold is not None:
            self._drop_hold(hold)
        if permit.identifier in self._relayed:
            released = int(await self._relay(permit.identifier))
        else:
            (released,), _ = await self._submit(Step.RELEASE, (permit.identifier,))
        if released == 1:
            emit_permit("released", permit)
        elif hold is not None:
            hold.lose("the release found it gone")
        return released == 1

    async def refresh(self, permit: Permit) -> bool:
        """Restart a held permit's lease, so it lasts another ``timeout``.

        An expired permit is never revived: expired permits are reaped in the
        same atomic step before the lease is updated.

        Returns:
            ``True`` if the permit is still held; ``False`` if it was lost.

        Raises:
            TypeError: ``permit`` is not a `Permit`.
            ValueError: ``permit`` belongs to another semaphore.
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            OutOfMemory: Redis's memory is full, and it refused the step, which
                wrote nothing (see the faults page).
            redis.RedisError: Redis failed or could not be reached.
        """
        permit = self._check_permit(permit)
        sent = asyncio.get_running_loop().time()
        (token,), _ = await self._submit(Step.REFRESH, (permit.identifier,))
        # A permit relayed to it is held, though Redis has not heard yet.
        held = token > 0 or permit.identifier in self._passing
        if token > 0:
            self._confirm_relayed(permit.identifier, sent)
        elif not held and (hold := self._holds.get(permit.identifier)) is not None:
            self._drop_hold(hold)
            hold.lose("a refresh found it gone")
        return held

    # --- keeping permits alive ----------------------------------------------------

    def _keep(
        self,
        permit: Permit,
        confirmed_at: float,
        lease: float,
        *,
        scope: anyio.CancelScope | None,
        on_lost: LostCallback | None,
    ) -> Hold:
        """Keep ``permit`` alive until it is released or lost."""
        hold = self._holds[permit.identifier] = Hold(
            permit, confirmed_at=confirmed_at, lease=lease, scope=scope, on_lost=on_lost
        )
        Refresher.of_running_loop().schedule(self, self._next_round(hold))
        return hold

    def _drop_hold(self, hold: Hold) -> None:
        """Stop keeping a permit alive."""
        if self._holds.get(hold.permit.identifier) is hold:
            del self._holds[hold.permit.identifier]
            if not self._holds:
                Refresher.of_running_loop().cancel(self)

    def _next_round(self, hold: Hold) -> float:
        # A third of the lease still unproven leaves two tries before it runs out.
        return hold.confirmed_at + min(self._refresh_interval, hold.lease / 3)

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
        for index, hold in enumerate(holds):
            if self._holds.get(hold.permit.identifier) is not hold:
                continue  # released meanwhile
            if values is None:
                if hold.expired(now):
                    self._drop_hold(hold)
                    hold.lose(f"Redis did not answer before its lease ({hold.lease:g} s) could have run out")
            elif values[index] > 0:
                self._confirm_relayed(hold.permit.identifier, sent)
            elif hold.permit.identifier not in self._passing:  # else relayed to it, and not yet heard in Redis
                self._drop_hold(hold)
                hold.lose("a refresh found it gone: its lease ran out, or its keys were deleted")
        if not self._holds:
            return None
        next_round = min(self._next_round(hold) for hold in self._holds.values())
        if values is None:
            pause = min(_RETRY_PAUSE * self._refresh_failures, self._refresh_interval)
            return min(now + pause, next_round, *(h.confirmed_at + h.lease for h in self._holds.values()))
        self._refresh_failures = 0
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
                values, _ = await self._submit(Step.REFRESH, [hold.permit.identifier for hold in holds])
            except Exception:
                self._refresh_failures += 1
                if self._refresh_failures == 1:
                    logger.warning(
                        "refreshing the permits held through %r failed; retrying",
                        self,
                        exc_info=True,
                        extra=log_fields(self._name),
                    )
            else:
                return values
        return None

    async def aclose(self) -> None:
        """Give back every permit kept alive through this object, and stop its background work.

        Permits held by ``async with`` blocks still running, or taken with
        ``auto_refresh``, are released in one step (their bodies are not
        cancelled: their ``async with`` then raises `PermitLost`); waiting
        acquires fail with `SemaphoreError`; the object's subscription ends.
        The object can be used again afterwards.

        Raises:
            redis.RedisError: Giving back the permits failed (they end with
                their leases).
            TimeoutError: Closing took longer than 5 s (it goes on in the
                background).

        Cancellation:
            Held off until closing is done, for up to 5 s: a cancelled
            `aclose` still closes, then raises the cancellation.
        """
        if self._loop is None or self._loop is not asyncio.get_running_loop():
            return
        holds = list(self._holds.values())
        for hold in holds:
            self._drop_hold(hold)
            hold.lost = PermitLost(name=self._name, identifier=hold.permit.identifier)
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(SemaphoreError(f"semaphore {self._name!r} was closed", name=self._name))
        # The runs' waiters failed above: nothing is relayed to them any more.
        self._runs.clear()
        if self._run_timer is not None:
            self._run_timer.cancel()
            self._run_timer = None
        # Before the first await: the waiters failed above, ending, must find
        # the channel let go of already, and schedule nothing.
        subscribed = self._subscribed or self._subscribing is not None or self._unsubscribing is not None
        background = self._stop_background()
        await to_the_end(self._finish_closing(holds, background, subscribed=subscribed), name=f"closing {self!r}")

    async def _finish_closing(
        self, holds: list[Hold], background: list[asyncio.Task[None]], *, subscribed: bool
    ) -> None:
        """The part of `aclose` that waits: background work ended, the channel unsubscribed, ``holds`` released."""
        await asyncio.gather(*background, return_exceptions=True)
        if subscribed:
            await subscriber_of(self._client).unsubscribe(self._channel)
        if not holds:
            return
        # A relayed permit goes by the same lane as the passes that gave it.
        relayed = [hold for hold in holds if hold.permit.identifier in self._relayed]
        plain = [hold for hold in holds if hold.permit.identifier not in self._relayed]
        for hold in relayed:
            del self._relayed[hold.permit.identifier]
        outcomes: list[tuple[Hold, int]] = []
        if plain:
            values, _ = await self._submit(Step.RELEASE, [hold.permit.identifier for hold in plain])
            outcomes += zip(plain, values, strict=True)
        if relayed:
            passes = [part for hold in relayed for part in (hold.permit.identifier, "", "")]
            values, _ = await self._submit(Step.PASS, passes)
            outcomes += zip(relayed, values[::3], strict=True)
        for hold, value in outcomes:
            emit_permit("released" if value == 1 else "lost", hold.permit)

    def _stop_background(self) -> list[asyncio.Task[None]]:
        """Cancel the pump and the channel's tasks and timer; return the tasks, to wait for."""
        background = [task for task in (self._pump, self._subscribing, self._unsubscribing) if task is not None]
        for task in background:
            task.cancel()
        self._subscribed = False
        self._subscribing = self._unsubscribing = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        return background

    async def count(self) -> int:
        """Return how many permits are held now, in all processes.

        Like every step, it first reaps expired permits and dead waiters and
        hands what is free to the queue.

        Raises:
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            RuntimeError: The semaphore is in use by another event loop.
            OutOfMemory: Redis's memory is full, and it refused the step, which
                wrote nothing (see the faults page).
            redis.RedisError: Redis failed or could not be reached.
        """
        return (await self._census()).holders

    async def waiting(self) -> int:
        """Return how many waiters are queued now, in all processes.

        Waiters a mutex is being relayed to within their process (see the
        design page) have left the queue, and are not counted. A step like
        `count`, and raises what it raises.
        """
        return (await self._census()).waiting

    async def _census(self) -> Reply:
        _, reply = await self._submit(Step.COUNT, ())
        return reply

    async def holders(self) -> dict[str, float]:
        """Return the live holders' identifiers, each with the seconds left of its lease.

        A read-only look: nothing is reaped or handed off.

        Raises:
            OutOfMemory: Redis's memory is full: it refuses even this
                look, which is one transaction.
            redis.RedisError: Redis failed or could not be reached.
        """
        keys = self._keys
        try:
            leases, owners, time = await detached(
                transaction(
                    self._client,
                    keys.base,
                    ("ZRANGE", keys.timeout_set, 0, -1, "WITHSCORES"),
                    ("ZRANGE", keys.owner_set, 0, -1),
                    ("TIME",),
                ),
                name="aiosem holders",
            )
        except redis.exceptions.OutOfMemoryError as error:
            raise out_of_memory(error, self._name) from None
        now = self._now()
        if now is None:
            now = int(time[0]) + int(time[1]) / 1_000_000
        owned = {text(owner) for owner in owners}
        return {
            member: remaining
            for member, score in scored(leases)
            if member in owned and (remaining := score + self._timeout - now) > 0
        }

    def statistics(self) -> SemaphoreStatistics:
        """Return a snapshot: counts as Redis last answered this object, and its local waiters."""
        return SemaphoreStatistics(
            name=self._name,
            limit=self._limit,
            holders=self._last.holders,
            waiting=self._last.waiting,
            local_waiters=len(self._waiters),
        )

    async def _end_hold(self, permit: Permit, lost: PermitLost | None, exc: BaseException | None) -> PermitLost | None:
        """Release a held permit as its holder ends, shielded and bounded; return its loss, if any.

        A permit known lost is not released: it is gone, or its lease may
        have run out while Redis was out of reach, and a release would only
        keep the holder waiting on that. A release that fails after the
        holder raised ``exc`` is logged; after a holder that completed, it
        is raised.
        """
        if lost is not None:
            return lost
        try:
            released = await to_the_end(self.release(permit), name=f"the release of {permit}")
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
        if released:
            return None
        emit_permit("lost", permit)
        return PermitLost(name=self._name, identifier=permit.identifier)

    async def __aenter__(self) -> Permit:
        """Acquire a permit for the body, waiting up to ``blocking_timeout``, and keep it alive.

        While the body runs, the permit is refreshed every
        ``refresh_interval``. If it is lost -- a refresh finds it gone, or
        Redis stays out of reach until its lease may have run out -- the body
        is cancelled at once (a cancel scope: no `ExceptionGroup`) and the
        ``async with`` raises `PermitLost`; with ``on_lost`` set on the
        semaphore, that callback is called instead and the body runs on.

        Raises:
            AcquireTimeout: No permit within ``blocking_timeout``.
            LimitMismatch: The semaphore is in use with another limit.
            OutOfMemory: Redis's memory is full, and it refused the step, which
                wrote nothing (see the faults page).
            redis.RedisError: Redis failed or could not be reached.
        """
        taken = await self._take(blocking=True, blocking_timeout=DEFAULT)
        if taken is None:
            assert self._blocking_timeout is not None  # noqa: S101 -- only a bounded wait gives up
            raise AcquireTimeout(name=self._name, blocking_timeout=self._blocking_timeout)
        permit, confirmed_at, lease = taken
        scope = anyio.CancelScope() if self._on_lost is None else None
        hold = self._keep(permit, confirmed_at, lease, scope=scope, on_lost=self._on_lost)
        if scope is not None:
            scope.__enter__()
        _held.push(self, hold)
        return permit

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop refreshing the body's permit and release it, shielded from cancellation.

        Raises:
            PermitLost: The permit was lost while the body ran (the body was
                cancelled for it, or, with ``on_lost``, ran to its end), or
                the release found it gone. Whatever the body raised is its
                context. Only a cancellation from outside wins over it: that
                propagates, and the loss is logged.
            TimeoutError: The release took longer than 5 s although the body
                completed; the permit ends with its lease.
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            redis.RedisError: The release failed although the body completed.
        """
        hold = _held.pop(self)
        # The body gave its permit back itself with `release`: nothing more to do.
        released = hold.lost is None and self._holds.get(hold.permit.identifier) is not hold
        self._drop_hold(hold)
        permit = hold.permit
        # The scope swallows the cancellation it delivered itself, no other.
        try:
            ours = hold.scope is not None and bool(hold.scope.__exit__(exc_type, exc, traceback))
        except BaseException as error:
            # A scope left out of order (a framework that nests blocks badly)
            # must not keep the permit until its lease runs out.
            if not released:
                await self._end_hold(permit, hold.lost, error)
            raise
        if released:
            return
        lost = await self._end_hold(permit, hold.lost, exc)
        if lost is None:
            return
        if ours:
            raise lost from None
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            logger.warning(
                "%s was lost while its body was being cancelled",
                permit,
                extra=log_fields(permit.name, permit.identifier),
            )
            return
        raise lost
