"""Many processes contend for one limit on a real server: it is never exceeded.

Four worker processes of 40 coroutines each loop for 2 s: take a permit,
increment a shared in-use counter in Redis, hold for a moment, decrement,
release (the ``python -m aiosem demo`` workers). The counter is only touched
under a permit, so a reading above the limit is an over-admission.
"""

from __future__ import annotations

import secrets

import pytest

from aiosem._demo import KINDS, Config, Kind, run

pytestmark = pytest.mark.slow

LOCKS = ("recipe-lock", "recipe-lock-with-timeout")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS)
def test_the_limit_holds_across_processes(topology_url: str, kind: Kind) -> None:
    limit = 1 if kind in LOCKS else 3
    config = Config(
        url=topology_url,
        kind=kind,
        # In braces: the recipes keep the book's key layout, whose keys share
        # a cluster slot only if the name is a hash tag.
        name=f"{{contention-{kind}-{secrets.token_hex(4)}}}",
        limit=limit,
        workers=4,
        coroutines=40,
        duration=2.0,
        hold=0.002,
    )
    result = run(config)
    # The figures for the record: shown with `pytest -s`.
    figures = f"{result.grants} grants, peak {result.peak}/{limit}, {result.over_limit} over the limit"
    print(f"{kind}: {figures}, {result.lost} permits lost")  # noqa: T201
    assert result.over_limit == 0
    assert result.peak == limit  # the limit was reached, so it was really contended
    assert result.grants >= 100
