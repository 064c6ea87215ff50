"""Three database queries at a time across every process, and a fencing token on every write.

Two kinds of query share the semaphore ``"db"`` and its three permits, kept
in Redis. Both are ``async def`` functions decorated with
``@aiosem.limit_concurrency("db", 3)``:

- a report needs its turn, nothing more;
- a repricing of an item writes, with the fencing token of its call's
  permit, which it finds with ``aiosem.current_permit()``.

Fencing. A permit is kept alive in the background while its block runs,
and a lost permit cancels the block; but no client can cover a process
that stops -- a GC pause, SIGSTOP, a VM migration -- for longer than its
lease and resumes with its write already on its way, after its permit went
to someone else. So each item keeps the highest token that wrote it, and
the database applies a write only if its token is at least that high::

    UPDATE items SET price = $2, fence = $3 WHERE id = $1 AND fence <= $3

When two such updates race, PostgreSQL (at its default isolation level,
READ COMMITTED) re-checks the ``WHERE`` against the row the other one
committed, so the check and the write are one step. A write refused (0
rows) is older than one already applied to the row: either its holder's
lease ran out, or -- with three permits, several holders are live at once,
and the token orders their grants without saying which are live -- a
repricing granted after it finished first. Either way the later grant's
price stands: the example drops the older one and counts it. A write that
must not be lost (an increment, say) would instead be retried under a new
permit, after reading the row again.

The fence outlasts the semaphore's counter in Redis: a token is never below
the Redis server's clock in microseconds, so after the counter expires (a
day after the last grant) or Redis loses its data, the next token is still
higher than every fence written before.

Every query logs its start and its end in PostgreSQL, with
``clock_timestamp()``, while it holds its permit; the summary computes from
that log, by the database's own clock, the most queries that ran at once
over every run logged in the schema, and the exit status is 1 if that is
more than three::

    python examples/db_queries.py --redis redis://localhost:6379/0 --dsn postgresql://postgres@localhost/postgres

Start several at once with the same ``--redis`` and ``--schema``: together
they never run more than three queries. Without ``--redis``, aiosem uses
``AIOSEM_REDIS_URL``, else ``memory://`` (this process alone; needs
aiosem's ``memory`` extra); without ``--dsn``, asyncpg reads libpq's
``PGHOST``, ``PGDATABASE`` and the like.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import secrets
import sys
from collections import Counter

import asyncpg

import aiosem

LIMIT = 3

TABLES = """
CREATE TABLE IF NOT EXISTS items (
    id integer PRIMARY KEY,
    price bigint NOT NULL,
    fence bigint NOT NULL DEFAULT 0  -- the highest fencing token that wrote the row
);
CREATE TABLE IF NOT EXISTS query_log (
    id bigserial PRIMARY KEY,
    run text NOT NULL,
    kind text NOT NULL,              -- 'report' or 'reprice'
    item integer,
    token bigint,
    price bigint,
    outcome text,                    -- 'read', 'written' or 'refused'
    started timestamptz NOT NULL,
    ended timestamptz
);
"""

FENCED_UPDATE = "UPDATE items SET price = $2, fence = $3 WHERE id = $1 AND fence <= $3"

# A sweep over the starts (+1) and ends (-1) in time order, an end before a
# start at the same instant; a query still running counts until the end of time.
MOST_AT_ONCE = """
SELECT coalesce(max(running), 0) FROM (
    SELECT sum(step) OVER (ORDER BY at, step ROWS UNBOUNDED PRECEDING) AS running
    FROM (
        SELECT started AS at, 1 AS step FROM query_log
        UNION ALL
        SELECT coalesce(ended, 'infinity'), -1 FROM query_log
    ) AS steps
) AS sweep
"""


class StaleWrite(Exception):
    """The database refused a write: a later grant had already written the row."""

    def __init__(self, item: int, token: int) -> None:
        super().__init__(f"item {item}: the price written under fencing token {token} was refused")
        self.item = item
        self.token = token


def schema_name(text: str) -> str:
    """A schema name safe to write into SQL as it is (``--schema``)."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: lowercase letters, digits and _ only")
    return text


async def create_tables(connection: asyncpg.Connection, schema: str, items: int) -> None:
    """Create the schema, its tables and items 1 to ``items``, unless a copy running at once did.

    ``connection`` has the schema on its ``search_path``.
    """
    async with connection.transaction():
        # Two sessions creating the same table "if not exists" at once can
        # still collide in the catalog: one copy at a time.
        await connection.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)
        await connection.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        await connection.execute(TABLES)
        await connection.execute(
            "INSERT INTO items (id, price) SELECT g, 100 FROM generate_series(1, $1) AS g ON CONFLICT DO NOTHING",
            items,
        )


