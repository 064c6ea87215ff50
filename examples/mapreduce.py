"""A map-reduce job whose map tasks read the database at most N at a time, across a whole process pool.

The parent splits a table of numbers into chunks of ids; a process pool maps
them -- a child reads its chunk from PostgreSQL and computes the chunk's
count, sum and sum of squares -- and the parent reduces the partial results
to the table's, then checks them against the same aggregates computed by
PostgreSQL directly.

The database takes only N of these reads at once, for the whole job,
however large the pool. So the read is limited by an aiosem semaphore in
Redis, shared by every child: the parent hands each child the Redis URL and
N, which it gives ``aiosem.configure`` before its first task, and each map
task runs its read in an event loop of its own (``asyncio.run``). The
chunk is processed after the read has given its permit back: the limit is
the database's, not the CPUs'.

Why a semaphore, and not a lock with a counter: a task that finds the N
slots taken would have to let go of the lock, sleep and try again, and a
slot freed during its sleep stays idle until it wakes -- a short sleep
burns CPU and Redis calls, a long one wastes the database's time. A
semaphore queues its waiters and hands a permit to the next one the moment
it is given back (about a millisecond from one process to another), in
arrival order; and a child that dies holding a permit loses it when its
lease runs out.

Each read logs its start and its end in PostgreSQL, with
``clock_timestamp()``, while it holds its permit. The summary computes from
that log, by the database's own clock, the most reads that ran at once; the
exit status is 1 if that is more than N or if the reduced result differs
from the direct one::

    python examples/mapreduce.py --redis redis://localhost:6379/0 \\
        --dsn postgresql://postgres@localhost/postgres --workers 4 --readers 2

``--redis`` defaults to ``AIOSEM_REDIS_URL``; without ``--dsn``, asyncpg
reads libpq's ``PGHOST``, ``PGDATABASE`` and the like.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

import asyncpg

import aiosem

#: The semaphore of the map tasks' reads; its limit comes from ``configure``.
READS = "mapreduce:reads"

TABLES = """
CREATE TABLE IF NOT EXISTS numbers (id integer PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE IF NOT EXISTS read_log (
    id bigserial PRIMARY KEY,
    chunk integer NOT NULL,
    process integer NOT NULL,        -- the pid of the child that read it
    rows integer,
    started timestamptz NOT NULL,
    ended timestamptz
);
"""

# A sweep over the starts (+1) and ends (-1) in time order, an end before a
# start at the same instant; a read still running counts until the end of time.
MOST_AT_ONCE = """
SELECT coalesce(max(running), 0) FROM (
    SELECT sum(step) OVER (ORDER BY at, step ROWS UNBOUNDED PRECEDING) AS running
    FROM (
        SELECT started AS at, 1 AS step FROM read_log
        UNION ALL
        SELECT coalesce(ended, 'infinity'), -1 FROM read_log
    ) AS steps
) AS sweep
"""


class Job(NamedTuple):
    """What every map task needs to know; sent to the children with each task."""

    dsn: str | None
    schema: str
    read_time: float


class Chunk(NamedTuple):
    """The ids ``first`` to ``last`` of the numbers, one map task's share."""

    number: int
    first: int
    last: int


class Partial(NamedTuple):
    """What a map task returns, and what the reduction adds up."""

    rows: int = 0
    total: int = 0
    squares: int = 0


def combine(left: Partial, right: Partial) -> Partial:
    return Partial(left.rows + right.rows, left.total + right.total, left.squares + right.squares)


def schema_name(text: str) -> str:
    """A schema name safe to write into SQL as it is (``--schema``)."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: lowercase letters, digits and _ only")
    return text


async def connect(job: Job) -> asyncpg.Connection:
    return await asyncpg.connect(job.dsn, server_settings={"search_path": job.schema})


# The children: each task is a call of `map_chunk`, in a process of the pool.


def configure_child(redis_url: str, readers: int) -> None:
    """Run once in each child, before its first task: every child shares one limit, in Redis."""
    aiosem.configure(url=redis_url, limits={READS: readers})


@aiosem.limit_concurrency(READS)
async def read_chunk(connection: asyncpg.Connection, chunk: Chunk, read_time: float) -> list[int]:
    """Read a chunk's numbers; at most N of these run at once in the whole pool."""
    entry = await connection.fetchval(
        "INSERT INTO read_log (chunk, process, started) VALUES ($1, $2, clock_timestamp()) RETURNING id",
        chunk.number,
        os.getpid(),
    )
    # pg_sleep stands for a read that makes the database work.
    rows = await connection.fetch(
        "SELECT value FROM numbers, pg_sleep($3) WHERE id BETWEEN $1 AND $2", chunk.first, chunk.last, read_time
    )
    await connection.execute("UPDATE read_log SET ended = clock_timestamp(), rows = $2 WHERE id = $1", entry, len(rows))
    return [row["value"] for row in rows]


async def map_chunk_async(job: Job, chunk: Chunk) -> Partial:
    connection = await connect(job)
    try:
        values = await read_chunk(connection, chunk, job.read_time)
    finally:
        await connection.close()
        await aiosem.aclose()
    return Partial(len(values), sum(values), sum(value * value for value in values))


def map_chunk(job: Job, chunk: Chunk) -> Partial:
    """One map task: its read runs in an event loop of its own."""
    return asyncio.run(map_chunk_async(job, chunk))


# The parent.


async def create_tables(connection: asyncpg.Connection, schema: str, rows: int) -> None:
    """Create the schema, its tables and numbers 1 to ``rows``, unless a job running at once did."""
    async with connection.transaction():
        # Two sessions creating the same table "if not exists" at once can
        # still collide in the catalog: one at a time.
        await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)
        await connection.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        await connection.execute(TABLES)
        await connection.execute(
            "INSERT INTO numbers (id, value) SELECT g, g * 7919 % 1000 FROM generate_series(1, $1) AS g "
            "ON CONFLICT DO NOTHING",
            rows,
        )


