"""Fixtures of the fault tests: each breaks a server of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import redis.asyncio

    from tests.harness.support import RedisServer


@pytest.fixture
async def admin(fresh_redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """An unrestricted client of the test's own server, for the test to break, fill, configure and inspect it.

    `test_closing` has an `admin` of its own: the session's server, flushed.
    """
    client = fresh_redis_server.admin_client()
    yield client
    await client.aclose()
