"""Fault injection: a load that keeps score, the bounds the code promises, and the faults to inject.

`Load` runs one semaphore object per simulated process, each on a client of
its own, each in a loop of ``async with``: holders keep their permits alive
in the background, and whoever finds every permit taken waits in the queue.
Every attempt is timed and its outcome kept, and the bodies that believe they
hold a permit are counted as they start and end. A test can therefore say
afterwards how long each call took, what its caller saw, and whether -- and
for how long -- more bodies ran than the limit allows.

The bounds are computed from the constants the code bounds itself by, so
each is stated once and follows the code. `report` notes what a test
measured: printed (``pytest -s``), and appended as a JSON line to the file
``$AIOSEM_FAULT_REPORT`` names, if set.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

import anyio
import redis
import redis.asyncio

from aiosem import AcquireTimeout, PermitLost, SemaphoreError
from aiosem._coordination import CLEANUP_TIMEOUT
from aiosem._timing import SHORTEST_STEP_BOUND
from tests.harness.support import RedisServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from tests.harness.proxy import TcpProxy
    from tests.harness.support import Semaphore

__all__ = [
    "Attempt",
    "Load",
    "PauseKind",
    "acquire_bound",
    "debugging_server",
    "evict_until_gone",
    "exhaust_memory",
    "free_memory",
    "pause_server",
    "processes",
    "proxied_client",
    "proxied_url",
    "report",
    "snapshot",
    "step_bound",
]

#: How a server is made to stop answering while it keeps its connections.
PauseKind = Literal["CLIENT PAUSE ALL", "CLIENT PAUSE WRITE", "DEBUG SLEEP"]

#: The prefix of the keys `exhaust_memory` fills the server with.
_FILLER = "filler:"
#: How much `exhaust_memory` writes, and how far below the use it then sets the limit.
_FILLER_KEYS = 100
_FILLER_BYTES = 10_000
_OVER_THE_LIMIT = 500_000
#: How much room `evict_until_gone` leaves, and how it fills it.
_EVICTION_ROOM = 64_000
_EVICTION_BATCH = 20
_EVICTION_BYTES = 1000
#: How long a process of the load pauses after an error before trying again, as a caller would.
_ERROR_PAUSE = 0.05


def step_bound(semaphore: Semaphore) -> float:
    """The longest one step (a release, a refresh by hand) may take before it is given up: ``redis.TimeoutError``."""
    return max(semaphore.timeout, SHORTEST_STEP_BOUND)


def acquire_bound(semaphore: Semaphore, blocking_timeout: float) -> float:
    """The longest an acquire may take when Redis stops answering, as the code bounds it.

    Its wait in the queue, then one step, and the clean-up that gives back
    what the step may have taken. (Nothing one-time is waited for: the
    first subscription of an object is made in the background.)
    """
    return blocking_timeout + step_bound(semaphore) + CLEANUP_TIMEOUT


@contextlib.asynccontextmanager
async def processes(
    connect: Callable[[], redis.asyncio.Redis],
    cls: type[Semaphore],
    name: str,
    limit: int,
    count: int,
    **options: Any,
) -> AsyncIterator[list[Semaphore]]:
    """``count`` objects of one semaphore, each on a client of its own, as ``count`` processes would have them.

    The objects and clients are closed when the block ends; closing an
    object whose server stopped answering fails, and that is ignored: the
    test has said what it had to say by then.
    """
    clients = [connect() for _ in range(count)]
    semaphores: list[Semaphore] = [cls(client, name, limit, **options) for client in clients]
    try:
        yield semaphores
    finally:
        for semaphore in semaphores:
            with contextlib.suppress(redis.RedisError, TimeoutError):
                await semaphore.aclose()
        for client in clients:
            await client.aclose(close_connection_pool=True)


def proxied_client(proxy: TcpProxy, server: RedisServer, **options: Any) -> redis.asyncio.Redis:
    """A client of ``server`` through ``proxy``, made as `RedisServer.client` makes one (its credentials too)."""
    parts = urlsplit(server.url)
    if parts.username is not None:
        options = {"username": unquote(parts.username), "password": unquote(parts.password or ""), **options}
    return redis.asyncio.Redis(host=proxy.host, port=proxy.port, **options)


def proxied_url(proxy: TcpProxy, server: RedisServer) -> str:
    """``server``'s URL, through ``proxy``."""
    parts = urlsplit(server.url)
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@{proxy.host}:{proxy.port}" if credentials else f"{proxy.host}:{proxy.port}"
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass
class Attempt:
    """One ``async with`` of one process of a `Load`, on the event loop's clock.

    Attributes:
        process: Which process made it.
        began: When it was entered.
        granted: When its body started, if it did.
        token: The fencing token of its permit, if it got one.
        body_ended: When its body ended (done, or cancelled by a loss).
        ended: When the ``async with`` was left, or raised.
        outcome: ``"released"``, or the class name of what it raised.
    """

    process: int
    began: float
    granted: float | None = None
    token: int | None = None
    body_ended: float | None = None
    ended: float | None = None
    outcome: str = ""

    @property
    def acquire_took(self) -> float | None:
        """How long the acquire took: until the body started, or until it raised."""
        end = self.granted if self.granted is not None else self.ended
        return None if end is None else end - self.began

    @property
    def exit_took(self) -> float | None:
        """How long leaving the block took once the body ended: the release."""
        if self.body_ended is None or self.ended is None:
            return None
        return self.ended - self.body_ended


