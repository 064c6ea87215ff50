"""aiosem beside its peers: cycles per second, acquire latency, what a cycle costs Redis, and over-admission.

In each scenario, 64 coroutines of one process share one client and run
``acquire -> hold -> release`` in a loop for a fixed time, with a semaphore
of limit 16 and then of limit 1 (a mutex). The rows, all on the scenario's
own ``redis-server`` and measured one after the other in the same run:

* ``raw EVALSHA loop``: `harness.RawLoop`, two EVALSHA round trips
  per cycle and no logic -- the floor of redis-py's one-command-per-round-trip
  path, and what every row is divided by (aiosem, which coalesces what its
  coroutines ask at once into one call, can beat it);
* the *Redis in Action* §6.3 fair semaphore (a counter, ``ZINTERSTORE``, two
  ``MULTI`` pipelines, the client's ``time.time()``) and the same under the
  book's lock, as `book` drives them: refused, a caller tries again every
  millisecond;
* redis-rate-limiters' ``AsyncSemaphore`` (``limiters``): a Redis list of
  tokens, taken by ``BLPOP`` -- which holds a connection per waiter;
* at limit 1 only, the two locks: redis-py's ``redis.asyncio.lock.Lock``
  (one object per coroutine, ``thread_local=False``, its default 0.1 s
  poll), and python-redis-lock's synchronous ``redis_lock.Lock`` (``SET NX``,
  then ``BLPOP`` on a signal list), each acquire and release in a worker
  thread with a synchronous client, as an asyncio user of it would;
* aiosem's `AsyncFairSemaphore` and `AsyncLockedSemaphore`;
* ``asyncio.Semaphore`` in the one process, no Redis at all: the ceiling
  for any semaphore in one Python process, which ``vs in-process`` divides
  by.

Each row reports cycles/s, the ratio to the raw loop of the same scenario,
the p50/p99 time ``acquire`` took, and, over the measured seconds:

* ``commands/cycle``: the server's ``total_commands_processed`` delta (the
  control connection's ``INFO`` taken off) over the cycles: every command
  Redis ran, those inside scripts and inside ``MULTI`` included;
* ``round trips/cycle``: writes to the sockets, counted on the client by
  wrapping each connection's stream writer (the synchronous client's
  ``send_packed_command``) -- a pipeline is one, and so is a step aiosem
  makes for several coroutines at once, which their cycles share;
  ``replies/cycle``: the replies read
  (the parsers' ``read_response`` calls): top-level commands, pub/sub messages included;
* ``connections``: connections open under the row's client name at the end
  (pools keep what they opened, so this is the most the row needed);
* ``busiest coroutine``: the share of the cycles made by the coroutine that
  made the most (1/64, under 2 %, if all made as many): a peer that polls
  lets the coroutine that just released take the lock again before the
  sleeping ones look;
* ``stalled``: coroutines still in a cycle `GRACE` seconds after the end,
  then cancelled (the book's fair semaphore can livelock at limit 1: 64
  callers that each add themselves and find others ranked ahead remove
  themselves again, over and over);
* ``over limit``: holds that began while ``limit`` others were in progress,
  counted by a plain in-use counter that every coroutine of the process
  shares. The hold is one pass of the event loop (``await asyncio.sleep(0)``),
  so that holders admitted together see each other; a count above 0 is
  over-admission, reported and not failed on (the book's semaphores are
  known to over-admit: §6.3.4).

The servers (``$AIOSEM_REDIS_SERVER``, else the one on ``PATH``) listen on
free loopback ports, without persistence, and are stopped by their PIDs; port
6379 is never touched. ``redis-benchmark``'s PING rate is taken once, on the
first server while it is idle, as the server's own ceiling.

Then the **hand-off**: at limit 1, a holder in this process and one waiter
in another (this file run again with a hidden ``--role``), for each peer
that blocks and for aiosem. Each repetition the holder takes the lock, tells
the waiter to acquire, lets it settle into waiting (`HANDOFF_SETTLE`), and
releases: from the start of ``release`` to the waiter's ``acquire``
returning, as p50/p90/p99 (``time.perf_counter``, one clock for every
process on Linux). The ratio divides by the best peer's p50 in the same run.
Two floors are measured alike, with no semaphore at all: a token handed
over by ``LPUSH`` to a ``BLPOP`` (what the blocking peers build on), and a
key handed over by one ``PUBLISH`` to a subscriber (what aiosem's waiter
wakes by). No design of either kind hands off faster than its floor. A
third, `GuardedBlpopFloor`, is the least a hand-off does that keeps the
guarantees aiosem's keeps -- a lease on the server's clock, a fencing
token, the queue's order, the waiters' liveness -- with the first floor's
wake-up: one script grants the head of the queue and pushes its token onto
the list its waiter blocks on.

The peers come from PyPI: ``pip install redis-rate-limiters python-redis-lock``.

Run it::

    python benchmarks/bench_peers.py                  # 3 s per row, about 1 minute
    python benchmarks/bench_peers.py --quick          # a smoke run, about 30 s
    python benchmarks/bench_peers.py --json benchmarks/results/peers.json
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, cast

import anyio
import anyio.to_thread
import redis
import redis.asyncio
import redis.asyncio.client
import redis.asyncio.lock
import redis_lock  # type: ignore[import-untyped]  # python-redis-lock ships no type information
from book import BookFairSemaphore, BookLockedSemaphore
from harness import (
    GRACE,
    HOST,
    MAX_CONNECTIONS,
    STEP_TIMEOUT,
    Cycler,
    InProcess,
    Message,
    RawLoop,
    RedisServer,
    commandstats_calls,
    environment,
    markdown_table,
    next_message,
    non_negative,
    on_fresh_server,
    open_stdin,
    package_version,
    parse_or_play_role,
    percentile,
    positive,
    redis_benchmark_ping,
    redis_server_binary,
    report,
    write_report,
)
from harness import Peer as HelperProcess
from limiters import AsyncSemaphore
from redis.asyncio.connection import DefaultParser

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._validation import WAITER_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

#: Coroutines of the one process, sharing one client, in every row.
COROUTINES: Final = 64
#: The scenarios' limits, in the order they run.
LIMITS: Final = (16, 1)
#: Every peer's lease where it has one (the book's ``timeout=10``).
LEASE: Final = 10.0
#: How long one acquire may wait before a peer gives up, where it can be told.
ACQUIRE_BOUND: Final = 30.0
CONTROL_CLIENT: Final = "aiosem-bench-control"

PeerName = Literal[
    "raw",
    "in-process",
    "book-fair",
    "book-locked",
    "limiters",
    "redis-py-lock",
    "python-redis-lock",
    "aiosem-fair",
    "aiosem-locked",
    "floor-blpop",
    "floor-publish",
    "floor-guarded",
]


@dataclass(frozen=True, slots=True)
class Peer:
    label: str
    #: The distribution whose version the JSON records.
    package: str | None
    #: A lock: run at limit 1 only.
    mutex_only: bool = False
    #: A floor of the hand-off, no semaphore: measured there only, and never "the best peer".
    floor: bool = False


#: In the order they run in each scenario: the floor first.
PEERS: Final[dict[PeerName, Peer]] = {
    "raw": Peer("raw EVALSHA loop", None),
    "in-process": Peer("asyncio.Semaphore (one process, no Redis)", None),
    "book-fair": Peer("book: fair semaphore (6.14)", None),
    "book-locked": Peer("book: semaphore with lock (6.17)", None),
    "limiters": Peer("redis-rate-limiters AsyncSemaphore", "redis-rate-limiters"),
    "redis-py-lock": Peer("redis-py asyncio Lock", "redis", mutex_only=True),
    "python-redis-lock": Peer("python-redis-lock (threads)", "python-redis-lock", mutex_only=True),
    "aiosem-fair": Peer("aiosem AsyncFairSemaphore", "aiosem"),
    "aiosem-locked": Peer("aiosem AsyncLockedSemaphore", "aiosem"),
    "floor-blpop": Peer("floor: LPUSH heard by a BLPOP", None, floor=True),
    "floor-publish": Peer("floor: PUBLISH heard by a subscriber", None, floor=True),
    "floor-guarded": Peer("floor: a guarded grant heard by a BLPOP", None, floor=True),
}


# --- counting on the client ---------------------------------------------------


class Wire:
    """Writes to the sockets and replies read, over every counting connection.

    Under a lock: python-redis-lock's worker threads count too.
    """

    __slots__ = ("_lock", "replies", "writes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.writes = 0
        self.replies = 0

    def __repr__(self) -> str:
        return f"Wire(writes={self.writes}, replies={self.replies})"

    def wrote(self) -> None:
        with self._lock:
            self.writes += 1

    def read(self) -> None:
        with self._lock:
            self.replies += 1

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.writes, self.replies


WIRE: Final = Wire()


class CountingWriter:
    """A connection's stream writer that counts its writes.

    Counting here rather than in ``send_packed_command`` sees every write,
    whoever makes it: a pipeline or a locked step's batch included.
    """

    __slots__ = ("_writer",)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    def write(self, data: bytes) -> None:
        WIRE.wrote()
        self._writer.write(data)

    def writelines(self, data: Any) -> None:
        WIRE.wrote()
        self._writer.writelines(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


class CountingConnection(redis.asyncio.Connection):
    """redis.asyncio's connection, its writes counted in `WIRE` (its replies are, by `CountingParser`)."""

    async def _connect(self) -> None:
        await super()._connect()  # type: ignore[no-untyped-call]  # untyped in redis-py
        if self._writer is not None:
            # Anything redis-py does with its writer, the wrapper passes on.
            self._writer = cast("asyncio.StreamWriter", CountingWriter(self._writer))


