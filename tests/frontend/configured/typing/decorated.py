"""What mypy sees of functions decorated with `limit_concurrency`: their own types, unchanged.

Checked by ``mypy --strict`` with the rest of the repository: each
``assert_type`` must hold, and each call marked ``type: ignore[...]`` must be
an error (``warn_unused_ignores`` fails the check if it is not). The module
is also imported and run by ``tests/frontend/configured/test_typing.py``.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from aiosem import limit_concurrency

if sys.version_info >= (3, 11):
    from typing import assert_type
else:  # pragma: no cover -- Python 3.10
    from typing_extensions import assert_type


@limit_concurrency("db", 3)
async def query(sql: str, *, timeout: float = 1.0) -> list[int]:
    return [len(sql)]


class Repository:
    @limit_concurrency("db", 3)
    async def get(self, key: int) -> str:
        return str(key)


@limit_concurrency("rows", 1)
async def rows(count: int) -> AsyncGenerator[int, None]:
    for row in range(count):
        yield row


@limit_concurrency("echo", 1)
async def echo() -> AsyncGenerator[str, str]:
    received = yield "ready"
    yield received


@limit_concurrency("pages", 1)
async def pages(count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield b""


def host(url: str) -> str:
    return urlsplit(url).hostname or url


@limit_concurrency(host, 3)
async def fetch(url: str) -> bytes:
    return url.encode()


@limit_concurrency(lambda url, *, retries=0: url, 3)
async def fetch_with_lambda(url: str, *, retries: int = 0) -> bytes:
    return url.encode()


async def check() -> None:
    as_callable: Callable[[str], Coroutine[Any, Any, list[int]]] = query
    assert_type(await as_callable("select 1"), list[int])
    assert_type(await query("select 1"), list[int])
    assert_type(await query("select 1", timeout=2.0), list[int])
    assert_type(await Repository().get(1), str)
    assert_type(rows(3), AsyncGenerator[int, None])
    assert_type([row async for row in rows(3)], list[int])
    generator = echo()
    assert_type(await anext(generator), str)
    assert_type(await generator.asend("hello"), str)
    await generator.aclose()
    assert_type(pages(1), AsyncIterator[bytes])
    assert_type(await fetch("https://example.com/"), bytes)
    assert_type(await fetch_with_lambda("https://example.com/", retries=1), bytes)


async def misuse() -> None:
    """Calls mypy must refuse, as it would refuse them on the undecorated functions."""
    await query(1)  # type: ignore[arg-type]
    await query("select 1", timeout="soon")  # type: ignore[arg-type]
    await query("select 1", retries=2)  # type: ignore[call-arg]
    await Repository().get("key")  # type: ignore[arg-type]
    rows("three")  # type: ignore[arg-type]
    await fetch(b"https://example.com/")  # type: ignore[arg-type]
