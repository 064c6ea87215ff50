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
``prefix:{name}:receipt:<id>``    what release call <id> released, while it may be retried
``prefix:{name}:wake:<token>``    the channel of one process's waiters
``lock:prefix:{name}``            the short lock of `AsyncLockedSemaphore`
================================  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass

from ._validation import check_name

_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})


def escape_name(name: str) -> str:
    """Return ``name`` with ``%``, ``{`` and ``}`` percent-encoded."""
    return name.translate(_ESCAPES)


def check_prefix(prefix: object) -> str:
    prefix = check_name(prefix, "prefix")
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must not contain '{{' or '}}', got {prefix!r}")
    return prefix


@dataclass(frozen=True, slots=True)
class SemaphoreKeys:
    """The keys of one semaphore, in the book's layout under ``base``."""

    base: str

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

    def receipt(self, call: str) -> str:
        """What release call ``call`` released, for the same call tried again to read."""
        return f"{self.base}:receipt:{call}"

    @property
    def limit(self) -> str:
        """The limit the semaphore is in use with, while anybody holds or waits."""
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

    @property
    def fair(self) -> tuple[str, str, str, str, str, str, str, str]:
        """The keys every fair script takes, in order."""
        return (
            self.timeout_set,
            self.owner_set,
            self.counter,
            self.queue,
            self.waiters,
            self.cancelled,
            self.tickets,
            self.limit,
        )
