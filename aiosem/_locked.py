"""`AsyncLockedSemaphore`: the book's lock-protected semaphore, without Lua."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import secrets
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel
import redis.exceptions

from ._background import Background
from ._connection import Client, Command, PinnedConnection, pinned_connection, publish_command, redirected
from ._coordination import Lane, Submission, resolve
from ._exceptions import in_place_of, out_of_memory
from ._keys import decode_limit
from ._observing import log_fields
from ._options import DEFAULT_LOCK_TIMEOUT, LockedSemaphoreOptions, refuse_unknown
from ._plan import Decision, ReadState, past_cutoff, plan_step
from ._protocol import Reply, Step
from ._rules import queue_ttl_ms
from ._semaphore import _Semaphore
from ._timing import Bound, overdue, step_bound
from ._validation import check_timeout
from ._waiting import WaiterStep

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from typing_extensions import Unpack

    from ._core import Core
    from ._waiting import Waiter


__all__ = ["AsyncLockedSemaphore"]

logger = logging.getLogger("aiosem")

#: The step lock lives at most this share of the shorter of the lease and the
#: waiter timeout: all a process that crashes, stalls or is cut off mid-step
#: can cost the others. Holders start refreshing at most a third of a lease
#: after their last refresh, waiters prove themselves alive every third of a
#: waiter timeout: held up by one stale lock, such a step still lands with
#: 5/12 of its lease (or waiter timeout) to spare, and by two in a row, 1/6.
_LOCK_SHARE: Final = 0.25
#: The shortest lock derived from that share, in ms: a step must end within
#: its lock (its two round trips, or three after waiting for it).
_SHORTEST_LOCK_MS: Final = 10
#: How long freeing the lock of an interrupted step may take at most: and
#: never longer than the lock lives, since by then it has freed itself.
_UNLOCK_TIMEOUT: Final = 2.0


class AsyncLockedSemaphore(_Semaphore):
    """A counting semaphore shared through Redis that needs no Lua at all.

    The same semaphore as `AsyncFairSemaphore` -- same interface, same data,
    same guarantees -- for servers where scripting is forbidden (an ACL with
    ``-@scripting``, some managed services, fakeredis without lupa). Each step
    is *Redis in Action*'s strictest design made safe: it takes a short lock
    (``lock:`` + the semaphore's key), reads the semaphore under ``WATCH``,
    and writes its changes and the lock's deletion in one ``MULTI``/``EXEC``.
    Should the lock expire mid-step and someone else take it, or anyone else
    write the semaphore, the ``EXEC`` aborts and the step is retried, so
    nothing is ever half-written or decided on stale data. A step costs two
    round trips; a busy lock is waited out with a jittered back-off, each
    try sending the lock's ``SET`` alone, and the reads once it is ours.

    It shares its keys, and therefore its permits, with an
    `AsyncFairSemaphore` of the same name and prefix, and its lock with
    book clients that call ``acquire_semaphore_with_lock`` on its key.

    Unlike the fair scripts, every step writes under a ``MULTI`` that Redis
    refuses whole when its memory is full: then `acquire`, `refresh`,
    `release` and the others raise `OutOfMemory` (a
    ``redis.exceptions.OutOfMemoryError``), having written nothing, and a
    permit kept alive is lost when its lease runs out.

    Its keyword options (`LockedSemaphoreOptions`, each described below)
    are those of `AsyncFairSemaphore` -- ``timeout`` (the lease),
    ``blocking_timeout``, ``prefix``, ``clock``, ``waiter_timeout``,
    ``refresh_interval``, ``on_lost``, ``replicas``, ``label`` -- and
    ``lock_timeout``, the longest the step lock may live.

    Args:
        client: A ``redis.asyncio.Redis`` client; the semaphore borrows one
            connection of its pool per step.
        name: The semaphore's name: any non-empty string.
        limit: How many permits may be held at once (at least 1), unless
            a limit set with `set_limit` is in force; ``None`` takes the
            limit in force in Redis (see `set_limit`).

    Raises:
        TypeError: An argument has the wrong type (the message names it).
        ValueError: An argument is out of range (the message names it).
    """

    __slots__ = ()

    def __init__(self, client: Client, name: str, limit: int | None, **options: Unpack[LockedSemaphoreOptions]) -> None:
        refuse_unknown(options, LockedSemaphoreOptions, "AsyncLockedSemaphore.__init__")
        lock_timeout = options.pop("lock_timeout", DEFAULT_LOCK_TIMEOUT)
        super().__init__(client, name, limit, options, lambda core: WatchedSteps(core, lock_timeout))

    async def aclose(self) -> None:
        """Give back every permit kept alive through this object, stop its background work, and free its lock.

        As `AsyncFairSemaphore.aclose`; then it waits for the unlocks of
        steps interrupted meanwhile (each bounded by the lock's lifetime,
        after which the lock has freed itself), so that a process that
        closes its semaphores before it exits leaves no step lock behind.

        Raises:
            redis.RedisError: Giving back the permits failed (they end with
                their leases).

        Cancellation:
            Shielded, and bounded to 5 s and then to the lock's lifetime
            (at most 2 s).
        """
        await super().aclose()


class WatchedSteps:
    """The steps of `AsyncLockedSemaphore`: a short lock, reads under ``WATCH``, one ``MULTI``/``EXEC`` (a `Backend`).

    What to write is decided by `plan_step` from what was read; this class
    takes and frees the lock, draws the waiters' tickets, reads, and commits.
    """

    __slots__ = (
        "_core",
        "_drawing",
        "_lock_ms",
        "_lock_seen_busy",
        "_on_the_way",
        "_ticket_lane",
        "_tickets",
        "_unlocking",
        "_withdrawal_lane",
    )

    #: Its plan relays a mutex granted to one of the caller's waiters through the run queued behind it,
    #: while no waiter that may have come before the run is on its way to the queue (``:arriving``).
    relays = True

    def __init__(self, core: Core, lock_timeout: float) -> None:
        self._core = core
        settings = core.settings
        share_ms = max(_SHORTEST_LOCK_MS, math.floor(min(settings.timeout, settings.waiter_ttl) * _LOCK_SHARE * 1000))
        self._lock_ms = min(max(1, math.ceil(check_timeout(lock_timeout, "lock_timeout") * 1000)), share_ms)
        #: The lanes -- a lane runs one step at a time -- whose last try found the lock busy.
        self._lock_seen_busy: set[Step] = set()
        #: Unlocks under way after interrupted steps, for `close` to wait for.
        self._unlocking = Background()
        #: The tickets of waiters not yet queued.
        self._tickets: dict[bytes, int] = {}
        #: The waiters that may be in ``:arriving``: their tickets drawn, or being drawn, and not queued yet.
        self._on_the_way: set[bytes] = set()
        #: The waiters whose tickets are being drawn: set once the draw has ended, or failed.
        self._drawing: dict[bytes, asyncio.Event] = {}
        # Its failures are raised as a step's are: a lost connection names the Redis it could not reach.
        self._ticket_lane: Lane[None] = Lane(self._draw_tickets, core.failure)
        # The acquires given up together leave :arriving together: one connection, not one each.
        self._withdrawal_lane: Lane[None] = Lane(self._take_out_of_arriving, core.failure)

    async def close(self) -> None:
        """Wait for the unlocks of steps interrupted meanwhile (each bounded by the lock's lifetime)."""
        loop = asyncio.get_running_loop()
        unlocking = [task for task in self._unlocking if task.get_loop() is loop]
        if unlocking:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(unlocking)

    def arrive(self, waiter: Waiter, then: Callable[[], None]) -> None:
        # A waiter's place is taken when it arrives, before it meets the lock:
        # however long the lock keeps it, nobody who came later gets ahead.
        # The tickets of a process's concurrent arrivals are drawn together,
        # in a lane of their own, whose task sends each waiter's first step
        # as soon as its ticket is read: its caller is woken once, by its
        # grant, not by its ticket too.
        self._on_the_way.add(waiter.identifier.encode())
        loop = asyncio.get_running_loop()
        # Bounded from the call, as a step is: a timer, as a queued waiter's deadline is.
        waiter.timer = loop.call_at(loop.time() + step_bound(self._core.settings.timeout), self._overdue, waiter)
        self._ticket_lane.enqueue(WaiterStep(waiter, functools.partial(self._drawn, waiter, then)), loop)

    def _overdue(self, waiter: Waiter) -> None:
        settings = self._core.settings
        waiter.fail(overdue(f"drawing a ticket of semaphore {settings.name!r}", step_bound(settings.timeout)))

    def _drawn(
        self, waiter: Waiter, then: Callable[[], None], outcome: tuple[Sequence[int], None] | BaseException
    ) -> None:
        """What a waiter's ticket draw answered, read in the ticket lane's task."""
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        if not waiter.pending:
            return  # given up, past its bound, or failed by `close`: `withdraw` takes it out of :arriving
        if isinstance(outcome, redis.exceptions.OutOfMemoryError):
            # As a step's refusal: redis-py's names the pipeline's command and key.
            outcome = in_place_of(out_of_memory(outcome, self._core.settings.name), outcome)
        if isinstance(outcome, BaseException):
            resolve(waiter.future, outcome)
            return
        (ticket,), _ = outcome
        self._tickets[waiter.identifier.encode()] = ticket
        then()

    async def _draw_tickets(
        self, identifiers: Sequence[str], waiting_since: float | None
    ) -> tuple[Sequence[int], None]:
        # Each waiter's timer bounds its wait, from its arrival; the draw's own
        # bound, the same, frees the lane of a connection that never answers.
        # A try whose reply was lost may have drawn tickets nobody holds: a
        # gap in the queue's order, never a tie.
        client, draw = self._core.client, self._ticket_draw(identifiers)

        async def attempt() -> list[Any]:
            async with pinned_connection(client, self._core.keys.tickets) as connection:
                return await connection.retried(lambda: connection.batch(*draw))

        with self._being_drawn([identifier.encode() for identifier in identifiers]):
            last = _last_ticket(
                await redirected(client, attempt, bound=self._lane_bound("drawing tickets", waiting_since))
            )
        return range(last - len(identifiers) + 1, last + 1), None

    def _lane_bound(self, what: str, waiting_since: float | None) -> Bound:
        """The bound of a batch of one of this class's lanes: a step's, from the call that waited longest."""
        settings = self._core.settings
        spent = 0.0 if waiting_since is None else asyncio.get_running_loop().time() - waiting_since
        return Bound(step_bound(settings.timeout), f"{what} of semaphore {settings.name!r}", spent=spent)

    @contextlib.contextmanager
    def _being_drawn(self, members: Sequence[bytes]) -> Iterator[None]:
        """Within the block, the tickets of ``members`` are being drawn: `withdraw` waits for the block's end."""
        drawn = asyncio.Event()
        self._drawing.update(dict.fromkeys(members, drawn))
        try:
            yield
        finally:
            drawn.set()
            for member in members:
                if self._drawing.get(member) is drawn:
                    del self._drawing[member]

    def _ticket_draw(self, identifiers: Sequence[str | bytes]) -> list[Command]:
        """Note ``identifiers`` arriving, then draw a ticket for each.

        Each identifier is added to ``:arriving`` with no deadline yet (the
        next step to see it gives it one) *before* the ``INCRBY`` of
        ``:tickets``, on one connection: whoever sees a ticket drawn sees
        its waiter on its way, and a run is relayed only while none is.
        Then the TTL a step writing a waiter gives both keys. Drawn outside
        the lock, so the TTLs can only be made longer (``NX``, then ``GT``),
        never shorter: a caller with a shorter waiter timeout must not let
        the tickets expire under another's waiters, or the next waiters
        would be queued ahead of them.
        """
        keys, queue_ms = self._core.keys, queue_ttl_ms(self._core.settings.waiter_ttl)
        return [
            ("ZADD", keys.arriving, *(item for identifier in identifiers for item in ("+inf", identifier))),
            ("INCRBY", keys.tickets, len(identifiers)),
            *(("PEXPIRE", key, queue_ms, when) for key in (keys.tickets, keys.arriving) for when in ("NX", "GT")),
        ]

    def forget(self, identifier: str) -> None:
        member = identifier.encode()
        self._tickets.pop(member, None)
        self._on_the_way.discard(member)

    async def withdraw(self, identifiers: Sequence[str]) -> None:
        # An acquire given up before a step queued it (cancelled while it
        # drew its ticket, say): left in :arriving, it would stop every run
        # until a step found it past its deadline. Bounded as a step: past
        # that, it is only that.
        arriving = [identifier for identifier in identifiers if identifier.encode() in self._on_the_way]
        if not arriving:
            return
        members = [identifier.encode() for identifier in arriving]
        with anyio.move_on_after(step_bound(self._core.settings.timeout)):
            # Behind the draws' own writes of them: from another connection, the ZREM could overtake them.
            for drawn in {self._drawing[member] for member in members if member in self._drawing}:
                await drawn.wait()
            try:
                await self._withdrawal_lane.submit(Submission(arriving), asyncio.get_running_loop())
            except Exception:
                logger.debug("could not take %r out of :arriving", members, exc_info=True)
            else:
                self._on_the_way.difference_update(members)

    async def _take_out_of_arriving(
        self, identifiers: Sequence[str], waiting_since: float | None
    ) -> tuple[Sequence[int], None]:
        keys = self._core.keys

        async def attempt() -> None:
            async with pinned_connection(self._core.client, keys.arriving) as connection:
                await connection.batch(("ZREM", keys.arriving, *identifiers))

        await redirected(self._core.client, attempt, bound=self._lane_bound("leaving :arriving", waiting_since))
        return (0,) * len(identifiers), None

    async def execute(self, step: Step, identifiers: Sequence[str], call: str) -> Reply | None:
        # A step whose bound has passed -- its loop woke from a long block,
        # say -- would take the lock and be cancelled holding it, before
        # its first reply: let the cancellation land before anything is sent.
        while anyio.current_effective_deadline() <= anyio.current_time():
            await anyio.lowlevel.checkpoint()
        members = [identifier.encode() for identifier in identifiers]
        # A waiter's place in the queue is its ticket, drawn outside the lock
        # when it arrived (or here, for one queued again) and kept through
        # retries: waiting out a busy lock never costs it its place.
        unticketed = [m for m in members if m not in self._tickets] if step is Step.WAIT else []
        self._on_the_way.update(unticketed)
        with self._being_drawn(unticketed):
            return await self._execute(step, members, call, unticketed)

    async def _execute(self, step: Step, members: list[bytes], call: str, unticketed: list[bytes]) -> Reply | None:
        """`execute`, once the waiters that need one are known: ``unticketed`` are drawn their tickets."""
        owner = secrets.token_hex(16)
        now = self._core.now()
        window = self._window(step, members)
        reads = self._reads(step, members, call, window=window, server_time=now is None)
        # Once the batch may have been sent, and until a reply says otherwise,
        # the lock may be ours: a compare-and-delete with our own owner value
        # is safe even if the SET never happened.
        locked = False
        committed: Any = None
        try:
            async with pinned_connection(self._core.client, self._core.keys.lock) as connection:
                locked = True
                replies = await self._lock_and_read(connection, owner, step, unticketed, reads)
                if replies is None:
                    locked = False
                    return None
                now = _parse_time(replies[21]) if now is None else now
                state = self._read_state(connection, replies, now, members, call, step=step, window=window)
                if step is Step.WAIT and self._lost_places(state, members):
                    # Their tickets are drawn again on the step's next try: nothing is written but the lock's end.
                    replies = await connection.batch(("MULTI",), ("DEL", self._core.keys.lock), ("EXEC",))
                    locked = replies[-1] is None
                else:
                    if past := past_cutoff(state.leases, now, state.lease):
                        # Only when a permit is past this object's lease: its own may be longer.
                        state = dataclasses.replace(state, records=await self._records(connection, past))
                    decision = plan_step(state, step, members)
                    committed, reply = await self._commit(connection, decision, step)
                    locked = committed is None
                    if not locked:
                        for member in members:
                            self._tickets.pop(member, None)
                        if step is Step.WAIT:
                            # Queued, granted or refused: its entry went in this step. (A cancel's may
                            # still be on its way in the waiter's first step: `withdraw` waits for it.)
                            self._on_the_way.difference_update(members)
        except BaseException as error:
            if locked:
                await self._free_lock(owner, error)
            raise
        if locked:
            await self._free_lock(owner)
        return None if committed is None else reply

    def _reads(
        self, step: Step, members: Sequence[bytes], call: str, *, window: int, server_time: bool
    ) -> list[Command]:
        """What a step reads under WATCH, the WATCH first: `_read_state` makes a `ReadState` of their replies."""
        keys = self._core.keys
        reads: list[Command] = [
            # Not the tickets: others take theirs outside the lock.
            ("WATCH", keys.lock, *keys.fair[:6], keys.limit, keys.holders, keys.weight),
            ("ZRANGE", keys.timeout_set, 0, -1, "WITHSCORES"),
            ("ZRANGE", keys.owner_set, 0, -1, "WITHSCORES"),
            ("GET", keys.counter),
            ("ZRANGE", keys.queue, 0, window - 1, "WITHSCORES"),
            ("ZCARD", keys.queue),
            ("ZRANGE", keys.waiters, 0, window - 1, "WITHSCORES"),
        ]
        reads.extend(
            ("ZMSCORE", key, *members) if members else ("PING",) for key in (keys.queue, keys.waiters, keys.cancelled)
        )
        reads.append(("GET", keys.limit))
        # The TTLs the steps keep: none on the permits' keys, the queue's a waiter timeout.
        reads.extend(("PTTL", key) for key in (keys.timeout_set, keys.owner_set, keys.limit))
        reads.extend(("PTTL", key) for key in (keys.queue, keys.waiters, keys.tickets))
        # What an earlier try of this call released, if its reply was lost:
        # only this call writes its receipt.
        reads.append(("GET", keys.receipt(call)) if call else ("PING",))
        reads.append(("GET", keys.weight))
        reads.append(("ZRANGE", keys.arriving, 0, window - 1, "WITHSCORES"))
        if server_time:
            reads.append(("TIME",))
        if _may_be_arriving(step, members):
            reads.append(("ZMSCORE", keys.arriving, *members))
        return reads

    def _window(self, step: Step, members: Sequence[bytes]) -> int:
        """How far a step reads the queue and ``:arriving``.

        Only as far as a step can reach: the queue's head, as far as the
        limit in force as last heard (or as set by this step), its earliest
        presumed deaths, and the step's own identifiers.
        """
        limits = [self._core.settings.limit or 0, self._core.last.limit or 0]
        if step is Step.LIMIT:
            limits += [int(member) for member in members if member]
        return max(limits) + len(members) + _QUEUE_WINDOW

    def _lost_places(self, state: ReadState, members: Sequence[bytes]) -> bool:
        """Drop the tickets of ``members`` no longer arriving in Redis, and answer whether there were any.

        A waiter about to be queued with its ticket must still be arriving:
        past its deadline, anyone may have relayed a run as if it were gone,
        and the ticket could put it ahead of that run. It takes a new one.
        """
        lost = [
            member
            for member in members
            if member in self._tickets
            and member not in state.queued
            and member not in state.owners
            and state.own_arrivals.get(member, -math.inf) <= state.now
        ]
        for member in lost:
            del self._tickets[member]
        return bool(lost)

    def _read_state(
        self,
        connection: PinnedConnection,
        replies: list[Any],
        now: float,
        members: Sequence[bytes],
        call: str,
        *,
        step: Step,
        window: int,
    ) -> ReadState:
        """What `_reads` found, as `plan_step` takes it: ``replies`` are theirs, the lock's ``SET`` first."""

        def scores(reply: Any) -> dict[bytes, float]:
            pairs = zip(members, reply if members else (), strict=True)
            return {member: float(score) for member, score in pairs if score is not None}

        keys = self._core.keys
        stored_limit, limit_set = decode_limit(replies[11])
        arrivals = _parse_zset(connection, replies[20])
        return ReadState(
            keys,
            now=now,
            lease=self._core.settings.timeout,
            limit=self._core.settings.limit,
            waiter_ttl=self._core.settings.waiter_ttl,
            caller=self._core.process,
            publish=publish_command(self._core.client),
            leases=_parse_zset(connection, replies[2]),
            owners=_parse_zset(connection, replies[3]),
            counter=int(replies[4] or 0),
            queue_head=_parse_zset(connection, replies[5]),
            queue_size=int(replies[6]),
            earliest_deaths=_parse_zset(connection, replies[7]),
            queued=scores(replies[8]),
            alive_until=scores(replies[9]),
            cancelled=scores(replies[10]),
            stored_limit=stored_limit,
            limit_set=limit_set,
            permit_ttls=(int(replies[12]), int(replies[13]), int(replies[14])),
            queue_ttls=(int(replies[15]), int(replies[16]), int(replies[17])),
            # A copy: the plan reads what the object's waiters were given.
            tickets=dict(self._tickets),
            receipt=keys.receipt(call) if call else None,
            receipt_seconds=step_bound(self._core.settings.timeout),
            earlier_receipt=connection.encode(replies[18]) if call and replies[18] is not None else b"",
            record=self._core.settings.record(),
            extra_weight=int(replies[19] or 0),
            # As the fair class: with replicas to wait for, every grant waits for them instead.
            relays=not self._core.settings.replicas,
            arrivals=arrivals,
            arrivals_whole=len(arrivals) < window,
            own_arrivals=scores(replies[-1]) if _may_be_arriving(step, members) else {},
        )

    async def _records(self, connection: PinnedConnection, members: Sequence[bytes]) -> dict[bytes, bytes]:
        """The records of ``members`` in ``:holders``, read under the same WATCH."""
        (found,) = await connection.batch(("HMGET", self._core.keys.holders, *members))
        return {member: connection.encode(record) for member, record in zip(members, found, strict=True) if record}

    async def _lock_and_read(
        self,
        connection: PinnedConnection,
        owner: str,
        lane: Step,
        unticketed: Sequence[bytes],
        reads: Sequence[Command],
    ) -> list[Any] | None:
        """Take the lock as ``owner`` and run ``reads``: the SET's reply and theirs, or ``None`` if the lock is busy.

        Tickets are drawn for the ``unticketed`` waiters first, lock or no lock.
        """
        keys = self._core.keys
        take: Command = ("SET", keys.lock, owner, "NX", "PX", self._lock_ms)
        tickets: list[Command] = []
        if unticketed:
            tickets += self._ticket_draw(unticketed)
        waiting = lane in self._lock_seen_busy
        if waiting:
            # Waiting for a busy lock: each try of the step takes the lock and
            # nothing else, and the reads follow once the lock is ours.
            replies = await connection.batch(*tickets, take)
            if replies[-1] is not None:
                replies += await connection.batch(*reads)
        else:
            # The lock in the reads' round trip: the SET before the WATCH, so
            # that our own lock does not dirty it.
            replies = await connection.batch(*tickets, take, *reads)
        if unticketed:
            last = _last_ticket(replies[: len(tickets)])
            for offset, member in enumerate(unticketed, start=last - len(unticketed) + 1):
                self._tickets[member] = offset
        replies = replies[len(tickets) :]
        if replies[0] is None:
            self._lock_seen_busy.add(lane)
            if not waiting:
                await connection.batch(("UNWATCH",))
            return None
        # Ours: the lane's next step starts optimistic again. (A lane runs one
        # step at a time, so what its last try saw was this step's.)
        self._lock_seen_busy.discard(lane)
        return replies

    async def _commit(self, connection: PinnedConnection, decision: Decision, step: Step) -> tuple[Any, Reply]:
        """Write what was decided and free the lock, in one transaction: EXEC's reply, and the step's."""
        reply = decision.reply
        commit: list[Command] = [("MULTI",), *decision.writes, ("DEL", self._core.keys.lock), ("EXEC",)]
        replicas = self._core.replicas_for(step)
        if replicas:
            # On the connection that wrote: WAIT counts its writes.
            commit.append(("WAIT", replicas, max(1, math.ceil(self._core.settings.waiter_ttl * 1000))))
        replies = await connection.batch(*commit)
        if not replicas:
            return replies[-1], reply
        committed = replies[-2]
        return committed, reply if committed is None else dataclasses.replace(reply, replicated=int(replies[-1]))

    async def _free_lock(self, owner: str, error: BaseException | None = None) -> None:
        """Free the lock a step may still hold: before returning, or in the background after ``error``.

        The unlock is a task of its own, which `aclose` waits for.
        """
        unlocking = self._unlocking.start(self._unlock(owner), name="aiosem unlock")
        if error is not None and (
            isinstance(error, Exception) or anyio.current_effective_deadline() <= anyio.current_time()
        ):
            # A step failing because Redis is out of reach, or running out of
            # its time, must end now, not after the unlock gives up too.
            return
        # Otherwise -- an aborted EXEC, or a cancellation -- freed before the
        # step ends or the cancellation propagates, so that a cancelled
        # caller leaves nothing behind.
        with anyio.CancelScope(shield=True):
            await asyncio.wait([unlocking])

    async def _unlock(self, owner: str) -> None:
        # After an aborted EXEC, or an error or cancellation mid-step, the lock
        # may still be ours. An EXEC of ours still in flight watches the lock,
        # so deleting it first only makes that EXEC abort: safe either way.
        # Past the lock's own lifetime there is nothing left to free.
        bound = min(_UNLOCK_TIMEOUT, self._lock_ms / 1000)
        with anyio.move_on_after(bound) as scope:
            try:
                async with pinned_connection(self._core.client, self._core.keys.lock) as connection:
                    value = (await connection.batch(("WATCH", self._core.keys.lock), ("GET", self._core.keys.lock)))[1]
                    if value is not None and connection.encode(value) == owner.encode():
                        await connection.batch(("MULTI",), ("DEL", self._core.keys.lock), ("EXEC",))
                    else:
                        await connection.batch(("UNWATCH",))
            except Exception:
                logger.warning(
                    "could not free the step lock of %r; it expires by itself within %g s",
                    self._core.semaphore,
                    self._lock_ms / 1000,
                    exc_info=True,
                    extra=log_fields(self._core.settings.name),
                )
        if scope.cancelled_caught:
            logger.warning(
                "could not free the step lock of %r within %g s; it expires by itself",
                self._core.semaphore,
                bound,
                extra=log_fields(self._core.settings.name),
            )


#: How far past what it needs a Lua-free step reads the queue, to see past
#: waiters presumed dead.
_QUEUE_WINDOW: Final = 64


def _parse_zset(connection: PinnedConnection, reply: list[Any]) -> dict[bytes, float]:
    # RESP2 answers ZRANGE WITHSCORES flat, [member, score, ...]; RESP3 in pairs.
    if reply and isinstance(reply[0], list):
        return {connection.encode(member): float(score) for member, score in reply}
    return {connection.encode(reply[i]): float(reply[i + 1]) for i in range(0, len(reply), 2)}


def _may_be_arriving(step: Step, members: Sequence[bytes]) -> bool:
    """Whether a step's identifiers may be in ``:arriving``: only an acquire's first step, or its cancel, names one."""
    return bool(members) and step in {Step.WAIT, Step.CANCEL}


def _last_ticket(replies: list[Any]) -> int:
    """The last ticket a `WatchedSteps._ticket_draw` drew, from its replies: the INCRBY's."""
    return int(replies[1])


def _parse_time(reply: list[Any]) -> float:
    return int(reply[0]) + int(reply[1]) / 1_000_000