class CountingParser(DefaultParser):  # type: ignore[misc,valid-type]  # a variable in redis-py's stubs
    """redis.asyncio's parser, its replies counted in `WIRE`.

    Counted here, not in the connection's ``read_response``: aiosem reads a
    batch's replies from the parser, unless the connection's class reads its
    own way -- as one overriding ``read_response`` would.
    """

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        WIRE.read()
        return await super().read_response(*args, **kwargs)


class CountingSyncConnection(redis.Connection):
    """redis-py's synchronous connection, counted the same way: it writes only through ``send_packed_command``."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        WIRE.wrote()
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]  # untyped in redis-py

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        WIRE.read()
        return super().read_response(*args, **kwargs)


# --- the peers, in the semaphores' acquire/release shape -------------------------


class LimitersSemaphore:
    """redis-rate-limiters' ``AsyncSemaphore``, whose entry and exit are its acquire and release.

    It keeps no token (a permit is an item popped off a Redis list), so one
    object serves every coroutine. Its ``max_sleep`` bounds the ``BLPOP``:
    the default, 0, waits for ever.
    """

    __slots__ = ("_semaphore",)

    def __init__(self, client: redis.asyncio.Redis, name: str, limit: int) -> None:
        self._semaphore = AsyncSemaphore(connection=client, name=name, capacity=limit, max_sleep=ACQUIRE_BOUND)

    def __repr__(self) -> str:
        return f"LimitersSemaphore({self._semaphore})"

    async def acquire(self) -> bool:
        # The context manager's halves, called apart: the other rows' cycle shape.
        await self._semaphore.__aenter__()
        return True

    async def release(self, permit: bool) -> None:
        await self._semaphore.__aexit__(None, None, None)


class RedisPyLock:
    """redis-py's asyncio ``Lock``, used correctly: one object per coroutine, its token not thread-local.

    By default the token lives in a ``threading.local``, which every task of
    the thread shares: one task could then release another's lock. With
    ``thread_local=False`` each object keeps its own, so each coroutine needs
    its own object (all of the same name). The poll (``sleep=0.1``) is left
    as a user gets it.
    """

    __slots__ = ("_lock",)

    def __init__(self, client: redis.asyncio.Redis, name: str) -> None:
        self._lock = redis.asyncio.lock.Lock(
            client, name, timeout=LEASE, blocking_timeout=ACQUIRE_BOUND, thread_local=False
        )

    def __repr__(self) -> str:
        return f"RedisPyLock({self._lock.name!r})"

    async def acquire(self) -> redis.asyncio.lock.Lock | None:
        return self._lock if await self._lock.acquire() else None

    async def release(self, permit: redis.asyncio.lock.Lock) -> None:
        await permit.release()


class ThreadedRedisLock:
    """python-redis-lock's synchronous ``Lock``, one per coroutine, each call in a worker thread.

    Its ``timeout`` bounds each ``BLPOP`` on the signal list (it may not
    exceed ``expire``); a waiter woken but beaten to the lock waits again.
    """

    __slots__ = ("_limiter", "_lock")

    def __init__(self, client: redis.Redis, name: str, limiter: anyio.CapacityLimiter) -> None:
        self._lock = redis_lock.Lock(client, name, expire=int(LEASE))
        self._limiter = limiter

    def __repr__(self) -> str:
        return f"ThreadedRedisLock({self._lock._name!r})"  # noqa: SLF001 -- its only name

    async def acquire(self) -> bool | None:
        acquire = partial(self._lock.acquire, blocking=True, timeout=int(LEASE))
        acquired: bool = await anyio.to_thread.run_sync(acquire, limiter=self._limiter)
        return True if acquired else None

    async def release(self, permit: bool) -> None:
        await anyio.to_thread.run_sync(self._lock.release, limiter=self._limiter)


class BlpopFloor:
    """The least a hand-off by blocking pop does: one token in a list, handed over by ``LPUSH`` to a ``BLPOP``.

    A mutex without a lease (a holder that dies keeps the token for
    ever), a queue, or anything else a semaphore does: what the peers that
    block build on, and a floor for them.
    """

    __slots__ = ("_client", "_key")

    def __init__(self, client: redis.asyncio.Redis, name: str) -> None:
        self._client = client
        self._key = f"floor:{{{name}}}"

    def __repr__(self) -> str:
        return f"BlpopFloor({self._key!r})"

    async def prepare(self) -> None:
        """Put the token in the list, once for every process."""
        if await self._client.set(f"{self._key}:made", 1, nx=True):
            await self._client.lpush(self._key, 1)

    async def acquire(self) -> bool | None:
        return True if await self._client.blpop([self._key], timeout=ACQUIRE_BOUND) is not None else None

    async def release(self, permit: bool) -> None:
        await self._client.lpush(self._key, 1)


class PublishFloor:
    """The least a hand-off by message does: a key taken by ``SET NX``, handed over by one ``PUBLISH``.

    The release publishes; whoever else listens takes the key as it is.
    Between two processes, as the hand-off measures it, that is a lock; with
    more waiters it is none (each would take it), and it has no lease. A
    design whose waiter wakes by pub/sub, as aiosem's does, cannot hand off
    faster: aiosem's release is a script that also reaps, hands the permit
    to the head of the queue and publishes, and its waiter reads the message
    as this one does.
    """

    __slots__ = ("_channel", "_client", "_key", "_me", "_pubsub")

    def __init__(self, client: redis.asyncio.Redis, name: str) -> None:
        self._client = client
        self._key = f"floor:{{{name}}}"
        self._channel = f"{self._key}:go"
        #: What this object publishes, so that it skips its own messages.
        self._me = secrets.token_hex(8).encode()
        self._pubsub: redis.asyncio.client.PubSub | None = None

    def __repr__(self) -> str:
        return f"PublishFloor({self._key!r})"

    async def acquire(self) -> bool | None:
        if self._pubsub is None:
            # Subscribed before the key is tried: no release can fall between.
            self._pubsub = self._client.pubsub()
            await self._pubsub.subscribe(self._channel)
        if await self._client.set(self._key, 1, nx=True):
            return True
        with anyio.move_on_after(ACQUIRE_BOUND):
            while True:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=ACQUIRE_BOUND)
                if message is not None and message["data"] != self._me:
                    return True
        return None

    async def release(self, permit: bool) -> None:
        if await self._client.publish(self._channel, self._me) <= 1:  # only this object listens: nobody to take it
            await self._client.delete(self._key)

    async def aclose(self) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8.2


#: The guarded floor's scripts. KEYS: leases, queue, waiters' deadlines,
#: tokens, tickets; ARGV: identifier, limit, lease and waiter timeout in ms,
#: the prefix of the waiters' lists. Both read the server's clock, reap the
#: permits whose lease ran out and the waiters presumed dead, and hand what
#: is free to the head of the queue -- a token for each, pushed onto its
#: list, and a lease of the waiter timeout -- before they act.
GUARDED_PRELUDE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[2])
local function serve()
  local free = limit - redis.call('ZCARD', KEYS[1])
  if free <= 0 then
    return
  end
  local handed = now + math.min(tonumber(ARGV[3]), tonumber(ARGV[4]))
  for _, head in ipairs(redis.call('ZRANGE', KEYS[2], 0, free - 1)) do
    local token = redis.call('INCR', KEYS[4])
    redis.call('ZADD', KEYS[1], handed, head)
    redis.call('ZREM', KEYS[2], head)
    redis.call('ZREM', KEYS[3], head)
    redis.call('RPUSH', ARGV[5] .. head, token)
    redis.call('PEXPIRE', ARGV[5] .. head, ARGV[4])
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #dead > 0 then
  redis.call('ZREM', KEYS[2], unpack(dead))
  redis.call('ZREM', KEYS[3], unpack(dead))
end
"""
#: A token, or 0 once queued: newcomers go behind the queue.
GUARDED_ACQUIRE: Final = (
    GUARDED_PRELUDE
    + """
serve()
if redis.call('ZCARD', KEYS[2]) == 0 and redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], now + ARGV[3], ARGV[1])
  return redis.call('INCR', KEYS[4])
end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), ARGV[1])
redis.call('ZADD', KEYS[3], now + ARGV[4], ARGV[1])
return 0
"""
)
#: 1 if the identifier held.
GUARDED_RELEASE: Final = (
    GUARDED_PRELUDE
    + """
local released = redis.call('ZREM', KEYS[1], ARGV[1])
serve()
return released
"""
)


