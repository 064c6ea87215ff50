"""Live limit changes under contention: the limit moves every 0.5 s between 1 and 10, across processes.

Three worker processes of eight coroutines each loop on one semaphore:
acquire, hold 2-12 ms, release. Their objects bring different limits --
none, 3 and 10 -- and a controller in this process sets the limit in force
16 times, 0.5 s apart, alternately raising and lowering it through a random
sequence in 1..10 (drawn in turn from 6..10 and 1..4). With 24 contenders the queue is never empty, so every
lowering finds more permits held than the new limit allows, and every raise
finds waiters to serve.

What is checked is read from Redis's own record of what aiosem wrote, not
from what the workers believe: a ``MONITOR`` connection sees, in the
server's one serial order, every command of every step -- a script's
commands right after its ``EVALSHA``, a transaction's queued commands at
its ``EXEC`` -- and the test replays the writes to the owner set (grants
and releases), the queue (tickets) and the limit key. Then, step by step:

* after a step that granted a permit, at most the limit in force is held:
  a grant is made only while fewer than the limit hold. After a lowering
  this is the issue's rule -- no new grant while the held weight is at or
  above the new limit -- checked at every release that drains the backlog;
* the step that raises the limit grants, after the ``SET`` of the limit,
  exactly the heads of the queue (by ticket, in ticket order, with
  increasing fencing tokens), as many as the new limit frees, and leaves no
  free permit while anybody waits: the "within one round trip" is that the
  grant is in the very step of the change. The controller checks the same
  from `set_limit`'s own reply; the cross-process wake-up is only bounded
  generously here (its latency is ``benchmarks/bench_live_limit.py``'s);
* the replay is complete: the grants it saw are exactly the permits (by
  identifier and fencing token) the workers' acquires returned, and it ends
  where Redis ends, with nothing held and nobody queued.

It cannot pass vacuously: it requires hundreds of grants, lowerings that
found more permits held than the new limit allows, lowerings followed by a
release that was withheld from the queue, and raises that granted queued
waiters in their step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import secrets
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import anyio
import pytest

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._rules import SKIPLIST_MOVER

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence

    from aiosem._keys import SemaphoreKeys
    from tests.harness.support import RedisServer

pytestmark = pytest.mark.slow

Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: The limits the worker processes' objects bring: a limit set wins over each.
BROUGHT: Final = ("none", "3", "10")
COROUTINES: Final = 8
CHANGES: Final = 16
PERIOD: Final = 0.5
#: The limits are drawn in turn from these: every lowering finds at least two
#: permits held over the new limit, so some release must be withheld.
LOW: Final = range(1, 5)
HIGH: Final = range(6, 11)
#: Generous: a waiter granted by a raise is woken by a message, not found
#: by its process's next heartbeat; the latency itself is the benchmark's.
WAKE_BOUND: Final = 2.0
#: Every wait of the test's own is bounded by this.
STEP_TIMEOUT: Final = 30.0

WORKER: Final = textwrap.dedent(
    """
    import asyncio, json, random, sys, time
    import anyio
    import redis.asyncio
    import aiosem

    async def loop(sem, stop, rng, grants):
        while not stop.is_set():
            permit = await sem.acquire()
            grants.append((permit.identifier, permit.fencing_token, time.monotonic()))
            await asyncio.sleep(rng.uniform(0.002, 0.012))
            if not await sem.release(permit):
                raise RuntimeError(f"the permit {permit.identifier} was lost before its release")

    async def main(url, cls, name, brought, coroutines, seed):
        client = redis.asyncio.Redis.from_url(url)
        limit = None if brought == "none" else int(brought)
        sem = getattr(aiosem, cls)(client, name, limit, waiter_timeout=5.0)
        rng, grants, stop = random.Random(int(seed)), [], asyncio.Event()
        # The test says stop by closing stdin.
        waiting = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        waiting.add_done_callback(lambda _: stop.set())
        try:
            with anyio.fail_after(LIFETIME):
                await asyncio.gather(*(loop(sem, stop, rng, grants) for _ in range(int(coroutines))))
        finally:
            await sem.aclose()
            await client.aclose()
        print(json.dumps(grants), flush=True)

    asyncio.run(main(*sys.argv[1:]))
    """
).replace("LIFETIME", "120")


# --- replaying MONITOR ------------------------------------------------------------

_LINE: Final = re.compile(r"^[\d.]+ \[\d+ ([^\]]+)\] (.*)$")
_ARGUMENT: Final = re.compile(r'"((?:[^"\\]|\\.)*)"')
#: Commands that only read, expire or persist a key: they change no member.
_KEEPING: Final = frozenset({
    "ZSCORE", "ZMSCORE", "ZCARD", "ZRANGE", "ZRANGEBYSCORE", "ZINTERCARD", "GET", "PTTL", "PERSIST", "PEXPIRE",
    "WATCH",
})  # fmt: skip


@dataclass
class Step:
    """One atomic step as MONITOR showed it, and what the replay noted of it."""

    lines: list[str] = field(default_factory=list)
    #: New members of the owner set: (identifier, token), in the order added.
    granted: list[tuple[str, int]] = field(default_factory=list)
    released: int = 0
    #: Set by a ``SET`` of the limit: (limit before, limit after, held then, the queue then in ticket order).
    change: tuple[int, int, int, list[str]] | None = None
    #: The grants made after that ``SET``.
    granted_after_change: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class Replay:
    """The owner set, the queue and the limit, as aiosem's writes left them, step by step."""

    keys: SemaphoreKeys
    owners: dict[str, int] = field(default_factory=dict)
    queue: dict[str, float] = field(default_factory=dict)
    limit: int = 0
    grants: list[tuple[str, int]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    #: Lowerings that found more permits held than the new limit allows, with waiters queued.
    pressed_lowerings: int = 0
    #: Steps that released a permit while waiters were queued, and granted none: held at or over the limit.
    withheld_releases: int = 0
    #: Lowerings after which, before the next change, at least one such release came.
    exercised_lowerings: int = 0
    #: Whether the last change was a lowering that no withheld release followed yet.
    lowered: bool = False
    #: Raises that found waiters, and the grants they made in their own step.
    raises_with_waiters: int = 0
    raise_grants: int = 0

    def run(self, lines: Iterator[str]) -> None:
        step = Step()
        after_script = False
        for line in lines:
            match = _LINE.match(line)
            if match is None:
                continue
            client, rest = match[1], match[2]
            arguments = [text.replace('\\"', '"') for text in _ARGUMENT.findall(rest)]
            if not arguments:
                continue
            command = arguments[0].upper()
            in_script = client == "lua"
            # A script's commands follow its EVALSHA; a transaction's come at
            # its EXEC, just before it. Anything else ends the step before.
            if (not in_script and (command in {"EVALSHA", "EVAL"} or after_script)) or command == "MULTI":
                self.close(step)
                step = Step()
            step.lines.append(line)
            self.apply(step, command, arguments[1:])
            if command == "EXEC":
                self.close(step)
                step = Step()
            after_script = in_script
        self.close(step)

    def apply(self, step: Step, command: str, arguments: Sequence[str]) -> None:
        keys = self.keys
        if not arguments or arguments[0] not in {keys.owner_set, keys.queue, keys.limit} or command in _KEEPING:
            return
        key, rest = arguments[0], list(arguments[1:])
        if key == keys.limit and command == "SET":
            before, value = self.limit, int(rest[0].lstrip("="))
            self.limit = value
            queue = sorted(self.queue, key=self.queue.__getitem__)
            step.change = (before, value, len(self.owners), queue)
        elif key in {keys.owner_set, keys.queue} and command == "ZADD":
            while rest and rest[0].upper() in {"NX", "XX", "GT", "LT", "CH"}:
                rest.pop(0)
            for score, member in zip(rest[::2], rest[1::2], strict=True):
                if member == SKIPLIST_MOVER:
                    continue  # added and taken out in one step, to move the set to the skiplist encoding
                if key == keys.queue:
                    self.queue[member] = float(score)
                else:
                    self.hold(step, member, int(float(score)))
        elif key in {keys.owner_set, keys.queue} and command == "ZREM":
            target = self.owners if key == keys.owner_set else self.queue
            for member in rest:
                if target.pop(member, None) is not None and key == keys.owner_set:
                    step.released += 1
        else:
            # A write the replay does not model (a reaper's ZINTERSTORE, a DEL):
            # it would make the counts below guesses, so it is a failure.
            self.violations.append(f"unmodelled write: {step.lines[-1]}")

    def hold(self, step: Step, member: str, token: int) -> None:
        if member in self.owners:
            # A pass to a successor the queue handed a permit first: it holds by the token relayed to it.
            self.owners[member] = token
            self.grants = [(granted, token if granted == member else held) for granted, held in self.grants]
            return
        self.owners[member] = token
        grant = (member, token)
        step.granted.append(grant)
        self.grants.append(grant)
        if step.change is not None:
            step.granted_after_change.append(grant)

    def close(self, step: Step) -> None:
        if not step.lines:
            return
        held, queued = len(self.owners), len(self.queue)
        where = "\n    ".join(step.lines)
        if step.granted and held > self.limit:
            self.violations.append(f"a step granted, leaving {held} held over the limit {self.limit}:\n    {where}")
        if step.released and not step.granted and queued and step.change is None:
            if held < self.limit:
                self.violations.append(f"a release left {held} held under the limit {self.limit} and waiters queued")
            self.withheld_releases += 1
            self.exercised_lowerings += self.lowered
            self.lowered = False
        if step.change is None:
            return
        before, after, held_then, queue_then = step.change
        self.lowered = after < before
        if after < before and queue_then and held_then > after:
            self.pressed_lowerings += 1
        if after > before and queue_then:
            self.raises_with_waiters += 1
            self.raise_grants += len(step.granted_after_change)
            expected = queue_then[: max(0, after - held_then)]
            granted = [member for member, _ in step.granted_after_change]
            tokens = [token for _, token in step.granted_after_change]
            if granted != expected:
                self.violations.append(f"the raise to {after} granted {granted}, not the queue's heads {expected}")
            if tokens != sorted(tokens) or len(set(tokens)) != len(tokens):
                self.violations.append(f"the raise to {after} granted tokens out of order: {tokens}")
            if queued and held < after:
                self.violations.append(f"the raise to {after} left {held} held and {queued} queued")


# --- the run ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    limit: int
    before: int | None
    #: `time.monotonic` when `set_limit` returned: CLOCK_MONOTONIC, one clock for every process of the machine.
    at: float
    holders: int
    waiting: int
    granted: tuple[tuple[str, int], ...]


def limits(rng: random.Random, count: int) -> list[int]:
    """``count`` limits, alternately drawn from LOW and HIGH: every change moves the limit by at least 2."""
    return [rng.choice(HIGH if i % 2 == 0 else LOW) for i in range(count)]


@contextlib.asynccontextmanager
async def monitoring(server: RedisServer, into: bytearray) -> AsyncIterator[None]:
    """Everything the server runs while the block runs, as MONITOR prints it, appended to ``into``."""
    reader, writer = await asyncio.open_connection(server.host, server.port)

    async def read() -> None:
        while chunk := await reader.read(1 << 20):
            into.extend(chunk)

    try:
        # The unrestricted default user: MONITOR is the test's own inspection.
        writer.write(b"MONITOR\r\n")
        await writer.drain()
        with anyio.fail_after(STEP_TIMEOUT):
            assert await reader.readline() == b"+OK\r\n"
        task = asyncio.create_task(read())
        try:
            yield
            # Whatever Redis ran before this ECHO has been sent before its line.
            marker = f"end-{secrets.token_hex(4)}"
            client = server.admin_client()
            try:
                await client.echo(marker)
            finally:
                await client.aclose()
            with anyio.fail_after(STEP_TIMEOUT):
                while marker.encode() not in into:  # noqa: ASYNC110 -- the reader appends in the background
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def lines_of(raw: bytes) -> Iterator[str]:
    for line in raw.split(b"\r\n"):
        if line.startswith(b"+"):
            yield line[1:].decode()


async def change_limits(controller: Semaphore, values: Sequence[int]) -> list[Change]:
    changes = []
    next_at = time.monotonic()
    for value in values:
        next_at += PERIOD
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        before = await controller.set_limit(value)
        at = time.monotonic()
        reply = controller._core.last
        changes.append(Change(value, before, at, reply.holders, reply.waiting, reply.granted))
    return changes


@dataclass(frozen=True, slots=True)
class Run:
    changes: list[Change]
    #: Per worker: (identifier, fencing token, `time.monotonic` when its acquire returned) of each grant.
    grants: list[list[tuple[str, int, float]]]
    #: Permits held and waiters queued in Redis once the workers were done.
    held_at_end: int
    queued_at_end: int


async def contend(server: RedisServer, controller: Semaphore, start: int, values: Sequence[int], seed: int) -> Run:
    """Start the workers, change the limit through ``values`` once they contend, stop them, and collect."""
    workers: list[asyncio.subprocess.Process] = []
    try:
        assert await controller.set_limit(start) is None
        for index, brought in enumerate(BROUGHT):
            worker = await asyncio.create_subprocess_exec(
                sys.executable, "-c", WORKER, server.url, controller.__class__.__name__, controller.name, brought,
                str(COROUTINES), str(seed + index),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            workers.append(worker)
        with anyio.fail_after(STEP_TIMEOUT):
            while await controller.waiting() == 0:  # noqa: ASYNC110 -- a bounded poll of Redis's own state
                await asyncio.sleep(0.01)
        changes = await change_limits(controller, values)
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.close()
        grants = []
        with anyio.fail_after(STEP_TIMEOUT):
            for worker in workers:
                out, _ = await worker.communicate()
                assert worker.returncode == 0, f"a worker failed (exit code {worker.returncode})"
                grants.append([(identifier, token, at) for identifier, token, at in json.loads(out)])
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
    keys = controller._keys
    held, queued = await controller._client.zcard(keys.owner_set), await controller._client.zcard(keys.queue)
    return Run(changes, grants, held, queued)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
async def test_live_limit_changes_under_contention(fresh_redis_server: RedisServer, cls: type[Semaphore]) -> None:
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")  # noqa: T201 -- to replay a failure's sequence
    rng = random.Random(seed)
    start, *values = limits(rng, CHANGES + 1)
    client = fresh_redis_server.client()
    controller = cls(client, f"live-{cls.__name__}-{secrets.token_hex(4)}", None)
    record = bytearray()
    try:
        async with monitoring(fresh_redis_server, record):
            run = await contend(fresh_redis_server, controller, start, values, seed)
    finally:
        await controller.aclose()
        await client.aclose()

    returned = {grant[0]: grant for grants in run.grants for grant in grants}
    replay = Replay(controller._keys)
    replay.run(lines_of(bytes(record)))
    print(  # noqa: T201 -- the figures, with `pytest -s`
        f"{cls.__name__}: limits {start} -> {values}; {len(replay.grants)} grants, "
        f"{replay.pressed_lowerings} pressed lowerings ({replay.exercised_lowerings} followed by a withheld release), "
        f"{replay.withheld_releases} withheld releases, "
        f"{replay.raises_with_waiters} raises with waiters granting {replay.raise_grants}"
    )
    assert not replay.violations, "\n".join(replay.violations[:5])

    # The controller's own replies say the same of each step of its.
    changes = run.changes
    assert [change.limit for change in changes] == values
    assert [change.before for change in changes] == [start, *values[:-1]]
    for change in changes:
        assert change.waiting == 0 or change.holders >= change.limit, change
    # Each waiter a raise granted was woken by it, not found by its process's later look.
    late = [
        (identifier, returned[identifier][2] - change.at)
        for change in changes
        for identifier, _ in change.granted
        if returned[identifier][2] - change.at > WAKE_BOUND
    ]
    assert not late

    # The replay saw every grant -- the same identifiers and tokens the acquires returned -- and ends where Redis does.
    assert sorted(replay.grants) == sorted((identifier, token) for identifier, token, _ in returned.values())
    assert len(replay.grants) == sum(len(grants) for grants in run.grants)
    assert (len(replay.owners), len(replay.queue)) == (run.held_at_end, run.queued_at_end) == (0, 0)
    # And what it checked happened, often.
    assert len(replay.grants) >= 300
    assert replay.pressed_lowerings >= 3
    assert replay.exercised_lowerings >= 3
    assert replay.raises_with_waiters >= 3
    assert replay.raise_grants >= replay.raises_with_waiters
