"""Limit FastAPI routes by an aiosem semaphore (aiosem's ``fastapi`` extra).

`limit` makes a dependency: a request takes a permit before its handler
runs, and gives it back once the response is sent. Every route, worker
process and machine limited by the same name shares one limit::

    from typing import Annotated

    from fastapi import Depends, FastAPI

    import aiosem
    from aiosem.contrib.fastapi import limit

    app = FastAPI()


    @app.get("/report", dependencies=[Depends(limit("reports", 3, blocking_timeout=2))])
    async def report() -> dict[str, str]: ...


    @app.get("/write")
    async def write(permit: Annotated[aiosem.Permit, Depends(limit("db", 1, blocking_timeout=1))]) -> None:
        ...  # permit.fencing_token orders this write against the others

A request that gets no permit within ``blocking_timeout`` is answered
``503 Service Unavailable`` with a ``Retry-After`` header, through FastAPI's
own `HTTPException`: no exception handler to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

from aiosem._extras import install_hint
from aiosem._options import RequestLimitOptions, refuse_unknown
from aiosem.contrib._http import RequestLimit

try:
    from fastapi import HTTPException, Request, status
except ModuleNotFoundError as error:
    raise ModuleNotFoundError(
        f"aiosem.contrib.fastapi needs FastAPI: {install_hint('fastapi')}", name=error.name
    ) from error

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from typing_extensions import Unpack

    from aiosem._permit import Permit

__all__ = ["limit"]


def _unavailable(message: str, headers: Mapping[str, str]) -> HTTPException:
    return HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, detail=message, headers=dict(headers))


@overload
def limit(
    name: str,
    limit: int | None = None,
    **options: Unpack[RequestLimitOptions],
) -> Callable[[Request], AsyncIterator[Permit]]: ...
@overload
def limit(
    name: Callable[[Request], str | None],
    limit: int | None = None,
    **options: Unpack[RequestLimitOptions],
) -> Callable[[Request], AsyncIterator[Permit | None]]: ...
def limit(
    name: str | Callable[[Request], str | None],
    limit: int | None = None,
    **options: Unpack[RequestLimitOptions],
) -> Callable[[Request], AsyncIterator[Permit | None]]:
    """A FastAPI dependency that holds a permit of a semaphore for each request.

    Use it in ``dependencies=[Depends(limit(...))]`` of a route, a router or
    the app, or as a parameter, ``permit: Annotated[Permit,
    Depends(limit(...))]``, to read the `Permit` (its fencing token). Make
    it once, at import, as with any dependency.

    The permit is taken before the handler runs and kept alive in the
    background. With the dependency's default scope (``"request"``) it is
    given back after the response is sent -- a streamed body and
    background tasks run under it; with ``Depends(..., scope="function")``
    as soon as the handler returns (then list it after any request-scoped
    dependency that keeps a task group open across its ``yield``: FastAPI
    leaves function-scoped dependencies first, and cancel scopes must be
    left in reverse order). A request is answered ``503 Service
    Unavailable`` with ``Retry-After: <retry_after>``:

    - when no permit came within ``blocking_timeout`` (set it: without one,
      here or in ``aiosem.configure``, a request waits as long as it takes);
    - when its permit was lost while it ran (its lease ran out, as when
      Redis stayed out of reach): the handler is cancelled at once, since
      another request may hold the permit by now. A loss after the response
      started -- while a body streams -- can only abort the response.

    Everything else the handler raises -- an `HTTPException` of its own, an
    error that becomes a 500 -- passes through, the permit given back. So
    do the errors of the limit itself, as 500s: `LookupError` if no limit
    is known for the name, `RuntimeError` if nothing is configured in a
    process that looks like one of several workers (see
    `aiosem.configure`), ``redis.RedisError`` if Redis failed.

    ``name`` may be a function of the `Request` returning the semaphore's
    name, to limit each key on its own (``lambda request:
    f"user:{request.headers['x-user']}"``), or ``None`` for a request not to
    limit (the dependency then gives ``None``).

    Args:
        name: The semaphore's name, or a function of the request returning
            it or ``None``.
        limit: How many requests may hold a permit at once; ``None``: the
            one ``aiosem.configure(limits=...)`` gives for the name.
        **options: The limit's options (`RequestLimitOptions`):
            ``timeout``, ``blocking_timeout`` (how long a request waits for
            a permit before its 503), ``retry_after``, ``client``,
            ``prefix``, ``kind``, ``waiter_timeout``, ``refresh_interval``;
            each left out (or ``None``) is read from `aiosem.configure`.

    Returns:
        The dependency: an async generator function of the request, giving
        the `Permit` (``None`` for a request ``name`` does not limit).

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument is out of range (``retry_after`` negative,
            ``limit`` below 1, ...).

    Cancellation:
        A request cancelled while it waits -- the server shutting down --
        leaves nothing behind; one cancelled while it holds gives its
        permit back, shielded and bounded to 5 s. A synchronous (``def``)
        handler runs in a worker thread, which cancellation cannot
        interrupt: after a loss its result is dropped for the 503, but it
        runs to its end.
    """
    refuse_unknown(options, RequestLimitOptions, "limit")
    guard: RequestLimit[Request] = RequestLimit(name, limit, **options)

    # FastAPI reads this signature: a `Request` parameter is given the request.
    async def limited(request: Request) -> AsyncIterator[Permit | None]:
        async with guard.hold(request, _unavailable) as permit:
            yield permit

    return limited
