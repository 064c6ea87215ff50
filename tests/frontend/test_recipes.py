"""aiosem.recipes: the book's nine functions, each step atomic and on the server's clock.

Every test runs on a real server and on fakeredis. The first part is what each
recipe does; the second, one test per fault of the book's code that the
recipes fix -- with, where the fault can be shown in one step, the book's
behaviour beside it (from `tests.harness.book_client`).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pytest

from aiosem import recipes
from tests.harness import book_client as book

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import redis.asyncio

R = TypeVar("R")

#: A client-side time for ``now=``: the leases below start here.
T = 1_700_000_000.0


class Acquire(Protocol):
    async def __call__(
        self, conn: redis.asyncio.Redis, semname: str, limit: int, timeout: float = 10, *, now: float | None = None
    ) -> str | None: ...


class Release(Protocol):
    async def __call__(
        self, conn: redis.asyncio.Redis, semname: str, identifier: str, timeout: float = 10, *, now: float | None = None
    ) -> bool: ...


class LockAcquire(Protocol):
    async def __call__(self, conn: redis.asyncio.Redis, lockname: str, acquire_timeout: float = 10) -> str | None: ...


#: Each semaphore recipe with the release that goes with it.
SEMAPHORES = [
    pytest.param(recipes.acquire_semaphore, recipes.release_semaphore, id="basic"),
    pytest.param(recipes.acquire_fair_semaphore, recipes.release_fair_semaphore, id="fair"),
    pytest.param(recipes.acquire_semaphore_with_lock, recipes.release_fair_semaphore, id="with_lock"),
]

#: The semaphore recipes alone, for tests that never release.
ACQUIRES = [pytest.param(param.values[0], id=param.id) for param in SEMAPHORES]

LOCKS = [
    pytest.param(recipes.acquire_lock, id="acquire_lock"),
    pytest.param(recipes.acquire_lock_with_timeout, id="acquire_lock_with_timeout"),
]


@pytest.fixture
def sent(client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The commands the client sends from now on, as text (pipelines aside)."""
    commands: list[str] = []
    original: Callable[..., Awaitable[Any]] = client.execute_command

    async def spy(*args: Any, **options: Any) -> Any:
        commands.append(" ".join(str(arg) for arg in args))
        return await original(*args, **options)

    monkeypatch.setattr(client, "execute_command", spy)
    return commands


def names(commands: list[str]) -> list[str]:
    return [command.split()[0].upper() for command in commands]


async def timed(call: Callable[[], Awaitable[R]]) -> tuple[R, float]:
    started = time.monotonic()
    result = await call()
    return result, time.monotonic() - started


# What each recipe does


@pytest.mark.parametrize("acquire", ACQUIRES)
async def test_a_semaphore_grants_up_to_its_limit_then_returns_none(
    client: redis.asyncio.Redis, acquire: Acquire
) -> None:
    first = await acquire(client, "sem", 2)
    second = await acquire(client, "sem", 2)
    assert first is not None
    assert second is not None
    assert first != second
    assert await acquire(client, "sem", 2) is None


@pytest.mark.parametrize("acquire", ACQUIRES)
async def test_identifiers_are_32_hex_digits(client: redis.asyncio.Redis, acquire: Acquire) -> None:
    identifier = await acquire(client, "sem", 1)
    assert identifier is not None
    assert re.fullmatch("[0-9a-f]{32}", identifier)


@pytest.mark.parametrize(("acquire", "release"), SEMAPHORES)
async def test_release_is_true_once_then_false(client: redis.asyncio.Redis, acquire: Acquire, release: Release) -> None:
    identifier = await acquire(client, "sem", 1)
    assert identifier is not None
    assert await release(client, "sem", identifier) is True
    assert await release(client, "sem", identifier) is False


