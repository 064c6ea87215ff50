"""Many processes contend with random weights for one limit on a real server: it is never exceeded, and order holds.

Four worker processes of ten coroutines each loop for about ten seconds
on one semaphore of limit 8: each call draws a weight from 1 to 4, takes a
permit of that weight, adds the weight to an in-use counter in Redis,
holds for a moment, takes the weight off again and releases.

The limit is checked against the server's own count, not the workers'
word: one script adds the weight and raises a ``peak`` key to the sum if
it is higher, atomically. A holder adds only once its acquire returned and
takes off before it releases, so the in-use sum never counts a weight that
is not held: ``peak`` above the limit is an over-admission.

Order: one object's calls, made in order, reach Redis in that order, and
Redis serves them in that order whatever they weigh -- a call that finds
nobody queued and its weight free is granted in its own step, later calls
queue behind any waiter, and the queue is served from its head (a head
whose weight does not fit holds back those behind it). Fencing tokens come
from one counter that every grant increases. So within one process, the
tokens of its calls increase in the order the calls were made. Across
processes the queue order is the order their steps reached Redis, which
the workers cannot see: only that no token was handed out twice.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import secrets
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Final, Literal

import anyio
import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._keys import SemaphoreKeys
from aiosem._options import DEFAULT_PREFIX
from aiosem._timing import Backoff, Deadline
from aiosem._urls import close, connect
from tests.harness.support import worker_outputs

if TYPE_CHECKING:
    import redis.asyncio

    from tests.harness.support import RedisServer

pytestmark = pytest.mark.slow

Kind = Literal["fair", "locked"]
CLASSES: Final[dict[Kind, type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]]] = {
    "fair": AsyncFairSemaphore,
    "locked": AsyncLockedSemaphore,
}

#: A worker process: runs the `Load` given as JSON, prints its `Calls` as JSON.
WORKER: Final = (
    "import sys; from tests.faults.test_weighted_contention import work_in_process; work_in_process(sys.argv[1])"
)

LIMIT: Final = 8
WORKERS: Final = 4
COROUTINES: Final = 10
HEAVIEST: Final = 4
DURATION: Final = 10.0
#: The longest hold, in seconds: random from 0 to it.
HOLD: Final = 0.004
#: The lease: far longer than any hold, so that no permit runs out under a busy machine.
LEASE: Final = 30.0
#: How long one acquire may wait before the worker gives up on the run: a stall, not contention.
STALL: Final = 20.0
#: How long the workers wait for each other to start together.
START: Final = 60.0

#: KEYS[1] the in-use sum, KEYS[2] the highest it reached; ARGV[1] the weight taken (positive) or given
#: back (negative). Adds the weight and raises the peak in one atomic step; returns the new sum.
COUNT: Final = """
local in_use = redis.call('INCRBY', KEYS[1], ARGV[1])
if in_use > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], in_use)
end
return in_use
"""


@dataclass(frozen=True, slots=True)
class Load:
    """What one worker process does."""

    url: str
    kind: Kind
    name: str
    seed: int


@dataclass(frozen=True, slots=True)
class Call:
    """One acquire of a worker: when it was made among the process's calls, what it weighed, what it got."""

    arrival: int
    weight: int
    token: int
    waited: float


def keys_of(name: str) -> tuple[str, str, str]:
    """The run's in-use sum, its peak and its start line: of the semaphore's hash tag, so a cluster would do too."""
    return f"weighted:{{{name}}}:in-use", f"weighted:{{{name}}}:peak", f"weighted:{{{name}}}:ready"


