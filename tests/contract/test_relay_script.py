"""The fair scripts' relay and pass, against a model of a mutex with a queue.

The differential test holds the locked class's relay to the scripts'; this
test holds the scripts' relay itself to a model. At limit
1, on one fake clock, hypothesis drives one semaphore through waits of the
caller's and another process's waiters, releases, passes along the relayed
run (and past it: to a waiter that is not the queue's head, to one that
left, to nobody), cancels and leases running out; after each step the
script's reply and the semaphore's state in Redis must be the model's.

The model says in plain Python what ``aiosem_hand_off``,
``aiosem_relay_run`` and ``fair_release``'s ``pass`` promise (see
docs/design.md, "A mutex relayed through a run"): a mutex handed to one of
the caller's own waiters is relayed to the caller's waiters queued right
behind it, up to the first of another process and at most `RUN_LENGTH`,
each with the next fencing token, all of them staying queued; a pass
releases the holder and installs the successor, with its token, only if
the successor is the queue's head -- and the permit is the holder's, or
free; a successor holding already holds by the relayed token from the pass on.
"""

from __future__ import annotations

import asyncio
import functools
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from aiosem._fair import fair_step
from aiosem._keys import SemaphoreKeys
from aiosem._protocol import QUEUED, TOMBSTONED, Reply, Step
from aiosem._rules import RUN_LENGTH, TOMBSTONE_SECONDS

if TYPE_CHECKING:
    from collections.abc import Iterator

    import redis.asyncio

    from tests.harness.support import RedisServer

CALLER: Final = "c0ffee"
OTHER: Final = "0dd"
LEASE: Final = 4.0
WAITER_TTL: Final = 2.0
#: Times and offsets are multiples of a quarter second: exact in binary, so the scripts' rounding is the model's.
START: Final = 1_700_000_000.25


