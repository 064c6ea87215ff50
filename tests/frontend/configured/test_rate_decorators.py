"""`limit_rate` and `rate_limiter`: a rate by name, where it comes from, and stacked with `limit_concurrency`.

Rates are fast (10 per 0.4 s: a slot every 40 ms) so that the tests are
quick, yet far apart against a busy machine's pauses; a rate is proven by the grant times the calls note
(`anyio.current_time`), never by sleeping, and a limit that must refuse
uses a slow rate (1 per minute) and a blocking timeout, so that nothing
depends on timing at all.

A grant is never noted before its slot, but may be noted after it: its
wait is counted from when the reply was read, and the replies of calls
made together are read together, the later ones (shorter waits) as late
as the first. So two grants may be noted closer than their slots are, by
up to the latency of a batch of replies; `assert_spaced` allows
``LATENESS`` for that, and a rate that did not hold would still break it
within a few slots.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import aiosem
from aiosem import AcquireTimeout, AsyncRateLimiter, _config, _options, limit_concurrency, limit_rate, rate_limiter
from tests.harness.limiting import state, wait_until

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Sequence
    from contextlib import AbstractAsyncContextManager

    import redis.asyncio

RATE, PER = 10, 0.4
#: The time between two slots of ``RATE`` per ``PER``.
INTERVAL = PER / RATE
#: How late after its slot a grant may be noted (see the module docstring):
#: fakeredis runs its scripts in the test's own event loop, a millisecond
#: or more each on a busy machine, so a batch of 16 takes tens of them.
LATENESS = 4 * INTERVAL


def assert_spaced(grants: Sequence[float], interval: float = INTERVAL) -> None:
    """Any two grants n apart are noted at least n intervals apart, give or take ``LATENESS``."""
    ordered = sorted(grants)
    for first, earlier in enumerate(ordered):
        for later in range(first + 1, len(ordered)):
            assert ordered[later] - earlier >= (later - first) * interval - LATENESS, (first, later, ordered)


def cached_rates() -> list[tuple[float, float, int]]:
    """The rates of the rate limiters cached in this loop."""
    return sorted(
        (entry.cached.rate, entry.cached.per, entry.cached.burst)
        for entry in [*state().idle.values(), *state().busy.values()]
        if isinstance(entry.cached, AsyncRateLimiter)
    )


# --- decorating ---------------------------------------------------------------------


def test_a_sync_function_is_refused_when_decorated() -> None:
    def blocking() -> None: ...

    with pytest.raises(TypeError, match=r"limit_rate decorates async def functions and async generator functions"):
        limit_rate("api", 1)(blocking)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"name": ""}, ValueError, "name must not be empty"),
        ({"name": 3}, TypeError, "name must be a str or a function returning one, not int"),
        ({"rate": 0}, ValueError, "rate must be a positive, finite number, got 0"),
        ({"rate": math.nan}, ValueError, "rate must be a positive, finite number, got nan"),
        ({"rate": math.inf}, ValueError, "rate must be a positive, finite number, got inf"),
        ({"rate": "5"}, TypeError, "rate must be a number, not str"),
        ({"rate": 1, "per": -1}, ValueError, "per must be a positive, finite number, got -1"),
        ({"rate": 1, "burst": 0}, ValueError, "burst must be between 1 and"),
        ({"rate": 1, "burst": 1.5}, TypeError, "burst must be an int, not float"),
        ({"per": 2}, ValueError, "per and burst go with rate: give rate= too"),
        ({"burst": 2}, ValueError, "per and burst go with rate: give rate= too"),
        ({"rate": 1, "blocking_timeout": -1}, ValueError, "blocking_timeout must not be negative"),
        ({"rate": 1, "prefix": "a{b"}, ValueError, "prefix must not contain"),
        ({"rate": 1, "client": object()}, TypeError, r"client must be a redis\.asyncio\.Redis"),
        ({"rate": 1, "cost": 0}, ValueError, "cost must be at least 1, got 0"),
        ({"rate": 1, "cost": 1.5}, TypeError, "cost must be an int"),
        ({"rate": 1, "cost": True}, TypeError, "cost must be an int, not bool"),
        ({"rate": 1, "burst": 3, "cost": 4}, ValueError, r"cost must be at most burst \(3\), got 4: a call of that"),
        ({"cost": 0}, ValueError, "cost must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_when_the_decorator_or_limiter_is_made(
    arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    given = {"name": "api", **arguments}
    with pytest.raises(error, match=match):
        limit_rate(**given)
    if isinstance(given["name"], str):
        with pytest.raises(error, match=match):
            rate_limiter(**given)


def test_the_decorated_function_keeps_its_name_and_signature() -> None:
    async def fetch(url: str, *, retries: int = 3) -> bytes:
        """Fetch a page."""
        return url.encode() * retries

    decorated = limit_rate("api", 5)(fetch)
    assert decorated.__name__ == "fetch"
    assert decorated.__doc__ == "Fetch a page."
    assert inspect.signature(decorated) == inspect.signature(fetch)
    assert inspect.iscoroutinefunction(decorated)
    assert repr(limit_rate("api", 5)) == "limit_rate('api', rate=Rate(rate=5.0, per=1.0, burst=1))"


# --- the rate -----------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
async def test_calls_of_a_decorated_function_start_at_the_rate() -> None:
    grants: list[float] = []

    @limit_rate("api", RATE, per=PER)
    async def call(number: int) -> int:
        grants.append(anyio.current_time())
        return number

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            for number in range(16):
                tasks.start_soon(call, number)
    assert len(grants) == 16
    assert_spaced(grants)


@pytest.mark.usefixtures("backend")
async def test_a_burst_starts_at_once_from_rest() -> None:
    @limit_rate("api", 1, per=60, burst=4, blocking_timeout=0)
    async def call() -> None: ...

    with anyio.fail_after(1):
        for _ in range(4):
            await call()
        with pytest.raises(AcquireTimeout):
            await call()


@pytest.mark.usefixtures("backend")
async def test_a_method_is_limited_by_a_name_of_its_instance() -> None:
    class Client:
        def __init__(self, host: str) -> None:
            self.host = host
            self.calls = 0

        @limit_rate(lambda self, path: f"host:{self.host}", 1, per=60, blocking_timeout=0)
        async def get(self, path: str) -> str:
            self.calls += 1
            return f"{self.host}{path}"

    first, second = Client("a.example"), Client("b.example")
    assert await first.get("/1") == "a.example/1"
    assert await second.get("/1") == "b.example/1"  # another host: another rate
    with pytest.raises(AcquireTimeout, match=r"'host:a\.example'"):
        await first.get("/2")  # the next slot of a.example is a minute away
    assert (first.calls, second.calls) == (1, 1)


@pytest.mark.usefixtures("backend")
async def test_a_per_key_decorator_limits_each_key_on_its_own() -> None:
    grants: dict[str, list[float]] = {"a": [], "b": []}

    @limit_rate(lambda key: f"key:{key}", RATE, per=PER)
    async def call(key: str) -> None:
        grants[key].append(anyio.current_time())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            for _ in range(8):
                tasks.start_soon(call, "a")
                tasks.start_soon(call, "b")
    assert_spaced(grants["a"])
    assert_spaced(grants["b"])
    # Each key its own rate: b's calls do not wait behind a's (that would
    # put all of them after a's last, 7 slots after a's first).
    assert min(grants["b"]) < max(grants["a"])
    assert len(cached_rates()) == 2


@pytest.mark.usefixtures("backend")
async def test_a_name_function_must_return_a_non_empty_str() -> None:
    @limit_rate(lambda key: key, 5)
    async def call(key: object) -> None: ...

    with pytest.raises(TypeError, match=r"the name function of @limit_rate on .*call must return a str, not int"):
        await call(3)
    with pytest.raises(ValueError, match=r"the name function of @limit_rate on .*call returned ''"):
        await call("")


@pytest.mark.usefixtures("backend")
async def test_a_slot_later_than_the_blocking_timeout_fails_at_once() -> None:
    @limit_rate("api", 1, per=60, blocking_timeout=5)
    async def call() -> str:
        return "done"

    with anyio.fail_after(1):  # the second call must not wait its 5 s: its slot is a minute away
        assert await call() == "done"
        with pytest.raises(AcquireTimeout, match="'api'") as raised:
            await call()
    assert raised.value.name == "api"
    assert raised.value.blocking_timeout == 5
    assert not state().busy


@pytest.mark.usefixtures("backend")
async def test_the_configured_blocking_timeout_applies_to_rate_limits() -> None:
    aiosem.configure(blocking_timeout=0)

    @limit_rate("api", 1, per=60)
    async def call() -> None: ...

    await call()
    with anyio.fail_after(1), pytest.raises(AcquireTimeout):
        await call()


# --- calls that cost more than one --------------------------------------------------


def test_a_limiter_takes_a_fixed_cost_and_a_decorator_a_function_of_the_call_too() -> None:
    with pytest.raises(TypeError, match=r"^cost must be an int, not function$"):
        rate_limiter("api", 1, cost=lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^cost must be an int or a function returning one, not str$"):
        limit_rate("api", 1, cost="2")  # type: ignore[arg-type]


def test_a_cost_other_than_one_shows_in_the_repr() -> None:
    assert repr(rate_limiter("api", 5)) == "rate_limiter('api', rate=Rate(rate=5.0, per=1.0, burst=1))"
    assert repr(rate_limiter("api", 5, burst=3, cost=2)) == (
        "rate_limiter('api', rate=Rate(rate=5.0, per=1.0, burst=3), cost=2)"
    )
    assert repr(limit_rate("api", 5, burst=3, cost=len)) == (
        "limit_rate('api', rate=Rate(rate=5.0, per=1.0, burst=3), cost=<built-in function len>)"
    )


@pytest.mark.usefixtures("backend")
async def test_a_decorated_call_takes_the_slots_its_cost_function_gives() -> None:
    @limit_rate("geocoder", 1, per=60, burst=10, blocking_timeout=0, cost=len)
    async def geocode(addresses: list[str]) -> int:
        return len(addresses)

    with anyio.fail_after(1):
        assert await geocode(["a"] * 6) == 6
        assert await geocode(["b"] * 4) == 4  # ten of ten slots taken
        with pytest.raises(AcquireTimeout, match="'geocoder'"):
            await geocode(["c"])  # the next slot is a minute away


@pytest.mark.usefixtures("backend")
async def test_a_cost_function_that_gives_a_bad_cost_fails_the_call_before_anything_is_sent(
    backend: redis.asyncio.Redis,
) -> None:
    def cost(addresses: list[str]) -> int:
        return len(addresses) if addresses else "none"  # type: ignore[return-value]

    @limit_rate("geocoder", 5, burst=3, cost=cost)
    async def geocode(addresses: list[str]) -> None:
        pytest.fail("a call of a bad cost must not run")  # pragma: no cover

    with pytest.raises(
        ValueError, match=r"^the cost function of @limit_rate on .*geocode: cost must be at most burst \(3\), got 4"
    ):
        await geocode(["a"] * 4)
    with pytest.raises(
        TypeError, match=r"^the cost function of @limit_rate on .*geocode: cost must be an int, not str"
    ):
        await geocode([])
    assert not await backend.exists("aiosem:{geocoder}:rate")


@pytest.mark.usefixtures("backend")
async def test_a_cost_above_the_configured_burst_fails_the_call_when_it_is_made() -> None:
    aiosem.configure(rates={"geocoder": (1, 60, 3)})

    @limit_rate("geocoder", cost=len)  # the burst is not known yet
    async def geocode(addresses: list[str]) -> None: ...

    await geocode(["a"] * 3)
    with pytest.raises(ValueError, match=r"^cost must be at most burst \(3\), got 4"):
        await geocode(["b"] * 4)
    assert not state().busy


@pytest.mark.usefixtures("backend")
async def test_a_rate_limiter_enters_once_its_cost_in_slots_has_come() -> None:
    def batch(cost: int) -> AbstractAsyncContextManager[None]:
        return rate_limiter("export", 1, per=60, burst=10, blocking_timeout=0, cost=cost)

    with anyio.fail_after(1):
        async with batch(6):
            pass
        with pytest.raises(AcquireTimeout, match="'export'"):
            async with batch(5):
                pytest.fail("only four slots are left")  # pragma: no cover
        async with batch(4):
            pass


@pytest.mark.usefixtures("backend")
async def test_a_generator_takes_its_cost_at_its_first_item() -> None:
    @limit_rate("export", 1, per=60, burst=5, blocking_timeout=0, cost=lambda count: count)
    async def rows(count: int) -> AsyncGenerator[int, None]:
        for row in range(count):
            yield row

    assert [row async for row in rows(3)] == [0, 1, 2]
    with pytest.raises(AcquireTimeout, match="'export'"):
        await anext(rows(3))  # two slots are left
    assert [row async for row in rows(2)] == [0, 1]


# --- async generators ---------------------------------------------------------------


@pytest.mark.usefixtures("backend")
async def test_a_generator_takes_one_slot_at_its_first_item(backend: redis.asyncio.Redis) -> None:
    @limit_rate("export", 1, per=60, blocking_timeout=0)
    async def rows(count: int) -> AsyncGenerator[int, None]:
        for row in range(count):
            yield row

    first, second = rows(3), rows(3)
    assert not await backend.exists("aiosem:{export}:rate")  # created, not started: no slot taken
    assert [row async for row in first] == [0, 1, 2]  # one slot for all three rows
    with pytest.raises(AcquireTimeout, match="'export'"):
        await anext(second)  # the next slot is a minute away
    assert await backend.exists("aiosem:{export}:rate")


@pytest.mark.usefixtures("backend")
async def test_a_rate_limited_generator_forwards_what_is_sent_in() -> None:
    @limit_rate("echo", RATE, per=PER)
    async def echo() -> AsyncGenerator[str, str]:
        received = "start"
        while True:
            received = yield received.upper()

    generator = echo()
    assert await anext(generator) == "START"
    assert await generator.asend("next") == "NEXT"
    await generator.aclose()


# --- the limiter --------------------------------------------------------------------


@pytest.mark.usefixtures("backend")
async def test_a_rate_limiter_spaces_the_blocks_of_the_tasks_that_share_it() -> None:
    shared = rate_limiter("api", RATE, PER)
    grants: list[float] = []

    async def call() -> None:
        async with shared:
            grants.append(anyio.current_time())

    async with shared as value:
        assert value is None
        assert not state().busy  # nothing is held once the slot has come
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            for _ in range(10):
                tasks.start_soon(call)
    assert_spaced(grants)
    assert repr(shared) == "rate_limiter('api', rate=Rate(rate=10.0, per=0.4, burst=1))"


@pytest.mark.usefixtures("backend")
async def test_a_cancelled_wait_leaves_nothing_in_use() -> None:
    shared = rate_limiter("api", 1, 60)
    async with shared:
        pass
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:

            async def wait() -> None:
                async with shared:
                    pytest.fail("the slot is a minute away")  # pragma: no cover

            tasks.start_soon(wait)
            await wait_until(lambda: bool(state().busy))
            tasks.cancel_scope.cancel()
    assert not state().busy
    assert state().users == 0


# --- where the rate comes from ------------------------------------------------------


@pytest.mark.usefixtures("backend")
async def test_the_rate_comes_from_the_argument_then_configure_then_a_decorator() -> None:
    @limit_rate("api", 7, per=2, burst=3)
    async def call_api() -> None: ...

    async with rate_limiter("api"):  # declared by the decorator
        pass
    assert cached_rates() == [(7.0, 2.0, 3)]
    aiosem.configure(rates={"api": (5, 1.0)})
    async with rate_limiter("api"):  # configured wins over declared
        pass
    async with rate_limiter("api", 50, 0.5):  # given wins over configured
        pass
    assert cached_rates() == [(5.0, 1.0, 1), (7.0, 2.0, 3), (50.0, 0.5, 1)]


@pytest.mark.usefixtures("backend")
async def test_a_decorator_without_a_rate_takes_the_configured_one() -> None:
    aiosem.configure(rates={"api": 10, "db": (4, 2.0), "mail": (3, 60, 2)})

    @limit_rate("api")
    async def call_api() -> None: ...

    @limit_rate(lambda name: name)
    async def call(name: str) -> None: ...

    await call_api()
    await call("db")
    await call("mail")
    assert cached_rates() == [(3.0, 60.0, 2), (4.0, 2.0, 1), (10.0, 1.0, 1)]


@pytest.mark.usefixtures("backend")
async def test_with_no_rate_anywhere_entering_says_how_to_give_one() -> None:
    with pytest.raises(
        LookupError,
        match=(
            r"no rate for rate limiter 'api': pass rate=, set one with aiosem.configure\(rates=\{'api': \.\.\.\}\), "
            r"or decorate a function with @limit_rate\('api', \.\.\.\) first"
        ),
    ):
        async with rate_limiter("api"):
            pass  # pragma: no cover -- never entered

    @limit_rate("api")
    async def call() -> None: ...

    with pytest.raises(LookupError, match="no rate for rate limiter 'api'"):
        await call()


@pytest.mark.usefixtures("backend")
async def test_decorators_declaring_different_rates_leave_a_limiter_without_one() -> None:
    @limit_rate("api", 5)
    async def first() -> None: ...

    @limit_rate("api", 5, per=2)
    async def second() -> None: ...

    with pytest.raises(LookupError, match=r"decorators declare it with different rates \[Rate\(rate=5\.0, per=1\.0"):
        async with rate_limiter("api"):
            pass  # pragma: no cover -- never entered


@pytest.mark.usefixtures("backend")
async def test_a_semaphore_limit_is_not_a_rate() -> None:
    aiosem.configure(limits={"api": 5})

    @limit_concurrency("db", 3)
    async def query() -> None: ...

    with pytest.raises(LookupError, match="no rate for rate limiter 'api'"):
        async with rate_limiter("api"):
            pass  # pragma: no cover -- never entered
    with pytest.raises(LookupError, match="no rate for rate limiter 'db'"):
        async with rate_limiter("db"):
            pass  # pragma: no cover -- never entered


@pytest.mark.parametrize(
    ("rates", "error", "match"),
    [
        ([("api", 1)], TypeError, "rates must be a mapping of names to rates, not list"),
        ({"": 5}, ValueError, "a name in rates must not be empty"),
        ({"api": "5"}, TypeError, r"rates\['api'\] must be a number of calls per second, or a \(rate, per\) or"),
        ({"api": (1, 2, 3, 4)}, TypeError, r"rates\['api'\] must be .* tuple, not tuple of 4"),
        ({"api": True}, TypeError, r"rates\['api'\] must be a number"),
        ({"api": 0}, ValueError, r"rates\['api'\]: rate must be a positive, finite number, got 0"),
        ({"api": (5, math.nan)}, ValueError, r"rates\['api'\]: per must be a positive, finite number, got nan"),
        ({"api": (5, 1, 0)}, ValueError, r"rates\['api'\]: burst must be between 1 and"),
        ({"api": (5, 1, 2.5)}, TypeError, r"rates\['api'\]: burst must be an int, not float"),
    ],
)
def test_configure_names_the_rate_it_refuses(rates: object, error: type[Exception], match: str) -> None:
    aiosem.configure(rates={"db": 2})
    with pytest.raises(error, match=match):
        aiosem.configure(prefix="after", rates=rates)  # type: ignore[arg-type]
    assert _config.settings() == _config.Settings(rates={"db": _options.Rate(2.0)})


def test_configure_adds_rates_to_those_set_before() -> None:
    aiosem.configure(rates={"api": 2, "db": (3, 60)})
    aiosem.configure(rates={"db": (4, 1, 2)})
    assert dict(_config.settings().rates) == {"api": (2.0, 1.0, 1), "db": (4.0, 1.0, 2)}


# --- with a semaphore ---------------------------------------------------------------


@pytest.mark.usefixtures("backend")
async def test_stacked_under_limit_concurrency_both_limits_hold() -> None:
    limit = 2
    running = peak = 0
    grants: list[float] = []

    def host_of(url: str) -> str:
        return f"host:{url.split('/')[2]}"

    @limit_concurrency(host_of, limit)
    @limit_rate(host_of, RATE, per=PER)
    async def fetch(url: str) -> str:
        nonlocal running, peak
        grants.append(anyio.current_time())
        running += 1
        peak = max(peak, running)
        try:
            await anyio.sleep(3 * INTERVAL)  # the request: longer than a slot, so the permits run out
        finally:
            running -= 1
        return url

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            for number in range(8):
                tasks.start_soon(fetch, f"https://a.example/{number}")
    assert peak == limit
    assert_spaced(grants)
    # One semaphore and one rate limiter, under one name.
    kinds = sorted(type(entry.cached).__name__ for entry in state().idle.values())
    assert kinds == ["AsyncFairSemaphore", "AsyncRateLimiter"]
