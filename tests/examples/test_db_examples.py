"""The database examples, run as a user runs them and checked against what PostgreSQL logged.

The examples log each query's start and end with PostgreSQL's
``clock_timestamp()``; the tests compute the most queries at once from that
log themselves, so that a limit is shown both kept and reached.
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import subprocess
import sys
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import asyncpg
import pytest

from aiosem import AsyncFairSemaphore
from tests.harness.postgres import fetch, in_thread, most_at_once, new_schema, require_postgres
from tests.harness.support import RedisServer

if TYPE_CHECKING:
    from collections.abc import Iterator
    from datetime import datetime
    from types import ModuleType

pytestmark = pytest.mark.apps

EXAMPLES = Path(__file__).parents[2] / "examples"
#: Queries each run of db_queries.py starts at once.
QUERIES = 24


def load_example(name: str) -> ModuleType:
    """Import an example by its path: ``examples`` is a directory of scripts, not a package."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(command: list[str]) -> str:
    """Run an example to success, as a user would; its output."""
    completed = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


async def run_queued(redis: RedisServer, commands: list[list[str]], queued: int) -> list[str]:
    """Run the commands at once to success, with every query of theirs ready to run at the same time; their outputs.

    The commands are started while this holds all three permits of the
    semaphore ``"db"``, which are given back once ``queued`` waiters are
    queued for it (in all processes).
    """
    client = redis.client()
    gate = AsyncFairSemaphore(client, "db", 3)
    processes: list[asyncio.subprocess.Process] = []
    try:
        async with gate, gate, gate:
            for command in commands:
                # One at a time, each kept as it starts: the clean-up kills what did.
                processes.append(await asyncio.create_subprocess_exec(*command, stdout=PIPE, stderr=PIPE))  # noqa: PERF401
            waiting = 0
            with anyio.move_on_after(30):
                while (waiting := await gate.waiting()) < queued:  # noqa: ASYNC110 -- no event tells of other processes' waiters
                    await anyio.sleep(0.05)
            assert waiting == queued, f"{waiting} of {queued} queries queued for the semaphore 'db'"
        with anyio.fail_after(60):
            outputs = await asyncio.gather(*(process.communicate() for process in processes))
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
        await gate.aclose()
        await client.aclose()
    for process, (_, errors) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, errors.decode()
    return [output.decode() for output, _ in outputs]


def db_queries_command(redis: RedisServer, dsn: str, schema: str, run: str) -> list[str]:
    return [
        sys.executable, str(EXAMPLES / "db_queries.py"),
        "--redis", redis.url, "--dsn", dsn, "--schema", schema, "--run", run, "--queries", str(QUERIES),
    ]  # fmt: skip


def ended(rows: list[asyncpg.Record]) -> list[tuple[datetime, datetime]]:
    """The logged queries' intervals; each of them ended."""
    assert all(row["ended"] is not None for row in rows)
    return [(row["started"], row["ended"]) for row in rows]


@pytest.fixture(scope="module")
def postgres_dsn() -> str:
    return require_postgres()


@pytest.fixture
def postgres_schema(postgres_dsn: str) -> Iterator[str]:
    with new_schema(postgres_dsn) as schema:
        yield schema


