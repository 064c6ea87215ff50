"""The web integrations: a limited route answers 503 with Retry-After past blocking_timeout, and gives its permit back.

Every behaviour is checked on each way to limit a route -- the FastAPI
dependency (in both of FastAPI's scopes), the aiohttp decorator and the
aiohttp middleware -- each served on a real loopback socket in the test's
event loop, and called with an aiohttp client.
"""

from __future__ import annotations

import asyncio
import importlib
import secrets
import sys
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import aiohttp
import anyio
import pytest
import uvicorn
from aiohttp import web
from aiohttp.test_utils import TestServer
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

import aiosem
from aiosem import AsyncFairSemaphore, Permit
from aiosem.contrib import aiohttp as contrib_aiohttp
from aiosem.contrib import fastapi as contrib_fastapi
from tests.harness.limiting import Gate, wait_until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

    import redis.asyncio
    from fastapi import Request

    from tests.harness.support import RedisServer

pytestmark = pytest.mark.apps

#: What a limited route does, given its permit (``None`` when not limited); it returns the JSON body.
Work: TypeAlias = "Callable[[Permit | None], Awaitable[dict[str, Any]]]"
#: A semaphore's name, or a function of the request's path returning it or ``None``.
NameByPath: TypeAlias = "str | Callable[[str], str | None]"

#: How much earlier than ``blocking_timeout`` a client may see its 503: timer granularity only.
EARLY = 0.01


@pytest.fixture
def name(real_client: redis.asyncio.Redis, redis_server: RedisServer) -> str:
    """A semaphore name of the test's own, on the session's server, which aiosem is configured to use."""
    aiosem.configure(url=redis_server.url)
    return f"contrib-{secrets.token_hex(4)}"


async def held(client: redis.asyncio.Redis, name: str) -> int:
    return await AsyncFairSemaphore(client, name, 1).count()


async def eventually(condition: Callable[[], Awaitable[bool]]) -> None:
    """Wait until ``condition()`` holds in Redis, for at most 5 s."""
    with anyio.fail_after(5):
        while not await condition():  # noqa: ASYNC110 -- nothing to wait on: the state is in Redis
            await anyio.sleep(0.005)


async def eventually_released(client: redis.asyncio.Redis, name: str) -> None:
    """Wait until nobody holds ``name``: a response may reach the client before its permit is given back."""
    await eventually(lambda: is_free(client, name))


async def is_free(client: redis.asyncio.Redis, name: str) -> bool:
    return await held(client, name) == 0


# --- serving an app limited each way -----------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: str
    #: Seconds from sending the request to the end of the response, as the client measured them.
    elapsed: float


class Served:
    """A client of a served app."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def get(self, path: str = "/work") -> Answer:
        started = time.monotonic()
        async with self.session.get(path) as response:
            body = await response.text()
        return Answer(response.status, response.headers, body, time.monotonic() - started)


Integration = Literal["fastapi", "fastapi-function-scope", "aiohttp-decorator", "aiohttp-middleware"]
INTEGRATIONS: tuple[Integration, ...] = ("fastapi", "fastapi-function-scope", "aiohttp-decorator", "aiohttp-middleware")


def fastapi_app(work: Work, name: NameByPath, options: dict[str, Any], scope: Literal["function"] | None) -> FastAPI:
    """``/work`` and ``/free``, both limited by one dependency."""
    by_request: str | Callable[[Request], str | None] = (
        name if isinstance(name, str) else lambda request: name(request.url.path)
    )
    dependency = contrib_fastapi.limit(by_request, **options)
    app = FastAPI()

    async def handler(permit: Permit | None = Depends(dependency, scope=scope)) -> JSONResponse:  # noqa: B008 -- how FastAPI is used
        return JSONResponse(await work(permit))

    app.get("/work")(handler)
    app.get("/free")(handler)
    return app


def aiohttp_app(work: Work, name: NameByPath, options: dict[str, Any], *, as_middleware: bool) -> web.Application:
    """``/work`` and ``/free``, both limited by the decorator, or by the middleware."""
    by_request: str | Callable[[web.Request], str | None] = (
        name if isinstance(name, str) else lambda request: name(request.path)
    )

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(await work(request.get(contrib_aiohttp.PERMIT)))

    route: Callable[[web.Request], Awaitable[web.Response]] = handler
    if as_middleware:
        app = web.Application(middlewares=[contrib_aiohttp.middleware(by_request, **options)])
    else:
        app = web.Application()
        route = contrib_aiohttp.limit(by_request, **options)(handler)
    app.router.add_get("/work", route)
    app.router.add_get("/free", route)
    return app


@asynccontextmanager
async def uvicorn_serving(app: FastAPI) -> AsyncIterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_config=None))
    serving = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started or serving.done(), within=10)
        assert server.started, serving.result()
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        with anyio.fail_after(10):
            await serving


@asynccontextmanager
async def aiohttp_serving(app: web.Application) -> AsyncIterator[str]:
    # A client going away cancels its handler: what a limit must survive.
    async with TestServer(app, host="127.0.0.1", handler_cancellation=True) as server:
        yield f"http://127.0.0.1:{server.port}"


class Serve(Protocol):
    def __call__(self, work: Work, name: NameByPath, **options: Any) -> Awaitable[Served]: ...


@pytest.fixture(params=INTEGRATIONS)
async def serve(request: pytest.FixtureRequest) -> AsyncIterator[Serve]:
    """Serve an app whose routes are limited the parametrized way, for the rest of the test."""
    integration: Integration = request.param
    async with AsyncExitStack() as stack:

        async def start(work: Work, name: NameByPath, **options: Any) -> Served:
            if integration.startswith("fastapi"):
                scope: Literal["function"] | None = "function" if integration.endswith("function-scope") else None
                base = await stack.enter_async_context(uvicorn_serving(fastapi_app(work, name, options, scope)))
            else:
                app = aiohttp_app(work, name, options, as_middleware=integration.endswith("middleware"))
                base = await stack.enter_async_context(aiohttp_serving(app))
            session = await stack.enter_async_context(aiohttp.ClientSession(base_url=base))
            return Served(session)

        yield start


def holding(gate: Gate) -> Work:
    """Work that stays inside until ``gate`` opens, and answers with the permit's fencing token."""

    async def work(permit: Permit | None) -> dict[str, Any]:
        await gate.pass_through()
        return {"token": None if permit is None else permit.fencing_token}

    return work


