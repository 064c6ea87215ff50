"""`limit_concurrency` on functions, methods and async generators, and with a per-key name."""

from __future__ import annotations

import asyncio
import gc
import inspect
import math
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import aiosem
from aiosem import (
    AcquireTimeout,
    AsyncFairSemaphore,
    AsyncLockedSemaphore,
    PermitLost,
    _loop_cache,
    limit_concurrency,
)
from tests.harness.limiting import Gate, state, wait_until

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator

    import redis.asyncio


async def held(client: redis.asyncio.Redis, name: str) -> int:
    """How many permits of ``name`` are held, as Redis says."""
    return await AsyncFairSemaphore(client, name, 1).count()


# --- decorating ---------------------------------------------------------------------


def test_a_sync_function_is_refused_when_decorated() -> None:
    def blocking() -> None: ...

    with pytest.raises(TypeError, match=r"decorates async def functions and async generator functions; .*blocking"):
        limit_concurrency("db", 1)(blocking)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"name": "", "limit": 1}, ValueError, "name must not be empty"),
        ({"name": 3, "limit": 1}, TypeError, "name must be a str or a function returning one, not int"),
        ({"name": "db", "limit": 0}, ValueError, "limit must be at least 1, got 0"),
        ({"name": "db", "limit": 1.5}, TypeError, "limit must be an int, not float"),
        ({"name": "db", "limit": 1, "timeout": -1}, ValueError, "timeout must be a positive, finite number"),
        ({"name": "db", "limit": 1, "blocking_timeout": -1}, ValueError, "blocking_timeout must not be negative"),
        ({"name": "db", "limit": 1, "prefix": "a{b"}, ValueError, "prefix must not contain"),
        ({"name": "db", "limit": 1, "kind": "fast"}, ValueError, "kind must be 'fair' or 'locked', got 'fast'"),
        ({"name": "db", "limit": 1, "client": object()}, TypeError, r"client must be a redis\.asyncio\.Redis"),
        ({"name": "db", "limit": 1, "on_lost": 3}, TypeError, "on_lost must be callable or None, not int"),
        ({"name": "db", "limit": 1, "refresh_interval": 0}, ValueError, "refresh_interval must be a positive"),
    ],
)
def test_bad_arguments_are_refused_when_the_decorator_is_made(
    arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        limit_concurrency(**arguments)


def test_the_decorated_function_keeps_its_name_signature_and_docstring() -> None:
    async def fetch(url: str, *, retries: int = 3) -> bytes:
        """Fetch a URL."""
        return b""

    decorated = limit_concurrency("web", 2)(fetch)
    assert decorated.__name__ == "fetch"
    assert decorated.__doc__ == "Fetch a URL."
    assert decorated.__wrapped__ is fetch  # type: ignore[attr-defined]
    assert inspect.signature(decorated) == inspect.signature(fetch)
    assert inspect.iscoroutinefunction(decorated)


def test_a_decorated_async_generator_function_stays_one() -> None:
    async def numbers() -> AsyncIterator[int]:
        yield 1

    assert inspect.isasyncgenfunction(limit_concurrency("numbers", 1)(numbers))


# --- coroutine functions ------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
async def test_a_decorated_function_returns_what_it_returns() -> None:
    @limit_concurrency("double", 2)
    async def double(value: int) -> int:
        return value * 2

    assert await double(21) == 42


@pytest.mark.usefixtures("backend")
async def test_a_decorated_function_raises_what_it_raises() -> None:
    @limit_concurrency("fails", 2)
    async def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await fails()


async def test_a_decorated_function_holds_a_permit_while_it_runs(backend: redis.asyncio.Redis) -> None:
    gate = Gate()

    @limit_concurrency("work", 2)
    async def work() -> None:
        await gate.pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(work)
            await gate.arrived.wait()
            assert await held(backend, "work") == 1
            gate.open.set()
    assert await held(backend, "work") == 0


@pytest.mark.usefixtures("backend")
async def test_no_more_than_limit_calls_run_at_once() -> None:
    limit = 3
    gate = Gate(expected=limit)

    @limit_concurrency("limited", limit)
    async def limited() -> None:
        await gate.pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            for _ in range(limit + 1):
                tasks.start_soon(limited)
            await gate.arrived.wait()
            # The extra call is queued in Redis, not merely not yet started.
            await wait_until(lambda: state().busy and next(iter(state().busy.values())).users == limit + 1)
            semaphore = next(iter(state().busy.values())).cached
            await wait_until(lambda: semaphore.statistics().waiting == 1)
            assert gate.inside == limit
            gate.open.set()
    assert gate.entered == limit + 1
    assert gate.peak == limit


@pytest.mark.usefixtures("backend")
async def test_a_call_that_waits_past_blocking_timeout_raises_acquire_timeout() -> None:
    gate = Gate()

    @limit_concurrency("slow", 1, blocking_timeout=0.05)
    async def slow() -> None:
        await gate.pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(slow)
            await gate.arrived.wait()
            with pytest.raises(AcquireTimeout, match=r"no permit of semaphore 'slow' within 0\.05 s"):
                await slow()
            gate.open.set()


@pytest.mark.usefixtures("backend")
async def test_a_configured_blocking_timeout_applies_to_functions_decorated_before() -> None:
    gate = Gate()

    @limit_concurrency("configured-late", 1)
    async def work() -> None:
        await gate.pass_through()

    aiosem.configure(blocking_timeout=0.05)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(work)
            await gate.arrived.wait()
            with pytest.raises(AcquireTimeout):
                await work()
            gate.open.set()


@pytest.mark.usefixtures("backend")
async def test_an_infinite_blocking_timeout_waits_whatever_is_configured() -> None:
    aiosem.configure(blocking_timeout=0)
    gate = Gate()

    @limit_concurrency("patient", 1, blocking_timeout=math.inf)
    async def patient() -> None:
        await gate.pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(patient)
            await gate.arrived.wait()
            tasks.start_soon(patient)
            await wait_until(lambda: next(iter(state().busy.values())).cached.statistics().waiting == 1)
            gate.open.set()
    assert gate.entered == 2


@pytest.mark.usefixtures("backend")
async def test_a_cancelled_call_gives_its_permit_back(backend: redis.asyncio.Redis) -> None:
    gate = Gate()

    @limit_concurrency("cancelled", 1)
    async def work() -> None:
        await gate.pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(work)
            await gate.arrived.wait()
            tasks.cancel_scope.cancel()
    assert await held(backend, "cancelled") == 0
    assert not state().busy


# --- methods --------------------------------------------------------------------------------


class Crawler:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    @limit_concurrency("crawler", 1)
    async def crawl(self, page: int) -> int:
        await self.gate.pass_through()
        return page


@pytest.mark.usefixtures("backend")
async def test_a_decorated_method_is_bound_to_its_instance() -> None:
    gate = Gate()
    gate.open.set()
    assert await Crawler(gate).crawl(7) == 7


@pytest.mark.usefixtures("backend")
async def test_instances_share_one_limit_per_name() -> None:
    gate = Gate()
    first, second = Crawler(gate), Crawler(gate)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(first.crawl, 1)
            await gate.arrived.wait()
            tasks.start_soon(second.crawl, 2)
            await wait_until(lambda: next(iter(state().busy.values())).cached.statistics().waiting == 1)
            assert gate.inside == 1
            gate.open.set()
    assert gate.peak == 1
    assert gate.entered == 2


# --- async generators -----------------------------------------------------------------------


def numbers(count: int, *, fail_after: int | None = None) -> AsyncGenerator[int, None]:
    @limit_concurrency("numbers", 1)
    async def generate() -> AsyncGenerator[int, None]:
        for number in range(count):
            if number == fail_after:
                raise KeyError("broken")
            yield number

    return generate()


async def test_a_generator_takes_no_permit_before_its_first_item(backend: redis.asyncio.Redis) -> None:
    generator = numbers(3)
    assert await held(backend, "numbers") == 0
    await generator.aclose()


async def test_a_generator_holds_its_permit_across_yields(backend: redis.asyncio.Redis) -> None:
    generator = numbers(3)
    assert await anext(generator) == 0
    assert await held(backend, "numbers") == 1
    assert await anext(generator) == 1
    assert await held(backend, "numbers") == 1
    await generator.aclose()


async def test_a_generator_gives_its_permit_back_when_exhausted(backend: redis.asyncio.Redis) -> None:
    assert [number async for number in numbers(3)] == [0, 1, 2]
    assert await held(backend, "numbers") == 0


async def test_a_generator_gives_its_permit_back_when_closed(backend: redis.asyncio.Redis) -> None:
    generator = numbers(3)
    await anext(generator)
    await generator.aclose()
    assert await held(backend, "numbers") == 0


async def test_a_generator_gives_its_permit_back_when_it_raises(backend: redis.asyncio.Redis) -> None:
    generator = numbers(3, fail_after=1)
    await anext(generator)
    with pytest.raises(KeyError, match="broken"):
        await anext(generator)
    assert await held(backend, "numbers") == 0


async def test_a_generator_closes_the_wrapped_one_before_giving_its_permit_back(
    backend: redis.asyncio.Redis,
) -> None:
    held_while_closing: list[int] = []

    @limit_concurrency("tidy", 1)
    async def tidy() -> AsyncGenerator[int, None]:
        try:
            yield 1
        finally:
            held_while_closing.append(await held(backend, "tidy"))

    generator = tidy()
    await anext(generator)
    await generator.aclose()
    assert held_while_closing == [1]
    assert await held(backend, "tidy") == 0


async def test_a_generator_whose_consumer_is_cancelled_gives_its_permit_back(backend: redis.asyncio.Redis) -> None:
    started = asyncio.Event()

    @limit_concurrency("stalled", 1)
    async def stalled() -> AsyncGenerator[int, None]:
        yield 1
        started.set()
        await asyncio.Event().wait()
        yield 2  # pragma: no cover -- never reached

    generator = stalled()
    await anext(generator)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(anext, generator)
            await started.wait()
            tasks.cancel_scope.cancel()
    assert await held(backend, "stalled") == 0


@pytest.mark.usefixtures("backend")
async def test_a_generator_forwards_what_is_sent_and_thrown() -> None:
    @limit_concurrency("echo", 1)
    async def echo() -> AsyncGenerator[str, str]:
        received = "start"
        while True:
            try:
                received = yield received
            except KeyError as error:  # noqa: PERF203 -- what athrow() throws in is caught here
                received = f"caught {error.args[0]}"

    generator = echo()
    assert await anext(generator) == "start"
    assert await generator.asend("one") == "one"
    assert await generator.athrow(KeyError("two")) == "caught two"
    await generator.aclose()


async def test_an_abandoned_generator_gives_its_permit_back_once_collected(backend: redis.asyncio.Redis) -> None:
    generator = numbers(3)
    await anext(generator)
    del generator
    gc.collect()
    # The event loop's finalizer closes it in a task of its own, which
    # gives the permit back and then the cached object.
    await wait_until(lambda: not state().busy)
    assert await held(backend, "numbers") == 0


async def test_a_lost_permit_stops_a_generator_at_its_next_yield(backend: redis.asyncio.Redis) -> None:
    @limit_concurrency("fragile", 1, timeout=0.6)
    async def fragile() -> AsyncGenerator[int, None]:
        for number in range(3):
            yield number

    generator = fragile()
    assert await anext(generator) == 0
    semaphore = next(iter(state().busy.values())).cached
    await backend.delete(semaphore.key, f"{semaphore.key}:owner")
    # The refresher finds the permit gone within a third of the lease.
    await wait_until(lambda: not len(semaphore._core.holdings))
    with pytest.raises(PermitLost, match="semaphore 'fragile'"):
        await anext(generator)
    assert not state().busy


async def test_with_on_lost_a_generator_runs_on_and_raises_permit_lost_at_its_end(
    backend: redis.asyncio.Redis,
) -> None:
    losses: list[PermitLost] = []
    lost = asyncio.Event()

    def on_lost(error: PermitLost) -> None:
        losses.append(error)
        lost.set()

    @limit_concurrency("fragile", 1, timeout=0.6, on_lost=on_lost)
    async def fragile() -> AsyncGenerator[int, None]:
        for number in range(3):
            yield number

    generator = fragile()
    assert await anext(generator) == 0
    semaphore = next(iter(state().busy.values())).cached
    await backend.delete(semaphore.key, f"{semaphore.key}:owner")
    with anyio.fail_after(10):
        await lost.wait()
    assert [await anext(generator), await anext(generator)] == [1, 2]
    with pytest.raises(PermitLost) as raised:
        await anext(generator)
    assert losses == [raised.value]


# --- names by key ---------------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
async def test_each_key_is_limited_on_its_own() -> None:
    gates = {"a.example": Gate(), "b.example": Gate()}

    @limit_concurrency(lambda host: host, 1, blocking_timeout=0)
    async def fetch(host: str) -> None:
        await gates[host].pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(fetch, "a.example")
            await gates["a.example"].arrived.wait()
            tasks.start_soon(fetch, "b.example")
            await gates["b.example"].arrived.wait()
            with pytest.raises(AcquireTimeout, match=r"'a\.example'"):
                await fetch("a.example")
            for gate in gates.values():
                gate.open.set()


@pytest.mark.usefixtures("backend")
async def test_the_first_calls_of_many_keys_at_once_do_not_stall() -> None:
    # A crawler's start: every host's semaphore object subscribes at once.
    @limit_concurrency(lambda host: host, 1)
    async def fetch(host: str) -> str:
        return host

    with anyio.fail_after(2):
        results = await asyncio.gather(*(fetch(f"host{number}") for number in range(5) for _ in range(2)))
    assert sorted(set(results)) == [f"host{number}" for number in range(5)]


@pytest.mark.usefixtures("backend")
async def test_the_name_function_gets_the_calls_arguments() -> None:
    seen: list[tuple[Any, ...]] = []

    def name(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "keyed"

    class Client:
        @limit_concurrency(name, 1)
        async def get(self, path: str, *, retries: int = 0) -> str:
            return path

    client = Client()
    assert await client.get("/", retries=2) == "/"
    assert seen == [((client, "/"), {"retries": 2})]


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize(
    ("key", "error", "match"),
    [
        (None, TypeError, r"the name function of @limit_concurrency on .*fetch must return a str, not NoneType"),
        ("", ValueError, r"the name function of @limit_concurrency on .*fetch returned ''"),
    ],
)
async def test_a_name_function_must_return_a_name(key: object, error: type[Exception], match: str) -> None:
    def name() -> Any:
        return key

    @limit_concurrency(name, 1)
    async def fetch() -> None: ...

    with pytest.raises(error, match=match):
        await fetch()


@pytest.mark.usefixtures("backend")
async def test_the_cache_keeps_a_bounded_number_of_idle_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_loop_cache, "CACHE_SIZE", 2)

    @limit_concurrency(lambda key: key, 1)
    async def touch(key: str) -> None: ...

    for key in "abcdef":
        await touch(key)
    assert [entry.cached.name for entry in state().idle.values()] == ["e", "f"]
    assert not state().busy


@pytest.mark.usefixtures("backend")
async def test_the_cache_never_evicts_an_object_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_loop_cache, "CACHE_SIZE", 1)
    gate = Gate()

    @limit_concurrency(lambda key: key, 1)
    async def use(key: str) -> None:
        if key == "busy":
            await gate.pass_through()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(use, "busy")
            await gate.arrived.wait()
            tasks.start_soon(use, "busy")  # waits: the object is used twice
            entry = next(entry for entry in state().busy.values() if entry.cached.name == "busy")
            await wait_until(lambda: entry.cached.statistics().waiting == 1)
            for key in "abcd":
                await use(key)
            assert len(state().idle) == 1
            assert [entry.cached.name for entry in state().busy.values()] == ["busy"]
            assert state().busy[entry.key] is entry
            assert entry.users == 2
            gate.open.set()
    assert gate.entered == 2


