"""Bad input, fuzzed: every misuse is refused by an error naming what is wrong, or is a documented no-op.

A refused call leaves Redis exactly as it was. The tests that could reach
Redis run on the session's real server, flushed first and then filled with
live state -- a held permit, a rate limiter's slot and a lock, all named
``busy`` -- and compare the whole keyspace (every key's DUMP and absolute
expiry) before and after each refused call. `tests/frontend/test_validation.py` pins the messages
of the common mistakes; here hypothesis searches the rest of the input
space, and the edges it cannot be trusted to hit are listed by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard, TypeVar

import anyio
import anyio.to_thread
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import aiosem
from aiosem import (
    AsyncFairSemaphore,
    AsyncLockedSemaphore,
    AsyncRateLimiter,
    LimitMismatch,
    Permit,
    _config,
    limit_concurrency,
    limit_rate,
    limiter,
    rate_limiter,
    recipes,
)
from aiosem._keys import escape_name
from tests.harness.support import two_processes, unrestricted, until_queued
from tests.harness.topology import hash_tag

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

    import redis.asyncio

    from tests.harness.support import RedisServer

    #: What a decorator made for a name does to a function.
    Decorate: TypeAlias = Callable[[Callable[..., Any]], Callable[..., Any]]

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore
T = TypeVar("T")

#: The name of the state every test starts with.
BUSY = "busy"
#: Hypothesis settings for tests that talk to Redis: few examples, no deadline
#: (a shared, noisy machine), fixtures shared by the examples of one test.
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
#: For tests that only call constructors: cheap, so more examples.
FUZZ_MORE = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# --- what the fuzzing draws --------------------------------------------------------

#: Strings with a lone surrogate: text that cannot be encoded, so cannot be sent.
with_surrogate = st.tuples(st.text(max_size=4), st.integers(0xD800, 0xDFFF).map(chr), st.text(max_size=4)).map("".join)
#: Names that could move, cancel or double a hash tag, or collide after escaping.
awkward_names = st.text(alphabet="%{}7BD25ab :*\x00", min_size=1, max_size=12)
usable_names = st.text(min_size=1, max_size=40) | awkward_names
#: What is not a name (all hashable, so they can key a mapping).
bad_names = st.one_of(
    st.just(""),
    with_surrogate,
    st.binary(max_size=8),
    st.integers(),
    st.floats(),
    st.none(),
    st.booleans(),
    st.tuples(st.text(max_size=3)),
)
#: Anything a caller might pass where a name goes.
any_name = usable_names | bad_names
#: Anything a caller might pass where a number goes.
any_number = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.floats(min_value=1e-12, max_value=1e-2),
    st.floats(min_value=1, max_value=1e12),
    st.sampled_from([0, -0.0, 1e-9, 1e9, 1e9 + 1, 2**53, 2**53 + 1, 2**63, 10**400, -(10**400), sys.float_info.max]),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.fractions(),
    st.decimals(allow_nan=False),
)


def type_name(value: object) -> str:
    return type(value).__name__


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def magnitude(value: float) -> float:
    """``abs(value)`` as a float; an int beyond the largest float is infinite."""
    try:
        return abs(float(value))
    except OverflowError:
        return math.inf


def encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


# --- the keyspace, before and after ---------------------------------------------------

Keyspace = dict[bytes, tuple[bytes | None, int]]


async def keyspace(client: redis.asyncio.Redis) -> Keyspace:
    """Every key with its serialized value (type and content) and its absolute expiry in ms (-1: none)."""
    async with unrestricted(client) as admin:
        return await _keyspace(admin)


async def _keyspace(client: redis.asyncio.Redis) -> Keyspace:
    keys = [key async for key in client.scan_iter(count=1000)]
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.dump(key)
            pipe.pexpiretime(key)
        replies = await pipe.execute()
    return {key: (replies[2 * i], replies[2 * i + 1]) for i, key in enumerate(keys)}


@contextlib.asynccontextmanager
async def redis_unchanged(client: redis.asyncio.Redis) -> AsyncIterator[None]:
    """Assert that the block changed nothing in Redis: no key added, removed, rewritten or given another TTL."""
    before = await keyspace(client)
    yield
    assert await keyspace(client) == before


@pytest.fixture
async def busy(real_client: redis.asyncio.Redis) -> AsyncIterator[redis.asyncio.Redis]:
    """The session's server, flushed, with a permit held, a rate limiter's slot taken and a lock held.

    All are named `BUSY` and last ten minutes, so that the keyspace holds
    still while a test compares it; aiosem is configured to use it.
    """
    holder = AsyncFairSemaphore(real_client, BUSY, 2, timeout=600)
    assert await holder.acquire(blocking=False) is not None
    assert await AsyncRateLimiter(real_client, BUSY, 1, per=600).acquire(blocking=False)
    assert await recipes.acquire_lock_with_timeout(real_client, BUSY, lock_timeout=600) is not None
    assert sorted(await keyspace(real_client)) == [
        f"aiosem:{{{BUSY}}}".encode(),  # the permit: its lease, its owner and fencing token, its holder's record,
        f"aiosem:{{{BUSY}}}:counter".encode(),
        f"aiosem:{{{BUSY}}}:holders".encode(),
        f"aiosem:{{{BUSY}}}:limit".encode(),  # and the limit it is held under
        f"aiosem:{{{BUSY}}}:owner".encode(),
        f"aiosem:{{{BUSY}}}:rate".encode(),  # the rate limiter's slot
        f"lock:{BUSY}".encode(),  # the lock
    ]
    aiosem.configure(client=real_client)
    yield real_client
    await holder.aclose()


def on_busy(cls: SemaphoreClass, client: redis.asyncio.Redis, **options: Any) -> Semaphore:
    """An object of the busy semaphore, with its lease: a shorter one would reap the busy permit."""
    return cls(client, BUSY, 2, **{"timeout": 600, **options})


# --- names ----------------------------------------------------------------------------


def name_refusal(value: object, argument: str) -> tuple[type[Exception], str] | None:
    """What every check of a name refuses: the error, and the start of its message as a pattern."""
    if not isinstance(value, str):
        return TypeError, f"{re.escape(argument)} must be a str"
    if not value:
        return ValueError, f"{re.escape(argument)} must not be empty$"
    if not encodable(value):
        return (
            ValueError,
            f"{re.escape(argument)} must be valid Unicode, without lone surrogates; it has one at index \\d+$",
        )
    if argument == "prefix" and ("{" in value or "}" in value):
        return ValueError, re.escape("prefix must not contain '{' or '}'")
    return None


#: Where a name is given, and what the messages call it.
NAME_ENTRIES: dict[str, tuple[Callable[[redis.asyncio.Redis, Any], object], str]] = {
    "AsyncFairSemaphore": (lambda client, name: AsyncFairSemaphore(client, name, 1), "name"),
    "AsyncLockedSemaphore": (lambda client, name: AsyncLockedSemaphore(client, name, 1), "name"),
    "AsyncRateLimiter": (lambda client, name: AsyncRateLimiter(client, name, 1), "name"),
    "limiter": (lambda _, name: limiter(name, 1), "name"),
    "rate_limiter": (lambda _, name: rate_limiter(name, 1), "name"),
    "limit_concurrency": (lambda _, name: limit_concurrency(name, 1), "name"),
    "limit_rate": (lambda _, name: limit_rate(name, 1), "name"),
    "prefix": (lambda client, prefix: AsyncFairSemaphore(client, BUSY, 1, prefix=prefix), "prefix"),
    "configure(limits=)": (lambda _, name: aiosem.configure(limits={name: 1}), "a name in limits"),
    "configure(rates=)": (lambda _, name: aiosem.configure(rates={name: 1}), "a name in rates"),
}


@pytest.mark.parametrize("entry", sorted(NAME_ENTRIES))
@FUZZ_MORE
@given(name=any_name)
async def test_every_entry_point_accepts_a_name_or_refuses_it_by_its_argument(
    busy: redis.asyncio.Redis, entry: str, name: object
) -> None:
    make, argument = NAME_ENTRIES[entry]
    refusal = name_refusal(name, argument)
    async with redis_unchanged(busy):
        if refusal is None:
            make(busy, name)
        else:
            with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
                make(busy, name)


async def semaphore_keys(client: redis.asyncio.Redis) -> set[bytes]:
    return {key async for key in client.scan_iter(count=1000)}


@FUZZ
@given(name=usable_names)
async def test_any_usable_name_works_on_the_server_under_its_one_hash_tag(
    real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis, cls: SemaphoreClass, name: str
) -> None:
    await admin_client.flushdb()
    sem = cls(real_client, name, 1)
    try:
        with anyio.fail_after(10):
            permit = await sem.acquire()
            assert permit is not None
            assert (permit.name, permit.key) == (name, sem.key)
            keys = await semaphore_keys(real_client)
            assert await sem.release(permit)
            assert await sem.count() == 0
    finally:
        await sem.aclose()
    assert {hash_tag(key.decode()) for key in keys} == {escape_name(name)}
    assert all(key.decode().startswith((sem.key, f"lock:{sem.key}")) for key in keys)


@FUZZ
@given(first=usable_names, second=usable_names)
async def test_two_names_never_share_a_key_or_a_hash_tag(
    real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis, cls: SemaphoreClass, first: str, second: str
) -> None:
    assume(first != second)
    await admin_client.flushdb()
    one, other = cls(real_client, first, 1), cls(real_client, second, 1)
    assert await one.acquire(blocking=False) is not None
    keys_of_first = await semaphore_keys(real_client)
    assert await other.acquire(blocking=False) is not None
    everything = await semaphore_keys(real_client)
    keys_of_second = everything - keys_of_first
    assert keys_of_first <= everything
    assert keys_of_second
    assert {hash_tag(key.decode()) for key in keys_of_first} == {escape_name(first)}
    assert {hash_tag(key.decode()) for key in keys_of_second} == {escape_name(second)}
    assert escape_name(first) != escape_name(second)


AWKWARD_NAMES = ["a\x00b", "😀", "\u202eabc", " ", "a b", "{x}", "}{", "*", "%", "%7B", ":", "x" * 10_000]


@pytest.mark.parametrize("name", AWKWARD_NAMES, ids=lambda name: ascii(name)[:12])
async def test_a_waiter_of_an_awkward_name_is_woken_through_its_channel(
    redis_server: RedisServer, real_client: redis.asyncio.Redis, name: str
) -> None:
    # Leases and waiter timeouts of a minute: the pump would not re-check
    # for 20 s, so a waiter granted within 5 s heard of it on its channel.
    async with two_processes(redis_server.client, AsyncFairSemaphore, name, 1, timeout=60, waiter_timeout=60) as (
        holder_side,
        waiter_side,
    ):
        held = await holder_side.acquire(blocking=False)
        assert held is not None
        granted: list[Permit | None] = []
        woken = anyio.Event()

        async def wait() -> None:
            granted.append(await waiter_side.acquire())
            woken.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(wait)
            await until_queued(holder_side)
            assert await holder_side.release(held)
            with anyio.fail_after(5):
                await woken.wait()
        (permit,) = granted
        assert permit is not None
        assert permit.fencing_token > held.fencing_token
        assert await waiter_side.release(permit)


# --- limits -------------------------------------------------------------------------


def limit_refusal(limit: object, *, none_means_configured: bool) -> tuple[type[Exception], str] | None:
    """What every entry point raises for ``limit``: the error and its message, or ``None`` if it is taken."""
    if limit is None and none_means_configured:
        return None
    if not is_number(limit) or not isinstance(limit, int):
        return TypeError, f"limit must be an int, not {type_name(limit)}"
    if limit < 1:
        return ValueError, "limit must be at least 1, got "
    if limit > 2**53:
        return ValueError, re.escape("limit must be at most 2**53 (9,007,199,254,740,992), got ")
    return None


#: Where a limit is given, whether ``None`` is taken there (for the configured one, or the one in force in
#: Redis), and the message's prefix.
LIMIT_ENTRIES: dict[str, tuple[Callable[[redis.asyncio.Redis, Any], object], bool, str]] = {
    "AsyncFairSemaphore": (lambda client, limit: AsyncFairSemaphore(client, "x", limit), True, ""),
    "AsyncLockedSemaphore": (lambda client, limit: AsyncLockedSemaphore(client, "x", limit), True, ""),
    "limiter": (lambda _, limit: limiter("x", limit), True, ""),
    "limit_concurrency": (lambda _, limit: limit_concurrency("x", limit), True, ""),
    "configure(limits=)": (lambda _, limit: aiosem.configure(limits={"x": limit}), False, re.escape("limits['x']: ")),
}


@pytest.mark.parametrize("entry", sorted(LIMIT_ENTRIES))
@FUZZ_MORE
@given(limit=any_number)
async def test_every_entry_point_takes_an_int_limit_from_1_to_2_to_the_53(
    busy: redis.asyncio.Redis, entry: str, limit: object
) -> None:
    make, none_means_configured, prefix = LIMIT_ENTRIES[entry]
    refusal = limit_refusal(limit, none_means_configured=none_means_configured)
    async with redis_unchanged(busy):
        if refusal is None:
            make(busy, limit)
        else:
            with pytest.raises(refusal[0], match=f"^{prefix}{refusal[1]}"):
                make(busy, limit)


TOO_MUCH = "limit must be at most 2**53 (9,007,199,254,740,992), got "


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        pytest.param(2**53 + 1, TOO_MUCH + "9007199254740993", id="2**53+1"),
        pytest.param(2**63, TOO_MUCH + "9223372036854775808", id="2**63"),
        pytest.param(10**17, TOO_MUCH + "100000000000000000", id="10**17"),
        pytest.param(10**5000, TOO_MUCH + "an int of 16610 bits", id="10**5000"),
        pytest.param(-(10**5000), "limit must be at least 1, got a negative int of 16610 bits", id="-10**5000"),
    ],
)
async def test_a_limit_beyond_what_the_scripts_count_exactly_is_refused(
    cls: SemaphoreClass, busy: redis.asyncio.Redis, limit: int, message: str
) -> None:
    async with redis_unchanged(busy):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            cls(busy, BUSY, limit)


@pytest.mark.parametrize("limit", [2**53, 9 * 10**15, 10**15 + 1])
async def test_the_largest_limits_are_stored_so_that_both_kinds_read_them(
    real_client: redis.asyncio.Redis, limit: int
) -> None:
    fair = AsyncFairSemaphore(real_client, "big", limit)
    locked = AsyncLockedSemaphore(real_client, "big", limit)
    first = await fair.acquire(blocking=False)
    second = await locked.acquire(blocking=False)
    assert first is not None
    assert second is not None
    assert await real_client.get(f"{fair.key}:limit") == str(limit).encode()
    for cls in (AsyncFairSemaphore, AsyncLockedSemaphore):
        with pytest.raises(LimitMismatch, match=f"in use with limit {limit}; this client asked for 5$"):
            await cls(real_client, "big", 5).acquire(blocking=False)
    assert await locked.release(first)
    assert await fair.release(second)


# --- durations ----------------------------------------------------------------------


def duration_refusal(  # noqa: PLR0911 -- one return per refusal, as in the checks
    argument: str, value: object, *, wait: bool, optional: bool = False
) -> tuple[type[Exception], str] | None:
    """What a lease or interval (or, with ``wait``, a blocking timeout) refuses: the error and message start.

    ``None`` is taken where it has a meaning: waiting for ever, or (``optional``) the default.
    """
    if value is None and (wait or optional):
        return None
    if not is_number(value):
        return TypeError, f"{argument} must be a number of seconds, not {type_name(value)}$"
    if isinstance(value, float) and math.isnan(value):
        return ValueError, f"{argument} must not be NaN$"
    if wait:
        if value < 0:
            return ValueError, f"{argument} must not be negative, got "
        if value > 1e9 and value != math.inf:
            return ValueError, re.escape(f"{argument} must be at most 1e+09 seconds (None or math.inf waits for ever)")
        return None
    if value <= 0 or value == math.inf:
        return ValueError, f"{argument} must be a positive, finite number of seconds, got "
    if value < 0.001:
        return ValueError, re.escape(f"{argument} must be at least 0.001 s (Redis counts in milliseconds), got ")
    if value > 1e9:
        return ValueError, re.escape(f"{argument} must be at most 1e+09 seconds, got ")
    return None


DURATIONS = ["timeout", "blocking_timeout", "waiter_timeout", "refresh_interval", "lock_timeout"]


@pytest.mark.parametrize("argument", DURATIONS)
@FUZZ_MORE
@given(value=any_number)
async def test_a_semaphore_takes_a_duration_as_given_or_refuses_it_by_name(
    busy: redis.asyncio.Redis, argument: str, value: object
) -> None:
    # The longest lease, so that only this argument can be refused: a
    # waiter timeout and a refresh interval must fit in it. (A lease given
    # alone sets both from itself.)
    options: dict[str, Any] = {"timeout": 1e9, argument: value}
    refusal = duration_refusal(
        argument,
        value,
        wait=argument == "blocking_timeout",
        optional=argument in ("waiter_timeout", "refresh_interval"),
    )
    if refusal is None and argument == "refresh_interval" and value == 1e9:
        refusal = ValueError, re.escape("refresh_interval must be shorter than timeout (1e+09 s), got ")
    async with redis_unchanged(busy):
        if refusal is not None:
            with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
                AsyncLockedSemaphore(busy, BUSY, 2, **options)
            return
        sem = AsyncLockedSemaphore(busy, BUSY, 2, **options)
    if value is not None and argument != "lock_timeout":  # None: the default; a lock's TTL is not shown
        assert getattr(sem, argument) == (None if value == math.inf else float(value))  # type: ignore[arg-type]


@FUZZ
@given(value=any_number)
async def test_acquire_takes_a_blocking_timeout_or_refuses_it_before_sending_anything(
    busy: redis.asyncio.Redis, cls: SemaphoreClass, value: object
) -> None:
    sem = on_busy(cls, busy)
    refusal = duration_refusal("blocking_timeout", value, wait=True)
    if refusal is None:
        permit = await sem.acquire(blocking=False, blocking_timeout=value)  # type: ignore[arg-type]
        assert permit is not None
        assert await sem.release(permit)
        return
    async with redis_unchanged(busy):
        with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
            await sem.acquire(blocking_timeout=value)  # type: ignore[arg-type]
        with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
            await sem.acquire(blocking=False, blocking_timeout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"timeout": 1e-9}, ValueError, "timeout must be at least 0.001 s (Redis counts in milliseconds), got 1e-09"),
        ({"timeout": 2**63}, ValueError, "timeout must be at most 1e+09 seconds, got 9223372036854775808"),
        ({"timeout": 10**400}, ValueError, "timeout must be at most 1e+09 seconds, got an int of 1329 bits"),
        (
            {"timeout": -(10**400)},
            ValueError,
            "timeout must be a positive, finite number of seconds, got a negative int of 1329 bits",
        ),
        ({"waiter_timeout": 1e-9}, ValueError, "waiter_timeout must be at least 0.001 s"),
        ({"waiter_timeout": math.nan}, ValueError, "waiter_timeout must not be NaN"),
        ({"waiter_timeout": True}, TypeError, "waiter_timeout must be a number of seconds, not bool"),
        ({"waiter_timeout": 11}, ValueError, "waiter_timeout must not exceed timeout (10 s), got 11"),
        ({"refresh_interval": 1e-9}, ValueError, "refresh_interval must be at least 0.001 s"),
        ({"refresh_interval": math.inf}, ValueError, "refresh_interval must be a positive, finite number"),
        ({"refresh_interval": "1"}, TypeError, "refresh_interval must be a number of seconds, not str"),
        ({"refresh_interval": 10}, ValueError, "refresh_interval must be shorter than timeout (10 s), got 10"),
        ({"blocking_timeout": 1e300}, ValueError, "blocking_timeout must be at most 1e+09 seconds"),
        ({"blocking_timeout": sys.float_info.max}, ValueError, "blocking_timeout must be at most 1e+09 seconds"),
        ({"blocking_timeout": 10**400}, ValueError, "blocking_timeout must be at most 1e+09 seconds"),
        ({"replicas": -(10**400)}, ValueError, "replicas must not be negative, got a negative int of 1329 bits"),
        ({"replicas": 1.0}, TypeError, "replicas must be an int, not float"),
        ({"on_lost": "print"}, TypeError, "on_lost must be callable or None, not str"),
    ],
    ids=lambda value: repr(value)[:40] if isinstance(value, dict) else "",
)
async def test_an_edge_of_a_semaphore_option_is_refused_with_its_message(
    cls: SemaphoreClass, busy: redis.asyncio.Redis, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    async with redis_unchanged(busy):
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            cls(busy, BUSY, 2, **options)


@pytest.mark.parametrize(
    ("options", "stored"),
    [
        ({"timeout": 0.001}, {"timeout": 0.001, "waiter_timeout": 0.001, "refresh_interval": 0.001 / 3}),
        ({"timeout": 1e9}, {"timeout": 1e9, "waiter_timeout": 2.0}),
        ({"timeout": 10, "waiter_timeout": 10}, {"waiter_timeout": 10.0}),
        ({"timeout": 10, "refresh_interval": 9.999}, {"refresh_interval": 9.999}),
        ({"blocking_timeout": 0}, {"blocking_timeout": 0.0}),
        ({"blocking_timeout": 1e9}, {"blocking_timeout": 1e9}),
        ({"blocking_timeout": math.inf}, {"blocking_timeout": None}),
    ],
    ids=repr,
)
async def test_the_edges_of_each_duration_are_accepted(
    cls: SemaphoreClass, busy: redis.asyncio.Redis, options: dict[str, Any], stored: dict[str, object]
) -> None:
    sem = cls(busy, BUSY, 2, **options)
    assert {attribute: getattr(sem, attribute) for attribute in stored} == stored


@pytest.mark.parametrize("reading", [math.nan, math.inf, -math.inf, "1700000000"], ids=repr)
async def test_a_clock_reading_that_is_not_a_finite_number_is_refused(
    busy: redis.asyncio.Redis, cls: SemaphoreClass, reading: Any
) -> None:
    sem = on_busy(cls, busy, clock=lambda: reading)
    async with redis_unchanged(busy):
        with pytest.raises((TypeError, ValueError), match=r"^clock\(\) must"):
            await sem.acquire(blocking=False)


# --- the rate limiter ---------------------------------------------------------------


def rate_refusal(argument: str, value: object) -> tuple[type[Exception], str] | None:
    if argument == "burst":
        if not is_number(value) or not isinstance(value, int):
            return TypeError, f"burst must be an int, not {type_name(value)}$"
        if not 1 <= value <= 1_000_000:
            return ValueError, "burst must be between 1 and 1,000,000, got "
        return None
    if not is_number(value):
        return TypeError, f"{argument} must be a number, not {type_name(value)}$"
    if not value > 0 or magnitude(value) == math.inf:
        return ValueError, f"{argument} must be a positive, finite number, got "
    return None


#: Rates and windows whose interval (per / rate) stays within 1e9 s; beyond,
#: see `test_a_rate_whose_interval_redis_cannot_keep_is_refused_at_once`.
sane_numbers = st.floats(min_value=1e-3, max_value=1e6) | st.integers(min_value=1, max_value=10**6)


@pytest.mark.parametrize("argument", ["rate", "per", "burst"])
@FUZZ
@given(value=any_number, rate=sane_numbers, per=sane_numbers)
async def test_a_rate_limiter_takes_its_rate_or_refuses_it_by_name(
    busy: redis.asyncio.Redis, argument: str, value: object, rate: float, per: float
) -> None:
    refusal = rate_refusal(argument, value)
    if refusal is None and argument != "burst" and is_number(value):
        # Into the range where per / rate stays within 1e9 s.
        value = min(max(value, 1e-3), 1e6)
    options: dict[str, Any] = {"rate": rate, "per": per, argument: value}
    if refusal is not None:
        async with redis_unchanged(busy):
            with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
                AsyncRateLimiter(busy, BUSY, **options)
        return
    limiter_ = AsyncRateLimiter(busy, "fuzzed", **options)
    assert await limiter_.acquire(blocking=False)
    await busy.delete(limiter_.key)


@pytest.mark.parametrize("value", [math.nan, -1.0, sys.float_info.max, 1e300, 10**400, "1"], ids=repr)
async def test_a_rate_limiter_refuses_a_bad_blocking_timeout_before_reserving(
    busy: redis.asyncio.Redis, value: object
) -> None:
    refusal = duration_refusal("blocking_timeout", value, wait=True)
    assert refusal is not None
    limiter_ = AsyncRateLimiter(busy, BUSY, 1, per=600)
    async with redis_unchanged(busy):
        with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
            await limiter_.acquire(blocking_timeout=value)  # type: ignore[arg-type]


def cost_refusal(value: object, burst: int) -> tuple[type[Exception], str] | None:
    """What a rate limiter refuses as a call's cost: the error, and the start of its message as a pattern."""
    if isinstance(value, bool) or not isinstance(value, int):
        return TypeError, f"cost must be an int, not {type_name(value)}$"
    if value < 1:
        return ValueError, "cost must be at least 1, got "
    if value > burst:
        return ValueError, re.escape(f"cost must be at most burst ({burst}), got ")
    return None


