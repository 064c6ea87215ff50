"""The relay: a mutex handed through a run of one object's waiters without a round trip each.

Both classes relay: the fair scripts form the runs, and so does the plan of
`AsyncLockedSemaphore`'s steps. When a step grants a mutex to one
of the calling object's waiters, it also names the run of that object's
waiters queued right behind it, with their tokens. Each holder of the run
gives the mutex to the next waiter at once, within the process, and tells
Redis in a 'pass' release sent in order with every other pass of the object;
the next waiter gets its token from the run and the rest of the holder's
lease, restarted when the pass lands. The run's waiters stay queued in
Redis until a pass reaches them, in their places: whatever ends a run --
a lease that may have run out, a pass that finds the permit gone -- leaves
Redis to hand the permit to the first of them when it frees.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

from ._protocol import Step
from ._waiting import RECHECK_DELAY, WaiterState

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._core import Core
    from ._waiting import Waiter


class Relay:
    """The relayed mutexes of one semaphore object: who holds each, the run behind it, and the passes under way."""

    __slots__ = ("_core", "_leases", "_passing", "_run_timer", "_runs")

    def __init__(self, core: Core) -> None:
        self._core = core
        #: The identifiers holding a relayed mutex, with how their lease was
        #: last confirmed: (loop time the confirming step was sent, seconds).
        self._leases: dict[str, tuple[float, float]] = {}
        #: The run behind each holder: its waiters, with their tokens, in order.
        self._runs: dict[str, list[tuple[str, int]]] = {}
        #: The waiters relayed to whose pass is on its way to Redis.
        self._passing: dict[str, Waiter] = {}
        self._run_timer: asyncio.TimerHandle | None = None

    def reset(self) -> None:
        """Forget everything: the object moved to another event loop (the old one is closed)."""
        self._leases.clear()
        self._runs.clear()
        self._passing.clear()
        self._run_timer = None

    def holds(self, identifier: str) -> bool:
        """Whether ``identifier`` holds a relayed mutex."""
        return identifier in self._leases

    def passing(self, identifier: str) -> bool:
        """Whether a mutex was relayed to ``identifier`` and Redis has not heard yet: it is held all the same."""
        return identifier in self._passing

    def run_of(self, identifier: str) -> list[tuple[str, int]]:
        """The waiters, with their tokens, the mutex held by ``identifier`` is to be relayed to."""
        return list(self._runs.get(identifier, ()))

    def start(self, head: str, sent: float, run: Sequence[tuple[str, int]]) -> None:
        """A step sent at ``sent`` granted the mutex to ``head`` and formed the ``run`` behind it."""
        self._leases[head] = (sent, self._core.settings.timeout)
        self._runs[head] = list(run)
        self._watch_runs()

    async def relay(self, identifier: str) -> bool:
        """Give up a relayed mutex: to the next waiter of its run at once, else to the queue; ``True`` if it was held.

        A holder whose lease may have run out passes nothing: Redis may have
        reaped the permit and handed it to the head of the queue, where the
        run's waiters still are, in their places. The next waiter is told if
        the pass finds the permit gone.
        """
        loop = asyncio.get_running_loop()
        lease_from, lease = self._leases.pop(identifier)
        run = self._runs.pop(identifier, [])
        successor: Waiter | None = None
        token = 0
        while run and loop.time() < lease_from + lease:
            candidate, token = run.pop(0)
            successor = self._core.queue.waiter(candidate)
            if successor is not None:
                if run:
                    self._runs[candidate] = run
                self._leases[candidate] = (lease_from, lease)
                self._passing[candidate] = successor
                successor.state = WaiterState.RELAYED
                successor.grant(token, lease_from, lease)
                self._watch_runs()
                break
        name = "" if successor is None else successor.identifier
        sent = loop.time()
        try:
            values, _ = await self._core.submit(Step.PASS, (identifier, name, str(token) if name else ""))
        finally:
            if successor is not None:
                self._passing.pop(name, None)
                successor.state = WaiterState.DONE
        if successor is not None and values[1] > 0:
            self.confirm(name, sent, successor)
        elif successor is not None:
            self._lost(name)
        return values[0] == 1

    def confirm(self, identifier: str, sent: float, waiter: Waiter | None = None) -> None:
        """A step sent at ``sent`` found ``identifier`` holding: its relayed lease, and its hold, run from then.

        So does the lease its ``waiter`` returns with, if it has not yet.
        """
        lease = self._core.settings.timeout
        if identifier in self._leases:
            self._leases[identifier] = (sent, lease)
        if waiter is not None:
            waiter.lease = (sent, lease)
        self._core.holdings.confirm(identifier, sent, lease)

    def _lost(self, identifier: str) -> None:
        """A pass found the permit relayed to ``identifier`` gone: it holds nothing, and its run ends."""
        if self._leases.pop(identifier, None) is None:
            return  # relayed on already: that pass found it gone too
        self._end_run(self._runs.pop(identifier, []))
        self._core.holdings.lose(
            identifier, "the permit relayed to it was gone: its previous holder's lease had run out"
        )

    def _lease_end(self, holder: str) -> float:
        """When the lease of a relayed permit may run out, as last confirmed (loop time)."""
        lease_from, lease = self._leases.get(holder, (-math.inf, 0.0))
        return lease_from + lease

    def _watch_runs(self) -> None:
        """Look at the runs again when the earliest of their holders' leases may have run out."""
        if self._run_timer is None and self._runs:
            at = min(self._lease_end(holder) for holder in self._runs) + RECHECK_DELAY
            self._run_timer = asyncio.get_running_loop().call_at(at, self._check_runs)

    def _check_runs(self) -> None:
        """End the runs whose holder's lease may have run out: Redis may have reaped it, and will not tell."""
        self._run_timer = None
        now = asyncio.get_running_loop().time()
        for holder in list(self._runs):
            if self._lease_end(holder) <= now:
                self._end_run(self._runs.pop(holder))
        self._watch_runs()

    def _end_run(self, run: Sequence[tuple[str, int]]) -> None:
        """Stop relaying to ``run``, whose waiters the permit may not reach: ask Redis at once who holds now.

        They are queued in Redis still, in their places, and Redis hands
        the permit on to the first of them when it frees.
        """
        if run:
            self._core.queue.recheck_now()

    def close(self) -> None:
        """Relay to nobody any more: the object is closing, and its waiters failed."""
        self._runs.clear()
        if self._run_timer is not None:
            self._run_timer.cancel()
            self._run_timer = None

    def take(self, identifiers: Sequence[str]) -> list[str]:
        """Of ``identifiers``, those holding a relayed mutex, which stop holding it here (their release passes it)."""
        relayed = [identifier for identifier in identifiers if identifier in self._leases]
        for identifier in relayed:
            del self._leases[identifier]
        return relayed
