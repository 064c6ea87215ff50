"""``python -m aiosem status``, ``limit`` and ``reset``, against real ``redis-server`` processes.

The command line runs in-process through `main` (in a worker thread when the
test's own event loop holds permits: `main` runs an event loop of its own),
and as a user runs it, as ``python -m aiosem``, where the whole process's
output matters.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import io
import json
import multiprocessing
import os
import re
import secrets
import signal
import socket
import string
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import redis.asyncio
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, PermitLost, SemaphoreError, recipes
from aiosem.__main__ import _describe, main, redact
from aiosem._keys import SemaphoreKeys
from aiosem._status import name_of
from tests.harness.support import FakeClock, until_queued

if TYPE_CHECKING:
    from tests.harness.support import RedisServer
    from tests.harness.topology import RedisClusterGroup

Semaphore = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]
PASSWORD = "hunter2-Secret"


def unique(stem: str) -> str:
    return f"{stem}-{secrets.token_hex(4)}"


async def cli(*argv: str) -> int:
    """Run the command line in a worker thread: it runs an event loop of its own."""
    return await anyio.to_thread.run_sync(main, list(argv))


async def status_of(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> dict[str, Any]:
    assert await cli("status", "--url", url, "--json", *argv) == 0
    document: dict[str, Any] = json.loads(capsys.readouterr().out)
    return document


async def one_status(capsys: pytest.CaptureFixture[str], url: str, name: str, *argv: str) -> dict[str, Any]:
    (entry,) = (await status_of(capsys, url, name, *argv))["semaphores"]
    assert entry["name"] == name
    return entry  # type: ignore[no-any-return]


def table_row(output: str, name: str) -> list[str]:
    """The cells of the summary table's row of ``name``."""
    line = next(line for line in output.splitlines() if f" {name} " in line)
    return [cell.strip() for cell in line.split("│")[1:-1]]


def flat(output: str) -> str:
    """``output`` with every run of white space made one space: a table's caption is folded to its width."""
    return " ".join(output.split())


def step_as(cls: Semaphore) -> list[str]:
    """The options of ``limit`` that make it step as ``cls`` does."""
    return ["--locked"] if cls is AsyncLockedSemaphore else []


class Terminal(io.StringIO):
    """Standard input as a person at a terminal types it."""

    def isatty(self) -> bool:
        return True


# --- status --------------------------------------------------------------------