@FUZZ
@given(cost=any_number, burst=st.integers(min_value=1, max_value=5))
async def test_a_rate_limiter_takes_its_cost_or_refuses_it_before_reserving(
    busy: redis.asyncio.Redis, cost: object, burst: int
) -> None:
    limiter_ = AsyncRateLimiter(busy, BUSY, 1, per=600, burst=burst)
    refusal = cost_refusal(cost, burst)
    if refusal is not None:
        async with redis_unchanged(busy):
            with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
                await limiter_.acquire(cost=cost)  # type: ignore[arg-type]
        return
    fresh = AsyncRateLimiter(busy, "fuzzed", 1, per=600, burst=burst)
    assert await fresh.try_acquire(cost=cost)  # type: ignore[arg-type]
    await busy.delete(fresh.key)


RATE_OVERFLOWS = [
    pytest.param({"rate": 1e-303}, id="rate=1e-303"),
    pytest.param({"rate": 1e-300}, id="rate=1e-300"),
    pytest.param({"rate": 1, "per": 1e300}, id="per=1e300"),
    pytest.param({"rate": 1e-9, "per": 1e9}, id="one per 1e18 s"),
]


@pytest.mark.parametrize("where", ["AsyncRateLimiter", "limit_rate", "configure(rates=)"])
@pytest.mark.parametrize("rate", RATE_OVERFLOWS)
async def test_a_rate_whose_interval_redis_cannot_keep_is_refused_at_once(
    busy: redis.asyncio.Redis, where: str, rate: dict[str, float]
) -> None:
    makers: dict[str, Callable[[], object]] = {
        "AsyncRateLimiter": lambda: AsyncRateLimiter(busy, "slow", **rate),  # type: ignore[arg-type]
        "limit_rate": lambda: limit_rate("slow", **rate),  # type: ignore[arg-type]
        "configure(rates=)": lambda: aiosem.configure(rates={"slow": (rate["rate"], rate.get("per", 1.0))}),
    }
    async with redis_unchanged(busy):
        with pytest.raises(ValueError, match="per / rate"):
            makers[where]()


