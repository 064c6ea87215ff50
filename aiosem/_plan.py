"""The Lua-free step's decision, as a pure function of what it read.

`AsyncLockedSemaphore` reads a semaphore under ``WATCH`` and writes its
changes in one ``MULTI``; between the two, `plan_step` decides those
writes and the step's `Reply`. It follows the fair scripts in
``aiosem/lua`` decision for decision -- same reaping, hand-off, grants,
queueing, tombstones, receipts and TTLs, with the constants of
``_rules.py`` -- so both classes behave identically on the same data;
``tests/contract/test_differential.py`` runs the two side by side to hold it to
that. It does no I/O and changes nothing it is given.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from ._keys import weight_of
from ._protocol import LIMIT_MISMATCH, NO_LIMIT, QUEUED, REFUSED, TOMBSTONED, TOO_HEAVY, Operation, Reply, Step
from ._rules import (
    COUNTER_TTL_MS,
    EXPIRE_SLACK_MS,
    RUN_LENGTH,
    SKIPLIST_AT,
    SKIPLIST_MOVER,
    TOMBSTONE_SECONDS,
    TOMBSTONE_TTL_MS,
    queue_ttl_ms,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ._connection import Command
    from ._keys import SemaphoreKeys

__all__ = ["Decision", "ReadState", "own_lease", "past_cutoff", "plan_step"]


@dataclass(frozen=True, slots=True)
class ReadState:
    """What one locked step read under ``WATCH``, and the step's own parameters.

    Of the queue it knows the head, its size, the earliest presumed deaths
    and the step's own identifiers: all a step can act on. Sorted sets are
    mappings of member to score; TTLs are ``PTTL`` replies (-1: none, -2: no
    such key).

    Attributes:
        keys: The semaphore's keys.
        now: The time to decide at, in seconds.
        lease: The lease, in seconds.
        limit: The caller's limit (``None``: it takes the stored one).
        waiter_ttl: The caller's waiter timeout, in seconds.
        caller: The caller's process token: its waiters are granted a whole
            lease and need no message.
        publish: How a grant wakes another process: PUBLISH, or SPUBLISH on a cluster.
        leases: The timeout set.
        owners: The owner set.
        counter: The fencing counter (0: none).
        queue_head: The first entries of ``:queue``.
        queue_size: How many entries ``:queue`` has.
        earliest_deaths: The first entries of ``:waiters``.
        queued: The step's identifiers' scores in ``:queue``.
        alive_until: The step's identifiers' scores in ``:waiters``.
        cancelled: The step's identifiers' scores in ``:cancelled``.
        stored_limit: The limit ``:limit`` holds, if any.
        limit_set: Whether that limit was set by a `Step.LIMIT` (``=n``),
            rather than brought by a caller.
        permit_ttls: The TTLs of the timeout set, the owner set and ``:limit``.
        queue_ttls: The TTLs of ``:queue``, ``:waiters`` and ``:tickets``.
        tickets: The tickets of the caller's waiters not queued yet, the
            step's own among them: each is queued by its ticket.
        receipt: A release call's receipt key (``None``: a call without an id).
        receipt_seconds: How long that receipt is kept.
        earlier_receipt: What an earlier try of the same call left in it.
        record: The caller's record, stored for each identifier the step
            queues or grants a permit to straight away ('': none).
        records: The records, in ``:holders``, of the leases `past_cutoff`
            finds: the reaper spares those whose own lease is longer.
        extra_weight: ``:weight``: how much more than 1 each permit held
            weighs, together.
        relays: Whether the caller relays a mutex granted to one of its
            waiters through its waiters queued right behind it (a run).
        arrivals: The first entries of ``:arriving``, by deadline: waiters
            that hold a ticket and are not queued yet.
        arrivals_whole: Whether that is all of ``:arriving``.
        own_arrivals: The step's identifiers' scores in ``:arriving``.
    """

    keys: SemaphoreKeys
    now: float
    lease: float
    limit: int | None
    waiter_ttl: float
    caller: str
    publish: str
    leases: Mapping[bytes, float]
    owners: Mapping[bytes, float]
    counter: int
    queue_head: Mapping[bytes, float]
    queue_size: int
    earliest_deaths: Mapping[bytes, float]
    queued: Mapping[bytes, float]
    alive_until: Mapping[bytes, float]
    cancelled: Mapping[bytes, float]
    stored_limit: int | None
    permit_ttls: tuple[int, int, int]
    queue_ttls: tuple[int, int, int]
    tickets: Mapping[bytes, int] = field(default_factory=dict)
    receipt: str | None = None
    receipt_seconds: float = 0.0
    earlier_receipt: bytes = b""
    record: str = ""
    records: Mapping[bytes, bytes] = field(default_factory=dict)
    limit_set: bool = False
    extra_weight: int = 0
    relays: bool = False
    arrivals: Mapping[bytes, float] = field(default_factory=dict)
    arrivals_whole: bool = True
    own_arrivals: Mapping[bytes, float] = field(default_factory=dict)


def past_cutoff(leases: Mapping[bytes, float], now: float, lease: float) -> list[bytes]:
    """The permits confirmed a ``lease`` or more before ``now``: those the reaper reads the records of.

    Compared as the scripts compare: with the bound as sent to Redis, rounded to the microsecond.
    """
    cutoff = float(_seconds(now - lease))
    return [member for member, score in leases.items() if score <= cutoff]


def own_lease(record: bytes | None) -> float | None:
    """The lease a record gives, in seconds, as the scripts' aiosem_own_lease reads it; ``None`` for none."""
    match = None if record is None else _OWN_LEASE.match(record)
    return None if match is None else int(match[1]) / 1000