@pytest.mark.usefixtures("backend")
async def test_calls_with_the_same_settings_share_one_semaphore_object() -> None:
    @limit_concurrency("shared", 2)
    async def first() -> None: ...

    @limit_concurrency("shared", 2)
    async def second() -> None: ...

    await first()
    await second()
    async with aiosem.limiter("shared"):
        pass
    assert len(state().idle) == 1


@pytest.mark.usefixtures("backend")
async def test_calls_with_other_settings_get_another_object() -> None:
    @limit_concurrency("settings", 2)
    async def fair() -> None: ...

    @limit_concurrency("settings", 2, kind="locked")
    async def locked() -> None: ...

    await fair()
    await locked()
    kinds = sorted(type(entry.cached).__name__ for entry in state().idle.values())
    assert kinds == ["AsyncFairSemaphore", "AsyncLockedSemaphore"]


@pytest.mark.usefixtures("backend")
async def test_the_configured_kind_chooses_the_semaphore_class() -> None:
    aiosem.configure(kind="locked")

    @limit_concurrency("kind", 2)
    async def work() -> None: ...

    await work()
    (entry,) = state().idle.values()
    assert isinstance(entry.cached, AsyncLockedSemaphore)


# --- the current permit ---------------------------------------------------------------


async def test_a_decorated_call_finds_its_own_permit(backend: redis.asyncio.Redis) -> None:
    @limit_concurrency("db", 2)
    async def write() -> aiosem.Permit:
        return aiosem.current_permit()

    first, second = await asyncio.gather(write(), write())
    assert first.name == second.name == "db"
    assert first.identifier != second.identifier
    assert first.fencing_token != second.fencing_token