@pytest.mark.parametrize(("acquire", "release"), SEMAPHORES)
async def test_a_released_permit_can_be_taken_again(
    client: redis.asyncio.Redis, acquire: Acquire, release: Release
) -> None:
    identifier = await acquire(client, "sem", 1)
    assert identifier is not None
    await release(client, "sem", identifier)
    assert await acquire(client, "sem", 1) is not None


async def test_the_fair_semaphore_keeps_the_books_layout(client: redis.asyncio.Redis) -> None:
    first = await recipes.acquire_fair_semaphore(client, "sem", 2, now=T)
    second = await recipes.acquire_fair_semaphore(client, "sem", 2, now=T + 1)
    assert first is not None
    assert second is not None
    assert await client.zrange("sem", 0, -1, withscores=True) == [(first.encode(), T), (second.encode(), T + 1)]
    # Owners are scored by the counter, which never falls below the clock in microseconds.
    tokens = [int(T * 1_000_000), int((T + 1) * 1_000_000)]
    assert await client.zrange("sem:owner", 0, -1, withscores=True) == [
        (first.encode(), tokens[0]),
        (second.encode(), tokens[1]),
    ]
    assert await client.get("sem:counter") == str(tokens[1]).encode()


async def test_refresh_is_true_while_the_permit_is_held(client: redis.asyncio.Redis) -> None:
    identifier = await recipes.acquire_fair_semaphore(client, "sem", 1)
    assert identifier is not None
    assert await recipes.refresh_fair_semaphore(client, "sem", identifier) is True
    assert await recipes.refresh_fair_semaphore(client, "sem", identifier) is True


async def test_refresh_restarts_the_lease(client: redis.asyncio.Redis) -> None:
    identifier = await recipes.acquire_fair_semaphore(client, "sem", 1, 10, now=T)
    assert identifier is not None
    assert await recipes.refresh_fair_semaphore(client, "sem", identifier, 10, now=T + 9) is True
    assert await recipes.acquire_fair_semaphore(client, "sem", 1, 10, now=T + 18) is None
    assert await client.zscore("sem", identifier) == T + 9


async def test_refresh_of_a_released_permit_is_false(client: redis.asyncio.Redis) -> None:
    identifier = await recipes.acquire_fair_semaphore(client, "sem", 1)
    assert identifier is not None
    await recipes.release_fair_semaphore(client, "sem", identifier)
    assert await recipes.refresh_fair_semaphore(client, "sem", identifier) is False
    assert await client.zcard("sem") == 0


@pytest.mark.parametrize("acquire", LOCKS)
async def test_a_free_lock_is_taken_at_once(client: redis.asyncio.Redis, acquire: LockAcquire) -> None:
    identifier, elapsed = await timed(lambda: acquire(client, "job"))
    assert identifier is not None
    assert await client.get("lock:job") == identifier.encode()
    assert elapsed < 0.5


@pytest.mark.parametrize("acquire", LOCKS)
async def test_a_held_lock_makes_acquire_return_none_after_acquire_timeout(
    client: redis.asyncio.Redis, acquire: LockAcquire
) -> None:
    assert await acquire(client, "job") is not None
    result, elapsed = await timed(lambda: acquire(client, "job", acquire_timeout=0.2))
    assert result is None
    assert 0.2 <= elapsed < 1.2


@pytest.mark.parametrize("acquire", LOCKS)
async def test_release_lock_is_true_once_then_false(client: redis.asyncio.Redis, acquire: LockAcquire) -> None:
    identifier = await acquire(client, "job")
    assert identifier is not None
    assert await recipes.release_lock(client, "job", identifier) is True
    assert await client.exists("lock:job") == 0
    assert await recipes.release_lock(client, "job", identifier) is False


async def test_acquire_lock_sets_no_timeout(client: redis.asyncio.Redis) -> None:
    assert await recipes.acquire_lock(client, "job") is not None
    assert await client.pttl("lock:job") == -1


# The book's faults, fixed


