"""Limit aiohttp handlers by an aiosem semaphore (aiosem's ``aiohttp`` extra).

Two ways, one behaviour: `limit` decorates one handler, `middleware` limits
every request of an app (or those its name function picks). A request
takes a permit before the handler runs and gives it back when the handler
returns; the handler finds it in ``request[PERMIT]``. Every handler, worker
process and machine limited by the same name shares one limit::

    from aiohttp import web

    from aiosem.contrib.aiohttp import PERMIT, limit, middleware


    @limit("reports", 3, blocking_timeout=2)
    async def report(request: web.Request) -> web.Response:
        return web.json_response({"fencing_token": request[PERMIT].fencing_token})


    # Besides, at most 10 requests at once per tenant, over every route.
    app = web.Application(middlewares=[middleware(lambda request: f"tenant:{request.headers.get('X-Tenant')}", 10)])

A request that gets no permit within ``blocking_timeout`` is answered
``503 Service Unavailable`` with a ``Retry-After`` header
(`aiohttp.web.HTTPServiceUnavailable`).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiosem._extras import install_hint
from aiosem._options import RequestLimitOptions, refuse_unknown
from aiosem._permit import Permit
from aiosem.contrib._http import RequestLimit

try:
    from aiohttp import web
except ModuleNotFoundError as error:
    raise ModuleNotFoundError(
        f"aiosem.contrib.aiohttp needs aiohttp: {install_hint('aiohttp')}", name=error.name
    ) from error

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Mapping

    from aiohttp.typedefs import Handler, Middleware
    from typing_extensions import Unpack


__all__ = ["PERMIT", "limit", "middleware"]

R = TypeVar("R", bound=web.StreamResponse)

if TYPE_CHECKING or hasattr(web, "RequestKey"):
    #: Where a limited request keeps its `Permit`: ``request[PERMIT]``.
    PERMIT: Final = web.RequestKey("aiosem_permit", Permit)
else:  # pragma: no cover -- aiohttp before 3.14 has no typed request keys, nor warns of str ones
    PERMIT: Final = "aiosem_permit"


def _unavailable(message: str, headers: Mapping[str, str]) -> web.HTTPServiceUnavailable:
    return web.HTTPServiceUnavailable(text=message, headers=headers)


async def _limited(
    guard: RequestLimit[web.Request], request: web.Request, handler: Callable[[web.Request], Awaitable[R]]
) -> R:
    """Run ``handler`` for ``request`` under a permit of ``guard``, kept in ``request[PERMIT]``."""
    async with guard.hold(request, _unavailable) as permit:
        if permit is not None:
            request[PERMIT] = permit
        return await handler(request)


def limit(
    name: str | Callable[[web.Request], str | None],
    limit: int | None = None,
    **options: Unpack[RequestLimitOptions],
) -> Callable[[Callable[[web.Request], Awaitable[R]]], Callable[[web.Request], Coroutine[Any, Any, R]]]:
    """Limit an aiohttp handler: each request holds a permit of a semaphore while the handler runs.

    The permit is taken before the handler runs, kept alive in the
    background, put in ``request[PERMIT]``, and given back when the handler
    returns or raises -- before aiohttp sends a returned response, after a
    body the handler streams itself. A request is answered ``503 Service
    Unavailable`` with ``Retry-After: <retry_after>``:

    - when no permit came within ``blocking_timeout`` (set it: without one,
      here or in ``aiosem.configure``, a request waits as long as it takes);
    - when its permit was lost while the handler ran (its lease ran out, as
      when Redis stayed out of reach): the handler is cancelled at once,
      since another request may hold the permit by now. A loss after a
      streamed response started can only abort the response.

    Everything else the handler raises -- an `aiohttp.web.HTTPException`
    of its own, an error that becomes a 500 -- passes through, the permit
    given back. So do the errors of the limit itself, as 500s:
    `LookupError` if no limit is known for the name, `RuntimeError` if
    nothing is configured in a process that looks like one of several
    workers (see `aiosem.configure`), ``redis.RedisError`` if Redis failed.

    ``name`` may be a function of the request returning the semaphore's
    name, to limit each key on its own, or ``None`` for a request not to
    limit (``request[PERMIT]`` is then not set).

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
        The decorator of an ``async def handler(request)``; class-based
        views are limited with `middleware`.

    Raises:
        TypeError: An argument has the wrong type; or, from the decorator,
            the handler is not an ``async def`` function.
        ValueError: An argument is out of range (``retry_after`` negative,
            ``limit`` below 1, ...).

    Cancellation:
        A request cancelled while it waits leaves nothing behind; one
        cancelled while it holds gives its permit back, shielded and bounded
        to 5 s.
    """
    refuse_unknown(options, RequestLimitOptions, "limit")
    guard: RequestLimit[web.Request] = RequestLimit(name, limit, **options)

    def decorate(handler: Callable[[web.Request], Awaitable[R]]) -> Callable[[web.Request], Coroutine[Any, Any, R]]:
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(
                f"limit decorates async def handlers; {getattr(handler, '__qualname__', handler)!r} is not one"
            )

        @functools.wraps(handler)
        async def limited(request: web.Request) -> R:
            return await _limited(guard, request, handler)

        return limited

    return decorate


def middleware(
    name: str | Callable[[web.Request], str | None],
    limit: int | None = None,
    **options: Unpack[RequestLimitOptions],
) -> Middleware:
    """An aiohttp middleware: each request holds a permit of a semaphore while its handler runs.

    As `limit`, for every request of the app the middleware is given to
    (``web.Application(middlewares=[...])``), class-based views included.
    With a fixed ``name``, all of them share one limit; a function of the
    request picks the semaphore per request, or exempts it with ``None``::

        def by_user(request: web.Request) -> str | None:
            user = request.headers.get("X-User")  # set by an authenticating proxy, say
            return None if request.path == "/health" else f"user:{user}"

    Middlewares run in the order they are listed: list this one after
    those that should answer without waiting for a permit (authentication,
    say), and before those whose work the limit should cover.

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
        The middleware.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument is out of range.

    Cancellation:
        As `limit`.
    """
    refuse_unknown(options, RequestLimitOptions, "middleware")
    guard: RequestLimit[web.Request] = RequestLimit(name, limit, **options)

    @web.middleware
    async def limit_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await _limited(guard, request, handler)

    return limit_requests