@dataclass(frozen=True, slots=True)
class Decision:
    """What one locked step writes, in order, inside its ``MULTI``; and what it answers."""

    writes: tuple[Command, ...]
    reply: Reply


def plan_step(state: ReadState, step: Step, members: Sequence[bytes]) -> Decision:
    """Decide a step on ``members`` from ``state``, as the fair script of ``step`` would.

    A `Step.PASS` takes its members in threes: holder, successor (``b""``:
    none), the successor's token.
    """
    draft = _Draft(state)
    operation = step.operation
    if step is Step.LIMIT:
        # As fair_acquire's MODE_LIMIT: what is free under the new limit goes to the queue at once.
        draft.hand_off()
        values = [draft.set_limit(member) for member in members]
        draft.hand_off()
    elif operation is Operation.ACQUIRE:
        # As fair_acquire: the queue is served before any newcomer.
        draft.hand_off()
        if members:
            draft.bring_limit()
        # As fair_acquire: an identifier named twice in one step gets its first answer.
        answered: dict[bytes, int] = {}
        queued, mark = draft.queue_size, len(draft.writes)
        for member in members:
            if member not in answered:
                answered[member] = draft.acquire(member, step)
        values = [answered[member] for member in members]
        draft.grown(mark, queued, draft.queue_size, (state.keys.queue, state.keys.waiters))
    elif step is Step.PASS:
        values = []
        for holder, successor, token in zip(members[::3], members[1::3], members[2::3], strict=True):
            released = draft.release(holder, step)
            values += [released, draft.pass_on(successor, token, released), 0]
        if state.receipt is not None:
            values = draft.with_receipt(state.receipt, values, stride=3)
    elif operation is Operation.RELEASE:
        values = [draft.release(member, step) for member in members]
        if state.receipt is not None:
            values = draft.with_receipt(state.receipt, values)
    else:
        values = [draft.refresh(member) for member in members]
    draft.write_refreshes()
    if operation is not Operation.ACQUIRE:
        # As fair_release and fair_refresh: what the step freed goes to the queue at once.
        draft.hand_off()
    return draft.finish(values)


