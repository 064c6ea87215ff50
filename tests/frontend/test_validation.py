"""Bad arguments are refused at once, by a message naming the argument, and leave Redis untouched.

Every rejected call runs against a real server and fakeredis, and each test
then checks that Redis holds no keys: nothing was sent before the refusal.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio

from aiosem import (
    AsyncFairSemaphore,
    AsyncLockedSemaphore,
    AsyncRateLimiter,
    Permit,
    limit_concurrency,
    limiter,
    recipes,
)
from aiosem._protocol import Step
from tests.harness.support import record_steps, unrestricted

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]

NAN = math.nan
INF = math.inf


def positive_seconds(argument: str, value: object) -> str:
    return re.escape(f"{argument} must be a positive, finite number of seconds, got {value}")


#: (bad arguments, error, message): the message is matched in full.
BAD_CONSTRUCTOR_ARGUMENTS = [
    pytest.param({"limit": 0}, ValueError, "limit must be at least 1, got 0", id="limit=0"),
    pytest.param({"limit": -1}, ValueError, "limit must be at least 1, got -1", id="limit=-1"),
    pytest.param({"limit": 1.5}, TypeError, "limit must be an int, not float", id="limit=1.5"),
    pytest.param({"limit": True}, TypeError, "limit must be an int, not bool", id="limit=True"),
    pytest.param({"limit": "3"}, TypeError, "limit must be an int, not str", id="limit='3'"),
    pytest.param({"timeout": 0}, ValueError, positive_seconds("timeout", 0), id="timeout=0"),
    pytest.param({"timeout": -1}, ValueError, positive_seconds("timeout", -1), id="timeout=-1"),
    pytest.param({"timeout": NAN}, ValueError, "timeout must not be NaN", id="timeout=nan"),
    pytest.param({"timeout": INF}, ValueError, positive_seconds("timeout", INF), id="timeout=inf"),
    pytest.param(
        {"timeout": 1e300}, ValueError, "timeout must be at most 1e[+]09 seconds, got 1e[+]300", id="timeout=1e300"
    ),
    pytest.param({"timeout": True}, TypeError, "timeout must be a number of seconds, not bool", id="timeout=True"),
    pytest.param({"timeout": "10"}, TypeError, "timeout must be a number of seconds, not str", id="timeout='10'"),
    pytest.param(
        {"blocking_timeout": -1},
        ValueError,
        "blocking_timeout must not be negative, got -1",
        id="blocking_timeout=-1",
    ),
    pytest.param({"blocking_timeout": NAN}, ValueError, "blocking_timeout must not be NaN", id="blocking_timeout=nan"),
    pytest.param(
        {"blocking_timeout": "1"},
        TypeError,
        "blocking_timeout must be a number of seconds, not str",
        id="blocking_timeout='1'",
    ),
    pytest.param({"name": ""}, ValueError, "name must not be empty", id="name=''"),
    pytest.param({"name": 5}, TypeError, "name must be a str, not int", id="name=5"),
    pytest.param({"name": b"x"}, TypeError, "name must be a str, not bytes", id="name=b'x'"),
    pytest.param({"name": None}, TypeError, "name must be a str, not NoneType", id="name=None"),
    pytest.param({"prefix": ""}, ValueError, "prefix must not be empty", id="prefix=''"),
    pytest.param(
        {"prefix": "a{b"}, ValueError, re.escape("prefix must not contain '{' or '}', got 'a{b'"), id="prefix='a{b'"
    ),
    pytest.param(
        {"prefix": "a}b"}, ValueError, re.escape("prefix must not contain '{' or '}', got 'a}b'"), id="prefix='a}b'"
    ),
    pytest.param({"prefix": 7}, TypeError, "prefix must be a str, not int", id="prefix=7"),
    pytest.param({"clock": 3}, TypeError, "clock must be callable or None, not int", id="clock=3"),
    pytest.param({"clock": "time"}, TypeError, "clock must be callable or None, not str", id="clock='time'"),
    pytest.param({"label": 5}, TypeError, "label must be a str or None, not int", id="label=5"),
    pytest.param({"label": ""}, ValueError, "label must be 1 to 64 characters long, got 0", id="label=''"),
    pytest.param({"label": "x" * 65}, ValueError, "label must be 1 to 64 characters long, got 65", id="label=65 chars"),
    pytest.param(
        {"label": "two\nlines"},
        ValueError,
        re.escape("label must be printable, without control characters; it has '\\n'"),
        id="label with a newline",
    ),
    pytest.param(
        {"label": "lone \ud800"},
        ValueError,
        re.escape("label must be printable, without control characters; it has '\\ud800'"),
        id="label with a lone surrogate",
    ),
]

BAD_LOCK_TIMEOUTS = [
    pytest.param(0, ValueError, positive_seconds("lock_timeout", 0), id="0"),
    pytest.param(-1, ValueError, positive_seconds("lock_timeout", -1), id="-1"),
    pytest.param(NAN, ValueError, "lock_timeout must not be NaN", id="nan"),
    pytest.param(INF, ValueError, positive_seconds("lock_timeout", INF), id="inf"),
    pytest.param("1", TypeError, "lock_timeout must be a number of seconds, not str", id="'1'"),
    pytest.param(1e300, ValueError, "lock_timeout must be at most 1e[+]09 seconds, got 1e[+]300", id="1e300"),
]

BAD_WAITS = [
    pytest.param(-1, ValueError, "blocking_timeout must not be negative, got -1", id="-1"),
    pytest.param(-INF, ValueError, "blocking_timeout must not be negative, got -inf", id="-inf"),
    pytest.param(NAN, ValueError, "blocking_timeout must not be NaN", id="nan"),
    pytest.param(True, TypeError, "blocking_timeout must be a number of seconds, not bool", id="True"),
]


async def assert_untouched(client: redis.asyncio.Redis) -> None:
    async with unrestricted(client) as admin:
        assert await admin.keys("*") == []


# -- the semaphore classes ----------------------------------------------------


@pytest.mark.parametrize(("bad", "error", "message"), BAD_CONSTRUCTOR_ARGUMENTS)
async def test_a_bad_constructor_argument_is_refused(
    cls: SemaphoreClass, client: redis.asyncio.Redis, bad: dict[str, Any], error: type[Exception], message: str
) -> None:
    arguments: dict[str, Any] = {"name": "sem", "limit": 2, **bad}
    with pytest.raises(error, match=f"^{message}$"):
        cls(client, **arguments)
    await assert_untouched(client)


def not_an_asyncio_client(kind: str) -> object:
    """What a user may pass where an asyncio client belongs."""
    if kind == "synchronous":
        return redis.Redis()  # never connected: construction must refuse it first
    return {"none": None, "url": "redis://localhost:6379/0"}[kind]


@pytest.mark.parametrize("by_name", [limit_concurrency, limiter])
def test_a_bad_label_is_refused_by_name_as_by_the_classes(by_name: Any) -> None:
    with pytest.raises(ValueError, match=r"^label must be 1 to 64 characters long, got 0$"):
        by_name("labelled", 1, label="")


@pytest.mark.parametrize("kind", ["none", "synchronous", "url"])
@pytest.mark.parametrize("public", [AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter])
def test_a_client_that_is_not_an_asyncio_client_is_refused_at_construction(
    public: type[AsyncFairSemaphore | AsyncLockedSemaphore | AsyncRateLimiter], kind: str
) -> None:
    client = not_an_asyncio_client(kind)
    with pytest.raises(TypeError, match=r"^client must be a redis\.asyncio\.Redis or RedisCluster .*, not "):
        public(client, "sem", 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("public", [AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter])
async def test_an_unknown_keyword_is_refused_in_the_public_class_name(
    public: type[AsyncFairSemaphore | AsyncLockedSemaphore | AsyncRateLimiter], client: redis.asyncio.Redis
) -> None:
    message = rf"^{public.__name__}\.__init__\(\) got an unexpected keyword argument 'loop'$"
    with pytest.raises(TypeError, match=message):
        public(client, "sem", 1, loop=None)  # type: ignore[call-arg]
    await assert_untouched(client)


@pytest.mark.parametrize(("lock_timeout", "error", "message"), BAD_LOCK_TIMEOUTS)
async def test_a_bad_lock_timeout_is_refused(
    client: redis.asyncio.Redis, lock_timeout: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        AsyncLockedSemaphore(client, "sem", 2, lock_timeout=lock_timeout)  # type: ignore[arg-type]
    await assert_untouched(client)


@pytest.mark.parametrize(("blocking_timeout", "error", "message"), BAD_WAITS)
async def test_a_bad_blocking_timeout_is_refused_by_acquire(
    cls: SemaphoreClass, client: redis.asyncio.Redis, blocking_timeout: object, error: type[Exception], message: str
) -> None:
    sem = cls(client, "sem", 2)
    with pytest.raises(error, match=f"^{message}$"):
        await sem.acquire(blocking_timeout=blocking_timeout)  # type: ignore[arg-type]
    await assert_untouched(client)


@pytest.mark.parametrize(("blocking_timeout", "error", "message"), BAD_WAITS)
async def test_a_bad_blocking_timeout_is_refused_by_acquire_even_without_blocking(
    cls: SemaphoreClass, client: redis.asyncio.Redis, blocking_timeout: object, error: type[Exception], message: str
) -> None:
    sem = cls(client, "sem", 2)
    with pytest.raises(error, match=f"^{message}$"):
        await sem.acquire(blocking=False, blocking_timeout=blocking_timeout)  # type: ignore[arg-type]
    await assert_untouched(client)


@pytest.mark.parametrize("operation", ["release", "refresh"])
@pytest.mark.parametrize(
    ("not_a_permit", "type_name"), [("0" * 32, "str"), (None, "NoneType"), (("sem", "0" * 32, 1, "k"), "tuple")]
)
async def test_release_and_refresh_refuse_what_is_not_a_permit(
    cls: SemaphoreClass, client: redis.asyncio.Redis, operation: str, not_a_permit: object, type_name: str
) -> None:
    sem = cls(client, "sem", 2)
    with pytest.raises(TypeError, match=f"^permit must be a Permit, not {type_name}$"):
        await getattr(sem, operation)(not_a_permit)
    await assert_untouched(client)


@pytest.mark.parametrize("operation", ["release", "refresh"])
@pytest.mark.parametrize(
    ("other_name", "other_prefix"), [("other", "aiosem"), ("sem", "other")], ids=["other-name", "other-prefix"]
)
async def test_release_and_refresh_refuse_a_permit_of_another_semaphore(
    cls: SemaphoreClass, client: redis.asyncio.Redis, operation: str, other_name: str, other_prefix: str
) -> None:
    sem = cls(client, "sem", 2)
    other = cls(client, other_name, 2, prefix=other_prefix)
    permit = Permit(other_name, secrets.token_hex(16), 1, other.key)
    message = f"permit belongs to the semaphore at {other.key!r}, not to this one at {sem.key!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        await getattr(sem, operation)(permit)
    await assert_untouched(client)


# -- blocking_timeout: 0 tries once, None and infinity wait for ever ----------


async def test_infinity_is_stored_as_none(cls: SemaphoreClass, client: redis.asyncio.Redis) -> None:
    assert cls(client, "sem", 1, blocking_timeout=INF).blocking_timeout is None


async def test_none_is_the_default_blocking_timeout(cls: SemaphoreClass, client: redis.asyncio.Redis) -> None:
    assert cls(client, "sem", 1).blocking_timeout is None


@pytest.mark.parametrize("seconds", [0, 0.0, 2, 2.5])
async def test_a_finite_blocking_timeout_is_stored_as_a_float(
    cls: SemaphoreClass, client: redis.asyncio.Redis, seconds: float
) -> None:
    stored = cls(client, "sem", 1, blocking_timeout=seconds).blocking_timeout
    assert stored == seconds
    assert isinstance(stored, float)


@pytest.fixture
def count_steps(cls: SemaphoreClass, monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Record every atomic step the semaphores of ``cls`` run."""
    return record_steps(cls, monkeypatch)


