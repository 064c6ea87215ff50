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
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Final, Literal

import anyio
import redis

from ._coordination import Lane, Submission, Subscriber, raise_if_cancel_swallowed, text
from ._exceptions import AcquireTimeout, PermitLost, SemaphoreError
from ._keys import SemaphoreKeys, check_prefix
from ._timing import Backoff, Deadline
from ._validation import check_limit, check_name, check_timeout, check_wait

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

    from redis.asyncio import Redis

logger = logging.getLogger("aiosem")

Operation = Literal["acquire", "release", "refresh"]

#: How long a release that runs while its caller is being cancelled, or after
#: its body failed, may take before it is abandoned to the lease.
_CLEANUP_TIMEOUT: Final = 5.0
#: The default waiter timeout, unless the lease is shorter.
_WAITER_TIMEOUT: Final = 2.0
#: How long after a lease runs out its semaphore is re-checked: enough for
#: the server's clock to have passed it too.
_RECHECK_DELAY: Final = 0.001


#: The longest pause between tries of a step that has to happen.
_MUST_STEP_PAUSE: Final = 0.005
#: Pauses of a failing pump grow by this much, up to a heartbeat.
_RETRY_PAUSE: Final = 0.05


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
        fencing_token: The semaphore's counter at the grant. It strictly
            increases over the whole life of the semaphore, so a resource that
            remembers the highest token it has seen can refuse a write that
            carries a lower one. With ``limit == 1`` this fences off a holder
            whose lease ran out while it was paused; with a larger limit
            several holders legitimately hold different tokens at once, so the
            token orders grants but does not prove which are still live.
        key: The Redis key the semaphore is stored under; a permit is only
            accepted by a semaphore with the same key.
    """

    name: str
    identifier: str
    fencing_token: int
    key: str


@dataclass(frozen=True, slots=True)
class Reply:
    """What one atomic step in Redis answered.

    Attributes:
        holders: Permits held once the step was done.
        waiting: Waiters queued once the step was done.
        next_expiry: Seconds until the earliest live lease runs out, or
            ``None`` when nobody holds.
        values: One result per identifier of the step (see the scripts).
        granted: The waiters this step handed a permit, with their tokens.
    """

    holders: int
    waiting: int
    next_expiry: float | None
    values: tuple[int, ...]
    granted: tuple[tuple[str, int], ...] = ()


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


#: The permits the current task holds through ``async with``, innermost
#: last. Each task runs in a context of its own, so tasks sharing one
#: semaphore object never see each other's permits.
_held: ContextVar[tuple[tuple[_Semaphore, Permit], ...]] = ContextVar("aiosem_held", default=())


class _Semaphore(ABC):
    __slots__ = (
        "__weakref__",
        "_blocking_timeout",
        "_claiming",
        "_claims",
        "_client",
        "_clock",
        "_keys",
        "_lanes",
        "_last",
        "_limit",
        "_loop",
        "_name",
        "_process",
        "_pump",
        "_queued",
        "_recheck_at",
        "_subscribed",
        "_timeout",
        "_waiter_ttl",
        "_waiters",
        "_wake",
    )

    def __init__(
        self,
        client: Redis,
        name: str,
        limit: int,
        *,
        timeout: float = 10.0,
        blocking_timeout: float | None = None,
        prefix: str = "aiosem",
        clock: Callable[[], float] | None = None,
        waiter_timeout: float | None = None,
    ) -> None:
        self._name = check_name(name)
        self._limit = check_limit(limit)
        self._timeout = check_timeout(timeout)
        self._blocking_timeout = check_wait(blocking_timeout)
        self._keys = SemaphoreKeys.for_name(check_prefix(prefix), name)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be callable or None, not {type(clock).__name__}")
        if waiter_timeout is None:
            self._waiter_ttl = min(_WAITER_TIMEOUT, self._timeout)
        else:
            self._waiter_ttl = check_timeout(waiter_timeout, "waiter_timeout")
            if self._waiter_ttl > self._timeout:
                raise ValueError(f"waiter_timeout must not exceed timeout ({self._timeout:g} s), got {waiter_timeout}")
        self._client = client
        self._clock = clock
        #: This object's identity in Redis: its waiters' identifiers and its
        #: channel begin with it.
        self._process = secrets.token_hex(8)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lanes: dict[tuple[Operation, str], Lane[Reply]] = {}
        #: Every waiting acquire's future, and those of them known to be queued.
        self._waiters: dict[str, asyncio.Future[int]] = {}
        self._queued: set[str] = set()
        #: Permits handed over by other processes, to claim; and being claimed.
        self._claims: set[str] = set()
        self._claiming: set[str] = set()
        self._pump: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._recheck_at: float | None = None
        self._subscribed = False
        self._last = Reply(0, 0, None, ())

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
    def key(self) -> str:
        """The Redis key the semaphore is stored under (its other keys extend it)."""
        return self._keys.base

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, limit={self._limit}, "
            f"timeout={self._timeout:g}, blocking_timeout={self._blocking_timeout!r}, "
            f"waiter_timeout={self._waiter_ttl:g}, key={self.key!r})"
        )

    @abstractmethod
    async def _execute(self, operation: Operation, mode: str, identifiers: Sequence[str]) -> Reply | None:
        """Carry out one step atomically; ``None`` if it could not run now and should be retried."""

    def _now(self) -> float | None:
        return None if self._clock is None else self._clock()

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

    async def _submit(
        self, operation: Operation, mode: str, identifiers: Sequence[str] | Submission
    ) -> tuple[Sequence[int], Reply]:
        self._bind()
        lane = self._lanes.get((operation, mode))
        if lane is None:
            lane = self._lanes[operation, mode] = Lane(lambda ids: self._step(operation, mode, ids))
        submission = identifiers if isinstance(identifiers, Submission) else Submission(identifiers)
        return await lane.submit(submission)

    async def _step(self, operation: Operation, mode: str, identifiers: Sequence[str]) -> Reply:
        deadline: Deadline | None = None
        # A busy lock is held for a round trip or two; a step that backed off
        # as far as a polling waiter would lose it to every poller.
        backoff = Backoff(longest=_MUST_STEP_PAUSE)
        while (reply := await self._execute(operation, mode, identifiers)) is None:
            if operation == "acquire" and mode == "try":
                reply = Reply(self._last.holders, self._last.waiting, None, (-1,) * len(identifiers))
                break
            # A step that has to happen may wait out a busy lock for as long
            # as a lease: by then the answer is moot.
            deadline = deadline or Deadline(self._timeout)
            if deadline.passed():
                raise SemaphoreError(
                    f"semaphore {self._name!r} stayed busy for {self._timeout:g} s; {operation} not done",
                    name=self._name,
                )
            await backoff.pause(deadline)
        self._observe(reply)
        return reply

    def _observe(self, reply: Reply) -> None:
        """Learn what a reply says about this object's waiters."""
        self._last = reply
        for identifier, token in reply.granted:
            # Granted by this object's own call: a full lease, nothing to claim.
            waiter = self._waiters.get(identifier)
            if waiter is not None and not waiter.done():
                waiter.set_result(token)
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
        for grant in message.split():
            identifier, _, token = grant.partition(":")
            # The permit is the waiter's from the grant on: it returns at once,
            # and the pump claims the whole lease behind it well within the
            # waiter timeout the grant was stamped with. A waiter no longer
            # here gave up, and its cancel step gives the permit back; one
            # resolved already was claimed by the re-check that resolved it.
            waiter = self._waiters.get(identifier)
            if waiter is not None and not waiter.done() and token.isdigit():
                waiter.set_result(int(token))
                self._claims.add(identifier)
        if self._claims:
            self._start_pump()

    # --- the pump --------------------------------------------------------------

    def _start_pump(self) -> None:
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
                    values, _ = await self._submit("refresh", "", identifiers)
                    if everyone:
                        next_beat = loop.time() + heartbeat
                    await self._settle(identifiers, values)
                except Exception:  # never let the pump die: waiters depend on it
                    failures += 1
                    self._claims |= claims & self._claiming
                    self._claiming -= claims
                    if failures == 1:
                        logger.warning("re-checking the waiters of %r failed; retrying", self, exc_info=True)
                    await anyio.sleep(min(_RETRY_PAUSE * failures, heartbeat))
                    continue
                failures = 0
        finally:
            self._pump = None

    async def _settle(self, identifiers: Sequence[str], values: Sequence[int]) -> None:
        """Act on what a re-check answered for each identifier."""
        dropped = []
        for identifier, value in zip(identifiers, values, strict=True):
            waiter = self._waiters.get(identifier)
            if value > 0:
                if waiter is not None and not waiter.done():
                    waiter.set_result(value)
            elif value < 0:
                if waiter is not None and not waiter.done():
                    dropped.append(identifier)
                elif identifier in self._claiming:
                    logger.warning("a permit of %r handed to this process was lost before it was claimed", self)
            self._claiming.discard(identifier)
        if dropped:
            # The queue forgot these waiters, presumed dead (this process did
            # not answer for a whole waiter timeout): queue them again, last.
            logger.warning("%d waiter(s) of %r lost their place in the queue; queueing again", len(dropped), self)
            requeued, _ = await self._submit("acquire", "wait", dropped)
            abandoned = []
            for identifier, value in zip(dropped, requeued, strict=True):
                waiter = self._waiters.get(identifier)
                if waiter is None or waiter.done():
                    # Given up while it was being queued again: its own cancel
                    # may have run first, so undo what this step did.
                    abandoned.append(identifier)
                elif value > 0:
                    waiter.set_result(value)
                elif value < 0:
                    waiter.set_exception(
                        SemaphoreError(f"a waiter of semaphore {self._name!r} was refused", name=self._name)
                    )
            if abandoned:
                await self._give_up(*abandoned)

    async def _subscribe(self) -> None:
        if self._subscribed:
            return
        try:
            await Subscriber.of(self._client).subscribe(self._keys.channels + self._process, self._on_message)
        except (TimeoutError, redis.RedisError):
            if not self._subscribed:
                # Waiters still get their permits, from the pump's re-checks.
                logger.warning("could not subscribe for %r; waiters will be slower to wake", self, exc_info=True)
        self._subscribed = True

    # --- the interface ---------------------------------------------------------

    def _check_permit(self, permit: Permit) -> Permit:
        if not isinstance(permit, Permit):
            raise TypeError(f"permit must be a Permit, not {type(permit).__name__}")
        if permit.key != self._keys.base:
            raise ValueError(
                f"permit belongs to the semaphore at {permit.key!r}, not to this one at {self._keys.base!r}"
            )
        return permit

    async def acquire(
        self, blocking: bool = True, blocking_timeout: float | _Default | None = DEFAULT
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
        the wait in the queue; the first blocking call of a semaphore object
        also subscribes to its channel (at most 5 s), and
        `AsyncLockedSemaphore` may wait out a busy lock before it is queued.

        Args:
            blocking: Wait for a permit; with ``False``, try once and return.
            blocking_timeout: How long to wait at most, in seconds; ``None``
                or infinity waits for ever. Defaults to the semaphore's.

        Returns:
            The `Permit`, or ``None`` if none could be had in time.

        Raises:
            TypeError: ``blocking_timeout`` is not a number.
            ValueError: ``blocking_timeout`` is negative or NaN.
            RuntimeError: The semaphore is in use by another event loop.
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease; or the queue forgot this waiter and would
                not take it back.
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            Nothing is left behind: a cancelled call leaves the queue, and a
            permit it was granted -- even one whose grant was still on its way
            to Redis -- is given back before the cancellation propagates
            (shielded, and bounded to 5 s). A permit granted just before
            Redis became unreachable ends with its lease.
        """
        wait = self._blocking_timeout if blocking_timeout is DEFAULT else check_wait(blocking_timeout)
        if not blocking:
            wait = 0.0
        self._bind()
        identifier = f"{self._process}.{secrets.token_hex(8)}"
        submission = Submission((identifier,))
        waiter: asyncio.Future[int] | None = None
        try:
            if wait != 0:
                await self._subscribe()
                waiter = self._waiters[identifier] = asyncio.get_running_loop().create_future()
                await self._arrive(identifier)
            (value,), reply = await self._submit("acquire", "try" if waiter is None else "wait", submission)
            if value == 0 and waiter is not None:
                self._queued.add(identifier)
                self._start_pump()
                self._recheck_when(reply)
                with anyio.move_on_after(wait):
                    value = await waiter
                if waiter.done() and not waiter.cancelled():
                    value = waiter.result()  # granted as the wait ran out: take it
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
            self._waiters.pop(identifier, None)
            self._queued.discard(identifier)
            self._forget(identifier)
        if value > 0:
            return Permit(self._name, identifier, value, self._keys.base)
        if waiter is not None:
            await self._give_up(identifier)
        return None

    async def _give_up(self, *identifiers: str) -> None:
        """Leave the queue, give back any permit, and refuse a grant still on its way."""
        self._claims.difference_update(identifiers)
        self._claiming.difference_update(identifiers)
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT):
            try:
                await self._submit("release", "cancel", identifiers)
            except Exception:
                logger.warning("could not give back what an interrupted acquire of %r took", self, exc_info=True)

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
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            Not shielded: a cancelled release may or may not have reached
            Redis. ``async with`` shields its release for you.
        """
        permit = self._check_permit(permit)
        self._claims.discard(permit.identifier)
        self._claiming.discard(permit.identifier)
        (released,), _ = await self._submit("release", "release", (permit.identifier,))
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
            redis.RedisError: Redis failed or could not be reached.
        """
        permit = self._check_permit(permit)
        (token,), _ = await self._submit("refresh", "", (permit.identifier,))
        return token > 0

    async def count(self) -> int:
        """Return how many permits are held now, in all processes.

        Like every step, it first reaps expired permits and dead waiters and
        hands what is free to the queue.

        Raises:
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            RuntimeError: The semaphore is in use by another event loop.
            redis.RedisError: Redis failed or could not be reached.
        """
        return (await self._census()).holders

    async def waiting(self) -> int:
        """Return how many waiters are queued now, in all processes.

        A step like `count`, and raises what it raises.
        """
        return (await self._census()).waiting

    async def _census(self) -> Reply:
        _, reply = await self._submit("acquire", "count", ())
        return reply

    async def holders(self) -> dict[str, float]:
        """Return the live holders' identifiers, each with the seconds left of its lease.

        A read-only look: nothing is reaped or handed off.

        Raises:
            redis.RedisError: Redis failed or could not be reached.
        """
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.zrange(self._keys.timeout_set, 0, -1, withscores=True)
            pipe.zrange(self._keys.owner_set, 0, -1)
            pipe.time()
            leases, owners, (seconds, microseconds) = await pipe.execute()
        now = self._now()
        if now is None:
            now = seconds + microseconds / 1_000_000
        owned = {text(owner) for owner in owners}
        return {
            text(member): remaining
            for member, score in leases
            if text(member) in owned and (remaining := score + self._timeout - now) > 0
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

    async def __aenter__(self) -> Permit:
        """Acquire a permit for the body, waiting up to ``blocking_timeout``.

        Raises:
            AcquireTimeout: No permit within ``blocking_timeout``.
            redis.RedisError: Redis failed or could not be reached.
        """
        permit = await self.acquire()
        if permit is None:
            assert self._blocking_timeout is not None  # noqa: S101 -- only a bounded wait gives up
            raise AcquireTimeout(name=self._name, blocking_timeout=self._blocking_timeout)
        _held.set((*_held.get(), (self, permit)))
        return permit

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Release the body's permit, shielded from cancellation.

        Raises:
            PermitLost: The body completed, but the permit had been lost
                before the release: the body may have overlapped with another
                holder. (If the body raised, its exception propagates and the
                loss is logged instead.)
            TimeoutError: The release took longer than 5 s although the body
                completed; the permit ends with its lease.
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            redis.RedisError: The release failed although the body completed.
        """
        held = _held.get()
        index = next((i for i in reversed(range(len(held))) if held[i][0] is self), None)
        if index is None:
            raise RuntimeError(f"{self!r}: __aexit__ without a matching __aenter__ in this task")
        permit = held[index][1]
        _held.set(held[:index] + held[index + 1 :])
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(_CLEANUP_TIMEOUT):
                    released = await self.release(permit)
            except Exception:
                if exc is None:
                    raise
                logger.warning("releasing %s failed after its body raised", permit, exc_info=True)
                return
        if not released:
            if exc is None:
                raise PermitLost(name=self._name, identifier=permit.identifier)
            logger.warning("%s was lost before its body raised", permit)