class GuardedBlpopFloor:
    """The least a hand-off that keeps a semaphore's guarantees does, its waiter woken by a ``BLPOP``.

    A semaphore whose permits have a lease on the server's clock, reaped once
    it runs out; a fencing token per grant; a queue served in arrival order,
    newcomers behind it; and waiters presumed dead past their timeout. Each
    script hands what is free -- a release, the permit it frees -- to the
    head of the queue, and pushes the token onto the head's own list, where
    the waiter blocks. A permit handed over starts with the waiter timeout as its lease, as
    aiosem's does; the claim that would restart it lies after the waiter
    returns, and is left out. So is all the rest: tombstones, receipts,
    weights, a live limit, the keys' expiry, and a waiter's heartbeat during
    a long wait. A waiter that gives up is not taken out of the queue (the
    hand-off never gives up). Its lists' keys are outside the script's
    declared keys: one server only.
    """

    __slots__ = ("_acquire", "_arguments", "_client", "_keys", "_release", "_wake")

    def __init__(self, client: redis.asyncio.Redis, name: str) -> None:
        self._client = client
        key = f"floor:{{{name}}}"
        self._keys = tuple(f"{key}:{part}" for part in ("leases", "queue", "waiters", "tokens", "tickets"))
        self._wake = f"{key}:wake:"
        #: Every call's arguments after its identifier: a mutex.
        self._arguments = (1, round(LEASE * 1000), round(WAITER_TIMEOUT * 1000), self._wake)
        self._acquire = self._release = ""

    def __repr__(self) -> str:
        return f"GuardedBlpopFloor({self._keys[0]!r})"

    async def prepare(self) -> None:
        """Load the scripts."""
        self._acquire = str(await self._client.script_load(GUARDED_ACQUIRE))
        self._release = str(await self._client.script_load(GUARDED_RELEASE))

    async def acquire(self) -> str | None:
        identifier = secrets.token_hex(8)
        token = await self._client.evalsha(self._acquire, 5, *self._keys, identifier, *self._arguments)
        if token == 0 and await self._client.blpop([self._wake + identifier], timeout=ACQUIRE_BOUND) is None:
            return None
        return identifier

    async def release(self, permit: str) -> None:
        await self._client.evalsha(self._release, 5, *self._keys, permit, *self._arguments)


