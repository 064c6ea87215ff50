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
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._connection import (
    Client,
    check_cluster_support,
    watch_eviction_policy,
)
from ._core import Core, Settings
from ._exceptions import AcquireTimeout, LimitMismatch, LimitNotSet
from ._holding import tell_release
from ._keys import SemaphoreKeys, check_prefix
from ._observing import emit, log_fields
from ._options import DEFAULT, DEFAULT_PREFIX, DEFAULT_TIMEOUT, _Default
from ._permit import Permit
from ._protocol import LIMIT_MISMATCH, NO_LIMIT, TOO_HEAVY, Reply, Step
from ._validation import (
    check_callable,
    check_client,
    check_label,
    check_limit,
    check_name,
    check_replicas,
    check_timeout,
    check_upkeep,
    check_wait,
    check_weight,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from contextlib import AbstractAsyncContextManager
    from types import TracebackType

    from ._core import Backend
    from ._holding import Hold
    from ._options import LostCallback, SemaphoreOptions

logger = logging.getLogger("aiosem")


@dataclass(frozen=True, slots=True)
class SemaphoreStatistics:
    """A snapshot of a semaphore, from this process's point of view.

    Attributes:
        name: The semaphore's name.
        limit: The limit in force, as Redis last answered this object
            (before its first step: the limit it was made with, if any).
        holders: The weight of the permits held (each at its weight, 1 unless
            acquired with one), as Redis last answered this object.
        waiting: Waiters queued in all processes, as Redis last answered.
        local_waiters: Tasks of this process waiting through this object.
    """

    name: str
    limit: int | None
    holders: int
    waiting: int
    local_waiters: int


#: The holds of the current task's ``async with`` blocks, innermost last.
#: Each task runs in a context of its own, so tasks sharing one semaphore
#: object never see each other's permits.


class _Semaphore:
    __slots__ = (
        "__weakref__",
        "_blocking_timeout",
        "_client",
        "_core",
        "_keys",
        "_on_lost",
        "_process",
        "_settings",
    )

    def __init__(
        self,
        client: Client,
        name: str,
        limit: int | None,
        options: SemaphoreOptions,
        backend: Callable[[Core], Backend],
    ) -> None:
        # Each public class takes ``**options`` and refuses unknown ones in its own name.
        check_cluster_support(check_client(client))
        name = check_name(name)
        limit = None if limit is None else check_limit(limit)
        timeout = check_timeout(options.get("timeout", DEFAULT_TIMEOUT))
        self._blocking_timeout = check_wait(options.get("blocking_timeout"))
        self._keys = SemaphoreKeys.for_name(check_prefix(options.get("prefix", DEFAULT_PREFIX)), name)
        clock = check_callable(options.get("clock"), "clock")
        waiter_ttl, refresh_interval = check_upkeep(
            options.get("waiter_timeout"), options.get("refresh_interval"), timeout
        )
        self._on_lost: LostCallback | None = check_callable(options.get("on_lost"), "on_lost")
        replicas = check_replicas(options.get("replicas", 0))
        label = check_label(options.get("label"))
        self._client = client
        self._settings = Settings(name, limit, timeout, waiter_ttl, refresh_interval, replicas, clock, label)
        self._core = Core(self, backend, client, self._keys, self._settings)
        #: This object's identity in Redis: its waiters' identifiers and its
        #: channel begin with it.
        self._process = self._core.process

    @property
    def name(self) -> str:
        """The semaphore's name."""
        return self._settings.name

    @property
    def limit(self) -> int | None:
        """How many permits may be held at once: the limit in force, as Redis last answered this object.

        Before the object's first step, the limit it was made with
        (``None``: it was made without one, to take the one in Redis). A
        limit set with `set_limit` -- by any process -- is in force for
        every object of the name, whatever it was made with.
        """
        return self._core.last.limit

    @property
    def timeout(self) -> float:
        """The lease, in seconds: a permit neither refreshed nor released within it is reclaimed."""
        return self._settings.timeout

    @property
    def blocking_timeout(self) -> float | None:
        """How long `acquire` and ``async with`` wait by default (``None``: for ever)."""
        return self._blocking_timeout

    @property
    def waiter_timeout(self) -> float:
        """How long a waiter whose process stopped answering keeps its place, in seconds."""
        return self._settings.waiter_ttl

    @property
    def refresh_interval(self) -> float:
        """How often held permits are refreshed, in seconds (default: a third of ``timeout``)."""
        return self._settings.refresh_interval

    @property
    def replicas(self) -> int:
        """How many replicas must acknowledge each acquire and refresh (0: none are waited for)."""
        return self._settings.replicas

    @property
    def key(self) -> str:
        """The Redis key the semaphore is stored under (its other keys extend it)."""
        return self._keys.base

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._settings.name!r}, limit={self.limit}, "
            f"timeout={self._settings.timeout:g}, blocking_timeout={self._blocking_timeout!r}, "
            f"waiter_timeout={self._settings.waiter_ttl:g}, refresh_interval={self._settings.refresh_interval:g}, "
            f"held={len(self._core.holdings)}, waiting={len(self._core.queue)}, key={self.key!r})"
        )

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
        weight: int = 1,
        auto_refresh: bool = False,
        on_lost: LostCallback | None = None,
    ) -> Permit | None:
        """Take a permit, waiting for one if ``blocking``.

        A waiter joins a queue in Redis shared by every process; permits go
        to the queue in arrival order, and a non-blocking call never takes
        one while anybody is queued (but for waiters heavier than the limit
        in force, which cannot be served: see ``weight``). When a permit frees, the step that frees
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

        A permit of ``weight`` k counts k against the limit -- a report query
        that needs the room of three lookups -- and is granted whole, in one
        step, once k fits in what the holders leave. Waiters are served in
        arrival order whatever they weigh: a heavy waiter at the head holds
        back lighter ones behind it until its weight is free, so it never
        starves (head-of-line blocking, as Go's ``semaphore.Weighted``).

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
            weight: What the permit counts for against the limit: an int
                from 1 (the default) to the limit in force.
            auto_refresh: Keep the permit alive until it is released.
            on_lost: With ``auto_refresh``: called (in the refresher's task,
                so it must not block) with the `PermitLost` if the permit is
                lost; defaults to the semaphore's ``on_lost``.

        Returns:
            The `Permit`, or ``None`` if none could be had in time.

        Raises:
            TypeError: ``blocking_timeout`` is not a number, ``weight`` not
                an int, or ``on_lost`` not callable.
            ValueError: ``blocking_timeout`` is negative or NaN, ``weight``
                is below 1, or ``on_lost`` is given without
                ``auto_refresh`` (nothing was sent); or ``weight`` is above
                the limit in force (Redis refused it at once: such a permit
                could never be granted).
            RuntimeError: The semaphore is in use by another event loop.
            LimitMismatch: The semaphore is in use -- somebody holds or
                waits -- with another limit, which no `set_limit` set;
                nothing was taken.
            LimitNotSet: The semaphore was made without a limit, and none
                is in force in Redis; nothing was taken.
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
        taken = await self._take(blocking, blocking_timeout, check_weight(weight))
        if taken is None:
            return None
        permit, confirmed_at, lease = taken
        if auto_refresh:
            self._core.holdings.keep(permit, confirmed_at, lease, scope=None, on_lost=on_lost or self._on_lost)
        return permit

    async def _take(
        self, blocking: bool, blocking_timeout: float | _Default | None, weight: int = 1
    ) -> tuple[Permit, float, float] | None:
        """Acquire a permit of ``weight``: the permit, when its lease was confirmed (loop time) and for how long."""
        wait = self._blocking_timeout if blocking_timeout is DEFAULT else check_wait(blocking_timeout)
        if not blocking:
            wait = 0.0
        loop = self._core.bind()
        started = time.monotonic()
        # In the background: a call's order and its timeout owe nothing to a one-time check.
        watch_eviction_policy(self._client, self._keys.base)
        identifier, value, (confirmed_at, lease) = await self._core.queue.wait(loop, wait, weight)
        # Neither granted nor queued below: nothing to give up.
        if value in (LIMIT_MISMATCH, TOO_HEAVY):
            # As the step's reply told it: a round trip each, a thousand refused callers would borrow a
            # thousand connections at once.
            limit = self._core.last.limit or self._settings.limit
            if value == TOO_HEAVY:
                raise ValueError(
                    f"weight must be at most the limit in force for semaphore {self._settings.name!r} ({limit}), "
                    f"got {weight}: a permit that heavy could never be granted"
                )
            assert self._settings.limit is not None  # noqa: S101 -- only a limit brought can mismatch
            raise LimitMismatch(name=self._settings.name, limit=self._settings.limit, stored_limit=limit or 0)
        if value == NO_LIMIT:
            raise LimitNotSet(name=self._settings.name)
        if value <= 0:
            emit("timed_out", "semaphore", self._settings.name, time.monotonic() - started)
            return None
        permit = Permit(self._settings.name, identifier, value, self._keys.base, time.monotonic())
        emit(
            "acquired",
            "semaphore",
            self._settings.name,
            permit.acquired_at - started,
            identifier=identifier,
            fencing_token=value,
            cost=weight,
        )
        return permit, confirmed_at, lease

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
        hold, answer = self._send_release(permit)
        released = await answer
        tell_release(permit, hold, released)
        return released == 1

    def _send_release(self, permit: Permit) -> tuple[Hold | None, Awaitable[int]]:
        """Stop keeping ``permit`` alive and send its release: its hold, if it had one, and what the release answers.

        The answer is 1 if the permit was held until then. It is a future
        that a cancellation of its awaiter cancels, and leaves out of its
        step if the step has not gone yet; for a relayed mutex, the relay's
        coroutine.
        """
        core = self._core
        # Before anything is dropped: another loop's call must leave this loop's hold alone.
        loop = core.bind()
        core.queue.forget_claim(permit.identifier)
        hold = core.holdings.get(permit.identifier)
        if hold is not None:
            core.holdings.drop(hold)
        if core.relay is not None and core.relay.holds(permit.identifier):
            return hold, core.relay.relay(permit.identifier)
        return hold, core.send(Step.RELEASE, permit.identifier, loop)

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
        (token,), _ = await self._core.submit(Step.REFRESH, (permit.identifier,))
        # A permit relayed to it is held, though Redis has not heard yet.
        relay = self._core.relay
        held = token > 0 or (relay is not None and relay.passing(permit.identifier))
        if token > 0:
            if relay is not None:
                relay.confirm(permit.identifier, sent)
            else:
                self._core.holdings.confirm(permit.identifier, sent, self._settings.timeout)
        elif not held:
            self._core.holdings.lose(permit.identifier, "a refresh found it gone")
        return held

    async def set_limit(self, limit: int | None) -> int | None:
        """Set the limit in force for this semaphore, in every process, at once; return the one stored before.

        The limit is stored with the semaphore in one atomic step, and is in
        force for every object of its name -- whatever limit each was made
        with, and without `LimitMismatch` -- until it is set again or
        cleared; it outlives the semaphore falling idle. Raising it hands
        the new permits to the longest waiters in the same step, in queue
        order, and wakes their processes. Lowering it takes no permit back:
        no permit is granted until fewer than the new limit are held.
        Setting the limit in force again changes nothing.

        ``None`` clears a set limit: it then counts as if the objects that
        hold or wait had brought it -- in force while anybody holds or
        waits, objects that bring another get `LimitMismatch` -- and once
        the semaphore is idle, the next acquire's limit applies. Clearing
        grants nothing.

        Args:
            limit: The new limit (at least 1), or ``None`` to clear it.

        Returns:
            The limit stored before -- set, or brought by the objects that
            hold or wait -- or ``None`` if there was none.

        Raises:
            TypeError: ``limit`` is not an int or ``None``.
            ValueError: ``limit`` is less than 1.
            RuntimeError: The semaphore is in use by another event loop.
            SemaphoreError: `AsyncLockedSemaphore` only: its lock stayed busy
                for a whole lease.
            OutOfMemory: Redis's memory is full, and it refused the step, which
                wrote nothing (see the faults page).
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            Not shielded: a cancelled call may or may not have reached Redis.
            Calling it again with the same limit is safe: setting a limit is
            idempotent.
        """
        value = "" if limit is None else str(check_limit(limit))
        (before,), _ = await self._core.submit(Step.LIMIT, (value,))
        logger.info(
            "the limit of semaphore %r is now %s (was %s)",
            self._settings.name,
            "cleared" if limit is None else limit,
            before or "none",
            extra=log_fields(self._settings.name),
        )
        return before or None

    async def aclose(self) -> None:
        """Give back every permit kept alive through this object, and stop its background work.

        Permits held by ``async with`` blocks still running, or taken with
        ``auto_refresh``, are released in one step (their bodies are not
        cancelled: their ``async with`` then raises `PermitLost`); waiting
        acquires fail with `SemaphoreError`, and have left the queue in
        Redis by the time `aclose` returns, so that the client may be closed
        straight after; the object's subscription ends, and so does the look
        at the server's eviction policy that the client's first call started
        in the background, if it is still under way (it is asked again on
        the client's next call). The object can be used again afterwards.

        Raises:
            redis.RedisError: Giving back the permits failed (they end with
                their leases).
            TimeoutError: Closing took longer than 5 s (it goes on in the
                background).

        Cancellation:
            Held off until closing is done, for up to 5 s: a cancelled
            `aclose` still closes, then raises the cancellation.
        """
        if self._core.loop is None or self._core.loop is not asyncio.get_running_loop():
            return
        await self._core.close()

    async def count(self) -> int:
        """Return how many permits are held now, in all processes, each counted at its weight.

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
        _, reply = await self._core.submit(Step.COUNT, ())
        return reply

    async def holders(self) -> dict[str, float]:
        """Return the live holders' identifiers, each with the seconds left of its lease.

        A read-only look: nothing is reaped or handed off. The looks of the
        object's tasks made while one is on its way share the next, one
        read in Redis; each caller gets a dict of its own.

        Raises:
            OutOfMemory: Redis's memory is full: it refuses even this
                look, which is one transaction.
            redis.RedisError: Redis failed or could not be reached.
        """
        return await self._core.holders()

    def statistics(self) -> SemaphoreStatistics:
        """Return a snapshot: counts as Redis last answered this object, and its local waiters."""
        return SemaphoreStatistics(
            name=self._settings.name,
            limit=self._core.last.limit,
            holders=self._core.last.holders,
            waiting=self._core.last.waiting,
            local_waiters=len(self._core.queue),
        )

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
        return await self._enter(1)

    async def _enter(self, weight: int) -> Permit:
        """``async with``'s entry, for a permit of ``weight`` (and `limiter`'s)."""
        taken = await self._take(blocking=True, blocking_timeout=DEFAULT, weight=weight)
        if taken is None:
            assert self._blocking_timeout is not None  # noqa: S101 -- only a bounded wait gives up
            raise AcquireTimeout(name=self._settings.name, blocking_timeout=self._blocking_timeout)
        permit, confirmed_at, lease = taken
        self._core.holdings.enter(permit, confirmed_at, lease, on_lost=self._on_lost)
        return permit

    def __call__(self, *, weight: int) -> AbstractAsyncContextManager[Permit]:
        """Hold a permit of ``weight`` for a block: ``async with sem(weight=3):``, as ``async with sem:`` one of 1.

        The permit counts ``weight`` against the limit; otherwise the block
        is exactly ``async with sem``: waited for up to
        ``blocking_timeout``, kept alive, cancelled if lost, given back
        shielded (see `acquire` for how weights are served).

        Raises:
            TypeError: ``weight`` is not an int (raised at once).
            ValueError: ``weight`` is below 1 (raised at once); on entering,
                it is above the limit in force.
        """
        return _Weighed(self, check_weight(weight))

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
        await self._core.holdings.exit(exc_type, exc, traceback)


class _Weighed:
    """The async context manager ``sem(weight=k)`` returns: ``async with sem`` for a permit of ``k``."""

    __slots__ = ("_semaphore", "_weight")

    def __init__(self, semaphore: _Semaphore, weight: int) -> None:
        self._semaphore = semaphore
        self._weight = weight

    def __repr__(self) -> str:
        return f"{self._semaphore!r}(weight={self._weight})"

    async def __aenter__(self) -> Permit:
        return await self._semaphore._enter(self._weight)  # noqa: SLF001 -- the semaphore's own entry

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._semaphore.__aexit__(exc_type, exc, traceback)
