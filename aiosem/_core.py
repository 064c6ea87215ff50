"""What the parts of one semaphore object share: who it is, how it takes steps, and its parts.

A semaphore object is a front (`_Semaphore`: the public calls) over a few
parts that each own one concern -- the `WaitQueue` its waiters, the
`Holdings` the permits it keeps alive, the `Relay` the
mutexes it relays -- and one backend that carries out each step atomically
in Redis (Lua scripts, or watched transactions). The `Core` is what they
share: the object's identity in Redis, and `Core.submit`, through which
every step of every part goes.

Per semaphore object, concurrent steps of one kind are coalesced into one
call at a time (`Lane`), and every reply is read by the wait queue, which
learns from it what was granted to its waiters.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Final, Protocol

import redis

from ._connection import Client, address, let_go_of, redirected, scored, text, transaction
from ._coordination import Lane, LaneOfLoop, Submission, resolve, to_the_end
from ._exceptions import NotReplicated, SemaphoreError, out_of_memory, step_failure
from ._holding import Holdings
from ._keys import encode_record
from ._observing import emit_permit
from ._protocol import REFUSED, Reply, Step
from ._relay import Relay
from ._timing import Backoff, Bound, Deadline, step_bound
from ._validation import check_now
from ._waiting import WaitQueue

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._holding import Hold
    from ._keys import SemaphoreKeys
    from ._semaphore import _Semaphore
    from ._waiting import Waiter

#: The longest pause between tries of a step that has to happen.
_MUST_STEP_PAUSE: Final = 0.005
#: The first pause before a release whose connection failed is tried again (it doubles).
_RETRY_PAUSE: Final = 0.05
#: How often a release whose connection failed is tried again: enough for a
#: connection closed under it, not to wait out a server that is down.
_RELEASE_RETRIES: Final = 3


class Backend(Protocol):
    """How one kind of semaphore carries out its steps in Redis: the only part that differs between kinds.

    `AsyncFairSemaphore`'s is `ScriptedSteps` (one Lua script per step),
    `AsyncLockedSemaphore`'s `WatchedSteps` (a lock, reads under ``WATCH``,
    one ``MULTI``/``EXEC``).
    """

    #: Whether its steps relay a mutex through runs of the caller's waiters (see `Relay`).
    relays: bool

    async def execute(self, step: Step, identifiers: Sequence[str], call: str) -> Reply | None:
        """Carry out one step atomically; ``None`` if it could not run now (a busy lock) and should be tried again.

        A step that leaves receipts (`Step.leaves_receipts`) does so under
        the ``call`` id, so that the same call tried again answers the same.
        """

    def arrive(self, waiter: Waiter, then: Callable[[], None]) -> None:
        """Note a blocking acquire's arrival, then call ``then`` to send its first step.

        ``then`` is called at once, or later in a task of the backend's --
        unless the waiter's caller has stopped waiting by then. Arriving
        may fail the waiter's future instead: with the error its call to
        Redis raised, or `redis.TimeoutError` past a step's bound.
        """

    async def withdraw(self, identifiers: Sequence[str]) -> None:
        """Take back what arriving wrote of acquires given up before a step queued them."""

    def forget(self, identifier: str) -> None:
        """Drop what the backend keeps about an identifier whose acquire ended."""

    async def close(self) -> None:
        """Wait for what the backend still does in the background (the object is closing)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """A semaphore object's settings, checked by its constructor: what its parts read at every step."""

    name: str
    #: The limit the object brings; ``None``: it takes the one in force in Redis.
    limit: int | None
    #: The lease, in seconds.
    timeout: float
    waiter_ttl: float
    refresh_interval: float
    replicas: int
    clock: Callable[[], float] | None
    label: str | None = None

    def record(self) -> str:
        """Who this object's identifiers are, as the steps record them (see `aiosem._keys.encode_record`).

        Read at every step, so that a forked child records its own process id.
        """
        return _record(self.timeout, self.label, os.getpid())


#: This machine's name, as the records of its holders and waiters give it.
_HOST: Final = socket.gethostname()


