"""Where a cycle's time goes: CPU per round trip and per cycle, in the client and in Redis.

Measured on one private ``redis-server``:

* **per round trip** (1 coroutine, the best of 3 runs of 3,000 calls): the
  wall time and the client process's CPU time of one ``EVALSHA`` of a
  one-line script sent through ``Redis.evalsha`` -- redis-py's whole command
  path -- and of the same command written to a borrowed connection, as
  aiosem writes its scripts; then of one `AsyncFairSemaphore.refresh`,
  a whole step with one identifier; and of the pieces a step adds to its
  round trip, each alone: a connection borrowed from the pool and given
  back, a task started and awaited (a lane's flusher), and the bound
  entered and left.
* **per cycle** (the throughput scenarios: 64 coroutines at limits 16 and 1,
  1 coroutine, and the raw loop): cycles/s, the client's CPU per cycle and
  the server's (from ``/proc/<pid>/stat``), and scripts per cycle with the
  server's time per script (``INFO commandstats``). Whichever side is near
  100 % of a core is what bounds the scenario. Of a script's time, the
  commands it ran (``commandstats`` counts those inside scripts too) take
  part, and Lua -- the script's own code, and each ``redis.call``'s
  crossing into Redis and back -- the rest: the report gives both, and the
  commands that took the most.
* **a step and a call apart**: the limit-16 scenario again at limits 8, 32
  and 64, with four coroutines per permit each time. A step carries about
  as many calls as the limit, so the scripts per cycle fall as it rises;
  a least-squares line of CPU per cycle against scripts per cycle splits a
  cycle's CPU, in the client and in Redis, into what each step costs
  whatever it carries (the slope) and what the calls cost beside their
  steps (the intercept).

* **wake-ups per cycle**: 64 coroutines at limit 16, each holding its
  permit for one pass of the event loop (``await asyncio.sleep(0)``), as
  ``bench_peers.py``'s loop does, for one second under CPython's profile
  hook: how often the event loop resumed a coroutine's task, and how many
  callbacks it ran, per cycle -- for `AsyncFairSemaphore` by
  ``acquire``/``release`` and by ``async with``, for
  `AsyncLockedSemaphore` by ``acquire``/``release``, and for
  ``asyncio.Semaphore``, the in-process ceiling. The hook slows everything:
  only the counts are reported.

* **the in-process budget**: the same held loop (64 coroutines, limit 16,
  one loop pass held) for ``asyncio.Semaphore``, for `AsyncFairSemaphore`,
  and for `ThinBatched`, the thinnest client of a batched semaphore kept in
  Redis -- every call of a turn of the loop in one write -- with three
  designs: `BARE_SCRIPT`, a count and a list with none of a semaphore's
  guarantees (with one script in flight and with two); `GUARDED_SCRIPT`,
  the lease on the server's clock, fencing tokens, the queue in arrival
  order and the waiters' liveness; and `FairScripts`, `AsyncFairSemaphore`'s
  own scripts, called as its steps call them (with one turn's scripts in
  flight and with two turns'). For each: cycles/s, client
  and server CPU per cycle, calls per script, and the rate the two CPUs
  would allow if they never overlapped (``1 / (client + server)``). Against
  the in-process loop's time per cycle, it gives the time a cycle may take
  at 0.15 and 0.25 of it.

With ``--profile``, the contended limit-16 scenario runs once more under
pyinstrument, and its heaviest frames are printed.

Run it::

    python benchmarks/bench_costs.py
    python benchmarks/bench_costs.py --json benchmarks/results/costs.json --profile
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import itertools
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import hiredis
from harness import (
    HOST,
    RAW_REMOVE,
    Cycler,
    InProcess,
    RawLoop,
    RedisServer,
    environment,
    markdown_table,
    new_client,
    positive,
    redis_server_binary,
    run_phase,
    write_report,
)

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._connection import pinned_connection
from aiosem._fair import fair_call
from aiosem._keys import SemaphoreKeys, encode_record
from aiosem._options import DEFAULT_PREFIX, DEFAULT_TIMEOUT
from aiosem._protocol import Step, parse_reply
from aiosem._rules import SKIPLIST_AT, SKIPLIST_MOVER
from aiosem._scripts import FAIR_ACQUIRE, FAIR_RELEASE
from aiosem._timing import Bound
from aiosem._validation import WAITER_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
    from types import FrameType
    from typing import TypeAlias

    import redis.asyncio

    #: One command a turn of `ThinBatched` writes, and what reads the grants from its reply.
    Sent: TypeAlias = tuple[tuple[str | int, ...], Callable[[Any], Iterable[tuple[str, int]]]]

CALLS: Final = 3000
RUNS: Final = 3
#: (label, limit, coroutines): the throughput benchmark's scenarios; limit 0 is the raw loop.
CYCLES: Final = (
    ("raw EVALSHA loop", 0, 64),
    ("AsyncFairSemaphore, limit 16", 16, 64),
    ("AsyncFairSemaphore, limit 1", 1, 64),
    ("AsyncFairSemaphore, limit 16", 16, 1),
)
#: The limits of the split, each with four coroutines per permit; limit 16 is measured above.
SPLIT_LIMITS: Final = (8, 32, 64)
#: The fractions of the in-process loop's rate whose time per cycle the budget gives (the issue's minimum and aim).
BUDGET_FRACTIONS: Final = (0.15, 0.25)
#: The budget's yardstick.
IN_PROCESS_LOOP: Final = "asyncio.Semaphore (one process)"
#: How many turns each loop of the budget takes.
BUDGET_ROUNDS: Final = 3
#: The keys of the semaphore `FairScripts` keeps in the budget.
THIN_FAIR_KEYS: Final = SemaphoreKeys.for_name(DEFAULT_PREFIX, "budget-thin")
#: The same, for the `FairScripts` loop with two turns in flight.
DEEP_FAIR_KEYS: Final = SemaphoreKeys.for_name(DEFAULT_PREFIX, "budget-deep")
#: How long the permits of `GUARDED_SCRIPT` and of `FairScripts` last, and how
#: long their waiters are presumed alive after they joined the queue
#: (seconds): aiosem's defaults.
BUDGET_LEASE: Final = DEFAULT_TIMEOUT
BUDGET_WAITER_TTL: Final = WAITER_TIMEOUT


@dataclass(frozen=True, slots=True)
class BatchedScript:
    """A script of `ThinBatched`'s own: its Lua, the suffixes of its keys, and the arguments it takes before the calls.

    A turn's calls go in one call of it, each two arguments, ``a`` or ``r``
    and an identifier; it returns the permits it granted as identifier,
    fencing token pairs.
    """

    label: str
    lua: str
    keys: tuple[str, ...]
    #: Its arguments before the calls; ``{limit}`` is the semaphore's.
    arguments: tuple[str, ...]


#: The least a batched semaphore's script can do: every acquire (``a``) takes
#: a unit of the count or joins the list; every release (``r``) hands its unit
#: to the list's head or gives it back. Its tokens are 0: it has none.
BARE_SCRIPT: Final = BatchedScript(
    "bare script",
    """
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
local limit = tonumber(ARGV[1])
local granted = {}
for i = 2, #ARGV, 2 do
  if ARGV[i] == 'a' then
    if count < limit then
      count = count + 1
      granted[#granted + 1] = ARGV[i + 1]
      granted[#granted + 1] = 0
    else
      redis.call('RPUSH', KEYS[2], ARGV[i + 1])
    end
  else
    local head = redis.call('LPOP', KEYS[2])
    if head then
      granted[#granted + 1] = head
      granted[#granted + 1] = 0
    else
      count = count - 1
    end
  end
end
redis.call('SET', KEYS[1], count)
return granted
""",
    ("count", "queue"),
    ("{limit}",),
)

#: The least a batched semaphore's script can do and keep the guarantees the
#: issue names: a lease on the server's clock (a permit past it is reaped,
#: so a crashed holder's comes back), a fencing token for every grant, a
#: queue served in arrival order (newcomers behind it), and waiters presumed
#: dead once their time is up. One command of each kind a step, and sorted
#: sets in the skiplist encoding, as aiosem's scripts write. It leaves out the rest of what aiosem keeps: tombstones for
#: acquires given up before they arrive, receipts that make a release safe
#: to send again, weights, a limit that can change, the holders' records,
#: the keys' TTLs, the repair of what eviction took, the relay of a mutex.
GUARDED_SCRIPT: Final = BatchedScript(
    "guarded script",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit, lease, waiter_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local skiplist_at, mover = tonumber(ARGV[4]), ARGV[5]
local TIMEOUTS, OWNERS, COUNTER, QUEUE, WAITERS, TICKETS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
-- Add score-member pairs to a sorted set of `size` members; one that grows
-- to skiplist_at goes to the skiplist encoding first, as aiosem's do.
local function add(key, size, pairs)
  local grows = size < skiplist_at and size + #pairs / 2 >= skiplist_at
  if grows then
    redis.call('ZADD', key, 0, mover)
  end
  redis.call('ZADD', key, unpack(pairs))
  if grows then
    redis.call('ZREM', key, mover)
  end
end
-- The lease, on the server's clock: permits past it go.
local expired = redis.call('ZRANGEBYSCORE', TIMEOUTS, '-inf', string.format('%.6f', now - lease))
if #expired > 0 then
  redis.call('ZREM', TIMEOUTS, unpack(expired))
  redis.call('ZREM', OWNERS, unpack(expired))
end
-- Waiters presumed dead leave the queue.
local dead = redis.call('ZRANGEBYSCORE', WAITERS, '-inf', string.format('%.6f', now))
if #dead > 0 then
  redis.call('ZREM', QUEUE, unpack(dead))
  redis.call('ZREM', WAITERS, unpack(dead))
end
local held = redis.call('ZCARD', OWNERS)
local queued = redis.call('ZCARD', QUEUE)
local acquires, releases = {}, {}
for i = 6, #ARGV, 2 do
  if ARGV[i] == 'a' then
    acquires[#acquires + 1] = ARGV[i + 1]
  else
    releases[#releases + 1] = ARGV[i + 1]
  end
end
-- Only a permit still held is released.
if #releases > 0 then
  local tokens = redis.call('ZMSCORE', OWNERS, unpack(releases))
  local gone = {}
  for i, identifier in ipairs(releases) do
    if tokens[i] then
      gone[#gone + 1] = identifier
    end
  end
  if #gone > 0 then
    redis.call('ZREM', OWNERS, unpack(gone))
    redis.call('ZREM', TIMEOUTS, unpack(gone))
    held = held - #gone
  end
end
-- What is free goes to the queue's head first, then to newcomers if nobody is queued.
local granted = {}
local free = limit - held
if free > 0 and queued > 0 then
  local heads = redis.call('ZRANGE', QUEUE, 0, free - 1)
  if #heads > 0 then
    redis.call('ZREM', QUEUE, unpack(heads))
    redis.call('ZREM', WAITERS, unpack(heads))
  end
  for _, identifier in ipairs(heads) do
    granted[#granted + 1] = identifier
  end
  queued = queued - #heads
  free = free - #heads
end
local joining = {}
for _, identifier in ipairs(acquires) do
  if free > 0 and queued == 0 then
    granted[#granted + 1] = identifier
    free = free - 1
  else
    joining[#joining + 1] = identifier
  end
end
if #joining > 0 then
  local first = tonumber(redis.call('GET', TICKETS) or '0')
  redis.call('SET', TICKETS, first + #joining)
  local tickets, deadlines = {}, {}
  local deadline = string.format('%.6f', now + waiter_ttl)
  for i, identifier in ipairs(joining) do
    tickets[#tickets + 1] = first + i
    tickets[#tickets + 1] = identifier
    deadlines[#deadlines + 1] = deadline
    deadlines[#deadlines + 1] = identifier
  end
  add(QUEUE, queued, tickets)
  add(WAITERS, queued, deadlines)
end
-- Each grant's fencing token, and its lease from now.
local reply = {}
if #granted > 0 then
  local first = tonumber(redis.call('GET', COUNTER) or '0') + 1
  redis.call('SET', COUNTER, first + #granted - 1)
  local tokens, stamps = {}, {}
  local stamp = string.format('%.6f', now)
  for i, identifier in ipairs(granted) do
    tokens[#tokens + 1] = first + i - 1
    tokens[#tokens + 1] = identifier
    stamps[#stamps + 1] = stamp
    stamps[#stamps + 1] = identifier
    reply[#reply + 1] = identifier
    reply[#reply + 1] = first + i - 1
  end
  add(OWNERS, held, tokens)
  add(TIMEOUTS, held, stamps)
end
return reply
""",
    ("timeouts", "owners", "counter", "queue", "waiters", "tickets"),
    ("{limit}", f"{BUDGET_LEASE:g}", f"{BUDGET_WAITER_TTL:g}", str(SKIPLIST_AT), SKIPLIST_MOVER),
)


@dataclass(frozen=True, slots=True)
class CallCost:
    call: str
    wall_us: float
    cpu_us: float


@dataclass(frozen=True, slots=True)
class CycleCost:
    scenario: str
    coroutines: int
    cycles_per_second: float
    client_cpu_us: float
    client_busy: float
    server_cpu_us: float
    server_busy: float
    scripts_per_cycle: float
    server_us_per_script: float
    #: Of that, the time of the commands the scripts ran.
    commands_us_per_script: float
    #: The commands that took the most time inside the scripts: calls and microseconds, per script.
    heaviest_commands: dict[str, tuple[float, float]]


@dataclass(frozen=True, slots=True)
class Split:
    """A cycle's CPU in the client and in Redis: per step, and per cycle beside its steps (a linear fit)."""

    client_us_per_step: float
    client_us_per_cycle_beside_steps: float
    server_us_per_step: float
    server_us_per_cycle_beside_steps: float


@dataclass(frozen=True, slots=True)
class BudgetCost:
    """One loop of the in-process budget: 64 coroutines at limit 16, each holding its permit one loop pass."""

    loop: str
    cycles_per_second: float
    client_cpu_us: float
    server_cpu_us: float
    #: Calls (acquires and releases) per script; ``None`` where nothing goes to Redis.
    calls_per_script: float | None
    #: ``1 / (client + server CPU per cycle)``: the rate if the two processes never ran at once.
    lockstep_cycles_per_second: float
    ratio_to_in_process: float


@dataclass(frozen=True, slots=True)
class Wakeups:
    """What the event loop did per cycle, 64 coroutines at limit 16 holding each permit for one loop pass."""

    shape: str
    cycles: int
    #: How often a cycling coroutine's task was resumed.
    task_wakeups: float
    #: How many callbacks the loop ran: those wake-ups, and everything else (futures' callbacks, I/O, timers).
    loop_callbacks: float


class Design(Protocol):
    """What `ThinBatched` sends to Redis for a turn's calls, and how it reads the grants."""

    #: What its waiters' identifiers start with.
    prefix: str

    def sources(self) -> tuple[str, ...]:
        """The scripts to load before the first turn."""

    def keys(self) -> tuple[str, ...]:
        """The keys to empty before the first turn."""

    def commands(self, calls: list[str]) -> list[Sent]:
        """The commands that carry ``calls`` (``a`` or ``r``, then an identifier, each)."""


class OwnScript:
    """A `BatchedScript` for one semaphore: a turn's calls in one call of it."""

    prefix = ""

    def __init__(self, script: BatchedScript, name: str, limit: int) -> None:
        self._script = script
        self._sha = hashlib.sha1(script.lua.encode()).hexdigest()  # noqa: S324 -- Redis names scripts by SHA1
        self._keys = tuple(f"{name}:{suffix}" for suffix in script.keys)
        self._arguments = tuple(argument.format(limit=limit) for argument in script.arguments)

    def sources(self) -> tuple[str, ...]:
        return (self._script.lua,)

    def keys(self) -> tuple[str, ...]:
        return self._keys

    def commands(self, calls: list[str]) -> list[Sent]:
        return [(("EVALSHA", self._sha, len(self._keys), *self._keys, *self._arguments, *calls), self._grants)]

    @staticmethod
    def _grants(reply: list[Any]) -> Iterable[tuple[str, int]]:
        return ((reply[index].decode(), reply[index + 1]) for index in range(0, len(reply), 2))


class FairScripts:
    """`AsyncFairSemaphore`'s own scripts, as its steps call them: a turn's releases in one, its acquires in another.

    Both go in one write, the releases first, so that the permits they free
    go to the queue before the acquires join it. Each release carries a call
    id, as the class's do.
    """

    def __init__(self, keys: SemaphoreKeys, limit: int) -> None:
        self._semaphore_keys = keys
        self._limit = limit
        self._caller = secrets.token_hex(8)
        self.prefix = f"{self._caller}."
        self._record = encode_record(BUDGET_LEASE, os.getpid(), "bench", None)

    def sources(self) -> tuple[str, ...]:
        return (FAIR_ACQUIRE.source, FAIR_RELEASE.source)

    def keys(self) -> tuple[str, ...]:
        return self._semaphore_keys.fair

    def commands(self, calls: list[str]) -> list[Sent]:
        releases = [calls[index + 1] for index in range(0, len(calls), 2) if calls[index] == "r"]
        acquires = [calls[index + 1] for index in range(0, len(calls), 2) if calls[index] == "a"]
        sent: list[Sent] = []
        if releases:
            sent.append((self._command(Step.RELEASE, releases, secrets.token_hex(8)), self._handed(len(releases))))
        if acquires:
            sent.append((self._command(Step.WAIT, acquires, ""), self._granted(acquires)))
        return sent

    def _command(self, step: Step, identifiers: list[str], call: str) -> tuple[str | int, ...]:
        script, keys, arguments = fair_call(
            step,
            self._semaphore_keys,
            identifiers,
            now=None,
            lease=BUDGET_LEASE,
            limit=self._limit,
            waiter_ttl=BUDGET_WAITER_TTL,
            caller=self._caller,
            call=call,
            relays=False,
            record=self._record,
            publish="PUBLISH",
        )
        return ("EVALSHA", script.sha, len(keys), *keys, *arguments)

    @staticmethod
    def _handed(count: int) -> Callable[[Any], Iterable[tuple[str, int]]]:
        return lambda raw: parse_reply(raw, count).granted

    @staticmethod
    def _granted(acquires: list[str]) -> Callable[[Any], Iterable[tuple[str, int]]]:
        def read(raw: Any) -> Iterable[tuple[str, int]]:
            reply = parse_reply(raw, len(acquires))
            at_once = [
                (identifier, value) for identifier, value in zip(acquires, reply.values, strict=True) if value > 0
            ]
            return [*at_once, *reply.granted]

        return read


class ThinBatched:
    """The thinnest client of a batched semaphore kept in Redis: a bound on what batching gives, not one to use.

    The calls made in one turn of the event loop go out together, in the
    command or commands its `Design` makes of them, written in one write on
    one connection and read with hiredis, no redis-py in between; up to
    ``depth`` commands are in flight, answered in order. The client has none
    of what aiosem's owes its users: no timeout, no cancellation, no failure
    handling, no heartbeat for its waiters (the loops it runs in are shorter
    than their time). Its design decides what Redis keeps: nothing a
    semaphore owes (`BARE_SCRIPT`); the lease, the fencing tokens, the queue
    and the waiters' liveness (`GUARDED_SCRIPT`); or everything aiosem keeps
    (`FairScripts`).
    """

    __slots__ = (
        "_answering",
        "_depth",
        "_design",
        "_granted",
        "_identifiers",
        "_in_flight",
        "_loop",
        "_pending",
        "_reader",
        "_scheduled",
        "_stream",
        "_task",
        "_writer",
    )

    def __init__(self, stream: asyncio.StreamReader, writer: asyncio.StreamWriter, design: Design, depth: int) -> None:
        self._stream = stream
        self._writer = writer
        self._design = design
        self._depth = depth
        self._loop = asyncio.get_running_loop()
        self._reader = hiredis.Reader()
        self._pending: list[str] = []
        #: What reads the grants of each command in flight, in the order they were sent.
        self._answering: collections.deque[Callable[[Any], Iterable[tuple[str, int]]]] = collections.deque()
        self._granted: dict[str, asyncio.Future[int]] = {}
        self._in_flight = 0
        self._scheduled = False
        self._identifiers = itertools.count()
        self._task = self._loop.create_task(self._read())

    @classmethod
    @contextlib.asynccontextmanager
    async def opened(cls, port: int, design: Design, depth: int) -> AsyncIterator[ThinBatched]:
        """A new one on its own connection to the server at ``port``, its scripts loaded and its keys emptied."""
        stream, writer = await asyncio.open_connection(HOST, port)
        reader = hiredis.Reader()

        async def command(*arguments: str) -> Any:
            # hiredis's stub types the argument as a tuple of one element.
            writer.write(hiredis.pack_command(arguments))  # type: ignore[arg-type]
            while (reply := reader.gets()) is False:
                reader.feed(await stream.read(65536))
            return reply

        for source in design.sources():
            await command("SCRIPT", "LOAD", source)
        await command("DEL", *design.keys())
        thin = cls(stream, writer, design, depth)
        try:
            yield thin
        finally:
            thin._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await thin._task
            writer.close()
            await writer.wait_closed()

    async def acquire(self) -> str:
        identifier = f"{self._design.prefix}{next(self._identifiers)}"
        granted = self._granted[identifier] = self._loop.create_future()
        self._pending += ("a", identifier)
        self._schedule()
        await granted
        return identifier

    async def release(self, permit: str) -> None:
        self._pending += ("r", permit)
        self._schedule()

    def _schedule(self) -> None:
        # At the end of this turn of the loop, so that its other calls go too.
        if not self._scheduled and self._in_flight < self._depth:
            self._scheduled = True
            self._loop.call_soon(self._send)

    def _send(self) -> None:
        self._scheduled = False
        if self._pending and self._in_flight < self._depth:
            calls, self._pending = self._pending, []
            sent = self._design.commands(calls)
            # hiredis's stub types the argument as a tuple of one element.
            self._writer.write(b"".join(hiredis.pack_command(command) for command, _ in sent))  # type: ignore[arg-type]
            self._answering.extend(grants for _, grants in sent)
            self._in_flight += len(sent)

    async def _read(self) -> None:
        try:
            while data := await self._stream.read(65536):
                self._reader.feed(data)
                self._answer()
            raise ConnectionError("the server closed the thin semaphore's connection")  # noqa: TRY301 -- one exit for both
        except BaseException as error:
            # Its waiters would wait for ever: they fail with the connection.
            for waiting in self._granted.values():
                if not waiting.done():
                    waiting.set_exception(RuntimeError(f"the thin semaphore failed: {error!r}"))
            raise

    def _answer(self) -> None:
        while (reply := self._reader.gets()) is not False:
            if isinstance(reply, Exception):
                raise reply
            self._in_flight -= 1
            for identifier, token in self._answering.popleft()(reply):
                self._granted.pop(identifier).set_result(token)
        self._schedule()


def split(costs: Sequence[CycleCost]) -> Split:
    """Fit CPU per cycle against scripts per cycle over ``costs``: the slope per step, the intercept per cycle."""
    scripts = [cost.scripts_per_cycle for cost in costs]
    client = statistics.linear_regression(scripts, [cost.client_cpu_us for cost in costs])
    server = statistics.linear_regression(scripts, [cost.server_cpu_us for cost in costs])
    return Split(
        client_us_per_step=round(client.slope, 1),
        client_us_per_cycle_beside_steps=round(client.intercept, 1),
        server_us_per_step=round(server.slope, 1),
        server_us_per_cycle_beside_steps=round(server.intercept, 1),
    )


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def call_cost(label: str, call: Callable[[], Awaitable[object]]) -> CallCost:
    for _ in range(CALLS // 10):
        await call()
    runs = []
    for _ in range(RUNS):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(CALLS):
            await call()
        runs.append(((time.perf_counter() - wall) / CALLS, (time.process_time() - cpu) / CALLS))
    wall_s, cpu_s = min(runs)
    return CallCost(label, round(wall_s * 1e6, 1), round(cpu_s * 1e6, 1))


async def call_costs(port: int) -> list[CallCost]:
    client = new_client(port)
    try:
        sha = str(await client.script_load(RAW_REMOVE))
        key = "bench:{costs}"

        async def evalsha() -> object:
            return await client.evalsha(sha, 1, key, "member")

        async def written() -> object:
            async with pinned_connection(client, key) as connection:
                return await connection.batch(("EVALSHA", sha, 1, key, "member"))

        semaphore = AsyncFairSemaphore(client, "costs", 1)
        permit = await semaphore.acquire()
        assert permit is not None  # noqa: S101 -- a fresh server: nobody else holds it

        async def refresh() -> object:
            return await semaphore.refresh(permit)

        async def borrowed() -> object:
            async with pinned_connection(client, key) as connection:
                return connection

        async def task() -> object:
            return await asyncio.create_task(asyncio.sleep(0))

        async def bound() -> object:
            with Bound(1.0, "a step"):
                return None

        return [
            await call_cost("EVALSHA through Redis.evalsha", evalsha),
            await call_cost("EVALSHA written to a borrowed connection", written),
            await call_cost("AsyncFairSemaphore.refresh (one step)", refresh),
            await call_cost("a connection borrowed and given back, nothing sent", borrowed),
            await call_cost("a task started and awaited", task),
            await call_cost("a step's bound entered and left", bound),
        ]
    finally:
        await client.aclose()


async def cycle_cost(port: int, pid: int, scenario: tuple[str, int, int], seconds: float) -> CycleCost:
    label, limit, coroutines = scenario
    client = new_client(port)
    try:
        cycler: Any = (
            await RawLoop.load(client, "bench:{cycles}") if limit == 0 else AsyncFairSemaphore(client, label, limit)
        )
        await run_phase(cycler, coroutines, 0.5)
        before = await client.info("commandstats")
        server, cpu = process_cpu(pid), time.process_time()
        phase = await run_phase(cycler, coroutines, seconds)
        server, cpu = process_cpu(pid) - server, time.process_time() - cpu
        after = await client.info("commandstats")
    finally:
        await client.aclose()
    scripts = after["cmdstat_evalsha"]["calls"] - before["cmdstat_evalsha"]["calls"]
    script_us = after["cmdstat_evalsha"]["usec"] - before["cmdstat_evalsha"]["usec"]
    inside = {
        name.removeprefix("cmdstat_"): (
            entry["calls"] - before.get(name, {}).get("calls", 0),
            entry["usec"] - before.get(name, {}).get("usec", 0),
        )
        for name, entry in after.items()
        # The raw loop's script runs one command; the INFO calls are this function's own.
        if name not in {"cmdstat_evalsha", "cmdstat_info"}
    }
    per_script = max(scripts, 1)
    heaviest = sorted(inside.items(), key=lambda item: -item[1][1])[:6]
    return CycleCost(
        scenario=label,
        coroutines=coroutines,
        cycles_per_second=round(phase.cycles / phase.seconds, 1),
        client_cpu_us=round(cpu / phase.cycles * 1e6, 1),
        client_busy=round(cpu / phase.seconds, 3),
        server_cpu_us=round(server / phase.cycles * 1e6, 1),
        server_busy=round(server / phase.seconds, 3),
        scripts_per_cycle=round(scripts / phase.cycles, 3),
        server_us_per_script=round(script_us / per_script, 1),
        commands_us_per_script=round(sum(usec for _, usec in inside.values()) / per_script, 1),
        heaviest_commands={
            name: (round(calls / per_script, 2), round(usec / per_script, 1)) for name, (calls, usec) in heaviest
        },
    )


async def hold_one_pass(cycler: Cycler[Any], stop_at: float) -> int:
    cycles = 0
    while time.perf_counter() < stop_at:
        permit = await cycler.acquire()
        await asyncio.sleep(0)
        await cycler.release(permit)
        cycles += 1
    return cycles


async def hold_one_pass_with(semaphore: AsyncFairSemaphore, stop_at: float) -> int:
    cycles = 0
    while time.perf_counter() < stop_at:
        async with semaphore:
            await asyncio.sleep(0)
        cycles += 1
    return cycles


@dataclass(slots=True)
class Tally:
    """What one loop of the budget spent, summed over its rounds."""

    cycles: int = 0
    wall: float = 0.0
    client: float = 0.0
    server: float = 0.0
    scripts: int = 0

    @property
    def rate(self) -> float:
        """Cycles per second over all its rounds."""
        return self.cycles / self.wall

    def cost(self, loop: str, in_process: float | None) -> BudgetCost:
        """The loop's costs; ``in_process`` is the in-process loop's cycles/s (``None``: this is it)."""
        rate = self.rate
        return BudgetCost(
            loop=loop,
            cycles_per_second=round(rate, 1),
            client_cpu_us=round(self.client / self.cycles * 1e6, 2),
            server_cpu_us=round(self.server / self.cycles * 1e6, 2),
            # Every cycle makes two calls, an acquire and a release.
            calls_per_script=round(2 * self.cycles / self.scripts, 1) if self.scripts else None,
            lockstep_cycles_per_second=round(self.cycles / (self.client + self.server), 1),
            ratio_to_in_process=round(rate / (in_process or rate), 4),
        )


async def scripts_run(client: redis.asyncio.Redis) -> int:
    return int((await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def budget(port: int, pid: int, seconds: float) -> list[BudgetCost]:
    """The in-process budget (see the module's docstring).

    The loops take turns, ``BUDGET_ROUNDS`` rounds of a share of ``seconds``
    each, so that the machine's changes of pace fall on all of them alike.
    """
    client = new_client(port)
    try:
        async with (
            ThinBatched.opened(port, OwnScript(BARE_SCRIPT, "bench:{bare-1}", 16), depth=1) as bare_1,
            ThinBatched.opened(port, OwnScript(BARE_SCRIPT, "bench:{bare-2}", 16), depth=2) as bare_2,
            ThinBatched.opened(port, OwnScript(GUARDED_SCRIPT, "bench:{guarded}", 16), depth=1) as guarded,
            # A turn sends two scripts, its releases' and its acquires'.
            ThinBatched.opened(port, FairScripts(THIN_FAIR_KEYS, 16), depth=2) as thin_fair,
            ThinBatched.opened(port, FairScripts(DEEP_FAIR_KEYS, 16), depth=4) as deep_fair,
        ):
            fair = AsyncFairSemaphore(client, "budget", 16)
            try:
                loops: dict[str, Cycler[Any]] = {
                    IN_PROCESS_LOOP: InProcess(16),
                    f"ThinBatched, {BARE_SCRIPT.label}, 1 in flight": bare_1,
                    f"ThinBatched, {BARE_SCRIPT.label}, 2 in flight": bare_2,
                    f"ThinBatched, {GUARDED_SCRIPT.label}": guarded,
                    "ThinBatched, AsyncFairSemaphore's scripts": thin_fair,
                    "ThinBatched, AsyncFairSemaphore's scripts, 2 turns in flight": deep_fair,
                    "AsyncFairSemaphore": fair,
                }
                tallies = {loop: Tally() for loop in loops}
                for cycler in loops.values():
                    await asyncio.gather(*(hold_one_pass(cycler, time.perf_counter() + 0.5) for _ in range(64)))
                for _ in range(BUDGET_ROUNDS):
                    for loop, cycler in loops.items():
                        tally = tallies[loop]
                        scripts = await scripts_run(client)
                        server, cpu, wall = process_cpu(pid), time.process_time(), time.perf_counter()
                        stop_at = wall + seconds / BUDGET_ROUNDS
                        tally.cycles += sum(await asyncio.gather(*(hold_one_pass(cycler, stop_at) for _ in range(64))))
                        tally.wall += time.perf_counter() - wall
                        tally.client += time.process_time() - cpu
                        tally.server += process_cpu(pid) - server
                        tally.scripts += await scripts_run(client) - scripts
            finally:
                await fair.aclose()
    finally:
        await client.aclose()
    in_process = tallies[IN_PROCESS_LOOP].rate
    return [tally.cost(loop, None if loop == IN_PROCESS_LOOP else in_process) for loop, tally in tallies.items()]


def counted(counts: collections.Counter[str]) -> Callable[[FrameType, str, object], None]:
    """A profile hook counting the tasks' resumptions of the cycling coroutines, and the loop's callbacks."""
    cycling = {hold_one_pass.__code__, hold_one_pass_with.__code__}
    run = asyncio.Handle._run.__code__  # noqa: SLF001 -- every callback the loop runs goes through it

    def hook(frame: FrameType, event: str, _: object) -> None:
        if event != "call":
            return
        if frame.f_code is run:
            counts["callbacks"] += 1
        # A task resumes its coroutine from a callback: the coroutine's frame is then called from Handle._run.
        elif frame.f_code in cycling and frame.f_back is not None and frame.f_back.f_code is run:
            counts["wakeups"] += 1

    return hook


async def wakeups(port: int) -> list[Wakeups]:
    """Count the event loop's work per cycle, for each shape of the limit-16 loop (see the module's docstring)."""
    client = new_client(port)
    results = []
    try:
        fair = AsyncFairSemaphore(client, "wakeups", 16)
        locked = AsyncLockedSemaphore(client, "wakeups-locked", 16)
        local = InProcess(16)
        shapes: list[tuple[str, Callable[[float], Awaitable[int]]]] = [
            ("AsyncFairSemaphore, acquire/release", lambda stop: hold_one_pass(fair, stop)),
            ("AsyncFairSemaphore, async with", lambda stop: hold_one_pass_with(fair, stop)),
            ("AsyncLockedSemaphore, acquire/release", lambda stop: hold_one_pass(locked, stop)),
            ("asyncio.Semaphore (one process)", lambda stop: hold_one_pass(local, stop)),
        ]
        for shape, cycle in shapes:
            await asyncio.gather(*(cycle(time.perf_counter() + 0.5) for _ in range(64)))
            counts: collections.Counter[str] = collections.Counter()
            sys.setprofile(counted(counts))
            try:
                done = await asyncio.gather(*(cycle(time.perf_counter() + 1.0) for _ in range(64)))
            finally:
                sys.setprofile(None)
            total = sum(done)
            results.append(
                Wakeups(shape, total, round(counts["wakeups"] / total, 3), round(counts["callbacks"] / total, 3))
            )
        await fair.aclose()
        await locked.aclose()
    finally:
        await client.aclose()
    return results


async def profile(port: int, seconds: float) -> str:
    """pyinstrument's heaviest frames while 64 coroutines cycle at limit 16; '' without pyinstrument."""
    try:
        from pyinstrument import Profiler  # noqa: PLC0415 -- optional: used only with --profile
    except ImportError:
        print("pyinstrument is not installed: no profile", file=sys.stderr)
        return ""
    client = new_client(port)
    try:
        semaphore = AsyncFairSemaphore(client, "profiled", 16)
        await run_phase(semaphore, 64, 0.5)
        profiler = Profiler(interval=0.0005, async_mode="disabled")
        profiler.start()
        await run_phase(semaphore, 64, seconds)
        profiler.stop()
    finally:
        await client.aclose()
    lines = profiler.output_text(unicode=False, flat=True).splitlines()
    return "\n".join([line for line in lines if line.strip()[:1].isdigit()][:25])


async def run_all(
    port: int, pid: int, seconds: float, profiled: bool
) -> tuple[list[CallCost], list[CycleCost], list[CycleCost], list[Wakeups], list[BudgetCost], str]:
    print("  per round trip ...", file=sys.stderr, flush=True)
    calls = await call_costs(port)
    cycles = []
    for scenario in CYCLES:
        print(f"  {scenario[0]}, {scenario[2]} coroutine(s) ...", file=sys.stderr, flush=True)
        cycles.append(await cycle_cost(port, pid, scenario, seconds))
    swept = []
    for limit in SPLIT_LIMITS:
        print(f"  split: limit {limit}, {4 * limit} coroutines ...", file=sys.stderr, flush=True)
        swept.append(await cycle_cost(port, pid, (f"AsyncFairSemaphore, limit {limit}", limit, 4 * limit), seconds))
    limit_16 = next(
        cost for cost in cycles if cost.scenario == "AsyncFairSemaphore, limit 16" and cost.coroutines == 64
    )
    swept = sorted([*swept, limit_16], key=lambda cost: cost.coroutines)
    print("  wake-ups per cycle ...", file=sys.stderr, flush=True)
    woken = await wakeups(port)
    print("  the in-process budget ...", file=sys.stderr, flush=True)
    budgeted = await budget(port, pid, seconds)
    return calls, cycles, swept, woken, budgeted, await profile(port, seconds) if profiled else ""


def split_tables(swept: Sequence[CycleCost], fitted: Split) -> str:
    points = markdown_table(
        ("split: scenario", "coroutines", "cycles/s", "scripts/cycle", "client CPU us/cycle", "server CPU us/cycle"),
        [
            (
                cost.scenario,
                str(cost.coroutines),
                f"{cost.cycles_per_second:,.0f}",
                f"{cost.scripts_per_cycle:.3f}",
                f"{cost.client_cpu_us:.1f}",
                f"{cost.server_cpu_us:.1f}",
            )
            for cost in swept
        ],
    )
    fit = markdown_table(
        ("CPU, fitted", "client us", "server us"),
        [
            ("per step, whatever it carries", f"{fitted.client_us_per_step:.1f}", f"{fitted.server_us_per_step:.1f}"),
            (
                "per cycle, beside its steps",
                f"{fitted.client_us_per_cycle_beside_steps:.1f}",
                f"{fitted.server_us_per_cycle_beside_steps:.1f}",
            ),
        ],
    )
    return f"{points}\n\n{fit}"


def wakeups_table(woken: Sequence[Wakeups]) -> str:
    return markdown_table(
        (
            "64 coroutines, limit 16, held a loop pass",
            "cycles counted",
            "task wake-ups/cycle",
            "loop callbacks/cycle",
        ),
        [(w.shape, f"{w.cycles:,}", f"{w.task_wakeups:.2f}", f"{w.loop_callbacks:.2f}") for w in woken],
    )


def budget_table(costs: Sequence[BudgetCost]) -> str:
    per_loop = markdown_table(
        (
            "64 coroutines, limit 16, held a loop pass",
            "cycles/s",
            "client CPU us/cycle",
            "server CPU us/cycle",
            "calls/script",
            "1 / (client + server), cycles/s",
            "ratio to in-process",
        ),
        [
            (
                cost.loop,
                f"{cost.cycles_per_second:,.0f}",
                f"{cost.client_cpu_us:.1f}",
                f"{cost.server_cpu_us:.1f}",
                "n/a" if cost.calls_per_script is None else f"{cost.calls_per_script:.1f}",
                f"{cost.lockstep_cycles_per_second:,.0f}",
                f"{cost.ratio_to_in_process:.3f}",
            )
            for cost in costs
        ],
    )
    in_process = costs[0].cycles_per_second
    allowed = markdown_table(
        ("at this fraction of the in-process loop", "a cycle may take, us"),
        [(f"{fraction:g}", f"{1e6 / (fraction * in_process):.1f}") for fraction in BUDGET_FRACTIONS],
    )
    return f"{per_loop}\n\n{allowed}"


def tables(calls: Sequence[CallCost], cycles: Sequence[CycleCost]) -> str:
    per_call = markdown_table(
        ("one call, 1 coroutine", "wall us", "client CPU us"),
        [(cost.call, f"{cost.wall_us:.1f}", f"{cost.cpu_us:.1f}") for cost in calls],
    )
    per_cycle = markdown_table(
        (
            "scenario",
            "coroutines",
            "cycles/s",
            "client CPU us/cycle",
            "server CPU us/cycle",
            "scripts/cycle",
            "us/script",
            "of it, commands",
        ),
        [
            (
                cost.scenario,
                str(cost.coroutines),
                f"{cost.cycles_per_second:,.0f}",
                f"{cost.client_cpu_us:.1f} ({cost.client_busy:.0%})",
                f"{cost.server_cpu_us:.1f} ({cost.server_busy:.0%})",
                f"{cost.scripts_per_cycle:.3f}",
                f"{cost.server_us_per_script:.0f}",
                f"{cost.commands_us_per_script:.0f}",
            )
            for cost in cycles
        ],
    )
    inside = markdown_table(
        ("scenario", "coroutines", "heaviest commands inside the scripts: calls / us per script"),
        [
            (
                cost.scenario,
                str(cost.coroutines),
                ", ".join(f"{name} {calls:g} / {usec:g}" for name, (calls, usec) in cost.heaviest_commands.items()),
            )
            for cost in cycles
            if cost.scripts_per_cycle
        ],
    )
    return f"{per_call}\n\n{per_cycle}\n\n{inside}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=positive, default=3.0, help="seconds measured per cycle scenario (default 3)")
    parser.add_argument("--profile", action="store_true", help="also profile the limit-16 scenario with pyinstrument")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    binary = redis_server_binary()
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(binary, Path(directory)) as server,
    ):
        assert server.process is not None  # noqa: S101 -- started by the block
        calls, cycles, swept, woken, budgeted, profiled = asyncio.run(
            run_all(server.port, server.process.pid, args.seconds, args.profile)
        )
    fitted = split(swept)
    print()
    print(tables(calls, cycles))
    print()
    print(split_tables(swept, fitted))
    print()
    print(wakeups_table(woken))
    print()
    print(budget_table(budgeted))
    if profiled:
        print(f"\npyinstrument, 64 coroutines at limit 16, heaviest frames (seconds of {args.seconds:g}):\n{profiled}")
    if args.json is not None:
        report = {
            **environment(server.version),
            "seconds": args.seconds,
            "calls": [asdict(cost) for cost in calls],
            "cycles": [asdict(cost) for cost in cycles],
            "split": {"points": [asdict(cost) for cost in swept], **asdict(fitted)},
            "wakeups": [asdict(counts) for counts in woken],
            "budget": [asdict(cost) for cost in budgeted],
            "profile": profiled.splitlines(),
        }
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
