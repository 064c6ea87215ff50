"""`plan_step`, the locked step's decision, is a pure function: it reads its state and changes none of it.

What it decides is held to the fair scripts by ``tests/test_differential.py``.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from aiosem._keys import SemaphoreKeys
from aiosem._plan import ReadState, plan_step
from aiosem._protocol import Step

NOW = 1_700_000_000.0


def a_busy_state() -> ReadState:
    """One holder, one expired holder, two waiters (one presumed dead), a tombstone, and TTLs to fix."""
    return ReadState(
        SemaphoreKeys.for_name("aiosem", "plan"),
        now=NOW,
        lease=10.0,
        limit=1,
        waiter_ttl=2.0,
        caller="ab12",
        publish="PUBLISH",
        leases={b"ab12.held": NOW - 1, b"cd34.expired": NOW - 20},
        owners={b"ab12.held": 7.0, b"cd34.expired": 3.0},
        counter=7,
        queue_head={b"cd34.dead": 1.0, b"cd34.waiting": 2.0},
        queue_size=2,
        earliest_deaths={b"cd34.dead": NOW - 1, b"cd34.waiting": NOW + 1},
        queued={b"cd34.waiting": 2.0},
        alive_until={b"cd34.waiting": NOW + 1},
        cancelled={b"ab12.gone": NOW + 30},
        stored_limit=1,
        permit_ttls=(86_400_000, -1, -1),
        queue_ttls=(100, 100, -1),
        tickets={b"ab12.new": 3},
        receipt="aiosem:{plan}:receipt:c1",
        receipt_seconds=10.0,
        earlier_receipt=b"01",
    )


@pytest.mark.parametrize("step", [step for step in Step if step is not Step.PASS], ids=lambda step: step.name)
def test_a_plan_changes_nothing_it_is_given(step: Step) -> None:
    state = a_busy_state()
    members = [b"3", b""] if step is Step.LIMIT else [b"ab12.held", b"cd34.waiting", b"ab12.gone", b"ab12.new"]
    given = copy.deepcopy((state, members))
    decision = plan_step(state, step, members)
    assert (state, members) == given
    assert plan_step(state, step, members) == decision  # and decides the same again


def test_a_locked_step_never_passes_a_permit_on() -> None:
    with pytest.raises(ValueError, match="never relays"):
        plan_step(a_busy_state(), Step.PASS, [b"ab12.held", b"ab12.next", b"8"])


def a_permit_past_the_lease(record: bytes) -> ReadState:
    """One holder confirmed 15 s ago, with ``record`` in ``:holders``; the caller's lease is 10 s."""
    return dataclasses.replace(
        a_busy_state(),
        leases={b"cd34.long": NOW - 15},
        owners={b"cd34.long": 3.0},
        queue_head={},
        queue_size=0,
        earliest_deaths={},
        queued={},
        alive_until={},
        records={b"cd34.long": record},
    )


def test_a_permit_whose_own_lease_runs_on_is_not_reaped_and_ends_with_it() -> None:
    decision = plan_step(a_permit_past_the_lease(b'[30000,42,"elsewhere",null]'), Step.COUNT, [])
    assert decision.reply.holders == 1
    assert decision.reply.next_expiry == pytest.approx(15)
    assert not [write for write in decision.writes if write[0] in ("ZREM", "HDEL")]


def test_a_permit_whose_own_lease_ran_out_too_is_reaped_with_its_record() -> None:
    keys = SemaphoreKeys.for_name("aiosem", "plan")
    decision = plan_step(a_permit_past_the_lease(b'[12000,42,"elsewhere",null]'), Step.COUNT, [])
    assert decision.reply.holders == 0
    assert ("HDEL", keys.holders, b"cd34.long") in decision.writes
    assert ("DEL", keys.limit, keys.holders, keys.weight) in decision.writes


def test_a_step_records_who_it_queues_or_grants_and_nobody_else() -> None:
    keys = SemaphoreKeys.for_name("aiosem", "plan")
    state = dataclasses.replace(a_busy_state(), record='[10000,7,"here","me"]')
    decision = plan_step(state, Step.WAIT, [b"ab12.held", b"ab12.new"])
    recorded = [write for write in decision.writes if write[0] == "HSET"]
    # The holder is recorded already; the newcomer queues (the limit is reached).
    assert recorded == [("HSET", keys.holders, b"ab12.new", '[10000,7,"here","me"]')]