class Load:
    """Processes that take turns holding a semaphore, and the score of every turn.

    Each process enters ``async with`` on its own semaphore object, holds for
    ``hold`` seconds (or until `stop`), and leaves; a caller that saw an
    error tries again after a short pause, as an application would. The
    semaphores' own ``blocking_timeout`` bounds each wait in the queue.

    Args:
        semaphores: One object per process, each on a client of its own.
        hold: How long each body runs.
    """

    def __init__(self, semaphores: Sequence[Semaphore], *, hold: float) -> None:
        self.semaphores = semaphores
        limit = semaphores[0].limit
        if limit is None:
            raise ValueError("a Load needs semaphores made with a limit: it counts against it")
        self.limit = limit
        self.hold = hold
        #: Every attempt, in the order they began.
        self.attempts: list[Attempt] = []
        #: The attempts whose bodies run now.
        self.holding: list[Attempt] = []
        #: The most bodies that ran at once.
        self.peak = 0
        #: Each stretch of time during which more bodies ran than the limit: (start, end).
        self.overlaps: list[tuple[float, float]] = []
        self._over_since: float | None = None
        self._stopping = anyio.Event()
        self._changed = anyio.Event()

    async def run(self) -> None:
        """Run every process until `stop`; returns once each has left its block."""
        async with anyio.create_task_group() as tasks:
            for index, semaphore in enumerate(self.semaphores):
                tasks.start_soon(self._process, index, semaphore)

    def stop(self) -> None:
        """End every body now, and start no new attempt."""
        self._stopping.set()

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; checked whenever a body starts or ends, or an attempt ends.

        Bound the wait yourself (``anyio.fail_after``).
        """
        while not predicate():
            changed = self._changed
            await changed.wait()

    def granted_after(self, moment: float) -> list[Attempt]:
        """The attempts whose bodies started at ``moment`` or later."""
        return [a for a in self.attempts if a.granted is not None and a.granted >= moment]

    def outcomes(self, attempts: Sequence[Attempt] | None = None) -> dict[str, int]:
        """How many attempts ended each way (all of them, or those given)."""
        chosen = self.attempts if attempts is None else attempts
        return dict(collections.Counter(a.outcome for a in chosen if a.ended is not None))

    def longest_acquire(self) -> float:
        return max((a.acquire_took for a in self.attempts if a.acquire_took is not None), default=0.0)

    def longest_exit(self) -> float:
        return max((a.exit_took for a in self.attempts if a.exit_took is not None), default=0.0)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _enter(self, attempt: Attempt, token: int) -> None:
        now = anyio.current_time()
        attempt.granted, attempt.token = now, token
        self.holding.append(attempt)
        self.peak = max(self.peak, len(self.holding))
        if len(self.holding) > self.limit and self._over_since is None:
            self._over_since = now
        self._notify()

    def _leave(self, attempt: Attempt) -> None:
        now = anyio.current_time()
        attempt.body_ended = now
        self.holding.remove(attempt)
        if len(self.holding) <= self.limit and self._over_since is not None:
            self.overlaps.append((self._over_since, now))
            self._over_since = None
        self._notify()

    async def _process(self, index: int, semaphore: Semaphore) -> None:
        while not self._stopping.is_set():
            attempt = Attempt(index, anyio.current_time())
            self.attempts.append(attempt)
            try:
                async with semaphore as permit:
                    self._enter(attempt, permit.fencing_token)
                    try:
                        with anyio.move_on_after(self.hold):
                            await self._stopping.wait()
                    finally:
                        self._leave(attempt)
            # What a caller of a limiter can see, most specific first;
            # anything else is a failure of the test.
            except (PermitLost, AcquireTimeout, SemaphoreError, redis.RedisError, TimeoutError) as error:
                attempt.outcome = type(error).__name__
            else:
                attempt.outcome = "released"
            attempt.ended = anyio.current_time()
            self._notify()
            if attempt.outcome not in ("released", "PermitLost"):
                await anyio.sleep(_ERROR_PAUSE)


async def exhaust_memory(admin: redis.asyncio.Redis) -> None:
    """Put the server over its ``maxmemory`` under ``noeviction``: a command that may grow memory is refused.

    Filler keys are written first, so that `free_memory` can give memory back
    without lifting the limit.
    """
    await admin.config_set("maxmemory-policy", "noeviction")
    async with admin.pipeline(transaction=False) as pipe:
        for index in range(_FILLER_KEYS):
            pipe.set(f"{_FILLER}{index}", b"x" * _FILLER_BYTES)
        await pipe.execute()
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used - _OVER_THE_LIMIT)


async def free_memory(admin: redis.asyncio.Redis) -> None:
    """Delete what `exhaust_memory` wrote: the server is under its limit again (``DEL`` is never refused)."""
    await admin.delete(*(f"{_FILLER}{index}" for index in range(_FILLER_KEYS)))


async def evict_until_gone(admin: redis.asyncio.Redis, keys: Sequence[str]) -> None:
    """Have Redis evict keys at random until one of ``keys`` is gone: ``allkeys-random``, little room, filler writes.

    Bound the wait yourself (``anyio.fail_after``).
    """
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory-policy", "allkeys-random")
    await admin.config_set("maxmemory", used + _EVICTION_ROOM)
    written = 0
    while await admin.exists(*keys) == len(keys):
        async with admin.pipeline(transaction=False) as pipe:
            for index in range(written, written + _EVICTION_BATCH):
                pipe.set(f"{_FILLER}{index}", b"x" * _EVICTION_BYTES)
            await pipe.execute()
        written += _EVICTION_BATCH


async def snapshot(client: redis.asyncio.Redis) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key but the fillers, with its serialized value and whether it has a TTL: what a step may have written."""
    keys = [key async for key in client.scan_iter() if not key.startswith(_FILLER.encode())]
    return {key: (await client.dump(key), await client.pttl(key) >= 0) for key in sorted(keys)}