async def test_a_zero_blocking_timeout_tries_once(
    cls: SemaphoreClass, client: redis.asyncio.Redis, count_steps: list[Step]
) -> None:
    sem = cls(client, "sem", 1, blocking_timeout=0)
    assert await sem.acquire() is not None
    count_steps.clear()
    assert await sem.acquire() is None
    assert count_steps == [Step.TRY]


async def test_a_zero_blocking_timeout_at_the_call_tries_once(
    cls: SemaphoreClass, client: redis.asyncio.Redis, count_steps: list[Step]
) -> None:
    sem = cls(client, "sem", 1)
    assert await sem.acquire() is not None
    count_steps.clear()
    assert await sem.acquire(blocking_timeout=0) is None
    assert count_steps == [Step.TRY]


async def test_a_zero_blocking_timeout_makes_async_with_fail_at_once(
    cls: SemaphoreClass, client: redis.asyncio.Redis, count_steps: list[Step]
) -> None:
    sem = cls(client, "sem", 1, blocking_timeout=0)
    assert await sem.acquire() is not None
    count_steps.clear()
    with pytest.raises(TimeoutError, match=r"^no permit of semaphore 'sem' within 0 s$"):
        async with sem:
            pytest.fail("the body must not run")
    assert count_steps == [Step.TRY]