@dataclass(frozen=True, slots=True)
class Clients:
    """A row's clients, both named after the row, both counting."""

    asynchronous: redis.asyncio.Redis
    synchronous: redis.Redis


def new_clients(port: int, client_name: str) -> Clients:
    # Bounded pools, as a service's should be, large enough for a connection
    # per coroutine: the BLPOP peers hold one per waiter.
    pool = redis.asyncio.BlockingConnectionPool(
        host=HOST,
        port=port,
        max_connections=MAX_CONNECTIONS,
        timeout=GRACE,
        connection_class=CountingConnection,
        parser_class=CountingParser,
        client_name=client_name,
    )
    sync_pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]  # untyped in redis-py
        host=HOST,
        port=port,
        max_connections=MAX_CONNECTIONS,
        timeout=GRACE,
        connection_class=CountingSyncConnection,
        client_name=client_name,
        # Longer than a BLPOP may block (the lease): no thread waits for ever.
        socket_timeout=LEASE + GRACE,
    )
    return Clients(redis.asyncio.Redis.from_pool(pool), redis.Redis.from_pool(sync_pool))


@asynccontextmanager
async def contenders(peer: PeerName, clients: Clients, name: str, limit: int) -> AsyncIterator[list[Cycler[Any]]]:
    """One cycler per coroutine: a shared object, or one each where the object holds the token."""
    client = clients.asynchronous
    semaphore: AsyncFairSemaphore | AsyncLockedSemaphore | PublishFloor | None = None
    cyclers: list[Cycler[Any]]
    if peer == "raw":
        cyclers = [await RawLoop.load(client, f"bench:{{{name}}}")] * COROUTINES
    elif peer == "in-process":
        cyclers = [InProcess(limit)] * COROUTINES
    elif peer == "book-fair":
        cyclers = [BookFairSemaphore(client, name, limit, timeout=LEASE, blocking_timeout=ACQUIRE_BOUND)] * COROUTINES
    elif peer == "book-locked":
        cyclers = [BookLockedSemaphore(client, name, limit, timeout=LEASE, blocking_timeout=ACQUIRE_BOUND)] * COROUTINES
    elif peer == "limiters":
        cyclers = [LimitersSemaphore(client, name, limit)] * COROUTINES
    elif peer == "redis-py-lock":
        cyclers = [RedisPyLock(client, name) for _ in range(COROUTINES)]
    elif peer == "python-redis-lock":
        # A thread per coroutine: each may sit in a BLPOP (anyio's default is 40).
        threads = anyio.CapacityLimiter(COROUTINES)
        cyclers = [ThreadedRedisLock(clients.synchronous, name, threads) for _ in range(COROUTINES)]
    elif peer in ("floor-blpop", "floor-guarded"):
        floor = (BlpopFloor if peer == "floor-blpop" else GuardedBlpopFloor)(client, name)
        await floor.prepare()
        cyclers = [floor] * COROUTINES
    elif peer == "floor-publish":
        semaphore = PublishFloor(client, name)
        cyclers = [semaphore] * COROUTINES
    else:
        kind = AsyncFairSemaphore if peer == "aiosem-fair" else AsyncLockedSemaphore
        semaphore = kind(client, name, limit, timeout=LEASE, blocking_timeout=ACQUIRE_BOUND)
        cyclers = [semaphore] * COROUTINES
    try:
        yield cyclers
    finally:
        if semaphore is not None:
            await semaphore.aclose()