async def pause_server(admin: redis.asyncio.Redis, kind: PauseKind, seconds: float) -> None:
    """Stop the server answering for ``seconds``; ``DEBUG SLEEP`` returns only once the server is back."""
    if kind == "DEBUG SLEEP":
        await admin.execute_command("DEBUG", "SLEEP", seconds)  # type: ignore[no-untyped-call]  # untyped in redis-py
    else:
        await admin.client_pause(round(seconds * 1000), all=kind == "CLIENT PAUSE ALL")


def debugging_server(binary: str, directory: Path) -> RedisServer:
    """A started server that accepts ``DEBUG``: Redis 7 needs telling, older servers know no such option."""
    server = RedisServer(binary, directory, "--enable-debug-command", "yes")
    try:
        server.start()
    except RuntimeError:
        server = RedisServer(binary, directory)
        server.start()
    return server


@dataclass(frozen=True)
class _Measurement:
    fault: str
    caller_saw: str
    recovered_in: float | None
    over_limit: str


def report(fault: str, *, caller_saw: str, recovered_in: float | None, over_limit: str) -> None:
    """Note what a test measured of one fault: what the callers saw, how long until it worked again, who ran over."""
    measurement = _Measurement(fault, caller_saw, None if recovered_in is None else round(recovered_in, 3), over_limit)
    recovered = "-" if recovered_in is None else f"{recovered_in:.3f} s"
    print(f"\nFAULT | {fault} | {caller_saw} | {recovered} | {over_limit}")  # noqa: T201 -- the figures are the point: `pytest -s`
    path = os.environ.get("AIOSEM_FAULT_REPORT")
    if path:
        with Path(path).open("a", encoding="utf-8") as file:
            file.write(json.dumps(asdict(measurement)) + "\n")
