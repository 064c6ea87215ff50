"""The typed examples of ``tests/frontend/configured/typing`` also run: what mypy checks there is what happens."""

from __future__ import annotations

import aiosem
from tests.frontend.configured.typing import decorated


async def test_the_typed_example_runs() -> None:
    aiosem.configure(url="memory://")
    await decorated.check()
