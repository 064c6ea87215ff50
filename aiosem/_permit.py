"""The permit: the only token of a holder, and all a semaphore object needs to release it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._keys import weight_of

__all__ = ["Permit"]


@dataclass(frozen=True, slots=True)
class Permit:
    """One permit of a semaphore, held by whoever has this object.

    The permit is the only token: nothing about it is stored in the semaphore
    object, so one semaphore object can be shared by any number of tasks.

    Attributes:
        name: The name of the semaphore.
        identifier: The holder's identifier in Redis, unique per grant.
        fencing_token: The semaphore's counter at the grant: one more than
            the last, or the server's clock in microseconds if that is
            higher. (A mutex relayed through a run of one object's
            waiters gets the run's tokens at the step that formed it, in
            the order they are used.) It strictly increases over the whole life of the
            semaphore -- even after the counter expired, a day after the
            last grant, or Redis lost its data -- so a resource that
            remembers the highest token it has seen can refuse a write that
            carries a lower one. With ``limit == 1`` this fences off a holder
            whose lease ran out while it was paused; with a larger limit
            several holders legitimately hold different tokens at once, so the
            token orders grants but does not prove which are still live.
        key: The Redis key the semaphore is stored under; a permit is only
            accepted by a semaphore with the same key.
        acquired_at: `time.monotonic` when this process got the permit
            (NaN for a permit made by hand), for measuring how long it is held.
    """

    name: str
    identifier: str
    fencing_token: int
    key: str
    acquired_at: float = field(default=math.nan, compare=False, repr=False)

    @property
    def weight(self) -> int:
        """What the permit counts for against the limit: the ``weight`` it was acquired with (1 unless given)."""
        return weight_of(self.identifier)