@pytest.mark.parametrize("reading", [math.nan, math.inf, "1700000000"], ids=repr)
async def test_a_rate_limiter_refuses_a_clock_reading_that_is_not_a_finite_number(
    busy: redis.asyncio.Redis, reading: Any
) -> None:
    limiter_ = AsyncRateLimiter(busy, BUSY, 1, per=600, clock=lambda: reading)
    async with redis_unchanged(busy):
        with pytest.raises((TypeError, ValueError), match=r"^clock\(\) must"):
            await limiter_.acquire(blocking=False)


# --- permits --------------------------------------------------------------------------


@FUZZ
@given(identifier=st.text(min_size=1, max_size=64) | awkward_names, fencing_token=st.integers(), name=any_name)
async def test_a_permit_not_held_is_a_no_op_that_changes_nothing(
    busy: redis.asyncio.Redis, cls: SemaphoreClass, identifier: str, fencing_token: int, name: Any
) -> None:
    sem = on_busy(cls, busy)
    stranger = Permit(name, identifier, fencing_token, sem.key)
    async with redis_unchanged(busy):
        assert await sem.refresh(stranger) is False
        assert await sem.release(stranger) is False


@pytest.mark.parametrize("operation", ["release", "refresh"])
@pytest.mark.parametrize("identifier", [None, 5, 1.5, b"ab", "", "a\ud800"], ids=repr)
async def test_a_hand_made_permit_whose_identifier_is_not_a_name_is_refused(
    cls: SemaphoreClass, busy: redis.asyncio.Redis, operation: str, identifier: object
) -> None:
    sem = on_busy(cls, busy)
    forged = Permit(BUSY, identifier, 1, sem.key)  # type: ignore[arg-type]
    async with redis_unchanged(busy):
        with pytest.raises((TypeError, ValueError), match=r"^permit\.identifier "):
            await getattr(sem, operation)(forged)