@dataclass
class Mutex:
    """What the scripts promise of a semaphore of one permit, its queue and the relay, as plainly as it can be said."""

    now: float = START
    counter: int = 0
    #: identifier -> (fencing token, stamp of the lease)
    holders: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: identifiers in queue order -> when each is presumed dead
    queue: dict[str, float] = field(default_factory=dict)
    #: identifier -> when its tombstone ends
    tombstones: dict[str, float] = field(default_factory=dict)

    def next_token(self) -> int:
        self.counter = max(self.counter + 1, math.floor(self.now * 1_000_000))
        return self.counter

    def reap(self) -> None:
        self.holders = {i: held for i, held in self.holders.items() if held[1] > self.now - LEASE}
        self.queue = {i: deadline for i, deadline in self.queue.items() if deadline > self.now}
        self.tombstones = {i: until for i, until in self.tombstones.items() if until > self.now}

    def hand_off(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """The grants, and the run relayed with the first, when the permit is free."""
        if self.holders or not self.queue:
            return [], []
        head = next(iter(self.queue))
        del self.queue[head]
        token = self.next_token()
        mine = head.startswith(CALLER + ".")
        # Another process's waiter holds for one waiter timeout, until its process claims the permit.
        self.holders[head] = (token, self.now if mine else self.now - LEASE + WAITER_TTL)
        if not mine:
            return [(head, token)], []
        run: list[str] = []
        for identifier in list(self.queue)[:RUN_LENGTH]:
            if not identifier.startswith(CALLER + "."):
                break
            run.append(identifier)
        if run:
            first = max(self.counter + 1, math.floor(self.now * 1_000_000))
            self.counter = first + len(run) - 1
        return [(head, token)], [(identifier, self.counter - len(run) + 1 + i) for i, identifier in enumerate(run)]

    def wait(self, identifier: str) -> int:
        if self.tombstones.pop(identifier, None) is not None:
            return TOMBSTONED
        if identifier in self.holders:
            self.holders[identifier] = (self.holders[identifier][0], self.now)
            return self.holders[identifier][0]
        if identifier in self.queue or self.holders or self.queue:
            self.queue[identifier] = self.now + WAITER_TTL  # a place kept, or a new one last
            return QUEUED
        token = self.next_token()
        self.holders[identifier] = (token, self.now)
        return token

    def release(self, identifier: str, *, cancel: bool = False) -> int:
        if self.holders.pop(identifier, None) is not None:
            return 1
        if cancel and self.queue.pop(identifier, None) is None:
            self.tombstones[identifier] = self.now + TOMBSTONE_SECONDS
        return 0

    def pass_on(self, holder: str, successor: str, token: int) -> list[int]:
        released = self.release(holder)
        if not successor:
            return [released, 0, 0]
        if successor in self.holders:
            # Its acquire returned with the relayed token and a whole lease, whoever handed it the permit first.
            self.holders[successor] = (token, self.now)
            return [released, token, 0]
        if self.holders or not self.queue or next(iter(self.queue)) != successor:
            return [released, 0, 0]
        del self.queue[successor]
        self.holders[successor] = (token, self.now)
        return [released, token, 0]


@dataclass(frozen=True)
class Seen:
    """What Redis holds, as the model would say it."""

    holders: dict[str, tuple[int, float]]
    queue: list[str]
    counter: int


async def seen(client: redis.asyncio.Redis, keys: SemaphoreKeys) -> Seen:
    owners: dict[bytes, float] = dict(await client.zrange(keys.owner_set, 0, -1, withscores=True))  # type: ignore[arg-type]
    stamps: dict[bytes, float] = dict(await client.zrange(keys.timeout_set, 0, -1, withscores=True))  # type: ignore[arg-type]
    queue: list[bytes] = await client.zrange(keys.queue, 0, -1)  # type: ignore[assignment]
    return Seen(
        holders={member.decode(): (int(owners[member]), stamps[member]) for member in owners},
        queue=[member.decode() for member in queue],
        counter=int(await client.get(keys.counter) or 0),
    )


def tell(kind: str, reply: Reply) -> Iterator[str]:
    """What the step did that the statistics should count."""
    if reply.relayed:
        yield f"a run of {min(len(reply.relayed), 3)}{'+' if len(reply.relayed) > 3 else ''} relayed"
    if reply.granted and not reply.relayed:
        yield "a hand-off without a run"
    if kind == "pass":
        yield "a pass that installed its successor" if reply.values[1] else "a pass that installed nobody"
    if TOMBSTONED in reply.values:
        yield "a late wait met its tombstone"


async def mutex_step(
    client: redis.asyncio.Redis,
    keys: SemaphoreKeys,
    step: Step,
    members: list[str],
    *,
    caller: str = CALLER,
    now: float = START,
) -> Reply:
    """A step of the fair scripts on a semaphore of one permit, whose caller relays."""
    return await fair_step(
        client, step, keys, members, now=now, lease=LEASE, limit=1, waiter_ttl=WAITER_TTL, caller=caller, relays=True
    )


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_the_relay_and_the_pass_follow_the_model(
    redis_server: RedisServer, loop: asyncio.AbstractEventLoop, data: st.DataObject
) -> None:
    loop.run_until_complete(drive(redis_server, data))


async def drive(server: RedisServer, data: st.DataObject) -> None:
    client = server.client()
    keys = SemaphoreKeys.for_name("relay", secrets.token_hex(6))
    model = Mutex()
    mine = [f"{CALLER}.{n}" for n in range(8)]
    theirs = [f"{OTHER}.{n}" for n in range(4)]
    relayed: list[tuple[str, int]] = []

    async def step(step: Step, members: list[str]) -> Reply:
        return await mutex_step(client, keys, step, members, now=model.now)

    try:
        # Mostly waits, releases and passes: a run needs a holder and the caller's waiters queued behind it.
        kinds = st.sampled_from(["wait"] * 4 + ["release"] * 2 + ["pass"] * 3 + ["cancel", "advance"])
        for _ in range(data.draw(st.integers(5, 30), label="steps")):
            kind = data.draw(kinds, label="kind")
            expected_granted: list[tuple[str, int]] = []
            expected_relayed: list[tuple[str, int]] = []
            if kind == "advance":
                model.now += data.draw(st.sampled_from([0.25, 1.0, WAITER_TTL, LEASE]), label="seconds")
                model.reap()
                expected_granted, expected_relayed = model.hand_off()
                reply = await step(Step.COUNT, [])
                expected: list[int] = []
            elif kind == "wait":
                identifier = data.draw(st.sampled_from(mine * 2 + theirs), label="waiter")
                model.reap()
                expected_granted, expected_relayed = model.hand_off()
                expected = [model.wait(identifier)]
                reply = await step(Step.WAIT, [identifier])
            elif kind in ("release", "cancel"):
                identifier = data.draw(st.sampled_from([*model.holders, *model.queue, *mine[:2]]), label="whom")
                model.reap()
                expected = [model.release(identifier, cancel=kind == "cancel")]
                expected_granted, expected_relayed = model.hand_off()
                reply = await step(Step.CANCEL if kind == "cancel" else Step.RELEASE, [identifier])
            else:
                holder = data.draw(st.sampled_from([*model.holders, *model.holders, mine[0]]), label="holder")
                # The run's next waiter, as the relay passes to; or anyone else, or nobody.
                choices = [*relayed[:1] * 3, *((i, 7) for i in model.queue), ("", 0)]
                successor, token = data.draw(st.sampled_from(choices), label="successor")
                model.reap()
                expected = model.pass_on(holder, successor, token)
                expected_granted, expected_relayed = model.hand_off()
                reply = await step(Step.PASS, [holder, successor, str(token) if successor else ""])
                relayed = relayed[1:]
            note(f"{kind}: {reply}")
            assert (list(reply.values), list(reply.granted), list(reply.relayed)) == (
                expected,
                expected_granted,
                expected_relayed,
            )
            relayed = list(reply.relayed) or relayed
            for what in tell(kind, reply):
                event(what)
            assert (reply.holders, reply.waiting) == (len(model.holders), len(model.queue))
            assert await seen(client, keys) == Seen(model.holders, list(model.queue), model.counter)
    finally:
        await client.delete(*keys.fair)
        await client.aclose()


def test_a_pass_never_installs_a_successor_over_a_limit_lowered_since_the_run_formed(
    redis_server: RedisServer, loop: asyncio.AbstractEventLoop
) -> None:
    loop.run_until_complete(pass_after_a_raise_and_a_lowering(redis_server))


async def pass_after_a_raise_and_a_lowering(server: RedisServer) -> None:
    client = server.client()
    keys = SemaphoreKeys.for_name("relay", secrets.token_hex(6))
    other, first, second, third = f"{OTHER}.x", f"{CALLER}.a", f"{CALLER}.b", f"{CALLER}.c"

    step = functools.partial(mutex_step, client, keys)
    try:
        await step(Step.WAIT, [other, first, second, third])  # `other` holds; the caller's three wait
        released = await step(Step.RELEASE, [other])
        assert [identifier for identifier, _ in released.relayed] == [second, third]  # `first` holds, relaying on
        raised = await step(Step.LIMIT, ["2"])
        assert [identifier for identifier, _ in raised.granted] == [second]  # the run's next, from the queue's head
        await step(Step.LIMIT, ["1"])
        # `first` passes to `third`, as its run says; but two were held, and the limit is now 1: `second`
        # holding, nobody else may.
        (_, third_token), *_ = (pair for pair in released.relayed if pair[0] == third)
        passed = await step(Step.PASS, [first, third, str(third_token)])
        assert passed.values == (1, 0, 0)
        assert (passed.holders, passed.waiting) == (1, 1)
        assert await client.zrange(keys.owner_set, 0, -1) == [second.encode()]
    finally:
        await client.delete(*keys.fair)
        await client.aclose()


def test_a_successor_the_queue_handed_the_permit_first_holds_by_its_relayed_token_and_a_whole_lease(
    redis_server: RedisServer, loop: asyncio.AbstractEventLoop
) -> None:
    loop.run_until_complete(pass_to_a_successor_granted_by_a_raise(redis_server))


async def pass_to_a_successor_granted_by_a_raise(server: RedisServer) -> None:
    client = server.client()
    keys = SemaphoreKeys.for_name("relay", secrets.token_hex(6))
    other, first, second = f"{OTHER}.x", f"{CALLER}.a", f"{CALLER}.b"

    step = functools.partial(mutex_step, client, keys)
    try:
        await step(Step.WAIT, [other, first, second])  # `other` holds; the caller's two wait
        released = await step(Step.RELEASE, [other])
        ((relayed_to, token),) = released.relayed
        assert relayed_to == second  # `first` holds, and relays on to `second`
        # Another process raises the limit: `second`, the queue's head, is handed a permit of its own, with
        # a new token and a lease of one waiter timeout, for a claim its process -- which relays to it
        # at once, and so never claims -- will not send.
        raised = await step(Step.LIMIT, ["2"], caller=OTHER)
        ((granted, new_token),) = raised.granted
        assert (granted, new_token > token) == (second, True)
        passed = await step(Step.PASS, [first, second, str(token)], now=START + 1)
        # Its acquire returned with the relayed token, and its lease from the pass: so says Redis.
        assert passed.values == (1, token, 0)
        assert await seen(client, keys) == Seen({second: (token, START + 1)}, [], new_token)
    finally:
        await client.delete(*keys.fair)
        await client.aclose()


def test_a_pass_sent_again_passes_on_only_a_permit_it_released_itself(
    redis_server: RedisServer, loop: asyncio.AbstractEventLoop
) -> None:
    loop.run_until_complete(pass_sent_again_without_a_limit(redis_server))


async def pass_sent_again_without_a_limit(server: RedisServer) -> None:
    client = server.client()
    keys = SemaphoreKeys.for_name("relay", secrets.token_hex(6))
    holder, successor, other = f"{CALLER}.a", f"{CALLER}.b", f"{OTHER}.x"
    try:
        # The pass's first try released `holder`; `successor` not at the queue's head then, the permit
        # went to the head, `other`; the reply was lost. The limit's key is gone since (evicted), and
        # the caller brings none. Sent again, the pass finds `holder` released by its first try, and
        # `successor` at the head: it must not install it beside `other`.
        await client.zadd(keys.timeout_set, {other: f"{START:.6f}"})
        await client.zadd(keys.owner_set, {other: 5})
        await client.zadd(keys.queue, {successor: 1})
        await client.zadd(keys.waiters, {successor: f"{START + WAITER_TTL:.6f}"})
        await client.set(keys.receipt("c2"), "1")
        passed = await fair_step(
            client,
            Step.PASS,
            keys,
            [holder, successor, "7"],
            now=START,
            lease=LEASE,
            limit=None,
            waiter_ttl=WAITER_TTL,
            caller=CALLER,
            call="c2",
            relays=True,
        )
        assert passed.values == (1, 0, 0)  # released, as the first try said; nobody installed
        assert (passed.holders, passed.waiting) == (1, 1)
        assert await client.zrange(keys.owner_set, 0, -1) == [other.encode()]
    finally:
        await client.delete(*keys.fair, keys.receipt("c2"))
        await client.aclose()