@pytest.mark.parametrize("construct", [None, INF], ids=["None", "inf"])
async def test_an_unbounded_blocking_timeout_keeps_waiting(
    cls: SemaphoreClass, client: redis.asyncio.Redis, count_steps: list[Step], construct: float | None
) -> None:
    sem = cls(client, "sem", 1, blocking_timeout=construct)
    holder = await sem.acquire()
    assert holder is not None
    count_steps.clear()
    with anyio.move_on_after(0.3) as waited:
        await sem.acquire()
    assert waited.cancelled_caught
    assert count_steps[0] == Step.WAIT  # queued once, then waited without polling
    assert count_steps[-1] == Step.CANCEL


@pytest.mark.parametrize("at_call", [None, INF], ids=["None", "inf"])
async def test_an_unbounded_blocking_timeout_at_the_call_overrides_the_default(
    cls: SemaphoreClass, client: redis.asyncio.Redis, count_steps: list[Step], at_call: float | None
) -> None:
    sem = cls(client, "sem", 1, blocking_timeout=0)
    holder = await sem.acquire()
    assert holder is not None
    count_steps.clear()
    with anyio.move_on_after(0.3) as waited:
        await sem.acquire(blocking_timeout=at_call)
    assert waited.cancelled_caught
    assert count_steps[0] == Step.WAIT
    assert count_steps[-1] == Step.CANCEL