@lru_cache(maxsize=256)
def _record(lease: float, label: str | None, pid: int) -> str:
    return encode_record(lease, pid, _HOST, label)


class _One(Submission[Reply]):
    """A call for one identifier whose caller awaits its value alone (see `Core.send`)."""

    __slots__ = ()

    def __init__(self, identifier: str, value: asyncio.Future[int]) -> None:
        super().__init__((identifier,))
        self.answer = value

    def settle(self, outcome: tuple[Sequence[int], Reply] | BaseException) -> None:
        assert self.answer is not None  # noqa: S101 -- set by the constructor
        resolve(self.answer, outcome if isinstance(outcome, BaseException) else outcome[0][0])


class Core:
    """The identity, the steps and the parts of one semaphore object (see the module's docstring)."""

    __slots__ = (
        "_labels",
        "_lanes",
        "_looks",
        "_step_bound",
        "backend",
        "client",
        "holdings",
        "keys",
        "last",
        "loop",
        "process",
        "queue",
        "relay",
        "semaphore",
        "settings",
    )

    def __init__(
        self,
        semaphore: _Semaphore,
        backend: Callable[[Core], Backend],
        client: Client,
        keys: SemaphoreKeys,
        settings: Settings,
    ) -> None:
        self.semaphore = semaphore
        self.client = client
        self.keys = keys
        self.settings = settings
        #: How long one step may take before it is presumed stalled, and what
        #: each kind of step is called in the error that says so.
        self._step_bound = step_bound(settings.timeout)
        self._labels = {step: f"a {step.operation.value} step of semaphore {settings.name!r}" for step in Step}
        #: This object's identity in Redis: its waiters' identifiers and its
        #: channel begin with it.
        self.process = secrets.token_hex(8)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lanes: dict[Step, Lane[Reply]] = {}
        #: The lane of `holders`' looks: any loop may look.
        self._looks: LaneOfLoop[dict[str, float]] = LaneOfLoop(self._look, self.failure)
        #: What the last step answered: the counts `statistics` shows.
        self.last = Reply(0, 0, settings.limit, None, ())
        self.backend = backend(self)
        self.queue = WaitQueue(self)
        self.holdings = Holdings(self)
        self.relay = Relay(self) if self.backend.relays else None

    def bind(self) -> asyncio.AbstractEventLoop:
        """Tie the object to the running event loop, and return it; a new loop (the old one closed) starts it afresh.

        Each call of the object's binds it once, and hands the loop on to
        what it does: on CPython 3.11, `asyncio.get_running_loop` makes a
        system call (``getpid``), some 0.2 µs, which a cycle at limit 16
        paid about ten times.

        Raises:
            RuntimeError: The object is in use by another event loop.
        """
        loop = asyncio.get_running_loop()
        if self.loop is loop:
            return loop
        if self.loop is not None and not self.loop.is_closed():
            raise RuntimeError(
                f"{self.semaphore!r} is in use by another event loop; create one semaphore object per loop"
            )
        self.loop = loop
        self._lanes.clear()
        self.queue.reset()
        self.holdings.reset()
        if self.relay is not None:
            self.relay.reset()
        return loop

    def now(self) -> float | None:
        """The time steps are to use: the semaphore's clock's, or ``None`` for the server's."""
        clock = self.settings.clock
        return None if clock is None else check_now(clock(), "clock()")

    def replicas_for(self, step: Step) -> int:
        """How many replicas a step must reach: acquires and refreshes wait for them, releases and counts do not."""
        return self.settings.replicas if step.waits_for_replicas else 0

    async def submit(self, step: Step, identifiers: Sequence[str] | Submission[Reply]) -> tuple[Sequence[int], Reply]:
        """Carry out ``step`` for ``identifiers``, with its other callers of the moment: results, and reply.

        Raises:
            redis.RedisError: The step failed, as `failure` says.
        """
        loop = self.bind()
        submission = identifiers if isinstance(identifiers, Submission) else Submission(identifiers)
        return await self._lane(step).submit(submission, loop)

    def send(self, step: Step, identifier: str, loop: asyncio.AbstractEventLoop) -> asyncio.Future[int]:
        """Have ``step`` carried out for one identifier, and return the future of its value.

        For a call that bound the object already: ``loop`` is the one `bind` returned.

        Awaited, it raises as `submit` does. Cancelled -- as its awaiter's
        cancellation cancels it -- before its step is sent, it leaves the
        identifier out of the step (`to_the_end` waits for it through any
        cancellation instead).
        """
        value: asyncio.Future[int] = loop.create_future()
        self._lane(step).enqueue(_One(identifier, value), loop)
        return value

    def enqueue(self, step: Step, submission: Submission[Reply], loop: asyncio.AbstractEventLoop) -> None:
        """Have ``step`` carried out for ``submission``, which hears the outcome itself (see `Submission.settle`).

        For a call that bound the object already: ``loop`` is the one `bind` returned.
        """
        self._lane(step).enqueue(submission, loop)

    def failure(self, error: BaseException) -> BaseException:
        """What the caller of a step raises for the step's ``error``: see `step_failure`."""
        return step_failure(error, self.settings.name, address(self.client))

    def _lane(self, step: Step) -> Lane[Reply]:
        lane = self._lanes.get(step)
        if lane is None:
            lane = self._lanes[step] = Lane(
                lambda ids, since: self._step(step, ids, since),
                self.failure,
                behind=self._freeing_about_to_go if step.takes else None,
                hold=self.queue.wakes_here if step.frees else None,
            )
        return lane

    def _freeing_about_to_go(self) -> bool:
        """Whether steps that free permits are about to go: the steps that take them go behind.

        A permit given back in the same loop turn as an acquire is asked for
        is then free when the acquire reaches Redis: as with
        `asyncio.Semaphore`, it can be granted at once rather than queued
        behind its own release. Where the object's coroutines release and
        acquire again in turn, the releases' reply -- which carries the
        grants -- comes back a script sooner, and the process works on it
        while Redis runs the acquires (see "What was tried" on the benchmarks
        page).
        """
        return any(lane.about_to_go for step, lane in self._lanes.items() if step.frees)

    async def _step(
        self, step: Step, identifiers: Sequence[str], waiting_since: float | None = None
    ) -> tuple[Sequence[int], Reply]:
        """Carry out a step; a call that waited in its lane since ``waiting_since`` has that much less of its bound."""
        settings = self.settings
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
                reply = Reply(
                    self.last.holders, self.last.waiting, self.last.limit, None, (REFUSED,) * len(identifiers)
                )
                break
            # A step that has to happen may wait out a busy lock for as long
            # as a lease: by then the answer is moot.
            deadline = deadline or Deadline(settings.timeout)
            if deadline.passed():
                raise SemaphoreError(
                    f"semaphore {settings.name!r} stayed busy for {settings.timeout:g} s;"
                    f" {step.operation.value} not done",
                    name=settings.name,
                )
            await backoff.pause(deadline)
        self.last = reply
        self.queue.observe(reply, sent)
        return reply.values, reply

    async def _bounded_execute(
        self, step: Step, identifiers: Sequence[str], call: str, spent: float = 0.0
    ) -> Reply | None:
        """`Backend.execute`, bounded so that a stalled connection cannot hang a step.

        On a cluster, a step turned away because the semaphore's slot moved
        or is moving did nothing, and is tried again on the slot's owner
        within the same bound. A release with a call id whose connection
        failed is tried again too, a few times: its receipts tell what a try
        whose reply was lost did.
        """
        name = self.settings.name
        attempt = partial(self.backend.execute if not call else self._execute_release, step, identifiers, call)
        try:
            reply = await redirected(
                self.client, attempt, bound=Bound(self._step_bound, self._labels[step], spent=spent)
            )
        except redis.exceptions.OutOfMemoryError as error:
            raise out_of_memory(error, name) from None  # one short traceback that names the semaphore
        replicas = self.settings.replicas
        if reply is not None and reply.replicated is not None and reply.replicated < replicas:
            raise NotReplicated(name=name, replicas=replicas, acknowledged=reply.replicated)
        return reply

    async def _execute_release(self, step: Step, identifiers: Sequence[str], call: str) -> Reply | None:
        """`Backend.execute` for a release with a call id, tried again a few times if its connection fails."""
        backoff: Backoff | None = None  # made at the first failure: most steps never meet one
        while True:
            try:
                return await self.backend.execute(step, identifiers, call)
            except redis.ConnectionError:  # noqa: PERF203 -- free until raised; the loop is for trying again
                backoff = backoff or Backoff(_RETRY_PAUSE * 2, first=_RETRY_PAUSE)
                if backoff.failures >= _RELEASE_RETRIES:
                    raise
                await backoff.pause()

    async def holders(self) -> dict[str, float]:
        """The live holders' identifiers, each with the seconds left of its lease: see `_Semaphore.holders`.

        The looks of the object's tasks made while one is on its way share
        the next: one connection, whatever their number.
        """
        loop = asyncio.get_running_loop()
        _, holders = await self._looks.of(loop).submit(Submission(()), loop)
        return dict(holders)

    async def _look(
        self, _identifiers: Sequence[str], _waiting_since: float | None
    ) -> tuple[Sequence[int], dict[str, float]]:
        """One look at the holders, for every look made meanwhile (a look names no identifier)."""
        keys = self.keys
        try:
            leases, owners, time = await transaction(
                self.client,
                keys.base,
                ("ZRANGE", keys.timeout_set, 0, -1, "WITHSCORES"),
                ("ZRANGE", keys.owner_set, 0, -1),
                ("TIME",),
            )
        except redis.exceptions.OutOfMemoryError as error:
            raise out_of_memory(error, self.settings.name) from None
        now = self.now()
        if now is None:
            now = int(time[0]) + int(time[1]) / 1_000_000
        owned = {text(owner) for owner in owners}
        lease = self.settings.timeout
        return (), {
            member: remaining
            for member, score in scored(leases)
            if member in owned and (remaining := score + lease - now) > 0
        }

    async def close(self) -> None:
        """Close the object's parts: what `_Semaphore.aclose` does, once the object is known to be in use here."""
        try:
            await self._close_parts()
        finally:
            await self.backend.close()
            # A client closed right after must find no connection of aiosem's out of its pool.
            await let_go_of(self.client)

    async def _close_parts(self) -> None:
        holds = self.holdings.close()
        # Before the first await: the waiters failed here, ending, must find
        # the channel let go of already, and schedule nothing.
        subscribed = self.queue.channel.in_use
        name = self.settings.name
        background = self.queue.close(SemaphoreError(f"semaphore {name!r} was closed", name=name))
        if self.relay is not None:
            self.relay.close()  # its runs' waiters failed above
        await to_the_end(
            self._finish_closing(holds, background, subscribed=subscribed), name=f"closing {self.semaphore!r}"
        )

    async def _finish_closing(
        self, holds: list[Hold], background: list[asyncio.Task[None]], *, subscribed: bool
    ) -> None:
        """The part of `close` that waits: background work ended, the channel unsubscribed, ``holds`` released."""
        await asyncio.gather(*background, return_exceptions=True)
        # Before `close` returns: a client closed right after it must not cut
        # off the failed acquires' way out of the queue.
        await self.queue.until_all_gone()
        if subscribed:
            await self.queue.channel.unsubscribe()
        if not holds:
            return
        # A relayed permit goes by the same lane as the passes that gave it.
        relayed = set() if self.relay is None else set(self.relay.take([hold.permit.identifier for hold in holds]))
        plain = [hold for hold in holds if hold.permit.identifier not in relayed]
        passed = [hold for hold in holds if hold.permit.identifier in relayed]
        outcomes: list[tuple[Hold, int]] = []
        if plain:
            values, _ = await self.submit(Step.RELEASE, [hold.permit.identifier for hold in plain])
            outcomes += zip(plain, values, strict=True)
        if passed:
            passes = [part for hold in passed for part in (hold.permit.identifier, "", "")]
            values, _ = await self.submit(Step.PASS, passes)
            outcomes += zip(passed, values[::3], strict=True)
        for hold, value in outcomes:
            emit_permit("released" if value == 1 else "lost", hold.permit)
