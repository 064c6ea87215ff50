"""The step protocol: what a step is asked to do, and what it answers.

Both backends -- the scripts of `AsyncFairSemaphore` and the watched
transactions of `AsyncLockedSemaphore` -- carry out the same steps and
answer the same `Reply`; this module is the one place their names, their
result codes and the scripts' reply format are defined.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ._connection import text

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "LIMIT_MISMATCH",
    "NO_LIMIT",
    "QUEUED",
    "REFUSED",
    "TOMBSTONED",
    "TOO_HEAVY",
    "Operation",
    "Reply",
    "Step",
    "parse_reply",
]


class Operation(enum.Enum):
    """Which script a step runs; its value is the script's name after ``fair_``."""

    ACQUIRE = "acquire"
    RELEASE = "release"
    REFRESH = "refresh"

    # Members are singletons compared by identity: hashed by it too, in C (a
    # step looks up its script, and its lane, by them).
    __hash__ = object.__hash__


class Step(enum.Enum):
    """One kind of step: an operation, and the mode it is run in (the scripts' ``ARGV[8]``).

    Every step first reaps expired permits and dead waiters, and hands free
    permits to the head of the queue.
    """

    #: Grant to each identifier if its weight is free and nobody who could be served is queued; refuse otherwise.
    TRY = (Operation.ACQUIRE, "try")
    #: Grant, or else queue, each identifier; prove one already queued alive.
    WAIT = (Operation.ACQUIRE, "wait")
    #: Nothing but the reaping and hand-off every step does: the counts it answers.
    COUNT = (Operation.ACQUIRE, "count")
    #: Give each identifier's permit back.
    RELEASE = (Operation.RELEASE, "release")
    #: Give back each identifier's permit, or leave the queue; an identifier
    #: neither held nor queued is refused for a while (a tombstone), in case
    #: its acquire is still on its way.
    CANCEL = (Operation.RELEASE, "cancel")
    #: Pass relayed mutexes on: identifiers come in threes (holder,
    #: successor or '', the successor's token or '').
    PASS = (Operation.RELEASE, "pass")
    #: Restart the leases of holders, and prove waiters alive.
    REFRESH = (Operation.REFRESH, "")
    #: Set the limit in force: each "identifier" is a limit, applied in
    #: order ('' clears a set limit); each answers the limit in force before
    #: it (0: none). Raising it hands the new permits to the queue at once.
    LIMIT = (Operation.ACQUIRE, "limit")

    __hash__ = object.__hash__

    operation: Operation
    mode: str
    frees: bool
    takes: bool
    #: Whether a step of this kind waits for the replicas: acquires and refreshes, not releases or counts.
    waits_for_replicas: bool
    #: Whether a step of this kind leaves receipts: tried again, it answers what its first try did.
    leaves_receipts: bool

    def __init__(self, operation: Operation, mode: str) -> None:
        # Plain attributes, set once: every step reads them.
        self.operation = operation
        self.mode = mode
        self.waits_for_replicas = operation is not Operation.RELEASE and mode != "count"
        self.leaves_receipts = operation is Operation.RELEASE and mode in ("release", "pass")
        #: Whether a step of this kind may free permits (it gives them back) or take them (it asks for them).
        self.frees = operation is Operation.RELEASE
        self.takes = operation is Operation.ACQUIRE and mode in ("try", "wait")


# What a step answers for one identifier, besides a fencing token (> 0: held).
#: Acquire: queued (or, proven alive, still queued). Release: held nothing.
#: Refresh: a waiter still queued.
QUEUED: Final = 0
#: Acquire: not granted, and not queued (a try). Refresh: neither held nor
#: queued -- a lost permit, or a waiter the queue forgot.
REFUSED: Final = -1
#: Acquire: cancelled before it arrived; its tombstone, having served, is gone.
TOMBSTONED: Final = -2
#: Acquire: the semaphore is in use -- somebody holds or waits -- with another
#: limit, which no `Step.LIMIT` set.
LIMIT_MISMATCH: Final = -3
#: Acquire: the caller gave no limit, and none is stored.
NO_LIMIT: Final = -4
#: Acquire: the permit weighs more than the limit in force.
TOO_HEAVY: Final = -5


@dataclass(frozen=True, slots=True)
class Reply:
    """What one atomic step in Redis answered.

    Attributes:
        holders: The weight of the permits held once the step was done
            (each permit weighs 1 unless acquired with a weight).
        waiting: Waiters queued once the step was done.
        limit: The limit in force once the step was done: the one stored
            with the semaphore, else the caller's (``None``: neither).
        next_expiry: Seconds until the earliest live lease runs out, or
            ``None`` when nobody holds.
        values: One result per identifier of the step: a fencing token, or
            one of the codes above.
        granted: The waiters this step handed a permit, with their tokens.
        replicated: How many replicas acknowledged the step, if it waited
            for them (``None``: it did not).
        relayed: The run of the caller's waiters, with their tokens, that
            the mutex granted to the caller's own waiter is relayed to, in
            order (see ``_relay.py``).
    """

    holders: int
    waiting: int
    limit: int | None
    next_expiry: float | None
    values: tuple[int, ...]
    granted: tuple[tuple[str, int], ...] = ()
    replicated: int | None = None
    relayed: tuple[tuple[str, int], ...] = ()


def parse_reply(raw: Sequence[Any], count: int, replicated: int | None = None) -> Reply:
    """Read the reply every fair script returns (see ``lua/_prelude.lua``) for ``count`` identifiers."""
    next_expiry = int(raw[2])
    relayed = 2 * int(raw[3])
    limit = int(raw[4])
    handed = raw[_HEADER + count : len(raw) - relayed]
    run = raw[len(raw) - relayed :]
    return Reply(
        holders=int(raw[0]),
        waiting=int(raw[1]),
        limit=limit or None,
        next_expiry=None if next_expiry < 0 else next_expiry / 1_000_000,
        values=tuple(int(value) for value in raw[_HEADER : _HEADER + count]),
        granted=_pairs(handed),
        replicated=replicated,
        relayed=_pairs(run),
    )


#: How many values every script's reply starts with, before its results.
_HEADER: Final = 5


def _pairs(flat: Sequence[Any]) -> tuple[tuple[str, int], ...]:
    return tuple((text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2))