# -- the recipes ---------------------------------------------------------------

SEMAPHORE_ACQUIRES = ["acquire_semaphore", "acquire_fair_semaphore", "acquire_semaphore_with_lock"]
SEMAPHORE_FLAGS = ["release_semaphore", "release_fair_semaphore", "refresh_fair_semaphore"]
SEMAPHORE_RECIPES = SEMAPHORE_ACQUIRES + SEMAPHORE_FLAGS
LOCK_ACQUIRES = ["acquire_lock", "acquire_lock_with_timeout"]
LOCK_RECIPES = [*LOCK_ACQUIRES, "release_lock"]
IDENTIFIER = "0" * 32

#: A valid call of each recipe, as keyword arguments after ``conn``.
VALID_CALLS: dict[str, dict[str, object]] = {
    **{function: {"semname": "sem", "limit": 1} for function in SEMAPHORE_ACQUIRES},
    **{function: {"semname": "sem", "identifier": IDENTIFIER} for function in SEMAPHORE_FLAGS},
    **{function: {"lockname": "lk"} for function in LOCK_ACQUIRES},
    "release_lock": {"lockname": "lk", "identifier": IDENTIFIER},
}

#: (recipes, argument, bad value, error, message)
RECIPE_REFUSALS: list[tuple[list[str], str, object, type[Exception], str]] = [
    (SEMAPHORE_RECIPES, "semname", "", ValueError, "semname must not be empty"),
    (SEMAPHORE_RECIPES, "semname", None, TypeError, "semname must be a str, not NoneType"),
    (SEMAPHORE_RECIPES, "timeout", NAN, ValueError, "timeout must not be NaN"),
    (SEMAPHORE_RECIPES, "timeout", 0, ValueError, positive_seconds("timeout", 0)),
    (SEMAPHORE_RECIPES, "now", NAN, ValueError, "now must not be NaN"),
    (SEMAPHORE_RECIPES, "now", INF, ValueError, "now must be finite, got inf"),
    (SEMAPHORE_RECIPES, "now", -INF, ValueError, "now must be finite, got -inf"),
    (SEMAPHORE_RECIPES, "now", "1", TypeError, "now must be a number of seconds, not str"),
    (SEMAPHORE_ACQUIRES, "limit", 0, ValueError, "limit must be at least 1, got 0"),
    (SEMAPHORE_ACQUIRES, "limit", True, TypeError, "limit must be an int, not bool"),
    (SEMAPHORE_FLAGS, "identifier", "", ValueError, "identifier must not be empty"),
    (SEMAPHORE_FLAGS, "identifier", b"x", TypeError, "identifier must be a str, not bytes"),
    (LOCK_RECIPES, "lockname", "", ValueError, "lockname must not be empty"),
    (LOCK_RECIPES, "lockname", 5, TypeError, "lockname must be a str, not int"),
    (LOCK_ACQUIRES, "acquire_timeout", -1, ValueError, "acquire_timeout must not be negative, got -1"),
    (LOCK_ACQUIRES, "acquire_timeout", NAN, ValueError, "acquire_timeout must not be NaN"),
    (["acquire_lock_with_timeout"], "lock_timeout", 0, ValueError, positive_seconds("lock_timeout", 0)),
    (["acquire_lock_with_timeout"], "lock_timeout", INF, ValueError, positive_seconds("lock_timeout", INF)),
    (["release_lock"], "identifier", "", ValueError, "identifier must not be empty"),
]