async def test_a_second_release_or_a_refresh_after_release_is_false_and_changes_nothing(
    cls: SemaphoreClass, busy: redis.asyncio.Redis
) -> None:
    sem = on_busy(cls, busy)
    permit = await sem.acquire(blocking=False)
    assert permit is not None
    assert await sem.release(permit) is True
    async with redis_unchanged(busy):
        assert await sem.release(permit) is False
        assert await sem.refresh(permit) is False
        assert await sem.release(permit) is False


@pytest.mark.parametrize("not_a_permit", [Permit, 0, [], {"identifier": "x"}, object()], ids=type_name)
async def test_release_and_refresh_refuse_anything_but_a_permit(
    cls: SemaphoreClass, busy: redis.asyncio.Redis, not_a_permit: object
) -> None:
    sem = on_busy(cls, busy)
    async with redis_unchanged(busy):
        for operation in (sem.release, sem.refresh):
            with pytest.raises(TypeError, match=f"^permit must be a Permit, not {type_name(not_a_permit)}$"):
                await operation(not_a_permit)  # type: ignore[arg-type]


async def test_releasing_the_permit_of_an_async_with_inside_it_ends_the_block_quietly(
    cls: SemaphoreClass, busy: redis.asyncio.Redis
) -> None:
    async with contextlib.aclosing(on_busy(cls, busy)) as sem:
        async with sem as permit:
            assert await sem.release(permit) is True
        assert await sem.count() == 1  # the busy holder's only


