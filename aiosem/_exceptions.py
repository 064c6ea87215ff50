"""The exceptions aiosem raises.

Everything aiosem raises on purpose derives from `SemaphoreError`::

    SemaphoreError
    ├── AcquireTimeout   (also a TimeoutError)
    ├── LimitMismatch
    ├── LimitNotSet      (also a LookupError)
    ├── NotReplicated
    ├── OutOfMemory      (also a redis.exceptions.OutOfMemoryError)
    ├── PermitLost
    └── RedisUnavailable (also a redis.exceptions.ConnectionError)

Misuse -- a bad argument, a permit handed to the wrong semaphore -- raises the
built-in `TypeError` or `ValueError` before anything is sent to Redis. Errors
of Redis itself (`redis.RedisError` and its subclasses, such as
`redis.ConnectionError`) are never swallowed: they reach the caller as raised
by redis-py -- but for a refusal for memory, which becomes `OutOfMemory`,
and a Redis out of reach, which becomes `RedisUnavailable`: still redis-py's
classes, now naming the semaphore and the Redis, once.
"""

from __future__ import annotations

from typing import Any, TypeVar

import redis.exceptions

E = TypeVar("E", bound=BaseException)

__all__ = [
    "AcquireTimeout",
    "LimitMismatch",
    "LimitNotSet",
    "NotReplicated",
    "OutOfMemory",
    "PermitLost",
    "RedisUnavailable",
    "SemaphoreError",
    "out_of_memory",
    "unavailable",
]


class SemaphoreError(Exception):
    """Base class of the errors aiosem raises about a semaphore.

    Attributes:
        name: The name of the semaphore.
    """

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        #: The name of the semaphore.
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled -- sent back from a worker process, say -- as its class, its
        # message and its attributes: the constructors take keywords, which
        # an exception's own pickling cannot pass.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[SemaphoreError], args: tuple[Any, ...], attributes: dict[str, Any]) -> SemaphoreError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(attributes)
    return error


class AcquireTimeout(SemaphoreError, TimeoutError):
    """No permit (or rate limiter slot) could be had within the blocking timeout.

    Raised by ``async with semaphore`` (or a rate limiter) when
    ``blocking_timeout`` runs out; `acquire` returns ``None`` (``False``)
    instead. Also a `TimeoutError`, so code that
    handles timeouts generically catches it too.

    Attributes:
        name: The name of the semaphore.
        blocking_timeout: How long the caller waited, in seconds.
    """

    def __init__(self, *, name: str, blocking_timeout: float, what: str = "permit of semaphore") -> None:
        super().__init__(f"no {what} {name!r} within {blocking_timeout:g} s", name=name)
        #: How long the caller waited, in seconds.
        self.blocking_timeout = blocking_timeout


class LimitMismatch(SemaphoreError):
    """Another client uses the same semaphore with a different limit.

    The limit a client brings is stored with the semaphore while anybody
    holds or waits, so that two deployments that disagree -- three permits
    here, five there -- are told, rather than silently enforcing neither.
    The acquire that meets the other limit takes nothing. A limit set with
    ``set_limit`` (or ``python -m aiosem limit``) is never a mismatch: it is
    in force for every client, whatever limit each brings.

    Attributes:
        name: The name of the semaphore.
        limit: The limit this client asked for.
        stored_limit: The limit the semaphore is in use with.
    """

    def __init__(self, *, name: str, limit: int, stored_limit: int) -> None:
        super().__init__(
            f"semaphore {name!r} is in use with limit {stored_limit}; this client asked for {limit}",
            name=name,
        )
        #: The limit this client asked for.
        self.limit = limit
        #: The limit the semaphore is in use with.
        self.stored_limit = stored_limit


class LimitNotSet(SemaphoreError, LookupError):
    """A semaphore made without a limit found none stored in Redis.

    A semaphore made with ``limit=None`` -- or a limiter or decorator given
    no limit, configured none and declared none -- takes the limit in force
    in Redis: one set with ``set_limit`` or ``python -m aiosem limit``, or
    the one the semaphore is in use with. With neither, its acquire takes
    nothing and raises this. Also a `LookupError`, as a limiter with no
    limit anywhere always raised.

    Attributes:
        name: The name of the semaphore.
    """

    def __init__(self, *, name: str) -> None:
        super().__init__(
            f"no limit for semaphore {name!r}: none was given, configured or declared, and none is in force "
            f"in Redis; pass limit=, or set one with `python -m aiosem limit {name} N`",
            name=name,
        )


class NotReplicated(SemaphoreError):
    """Fewer replicas than a semaphore's ``replicas`` acknowledged a step in time.

    A semaphore made with ``replicas=n`` follows each acquire and refresh
    with a ``WAIT`` for ``n`` replicas, so that a failover cannot forget a
    permit its holder was told it has. When the replicas do not all answer
    within the wait, the step is not trusted: an acquire gives back what it
    took and raises this; a refresh by hand raises it (the permit's lease
    runs on from the last refresh that was replicated); a permit kept alive
    in the background is lost if no refresh is replicated before its lease
    runs out.

    Attributes:
        name: The name of the semaphore.
        replicas: How many replicas the semaphore waits for.
        acknowledged: How many acknowledged the step.
    """

    def __init__(self, *, name: str, replicas: int, acknowledged: int) -> None:
        super().__init__(
            f"a step of semaphore {name!r} reached {acknowledged} of the {replicas} replica(s) it waits for",
            name=name,
        )
        #: How many replicas the semaphore waits for.
        self.replicas = replicas
        #: How many acknowledged the step.
        self.acknowledged = acknowledged