@pytest.mark.parametrize(
    ("function", "bad", "error", "message"),
    [
        pytest.param(function, {argument: value}, error, message, id=f"{function}-{argument}={value!r}")
        for functions, argument, value, error, message in RECIPE_REFUSALS
        for function in functions
    ],
)
async def test_a_recipe_refuses_a_bad_argument(
    client: redis.asyncio.Redis, function: str, bad: dict[str, object], error: type[Exception], message: str
) -> None:
    arguments = {**VALID_CALLS[function], **bad}
    with pytest.raises(error, match=f"^{message}$"):
        await getattr(recipes, function)(client, **arguments)
    await assert_untouched(client)


@pytest.mark.parametrize("function", sorted(VALID_CALLS))
async def test_the_valid_recipe_calls_above_are_accepted(client: redis.asyncio.Redis, function: str) -> None:
    # So each refusal above is due to the one bad argument, not to the rest of the call.
    await getattr(recipes, function)(client, **VALID_CALLS[function])


async def test_a_zero_acquire_timeout_tries_the_lock_once(client: redis.asyncio.Redis) -> None:
    assert await recipes.acquire_lock_with_timeout(client, "lk", acquire_timeout=0) is not None
    with anyio.fail_after(1):
        assert await recipes.acquire_lock_with_timeout(client, "lk", acquire_timeout=0) is None