# --- the contract, on every integration --------------------------------------------------------


async def test_a_request_waiting_past_blocking_timeout_gets_503_with_retry_after(serve: Serve, name: str) -> None:
    gate = Gate()
    served = await serve(holding(gate), name, limit=1, blocking_timeout=0.3, retry_after=7)
    first = asyncio.create_task(served.get())
    with anyio.fail_after(10):
        await gate.arrived.wait()
    second = await served.get()
    gate.open.set()
    assert second.status == 503
    assert second.headers["Retry-After"] == "7"
    assert "Too many requests in progress" in second.body
    assert second.elapsed >= 0.3 - EARLY
    assert (await first).status == 200


async def test_a_blocking_timeout_left_out_is_the_configured_one(serve: Serve, name: str) -> None:
    aiosem.configure(blocking_timeout=0.2)
    gate = Gate()
    served = await serve(holding(gate), name, limit=1)
    first = asyncio.create_task(served.get())
    with anyio.fail_after(10):
        await gate.arrived.wait()
    second = await served.get()
    gate.open.set()
    assert (second.status, second.headers["Retry-After"]) == (503, "1")
    assert (await first).status == 200


async def test_a_request_waiting_less_than_blocking_timeout_is_served(
    serve: Serve, name: str, real_client: redis.asyncio.Redis
) -> None:
    gate = Gate()
    served = await serve(holding(gate), name, limit=1, blocking_timeout=10)
    first = asyncio.create_task(served.get())
    with anyio.fail_after(10):
        await gate.arrived.wait()
    second = asyncio.create_task(served.get())
    await eventually(lambda: waiting(real_client, name))
    gate.open.set()
    answers = [await first, await second]
    assert [answer.status for answer in answers] == [200, 200]
    assert gate.peak == 1


async def waiting(client: redis.asyncio.Redis, name: str) -> bool:
    return await AsyncFairSemaphore(client, name, 1).waiting() > 0


async def test_the_handler_runs_holding_the_permit_it_is_given_and_gives_it_back_after(
    serve: Serve, name: str, real_client: redis.asyncio.Redis
) -> None:
    gate = Gate()
    permits: list[Permit | None] = []

    async def work(permit: Permit | None) -> dict[str, Any]:
        permits.append(permit)
        return await holding(gate)(permit)

    served = await serve(work, name, limit=2)
    answer = asyncio.create_task(served.get())
    with anyio.fail_after(10):
        await gate.arrived.wait()
    (permit,) = permits
    assert permit is not None
    assert permit.name == name
    assert list(await AsyncFairSemaphore(real_client, name, 2).holders()) == [permit.identifier]
    gate.open.set()
    assert (await answer).status == 200
    await eventually_released(real_client, name)


async def test_the_permit_is_given_back_when_the_handler_raises(
    serve: Serve, name: str, real_client: redis.asyncio.Redis
) -> None:
    entered = asyncio.Event()

    async def failing(permit: Permit | None) -> dict[str, Any]:
        entered.set()
        raise RuntimeError("the handler's own failure")

    served = await serve(failing, name, limit=1, blocking_timeout=0)
    answer = await served.get()
    assert entered.is_set()
    assert answer.status == 500
    assert "Retry-After" not in answer.headers
    await eventually_released(real_client, name)


async def test_the_permit_is_given_back_when_the_client_goes_away(
    serve: Serve, name: str, real_client: redis.asyncio.Redis
) -> None:
    gate = Gate()
    served = await serve(holding(gate), name, limit=1)
    answer = asyncio.create_task(served.get())
    with anyio.fail_after(10):
        await gate.arrived.wait()
    answer.cancel()  # the client closes the connection
    with pytest.raises(asyncio.CancelledError):
        await answer
    gate.open.set()
    await eventually_released(real_client, name)