# --- the measurement -------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """The in-use counter every coroutine of the process shares."""

    limit: int | None
    in_use: int = 0
    most_in_use: int = 0
    over_limit: int = 0


async def cycle_loop(
    cycler: Cycler[Any], stop_at: float, latencies: list[float], tally: Tally, *, cycles: list[int], index: int
) -> None:
    """Cycle until ``stop_at``, counting in ``cycles[index]``: a coroutine cancelled later keeps its count."""
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        permit = await cycler.acquire()
        latencies.append(time.perf_counter() - started)
        if permit is None:
            raise RuntimeError(f"acquire gave up after {ACQUIRE_BOUND:g} s")
        tally.in_use += 1
        tally.most_in_use = max(tally.most_in_use, tally.in_use)
        if tally.limit is not None and tally.in_use > tally.limit:
            tally.over_limit += 1
        # The hold: one pass of the event loop, so that holds admitted
        # together overlap here as they do in Redis.
        await asyncio.sleep(0)
        tally.in_use -= 1
        await cycler.release(permit)
        cycles[index] += 1


@dataclass(frozen=True, slots=True)
class Phase:
    cycles: int
    seconds: float
    latencies: list[float]
    tally: Tally
    #: The cycles of the coroutine that made the most.
    busiest: int
    #: Coroutines still in a cycle `GRACE` seconds after the end, then cancelled.
    stalled: int