def split(first: int, last: int, size: int) -> list[Chunk]:
    """The ids ``first`` to ``last`` in chunks of ``size`` ids."""
    return [
        Chunk(number, start, min(start + size - 1, last)) for number, start in enumerate(range(first, last + 1, size))
    ]


async def main(arguments: argparse.Namespace) -> int:
    job = Job(arguments.dsn, arguments.schema, arguments.read_time)
    connection = await connect(job)
    try:
        await create_tables(connection, arguments.schema, arguments.rows)
        first, last = await connection.fetchrow("SELECT min(id), max(id) FROM numbers")
        chunks = split(first, last, arguments.chunk)
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(
            arguments.workers,
            # A fresh interpreter per child, on every platform: nothing of
            # the parent's event loop or connections is inherited.
            mp_context=multiprocessing.get_context("spawn"),
            initializer=configure_child,
            initargs=(arguments.redis, arguments.readers),
        ) as pool:
            partials = await asyncio.gather(*(loop.run_in_executor(pool, map_chunk, job, chunk) for chunk in chunks))
        reduced = functools.reduce(combine, partials, Partial())
        aggregates = await connection.fetchrow(
            "SELECT count(*), coalesce(sum(value), 0), coalesce(sum(value * value), 0) FROM numbers"
        )
        direct = Partial(*map(int, aggregates))  # sums of bigints are numerics: Decimal
        most: int = await connection.fetchval(MOST_AT_ONCE)
    finally:
        await connection.close()
    print(f"{arguments.workers} processes mapped {len(chunks)} chunks of up to {arguments.chunk} ids")
    print(f"reduced: rows={reduced.rows} sum={reduced.total} sum_of_squares={reduced.squares}")
    print(f"direct:  rows={direct.rows} sum={direct.total} sum_of_squares={direct.squares}")
    print(f"max overlap of reads: {most} (limit {arguments.readers})")
    return 0 if reduced == direct and most <= arguments.readers else 1


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Map-reduce over a table, N database reads at a time.")
    parser.add_argument("--redis", default=os.environ.get("AIOSEM_REDIS_URL"), help="default: AIOSEM_REDIS_URL")
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: libpq's PG* environment variables)")
    parser.add_argument("--schema", type=schema_name, default="aiosem_mapreduce", help="schema of the tables")
    parser.add_argument("--workers", type=int, default=4, help="processes in the pool")
    parser.add_argument("--readers", type=int, default=2, help="N: database reads at once, in all processes")
    parser.add_argument("--rows", type=int, default=2000, help="numbers in the table")
    parser.add_argument("--chunk", type=int, default=100, help="ids per map task")
    parser.add_argument("--read-time", type=float, default=0.05, help="seconds each read keeps the database busy")
    arguments = parser.parse_args()
    if arguments.redis is None:
        parser.error("give --redis or set AIOSEM_REDIS_URL: the limit must be shared by the pool's processes")
    return arguments


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_arguments())))
