"""PostgreSQL for the tests of the database examples: a server that answers, schemas of their own.

The server is ``$AIOSEM_POSTGRES_DSN``, else
``postgresql://postgres@127.0.0.1:5432/test``, shared with other test runs:
the examples create their tables in the schema they are given, and
`new_schema` drops it. Where no server answers, `require_postgres` skips
the test with the reason -- except under CI (``CI`` set), where it fails
it, as the Redis fixtures do.

Helpers run their queries in an event loop of their own, in a thread, so
that sync tests (which run the examples as subprocesses) and async tests
use them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterator
    from datetime import datetime

T = TypeVar("T")

DSN = os.environ.get("AIOSEM_POSTGRES_DSN") or "postgresql://postgres@127.0.0.1:5432/test"

#: Seconds to connect before the server counts as unreachable.
_CONNECT_TIMEOUT = 5.0


def in_thread(function: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``function()`` to its end in a new event loop, in a thread of its own."""
    with ThreadPoolExecutor(1) as executor:
        return executor.submit(lambda: asyncio.run(function())).result()


def fetch(dsn: str, schema: str, sql: str, *arguments: object) -> list[asyncpg.Record]:
    """The rows of one query, with ``schema`` on the search path."""

    async def query() -> list[asyncpg.Record]:
        connection = await asyncpg.connect(dsn, timeout=_CONNECT_TIMEOUT, server_settings={"search_path": schema})
        try:
            return await connection.fetch(sql, *arguments)  # type: ignore[no-any-return]
        finally:
            await connection.close()

    return in_thread(query)


@contextlib.contextmanager
def new_schema(dsn: str) -> Iterator[str]:
    """The name of a schema nobody else uses; dropped, with all it holds, when done."""
    schema = f"aiosem_test_{secrets.token_hex(6)}"
    try:
        yield schema
    finally:
        fetch(dsn, "public", f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals that overlap at any instant; one that ends as another starts does not overlap it."""
    # (end, -1) sorts before (start, +1) at the same instant.
    steps = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, step in steps:
        running += step
        most = max(most, running)
    return most


def require_postgres() -> str:
    """The DSN of a PostgreSQL that answers; skip the test without one (fail it under CI)."""

    async def ping() -> None:
        connection = await asyncpg.connect(DSN, timeout=_CONNECT_TIMEOUT)
        await connection.close()

    try:
        in_thread(ping)
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError) as error:
        message = (
            f"no PostgreSQL to run the database examples against ({type(error).__name__}: {error}): "
            "start one on 127.0.0.1:5432 (user postgres, database test) or set AIOSEM_POSTGRES_DSN"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return DSN