async def run_phase(cyclers: Sequence[Cycler[Any]], limit: int | None, seconds: float) -> Phase:
    latencies: list[float] = []
    tally = Tally(limit)
    start = time.perf_counter()
    cycles = [0] * len(cyclers)
    tasks = [
        asyncio.create_task(cycle_loop(cycler, start + seconds, latencies, tally, cycles=cycles, index=index))
        for index, cycler in enumerate(cyclers)
    ]
    _, pending = await asyncio.wait(tasks, timeout=seconds + GRACE)
    # Cycles that finish after the deadline count, so the time they took does too.
    elapsed = time.perf_counter() - start
    for task in pending:
        # Stalled -- a livelock, not an error: counted, and the cycles made meanwhile stand.
        task.cancel()
    for task in pending:
        # Cut off mid-command, it may end later, its connection lost: what it raises then is read here.
        task.add_done_callback(_read_outcome)
    if pending:
        await asyncio.wait(pending, timeout=GRACE)
    for task in tasks:
        if task not in pending:
            task.result()  # raises what a coroutine raised
    return Phase(sum(cycles), elapsed, latencies, tally, max(cycles), len(pending))


def _read_outcome(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True, slots=True)
class RowResult:
    peer: PeerName
    label: str
    limit: int
    coroutines: int
    cycles: int
    seconds: float
    cycles_per_second: float
    acquire_p50_ms: float
    acquire_p99_ms: float
    #: Every command the server ran (inside scripts and MULTI too), per cycle.
    commands_per_cycle: float
    #: Socket writes per cycle, counted on the client.
    round_trips_per_cycle: float
    #: Replies read per cycle, counted on the client: top-level commands and pub/sub messages.
    replies_per_cycle: float
    #: Connections open under the row's client name at the end.
    connections: int
    #: Holds that began with ``limit`` others in progress (None for the raw loop, which has no limit).
    over_limit: int | None
    most_in_use: int
    #: The busiest coroutine's share of the cycles (1/64 if all had as many): a poll lets one coroutine hog.
    busiest_share: float
    #: The commands Redis ran, by name, per cycle (commandstats; the most frequent first).
    commands_by_name: dict[str, float]
    #: Coroutines still in a cycle `GRACE` seconds after the end, then cancelled (a livelock).
    stalled: int = 0
    #: cycles/s over the raw loop's in the same scenario.
    ratio_to_raw: float | None = None
    #: cycles/s over ``asyncio.Semaphore``'s, in one process, in the same scenario.
    ratio_to_in_process: float | None = None


async def measure_row(
    port: int, control: redis.asyncio.Redis, peer: PeerName, limit: int, *, duration: float, warmup: float
) -> RowResult:
    # A client and a name of its own: no row inherits another's connections or keys.
    name = f"bench-peers-{peer}-{limit}"
    clients = new_clients(port, name)
    try:
        async with contenders(peer, clients, name, limit) as cyclers:
            bound = None if peer == "raw" else limit
            if warmup > 0:
                # Opens the connections and loads the scripts: not what a steady state costs.
                await run_phase(cyclers, bound, warmup)
            before = await control.info("stats", "commandstats")
            writes, replies = WIRE.snapshot()
            phase = await run_phase(cyclers, bound, duration)
            writes_after, replies_after = WIRE.snapshot()
            after = await control.info("stats", "commandstats")
            listed = await control.client_list()
    finally:
        await clients.asynchronous.aclose()
        await clients.asynchronous.connection_pool.aclose()
        # Its threads are done by now: closing only closes sockets.
        clients.synchronous.close()

    cycles = max(1, phase.cycles)
    # The first INFO shows in the second's count once it has run; none of the peers sends INFO.
    commands = int(after["total_commands_processed"]) - int(before["total_commands_processed"]) - 1
    calls_before = commandstats_calls(before)
    by_name = {
        command: round((calls - calls_before.get(command, 0)) / cycles, 3)
        for command, calls in commandstats_calls(after).items()
        if command != "info" and calls > calls_before.get(command, 0)
    }
    latencies = sorted(phase.latencies)
    return RowResult(
        peer=peer,
        label=PEERS[peer].label,
        limit=limit,
        coroutines=COROUTINES,
        cycles=phase.cycles,
        seconds=round(phase.seconds, 3),
        cycles_per_second=round(phase.cycles / phase.seconds, 1),
        acquire_p50_ms=round(percentile(latencies, 0.50) * 1000, 3),
        acquire_p99_ms=round(percentile(latencies, 0.99) * 1000, 3),
        commands_per_cycle=round(commands / cycles, 2),
        round_trips_per_cycle=round((writes_after - writes) / cycles, 2),
        replies_per_cycle=round((replies_after - replies) / cycles, 2),
        connections=sum(1 for entry in listed if entry.get("name") == name),
        over_limit=None if bound is None else phase.tally.over_limit,
        most_in_use=phase.tally.most_in_use,
        busiest_share=round(phase.busiest / cycles, 3),
        commands_by_name=dict(sorted(by_name.items(), key=lambda item: -item[1])),
        stalled=phase.stalled,
    )


async def run_scenario(port: int, limit: int, duration: float, warmup: float) -> list[RowResult]:
    control = redis.asyncio.Redis(host=HOST, port=port, client_name=CONTROL_CLIENT)
    rows: list[RowResult] = []
    try:
        for peer, spec in PEERS.items():
            if (spec.mutex_only and limit != 1) or spec.floor:
                continue
            print(f"  limit {limit}: {spec.label} ...", file=sys.stderr, flush=True)
            # No row starts on another's keys (the book's leftover entries, a list of tokens).
            await control.flushall()
            rows.append(await measure_row(port, control, peer, limit, duration=duration, warmup=warmup))
    finally:
        await control.aclose()
    raw = next(row.cycles_per_second for row in rows if row.peer == "raw")
    ceiling = next(row.cycles_per_second for row in rows if row.peer == "in-process")
    return [
        replace(
            row,
            ratio_to_raw=round(row.cycles_per_second / raw, 3),
            ratio_to_in_process=round(row.cycles_per_second / ceiling, 4),
        )
        for row in rows
    ]


