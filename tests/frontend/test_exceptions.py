"""The exceptions: a hierarchy under SemaphoreError, messages that name the semaphore, and pickling.

A worker process (a `ProcessPoolExecutor`, multiprocessing, a task queue)
sends its exception back pickled: every aiosem exception must come back
whole, with its message and its attributes.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import pytest
import redis
import redis.asyncio

from aiosem import (
    AcquireTimeout,
    AsyncFairSemaphore,
    AsyncLockedSemaphore,
    AsyncRateLimiter,
    LimitMismatch,
    NotReplicated,
    OutOfMemory,
    PermitLost,
    RedisUnavailable,
    SemaphoreError,
)
from aiosem._urls import close, connect

if TYPE_CHECKING:
    from tests.harness.support import RedisServer

EXAMPLES = [
    pytest.param(SemaphoreError("semaphore 'db' stayed busy", name="db"), id="SemaphoreError"),
    pytest.param(AcquireTimeout(name="db", blocking_timeout=1.5), id="AcquireTimeout"),
    pytest.param(LimitMismatch(name="db", limit=3, stored_limit=5), id="LimitMismatch"),
    pytest.param(NotReplicated(name="db", replicas=2, acknowledged=1), id="NotReplicated"),
    pytest.param(OutOfMemory(name="db", reply="command not allowed when used memory > 'maxmemory'."), id="OutOfMemory"),
    pytest.param(PermitLost(name="db", identifier="0123abcd.4567ef"), id="PermitLost"),
    pytest.param(
        RedisUnavailable(name="db", address="redis://:***@localhost:6390/0", detail="Connection refused"),
        id="RedisUnavailable",
    ),
]


@pytest.mark.parametrize("error", EXAMPLES)
def test_every_exception_is_a_semaphore_error_naming_its_semaphore(error: SemaphoreError) -> None:
    assert isinstance(error, SemaphoreError)
    assert error.name == "db"
    assert "'db'" in str(error)


@pytest.mark.parametrize("error", EXAMPLES)
def test_an_exception_comes_back_whole_from_a_pickle(error: SemaphoreError) -> None:
    again = pickle.loads(pickle.dumps(error))  # noqa: S301 -- our own bytes
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert again.args == error.args
    assert vars(again) == vars(error)


def test_an_acquire_timeout_is_a_timeout_error_too() -> None:
    error = AcquireTimeout(name="db", blocking_timeout=1.5)
    assert isinstance(error, TimeoutError)
    assert str(error) == "no permit of semaphore 'db' within 1.5 s"
    assert error.blocking_timeout == 1.5


def test_a_lost_permit_names_its_identifier() -> None:
    error = PermitLost(name="db", identifier="0123abcd.4567ef")
    assert error.identifier == "0123abcd.4567ef"
    assert str(error) == "permit 0123abcd.4567ef of semaphore 'db' was lost: its lease ran out"


def test_a_refusal_for_memory_is_redis_pys_out_of_memory_error_too() -> None:
    error = OutOfMemory(name="db", reply="command not allowed when used memory > 'maxmemory'.")
    assert isinstance(error, redis.exceptions.OutOfMemoryError)
    assert isinstance(error, redis.ResponseError)
    assert str(error) == (
        "Redis refused a step of semaphore 'db': its memory is full (used memory > maxmemory, and its "
        "maxmemory-policy evicts nothing more); free memory or raise maxmemory"
    )
    assert error.reply == "command not allowed when used memory > 'maxmemory'."
    assert repr(error) == f"OutOfMemory({str(error)!r})"


def test_a_refusal_for_memory_of_a_rate_limiter_names_the_limiter() -> None:
    error = OutOfMemory(name="api", reply="", what="rate limiter")
    assert str(error).startswith("Redis refused a step of rate limiter 'api': its memory is full")


def test_a_redis_out_of_reach_is_redis_pys_connection_error_too() -> None:
    error = RedisUnavailable(name="db", address="redis://:***@localhost:6390/0", detail="Connection refused")
    assert isinstance(error, redis.ConnectionError)
    assert str(error) == "Redis at redis://:***@localhost:6390/0 is unreachable, for semaphore 'db': Connection refused"
    assert error.address == "redis://:***@localhost:6390/0"


@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore])
@pytest.mark.parametrize("blocking", [False, True], ids=["try", "wait"])
async def test_a_step_that_cannot_reach_redis_raises_redis_unavailable_naming_it(
    cls: type[AsyncFairSemaphore | AsyncLockedSemaphore], refusing_port: int, blocking: bool
) -> None:
    client = redis.asyncio.Redis(host="127.0.0.1", port=refusing_port, password="s3cret")
    semaphore = cls(client, "db", 1)
    try:
        with pytest.raises(RedisUnavailable) as caught:
            await semaphore.acquire(blocking=blocking, blocking_timeout=10)
    finally:
        await semaphore.aclose()
        await client.aclose()
    assert str(caught.value).startswith(
        f"Redis at redis://:***@127.0.0.1:{refusing_port}/0 is unreachable, for semaphore 'db': "
    )
    assert caught.value.__suppress_context__
    assert isinstance(caught.value.__context__, redis.ConnectionError)


async def test_a_rate_limiter_that_cannot_reach_redis_raises_redis_unavailable_naming_it(refusing_port: int) -> None:
    # A client from a URL, as configure() makes: redis-py's default one retries a refused
    # connection for longer than a step's bound, which then ends the call with a TimeoutError.
    client = connect(f"redis://127.0.0.1:{refusing_port}/0")
    limiter = AsyncRateLimiter(client, "api", 5)
    try:
        with pytest.raises(RedisUnavailable, match=r"is unreachable, for rate limiter 'api': "):
            await limiter.acquire(blocking=False)
    finally:
        await limiter.aclose()
        await close(client)


async def test_credentials_redis_refuses_stay_redis_pys_authentication_error(redis_server: RedisServer) -> None:
    client = redis.asyncio.Redis(host=redis_server.host, port=redis_server.port, username="nobody", password="wrong")
    semaphore = AsyncFairSemaphore(client, "db", 1)
    try:
        with pytest.raises(redis.AuthenticationError):
            await semaphore.acquire(blocking=False)
    finally:
        await semaphore.aclose()
        await client.aclose()
