"""What goes through aiosem's process-wide configuration: `configure`, limits and rates by name, the web integrations.

Every test here starts from no configuration and no environment
(`_isolated`, in the root conftest), and ends with aiosem closed in its own
loop and every task of that loop ended by itself (`close_and_settle`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import aiosem
from tests.harness.limiting import close_and_settle

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import redis.asyncio


@pytest.fixture(autouse=True)
async def _settled(_isolated: None) -> AsyncIterator[None]:
    yield
    await close_and_settle()


@pytest.fixture
def backend(client: redis.asyncio.Redis) -> redis.asyncio.Redis:
    """The test's client (a real server, then fakeredis), configured as aiosem's."""
    aiosem.configure(client=client)
    return client
