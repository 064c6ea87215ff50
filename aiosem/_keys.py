"""Where a semaphore lives in Redis.

Every key of one semaphore shares one Redis Cluster hash tag, ``{name}``, so a
single script may touch them all; different names get different tags and
spread over the slots. Redis hashes only what lies between the first ``{`` of
a key and the first ``}`` after it, so a name containing braces could move or
cancel the tag: names are escaped so that each yields exactly one non-empty
tag, and prefixes may not contain braces at all.

The layout under the base key ``prefix:{name}`` extends the book's, so a
client written from *Redis in Action* can share a semaphore by using the
base key as its ``semname``:

================================  ===========================================
``prefix:{name}``                 timeout set: identifier -> grant time (s)
``prefix:{name}:owner``           owner set: identifier -> fencing token
``prefix:{name}:counter``         the last fencing token; expires a day after the last grant
``prefix:{name}:queue``           waiters: identifier -> ticket (arrival order)
``prefix:{name}:waiters``         waiters: identifier -> presumed dead at (s)
``prefix:{name}:cancelled``       tombstones: identifier -> refused until (s)
``prefix:{name}:tickets``         the last ticket handed to a waiter
``prefix:{name}:arriving``        locked waiters ticketed, not queued yet: identifier -> presumed gone at (s)
``prefix:{name}:limit``           the limit in force: ``n`` brought, while in use; ``=n`` set, until cleared
``prefix:{name}:holders``         records: identifier -> [lease (ms), pid, host, label]
``prefix:{name}:weight``          how much more than 1 each permit held weighs, together
``prefix:{name}:receipt:<id>``    what release call <id> released, while it may be retried
``prefix:{name}:wake:<token>``    the channel of one process's waiters
``lock:prefix:{name}``            the short lock of `AsyncLockedSemaphore`
================================  ===========================================

A record in ``:holders`` says who an identifier is: the lease it uses, the
process and host it runs in, and the label its semaphore was given. It is
written once, in the step that queues the identifier or grants it a permit
straight away, follows it through a hand-off, and goes in the step that
removes it (release, cancel, reaping); the hash goes whenever nobody holds
or waits. ``python -m aiosem status`` shows it, and the reaper reads it to
reap a permit no earlier than its own lease. A book client writes none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from ._validation import check_name

_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def escape_name(name: str) -> str:
    """Return ``name`` with ``%``, ``{`` and ``}`` percent-encoded."""
    return name.translate(_ESCAPES)


class Record(NamedTuple):
    """Who an identifier that holds or waits is, as its ``:holders`` record says."""

    #: Its lease, in seconds (recorded in whole milliseconds, rounded up).
    lease: float
    pid: int
    host: str
    label: str | None


def encode_record(lease: float, pid: int, host: str, label: str | None) -> str:
    """The record the scripts store: a JSON array whose first item, the lease in ms, they read."""
    return json.dumps([_ceil_ms(lease), pid, host, label], separators=(",", ":"), ensure_ascii=False)


def decode_record(raw: bytes | str) -> Record | None:
    """What `encode_record` wrote; ``None`` for anything else (written by whom?)."""
    try:
        lease_ms, pid, host, label = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not (isinstance(lease_ms, int) and isinstance(pid, int) and isinstance(host, str)):
        return None
    return Record(lease_ms / 1000, pid, host, label if isinstance(label, str) else None)


def decode_limit(raw: bytes | str | None) -> tuple[int | None, bool]:
    """The limit ``:limit`` holds, and whether it was set (``=n``) rather than brought by a caller (``n``).

    ``(None, False)`` for none, or for anything else (written by whom?).
    """
    if raw is None:
        return None, False
    value = raw.decode() if isinstance(raw, bytes) else raw
    set_ = value.startswith("=")
    digits = value[1:] if set_ else value
    if not digits.isdigit():
        return None, False
    return int(digits), set_


def weighted(identifier: str, weight: int) -> str:
    """The identifier of a permit of ``weight``: the scripts read a weight above 1 from its ``*k`` end."""
    return identifier if weight == 1 else f"{identifier}*{weight}"


def weight_of(identifier: str | bytes) -> int:
    """What a permit weighs, as the scripts' aiosem_weight reads it from its identifier."""
    match = _WEIGHT.search(identifier if isinstance(identifier, str) else identifier.decode(errors="replace"))
    return 1 if match is None else max(1, int(match[1]))


_WEIGHT: Final = re.compile(r"\*([0-9]+)\Z")


def _ceil_ms(seconds: float) -> int:
    return -(-round(seconds * 1_000_000) // 1000)


def check_prefix(prefix: object) -> str:
    prefix = check_name(prefix, "prefix")
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must not contain '{{' or '}}', got {prefix!r}")
    return prefix


@dataclass(frozen=True, slots=True)
class SemaphoreKeys:
    """The keys of one semaphore, in the book's layout under ``base``."""

    base: str
    #: The keys every fair script takes, in order (and a release its receipt
    #: after them): made once, as every fair step sends them.
    fair: tuple[str, str, str, str, str, str, str, str, str, str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fair = (
            self.timeout_set,
            self.owner_set,
            self.counter,
            self.queue,
            self.waiters,
            self.cancelled,
            self.tickets,
            self.limit,
            self.holders,
            self.weight,
            self.arriving,
        )
        object.__setattr__(self, "fair", fair)

    @classmethod
    def for_name(cls, prefix: str, name: str) -> SemaphoreKeys:
        return cls(f"{prefix}:{{{escape_name(name)}}}")

    @property
    def timeout_set(self) -> str:
        return self.base

    @property
    def owner_set(self) -> str:
        return f"{self.base}:owner"

    @property
    def counter(self) -> str:
        return f"{self.base}:counter"

    @property
    def queue(self) -> str:
        return f"{self.base}:queue"

    @property
    def waiters(self) -> str:
        return f"{self.base}:waiters"

    @property
    def cancelled(self) -> str:
        return f"{self.base}:cancelled"

    @property
    def tickets(self) -> str:
        return f"{self.base}:tickets"

    @property
    def arriving(self) -> str:
        """The waiters of `AsyncLockedSemaphore` that hold a ticket and are not queued yet (see docs/design.md)."""
        return f"{self.base}:arriving"

    def receipt(self, call: str) -> str:
        """What release call ``call`` released, for the same call tried again to read."""
        return f"{self.base}:receipt:{call}"

    @property
    def holders(self) -> str:
        """Who each identifier that holds or waits is: its lease, process and label, as it recorded them."""
        return f"{self.base}:holders"

    @property
    def weight(self) -> str:
        """How much more than 1 each permit held weighs (see `weight_of`), together; absent for 0."""
        return f"{self.base}:weight"

    @property
    def limit(self) -> str:
        """The limit in force: brought by a caller, while anybody holds or waits; or set, until cleared."""
        return f"{self.base}:limit"

    @property
    def rate(self) -> str:
        """The rate limiter of the same name: its theoretical arrival time."""
        return f"{self.base}:rate"

    @property
    def channels(self) -> str:
        """The prefix of the wake-up channels; a process's channel is this plus its token."""
        return f"{self.base}:wake:"

    @property
    def lock(self) -> str:
        return f"lock:{self.base}"