class OutOfMemory(SemaphoreError, redis.exceptions.OutOfMemoryError):
    """Redis refused a step because its memory is full.

    Redis is over its ``maxmemory`` and its ``maxmemory-policy`` lets it
    evict nothing more: ``noeviction``, or a ``volatile-*`` policy once no
    key with a TTL is left. It then refuses every command that may need
    memory, and a refused step wrote nothing. Free memory or raise
    ``maxmemory``; the next call works again. `AsyncFairSemaphore`'s steps
    are never refused (see the page on faults); `AsyncLockedSemaphore`'s and
    `AsyncRateLimiter`'s are.

    Also a `redis.exceptions.OutOfMemoryError`, and so a
    `redis.ResponseError`: code that handles Redis's errors catches it too.

    Attributes:
        name: The name of the semaphore (or rate limiter).
        reply: What Redis answered, as redis-py reported it.
    """

    def __init__(self, *, name: str, reply: str, what: str = "semaphore") -> None:
        super().__init__(
            f"Redis refused a step of {what} {name!r}: its memory is full (used memory > maxmemory, and its "
            "maxmemory-policy evicts nothing more); free memory or raise maxmemory",
            name=name,
        )
        #: What Redis answered, as redis-py reported it.
        self.reply = reply

    def __repr__(self) -> str:
        # redis-py's errors show only their class; this one shows its message too.
        return f"{type(self).__name__}({str(self)!r})"


def in_place_of(error: E, context: BaseException) -> E:
    """``error``, to raise in place of ``context``: as ``raise error from None`` in an ``except`` of ``context``.

    For an error raised in another task than the one that caught
    ``context``: its traceback is shown alone, and ``context`` kept for a
    debugger.
    """
    error.__cause__, error.__context__, error.__suppress_context__ = None, context, True
    return error


def out_of_memory(error: redis.exceptions.OutOfMemoryError, name: str, what: str = "semaphore") -> OutOfMemory:
    """The `OutOfMemory` to raise, ``from None``, for Redis's refusal ``error`` of a step of ``name``.

    A refusal arrives as redis-py's `OutOfMemoryError`, bare, from a script
    (with the script's SHA and line), or from a pipeline (naming the command
    and its key): the message says instead which semaphore and what to do.
    """
    if isinstance(error, OutOfMemory):
        return error
    return OutOfMemory(name=name, reply=str(error), what=what)


class PermitLost(SemaphoreError):
    """A permit was no longer held when its holder still relied on it.

    Its lease ran out -- the holder neither refreshed nor released it within
    ``timeout`` -- and another client may have been granted it since: the
    work done under it may have overlapped with another holder's. Or the
    semaphore object was closed (`aclose`) while the holder still ran, and
    the permit was given back then.

    Attributes:
        name: The name of the semaphore.
        identifier: The identifier of the lost permit.
        reason: Why it was lost, as the message says.
    """

    def __init__(self, *, name: str, identifier: str, reason: str = "its lease ran out") -> None:
        super().__init__(f"permit {identifier} of semaphore {name!r} was lost: {reason}", name=name)
        #: The identifier of the lost permit.
        self.identifier = identifier
        #: Why it was lost, as the message says.
        self.reason = reason


class RedisUnavailable(SemaphoreError, redis.exceptions.ConnectionError):
    """Redis could not be reached, or refused the connection.

    Raised by a call of a semaphore or limiter whose step could not reach
    Redis: nothing listens at the address, the network is cut, Sentinel
    names no master. (Credentials Redis refuses raise redis-py's
    `AuthenticationError`, as they are.) The message says which Redis, its
    password hidden, and what redis-py reported, in one line; the step had
    no effect that the caller must undo. Also a
    `redis.exceptions.ConnectionError`: code that handles redis-py's errors
    catches it too. The error redis-py raised is its ``__context__``.

    Attributes:
        name: The name of the semaphore (or rate limiter).
        address: The Redis, as a URL with its password shown as ``***``.
    """

    def __init__(self, *, name: str, address: str, detail: str, what: str = "semaphore") -> None:
        super().__init__(f"Redis at {address} is unreachable, for {what} {name!r}: {detail}", name=name)
        #: The Redis, as a URL with its password shown as ``***``.
        self.address = address

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


def unavailable(
    error: redis.exceptions.ConnectionError, name: str, address: str, what: str = "semaphore"
) -> RedisUnavailable:
    """The `RedisUnavailable` to raise, ``from None``, for redis-py's ``error`` on a step of ``name``."""
    if isinstance(error, RedisUnavailable):
        return error
    detail = " ".join(str(error).split()) or type(error).__name__
    return RedisUnavailable(name=name, address=address, detail=detail, what=what)


def step_failure(error: BaseException, name: str, address: str, what: str = "semaphore") -> BaseException:
    """What a caller of ``name``'s failed step raises for the step's ``error``, a new one for each caller.

    A connection's failure is raised afresh, in the caller's task (``from
    None``): one short traceback, from the caller's frames, that says which
    Redis (``address``) could not be reached. redis-py's
    `AuthenticationError` says what was refused, and stays as it is.
    """
    if isinstance(error, redis.exceptions.ConnectionError) and not isinstance(
        error, redis.exceptions.AuthenticationError
    ):
        return in_place_of(unavailable(error, name, address, what), error)
    return error
