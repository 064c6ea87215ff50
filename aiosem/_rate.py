"""`AsyncRateLimiter`: so many calls per time window, shared through Redis (GCRA)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Final

import anyio
import redis
import redis.exceptions

from ._connection import address, let_go_of, watch_eviction_policy
from ._coordination import LaneOfLoop, Submission, clean_up
from ._exceptions import AcquireTimeout, out_of_memory, step_failure
from ._keys import SemaphoreKeys, check_prefix
from ._observing import emit, log_fields
from ._options import DEFAULT, DEFAULT_PREFIX, RateLimiterOptions, _Default, refuse_unknown
from ._scripts import RATE_ACQUIRE
from ._timing import SHORTEST_STEP_BOUND, Bound
from ._validation import check_callable, check_client, check_cost, check_name, check_now, check_rate, check_wait

if TYPE_CHECKING:
    from collections.abc import Awaitable, Sequence
    from types import TracebackType

    from typing_extensions import Unpack

    from ._connection import Client


__all__ = ["AsyncRateLimiter"]

logger = logging.getLogger("aiosem")

_MICROSECONDS: Final = 1_000_000


class AsyncRateLimiter:
    """At most ``rate`` calls per ``per`` seconds, shared through Redis, in arrival order.

    Like `aiolimiter.AsyncLimiter`, but the count lives in Redis, so every
    process using the same name and Redis shares one rate:

        api = AsyncRateLimiter(redis, "api", rate=5, per=1.0)   # 5 calls a second
        async with api:
            await call_the_api()

    It is GCRA, the generic cell rate algorithm: one key holds the
    *theoretical arrival time*, and each call, in one atomic script on the
    server's clock, reserves the next slot -- one emission interval
    (``per / rate``) after the last -- and is told how long until it. The
    caller then sleeps once, exactly that long: no polling, and callers are
    served in the order their calls reached Redis. ``burst`` slots may be
    taken at once by a limiter that was at rest. The key expires when the
    limiter comes to rest: nothing is stored per call, nor for an idle name.

    A call may cost more than one slot -- a batch of 50 items against a
    quota of items -- with ``acquire(cost=50)``: it reserves its 50 slots
    in one step, and comes once no more than ``burst`` slots' worth of
    reservations, its own included, lie ahead. Costly and cheap calls keep
    the order in which they reached Redis.

    Its keyword options (`RateLimiterOptions`, each described below) are
    ``burst``, ``blocking_timeout``, ``prefix`` and ``clock``.

    Args:
        client: A ``redis.asyncio.Redis`` client; the limiter borrows it.
        name: The limiter's name: any non-empty string. Its key shares the
            hash tag of the semaphore of the same name.
        rate: How many calls per ``per`` seconds (a positive number).
        per: The window, in seconds (positive; default 1).

    Raises:
        TypeError: An argument has the wrong type (the message names it).
        ValueError: An argument is out of range (the message names it).
    """

    __slots__ = (
        "_blocking_timeout",
        "_burst",
        "_client",
        "_clock",
        "_interval_us",
        "_key",
        "_lane",
        "_name",
        "_per",
        "_rate",
    )

    def __init__(
        self, client: Client, name: str, rate: float, per: float = 1.0, **options: Unpack[RateLimiterOptions]
    ) -> None:
        refuse_unknown(options, RateLimiterOptions, "AsyncRateLimiter.__init__")
        self._name = check_name(name)
        self._rate, self._per, self._burst = check_rate(rate, per, options.get("burst", 1))
        self._blocking_timeout = check_wait(options.get("blocking_timeout"))
        self._key = SemaphoreKeys.for_name(check_prefix(options.get("prefix", DEFAULT_PREFIX)), name).rate
        self._clock = check_callable(options.get("clock"), "clock")
        self._client = check_client(client)
        self._interval_us = max(1, round(self._per / self._rate * _MICROSECONDS))
        #: The calls of the object's tasks go to Redis together, a batch at a time, in its event loop's lane.
        self._lane: LaneOfLoop[None] = LaneOfLoop(self._run_batch, self._failure)

    @property
    def name(self) -> str:
        """The limiter's name."""
        return self._name

    @property
    def rate(self) -> float:
        """How many calls per ``per`` seconds."""
        return self._rate

    @property
    def per(self) -> float:
        """The window, in seconds."""
        return self._per

    @property
    def burst(self) -> int:
        """How many calls an idle limiter lets through at once."""
        return self._burst

    @property
    def blocking_timeout(self) -> float | None:
        """How long `acquire` and ``async with`` wait by default (``None``: for ever)."""
        return self._blocking_timeout

    @property
    def key(self) -> str:
        """The Redis key the limiter's state lives under (while it is not at rest)."""
        return self._key

    def __repr__(self) -> str:
        return (
            f"AsyncRateLimiter(name={self._name!r}, rate={self._rate:g}, per={self._per:g}, burst={self._burst}, "
            f"blocking_timeout={self._blocking_timeout!r}, key={self._key!r})"
        )

    async def _run(self, mode: str, argument: str, cost: int = 1) -> tuple[bool, float, int]:
        """One call of the script, with the calls made meanwhile: granted, the wait in seconds, and the TAT after it.

        Cancellation:
            Raised at once; a call already sent goes on, and what it took is lost to the caller.
        """
        call = _Call(mode, argument, cost)
        return _outcome(await self._send(call))

    def _send(self, call: _Call) -> asyncio.Future[tuple[Sequence[int], None]]:
        """Have ``call`` go with the lane's next batch: its answer, which cancelled before it is sent leaves it out."""
        loop = asyncio.get_running_loop()
        answer = call.answer = loop.create_future()
        self._lane.of(loop).enqueue(call, loop)
        return answer

    async def _run_batch(self, arguments: Sequence[str], waiting_since: float | None) -> tuple[Sequence[int], None]:
        """Run the calls of a batch -- each its mode, argument and cost -- in one script, in order."""
        now = "" if self._clock is None else repr(check_now(self._clock(), "clock()"))
        tolerance = (self._burst - 1) * self._interval_us
        spent = 0.0 if waiting_since is None else asyncio.get_running_loop().time() - waiting_since
        with Bound(SHORTEST_STEP_BOUND, f"a step of rate limiter {self._name!r}", spent=spent):
            try:
                replies = await RATE_ACQUIRE.run(
                    self._client, (self._key,), (now, self._interval_us, tolerance, *arguments)
                )
            except redis.exceptions.OutOfMemoryError as error:
                raise out_of_memory(error, self._name, "rate limiter") from None
        return [int(value) for value in replies], None

    def _failure(self, error: Exception) -> BaseException:
        """What each caller of a failed batch raises: see `step_failure`."""
        return step_failure(error, self._name, address(self._client), "rate limiter")

    async def acquire(
        self, blocking: bool = True, blocking_timeout: float | _Default | None = DEFAULT, *, cost: int = 1
    ) -> bool:
        """Take a slot -- or ``cost`` slots at once -- waiting for it if ``blocking``.

        One call to Redis reserves the next slot and says when it comes; the
        call then sleeps until then, once. A slot further away than
        ``blocking_timeout`` is not reserved, and the call returns ``False``
        at once: it would only have waited to fail.

        A call that costs more -- a batch API call of 50 items against a
        quota of items -- takes its ``cost`` slots in the same one step:

            if await api.acquire(cost=len(batch)):
                await send(batch)

        It comes once at most ``burst`` slots' worth of reservations, its
        own included, lie ahead: from rest, a call of cost ``burst`` passes
        at once, and the next call waits as if ``burst`` calls of cost 1
        had passed. Reservations keep the order in which they reached
        Redis, whatever their cost.

        Args:
            blocking: Wait for the slots; with ``False``, take them only if
                they are free now.
            blocking_timeout: How long to wait at most, in seconds; ``None``
                or infinity waits for ever. Defaults to the limiter's.
            cost: How many slots the call takes: an int from 1 (the
                default) to ``burst``.

        Returns:
            ``True`` once the slots have come; ``False`` if they could not
            be had in time.

        Raises:
            TypeError: ``blocking_timeout`` is not a number, or ``cost`` not
                an int.
            ValueError: ``blocking_timeout`` is negative or NaN; ``cost`` is
                below 1, or above ``burst`` (it could never be granted).
                Either is raised before anything is sent to Redis.
            OutOfMemory: Redis's memory is full and it refused the
                reservation, which took nothing.
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            Raised at once, wherever it lands. The slots of a cancelled call
            -- taken, or their reservation still on its way to Redis -- are
            given back, all ``cost`` of them (shielded, bounded to 5 s), if
            nobody reserved any after them, so a cancelled caller does not
            slow the others down.
        """
        wait = self._blocking_timeout if blocking_timeout is DEFAULT else check_wait(blocking_timeout)
        cost = check_cost(cost, self._burst)
        started = time.monotonic()
        watch_eviction_policy(self._client, self._key)
        if not blocking:
            granted, delay, tat = await self._reserve("try", "", cost)
        else:
            longest = "" if wait is None else str(math.floor(wait * _MICROSECONDS))
            granted, delay, tat = await self._reserve("reserve", longest, cost)
        if granted and delay > 0:
            await self._sleep_until_slot(delay, tat, cost)
        emit("acquired" if granted else "timed_out", "rate", self._name, time.monotonic() - started, cost=cost)
        return granted

    async def _reserve(self, mode: str, argument: str, cost: int) -> tuple[bool, float, int]:
        """Take or reserve ``cost`` slots; a caller cancelled once they were sent gives them back.

        The call runs in the lane's task, so that a cancellation never cuts
        it off: the caller hears of it at once, once the slots the call took,
        if it took them, are given back.
        """
        call = _Call(mode, argument, cost)
        answer = self._send(call)
        try:
            return _outcome(await asyncio.shield(answer))
        except asyncio.CancelledError:
            if call.sent:
                await self._give_back(self._slots_of(answer, cost))
            else:
                answer.cancel()  # left out of its batch
            raise

    async def _slots_of(self, answer: asyncio.Future[tuple[Sequence[int], None]], cost: int) -> None:
        """Give back the ``cost`` slots the call ``answer`` answers took, if it took them."""
        try:
            granted, _, tat = _outcome(await answer)
        except redis.RedisError:
            return  # nothing was taken
        if granted:
            await self._run("return", str(tat), cost)

    async def _sleep_until_slot(self, delay: float, tat: int, cost: int) -> None:
        """Sleep until the reserved slots come; give them back if cancelled meanwhile."""
        try:
            await anyio.sleep(delay)
        except BaseException:
            await self._give_back(self._run("return", str(tat), cost))
            raise

    async def _give_back(self, call: Awaitable[object]) -> None:
        """Run ``call``, which gives back the slot of a cancelled call if nobody reserved one after it, to its end."""
        await clean_up(call, name=f"giving back a slot of {self!r}", failed=self._could_not_give_back)

    def _could_not_give_back(self) -> None:
        logger.warning(
            "could not give back the slot of a cancelled wait on %r",
            self,
            exc_info=True,
            extra=log_fields(self._name),
        )

    async def try_acquire(self, *, cost: int = 1) -> bool:
        """Take a slot (or ``cost`` slots) if free now, without waiting; the same as ``acquire(blocking=False)``."""
        return await self.acquire(blocking=False, cost=cost)

    async def aclose(self) -> None:
        """Give back at once the connection the limiter's last calls left parked for the next ones.

        A limiter holds no slot; its calls, like a semaphore's steps, leave
        their connection parked for up to 0.1 s for the next calls of the
        event loop (see the design page), and a client's first call starts
        a look at the server's eviction policy in the background, which
        `aclose` ends (it is asked again on the next call). After `aclose`,
        a client closed at once finds every connection back in its pool,
        and nothing of aiosem's opens one again. The limiter can still be
        used.
        """
        await let_go_of(self._client)

    async def __aenter__(self) -> None:
        """Wait for a slot, up to ``blocking_timeout``.

        Raises:
            AcquireTimeout: No slot within ``blocking_timeout``.
            OutOfMemory: Redis's memory is full and it refused the
                reservation, which took nothing.
            redis.RedisError: Redis failed or could not be reached.
        """
        await self._enter(1)

    async def _enter(self, cost: int) -> None:
        """Wait for ``cost`` slots, up to ``blocking_timeout``, as ``async with`` does for one (and `rate_limiter`)."""
        if not await self.acquire(cost=cost):
            assert self._blocking_timeout is not None  # noqa: S101 -- only a bounded wait gives up
            raise AcquireTimeout(name=self._name, blocking_timeout=self._blocking_timeout, what="slot of rate limiter")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Nothing: a slot, once come, is used."""


class _Call(Submission[None]):
    """One call of the rate script in its limiter's lane: its mode, argument and cost, three of the batch's arguments.

    The lane answers it with three values: granted (1 or 0), the wait in
    microseconds, and the TAT the call left.
    """

    __slots__ = ()

    def __init__(self, mode: str, argument: str, cost: int) -> None:
        super().__init__((mode, argument, str(cost)))


def _outcome(answer: tuple[Sequence[int], None]) -> tuple[bool, float, int]:
    """A call's answer as its caller takes it: granted, the wait in seconds, and the TAT after it."""
    (granted, wait, tat), _ = answer
    return granted == 1, wait / _MICROSECONDS, tat