class _Draft:
    """The working copy that one `plan_step` call decides on, and the writes it collects."""

    __slots__ = (
        "alive",
        "cancelled",
        "counter",
        "extra",
        "freed",
        "granted",
        "heads",
        "held",
        "leases",
        "limit",
        "limit_set",
        "owners",
        "queue_size",
        "queued",
        "refreshed_holders",
        "refreshed_waiters",
        "refusal",
        "relayed",
        "run_below",
        "served_first",
        "spared",
        "state",
        "stored_limit",
        "waiters_written",
        "writes",
    )

    def __init__(self, state: ReadState) -> None:
        self.state = state
        keys = state.keys
        self.counter = state.counter
        #: As the scripts' state: the limit stored, whether it was set, and the limit in force.
        self.stored_limit = state.stored_limit
        self.limit_set = state.limit_set and state.stored_limit is not None
        self.limit = state.stored_limit if state.stored_limit is not None else state.limit
        #: What every acquire of the step answers, unless it holds or waits already.
        self.refusal: int | None = None
        #: As the scripts' state.served_first: whether a waiter that could be served is queued.
        self.served_first = False
        self.waiters_written = False
        self.writes: list[Command] = []
        self.granted: list[tuple[str, int]] = []
        self.relayed: list[tuple[str, int]] = []
        self.refreshed_holders: list[bytes] = []
        self.refreshed_waiters: list[bytes] = []
        # Compared as the scripts compare: with the bounds as sent to Redis,
        # rounded to the microsecond.
        now = float(_seconds(state.now))
        #: As the scripts' aiosem_past: a permit past the caller's lease whose own is longer and still runs.
        self.spared: dict[bytes, float] = {}
        expired: set[bytes] = set()
        for member in past_cutoff(state.leases, state.now, state.lease):
            own = own_lease(state.records.get(member))
            if own is not None and state.leases[member] > float(_seconds(state.now - own)):
                self.spared[member] = own
            else:
                expired.add(member)
        # As the scripts' reaper: a member of one permit set only counts for nothing.
        strays = (state.leases.keys() - expired) ^ (state.owners.keys() - expired)
        dead = expired | strays
        self.leases = {member: score for member, score in state.leases.items() if member not in dead}
        self.owners = {member: int(score) for member, score in state.owners.items() if member not in dead}
        #: As the scripts' state.extra: :weight, how much more than 1 each permit held weighs, together.
        self.extra = state.extra_weight
        weighed = len(state.owners) + self.extra
        if dead:
            self.writes += [("ZREM", keys.timeout_set, *dead), ("ZREM", keys.owner_set, *dead)]
        # As the scripts' reaper: the weight of permits taken goes too; with none held, none weighs.
        taken_weighed = any(weight_of(member) > 1 for member in expired)
        if self.extra > 0 and (taken_weighed or strays or not self.owners):
            self._recount_weight()
        #: As the scripts' state.holders: the weight held.
        self.held = len(self.owners) + self.extra
        #: As the scripts' state.freed: the weight freed by the step, which goes to the queue when no limit is known.
        self.freed = weighed - self.held
        if expired:
            self.writes.append(("HDEL", keys.holders, *expired))
        deaths = (*state.earliest_deaths.items(), *state.alive_until.items())
        gone = {member for member, until in deaths if until <= now}
        if gone:
            self.writes += [("ZREM", keys.queue, *gone), ("ZREM", keys.waiters, *gone), ("HDEL", keys.holders, *gone)]
        self.writes.append(("ZREMRANGEBYSCORE", keys.cancelled, "-inf", _seconds(state.now)))
        # A waiter presumed dead may have had no place in the queue (its
        # :queue entry evicted, say): with the whole queue in view, only
        # those that did leave it. Past the window, each is presumed queued.
        whole = len(state.queue_head) >= state.queue_size
        self.queue_size = state.queue_size - len(gone & state.queue_head.keys() if whole else gone)
        self.heads = [member for member, _ in sorted(state.queue_head.items(), key=_by_score) if member not in gone]
        self.queued = {member for member in state.queued if member not in gone}
        self.alive = {member for member, until in state.alive_until.items() if until > now}
        self.cancelled = {member for member, until in state.cancelled.items() if until > now}
        #: A run relays only waiters whose tickets are below this (see `_settle_arrivals`).
        self.run_below = self._settle_arrivals(now)

    def _settle_arrivals(self, now: float) -> float:
        """Take the step's identifiers and the waiters gone out of ``:arriving``; give the others a deadline.

        Answers the ticket below which a run may be relayed. Any waiter
        arriving may have come before the run, and be queued ahead of it
        once the run is under way: one of the caller's own, whose ticket it
        knows, cuts the run at its ticket; one of anyone else's, or a
        ``:arriving`` not read whole, stops it.
        """
        state, key = self.state, self.state.keys.arriving
        gone = [member for member, until in state.arrivals.items() if until <= now]
        ended = [member for member in state.own_arrivals if member not in gone]
        if gone or ended:
            self.writes.append(("ZREM", key, *gone, *ended))
        # Seen for the first time: presumed gone a waiter timeout from now, unless queued by then.
        new = [member for member, until in state.arrivals.items() if until == math.inf and member not in ended]
        if new:
            deadline = _seconds(state.now + state.waiter_ttl)
            self.writes.append(("ZADD", key, "XX", *(item for member in new for item in (deadline, member))))
        if not state.arrivals_whole:
            return -math.inf
        run_below = math.inf
        for member, until in (*state.arrivals.items(), *state.own_arrivals.items()):
            if until <= now:
                continue
            # Known only for the caller's own waiters: anyone else's stops the run.
            ticket = state.tickets.get(member)
            if ticket is None:
                return -math.inf
            run_below = min(run_below, ticket)
        return run_below

    def _recount_weight(self) -> None:
        """As the scripts' aiosem_recount_weight: :weight again, from the permits held."""
        keys = self.state.keys
        self.extra = sum(weight_of(member) - 1 for member in self.owners)
        self.writes.append(("SET", keys.weight, self.extra) if self.extra > 0 else ("DEL", keys.weight))

    def _add_weight(self, delta: int) -> None:
        """As the scripts' aiosem_add_weight: ``delta`` added to :weight, which goes at 0."""
        self.extra += delta
        self.writes.append(("INCRBY", self.state.keys.weight, delta))
        if self.extra <= 0:
            self.writes.append(("DEL", self.state.keys.weight))

    def next_tokens(self, count: int) -> int:
        """As the scripts' aiosem_next_tokens: the first of ``count`` tokens, never below the clock in microseconds."""
        first = max(self.counter + 1, math.floor(self.state.now * 1_000_000))
        self.counter = first + count - 1
        return first

    def grant(self, member: bytes, stamp: float) -> int:
        """As the scripts' aiosem_hold, with the next token."""
        token = self.next_tokens(1)
        self.hold(member, token, stamp)
        return token

    def stamp(self, member: bytes, token: int, stamp: float) -> None:
        """As the scripts' aiosem_stamp."""
        keys = self.state.keys
        self.owners[member] = token
        score = _seconds(stamp)
        self.leases[member] = float(score)
        self.writes += [("ZADD", keys.owner_set, token, member), ("ZADD", keys.timeout_set, score, member)]

    def hold(self, member: bytes, token: int, stamp: float) -> None:
        """As the scripts' aiosem_hold."""
        self.stamp(member, token, stamp)
        weight = weight_of(member)
        if weight > 1:
            self._add_weight(weight - 1)
        self.held += weight

    def enter(self, member: bytes) -> None:
        """As the scripts' aiosem_enter_all: an identifier queued or granted straight away is stored with its record."""
        if self.state.record:
            self.writes.append(("HSET", self.state.keys.holders, member, self.state.record))

    def leave_queue(self, members: Sequence[bytes]) -> None:
        self.queue_size -= len(members)
        self.queued.difference_update(members)
        self.alive.difference_update(members)
        self.writes += [("ZREM", self.state.keys.queue, *members), ("ZREM", self.state.keys.waiters, *members)]

    def fitting_heads(self, free: int) -> tuple[list[bytes], bool]:
        """As the scripts' aiosem_heads: who ``free`` weight goes to, and whether a servable waiter is left.

        The waiters come in queue order. Only as far as the queue was read: past it, a head passed over for
        being heavier than the limit would be followed by waiters not read,
        presumed to be servable.
        """
        heads: list[bytes] = []
        for member in self.heads:
            weight = weight_of(member)
            if self.limit is not None and weight > self.limit:
                continue
            if weight > free:
                return heads, True
            heads.append(member)
            free -= weight
            if free == 0:
                return heads, True
        return heads, len(self.heads) < self.queue_size

    def hand_off(self) -> None:
        """As the scripts' aiosem_hand_off: free weight to the queue's head, another process's for a waiter TTL."""
        state = self.state
        free = self.freed if self.limit is None else self.limit - self.held
        self.freed = 0
        if free <= 0 or self.queue_size == 0:
            self.served_first = self.queue_size > 0
            return
        heads, self.served_first = self.fitting_heads(free)
        self.heads = [member for member in self.heads if member not in heads]
        held, mark = len(self.owners), len(self.writes)
        messages: dict[str, list[str]] = {}
        for member in heads:
            owner = _owner(member)
            stamp = state.now
            if owner != state.caller:
                stamp = state.now - state.lease + min(state.waiter_ttl, state.lease)
            token = self.grant(member, stamp)
            identifier = member.decode()
            if owner is not None and owner != state.caller:
                messages.setdefault(owner, []).append(f"{identifier}:{token} ")
            self.granted.append((identifier, token))
        self.grown(mark, held, len(self.owners), (state.keys.owner_set, state.keys.timeout_set))
        if heads:
            self.leave_queue(heads)
        for owner, grants in messages.items():
            self.writes.append((state.publish, state.keys.channels + owner, "".join(grants)))
        if heads:
            self.relay_run(heads[0])

    def grown(self, mark: int, before: int, after: int, keys: Sequence[str]) -> None:
        """As the scripts' aiosem_add_all: sorted sets grown to `SKIPLIST_AT` members by the writes from ``mark`` on.

        They go to the skiplist encoding before those writes, by a member too long for the compact one, added
        before them and taken out after.
        """
        if before < SKIPLIST_AT <= after:
            self.writes[mark:mark] = [("ZADD", key, 0, SKIPLIST_MOVER) for key in keys]
            self.writes += [("ZREM", key, SKIPLIST_MOVER) for key in keys]

    def relay_run(self, head: bytes) -> None:
        """As the scripts' aiosem_relay_run: a mutex just handed to the caller's ``head`` goes on through its run.

        The run is the caller's unweighted waiters queued right behind it,
        up to the first of anyone else: each gets its token now, stays
        queued, and is named in the reply.
        """
        state = self.state
        if not state.relays or self.limit != 1 or _owner(head) != state.caller:
            return
        run: list[bytes] = []
        for member in self.heads[:RUN_LENGTH]:
            if _owner(member) != state.caller or weight_of(member) != 1 or state.queue_head[member] >= self.run_below:
                break
            run.append(member)
        if run:
            first = self.next_tokens(len(run))
            self.relayed += [(member.decode(), token) for token, member in enumerate(run, start=first)]

    def pass_on(self, successor: bytes, token: bytes, released: int) -> int:
        """As fair_release's pass: a relayed mutex installed with its successor, as the queue's head; its token or 0."""
        if not successor:
            return 0
        if successor in self.owners:
            # Installed by a pass sent before, or handed the permit from the queue's head: held by the relayed token.
            self.stamp(successor, int(token), self.state.now)
            return int(token)
        if self.limit is not None:
            if self.held + weight_of(successor) > self.limit:
                return 0
        elif released == 0:
            return 0
        if not self.heads or self.heads[0] != successor:
            return 0
        del self.heads[0]
        self.leave_queue([successor])
        self.hold(successor, int(token), self.state.now)
        self.freed -= released
        return int(token)

    def set_limit(self, member: bytes) -> int:
        """As fair_acquire's set_limit: a limit in force from now on (``b""``: clear one set); the one stored before."""
        before = self.stored_limit or 0
        keys = self.state.keys
        if not member:
            if self.limit_set:
                # As if its users had brought it: in force while anybody holds or waits.
                assert self.stored_limit is not None  # noqa: S101 -- a limit set is stored
                self.writes.append(("SET", keys.limit, self.stored_limit))
                self.limit_set = False
        else:
            self.stored_limit = self.limit = int(member)
            self.limit_set = True
            self.writes.append(("SET", keys.limit, b"=" + member))
        return before

    def bring_limit(self) -> None:
        """As fair_acquire: refuse the step's acquires, or put the caller's limit in force, and store it."""
        state = self.state
        if self.limit is None:
            self.refusal = NO_LIMIT
        elif (
            state.limit is not None
            and not self.limit_set
            and self.stored_limit is not None
            and self.stored_limit != state.limit
            and (self.held > 0 or self.queue_size > 0)
        ):
            # A limit brought by another caller counts only while somebody holds or waits under it.
            self.refusal = LIMIT_MISMATCH
        elif not self.limit_set and state.limit is not None:
            self.limit = state.limit
            if self.stored_limit != state.limit:
                self.writes.append(("SET", state.keys.limit, state.limit))
                self.stored_limit = state.limit

    def acquire(self, member: bytes, step: Step) -> int:  # noqa: PLR0911 -- one return per outcome, as in the script
        keys = self.state.keys
        if member in self.cancelled:
            self.cancelled.discard(member)
            self.writes.append(("ZREM", keys.cancelled, member))
            return TOMBSTONED
        now = self.state.now
        if member in self.owners:
            self.leases[member] = float(_seconds(now))
            self.writes.append(("ZADD", keys.timeout_set, "XX", _seconds(now), member))
            return self.owners[member]
        alive_until = _seconds(now + self.state.waiter_ttl)
        if member in self.queued:
            self.writes.append(("ZADD", keys.waiters, "XX", alive_until, member))
            self.waiters_written = True
            return QUEUED
        if self.refusal is not None:
            return self.refusal
        assert self.limit is not None  # noqa: S101 -- else refused: NO_LIMIT
        weight = weight_of(member)
        if weight > self.limit:
            return TOO_HEAVY
        if not self.served_first and self.held + weight <= self.limit:
            token = self.grant(member, now)
            self.enter(member)
            return token
        if step is not Step.WAIT:
            return REFUSED
        self.queue_size += 1
        self.served_first = True
        self.queued.add(member)
        self.alive.add(member)
        self.waiters_written = True
        self.writes += [
            ("ZADD", keys.queue, self.state.tickets[member], member),
            ("ZADD", keys.waiters, alive_until, member),
        ]
        self.enter(member)
        return QUEUED

    def release(self, member: bytes, step: Step) -> int:
        keys = self.state.keys
        if member in self.owners:
            del self.owners[member], self.leases[member]
            self.writes += [
                ("ZREM", keys.owner_set, member),
                ("ZREM", keys.timeout_set, member),
                ("HDEL", keys.holders, member),
            ]
            # As the script: it counted for 1, and for no more of :weight than there is.
            extra = min(weight_of(member) - 1, self.extra)
            if extra > 0:
                self._add_weight(-extra)
            self.freed += 1 + extra
            self.held -= 1 + extra
            return 1
        if step is Step.CANCEL:
            if member in self.queued:
                self.leave_queue([member])
                self.writes.append(("HDEL", keys.holders, member))
                if member in self.heads:
                    self.heads.remove(member)
            else:
                # A step of this class that has not committed can only abort,
                # but a batch retried after a busy lock would try again.
                self.cancelled.add(member)
                self.writes += [
                    ("ZADD", keys.cancelled, _seconds(self.state.now + TOMBSTONE_SECONDS), member),
                    ("PEXPIRE", keys.cancelled, TOMBSTONE_TTL_MS),
                ]
        return 0

    def with_receipt(self, receipt: str, values: list[int], stride: int = 1) -> list[int]:
        """As the release script: what an earlier try of the call released counts as released, and is noted.

        With a ``stride`` of 3 (a pass), only every third value is a release: the others are noted as 0.
        """
        earlier = self.state.earlier_receipt
        values = [
            value or int(earlier[i : i + 1] == b"1") if i % stride == 0 else value for i, value in enumerate(values)
        ]
        noted = "".join(str(value) if i % stride == 0 else "0" for i, value in enumerate(values))
        if "1" in noted:
            self.writes.append(("SET", receipt, noted, "PX", math.ceil(self.state.receipt_seconds * 1000)))
        return values

    def refresh(self, member: bytes) -> int:
        if member in self.owners:
            self.leases[member] = float(_seconds(self.state.now))
            self.refreshed_holders.append(member)
            return self.owners[member]
        # As fair_refresh: a waiter is one with a deadline in :waiters.
        if member in self.alive:
            self.refreshed_waiters.append(member)
            self.waiters_written = True
            return QUEUED
        return REFUSED

    def write_refreshes(self) -> None:
        # One command for all the holders, one for all the waiters: a batch
        # of a thousand waiters proving they are alive is two writes.
        state = self.state
        for key, score, members in (
            (state.keys.timeout_set, _seconds(state.now), self.refreshed_holders),
            (state.keys.waiters, _seconds(state.now + state.waiter_ttl), self.refreshed_waiters),
        ):
            if members:
                self.writes.append(("ZADD", key, "XX", *(item for member in members for item in (score, member))))

    def finish(self, values: list[int]) -> Decision:
        state, keys = self.state, self.state.keys
        if self.counter > state.counter:
            # The counter is watched: nobody else wrote it since it was read.
            self.writes.insert(0, ("SET", keys.counter, self.counter, "PX", COUNTER_TTL_MS))
        if self.waiters_written:
            self.write_queue_ttls()
        if not self.owners and self.queue_size == 0:
            # As the scripts: a limit set outlives the idle semaphore.
            if self.limit_set:
                self.writes.append(("DEL", keys.holders, keys.weight))
            else:
                self.writes.append(("DEL", keys.limit, keys.holders, keys.weight))
                self.limit = state.limit
        else:
            # As the scripts' aiosem_persist_permits: no TTL on a key that
            # bears a live permit, lest volatile-* eviction take it. Only a
            # TTL found is removed, so most steps write nothing here.
            for key, ttl in zip((keys.timeout_set, keys.owner_set, keys.limit), state.permit_ttls, strict=True):
                if ttl >= 0:
                    self.writes.append(("PERSIST", key))
        # As the scripts' header: in whole microseconds; a spared permit not
        # refreshed since ends with its own lease, the others with the caller's.
        cutoff = float(_seconds(state.now - state.lease))
        left = [
            max(0, math.floor((score + self._lease_of(member, score, cutoff) - state.now) * 1_000_000))
            for member, score in self.leases.items()
        ]
        return Decision(
            writes=tuple(self.writes),
            reply=Reply(
                holders=self.held,
                waiting=self.queue_size,
                limit=self.limit,
                next_expiry=min(left) / 1_000_000 if left else None,
                values=tuple(values),
                granted=tuple(self.granted),
                relayed=tuple(self.relayed),
            ),
        )

    def _lease_of(self, member: bytes, score: float, cutoff: float) -> float:
        if score <= cutoff and member in self.spared:
            return self.spared[member]
        return self.state.lease

    def write_queue_ttls(self) -> None:
        """As the scripts' aiosem_expire, on the TTLs the keys have once the step's writes are done.

        ``NX`` gives one to a key without: one that had none, or that the
        step emptied and filled again. ``GT`` pushes out one read with less
        than the margin less the slack left, and, as in the scripts, never
        shortens another caller's longer one.
        """
        state = self.state
        queue_ms = queue_ttl_ms(state.waiter_ttl)
        for key, ttl in zip((state.keys.queue, state.keys.waiters, state.keys.tickets), state.queue_ttls, strict=True):
            self.writes.append(("PEXPIRE", key, queue_ms, "NX"))
            if 0 <= ttl < queue_ms - EXPIRE_SLACK_MS:
                self.writes.append(("PEXPIRE", key, queue_ms, "GT"))


def _by_score(item: tuple[bytes, float]) -> tuple[float, bytes]:
    return item[1], item[0]


_OWNER: Final = re.compile(rb"^([0-9a-fA-F]+)\.")
_OWN_LEASE: Final = re.compile(rb"^\[([0-9]+),")


def _owner(member: bytes) -> str | None:
    """The process token a waiter's identifier starts with, as the scripts' aiosem_owner reads it."""
    match = _OWNER.match(member)
    return None if match is None else match[1].decode()


def _seconds(value: float) -> str:
    """A score as the scripts write it: in seconds, to the microsecond."""
    return f"{value:.6f}"