async def run_load(load: Load) -> list[Call]:
    """Run ``COROUTINES`` coroutines on one semaphore object for `DURATION` seconds; return their calls."""
    client = connect(load.url)
    sem = CLASSES[load.kind](client, load.name, LIMIT, timeout=LEASE)
    in_use, peak, ready = keys_of(load.name)
    rng = random.Random(load.seed)
    calls: list[Call] = []
    arrivals = 0
    try:
        await client.incr(ready)
        start, backoff = Deadline(START), Backoff()
        while int(await client.get(ready) or 0) < WORKERS:
            assert not start.passed(), "the other workers never started"
            await backoff.pause(start)
        end = time.monotonic() + DURATION

        async def cycle() -> None:
            nonlocal arrivals
            while time.monotonic() < end:
                weight = rng.randint(1, HEAVIEST)
                # Numbered as it is made: nothing is awaited between here and the acquire's call being sent.
                arrival, arrivals = arrivals, arrivals + 1
                began = time.monotonic()
                permit = await sem.acquire(weight=weight, blocking_timeout=STALL)
                assert permit is not None, f"no permit of {weight} within {STALL} s"
                calls.append(Call(arrival, weight, permit.fencing_token, time.monotonic() - began))
                await client.eval(COUNT, 2, in_use, peak, weight)
                await asyncio.sleep(rng.uniform(0, HOLD))
                await client.eval(COUNT, 2, in_use, peak, -weight)
                assert await sem.release(permit), "a permit was lost: the lease is far longer than any hold"

        await asyncio.gather(*(cycle() for _ in range(COROUTINES)))
    finally:
        await sem.aclose()
        await close(client)
    return calls


def work_in_process(load: str) -> None:
    """A worker process's body: run the load given as JSON, print its calls as JSON."""
    calls = asyncio.run(run_load(Load(**json.loads(load))))
    print(json.dumps([asdict(call) for call in calls]), flush=True)  # noqa: T201 -- the answer to the parent


async def longest_queue(admin: redis.asyncio.Redis, queue: str, until: anyio.Event) -> int:
    """The most waiters Redis had queued at once, sampled every 10 ms until ``until`` is set."""
    longest = 0
    while not until.is_set():
        longest = max(longest, await admin.zcard(queue))
        with anyio.move_on_after(0.01):
            await until.wait()
    return longest


async def in_processes(loads: list[Load], within: float) -> list[list[Call]]:
    """Run each load in a process of its own, all at once; return each one's calls."""
    outputs = await worker_outputs(WORKER, [json.dumps(asdict(load)) for load in loads], within)
    return [[Call(**call) for call in json.loads(stdout)] for stdout in outputs]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["fair", "locked"])
async def test_random_weights_never_exceed_the_limit_and_each_process_is_served_in_call_order(
    kind: Kind, redis_server: RedisServer, real_client: redis.asyncio.Redis, admin_client: redis.asyncio.Redis
) -> None:
    name = f"weighted-{kind}-{secrets.token_hex(4)}"
    seed = random.randrange(2**32)
    loads = [Load(redis_server.url, kind, name, seed + worker) for worker in range(WORKERS)]
    # Spawned and started together: the workers wait for each other before the run's ten seconds.
    keys = SemaphoreKeys.for_name(DEFAULT_PREFIX, name)
    done = anyio.Event()
    sampler = asyncio.create_task(longest_queue(admin_client, keys.queue, done))
    try:
        per_process = await in_processes(loads, within=START + DURATION + STALL + 30)
    finally:
        done.set()
        longest = await sampler

    in_use, peak, _ = keys_of(name)
    highest = int(await admin_client.get(peak) or 0)
    calls = [call for process in per_process for call in process]
    # The figures for the record (and the seed to draw the same weights again): shown with `pytest -s`.
    figures = f"{len(calls)} grants, peak {highest}/{LIMIT}, up to {longest} queued"
    print(f"{kind}: seed {seed}, {figures}, longest wait {max(call.waited for call in calls):.3f} s")  # noqa: T201

    assert highest <= LIMIT, f"{highest} weight held at once under a limit of {LIMIT}"
    assert highest >= LIMIT - HEAVIEST + 1  # contended: the limit was nearly full, as weights allow
    assert int(await admin_client.get(in_use) or 0) == 0
    assert len(calls) >= 200
    assert longest >= WORKERS  # waiters of several processes queued at once
    assert {call.weight for call in calls} == set(range(1, HEAVIEST + 1))

    for worker, process in enumerate(per_process):
        tokens = [call.token for call in sorted(process, key=lambda call: call.arrival)]
        out_of_order = [(a, b) for a, b in itertools.pairwise(tokens) if a >= b]
        assert not out_of_order, f"worker {worker}: tokens out of call order: {out_of_order[:5]}"
    assert len({call.token for call in calls}) == len(calls)  # no token handed out twice

    sem = CLASSES[kind](real_client, name, LIMIT)
    assert (await sem.count(), await sem.waiting()) == (0, 0)
    assert await admin_client.exists(keys.weight, keys.owner_set, keys.queue, keys.holders) == 0