# --- the hand-off -------------------------------------------------------------

#: The two floors, the peers whose waiter blocks until the lock frees (redis-py's Lock polls, every 0.1 s), and aiosem.
HANDOFF_PEERS: Final[tuple[PeerName, ...]] = (
    "floor-blpop",
    "floor-publish",
    "floor-guarded",
    "limiters",
    "python-redis-lock",
    "redis-py-lock",
    "aiosem-fair",
    "aiosem-locked",
)
#: From the waiter saying it is about to acquire to the release: time to be blocked in its BLPOP, or queued.
HANDOFF_SETTLE: Final = 0.02
#: Unmeasured repetitions first: connections open, scripts loaded.
HANDOFF_WARMUP: Final = 5
HANDOFF_REPETITIONS: Final = 100
QUICK_HANDOFF_REPETITIONS: Final = 20
#: How long a helper process may live at most.
ROLE_LIFETIME: Final = 600.0


async def role_handoff_waiter(port: int, config: Message) -> None:
    """On each order: say so, acquire, note when it returned, release, and report the time."""
    clients = new_clients(port, "aiosem-bench-handoff-waiter")
    try:
        with anyio.fail_after(ROLE_LIFETIME):
            async with contenders(config["peer"], clients, config["name"], 1) as cyclers:
                cycler = cyclers[0]
                stdin = await open_stdin()
                report(ready=True)
                while await next_message(stdin) is not None:
                    report(going=True)
                    permit = await cycler.acquire()
                    end = time.perf_counter()
                    if permit is None:
                        report(error=f"no hand-off within {ACQUIRE_BOUND:g} s")
                        continue
                    await cycler.release(permit)
                    report(end=end)
    finally:
        await clients.asynchronous.aclose()
        await clients.asynchronous.connection_pool.aclose()
        clients.synchronous.close()


async def run_role(role: str, port: int, config: Message) -> None:
    await ROLES[role](port, config)


ROLES: Final = {"handoff-waiter": role_handoff_waiter}


@dataclass(frozen=True, slots=True)
class HandoffResult:
    peer: PeerName
    label: str
    repetitions: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    #: p50 over the best peer's p50 in the same run (aiosem's own rows left out of "best").
    ratio_to_best_peer: float | None = None


async def measure_handoff(port: int, peer: PeerName, repetitions: int) -> HandoffResult:
    """A holder here, a waiter in another process: from ``release`` called to the waiter's ``acquire`` returning."""
    name = f"bench-handoff-{peer}"
    clients = new_clients(port, "aiosem-bench-handoff-holder")
    latencies: list[float] = []
    try:
        async with (
            contenders(peer, clients, name, 1) as cyclers,
            await HelperProcess.start("handoff-waiter", port, script=__file__, peer=peer, name=name) as waiter,
        ):
            holder = cyclers[0]
            await waiter.receive()
            for repetition in range(HANDOFF_WARMUP + repetitions):
                permit = await holder.acquire()
                if permit is None:
                    raise RuntimeError("the holder could not take the free lock")
                await waiter.send(go=repetition)
                await waiter.receive()
                await asyncio.sleep(HANDOFF_SETTLE)
                start = time.perf_counter()
                await holder.release(permit)
                end = (await waiter.receive(within=ACQUIRE_BOUND + STEP_TIMEOUT))["end"]
                if repetition >= HANDOFF_WARMUP:
                    latencies.append(end - start)
    finally:
        await clients.asynchronous.aclose()
        await clients.asynchronous.connection_pool.aclose()
        clients.synchronous.close()
    ordered = sorted(latencies)
    return HandoffResult(
        peer=peer,
        label=PEERS[peer].label,
        repetitions=len(ordered),
        p50_ms=round(percentile(ordered, 0.5) * 1000, 3),
        p90_ms=round(percentile(ordered, 0.9) * 1000, 3),
        p99_ms=round(percentile(ordered, 0.99) * 1000, 3),
        max_ms=round(ordered[-1] * 1000, 3),
    )


def with_best_peer(results: Sequence[HandoffResult]) -> list[HandoffResult]:
    best = min(
        result.p50_ms for result in results if not result.peer.startswith("aiosem") and not PEERS[result.peer].floor
    )
    return [replace(result, ratio_to_best_peer=round(result.p50_ms / best, 3)) for result in results]


def handoff_table(results: Sequence[HandoffResult]) -> str:
    header = ("peer", "hand-offs", "p50 ms", "p90 ms", "p99 ms", "max ms", "p50 vs best peer")
    body = [
        (
            result.label,
            str(result.repetitions),
            f"{result.p50_ms:.3f}",
            f"{result.p90_ms:.3f}",
            f"{result.p99_ms:.3f}",
            f"{result.max_ms:.3f}",
            "n/a" if result.ratio_to_best_peer is None else f"{result.ratio_to_best_peer:.2f}",
        )
        for result in results
    ]
    return (
        "hand-off at limit 1: from `release` called in this process to `acquire` returning in another\n\n"
        + markdown_table(header, body)
    )