async def test_an_acquire_timeout_of_another_limit_in_the_handler_is_the_handlers_own_error(
    serve: Serve, name: str
) -> None:
    other = f"{name}-other"

    async def nested(permit: Permit | None) -> dict[str, Any]:
        async with aiosem.limiter(other, 1, blocking_timeout=0):
            return {}

    served = await serve(nested, name, limit=1, blocking_timeout=0)
    async with aiosem.limiter(other, 1):
        answer = await served.get()
    # As for any TimeoutError of a handler: Starlette answers 500, aiohttp 504.
    assert answer.status in (500, 504)
    assert "Retry-After" not in answer.headers


async def test_a_lost_permit_cancels_the_handler_and_answers_503_with_retry_after(
    serve: Serve, name: str, real_client: redis.asyncio.Redis
) -> None:
    permits: list[Permit] = []
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def endless(permit: Permit | None) -> dict[str, Any]:
        assert permit is not None
        permits.append(permit)
        entered.set()
        try:
            await anyio.sleep_forever()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    served = await serve(endless, name, limit=1, timeout=0.6, retry_after=3)
    answer = asyncio.create_task(served.get())
    with anyio.fail_after(10):
        await entered.wait()
    (permit,) = permits
    # The permit's keys gone, its next refresh (within 0.2 s) finds it lost.
    await real_client.delete(permit.key, f"{permit.key}:owner")
    lost = await answer
    assert cancelled.is_set()
    assert lost.status == 503
    assert lost.headers["Retry-After"] == "3"
    assert "interrupted" in lost.body


async def test_a_request_the_name_function_gives_no_name_is_not_limited(serve: Serve, name: str) -> None:
    gate = Gate(expected=2)
    served = await serve(holding(gate), lambda path: None if path == "/free" else name, limit=1, blocking_timeout=0)
    answers = [asyncio.create_task(served.get("/free")) for _ in range(2)]
    with anyio.fail_after(10):
        await gate.arrived.wait()
    gate.open.set()
    for answer in answers:
        assert (await answer).status == 200
        assert (await answer).body.replace(" ", "") == '{"token":null}'


async def test_each_name_the_function_gives_is_limited_on_its_own(serve: Serve, name: str) -> None:
    gate = Gate(expected=2)
    served = await serve(holding(gate), lambda path: f"{name}:{path}", limit=1, blocking_timeout=0)
    answers = [asyncio.create_task(served.get(path)) for path in ("/work", "/free")]
    with anyio.fail_after(10):
        await gate.arrived.wait()
    gate.open.set()
    assert [(await answer).status for answer in answers] == [200, 200]


# --- making the limits ---------------------------------------------------------------------------

FACTORIES: dict[str, Callable[..., object]] = {
    "fastapi.limit": contrib_fastapi.limit,
    "aiohttp.limit": contrib_aiohttp.limit,
    "aiohttp.middleware": contrib_aiohttp.middleware,
}


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"retry_after": -1}, ValueError, "retry_after must not be negative, got -1"),
        ({"retry_after": 1.5}, TypeError, r"retry_after must be an int \(whole seconds\), not float"),
        ({"retry_after": True}, TypeError, r"retry_after must be an int \(whole seconds\), not bool"),
        ({"name": 3}, TypeError, "name must be a str or a function of the request returning one, not int"),
        ({"name": ""}, ValueError, "name must not be empty"),
        ({"limit": 0}, ValueError, "limit must be at least 1, got 0"),
        ({"blocking_timeout": -1}, ValueError, "blocking_timeout must not be negative"),
        ({"timeout": 0}, ValueError, "timeout must be a positive, finite number"),
        ({"kind": "fast"}, ValueError, "kind must be 'fair' or 'locked', got 'fast'"),
        ({"client": object()}, TypeError, r"client must be a redis\.asyncio\.Redis"),
    ],
)
def test_bad_arguments_are_refused_when_the_limit_is_made(
    factory: Callable[..., object], arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        factory(**{"name": "api", "limit": 3, **arguments})


def test_the_aiohttp_decorator_refuses_a_synchronous_handler() -> None:
    def blocking(request: web.Request) -> web.Response:
        return web.Response()

    with pytest.raises(TypeError, match=r"limit decorates async def handlers; .*blocking"):
        contrib_aiohttp.limit("api", 3)(blocking)  # type: ignore[arg-type]


def test_the_aiohttp_decorator_keeps_the_handlers_name_and_docstring() -> None:
    async def report(request: web.Request) -> web.Response:
        """Make the report."""
        return web.Response()

    limited = contrib_aiohttp.limit("api", 3)(report)
    assert (limited.__name__, limited.__doc__) == ("report", "Make the report.")


@pytest.mark.parametrize(
    ("module", "framework", "requirement"),
    [("aiosem.contrib.fastapi", "fastapi", "fastapi>=0.121"), ("aiosem.contrib.aiohttp", "aiohttp", "aiohttp>=3.9")],
)
def test_an_integration_says_what_to_install_when_its_framework_is_missing(
    module: str, framework: str, requirement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, framework, None)
    monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ImportError, match=rf"{module} needs .*: pip install '{requirement}'$"):
        importlib.import_module(module)