async def test_refresh_of_an_expired_permit_is_false_and_leaves_no_trace(client: redis.asyncio.Redis) -> None:
    identifier = await recipes.acquire_fair_semaphore(client, "sem", 1, 10, now=T)
    assert identifier is not None
    assert await recipes.refresh_fair_semaphore(client, "sem", identifier, 10, now=T + 11) is False
    assert await client.zscore("sem", identifier) is None
    assert await client.zscore("sem:owner", identifier) is None


@pytest.mark.unrestricted
async def test_the_books_refresh_revives_an_expired_permit(client: redis.asyncio.Redis) -> None:
    # The fault fixed above: nobody has reaped the expired permit yet, so the
    # book's ZADD finds it, restarts its lease and reports it held.
    identifier = await book.acquire_fair_semaphore(client, "sem", 1, 10, clock=lambda: T)
    assert identifier is not None
    assert await book.refresh_fair_semaphore(client, "sem", identifier, clock=lambda: T + 11) is True
    assert await client.zscore("sem", identifier) == T + 11
    assert await client.zscore("sem:owner", identifier) == 1


async def test_release_lock_with_a_wrong_identifier_is_false_and_keeps_the_lock(
    client: redis.asyncio.Redis,
) -> None:
    identifier = await recipes.acquire_lock(client, "job")
    assert identifier is not None
    assert await recipes.release_lock(client, "job", "not-the-owner") is False
    assert await client.get("lock:job") == identifier.encode()


async def test_release_lock_deletes_only_lock_plus_name(
    client: redis.asyncio.Redis, client_admin: redis.asyncio.Redis
) -> None:
    # One widespread transcription of listing 6.9 releases 'locked:...' keys.
    identifier = await recipes.acquire_lock(client, "job")
    assert identifier is not None
    bystanders = ["job", "locked:job", f"locked:{identifier}", "lock:job:other"]
    for key in bystanders:
        await client.set(key, identifier)
    assert await recipes.release_lock(client, "job", identifier) is True
    assert sorted(await client_admin.keys("*")) == sorted(key.encode() for key in bystanders)


async def test_acquire_lock_with_timeout_sets_key_and_ttl_in_one_command(
    client: redis.asyncio.Redis, sent: list[str]
) -> None:
    assert await recipes.acquire_lock_with_timeout(client, "job", lock_timeout=0.5) is not None
    assert names(sent) == ["SET"]
    assert 0 < await client.pttl("lock:job") <= 500


@pytest.mark.unrestricted
async def test_the_books_lock_with_timeout_takes_two_commands_and_whole_seconds(
    client: redis.asyncio.Redis, sent: list[str]
) -> None:
    # The fault fixed above: a crash between SETNX and EXPIRE leaves a lock
    # that never expires.
    assert await book.acquire_lock_with_timeout(client, "job", lock_timeout=0.5)
    assert names(sent) == ["SETNX", "EXPIRE"]
    assert 500 < await client.pttl("lock:job") <= 1000


async def test_acquire_semaphore_with_lock_leaves_no_lock_after_success(client: redis.asyncio.Redis) -> None:
    assert await recipes.acquire_semaphore_with_lock(client, "sem", 1) is not None
    assert await client.exists("lock:sem") == 0


async def test_acquire_semaphore_with_lock_leaves_no_lock_after_refusal(client: redis.asyncio.Redis) -> None:
    assert await recipes.acquire_semaphore_with_lock(client, "sem", 1) is not None
    assert await recipes.acquire_semaphore_with_lock(client, "sem", 1) is None
    assert await client.exists("lock:sem") == 0


async def test_acquire_semaphore_with_lock_returns_none_while_another_holds_the_lock(
    client: redis.asyncio.Redis,
) -> None:
    await client.set("lock:sem", "someone else")
    assert await recipes.acquire_semaphore_with_lock(client, "sem", 1) is None
    assert await client.get("lock:sem") == b"someone else"
    assert await client.zcard("sem") == 0


