"""What ``python -m aiosem status`` and ``reset`` read and delete in Redis.

Each semaphore is read in one ``MULTI``/``EXEC`` on the node that serves its
hash tag, with ``TIME`` inside, so that every figure of one semaphore is
taken at one instant of the server's clock. The read changes nothing: a
lease that ran out, or a waiter presumed dead, stays until the semaphore's
next step reaps it, and is shown for what it is. No Lua is run, so a server
that forbids scripting can be inspected too.

Each identifier that holds or waits is stored with a record of its lease,
process id, host and label (see `aiosem._keys`), and the time left of a
lease is computed with its own: remaining = last confirmation + lease -
now. An identifier without a record -- a book client's -- is shown with
the lease the caller gives, and marked as such.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, Final

from ._connection import scored, text, transaction
from ._keys import Record, SemaphoreKeys, decode_limit, decode_record, escape_name, weight_of

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._connection import Client

#: The keys that make a name a semaphore (or a rate limiter), as suffixes of
#: its base key: any of them but the short-lived lock, and the records of
#: its holders and waiters, which may outlive waiters that died.
_SUFFIXES: Final = frozenset((*SemaphoreKeys("").fair, SemaphoreKeys("").rate)) - {SemaphoreKeys("").holders}
#: How many keys each SCAN call looks at.
_SCAN_COUNT: Final = 1000
_UNESCAPES: Final = {"%25": "%", "%7B": "{", "%7D": "}"}
_ESCAPED: Final = re.compile("%25|%7B|%7D")
_GLOB_SPECIAL: Final = re.compile(r"([\\*?\[\]])")
#: What PTTL answers for a key that does not exist (-1: one without a TTL).
_NO_SUCH_KEY: Final = -2


@dataclass(frozen=True, slots=True)
class Holder:
    """One permit in Redis, as read.

    Attributes:
        identifier: The holder's identifier.
        fencing_token: The token it was granted with.
        age: Seconds since its lease was last confirmed (granted or refreshed).
        lease: Its lease, in seconds: its own, as recorded, or else the one
            the reader assumed.
        remaining: Seconds left of that lease; zero or less: it ran out,
            and the next step reaps it.
        record: Who holds it, as recorded; ``None`` for a holder that
            records nothing (a book client), whose lease is assumed.
    """

    identifier: str
    fencing_token: int
    age: float
    lease: float
    remaining: float
    record: Record | None

    @property
    def expired(self) -> bool:
        """Whether the lease ran out."""
        return self.remaining <= 0

    @property
    def weight(self) -> int:
        """What the permit counts for against the limit (1 unless acquired with a weight)."""
        return weight_of(self.identifier)


@dataclass(frozen=True, slots=True)
class Waiter:
    """One waiter queued in Redis, as read.

    Attributes:
        identifier: The waiter's identifier.
        ticket: Its ticket: the order of arrival (lower came first).
        place: Its place in the queue among the live waiters (1: next served).
        record: Who waits, as recorded (``None``: nothing recorded).
    """

    identifier: str
    ticket: int
    place: int
    record: Record | None

    @property
    def weight(self) -> int:
        """What the permit it waits for will count for against the limit."""
        return weight_of(self.identifier)


@dataclass(frozen=True, slots=True)
class SemaphoreStatus:
    """One semaphore's keys, read at one instant of the server's clock.

    Attributes:
        name: The semaphore's name.
        key: Its base key.
        exists: Whether any of its keys exists (the records of holders and
            waiters aside).
        time: The server's clock at the read, in seconds since the epoch.
        limit: The limit in force: one set (``set_limit``, ``python -m
            aiosem limit``), which stays until cleared, or else the one its
            users brought, which Redis keeps only while anybody holds or
            waits; ``None``: neither.
        limit_set: Whether ``limit`` was set, rather than brought.
        last_token: The last fencing token handed out; ``None`` if none ever was.
        holders: Every permit stored, lowest token first, expired ones included.
        waiters: The live waiters, in queue order (those presumed dead left out).
        rate_ahead: How far the rate limiter of the same name has its
            theoretical arrival time ahead of now, in seconds; ``None``
            when it is at rest.
        locked: Whether the short step lock of `AsyncLockedSemaphore` is held.
        lock_expires_in: Seconds until that lock expires, if it has a TTL.
    """

    name: str
    key: str
    exists: bool
    time: float
    limit: int | None
    limit_set: bool
    last_token: int | None
    holders: tuple[Holder, ...]
    waiters: tuple[Waiter, ...]
    rate_ahead: float | None
    locked: bool
    lock_expires_in: float | None

    @property
    def held(self) -> int:
        """The weight held, to compare with the limit: of the live permits (lease not run out), each at its weight."""
        return sum(holder.weight for holder in self.holders if not holder.expired)


@dataclass(frozen=True, slots=True)
class ResetResult:
    """What `reset` deleted.

    Attributes:
        existed: Whether any key of the semaphore, or of its rate limiter, existed.
        holders: How many permits were stored (expired ones included).
        waiters: How many waiters were queued (presumed dead ones included).
        last_token: The fencing counter, kept: the next grant gets a higher token.
        rate: Whether the rate limiter's state was deleted.
    """

    existed: bool
    holders: int
    waiters: int
    last_token: int | None
    rate: bool


def unescape_name(escaped: str) -> str:
    """Undo `aiosem._keys.escape_name`."""
    return _ESCAPED.sub(lambda match: _UNESCAPES[match[0]], escaped)


def name_of(key: bytes | str, prefix: str) -> str | None:
    """The name of the semaphore ``key`` belongs to under ``prefix``, or ``None`` if none does."""
    if isinstance(key, bytes):
        try:
            key = key.decode()
        except UnicodeDecodeError:
            return None  # aiosem writes its keys in UTF-8
    start = f"{prefix}:{{"
    if not key.startswith(start):
        return None
    escaped, brace, suffix = key[len(start) :].partition("}")
    if not brace or suffix not in _SUFFIXES:
        return None
    name = unescape_name(escaped)
    # A key that merely looks alike (``%7b``, a bare ``%``) is not one of ours.
    return name if name and escape_name(name) == escaped else None


async def find_names(client: Client, prefix: str, patterns: Sequence[str] = ()) -> list[str]:
    """Every semaphore or rate limiter under ``prefix``, sorted; on a cluster, on every primary.

    Args:
        client: A client of the server, Sentinel's master or the cluster.
        prefix: The semaphores' prefix.
        patterns: Only the names that match one of these globs (`fnmatch`:
            ``*``, ``?``, ``[...]``), matched against the name, not the key;
            none: every name.

    Raises:
        redis.RedisError: Redis failed or could not be reached.
    """
    # One SCAN of the prefix, the names matched here: keys hold them
    # escaped, and Redis's globs are not quite fnmatch's.
    pattern = _GLOB_SPECIAL.sub(r"\\\1", f"{prefix}:{{") + "*"
    names: set[str] = set()
    async for key in client.scan_iter(match=pattern, count=_SCAN_COUNT):
        name = name_of(key, prefix)
        if name is not None and (not patterns or any(fnmatchcase(name, glob) for glob in patterns)):
            names.add(name)
    return sorted(names)


async def read_status(client: Client, prefix: str, name: str, timeout: float) -> SemaphoreStatus:
    """Read one semaphore and the rate limiter of its name, atomically, on the server's clock.

    Args:
        client: A client of the server, Sentinel's master or the cluster.
        prefix: The semaphore's prefix.
        name: The semaphore's name.
        timeout: The lease to assume for a holder without a record of its
            own (a book client's), in seconds.

    Raises:
        redis.RedisError: Redis failed or could not be reached.
    """
    keys = SemaphoreKeys.for_name(prefix, name)
    leases, owners, counter, limit, queue, alive_until, stored, tat, lock_ms, existing, clock = await transaction(
        client,
        keys.base,
        ("ZRANGE", keys.timeout_set, 0, -1, "WITHSCORES"),
        ("ZRANGE", keys.owner_set, 0, -1, "WITHSCORES"),
        ("GET", keys.counter),
        ("GET", keys.limit),
        ("ZRANGE", keys.queue, 0, -1, "WITHSCORES"),
        ("ZRANGE", keys.waiters, 0, -1, "WITHSCORES"),
        ("HGETALL", keys.holders),
        ("GET", keys.rate),
        ("PTTL", keys.lock),
        ("EXISTS", *_existing(keys)),
        ("TIME",),
    )
    now = int(clock[0]) + int(clock[1]) / 1_000_000
    limit_in_force, limit_set = decode_limit(limit)
    confirmed = dict(scored(leases))
    records = _records(stored)

    def holder(member: str, token: float) -> Holder:
        record = records.get(member)
        lease = timeout if record is None else record.lease
        age = now - confirmed[member]
        return Holder(member, int(token), age=age, lease=lease, remaining=lease - age, record=record)

    holders = sorted(
        # A member in one set only holds nothing: the next step drops it.
        (holder(member, token) for member, token in scored(owners) if member in confirmed),
        key=lambda holder: holder.fencing_token,
    )
    presumed_dead_at = dict(scored(alive_until))
    live = [
        (member, int(ticket))
        for member, ticket in scored(queue)
        # Presumed dead once its time passed, as the next step will find it.
        if member not in presumed_dead_at or presumed_dead_at[member] > now
    ]
    waiters = tuple(
        Waiter(member, ticket, place, records.get(member)) for place, (member, ticket) in enumerate(live, start=1)
    )
    return SemaphoreStatus(
        name=name,
        key=keys.base,
        exists=int(existing) > 0,
        time=now,
        limit=limit_in_force,
        limit_set=limit_set,
        last_token=None if counter is None else int(counter),
        holders=tuple(holders),
        waiters=waiters,
        # The limiter's key holds its TAT in microseconds, and expires about when it is reached.
        rate_ahead=None if tat is None else max(0.0, int(tat) / 1_000_000 - now),
        locked=int(lock_ms) != _NO_SUCH_KEY,
        lock_expires_in=int(lock_ms) / 1000 if int(lock_ms) >= 0 else None,
    )


def _existing(keys: SemaphoreKeys) -> tuple[str, ...]:
    """The keys whose existence makes a semaphore exist: not the records, which may outlive dead waiters."""
    return (*(key for key in keys.fair if key != keys.holders), keys.rate, keys.lock)


def _records(reply: Any) -> dict[str, Record]:
    """An HGETALL of ``:holders``, flat in RESP2, a map in RESP3: each readable record by identifier."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {text(member): record for member, raw in pairs if (record := decode_record(raw)) is not None}


async def reset(client: Client, prefix: str, name: str, *, rate: bool) -> ResetResult:
    """Delete a semaphore's permits, queue, limit, records and step lock in one transaction; keep its counter.

    The limit goes whether its users brought it or it was set (with
    ``set_limit`` or ``python -m aiosem limit``): a reset is a reset, and
    the next acquire's limit applies, as on a new semaphore. The fencing
    counter is kept so that tokens keep increasing: a resource that
    remembers the highest token it saw still refuses the holders of
    before. So are the ticket counter (waiters drawn a ticket but not yet
    queued keep their place in the arrival order) and the tombstones of
    cancelled acquires (an acquire cancelled while on its way still takes
    nothing), and the receipts of recent releases (a release tried again
    still learns what its first try did); all expire by themselves. A
    holder learns of the reset at its next refresh, as `PermitLost`; a
    waiter is queued again by its process.

    Args:
        client: A client of the server, Sentinel's master or the cluster.
        prefix: The semaphore's prefix.
        name: The semaphore's name.
        rate: Also delete the state of the rate limiter of the same name.

    Raises:
        redis.RedisError: Redis failed or could not be reached.
    """
    keys = SemaphoreKeys.for_name(prefix, name)
    doomed = [
        keys.timeout_set,
        keys.owner_set,
        keys.queue,
        keys.waiters,
        keys.limit,
        keys.holders,
        keys.weight,
        keys.lock,
    ]
    if rate:
        doomed.append(keys.rate)
    existing, holders, waiters, counter, _ = await transaction(
        client,
        keys.base,
        ("EXISTS", *_existing(keys)),
        ("ZCARD", keys.owner_set),
        ("ZCARD", keys.queue),
        ("GET", keys.counter),
        ("DEL", *doomed),
    )
    return ResetResult(
        existed=int(existing) > 0,
        holders=int(holders),
        waiters=int(waiters),
        last_token=None if counter is None else int(counter),
        rate=rate,
    )
