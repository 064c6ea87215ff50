"""The *Redis in Action* §6.3 semaphores, driven the way a caller of the book drives them.

The book's functions themselves -- listings 6.14-6.15 (the fair semaphore:
a counter, ``ZINTERSTORE`` and two ``MULTI`` pipelines, ranked by the
client's ``time.time()``) and 6.17 (the same under a ``SETNX`` lock given up
after 10 ms) -- are the transcription in `tests.harness.book_client`, faults kept on
purpose, that the test suite already runs against aiosem. They are reused
here rather than copied, so that the benchmark and the tests measure the very
same code. (`aiosem.recipes` are the repaired versions and are not the
baseline.)

What this module adds is the loop the book leaves to its reader: its
semaphore acquires try once and return ``None`` when refused, so a caller
that must get a permit tries again. It does so every millisecond, the pace
of the book's own lock (listing 6.8 spins with ``time.sleep(.001)``), and
gives up after ``blocking_timeout`` so that no wait is unbounded.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Final

from harness import book_client

if TYPE_CHECKING:
    import redis.asyncio

#: The book's lease (``timeout=10`` in listings 6.12-6.17).
LEASE: Final = 10.0
#: Between two tries of a refused caller: the book's lock spins at this pace.
RETRY_PAUSE: Final = 0.001


class BookFairSemaphore:
    """Listings 6.14 (acquire) and 6.15 (release), retried until admitted.

    Args:
        client: The client every call goes through.
        name: The semaphore's key; the book adds ``:owner`` and ``:counter``.
        limit: How many holders the book means to admit.
        timeout: The lease, in seconds, against the client's clock.
        blocking_timeout: How long `acquire` keeps trying before it returns ``None``.
    """

    __slots__ = ("_blocking_timeout", "_client", "_limit", "_name", "_timeout")

    def __init__(
        self,
        client: redis.asyncio.Redis,
        name: str,
        limit: int,
        *,
        timeout: float = LEASE,
        blocking_timeout: float = 30.0,
    ) -> None:
        self._client = client
        self._name = name
        self._limit = limit
        self._timeout = timeout
        self._blocking_timeout = blocking_timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, limit={self._limit})"

    async def try_acquire(self) -> str | None:
        """One try, as the book's function makes it: the identifier, or ``None`` if refused."""
        return await book_client.acquire_fair_semaphore(self._client, self._name, self._limit, self._timeout)

    async def acquire(self) -> str | None:
        """Try every `RETRY_PAUSE` until admitted; ``None`` after ``blocking_timeout``."""
        # A monotonic deadline, like tests.harness.book_client's lock waits: the
        # book's clock (time.time) is what it ranks with, not what a caller
        # should time its patience by.
        deadline = time.monotonic() + self._blocking_timeout
        while (identifier := await self.try_acquire()) is None:
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(RETRY_PAUSE)
        return identifier

    async def release(self, permit: str) -> bool:
        """Listing 6.15: remove the identifier from both sets."""
        return await book_client.release_fair_semaphore(self._client, self._name, permit)


class BookLockedSemaphore(BookFairSemaphore):
    """Listing 6.17 (the fair semaphore under ``lock:<name>``), retried until admitted.

    A try that cannot take the lock within the book's 10 ms counts as refused,
    as the book has it; the release is listing 6.15's, as in the book.
    """

    __slots__ = ()

    async def try_acquire(self) -> str | None:
        return await book_client.acquire_semaphore_with_lock(self._client, self._name, self._limit, self._timeout)
