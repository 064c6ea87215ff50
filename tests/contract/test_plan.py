"""`plan_step`, the locked step's decision, is a pure function: it reads its state and changes none of it.

What it decides is held to the fair scripts by ``tests/contract/test_differential.py``.
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


@pytest.mark.parametrize("step", list(Step), ids=lambda step: step.name)
def test_a_plan_changes_nothing_it_is_given(step: Step) -> None:
    state = a_busy_state()
    members = [b"ab12.held", b"cd34.waiting", b"ab12.gone", b"ab12.new"]
    if step is Step.LIMIT:
        members = [b"3", b""]
    elif step is Step.PASS:
        members = [b"ab12.held", b"cd34.waiting", b"8"]
    given = copy.deepcopy((state, members))
    decision = plan_step(state, step, members)
    assert (state, members) == given
    assert plan_step(state, step, members) == decision  # and decides the same again


def test_a_pass_to_a_waiter_not_at_the_queues_head_installs_nothing_and_the_head_is_served() -> None:
    decision = plan_step(a_busy_state(), Step.PASS, [b"ab12.held", b"ab12.not-queued", b"8"])
    assert decision.reply.values == (1, 0, 0)
    assert [identifier for identifier, _ in decision.reply.granted] == ["cd34.waiting"]


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


def a_mutex_before_a_run(**arriving: object) -> ReadState:
    """The caller holds the mutex, three of its waiters queued behind (tickets 1 to 3): its release forms a run."""
    queue = {b"ab12.w1": 1.0, b"ab12.w2": 2.0, b"ab12.w3": 3.0}
    return dataclasses.replace(
        a_busy_state(),
        leases={b"ab12.held": NOW - 1},
        owners={b"ab12.held": 7.0},
        queue_head=queue,
        queue_size=3,
        earliest_deaths=dict.fromkeys(queue, NOW + 1),
        queued={},
        alive_until={},
        cancelled={},
        permit_ttls=(-1, -1, -1),
        queue_ttls=(-1, -1, -1),
        receipt=None,
        relays=True,
        **{"tickets": {}, **arriving},  # type: ignore[arg-type]
    )


def relayed_by_release(state: ReadState) -> list[str]:
    decision = plan_step(state, Step.RELEASE, [b"ab12.held"])
    assert [identifier for identifier, _ in decision.reply.granted] == ["ab12.w1"]
    return [identifier for identifier, _ in decision.reply.relayed]


def test_with_nobody_arriving_the_callers_waiters_behind_the_head_are_its_run() -> None:
    assert relayed_by_release(a_mutex_before_a_run()) == ["ab12.w2", "ab12.w3"]


@pytest.mark.parametrize("deadline", [float("inf"), NOW + 0.5], ids=["seen-first", "seen-before"])
def test_another_processes_waiter_on_its_way_stops_the_run(deadline: float) -> None:
    assert relayed_by_release(a_mutex_before_a_run(arrivals={b"cd34.late": deadline})) == []


def test_a_book_identifier_on_its_way_stops_the_run() -> None:
    assert relayed_by_release(a_mutex_before_a_run(arrivals={b"no-process": float("inf")})) == []


def test_the_callers_own_waiter_on_its_way_cuts_the_run_at_its_ticket() -> None:
    state = a_mutex_before_a_run(arrivals={b"ab12.on-its-way": float("inf")}, tickets={b"ab12.on-its-way": 3})
    assert relayed_by_release(state) == ["ab12.w2"]


def test_the_callers_own_waiter_whose_ticket_it_has_not_heard_yet_stops_the_run() -> None:
    assert relayed_by_release(a_mutex_before_a_run(arrivals={b"ab12.drawing": float("inf")})) == []


def test_arrivals_not_read_whole_stop_the_run() -> None:
    assert relayed_by_release(a_mutex_before_a_run(arrivals_whole=False)) == []


def test_a_waiter_whose_arrival_deadline_passed_is_taken_out_and_stops_nothing() -> None:
    state = a_mutex_before_a_run(arrivals={b"cd34.gone": NOW})
    assert relayed_by_release(state) == ["ab12.w2", "ab12.w3"]
    assert ("ZREM", state.keys.arriving, b"cd34.gone") in plan_step(state, Step.RELEASE, [b"ab12.held"]).writes


def test_an_arrival_seen_for_the_first_time_is_given_a_waiter_timeout_to_be_queued() -> None:
    state = a_mutex_before_a_run(arrivals={b"cd34.new": float("inf"), b"cd34.seen": NOW + 1})
    writes = plan_step(state, Step.RELEASE, [b"ab12.held"]).writes
    assert ("ZADD", state.keys.arriving, "XX", f"{NOW + 2.0:.6f}", b"cd34.new") in writes
    assert not [write for write in writes if write[0] == "ZADD" and b"cd34.seen" in write]


def test_a_step_takes_its_own_waiters_out_of_the_arrivals() -> None:
    state = a_mutex_before_a_run(own_arrivals={b"ab12.new": float("inf")}, tickets={b"ab12.new": 4})
    decision = plan_step(state, Step.WAIT, [b"ab12.new"])
    assert decision.reply.values == (0,)  # queued
    assert ("ZREM", state.keys.arriving, b"ab12.new") in decision.writes