@pytest.fixture(scope="module")
def redis(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server of this module's own: no permit another test left behind takes a slot."""
    server = RedisServer(redis_binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_run(redis: RedisServer, postgres_dsn: str) -> Iterator[tuple[str, str]]:
    """db_queries.py run once: its output, and its schema."""
    with new_schema(postgres_dsn) as schema:
        command = db_queries_command(redis, postgres_dsn, schema, "alone")
        [output] = in_thread(lambda: run_queued(redis, [command], QUERIES))
        yield output, schema


@pytest.fixture(scope="module")
def three_runs(redis: RedisServer, postgres_dsn: str) -> Iterator[str]:
    """Three copies of db_queries.py run at once, on one Redis and one schema: the schema."""
    with new_schema(postgres_dsn) as schema:
        commands = [db_queries_command(redis, postgres_dsn, schema, f"copy-{number}") for number in range(3)]
        in_thread(lambda: run_queued(redis, commands, 3 * QUERIES))
        yield schema


@pytest.fixture(scope="module")
def mapreduce(redis: RedisServer, postgres_dsn: str) -> Iterator[tuple[str, str]]:
    """mapreduce.py run with a pool of 4 processes and 2 reads at once: its output, and its schema."""
    with new_schema(postgres_dsn) as schema:
        command = [
            sys.executable, str(EXAMPLES / "mapreduce.py"),
            "--redis", redis.url, "--dsn", postgres_dsn, "--schema", schema,
            "--workers", "4", "--readers", "2", "--rows", "2000", "--chunk", "100",
        ]  # fmt: skip
        output = run(command)
        yield output, schema


def test_db_queries_prints_what_the_database_logged(one_run: tuple[str, str], postgres_dsn: str) -> None:
    output, schema = one_run
    log = fetch(postgres_dsn, schema, "SELECT outcome, started, ended FROM query_log")
    refused = sum(row["outcome"] == "refused" for row in log)
    assert len(log) == QUERIES
    assert f"queries run: {QUERIES}\n" in output
    assert f"stale writes refused: {refused}\n" in output
    assert f"max overlap: {most_at_once(ended(log))} (limit 3" in output


@pytest.mark.slow
def test_three_copies_of_db_queries_run_at_most_three_queries_at_once(three_runs: str, postgres_dsn: str) -> None:
    log = fetch(postgres_dsn, three_runs, "SELECT run, started, ended FROM query_log")
    assert sorted(row["run"] for row in log) == sorted(f"copy-{number}" for number in range(3) for _ in range(QUERIES))
    assert any(  # queries of two processes ran at the same time
        one["run"] != other["run"] and one["started"] < other["ended"] and other["started"] < one["ended"]
        for one in log
        for other in log
    )
    assert most_at_once(ended(log)) == 3


@pytest.mark.slow
def test_each_item_ends_with_the_price_written_under_its_highest_token(three_runs: str, postgres_dsn: str) -> None:
    items = fetch(postgres_dsn, three_runs, "SELECT id, price, fence FROM items ORDER BY id")
    writes = fetch(postgres_dsn, three_runs, "SELECT item, token, price, outcome FROM query_log WHERE kind = 'reprice'")
    assert len({write["token"] for write in writes}) == len(writes)
    for item in items:
        latest = max((write for write in writes if write["item"] == item["id"]), key=lambda write: write["token"])
        assert latest["outcome"] == "written"
        assert (item["price"], item["fence"]) == (latest["price"], latest["token"])


async def test_a_holder_whose_lease_ran_out_cannot_overwrite_a_later_grants_write(
    redis_server: RedisServer, postgres_dsn: str, postgres_schema: str
) -> None:
    db_queries = load_example("db_queries")
    client = redis_server.client()
    semaphore = AsyncFairSemaphore(client, f"db-{secrets.token_hex(4)}", limit=3, timeout=2.0)
    connection = await asyncpg.connect(postgres_dsn, server_settings={"search_path": postgres_schema})
    try:
        await db_queries.create_tables(connection, postgres_schema, 1)
        stale = await semaphore.acquire()  # never refreshed: its holder has stopped
        assert stale is not None
        async with semaphore, semaphore:  # the other two permits, kept alive
            # Only the stale lease running out can free a permit for this one.
            later = await semaphore.acquire(blocking_timeout=30)
            assert later is not None
            await db_queries.set_price(connection, 1, 200, later.fencing_token)
            with pytest.raises(db_queries.StaleWrite, match=f"fencing token {stale.fencing_token} was refused"):
                await db_queries.set_price(connection, 1, 100, stale.fencing_token)
            assert await semaphore.release(later)
        assert not await semaphore.release(stale)  # it was lost before it wrote
        row = await connection.fetchrow("SELECT price, fence FROM items WHERE id = 1")
        assert (row["price"], row["fence"]) == (200, later.fencing_token)
    finally:
        await connection.close()
        await semaphore.aclose()
        await client.aclose()


@pytest.mark.slow
def test_mapreduce_reduces_to_what_postgresql_computes_directly(mapreduce: tuple[str, str], postgres_dsn: str) -> None:
    output, schema = mapreduce
    [direct] = fetch(postgres_dsn, schema, "SELECT count(*), sum(value), sum(value * value) FROM numbers")
    assert f"reduced: rows={direct[0]} sum={direct[1]} sum_of_squares={direct[2]}\n" in output
    [read] = fetch(postgres_dsn, schema, "SELECT count(*), sum(rows) FROM read_log")
    assert (read[0], read[1]) == (20, direct[0])  # 2,000 numbers in chunks of 100, each read once


@pytest.mark.slow
def test_mapreduce_runs_at_most_two_reads_at_once_across_its_processes(
    mapreduce: tuple[str, str], postgres_dsn: str
) -> None:
    output, schema = mapreduce
    log = fetch(postgres_dsn, schema, "SELECT process, started, ended FROM read_log")
    assert len({row["process"] for row in log}) > 1
    assert most_at_once(ended(log)) == 2
    assert "max overlap of reads: 2 (limit 2)\n" in output