async def test_status_shows_limit_holders_tokens_and_waiters(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("held")
    semaphore = cls(real_client, name, 2)
    first, second = await semaphore.acquire(), await semaphore.acquire()
    assert first is not None
    assert second is not None
    waiting = asyncio.create_task(semaphore.acquire(blocking_timeout=30))
    try:
        await until_queued(semaphore)
        entry = await one_status(capsys, redis_server.url, name)
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await semaphore.release(first)
        await semaphore.release(second)
        await semaphore.aclose()
    assert entry["exists"] is True
    assert entry["key"] == semaphore.key
    assert entry["limit"] == 2
    assert entry["held"] == 2
    assert [(h["identifier"], h["fencing_token"]) for h in entry["holders"]] == [
        (first.identifier, first.fencing_token),
        (second.identifier, second.fencing_token),
    ]
    assert entry["last_token"] == second.fencing_token
    assert entry["waiting"] == 1
    assert len(entry["waiters"]) == 1
    for holder in entry["holders"]:
        assert holder["expired"] is False
        assert 0 <= holder["age"] < 5
        assert 5 < holder["remaining"] <= 10
        assert holder["age"] + holder["remaining"] == pytest.approx(10, abs=1e-5)


async def test_each_holder_is_shown_with_its_own_lease(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("lease")
    long, short = cls(real_client, name, 2, timeout=30), cls(real_client, name, 2, timeout=5)
    first, second = await long.acquire(), await short.acquire()
    assert first is not None
    assert second is not None
    try:
        entry = await one_status(capsys, redis_server.url, name)  # --timeout left at 10
    finally:
        await long.release(first)
        await short.release(second)
    by_identifier = {holder["identifier"]: holder for holder in entry["holders"]}
    held_long, held_short = by_identifier[first.identifier], by_identifier[second.identifier]
    assert (held_long["lease"], held_long["lease_recorded"]) == (30, True)
    assert (held_short["lease"], held_short["lease_recorded"]) == (5, True)
    assert 25 < held_long["remaining"] <= 30
    assert 0 < held_short["remaining"] <= 5
    for holder in (held_long, held_short):
        assert holder["age"] + holder["remaining"] == pytest.approx(holder["lease"], abs=1e-5)


async def test_a_holder_is_shown_with_its_host_process_id_and_label(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("who")
    semaphore = cls(real_client, name, 1, label="billing worker")
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        entry = await one_status(capsys, redis_server.url, name)
        assert await cli("status", "--url", redis_server.url, name) == 0
    finally:
        await semaphore.release(permit)
    (holder,) = entry["holders"]
    assert (holder["host"], holder["pid"], holder["label"]) == (socket.gethostname(), os.getpid(), "billing worker")
    row = table_row(capsys.readouterr().out, permit.identifier)
    assert row[:6] == [
        str(permit.fencing_token),
        permit.identifier,
        "1",
        socket.gethostname(),
        str(os.getpid()),
        "billing worker",
    ]
    assert row[7] == "10 s"


def _hold_in_forked_child(semaphore: AsyncFairSemaphore) -> None:
    async def hold() -> None:
        assert await semaphore.acquire() is not None  # and left to its lease: the parent reads it

    asyncio.run(hold())


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
async def test_a_forked_childs_holder_is_shown_with_the_childs_process_id(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("forked")
    # Made, and its record read, in the parent; used only in the child.
    semaphore = AsyncFairSemaphore(redis.asyncio.Redis.from_url(redis_server.url), name, 1, label="child")
    assert json.loads(semaphore._settings.record())[1] == os.getpid()
    child = multiprocessing.get_context("fork").Process(target=_hold_in_forked_child, args=(semaphore,))
    child.start()
    await anyio.to_thread.run_sync(child.join, 60)
    assert child.exitcode == 0
    (holder,) = (await one_status(capsys, redis_server.url, name))["holders"]
    assert (holder["pid"], holder["label"]) == (child.pid, "child")


async def test_a_holder_without_a_label_shows_none(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("unlabelled")
    semaphore = AsyncFairSemaphore(real_client, name, 1)
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        (holder,) = (await one_status(capsys, redis_server.url, name))["holders"]
    finally:
        await semaphore.release(permit)
    assert (holder["pid"], holder["label"]) == (os.getpid(), None)


async def test_a_book_clients_holder_is_shown_with_the_lease_assumed(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("book")
    keys = SemaphoreKeys.for_name("aiosem", name)
    # The book's client records nothing of itself: its lease is what --timeout says.
    identifier = await recipes.acquire_fair_semaphore(real_client, keys.base, 2, timeout=30)
    assert identifier is not None
    try:
        entry = await one_status(capsys, redis_server.url, name, "--timeout", "30")
        assert await cli("status", "--url", redis_server.url, name, "--timeout", "30") == 0
    finally:
        await recipes.release_fair_semaphore(real_client, keys.base, identifier, timeout=30)
    (holder,) = entry["holders"]
    assert (holder["lease"], holder["lease_recorded"]) == (30, False)
    assert (holder["host"], holder["pid"], holder["label"]) == (None, None, None)
    assert 25 < holder["remaining"] <= 30
    output = capsys.readouterr().out
    assert table_row(output, identifier)[2:6] == ["1", "-", "-", "-"]
    assert table_row(output, identifier)[7] == "30 s *"
    assert "a lease marked * is assumed (--timeout 30): its holder recorded none" in flat(output)


async def test_a_lease_that_ran_out_is_shown_expired_and_not_counted(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("expired")
    # Granted on a clock 100 s behind the server's: its 10 s lease ran out
    # long ago, and nothing has reaped it yet.
    semaphore = AsyncFairSemaphore(real_client, name, 1, clock=FakeClock(time.time() - 100))
    assert await semaphore.acquire() is not None
    entry = await one_status(capsys, redis_server.url, name)
    assert entry["held"] == 0
    (holder,) = entry["holders"]
    assert holder["expired"] is True
    assert holder["remaining"] < -80
    assert await cli("status", "--url", redis_server.url, name) == 0
    assert table_row(capsys.readouterr().out, name)[2] == "0 (+1 expired)"


async def test_waiters_presumed_dead_are_not_counted(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("dead-waiter")
    keys = SemaphoreKeys.for_name("aiosem", name)
    now = time.time()
    await real_client.zadd(keys.queue, {"dead.1": 1, "live.2": 2})
    await real_client.zadd(keys.waiters, {"dead.1": now - 1, "live.2": now + 60})
    entry = await one_status(capsys, redis_server.url, name)
    assert entry["waiting"] == 1
    assert entry["waiters"] == [
        {"identifier": "live.2", "weight": 1, "ticket": 2, "place": 1, "host": None, "pid": None, "label": None}
    ]


async def test_the_rate_limiter_of_the_same_name_is_shown(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("rate")
    limiter = AsyncRateLimiter(real_client, name, 1, per=10)
    assert await limiter.acquire()
    entry = await one_status(capsys, redis_server.url, name)
    assert entry["exists"] is True
    assert entry["holders"] == []
    assert 5 < entry["rate"]["ahead"] <= 10
    assert await cli("status", "--url", redis_server.url, name) == 0
    assert table_row(capsys.readouterr().out, name)[5].endswith(" s")


async def test_a_stuck_step_lock_is_shown(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("lock")
    await real_client.set(SemaphoreKeys.for_name("aiosem", name).lock, "someone", px=60_000)
    entry = await one_status(capsys, redis_server.url, name)
    assert 50 < entry["lock"]["expires_in"] <= 60


async def test_status_reads_a_resp3_connection_alike(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("resp3")
    semaphore = AsyncFairSemaphore(real_client, name, 3)
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        resp2 = await one_status(capsys, redis_server.url, name)
        resp3 = await one_status(capsys, f"{redis_server.url}?protocol=3", name)
    finally:
        await semaphore.release(permit)
    for entry in (resp2, resp3):
        assert [(h["identifier"], h["fencing_token"]) for h in entry["holders"]] == [
            (permit.identifier, permit.fencing_token)
        ]
        assert (entry["limit"], entry["last_token"]) == (3, permit.fencing_token)


async def test_the_table_shows_each_semaphore_with_its_holder_count(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("table")
    semaphore = AsyncFairSemaphore(real_client, name, 3)
    permits = [await semaphore.acquire() for _ in range(2)]
    try:
        assert await cli("status", "--url", redis_server.url, name) == 0
    finally:
        for permit in permits:
            assert permit is not None
            await semaphore.release(permit)
    output = capsys.readouterr().out
    # name, limit, held, waiting, last token, rate ahead, lock
    last = max(permit.fencing_token for permit in permits if permit is not None)
    assert table_row(output, name) == [name, "3", "2", "0", str(last), "-", "-"]
    assert f"holders of '{name}'" in output
    assert "remaining = last confirmation + lease - now, on Redis's clock" in flat(output)


async def test_a_limit_set_is_marked_set_in_the_table_and_the_json(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    brought, set_ = unique("brought"), unique("set")
    semaphore = AsyncFairSemaphore(real_client, brought, 3)
    permit = await semaphore.acquire()
    assert permit is not None
    # Set on an idle name: it is in force all the same, and stays.
    assert await AsyncFairSemaphore(real_client, set_, None).set_limit(5) is None
    try:
        entries = (await status_of(capsys, redis_server.url, brought, set_))["semaphores"]
        assert await cli("status", "--url", redis_server.url, brought, set_) == 0
    finally:
        await semaphore.release(permit)
    assert [(entry["limit"], entry["limit_set"]) for entry in entries] == [(3, False), (5, True)]
    output = capsys.readouterr().out
    assert table_row(output, brought)[1] == "3"
    assert table_row(output, set_)[1:3] == ["5 (set)", "0"]


def test_the_table_without_rich_says_how_to_get_it(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)
    assert main(["status", "--url", redis_server.url]) == 2
    assert "the table needs rich: pip install 'rich>=13', or pass --json" in capsys.readouterr().err


async def test_names_round_trip_through_their_escaped_keys(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique("names")
    names = ["a {b} }{ c", "ünïcödé 名前", "with  spaces ", "%7B not a brace %", "*?[glob]\\"]
    for name in names:
        semaphore = AsyncFairSemaphore(real_client, name, 1, prefix=prefix)
        assert await semaphore.acquire() is not None
    listed = (await status_of(capsys, redis_server.url, "--prefix", prefix))["semaphores"]
    assert [entry["name"] for entry in listed] == sorted(names)
    assert all(entry["held"] == 1 for entry in listed)


async def test_without_names_every_semaphore_under_the_prefix_is_listed_and_no_other(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    stem = unique("scan")
    # A glob would take the brackets of the first prefix for a class matching the second.
    prefix, neighbour = f"{stem}[1]", f"{stem}1"
    for name, where in [("one", prefix), ("two", prefix), ("other", neighbour), ("default", "aiosem")]:
        semaphore = AsyncFairSemaphore(real_client, f"{name}-{stem}", 1, prefix=where)
        assert await semaphore.acquire() is not None
    await real_client.set(f"{prefix}:{{unrelated}}:data", "not a semaphore's key")
    listed = (await status_of(capsys, redis_server.url, "--prefix", prefix))["semaphores"]
    assert [entry["name"] for entry in listed] == [f"one-{stem}", f"two-{stem}"]


async def test_with_nothing_under_the_prefix_status_lists_nothing(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique("empty")
    assert (await status_of(capsys, redis_server.url, "--prefix", prefix))["semaphores"] == []
    assert await cli("status", "--url", redis_server.url, "--prefix", prefix) == 0
    assert f"no semaphores under prefix '{prefix}'" in capsys.readouterr().out


async def test_status_scans_every_primary_of_a_cluster(
    cluster_client: redis.asyncio.RedisCluster, redis_cluster: RedisClusterGroup, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique("cluster")
    by_node: dict[int, list[str]] = {}
    for index in range(300):  # the tag is the name: the same nodes every run
        name = f"spread-{index}"
        node = redis_cluster.node_for_slot(key_slot(SemaphoreKeys.for_name(prefix, name).base.encode()))
        by_node.setdefault(node.port, []).append(name)
    assert len(by_node) == 3
    names = sorted(name for on_one_node in by_node.values() for name in on_one_node[:2])
    for name in names:
        semaphore = AsyncFairSemaphore(cluster_client, name, 2, prefix=prefix)
        assert await semaphore.acquire() is not None
        await semaphore.aclose()
    listed = (await status_of(capsys, redis_cluster.url, "--prefix", prefix))["semaphores"]
    assert [(entry["name"], entry["held"]) for entry in listed] == [(name, 1) for name in names]


async def test_a_named_semaphore_that_does_not_exist_exits_1(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("missing")
    assert await cli("status", "--url", redis_server.url, "--json", name) == 1
    captured = capsys.readouterr()
    (entry,) = json.loads(captured.out)["semaphores"]
    assert entry["exists"] is False
    assert f"no semaphore '{name}' under prefix 'aiosem'" in captured.err


async def test_a_pattern_shows_the_names_it_matches(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    stem = unique("pattern")
    # Braces are escaped in the keys: the pattern is matched against the names.
    names = [f"{stem}-a", f"{stem}-{{b}}", f"other-{stem}", f"{stem}"]
    semaphores = [AsyncFairSemaphore(real_client, name, 1) for name in names]
    permits = [await semaphore.acquire() for semaphore in semaphores]
    try:
        matched = await status_of(capsys, redis_server.url, f"{stem}-*")
        mixed = await status_of(capsys, redis_server.url, f"other-{stem}", f"{stem}-[a]")
    finally:
        for semaphore, permit in zip(semaphores, permits, strict=True):
            assert permit is not None
            await semaphore.release(permit)
    assert [entry["name"] for entry in matched["semaphores"]] == [f"{stem}-a", f"{stem}-{{b}}"]
    # A name as given comes first, then what the patterns matched.
    assert [entry["name"] for entry in mixed["semaphores"]] == [f"other-{stem}", f"{stem}-a"]


async def test_a_pattern_that_matches_nothing_lists_nothing_and_exits_0(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (await status_of(capsys, redis_server.url, f"{unique('nothing')}-*"))["semaphores"] == []


async def test_the_waiters_are_listed_in_queue_order_with_who_they_are(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("queue")
    holder, first, second = (cls(real_client, name, 1, label=label) for label in ("holder", "first", "second"))
    permit = await holder.acquire()
    assert permit is not None
    waiting = [asyncio.create_task(first.acquire(blocking_timeout=30))]
    try:
        await until_queued(holder, 1)
        waiting.append(asyncio.create_task(second.acquire(blocking_timeout=30)))
        await until_queued(holder, 2)
        entry = await one_status(capsys, redis_server.url, name)
        assert await cli("status", "--url", redis_server.url, name) == 0
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await holder.release(permit)
        for semaphore in (holder, first, second):
            await semaphore.aclose()
    assert [(w["place"], w["label"], w["host"], w["pid"]) for w in entry["waiters"]] == [
        (1, "first", socket.gethostname(), os.getpid()),
        (2, "second", socket.gethostname(), os.getpid()),
    ]
    output = capsys.readouterr().out
    assert f"waiters of '{name}', in queue order" in output
    for waiter in entry["waiters"]:
        row = table_row(output, waiter["identifier"])
        assert row == [
            str(waiter["place"]),
            waiter["identifier"],
            "1",
            socket.gethostname(),
            str(os.getpid()),
            waiter["label"],
        ]


async def test_a_waiter_granted_a_permit_keeps_its_record(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("handed")
    holder, waiter = cls(real_client, name, 1, timeout=10), cls(real_client, name, 1, timeout=20, label="next")
    permit = await holder.acquire()
    assert permit is not None
    waiting = asyncio.create_task(waiter.acquire(blocking_timeout=30))
    try:
        await until_queued(holder)
        await holder.release(permit)
        handed = await waiting
        assert handed is not None
        (entry,) = (await one_status(capsys, redis_server.url, name))["holders"]
        await waiter.release(handed)
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await holder.aclose()
        await waiter.aclose()
    assert (entry["identifier"], entry["label"], entry["lease"], entry["lease_recorded"]) == (
        handed.identifier,
        "next",
        20,
        True,
    )


async def test_watch_shows_again_until_ctrl_c_which_ends_it_quietly(
    real_client: redis.asyncio.Redis, redis_server: RedisServer
) -> None:
    name = unique("watch")
    semaphore = AsyncFairSemaphore(real_client, name, 2)
    permit = await semaphore.acquire()
    assert permit is not None
    command = [sys.executable, "-m", "aiosem", "status", name, "--url", redis_server.url, "--json", "--watch", "0.05"]
    try:
        async with await anyio.open_process(command) as process:
            assert process.stdout is not None
            assert process.stderr is not None
            received = b""
            with anyio.fail_after(30):
                # Two frames: one JSON document per line.
                while received.count(b"\n") < 2:
                    received += await process.stdout.receive()
            process.send_signal(signal.SIGINT)
            with anyio.fail_after(10):
                status = await process.wait()
            errors = b"".join([chunk async for chunk in process.stderr])
    finally:
        await semaphore.release(permit)
    assert status == 0
    assert errors == b""
    frames = [json.loads(line) for line in received.splitlines()[:2]]
    for frame in frames:
        (entry,) = frame["semaphores"]
        assert entry["holders"][0]["identifier"] == permit.identifier


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"aiosem {importlib.metadata.version('aiosem')}\n"


# --- URLs and passwords --------------------------------------------------------


def test_without_a_url_status_exits_2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOSEM_REDIS_URL", raising=False)
    assert main(["status"]) == 2
    assert "no Redis URL: pass --url or set AIOSEM_REDIS_URL" in capsys.readouterr().err


def test_the_url_comes_from_the_environment(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOSEM_REDIS_URL", redis_server.url)
    assert main(["status", "--json", "--prefix", unique("env")]) == 0
    assert json.loads(capsys.readouterr().out)["semaphores"] == []


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://", "memory:// is a store inside one process"),
        ("localhost:6379", "localhost:6379 is not a Redis URL: one starts with redis://, rediss://, unix://"),
    ],
)
def test_only_a_redis_url_is_accepted(url: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", url]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:hunter2@host:6380/0", "redis://user:***@host:6380/0"),
        ("redis://:hunter2@host/0", "redis://:***@host/0"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("rediss://user:hunter2@[::1]:6380/0", "rediss://user:***@[::1]:6380/0"),
        ("unix://user:hunter2@/run/redis.sock?db=2", "unix://user:***@/run/redis.sock?db=2"),
        (
            "redis+cluster://app:hunter2@10.0.0.1:7000,10.0.0.2:7001/0",
            "redis+cluster://app:***@10.0.0.1:7000,10.0.0.2:7001/0",
        ),
        (
            "redis+sentinel://:hunter2@s1:26379,s2/mymaster/2?socket_timeout=4&sentinel_password=hunter3",
            "redis+sentinel://:***@s1:26379,s2/mymaster/2?socket_timeout=4&sentinel_password=***",
        ),
        ("redis://host/0?password=hunter2&db=1", "redis://host/0?password=***"),
        ("redis://hunter2@host/0", "redis://***@host/0"),
        ("redis://user:hun@ter2@host/0", "redis://user:***@host/0"),
        ("redis://user:hun/ter2@host/0", "redis://***"),
        ("redis://host/0?client_name=a@b", "redis://***"),
        ("user:hunter2@host:6379", "user:***@host:6379"),
        ("redis://:hunter2@host:port", "redis://:***@host:port"),
    ],
)
def test_redact_hides_every_password(url: str, shown: str) -> None:
    assert redact(url) == shown


#: Passwords whose every second character is an upper-case letter, which no
#: other part of the URLs below has: any piece of one shown has one.
passwords = st.lists(
    st.tuples(st.sampled_from(["", *string.punctuation, " ", "é"]), st.sampled_from(string.ascii_uppercase)),
    min_size=1,
).map(lambda pairs: "".join(a + b for a, b in pairs))


@given(passwords)
@pytest.mark.parametrize(
    "template",
    [
        "redis://user:{}@host:6379/0",
        "rediss://:{}@host/0?ssl_cert_reqs=none",
        "unix://user:{}@/run/redis.sock?db=2",
        "redis+cluster://app:{}@10.0.0.1:7000,10.0.0.2:7001/0?socket_timeout=3",
        "redis+sentinel://app:{0}@s1:26379,s2/mymaster/2?sentinel_password={0}",
        "redis+sentinel://s1:26379/mymaster?sentinel_password={}&socket_timeout=4",
        "redis://host/0?db=1&password={}",
    ],
)
def test_redact_shows_no_part_of_any_password(template: str, password: str) -> None:
    assert not set(redact(template.format(password))) & set(string.ascii_uppercase)


async def test_a_password_is_never_printed(fresh_redis_server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    admin = fresh_redis_server.admin_client()
    name = unique("auth")
    try:
        semaphore = AsyncFairSemaphore(admin, name, 1)
        assert await semaphore.acquire() is not None
        await admin.config_set("requirepass", PASSWORD)
    finally:
        await admin.aclose()
    url = f"redis://default:{PASSWORD}@{fresh_redis_server.host}:{fresh_redis_server.port}/0"
    assert (await one_status(capsys, url, name))["held"] == 1
    assert await cli("status", "--url", url, name) == 0
    wrong = url.replace(PASSWORD, "wrong-Password")
    assert await cli("status", "--url", wrong, name) == 3
    assert await cli("reset", "--url", wrong, name, "--yes") == 3
    captured = capsys.readouterr()
    assert "redis://default:***@" in captured.err
    for secret in (PASSWORD, "wrong-Password"):
        assert secret not in captured.out + captured.err


@pytest.mark.parametrize(
    "template",
    [
        "redis://user:{password}@127.0.0.1:{port}/0",
        "redis+cluster://user:{password}@127.0.0.1:{port},127.0.0.1:{port}",
        "redis+sentinel://user:{password}@127.0.0.1:{port}/mymaster?sentinel_password={password}",
    ],
    ids=["server", "cluster", "sentinel"],
)
def test_a_connection_failure_is_one_line_without_the_password(
    template: str, refusing_port: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As redis-py did before CVE-2026-32597 was fixed; Sentinel's "No master
    # found" shows each sentinel's client, and so its pool.
    monkeypatch.setattr(
        redis.asyncio.ConnectionPool,
        "__repr__",
        lambda pool: f"<redis.asyncio.connection.ConnectionPool({pool.connection_kwargs!r})>",
    )
    url = template.format(password=PASSWORD, port=refusing_port)
    assert main(["status", "--url", url]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert re.match(rf"aiosem status: error: Redis at {re.escape(redact(url))}( is unreachable)?: ", line)
    assert PASSWORD not in line
    assert "<redis." not in line


def test_an_error_that_quotes_a_password_shows_stars_instead() -> None:
    url = "redis+sentinel://app:p%40ss@s1/mymaster?socket_timeout=1&sentinel_password=a+b%5C"
    error = redis.ConnectionError("AUTH p@ss refused; sentinel {'password': 'a b\\\\'} refused")
    assert _describe(error, url) == "AUTH *** refused; sentinel {'password': '***'} refused"


def test_an_error_names_redis_py_objects_without_their_reprs() -> None:
    error = redis.ConnectionError(
        "No master found for 'm' : <redis.asyncio.client.Redis(<redis.asyncio.connection.ConnectionPool("
        "<redis.asyncio.connection.Connection(host=s1,options=<object object at 0x1>)>)>)> - ConnectionError"
    )
    assert _describe(error, "redis+sentinel://s1/m") == "No master found for 'm' : Redis - ConnectionError"


def test_an_ambiguous_url_is_refused_before_anything_quotes_a_piece_of_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # redis-py would take "/ter2@host" for the database, and say so.
    assert main(["status", "--url", "redis://:hun/ter2@127.0.0.1/0"]) == 2
    err = capsys.readouterr().err
    assert "makes the URL ambiguous" in err
    assert "hun" not in err
    assert "ter2" not in err


def test_a_user_meets_a_connection_failure_without_a_traceback_or_password(refusing_port: int) -> None:
    url = f"redis://app:{PASSWORD}@127.0.0.1:{refusing_port}/0"
    completed = subprocess.run(
        [sys.executable, "-m", "aiosem", "status", "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 3
    assert "Traceback" not in completed.stderr
    assert PASSWORD not in completed.stdout + completed.stderr
    assert f"redis://app:***@127.0.0.1:{refusing_port}/0" in completed.stderr


# --- limit ---------------------------------------------------------------------


async def test_limit_n_sets_the_limit_in_force_and_says_what_it_was(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("set")
    semaphore = cls(real_client, name, 2)
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        assert await cli("limit", name, "5", "--url", redis_server.url, *step_as(cls)) == 0
        assert capsys.readouterr().out == f"'{name}': limit 5 (was 2); 1 held, 0 waiting\n"
        entry = await one_status(capsys, redis_server.url, name)
    finally:
        await semaphore.release(permit)
    assert (entry["limit"], entry["limit_set"]) == (5, True)
    # Set, not brought: it outlives the semaphore falling idle.
    assert await real_client.get(SemaphoreKeys.for_name("aiosem", name).limit) == b"=5"


async def test_raising_the_limit_grants_a_waiter_of_a_running_semaphore_at_once(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("raise")
    semaphore = cls(real_client, name, 1)
    permit = await semaphore.acquire()
    assert permit is not None
    waiting = asyncio.create_task(semaphore.acquire(blocking_timeout=30))
    try:
        await until_queued(semaphore)
        assert await cli("limit", name, "2", "--url", redis_server.url, *step_as(cls)) == 0
        with anyio.fail_after(10):  # long before its blocking timeout, and with the first permit still held
            granted = await waiting
        assert granted is not None
        await semaphore.release(granted)
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await semaphore.release(permit)
        await semaphore.aclose()
    assert capsys.readouterr().out == f"'{name}': limit 2 (was 1); 2 held, 0 waiting\n"


async def test_limit_clear_clears_a_set_limit(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("clear")
    semaphore = cls(real_client, name, None)
    assert await semaphore.set_limit(4) is None
    assert await cli("limit", name, "--clear", "--url", redis_server.url, *step_as(cls)) == 0
    assert capsys.readouterr().out == f"'{name}': limit cleared (was 4); the next acquire's limit applies\n"
    assert await real_client.exists(SemaphoreKeys.for_name("aiosem", name).limit) == 0
    # Nothing set, nothing to clear.
    assert await cli("limit", name, "--clear", "--url", redis_server.url, *step_as(cls)) == 0
    assert capsys.readouterr().out == f"'{name}': no limit was set; the next acquire's limit applies\n"


async def test_limit_clear_of_a_semaphore_in_use_leaves_the_limit_as_if_its_users_brought_it(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("clear-in-use")
    semaphore = cls(real_client, name, None)
    assert await semaphore.set_limit(2) is None
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        assert await cli("limit", name, "--clear", "--url", redis_server.url, *step_as(cls)) == 0
        assert await real_client.get(SemaphoreKeys.for_name("aiosem", name).limit) == b"2"
    finally:
        await semaphore.release(permit)
    assert capsys.readouterr().out == (
        f"'{name}': limit cleared (was 2); it stays in force as its users' while they hold or wait\n"
    )
    assert await real_client.exists(SemaphoreKeys.for_name("aiosem", name).limit) == 0  # idle: gone


async def test_limit_clear_leaves_a_limit_its_users_brought(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("brought")
    semaphore = AsyncFairSemaphore(real_client, name, 3)
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        assert await cli("limit", name, "--clear", "--url", redis_server.url) == 0
        assert await real_client.get(SemaphoreKeys.for_name("aiosem", name).limit) == b"3"
    finally:
        await semaphore.release(permit)
    assert capsys.readouterr().out == (
        f"'{name}': no limit was set; limit 3, brought by its users, stays while they hold or wait\n"
    )


async def test_limit_without_n_shows_the_limit_in_force_and_changes_nothing(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    set_, brought, unused = unique("set"), unique("brought"), unique("unused")
    await AsyncFairSemaphore(real_client, set_, None).set_limit(5)
    semaphore = AsyncFairSemaphore(real_client, brought, 3)
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        for name in (set_, brought, unused):
            assert await cli("limit", name, "--url", redis_server.url) == 0
        stored = [
            await real_client.get(SemaphoreKeys.for_name("aiosem", name).limit) for name in (set_, brought, unused)
        ]
    finally:
        await semaphore.release(permit)
    assert capsys.readouterr().out.splitlines() == [
        f"'{set_}': limit 5 (set); 0 held, 0 waiting",
        f"'{brought}': limit 3; 1 held, 0 waiting",
        f"'{unused}': no limit in force; 0 held, 0 waiting",
    ]
    assert stored == [b"=5", b"3", None]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["0"], "argument N: limit must be at least 1, got 0"),
        (["-3"], "argument N: limit must be at least 1, got -3"),
        (["2.5"], "argument N: limit must be a whole number, got '2.5'"),
        (["many"], "argument N: limit must be a whole number, got 'many'"),
        (["3", "--clear"], "argument --clear: not allowed with argument N"),
    ],
)
def test_a_bad_limit_exits_2_as_argparse_does(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["limit", "db", *argv, "--url", "redis://127.0.0.1:1/0"])
    assert exited.value.code == 2
    assert f"aiosem limit: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["5"], ["--clear"], ["5", "--locked"]], ids=["show", "set", "clear", "locked"])
def test_limit_with_redis_unreachable_is_one_line_and_exits_3(
    argv: list[str], refusing_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://app:{PASSWORD}@127.0.0.1:{refusing_port}/0"
    assert main(["limit", "db", *argv, "--url", url]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"aiosem limit: error: Redis at redis://app:***@127.0.0.1:{refusing_port}/0 is unreachable")
    assert PASSWORD not in line


def test_a_step_lock_that_stays_busy_is_one_line_and_exits_3(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the locked step raises once its lock stayed busy for a whole lease: a 10 s wait, spared.
    async def busy(self: AsyncLockedSemaphore, limit: int | None) -> int | None:
        raise SemaphoreError(f"the step lock of semaphore {self.name!r} stayed busy", name=self.name)

    monkeypatch.setattr(AsyncLockedSemaphore, "set_limit", busy)
    assert main(["limit", "db", "5", "--locked", "--url", redis_server.url]) == 3
    assert capsys.readouterr().err == "aiosem limit: error: the step lock of semaphore 'db' stayed busy\n"


# --- reset ---------------------------------------------------------------------


async def test_reset_clears_permits_queue_limit_and_lock_and_keeps_the_counter(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str], cls: Semaphore
) -> None:
    name = unique("reset")
    keys = SemaphoreKeys.for_name("aiosem", name)
    semaphore = cls(real_client, name, 2)
    permits = [await semaphore.acquire(), await semaphore.acquire()]
    waiting = asyncio.create_task(semaphore.acquire(blocking_timeout=30))
    try:
        await until_queued(semaphore)
        await real_client.set(keys.lock, "stuck", px=60_000)
        assert await cli("reset", name, "--url", redis_server.url, "--yes") == 0
        assert await real_client.exists(keys.timeout_set, keys.owner_set, keys.limit, keys.holders, keys.lock) == 0
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await semaphore.aclose()
    assert permits[1] is not None
    last = permits[1].fencing_token
    assert f"deleted 2 permit(s), 1 waiter(s); the fencing counter stays at {last}" in capsys.readouterr().out
    entry = await one_status(capsys, redis_server.url, name)
    assert (entry["limit"], entry["held"], entry["last_token"], entry["lock"]) == (None, 0, last, None)
    later = cls(real_client, name, 1)
    permit = await later.acquire()
    assert permit is not None
    assert permit.fencing_token > permits[1].fencing_token
    assert await later.release(permit)


async def test_a_holder_finds_its_permit_lost_at_its_next_refresh_after_a_reset(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, cls: Semaphore
) -> None:
    name = unique("lost")
    semaphore = cls(real_client, name, 1, timeout=10, refresh_interval=0.1)

    async def hold_through_a_reset() -> None:
        async with semaphore:
            assert await cli("reset", name, "--url", redis_server.url, "--yes") == 0
            await anyio.sleep_forever()  # cancelled when the refresh finds the permit gone

    try:
        with anyio.fail_after(10), pytest.raises(PermitLost):
            await hold_through_a_reset()
    finally:
        await semaphore.aclose()


async def test_reset_keeps_the_rate_limiter_unless_told(
    real_client: redis.asyncio.Redis, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("rate-reset")
    limiter = AsyncRateLimiter(real_client, name, 1, per=60)
    assert await limiter.acquire()
    assert await cli("reset", name, "--url", redis_server.url, "--yes") == 0
    assert not await limiter.try_acquire()
    assert await cli("reset", name, "--url", redis_server.url, "--yes", "--rate") == 0
    assert "and its rate limiter's state" in capsys.readouterr().out
    assert await limiter.try_acquire()


async def test_reset_of_a_semaphore_that_does_not_exist_exits_1(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    name = unique("nothing")
    assert await cli("reset", name, "--url", redis_server.url, "--yes") == 1
    assert f"no semaphore '{name}' under prefix 'aiosem'" in capsys.readouterr().err


async def test_reset_without_yes_refuses_when_nobody_can_confirm(
    real_client: redis.asyncio.Redis,
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = unique("no-tty")
    semaphore = AsyncFairSemaphore(real_client, name, 1)
    assert await semaphore.acquire() is not None
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{name}\n"))
    assert await cli("reset", name, "--url", redis_server.url) == 2
    assert "stdin is not a terminal, so the reset cannot be confirmed: pass --yes" in capsys.readouterr().err
    assert await semaphore.count() == 1


async def test_reset_is_confirmed_by_typing_the_name(
    real_client: redis.asyncio.Redis,
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = unique("typed")
    semaphore = AsyncFairSemaphore(real_client, name, 1)
    permit = await semaphore.acquire()
    assert permit is not None
    monkeypatch.setattr(sys, "stdin", Terminal(f"{name}\n"))
    assert await cli("reset", name, "--url", redis_server.url) == 0
    output = capsys.readouterr().out
    assert f"Resetting '{name}' (aiosem:{{{name}}}) deletes 1 permit(s), 0 waiter(s)" in output
    assert f"its fencing counter stays (last token {permit.fencing_token})" in output
    assert "Type the name to confirm: " in output
    assert await semaphore.count() == 0


async def test_reset_clears_a_set_limit_too_and_says_so_first(
    real_client: redis.asyncio.Redis,
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = unique("reset-set")
    semaphore = AsyncFairSemaphore(real_client, name, None)
    await semaphore.set_limit(5)
    monkeypatch.setattr(sys, "stdin", Terminal(f"{name}\n"))
    assert await cli("reset", name, "--url", redis_server.url) == 0
    assert "deletes 0 permit(s), 0 waiter(s), the limit set (5) and its step lock" in capsys.readouterr().out
    assert await real_client.exists(SemaphoreKeys.for_name("aiosem", name).limit) == 0


async def test_reset_typed_with_another_name_deletes_nothing(
    real_client: redis.asyncio.Redis,
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = unique("mistyped")
    semaphore = AsyncFairSemaphore(real_client, name, 1)
    assert await semaphore.acquire() is not None
    monkeypatch.setattr(sys, "stdin", Terminal("something else\n"))
    assert await cli("reset", name, "--url", redis_server.url) == 1
    assert "not confirmed; nothing was deleted" in capsys.readouterr().err
    assert await semaphore.count() == 1


def test_a_bad_argument_exits_2_as_argparse_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["status", "--timeout", "0"])
    assert exited.value.code == 2
    assert "--timeout must be a positive, finite number of seconds, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["reset", "x", "--prefix", "a{b"])
    assert "prefix must not contain '{' or '}'" in capsys.readouterr().err


# --- as a user runs it ---------------------------------------------------------


async def test_python_m_aiosem_status_prints_json_a_program_can_read(
    real_client: redis.asyncio.Redis, redis_server: RedisServer
) -> None:
    name = unique("subprocess")
    semaphore = AsyncLockedSemaphore(real_client, name, 4)
    permit = await semaphore.acquire()
    assert permit is not None
    try:
        completed = await anyio.run_process(
            [sys.executable, "-m", "aiosem", "status", name, "--url", redis_server.url, "--json"], check=False
        )
    finally:
        await semaphore.release(permit)
    assert completed.returncode == 0, completed.stderr
    document = json.loads(completed.stdout)
    assert document["prefix"] == "aiosem"
    assert document["timeout"] == 10
    (entry,) = document["semaphores"]
    assert (entry["limit"], entry["held"]) == (4, 1)
    assert entry["holders"][0]["identifier"] == permit.identifier


# --- keys ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "aiosem:{db}:data",  # not a key aiosem writes
        "aiosem:{db",  # no end to the tag
        "aiosem:{}:counter",  # no name
        "aiosem:{%7b}:counter",  # an escape aiosem does not write
        "aiosem:{100%}:counter",  # an unescaped percent sign
        "other:{db}:counter",
        b"aiosem:{\xff}:counter",  # not UTF-8
    ],
)
def test_only_keys_aiosem_writes_name_a_semaphore(key: str | bytes) -> None:
    assert name_of(key, "aiosem") is None


def test_every_key_of_a_semaphore_names_it_but_the_records() -> None:
    keys = SemaphoreKeys.for_name("aiosem", "a {b}% c")
    for key in (*keys.fair, keys.rate):
        expected = None if key == keys.holders else "a {b}% c"
        assert name_of(key.encode(), "aiosem") == expected