# --- one object, two event loops ---------------------------------------------------------


def in_another_loop(step: Callable[[], Awaitable[T]]) -> T:
    """Run ``step`` in an event loop of its own (call in a worker thread)."""

    async def main() -> T:
        return await step()

    return asyncio.run(main())


async def held_on(sem: Semaphore, permit: Permit, within: float = 10.0) -> None:
    """Wait until the background refresher confirms ``permit`` once more (bounded)."""
    hold = sem._core.holdings.get(permit.identifier)
    assert hold is not None
    confirmed = hold.confirmed_at
    with anyio.fail_after(within):
        while hold.confirmed_at == confirmed:  # noqa: ASYNC110 -- the refresher's own record; nothing signals it
            await anyio.sleep(0.01)
    assert sem._core.holdings.get(permit.identifier) is hold


async def test_a_semaphore_used_from_a_second_event_loop_raises_and_changes_nothing(
    cls: SemaphoreClass, busy: redis.asyncio.Redis
) -> None:
    message = "is in use by another event loop; create one semaphore object per loop$"
    async with contextlib.aclosing(on_busy(cls, busy)) as sem:
        async with sem as permit:
            hold = sem._core.holdings.get(permit.identifier)
            assert hold is not None
            async with redis_unchanged(busy):
                steps = (lambda: sem.acquire(blocking=False), sem.count, sem.__aenter__, lambda: sem.refresh(permit))
                for step in steps:
                    with pytest.raises(RuntimeError, match=message):
                        await anyio.to_thread.run_sync(in_another_loop, step)
                # Closing from another loop is a no-op: the object belongs to this one.
                await anyio.to_thread.run_sync(in_another_loop, sem.aclose)
            assert len(sem._core.holdings) == 1
            assert sem._core.holdings.get(permit.identifier) is hold
            assert hold.lost is None
        assert await sem.count() == 1  # the busy holder's only