async def set_price(connection: asyncpg.Connection, item: int, price: int, token: int) -> None:
    """Write an item's price, fenced by the writer's token.

    Raises:
        StaleWrite: The item was written under a higher token already.
    """
    if await connection.execute(FENCED_UPDATE, item, price, token) == "UPDATE 0":
        raise StaleWrite(item, token)


async def log_start(connection: asyncpg.Connection, run: str, kind: str, item: int | None, token: int | None) -> int:
    """Log a query's start, by the database's clock; return its log entry."""
    entry: int = await connection.fetchval(
        "INSERT INTO query_log (run, kind, item, token, started) "
        "VALUES ($1, $2, $3, $4, clock_timestamp()) RETURNING id",
        run,
        kind,
        item,
        token,
    )
    return entry


async def log_end(connection: asyncpg.Connection, entry: int, outcome: str, price: int | None = None) -> None:
    await connection.execute(
        "UPDATE query_log SET ended = clock_timestamp(), outcome = $2, price = $3 WHERE id = $1", entry, outcome, price
    )


@aiosem.limit_concurrency("db", LIMIT)
async def report(pool: asyncpg.Pool, run: str, work: float) -> int:
    """The total of all prices: a query that needs its turn but not its permit."""
    # The connection is taken under the permit: no process needs more than LIMIT.
    async with pool.acquire() as connection:
        entry = await log_start(connection, run, "report", None, None)
        total: int = await connection.fetchval("SELECT sum(price) FROM items, pg_sleep($1)", work)
        await log_end(connection, entry, "read")
    return total


@aiosem.limit_concurrency("db", LIMIT)
async def reprice(pool: asyncpg.Pool, run: str, item: int, work: float) -> str:
    """Move an item's price a little, and write it with the permit's fencing token."""
    async with pool.acquire() as connection:
        token = aiosem.current_permit().fencing_token
        entry = await log_start(connection, run, "reprice", item, token)
        price: int = await connection.fetchval(
            "SELECT price + $2 FROM items, pg_sleep($3) WHERE id = $1", item, random.randint(-5, 5), work
        )
        try:
            await set_price(connection, item, price, token)
        except StaleWrite as stale:
            print(f"{stale}: a later grant's price stands, this one is dropped")
            await log_end(connection, entry, "refused", price)
            return "refused"
        await log_end(connection, entry, "written", price)
        return "written"


async def query(pool: asyncpg.Pool, run: str, number: int, items: int) -> str:
    work = random.uniform(0.02, 0.08)  # seconds the database spends on the query
    if number % 4 == 0:
        await report(pool, run, work)
        return "read"
    return await reprice(pool, run, random.randint(1, items), work)


async def main(arguments: argparse.Namespace) -> int:
    aiosem.configure(url=arguments.redis)
    pool = await asyncpg.create_pool(
        arguments.dsn, min_size=0, max_size=LIMIT, server_settings={"search_path": arguments.schema}
    )
    try:
        async with pool.acquire() as connection:
            await create_tables(connection, arguments.schema, arguments.items)
        outcomes = Counter(
            await asyncio.gather(
                *(query(pool, arguments.run, number, arguments.items) for number in range(arguments.queries))
            )
        )
        async with pool.acquire() as connection:
            most: int = await connection.fetchval(MOST_AT_ONCE)
    finally:
        await pool.close()
        await aiosem.aclose()
    print(f"run {arguments.run}: {outcomes['read']} reports, {outcomes['written']} prices written")
    print(f"queries run: {outcomes.total()}")
    print(f"stale writes refused: {outcomes['refused']}")
    print(f"max overlap: {most} (limit {LIMIT}, every run logged in schema {arguments.schema})")
    return 1 if most > LIMIT else 0


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Three database queries at a time, fenced writes.")
    parser.add_argument("--redis", help="Redis URL (default: AIOSEM_REDIS_URL, else memory://)")
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: libpq's PG* environment variables)")
    parser.add_argument("--schema", type=schema_name, default="aiosem_examples", help="schema of the tables")
    parser.add_argument("--run", default=secrets.token_hex(4), help="this run's name in the log")
    parser.add_argument("--queries", type=int, default=24, help="queries this run starts at once")
    parser.add_argument("--items", type=int, default=3, help="items to reprice")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_arguments())))
