"""The typed examples of ``tests/typing`` also run: what mypy checks there is what happens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import aiosem
from aiosem import _config
from tests.limiting import close_and_settle, isolate
from tests.typing import decorated

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    isolate(request, monkeypatch)
    yield
    _config._reset()


@pytest.fixture(autouse=True)
async def _settled(_isolated: None) -> AsyncIterator[None]:
    yield
    await close_and_settle()


async def test_the_typed_example_runs() -> None:
    aiosem.configure(url="memory://")
    await decorated.check()