async def test_a_refused_second_event_loop_leaves_the_first_loops_permit_kept_alive(
    cls: SemaphoreClass, busy: redis.asyncio.Redis
) -> None:
    async with contextlib.aclosing(cls(busy, "shared", 2, timeout=0.6)) as sem, sem as permit:
        with pytest.raises(RuntimeError, match="is in use by another event loop"):
            await anyio.to_thread.run_sync(in_another_loop, lambda: sem.acquire(blocking=False))
        await held_on(sem, permit)


async def test_a_release_from_a_second_event_loop_leaves_the_first_loops_permit_alive(
    cls: SemaphoreClass, busy: redis.asyncio.Redis
) -> None:
    async with contextlib.aclosing(cls(busy, "shared", 2, timeout=0.6)) as sem, sem as permit:
        with pytest.raises(RuntimeError, match="is in use by another event loop"):
            await anyio.to_thread.run_sync(in_another_loop, lambda: sem.release(permit))
        await held_on(sem, permit)


# --- decorators -------------------------------------------------------------------------

DECORATORS: dict[str, Callable[[Any], Decorate]] = {
    "limit_concurrency": lambda name: limit_concurrency(name, 1),
    "limit_rate": lambda name: limit_rate(name, 1),
}


@pytest.mark.parametrize("decorator", sorted(DECORATORS))
@FUZZ
@given(returned=bad_names)
async def test_a_name_function_returning_a_bad_name_fails_the_call_before_redis(
    busy: redis.asyncio.Redis, decorator: str, returned: object
) -> None:
    ran: list[object] = []

    @DECORATORS[decorator](lambda: returned)
    async def call() -> None:
        ran.append(None)

    if not isinstance(returned, str):
        refusal: tuple[type[Exception], str] = (
            TypeError,
            f"^the name function of @{decorator} on .*call must return a str, not {type_name(returned)}$",
        )
    elif not returned:
        refusal = ValueError, f"^the name function of @{decorator} on .*call returned ''$"
    else:
        refusal = ValueError, "^name must be valid Unicode, without lone surrogates"
    async with redis_unchanged(busy):
        with pytest.raises(refusal[0], match=refusal[1]):
            await call()
    assert ran == []


