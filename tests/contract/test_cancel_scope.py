"""`cancel_scope`: anyio's cancel scopes, made without asking anyio which backend runs each time.

Every ``async with`` block and every step makes one, so they are made of
the class the first one was made of. These tests check that what comes out
is anyio's own scope, with its deadline and its shield, whether made first
or from the class.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aiosem import _timing
from aiosem._timing import cancel_scope

#: Long enough for anything that is going to happen on an idle loop to happen.
SETTLE: float = 5.0


@pytest.fixture(params=["first", "made of its class"])
async def fresh(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scope made in the test is the process's first, or one made of the class the first told."""
    monkeypatch.setattr(_timing, "_scope_class", None)
    if request.param == "made of its class":
        cancel_scope()


@pytest.mark.usefixtures("fresh")
async def test_a_scope_is_anyios_own() -> None:
    scope = cancel_scope()

    assert isinstance(scope, anyio.CancelScope)
    assert type(scope) is type(anyio.CancelScope())


@pytest.mark.usefixtures("fresh")
async def test_its_deadline_cancels_the_block_and_nothing_else() -> None:
    deadline = anyio.current_time() + 0.01

    with cancel_scope(deadline=deadline) as scope:
        await anyio.sleep(SETTLE)

    assert scope.deadline == deadline
    assert scope.cancelled_caught


@pytest.mark.usefixtures("fresh")
async def test_a_shielded_scope_holds_off_an_outer_cancellation_until_it_ends() -> None:
    done: list[str] = []

    with anyio.CancelScope() as outer:
        with cancel_scope(shield=True) as shielded:
            outer.cancel()
            await asyncio.sleep(0.01)
            done.append("the shielded block ran on")
        await asyncio.sleep(SETTLE)

    assert shielded.shield
    assert done == ["the shielded block ran on"]
    assert outer.cancelled_caught