# --- the report ------------------------------------------------------------


def results_table(rows: Sequence[RowResult]) -> str:
    header = (
        "peer",
        "limit",
        "cycles/s",
        "vs raw",
        "vs in-process",
        "acquire p50 ms",
        "acquire p99 ms",
        "commands/cycle",
        "round trips/cycle",
        "replies/cycle",
        "connections",
        "stalled",
        "over limit",
        "most in use",
        "busiest coroutine",
    )
    body = [
        (
            row.label,
            str(row.limit),
            f"{row.cycles_per_second:,.0f}",
            "n/a" if row.ratio_to_raw is None else f"{row.ratio_to_raw:.2f}",
            "n/a" if row.ratio_to_in_process is None else f"{row.ratio_to_in_process:.3f}",
            f"{row.acquire_p50_ms:.3f}",
            f"{row.acquire_p99_ms:.3f}",
            f"{row.commands_per_cycle:.2f}",
            f"{row.round_trips_per_cycle:.2f}",
            f"{row.replies_per_cycle:.2f}",
            str(row.connections),
            f"**{row.stalled}**" if row.stalled else "0",
            "-" if row.over_limit is None else (f"**{row.over_limit:,}**" if row.over_limit else "0"),
            str(row.most_in_use),
            f"{row.busiest_share:.0%}",
        )
        for row in rows
    ]
    return (
        f"{COROUTINES} coroutines, one client, acquire -> one event-loop pass -> release; commands: every command "
        "Redis ran (scripts' and MULTI's included); round trips: socket writes; replies: replies read\n\n"
        + markdown_table(header, body)
    )


@dataclass(frozen=True, slots=True)
class Plan:
    duration: float
    warmup: float


#: What ``--only`` may pick: the loops of every row at each limit, the hand-offs.
PARTS: Final = ("loops", "handoffs")
FULL: Final = Plan(duration=3.0, warmup=0.5)
QUICK: Final = Plan(duration=1.0, warmup=0.25)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK.duration:g} s per row")
    parser.add_argument("--duration", type=positive, help=f"seconds measured per row (default {FULL.duration:g})")
    parser.add_argument(
        "--warmup", type=non_negative, help=f"unmeasured seconds before each row (default {FULL.warmup:g})"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument(
        "--only",
        choices=PARTS,
        action="append",
        help="run this part only (again for more): the loops at each limit, or the hand-offs",
    )
    args = parse_or_play_role(parser, argv, ROLES, run_role)
    if args is None:
        return 0
    plan = QUICK if args.quick else FULL
    duration = plan.duration if args.duration is None else args.duration
    warmup = plan.warmup if args.warmup is None else args.warmup

    binary = redis_server_binary()
    versions: set[str] = set()
    ping: dict[str, float] | None = None
    rows: list[RowResult] = []
    parts = set(args.only or PARTS)
    for limit in LIMITS if "loops" in parts else ():
        with (
            tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
            RedisServer(binary, Path(directory)) as server,
        ):
            print(f"redis-server {server.version} on {server.host}:{server.port}", file=sys.stderr)
            versions.add(server.version)
            if limit == LIMITS[0]:
                # While the server is idle: the PING rate is the server's ceiling, not ours.
                ping = redis_benchmark_ping(server.port)
            rows.extend(asyncio.run(run_scenario(server.port, limit, duration, warmup)))
    repetitions = QUICK_HANDOFF_REPETITIONS if args.quick else HANDOFF_REPETITIONS
    handoffs = with_best_peer(
        [
            on_fresh_server(
                binary,
                versions,
                f"hand-off: {PEERS[peer].label}",
                partial(measure_handoff, peer=peer, repetitions=repetitions),
            )
            for peer in (HANDOFF_PEERS if "handoffs" in parts else ())
        ]
    )

    for table in (results_table(rows) if rows else None, handoff_table(handoffs) if handoffs else None):
        if table is not None:
            print()
            print(table)
    if "loops" in parts:  # the PING rate is measured before them
        print()
        if ping is None:
            print("redis-benchmark PING: not measured (redis-benchmark not on PATH)")
        else:
            print("redis-benchmark PING: " + ", ".join(f"{name} {rate:,.0f} requests/s" for name, rate in ping.items()))

    if args.json is not None:
        report = {
            **environment(sorted(versions)),
            "peers": {
                peer: {"label": spec.label, "package": spec.package, "version": package_version(spec.package)}
                for peer, spec in PEERS.items()
                if spec.package is not None
            },
            "quick": args.quick,
            "parts": sorted(parts),
            "duration_s": duration,
            "warmup_s": warmup,
            "coroutines": COROUTINES,
            "limits": list(LIMITS),
            "lease_s": LEASE,
            "redis_benchmark_ping": ping,
            "rows": [asdict(row) for row in rows],
            "handoff_settle_s": HANDOFF_SETTLE,
            "handoffs": [asdict(result) for result in handoffs],
        }
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