async def async_function() -> None: ...


def sync_function() -> None: ...


def sync_generator() -> Iterator[int]:
    yield 1


class AsyncCallable:
    async def __call__(self) -> None: ...


NOT_ASYNC_FUNCTIONS = {
    "sync function": sync_function,
    "sync generator function": sync_generator,
    "lambda": lambda: None,
    "class": AsyncCallable,
    "partial of a sync function": functools.partial(sync_function),
    "instance with an async __call__": AsyncCallable(),
    "builtin": print,
    "None": None,
}


@pytest.mark.parametrize("decorator", sorted(DECORATORS))
@pytest.mark.parametrize("function", list(NOT_ASYNC_FUNCTIONS.values()), ids=list(NOT_ASYNC_FUNCTIONS))
def test_a_decorator_refuses_what_is_not_an_async_function(decorator: str, function: object) -> None:
    with pytest.raises(TypeError, match=f"^{decorator} decorates async def functions and async generator functions;"):
        DECORATORS[decorator]("db")(function)  # type: ignore[arg-type]


@pytest.mark.parametrize("decorator", sorted(DECORATORS))
def test_a_decorator_refuses_a_coroutine_object(decorator: str) -> None:
    coroutine = async_function()
    try:
        with pytest.raises(TypeError, match=f"^{decorator} decorates async def functions"):
            DECORATORS[decorator]("db")(coroutine)  # type: ignore[arg-type]
    finally:
        coroutine.close()


@pytest.mark.parametrize("decorator", sorted(DECORATORS))
async def test_a_partial_of_an_async_function_is_decorated(busy: redis.asyncio.Redis, decorator: str) -> None:
    async def double(value: int) -> int:
        return 2 * value

    assert await DECORATORS[decorator]("partial")(functools.partial(double, 21))() == 42


# --- configure --------------------------------------------------------------------------

#: Passwords made of characters no message or URL below has otherwise.
passwords = st.text(alphabet="QXZJKVW", min_size=6, max_size=12)
#: URL shapes aiosem must refuse at once, each with a password in it.
BAD_URLS = [
    "http://user:{}@example.com",
    "valkey://:{}@host:6379",
    "memory://:{}@host",
    "redis+cluster://:{}@10.0.0.1:7000/3",
    "redis+cluster://:{}@10.0.0.1:port",
    "redis+cluster://:{}@10.0.0.1:7000,,10.0.0.2:7001",
    "redis+sentinel://:{}@10.0.0.1:26379",
    "redis+sentinel://:{}@10.0.0.1:26379/mymaster/x",
    "redis+sentinel://:{}@10.0.0.1:26379/mymaster?socket_timeout=soon",
]


@pytest.mark.parametrize("template", BAD_URLS)
@FUZZ_MORE
@given(password=passwords)
def test_a_refused_url_never_shows_its_password_and_changes_nothing(template: str, password: str) -> None:
    aiosem.configure(url="redis://before")
    with pytest.raises(ValueError, match=r"^url") as refused:
        aiosem.configure(url=template.format(password))
    assert password not in str(refused.value)
    assert _config.settings().url == "redis://before"


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@host:notaport",
        "redis://:hunter2@host:99999",
        "rediss://:hunter2@host:-1",
        "redis://:hunter2@host/0?socket_timeout=soon",
        "redis://:hunter2@[::1",
    ],
)
def test_a_malformed_server_url_is_refused_by_configure(url: str) -> None:
    with pytest.raises(ValueError, match=r"^url") as refused:
        aiosem.configure(url=url)
    assert "hunter2" not in str(refused.value)


#: Mappings of names to limits or rates, and things that are not mappings.
limits_mappings = st.one_of(
    st.dictionaries(any_name, any_number, max_size=3),
    st.lists(st.tuples(st.text(max_size=3), st.integers()), max_size=2),
    st.integers(),
    st.text(max_size=3),
)
rates_mappings = st.one_of(
    st.dictionaries(any_name, any_number | st.tuples(*[any_number] * 2) | st.tuples(*[any_number] * 3), max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=3), st.lists(sane_numbers, max_size=4).map(tuple), max_size=3),
    st.lists(st.tuples(st.text(max_size=3), st.integers()), max_size=2),
    st.integers(),
)


def limits_refusal(limits: object) -> tuple[type[Exception], str] | None:
    """What `configure` refuses of a ``limits`` mapping: its first bad name or limit."""
    if not isinstance(limits, Mapping):
        return TypeError, f"limits must be a mapping of names to limits, not {type_name(limits)}$"
    for name, limit in limits.items():
        refusal = name_refusal(name, "a name in limits")
        if refusal is not None:
            return refusal
        refusal = limit_refusal(limit, none_means_configured=False)
        if refusal is not None:
            return refusal[0], re.escape(f"limits[{name!r}]: ") + refusal[1]
    return None


