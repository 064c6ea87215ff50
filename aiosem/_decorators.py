"""Limits by name, with no object to create or pass around.

`limit_concurrency` and `limiter` limit how many calls run at once (a
semaphore); `limit_rate` and `rate_limiter` how often they start (a rate
limiter). All four find the object of a call in the running event loop's
cache (`aiosem._loop_cache`), creating it on first use with the settings of the
call -- its own arguments, then `configure`'s -- and count it in use while
the call holds or waits, so that it is never evicted from under it. A rate
limiter is in use only while a call waits for its slot: it holds nothing
afterwards.

Both decorators are one `_Decorator`: each call enters a per-call guard --
the limiter of its name -- around the function; an async generator's guard
is entered at its first ``__anext__`` and left when it ends.

A coroutine function's call holds its permit through the semaphore's own
``async with``: kept alive in the background, its body cancelled if the
permit is lost. An async generator outlives any one task -- each
``__anext__`` may come from another one, and its ``aclose`` from the event
loop's finalizer -- so its permit is taken with ``auto_refresh`` instead,
given back when the generator ends, and a loss stops it at its next yield.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any, ClassVar, ParamSpec, TypeVar, overload

from ._declarations import LIMITS, RATES
from ._exceptions import AcquireTimeout, PermitLost
from ._loop_cache import Entry, checkout
from ._observing import log_fields
from ._options import LimiterOptions, RateByNameOptions, refuse_unknown
from ._specs import RateSpec, SemaphoreSpec, rate_spec, semaphore_spec
from ._task_stack import TaskStack
from ._validation import check_cost, check_name, check_weight

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
    from contextlib import AbstractAsyncContextManager
    from types import TracebackType

    from typing_extensions import Unpack

    from ._options import LostCallback
    from ._permit import Permit
    from ._specs import Semaphore

__all__ = ["current_permit", "limit_concurrency", "limit_rate", "limiter", "rate_limiter"]

logger = logging.getLogger("aiosem")

P = ParamSpec("P")
R = TypeVar("R")
Y = TypeVar("Y")
S = TypeVar("S")


#: The limiters the current task is inside, innermost last, each with the
#: cached object it entered and its permit. Tasks sharing one limiter never
#: see each other's.
_entered: TaskStack[_Limiter, tuple[Entry[Semaphore], Permit]] = TaskStack("aiosem_limiters")


class _Limiter:
    """The async context manager `limiter` returns; reusable, and shareable between tasks."""

    __slots__ = ("_name", "_options", "_weight")

    def __init__(self, name: str, options: SemaphoreSpec, weight: int = 1) -> None:
        self._name = name
        self._options = options
        self._weight = weight

    def __repr__(self) -> str:
        weight = "" if self._weight == 1 else f", weight={self._weight}"
        return f"limiter({self._name!r}, limit={self._options.limit!r}{weight})"

    async def __aenter__(self) -> Permit:
        entry = await checkout(self._name, self._options)
        try:
            permit = await entry.cached._enter(self._weight)  # noqa: SLF001 -- the semaphore's own async with, weighed
        except BaseException:
            entry.state.checkin(entry)
            raise
        _entered.push(self, (entry, permit))
        return permit

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        entry, _ = _entered.pop(self)
        try:
            await entry.cached.__aexit__(exc_type, exc, traceback)
        finally:
            entry.state.checkin(entry)


def current_permit(name: str | None = None) -> Permit:
    """Return the permit the current task holds through a limiter or a decorated call.

    A function decorated with `limit_concurrency` does not see its permit;
    this is how it gets it -- for its fencing token, say:

        @aiosem.limit_concurrency("db", 3)
        async def write(row: int, value: str) -> None:
            token = aiosem.current_permit().fencing_token
            await db.execute("UPDATE t SET v = $2, fence = $3 WHERE id = $1 AND fence <= $3", row, value, token)

    Args:
        name: The semaphore's name (for a per-key decorator, the name of
            this call); ``None``: the innermost block the task is in.

    Returns:
        The permit of the innermost matching `limiter` block or call of a
        coroutine function decorated with `limit_concurrency`, in the
        current task. (An async generator's permit is not the current
        task's: each ``__anext__`` may come from another task.)

    Raises:
        LookupError: The current task holds no such permit.
    """
    for held, (_, permit) in _entered.innermost_first():
        if name is None or held._name == name:  # noqa: SLF001 -- _Limiter is this module's
            return permit
    what = "a limiter" if name is None else f"a limiter named {name!r}"
    raise LookupError(f"the current task is not inside {what} or a call decorated with limit_concurrency")


def limiter(
    name: str, limit: int | None = None, *, weight: int = 1, **options: Unpack[LimiterOptions]
) -> AbstractAsyncContextManager[Permit]:
    """Limit a block of code by a semaphore's name.

    Like entering a semaphore with ``async with``, without creating or
    passing one around: every block entered with the same name, and the
    same Redis and prefix, shares one limit, across every process.

        async with aiosem.limiter("api", 5) as permit:
            await call_api(fencing_token=permit.fencing_token)

    The limit comes from the ``limit`` argument, else from
    ``configure(limits=...)``, else from a `limit_concurrency` decorator
    with the same (fixed) name created earlier in this process, else from
    Redis: the limit in force there (see `AsyncFairSemaphore.set_limit`).
    A limit set in Redis wins over all of them. Every argument left out is
    read from `configure` when the block is entered.
    The returned object can be kept and entered again, by any number of
    tasks at once, each with a permit of its own.

    While the block runs, its permit is kept alive in the background; if it
    is lost anyway, the block is cancelled and `PermitLost` raised (with
    ``on_lost``, the callback is called instead and the block runs on).
    Do not hold a limiter across the ``yield`` of an async generator: the
    block would belong to whichever task resumes the generator. Decorate
    the generator function with `limit_concurrency` instead.

    Args:
        name: The semaphore's name.
        limit: How many permits may be held at once; ``None``: configured,
            declared by a decorator, or else the one in force in Redis.
        weight: What the block's permit counts for against the limit: an
            int from 1 (the default) to the limit in force (see
            `AsyncFairSemaphore.acquire`).
        **options: The semaphore's options (`LimiterOptions`):
            ``timeout``, ``blocking_timeout``, ``client``, ``prefix``,
            ``kind``, ``waiter_timeout``, ``refresh_interval``, ``on_lost``,
            ``label``; each left out (or ``None``) is read from `configure`.

    Returns:
        An async context manager whose value is the `Permit`.

    Raises:
        TypeError: An argument has the wrong type (raised at once).
        ValueError: An argument is out of range (raised at once).
        LookupError: On entering: decorators declare different limits
            for ``name``, and none is given or configured; or
            (`LimitNotSet`) no limit for ``name`` anywhere, Redis included.
        AcquireTimeout: On entering: no permit within ``blocking_timeout``.
        PermitLost: On leaving: the permit was lost while the block ran.
        RuntimeError: On entering: nothing is configured and this process
            looks like one of several workers (see `configure`).
        redis.RedisError: Redis failed or could not be reached.

    Cancellation:
        As ``async with`` a semaphore: a cancelled wait leaves nothing
        behind, and leaving the block gives the permit back, shielded from
        cancellation and bounded to 5 s.
    """
    refuse_unknown(options, LimiterOptions, "limiter")
    return _Limiter(check_name(name), semaphore_spec(limit, options), check_weight(weight))


class _Loss:
    """How a generator's permit, kept alive, tells of its loss; it refers to nothing of the generator."""

    __slots__ = ("lost", "on_lost")

    def __init__(self, on_lost: LostCallback | None) -> None:
        self.on_lost = on_lost
        self.lost: PermitLost | None = None

    def __call__(self, lost: PermitLost) -> None:
        self.lost = lost
        if self.on_lost is not None:
            self.on_lost(lost)

    def check(self) -> None:
        """Raise the loss, unless a callback was told of it (then it is raised at the end)."""
        if self.lost is not None and self.on_lost is None:
            raise self.lost


class _GeneratorHold:
    """Hold a permit for an async generator's life, in whichever tasks drive it.

    The permit is kept alive with ``auto_refresh``, not by a cancel scope:
    the generator's body runs only while someone awaits its ``__anext__``,
    and nobody may be cancelled for a loss between two of them.
    """

    __slots__ = ("_entry", "_loss", "_name", "_options", "_permit", "_weight")

    def __init__(self, name: str, options: SemaphoreSpec, weight: int) -> None:
        self._name = name
        self._options = options
        self._weight = weight
        self._loss = _Loss(options.on_lost)
        self._entry: Entry[Semaphore] | None = None
        self._permit: Permit | None = None

    async def __aenter__(self) -> _Loss:
        self._entry = entry = await checkout(self._name, self._options)
        semaphore = entry.cached
        try:
            self._permit = await semaphore.acquire(weight=self._weight, auto_refresh=True, on_lost=self._loss)
        except BaseException:
            entry.state.checkin(entry)
            raise
        if self._permit is None:
            entry.state.checkin(entry)
            assert semaphore.blocking_timeout is not None  # noqa: S101 -- only a bounded wait gives up
            raise AcquireTimeout(name=semaphore.name, blocking_timeout=semaphore.blocking_timeout)
        return self._loss

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Give the permit back, shielded; raise `PermitLost` if it was lost and nothing else is raised."""
        entry, permit = self._entry, self._permit
        assert entry is not None  # noqa: S101 -- entered
        assert permit is not None  # noqa: S101 -- entered
        try:
            await self._give_back(entry.cached, permit, exc_type, exc)
        finally:
            entry.state.checkin(entry)

    async def _give_back(
        self, semaphore: Semaphore, permit: Permit, exc_type: type[BaseException] | None, exc: BaseException | None
    ) -> None:
        lost = await semaphore._core.holdings.end(permit, self._loss.lost, exc)  # noqa: SLF001 -- the semaphore's own ending
        if lost is None or lost is exc:
            return
        if exc is None:
            raise lost
        logger.warning(
            "%s was lost before its generator ended with %s",
            permit,
            exc_type.__name__ if exc_type else exc,
            extra=log_fields(permit.name, permit.identifier),
        )


class _RateLimiter:
    """The async context manager `rate_limiter` returns; reusable, and shareable between tasks.

    Entering it waits for its ``cost`` slots; leaving it does nothing: a
    slot, once come, is used.
    """

    __slots__ = ("_cost", "_name", "_options")

    def __init__(self, name: str, options: RateSpec, cost: int) -> None:
        self._name = name
        self._options = options
        self._cost = cost

    def __repr__(self) -> str:
        cost = "" if self._cost == 1 else f", cost={self._cost}"
        return f"rate_limiter({self._name!r}, rate={self._options.rate!r}{cost})"

    async def __aenter__(self) -> None:
        entry = await checkout(self._name, self._options)
        try:
            await entry.cached._enter(self._cost)  # noqa: SLF001 -- the limiter's own async with, at a cost
        finally:
            entry.state.checkin(entry)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        pass


class _Decorator:
    """What `limit_concurrency` and `limit_rate` share: the wrapping, and the name of a call.

    A subclass says what a call enters around the function (`_guard`) and
    what an async generator enters around its life (`_generator_guard`,
    whose value, if not ``None``, is checked at each ``yield``).
    """

    __slots__ = ("_name",)
    #: The decorator's public name, for messages.
    _decorator: ClassVar[str]

    def __init__(self, name: str | Callable[..., str]) -> None:
        self._name = name

    def _guard(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AbstractAsyncContextManager[object]:
        raise NotImplementedError

    def _generator_guard(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AbstractAsyncContextManager[_Loss | None]:
        raise NotImplementedError

    @overload
    def __call__(self, function: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __call__(self, function: Callable[P, AsyncGenerator[Y, S]]) -> Callable[P, AsyncGenerator[Y, S]]: ...
    @overload
    def __call__(self, function: Callable[P, AsyncIterator[Y]]) -> Callable[P, AsyncIterator[Y]]: ...
    def __call__(self, function: Callable[P, Any]) -> Callable[P, Any]:
        if inspect.isasyncgenfunction(function):
            return self._generator(function)
        if inspect.iscoroutinefunction(function):
            return self._coroutine(function)
        raise TypeError(
            f"{self._decorator} decorates async def functions and async generator functions; "
            f"{getattr(function, '__qualname__', function)!r} is neither (a synchronous function "
            "would block its event loop while it waits)"
        )

    def _key(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The name of the semaphore or rate limiter of one call."""
        if isinstance(self._name, str):
            return self._name
        name = self._name(*args, **kwargs)
        if not isinstance(name, str):
            raise TypeError(
                f"the name function of @{self._decorator} on {function.__qualname__} must return a str, "
                f"not {type(name).__name__}"
            )
        if not name:
            raise ValueError(f"the name function of @{self._decorator} on {function.__qualname__} returned ''")
        return name

    def _coroutine(self, function: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        @functools.wraps(function)
        async def limited(*args: P.args, **kwargs: P.kwargs) -> R:
            async with self._guard(function, args, kwargs):
                return await function(*args, **kwargs)

        return limited

    def _generator(self, function: Callable[P, AsyncGenerator[Y, S]]) -> Callable[P, AsyncGenerator[Y, S]]:
        @functools.wraps(function)
        async def limited(*args: P.args, **kwargs: P.kwargs) -> AsyncGenerator[Y, S]:
            async with self._generator_guard(function, args, kwargs) as loss:
                generator = function(*args, **kwargs)
                try:
                    # Forward what the consumer sends and throws, as
                    # `yield from` would; a loss stops it at a yield.
                    step: Awaitable[Y] = generator.asend(None)  # type: ignore[arg-type]
                    while True:
                        try:
                            value = await step
                        except StopAsyncIteration:
                            return
                        if loss is not None:
                            loss.check()
                        try:
                            sent = yield value
                        except GeneratorExit:
                            raise
                        except BaseException as thrown:  # noqa: BLE001 -- athrow() is forwarded, whatever it is
                            step = generator.athrow(thrown)
                        else:
                            step = generator.asend(sent)
                finally:
                    await generator.aclose()

        return limited


class _ConcurrencyLimit(_Decorator):
    """The decorator `limit_concurrency` returns: a call holds a permit while it runs."""

    __slots__ = ("_options", "_weight")
    _decorator = "limit_concurrency"

    def __init__(
        self, name: str | Callable[..., str], options: SemaphoreSpec, weight: int | Callable[..., int]
    ) -> None:
        super().__init__(name)
        self._options = options
        self._weight = weight

    def __repr__(self) -> str:
        weight = "" if self._weight == 1 else f", weight={self._weight!r}"
        return f"limit_concurrency({self._name!r}, limit={self._options.limit!r}{weight})"

    def _weight_of(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """What one call's permit weighs: the fixed weight, or what the weight function says of its arguments."""
        if isinstance(self._weight, int):
            return self._weight
        try:
            return check_weight(self._weight(*args, **kwargs))
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"the weight function of @limit_concurrency on {function.__qualname__}: {error}"
            ) from None

    def _guard(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AbstractAsyncContextManager[object]:
        # The semaphore's own ``async with``: the permit is kept alive, the
        # call cancelled if it is lost.
        return _Limiter(self._key(function, args, kwargs), self._options, self._weight_of(function, args, kwargs))

    def _generator_guard(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AbstractAsyncContextManager[_Loss | None]:
        return _GeneratorHold(self._key(function, args, kwargs), self._options, self._weight_of(function, args, kwargs))


class _RateLimit(_Decorator):
    """The decorator `limit_rate` returns: a call starts once its slots have come."""

    __slots__ = ("_cost", "_options")
    _decorator = "limit_rate"

    def __init__(self, name: str | Callable[..., str], options: RateSpec, cost: int | Callable[..., int]) -> None:
        super().__init__(name)
        self._options = options
        self._cost = cost

    def __repr__(self) -> str:
        cost = "" if self._cost == 1 else f", cost={self._cost!r}"
        return f"limit_rate({self._name!r}, rate={self._options.rate!r}{cost})"

    def _cost_of(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """How many slots one call takes: the fixed cost, or what the cost function says of its arguments."""
        if isinstance(self._cost, int):
            return self._cost
        cost = self._cost(*args, **kwargs)
        burst = None if self._options.rate is None else self._options.rate.burst
        try:
            return check_cost(cost, burst)
        except (TypeError, ValueError) as error:
            raise type(error)(f"the cost function of @limit_rate on {function.__qualname__}: {error}") from None

    def _guard(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AbstractAsyncContextManager[object]:
        return _RateLimiter(self._key(function, args, kwargs), self._options, self._cost_of(function, args, kwargs))

    def _generator_guard(
        self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AbstractAsyncContextManager[_Loss | None]:
        return _RateLimiter(self._key(function, args, kwargs), self._options, self._cost_of(function, args, kwargs))


def limit_concurrency(
    name: str | Callable[..., str],
    limit: int | None = None,
    *,
    weight: int | Callable[..., int] = 1,
    **options: Unpack[LimiterOptions],
) -> _ConcurrencyLimit:
    """Limit how many calls of an async function run at once, across every process.

    Each call takes a permit of the semaphore ``name`` before it starts and
    gives it back when it ends; every function decorated with the same name,
    and every `limiter` of it, share one limit.

        @aiosem.limit_concurrency("db", 3)
        async def query(sql: str) -> list[Row]: ...

    ``name`` may be a function of the call's arguments -- the same
    arguments, ``self`` included for a method -- returning the name, to
    limit each key on its own:

        @aiosem.limit_concurrency(lambda url: f"host:{urlsplit(url).hostname}", 3)
        async def fetch(url: str) -> bytes: ...  # 3 at once per host

    A call may weigh more than one: ``weight`` is a fixed int, or a function
    of the call's arguments returning one, and the call's permit counts
    that much against the limit (see `AsyncFairSemaphore.acquire`):

        @aiosem.limit_concurrency("db", 10, weight=lambda sql, report=False: 5 if report else 1)
        async def query(sql: str, report: bool = False) -> list[Row]: ...

    A weight function's result is checked at each call: a call whose
    weight is not an int from 1 up raises `TypeError` or `ValueError`
    before anything is sent; one above the limit in force raises
    `ValueError` at once, having taken nothing.

    Each event loop keeps the semaphore objects it created: those in use,
    and the 1024 idle ones used most recently; so a crawler meeting a
    hundred thousand hosts keeps about as many objects as it has calls in
    flight.

    The decorated function keeps its signature and type. It may be an
    ``async def`` function or method -- the permit is held for the call --
    or an async generator function: the permit is taken at the first
    ``__anext__`` and held, kept alive in the background, until the
    generator is exhausted, raises or is closed. A generator abandoned
    unclosed holds it until the event loop finalizes it (at once in
    CPython, once nothing refers to it), and its lease runs out at most
    ``timeout`` after the loop stops.

    A fixed ``name`` with a ``limit`` declares that limit for a `limiter`
    of the same name given none. Arguments left out are read from
    `configure` at each call; the limit too, when ``limit`` is ``None``
    (and if none is configured, the one in force in Redis). A limit set in
    Redis (see `AsyncFairSemaphore.set_limit`) wins over ``limit``.

    A call of the decorated function raises what the function raises, and:
    `LookupError` if no limit is known for its name (`LimitNotSet`: not
    even in Redis), `AcquireTimeout` if no
    permit came within ``blocking_timeout``, `PermitLost` if the permit was
    lost while the call ran (the call is cancelled at once; an async
    generator stops at its next ``yield``), `RuntimeError` if nothing is
    configured in a process that looks like one of several workers (see
    `configure`), and ``redis.RedisError`` if Redis failed.

    Args:
        name: The semaphore's name, or a function of the call's arguments
            returning it.
        limit: How many calls may hold a permit at once; ``None``: the
            one ``configure(limits=...)`` gives for the name, or else the
            one in force in Redis.
        weight: What a call's permit counts for against the limit: an int
            from 1 (the default) to the limit in force, or a function of
            the call's arguments returning one.
        **options: The semaphore's options (`LimiterOptions`):
            ``timeout``, ``blocking_timeout``, ``client``, ``prefix``,
            ``kind``, ``waiter_timeout``, ``refresh_interval``, ``on_lost``
            (`PermitLost` is then still raised when the call ends),
            ``label``; each
            left out (or ``None``) is read from `configure` at each call.

    Returns:
        The decorator.

    Raises:
        TypeError: An argument has the wrong type; or, from the decorator,
            the function is not an ``async def`` or async generator
            function.
        ValueError: An argument is out of range.

    Cancellation:
        A call cancelled while it waits leaves nothing behind; one
        cancelled while it runs gives its permit back, shielded from the
        cancellation and bounded to 5 s, before the cancellation
        propagates. So does a generator closed or cancelled mid-way.
    """
    if not (isinstance(name, str) or callable(name)):
        raise TypeError(f"name must be a str or a function returning one, not {type(name).__name__}")
    refuse_unknown(options, LimiterOptions, "limit_concurrency")
    checked = semaphore_spec(limit, options)
    if not (isinstance(weight, int) or callable(weight)):
        raise TypeError(f"weight must be an int or a function returning one, not {type(weight).__name__}")
    if not callable(weight):
        weight = check_weight(weight)
    if isinstance(name, str):
        check_name(name)
        if checked.limit is not None:
            LIMITS.declare(name, checked.limit)
    return _ConcurrencyLimit(name, checked, weight)


def limit_rate(
    name: str | Callable[..., str],
    rate: float | None = None,
    per: float | None = None,
    *,
    cost: int | Callable[..., int] = 1,
    **options: Unpack[RateByNameOptions],
) -> _RateLimit:
    """Limit how often calls of an async function start, across every process.

    Each call waits for a slot of the rate limiter ``name`` -- an
    `AsyncRateLimiter`: at most ``rate`` calls per ``per`` seconds, in
    arrival order -- and then runs; there is nothing to give back when it
    ends. Every function decorated with the same name, and every
    `rate_limiter` of it, share one rate.

        @aiosem.limit_rate("api", 5)  # 5 calls a second
        async def call_api(query: str) -> dict[str, object]: ...

    ``name`` may be a function of the call's arguments returning the name,
    to limit each key on its own, as with `limit_concurrency`. Stacked
    with it, put `limit_concurrency` on top, so that a call takes its
    permit first and starts as soon as its slot comes:

        @aiosem.limit_concurrency(host_of, 3)
        @aiosem.limit_rate(host_of, 1, per=2)  # robots.txt: Crawl-delay: 2
        async def fetch(url: str) -> bytes: ...

    A call that costs more than one -- a batch of items against a quota of
    items -- takes ``cost`` slots at once; ``cost`` may be a function of the
    call's arguments, as ``name`` may:

        @aiosem.limit_rate("geocoder", 100, burst=100, cost=len)  # 100 addresses a second
        async def geocode(addresses: list[str]) -> list[Point]: ...

    The decorated function keeps its signature and type. It may be an
    ``async def`` function or method, or an async generator function, which
    takes its slots once, at its first ``__anext__``.

    ``rate``, ``per`` and ``burst`` go together: with ``rate``, ``per``
    defaults to 1 s and ``burst`` to 1; without it, all three come from
    ``configure(rates=...)``, read at each call. A fixed ``name`` with a
    ``rate`` declares that rate for a `rate_limiter` of the same name given
    none. Rate limiting runs a Lua script whatever ``kind`` is configured.

    A call of the decorated function raises what the function raises, and:
    `LookupError` if no rate is known for its name, `AcquireTimeout` if its
    slot would come later than ``blocking_timeout`` (it then fails at once,
    having reserved nothing), `TypeError` or `ValueError` if its cost is
    not an int from 1 to the rate's ``burst`` (before anything is sent to
    Redis), `RuntimeError` if nothing is configured in a process that looks
    like one of several workers (see `configure`), and
    ``redis.RedisError`` if Redis failed.

    Args:
        name: The rate limiter's name, or a function of the call's
            arguments returning it. A semaphore of the same name is
            another object, with keys in the same Cluster slot.
        rate: How many calls may start per ``per`` seconds; ``None``: the
            rate ``configure(rates=...)`` gives for the name.
        per: The window in seconds (default 1); only with ``rate``.
        cost: How many slots each call takes (default 1), or a function of
            the call's arguments returning it: an int from 1 to ``burst``.
        **options: The rate limiter's options (`RateByNameOptions`):
            ``burst``, ``blocking_timeout``, ``client``, ``prefix``; each
            left out (or ``None``) is read from `configure` at each call.

    Returns:
        The decorator.

    Raises:
        TypeError: An argument has the wrong type; or, from the decorator,
            the function is not an ``async def`` or async generator
            function.
        ValueError: An argument is out of range, ``per`` or ``burst`` was
            given without ``rate``, or a fixed ``cost`` is above the
            ``burst`` given (it could never be granted).

    Cancellation:
        A call cancelled while it waits for its slots gives them back if
        nobody reserved any after it (see `AsyncRateLimiter.acquire`);
        once the call runs, there is nothing to give back.
    """
    if not (isinstance(name, str) or callable(name)):
        raise TypeError(f"name must be a str or a function returning one, not {type(name).__name__}")
    refuse_unknown(options, RateByNameOptions, "limit_rate")
    checked = rate_spec(rate, per, options)
    if not (isinstance(cost, int) or callable(cost)):
        raise TypeError(f"cost must be an int or a function returning one, not {type(cost).__name__}")
    if not callable(cost):
        cost = check_cost(cost, None if checked.rate is None else checked.rate.burst)
    if isinstance(name, str):
        check_name(name)
        if checked.rate is not None:
            RATES.declare(name, checked.rate)
    return _RateLimit(name, checked, cost)


def rate_limiter(
    name: str,
    rate: float | None = None,
    per: float | None = None,
    *,
    cost: int = 1,
    **options: Unpack[RateByNameOptions],
) -> AbstractAsyncContextManager[None]:
    """Limit how often a block of code starts, by a rate limiter's name.

    Like entering an `AsyncRateLimiter` with ``async with``, without
    creating or passing one around: every block entered with the same name,
    and the same Redis and prefix, shares one rate, across every process.

        async with aiosem.rate_limiter("api", 5):  # 5 a second
            await call_api()

    Entering waits for a slot -- or ``cost`` slots at once -- once, in
    arrival order; leaving does nothing. The rate comes from the ``rate``
    argument (with ``per``, default 1 s, and ``burst``, default 1), else from
    ``configure(rates=...)``, else from a `limit_rate` decorator with the
    same (fixed) name created earlier in this process. Every argument left
    out is read from `configure` when the block is entered. The returned
    object can be kept and entered again, by any number of tasks at once.

    Args:
        name: The rate limiter's name.
        rate: How many blocks may start per ``per`` seconds; ``None``:
            configured, or declared by a decorator.
        per: The window in seconds (default 1); only with ``rate``.
        cost: How many slots entering takes: an int from 1 (the default)
            to ``burst``.
        **options: The rate limiter's options (`RateByNameOptions`):
            ``burst``, ``blocking_timeout``, ``client``, ``prefix``; each
            left out (or ``None``) is read from `configure` when the block
            is entered.

    Returns:
        An async context manager whose value is ``None``.

    Raises:
        TypeError: An argument has the wrong type (raised at once).
        ValueError: An argument is out of range, or ``per`` or ``burst``
            was given without ``rate``, or ``cost`` is above the ``burst``
            given (raised at once); on entering, ``cost`` is above the
            configured or declared ``burst`` (nothing was sent to Redis).
        LookupError: On entering: no rate for ``name`` anywhere.
        AcquireTimeout: On entering: the slot would come later than
            ``blocking_timeout``; nothing was reserved.
        RuntimeError: On entering: nothing is configured and this process
            looks like one of several workers (see `configure`).
        redis.RedisError: Redis failed or could not be reached.

    Cancellation:
        A wait cancelled gives its slots back if nobody reserved any after
        them; leaving the block has nothing to give back.
    """
    refuse_unknown(options, RateByNameOptions, "rate_limiter")
    checked = rate_spec(rate, per, options)
    return _RateLimiter(
        check_name(name), checked, check_cost(cost, None if checked.rate is None else checked.rate.burst)
    )
