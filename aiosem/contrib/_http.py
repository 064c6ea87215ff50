"""What the web integrations share: which permit a request takes, and the 503 it gets without one.

A `RequestLimit` is made once, when the app is built, from the arguments of
`aiosem.contrib.fastapi.limit`, `aiosem.contrib.aiohttp.limit` or
`aiosem.contrib.aiohttp.middleware`, and checks them there: a mistake shows
when the app starts, not at its first request. Each request then enters
`RequestLimit.hold`, which is `aiosem.limiter`'s ``async with`` -- the
permit kept alive in the background, the request's own work cancelled if it
is lost -- with two of its errors turned into the framework's 503:

- `AcquireTimeout` of this limit: no permit came within ``blocking_timeout``;
- `PermitLost` of this request's permit: its work was cancelled half-way.

The same errors of another limit, entered by the handler itself, are the
handler's own and pass through untouched, like everything else it raises.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Generic, TypeAlias, TypeVar

from aiosem._decorators import _Limiter
from aiosem._exceptions import AcquireTimeout, PermitLost
from aiosem._specs import semaphore_spec
from aiosem._validation import check_name

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from typing_extensions import Unpack

    from aiosem._options import RequestLimitOptions
    from aiosem._permit import Permit

__all__ = ["DEFAULT_RETRY_AFTER", "RequestLimit", "Unavailable", "check_retry_after"]

RequestT = TypeVar("RequestT")

#: The ``Retry-After`` of a 503 unless told otherwise, in seconds.
DEFAULT_RETRY_AFTER: Final = 1

#: Makes the framework's 503 from a message for the client and the response headers.
Unavailable: TypeAlias = "Callable[[str, Mapping[str, str]], Exception]"

#: What a client is told; it says nothing of the semaphore, whose name may be internal.
BUSY: Final = "Too many requests in progress; try again later."
INTERRUPTED: Final = "The request was interrupted; try again later."


def check_retry_after(value: object) -> int:
    """A ``Retry-After`` delay: a whole, non-negative number of seconds, as HTTP sends it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"retry_after must be an int (whole seconds), not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"retry_after must not be negative, got {value}")
    return value


class RequestLimit(Generic[RequestT]):
    """A limit on a framework's requests, checked when made.

    ``name`` is the semaphore's name, or a function of the request returning
    it -- or ``None``, for a request not to limit. The options
    (`RequestLimitOptions`) are `aiosem.limiter`'s but ``on_lost``, plus
    ``retry_after``, the seconds a 503 tells the client to wait.
    """

    __slots__ = ("_name", "_options", "headers")

    def __init__(
        self, name: str | Callable[[RequestT], str | None], limit: int | None, **options: Unpack[RequestLimitOptions]
    ) -> None:
        if isinstance(name, str):
            check_name(name)
        elif not callable(name):
            raise TypeError(f"name must be a str or a function of the request returning one, not {type(name).__name__}")
        self._name = name
        retry_after = options.pop("retry_after", DEFAULT_RETRY_AFTER)
        # No ``on_lost``: a request's work is cancelled when its permit is
        # lost; running on, to answer 503 at its end, would waste the work and the wait.
        self._options = semaphore_spec(limit, options)
        #: The headers of every 503 this limit answers.
        self.headers: Mapping[str, str] = MappingProxyType({"Retry-After": str(check_retry_after(retry_after))})

    def __repr__(self) -> str:
        return f"RequestLimit({self._name!r}, limit={self._options.limit!r}, headers={dict(self.headers)!r})"

    def name_of(self, request: RequestT) -> str | None:
        """The semaphore ``request`` takes a permit of, or ``None`` if it is not limited.

        Raises:
            TypeError, ValueError: The name function returned something else
                than a non-empty str or ``None``.
        """
        if isinstance(self._name, str):
            return self._name
        name = self._name(request)
        return None if name is None else check_name(name, "the name of a request")

    @asynccontextmanager
    async def hold(self, request: RequestT, unavailable: Unavailable) -> AsyncIterator[Permit | None]:
        """Hold a permit for ``request`` while the block runs; ``None`` for a request not limited.

        Raises:
            Exception: ``unavailable(...)``, the framework's 503, with
                `headers`: no permit came within ``blocking_timeout``, or
                the permit was lost while the block ran (the block was
                cancelled for it).
            LookupError: No limit is known for the request's name.
            TypeError, ValueError: The name function returned neither a
                non-empty str nor ``None``.
            redis.RedisError: Redis failed or could not be reached.

        Cancellation:
            As `aiosem.limiter`: a cancelled wait leaves nothing behind, and
            a block ending in any way gives the permit back, shielded and
            bounded to 5 s.
        """
        name = self.name_of(request)
        if name is None:
            yield None
            return
        permit: Permit | None = None
        try:
            async with _Limiter(name, self._options) as permit:
                yield permit
        except AcquireTimeout as error:
            if permit is not None:
                raise  # another limit's, entered by the block
            raise unavailable(BUSY, self.headers) from error
        except PermitLost as error:
            if permit is None or error.identifier != permit.identifier:
                raise
            raise unavailable(INTERRUPTED, self.headers) from error