def rates_refusal(rates: object) -> tuple[type[Exception], str] | None:
    """What `configure` refuses of a ``rates`` mapping: its first bad name, shape, rate, window or burst."""
    if not isinstance(rates, Mapping):
        return TypeError, f"rates must be a mapping of names to rates, not {type_name(rates)}$"
    for name, rate in rates.items():
        refusal = name_refusal(name, "a name in rates")
        if refusal is not None:
            return refusal
        if isinstance(rate, tuple) and len(rate) in (2, 3):
            parts = rate
        elif is_number(rate):
            parts = (rate,)
        else:
            return TypeError, re.escape(f"rates[{name!r}] must be a number of calls per second, or a (rate, per)")
        for argument, value in zip(("rate", "per", "burst"), parts, strict=False):
            refusal = rate_refusal(argument, value)
            if refusal is not None:
                return refusal[0], re.escape(f"rates[{name!r}]: ") + refusal[1]
        per = parts[1] if len(parts) > 1 else 1.0
        if per / parts[0] > 1e9:
            # Redis cannot keep an interval that long as a TTL.
            return ValueError, re.escape(
                f"rates[{name!r}]: per / rate, the time between two calls, must be at most 1e+09 s"
            )
    return None


@FUZZ_MORE
@given(limits=limits_mappings)
def test_configure_takes_a_limits_mapping_whole_or_refuses_it_changing_nothing(limits: Any) -> None:
    aiosem.configure(limits={"kept": 3})
    before = _config.settings()
    refusal = limits_refusal(limits)
    if refusal is None:
        aiosem.configure(limits=limits)
        assert _config.settings().limits == {**before.limits, **limits}
        return
    with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
        aiosem.configure(limits=limits)
    assert _config.settings() == before


@FUZZ_MORE
@given(rates=rates_mappings)
# Each part is refused on its own before the interval they make together: found by the fuzzing.
@example(rates={"0": (1, 1_000_000_001.0, 0)})
def test_configure_takes_a_rates_mapping_whole_or_refuses_it_changing_nothing(rates: Any) -> None:
    aiosem.configure(rates={"kept": 2})
    before = _config.settings()
    refusal = rates_refusal(rates)
    if refusal is None:
        aiosem.configure(rates=rates)
        assert set(_config.settings().rates) == {*before.rates, *rates}
        return
    with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
        aiosem.configure(rates=rates)
    assert _config.settings() == before


# --- the recipes --------------------------------------------------------------------------

#: Each recipe, with a valid call; the fuzzing replaces one argument.
RECIPE_CALLS: dict[str, dict[str, object]] = {
    "acquire_semaphore": {"semname": "fuzzed", "limit": 2},
    "acquire_fair_semaphore": {"semname": "fuzzed", "limit": 2},
    "acquire_semaphore_with_lock": {"semname": "fuzzed", "limit": 2},
    "release_semaphore": {"semname": "fuzzed", "identifier": "0" * 32},
    "release_fair_semaphore": {"semname": "fuzzed", "identifier": "0" * 32},
    "refresh_fair_semaphore": {"semname": "fuzzed", "identifier": "0" * 32},
    "acquire_lock": {"lockname": "fuzzed", "acquire_timeout": 0},
    "acquire_lock_with_timeout": {"lockname": "fuzzed", "acquire_timeout": 0, "lock_timeout": 1},
    "release_lock": {"lockname": "fuzzed", "identifier": "0" * 32},
}
NAMES = {"semname", "identifier", "lockname"}


def recipe_refusal(  # noqa: PLR0911 -- one return per refusal, as in the checks
    argument: str, value: object
) -> tuple[type[Exception], str] | None:
    if argument in NAMES:
        return name_refusal(value, argument)
    if argument == "limit":
        return limit_refusal(value, none_means_configured=False)
    if argument == "now":
        # A reading of any finite size is a time; only NaN and infinity are not.
        if value is None:
            return None
        if not is_number(value):
            return TypeError, f"now must be a number of seconds, not {type_name(value)}$"
        if magnitude(value) != magnitude(value):
            return ValueError, "now must not be NaN$"
        if magnitude(value) == math.inf:
            return ValueError, "now must be finite, got "
        return None
    return duration_refusal(argument, value, wait=argument == "acquire_timeout")


@pytest.mark.parametrize(
    ("function", "argument"),
    [
        *((function, argument) for function, call in sorted(RECIPE_CALLS.items()) for argument in call),
        *((function, "timeout") for function in sorted(RECIPE_CALLS) if "semname" in RECIPE_CALLS[function]),
        *((function, "now") for function in sorted(RECIPE_CALLS) if "semname" in RECIPE_CALLS[function]),
    ],
)
@settings(FUZZ, max_examples=25)  # 31 recipe arguments: 25 values each
@given(value=any_number | any_name)
async def test_a_recipe_works_or_refuses_a_bad_argument_by_name_before_redis(
    busy: redis.asyncio.Redis, function: str, argument: str, value: object
) -> None:
    call = {**RECIPE_CALLS[function], argument: value}
    refusal = recipe_refusal(argument, value)
    if refusal is not None:
        async with redis_unchanged(busy):
            with pytest.raises(refusal[0], match=f"^{refusal[1]}"):
                await getattr(recipes, function)(busy, **call)
        return
    with anyio.fail_after(10):
        result = await getattr(recipes, function)(busy, **call)
    assert result is None or isinstance(result, (str, bool))
    await busy.delete("fuzzed", "fuzzed:owner", "fuzzed:counter", "fuzzed:limit", "lock:fuzzed")
