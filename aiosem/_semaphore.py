"""The mechanism both semaphores share: permits, acquiring, holding, releasing.

`AsyncFairSemaphore` and `AsyncLockedSemaphore` differ only in how one step
-- grant, release or refresh some identifiers -- is carried out atomically in
Redis (`_Semaphore._execute`); everything a caller sees is here.
"""

from __future__ import annotations

import enum
import logging
import secrets
from abc import ABC, abstractmethod
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

import anyio
import redis

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


#: The longest pause between tries of a step that has to happen.
_MUST_STEP_PAUSE: Final = 0.005


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
        next_expiry: Seconds until the earliest live lease runs out, or
            ``None`` when nobody holds.
        values: One result per identifier of the step: a fencing token
            (0: not granted) for a grant, 1 or 0 for a release or refresh.
    """

    holders: int
    next_expiry: float | None
    values: tuple[int, ...]


#: The permits the current task holds through ``async with``, innermost
#: last. Each task runs in a context of its own, so tasks sharing one
#: semaphore object never see each other's permits.
_held: ContextVar[tuple[tuple[_Semaphore, Permit], ...]] = ContextVar("aiosem_held", default=())


class _Semaphore(ABC):
    __slots__ = ("_blocking_timeout", "_client", "_clock", "_keys", "_limit", "_name", "_timeout")

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
    ) -> None:
        self._name = check_name(name)
        self._limit = check_limit(limit)
        self._timeout = check_timeout(timeout)
        self._blocking_timeout = check_wait(blocking_timeout)
        self._keys = SemaphoreKeys.for_name(check_prefix(prefix), name)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be callable or None, not {type(clock).__name__}")
        self._client = client
        self._clock = clock

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
    def key(self) -> str:
        """The Redis key the semaphore is stored under (its other keys extend it)."""
        return self._keys.base

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, limit={self._limit}, "
            f"timeout={self._timeout:g}, blocking_timeout={self._blocking_timeout!r}, key={self.key!r})"
        )

    @abstractmethod
    async def _execute(self, operation: Operation, identifiers: Sequence[str]) -> Reply | None:
        """Carry out one step atomically; ``None`` if it could not run now and should be retried."""

    def _now(self) -> float | None:
        return None if self._clock is None else self._clock()

    async def _must_step(self, operation: Operation, identifiers: Sequence[str]) -> Reply:
        # A step that has to happen (release, refresh, count) may wait out a
        # busy lock for as long as a lease: by then the answer is moot.
        deadline = Deadline(self._timeout)
        # A busy lock is held for a round trip or two; a release that backed
        # off as far as a waiting acquire would lose it to every poller.
        backoff = Backoff(longest=_MUST_STEP_PAUSE)
        while (reply := await self._execute(operation, identifiers)) is None:
            if deadline.passed():
                raise SemaphoreError(
                    f"semaphore {self._name!r} stayed busy for {self._timeout:g} s; {operation} not done",
                    name=self._name,
                )
            await backoff.pause(deadline)
        return reply

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

        Waiting polls Redis with a jittered back-off of 1 to 50 ms, and ends
        at once when a holder's lease runs out before that.

        Args:
            blocking: Wait for a permit; with ``False``, try once and return.
            blocking_timeout: How long to wait at most, in seconds; ``None``
                or infinity waits for ever. Defaults to the semaphore's.

        Returns:
            The `Permit`, or ``None`` if none could be had in time.

        Raises:
            TypeError: ``blocking_timeout`` is not a number.
            ValueError: ``blocking_timeout`` is negative or NaN.
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            A cancelled call may have been granted a permit whose reply it
            never read. It releases that identifier, shielded from the
            cancellation and bounded in time, before the cancellation
            propagates. Should that release reach Redis before the grant
            does, the permit is held until its lease runs out; so is one
            granted just before the connection failed.
        """
        wait = self._blocking_timeout if blocking_timeout is DEFAULT else check_wait(blocking_timeout)
        deadline = Deadline(wait if blocking else 0.0)
        identifier = secrets.token_hex(16)
        backoff = Backoff()
        while True:
            try:
                reply = await self._execute("acquire", (identifier,))
            except (redis.ConnectionError, redis.ResponseError):
                # The script was refused or the server is out of reach: a grant
                # that did happen ends with its lease, and a release would only
                # delay this error.
                raise
            except BaseException:
                await self._abandon(identifier)
                raise
            if reply is not None and reply.values[0]:
                return Permit(self._name, identifier, reply.values[0], self._keys.base)
            if deadline.passed():
                return None
            await backoff.pause(deadline, wake_by=None if reply is None else reply.next_expiry)

    async def _abandon(self, identifier: str) -> None:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT):
            try:
                await self._must_step("release", (identifier,))
            except Exception:
                logger.warning("could not give back the permit of an interrupted acquire", exc_info=True)

    async def release(self, permit: Permit) -> bool:
        """Give a permit back.

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
        reply = await self._must_step("release", (permit.identifier,))
        return bool(reply.values[0])

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
        reply = await self._must_step("refresh", (permit.identifier,))
        return bool(reply.values[0])

    async def count(self) -> int:
        """Return how many permits are held now, after reaping expired ones.

        Raises:
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            redis.RedisError: Redis failed or could not be reached.
        """
        reply = await self._must_step("acquire", ())
        return reply.holders

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