async def test_the_current_permit_of_a_per_key_call_is_found_by_its_key(backend: redis.asyncio.Redis) -> None:
    @limit_concurrency(lambda host: f"host:{host}", 1)
    async def fetch(host: str) -> tuple[aiosem.Permit, aiosem.Permit]:
        async with aiosem.limiter("inner", 1):
            return aiosem.current_permit(f"host:{host}"), aiosem.current_permit()

    outer, innermost = await fetch("a.example")
    assert outer.name == "host:a.example"
    assert innermost.name == "inner"


async def test_outside_any_limiter_there_is_no_current_permit(backend: redis.asyncio.Redis) -> None:
    with pytest.raises(LookupError, match="not inside a limiter or a call decorated with limit_concurrency"):
        aiosem.current_permit()
    async with aiosem.limiter("db", 1):
        with pytest.raises(LookupError, match="not inside a limiter named 'other'"):
            aiosem.current_permit("other")
    with pytest.raises(LookupError):
        aiosem.current_permit("db")


async def test_an_async_generators_permit_is_not_the_current_permit(backend: redis.asyncio.Redis) -> None:
    @limit_concurrency("db", 1)
    async def rows() -> AsyncIterator[int]:
        yield 1

    async for _ in rows():
        with pytest.raises(LookupError):
            aiosem.current_permit()