async def test_the_lock_of_acquire_semaphore_with_lock_expires_if_its_holder_dies(
    client: redis.asyncio.Redis, sent: list[str]
) -> None:
    # The book's lock (listing 6.8) has no timeout: a holder that dies
    # between lock and release blocks the semaphore for good.
    assert await recipes.acquire_semaphore_with_lock(client, "sem", 1) is not None
    lock_command = next(command for command in sent if command.startswith("SET "))
    assert "PX" in lock_command.split()


async def test_a_refused_basic_acquire_leaves_no_trace(client: redis.asyncio.Redis) -> None:
    holder = await recipes.acquire_semaphore(client, "sem", 1, now=T)
    assert holder is not None
    assert await recipes.acquire_semaphore(client, "sem", 1, now=T + 1) is None
    assert await client.zrange("sem", 0, -1, withscores=True) == [(holder.encode(), T)]


async def test_a_refused_fair_acquire_leaves_no_trace(client: redis.asyncio.Redis) -> None:
    holder = await recipes.acquire_fair_semaphore(client, "sem", 1)
    assert holder is not None
    assert await recipes.acquire_fair_semaphore(client, "sem", 1) is None
    assert await client.zcard("sem") == 1
    assert await client.zcard("sem:owner") == 1
    assert await client.get("sem:counter") == str(int(await client.zscore("sem:owner", holder) or 0)).encode()


@pytest.mark.unrestricted
async def test_the_books_refused_fair_acquire_bumps_the_counter(client: redis.asyncio.Redis) -> None:
    # The fault fixed above: the book's INCR comes before it knows it is refused.
    assert await book.acquire_fair_semaphore(client, "sem", 1) is not None
    assert await book.acquire_fair_semaphore(client, "sem", 1) is None
    assert await client.get("sem:counter") == b"2"


@pytest.mark.parametrize(("acquire", "release"), SEMAPHORES)
async def test_release_of_an_expired_permit_is_false(
    client: redis.asyncio.Redis, acquire: Acquire, release: Release
) -> None:
    identifier = await acquire(client, "sem", 1, 10, now=T)
    assert identifier is not None
    assert await release(client, "sem", identifier, 10, now=T + 10) is False


async def test_basic_release_reaps_expired_permits(client: redis.asyncio.Redis) -> None:
    expired = await recipes.acquire_semaphore(client, "sem", 2, 10, now=T)
    live = await recipes.acquire_semaphore(client, "sem", 2, 10, now=T + 5)
    assert expired is not None
    assert live is not None
    assert await recipes.release_semaphore(client, "sem", live, 10, now=T + 11) is True
    assert await client.exists("sem") == 0


@pytest.mark.parametrize("acquire", ACQUIRES)
async def test_now_opts_into_the_client_clock(client: redis.asyncio.Redis, acquire: Acquire) -> None:
    assert await acquire(client, "sem", 1, 10, now=T) is not None
    assert await acquire(client, "sem", 1, 10, now=T + 9.9) is None
    assert await acquire(client, "sem", 1, 10, now=T + 10) is not None


@pytest.mark.parametrize(("acquire", "release"), SEMAPHORES)
async def test_the_recipes_read_the_server_clock_by_default(
    real_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch, acquire: Acquire, release: Release
) -> None:
    # fakeredis runs in this process and reads the patched clock: real servers only.
    identifier = await acquire(real_client, "sem", 1, 10)
    assert identifier is not None
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    assert await acquire(real_client, "sem", 1, 10) is None
    assert await release(real_client, "sem", identifier, 10) is True


async def test_refresh_reads_the_server_clock_by_default(
    real_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    identifier = await recipes.acquire_fair_semaphore(real_client, "sem", 1, 10)
    assert identifier is not None
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    assert await recipes.refresh_fair_semaphore(real_client, "sem", identifier, 10) is True
