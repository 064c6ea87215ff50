"""``python -m aiosem demo``: worker processes share one limit, watched live.

Each worker process runs many coroutines that loop: take a permit, increment
a shared in-use counter in Redis, hold for a moment, decrement, release. The
counter is only ever touched while a permit is held, so any reading above
the limit is an over-admission. The same workers drive the multi-process
contention tests, for every semaphore and recipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

import redis
import redis.asyncio

from . import recipes
from ._exceptions import PermitLost
from ._fair import AsyncFairSemaphore
from ._keys import SemaphoreKeys
from ._locked import AsyncLockedSemaphore
from ._options import DEFAULT_PREFIX
from ._scripts import ALL_SCRIPTS
from ._timing import Backoff, Deadline
from ._urls import close, connect

if TYPE_CHECKING:
    from ._connection import Client

Kind: TypeAlias = Literal[
    "fair", "locked", "recipe-basic", "recipe-fair", "recipe-locked", "recipe-lock", "recipe-lock-with-timeout"
]
KINDS: Final[tuple[Kind, ...]] = (
    "fair",
    "locked",
    "recipe-basic",
    "recipe-fair",
    "recipe-locked",
    "recipe-lock",
    "recipe-lock-with-timeout",
)

#: How long the workers wait for each other before they start together.
_START_TIMEOUT: Final = 60.0
#: The exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
_EXIT_INTERRUPTED: Final = 130
#: How often a worker looks whether the run was stopped early, in seconds.
_STOP_POLL: Final = 0.1
#: The lease the workers take: far longer than any hold, so that a reading
#: over the limit can only mean a wrongly granted permit.
_LEASE: Final = 10.0


@dataclass(frozen=True, slots=True)
class Config:
    """What every worker of one run is told."""

    url: str
    kind: Kind
    name: str
    limit: int
    workers: int
    coroutines: int
    duration: float
    hold: float

    @property
    def in_use_key(self) -> str:
        return f"aiosem-demo:{{{self.name}}}:in-use"

    @property
    def ready_key(self) -> str:
        return f"aiosem-demo:{{{self.name}}}:ready"

    @property
    def stop_key(self) -> str:
        """Set when the run is stopped early (Ctrl-C): each worker ends its holds and reports."""
        return f"aiosem-demo:{{{self.name}}}:stop"

    @property
    def semaphore_keys(self) -> tuple[str, ...]:
        """The keys the run's semaphore may leave, but for receipts of releases, which expire within seconds."""
        if self.kind in ("fair", "locked"):
            keys = SemaphoreKeys.for_name(DEFAULT_PREFIX, self.name)
        else:
            # The recipes take the name as their key, as the book does.
            keys = SemaphoreKeys(self.name)
        # The fair class never takes the step lock, and its ACL line may not reach it.
        return (*keys.fair, keys.rate) if self.kind == "fair" else (*keys.fair, keys.rate, keys.lock)


@dataclass(frozen=True, slots=True)
class Result:
    """What one worker, or a whole run, observed."""

    grants: int
    peak: int
    over_limit: int
    #: Holds whose permit was lost before they ended (`PermitLost`): a holder
    #: stalled past its lease, which the limit survives.
    lost: int = 0
    #: Whether the run was stopped before its duration was up.
    stopped: bool = False

    def __add__(self, other: Result) -> Result:
        return Result(
            self.grants + other.grants,
            max(self.peak, other.peak),
            self.over_limit + other.over_limit,
            self.lost + other.lost,
            self.stopped or other.stopped,
        )


Holder = Callable[[], contextlib.AbstractAsyncContextManager[None]]


def _holder(client: Client, config: Config) -> Holder:
    """How one coroutine of this kind holds a permit."""
    name, limit = config.name, config.limit
    if config.kind in ("fair", "locked"):
        cls = AsyncFairSemaphore if config.kind == "fair" else AsyncLockedSemaphore
        semaphore = cls(client, name, limit, timeout=_LEASE)

        @contextlib.asynccontextmanager
        async def hold_class() -> AsyncIterator[None]:
            async with semaphore:
                yield

        return hold_class

    calls: dict[str, tuple[Callable[[], Awaitable[str | None]], Callable[[str], Awaitable[bool]]]] = {
        "recipe-basic": (
            lambda: recipes.acquire_semaphore(client, name, limit, _LEASE),
            lambda i: recipes.release_semaphore(client, name, i, _LEASE),
        ),
        "recipe-fair": (
            lambda: recipes.acquire_fair_semaphore(client, name, limit, _LEASE),
            lambda i: recipes.release_fair_semaphore(client, name, i, _LEASE),
        ),
        "recipe-locked": (
            lambda: recipes.acquire_semaphore_with_lock(client, name, limit, _LEASE),
            lambda i: recipes.release_fair_semaphore(client, name, i, _LEASE),
        ),
        "recipe-lock": (
            lambda: recipes.acquire_lock(client, name, acquire_timeout=0),
            lambda i: recipes.release_lock(client, name, i),
        ),
        "recipe-lock-with-timeout": (
            lambda: recipes.acquire_lock_with_timeout(client, name, acquire_timeout=0, lock_timeout=_LEASE),
            lambda i: recipes.release_lock(client, name, i),
        ),
    }
    try_once, release = calls[config.kind]

    @contextlib.asynccontextmanager
    async def hold_recipe() -> AsyncIterator[None]:
        backoff = Backoff()
        while (identifier := await try_once()) is None:
            await backoff.pause(Deadline(None))
        try:
            yield
        finally:
            await release(identifier)

    return hold_recipe


async def _work(config: Config) -> Result:
    client = connect(config.url)
    grants = peak = over = lost = 0
    stopped = asyncio.Event()
    try:
        hold = _holder(client, config)
        await client.incr(config.ready_key)
        start = Deadline(_START_TIMEOUT)
        backoff = Backoff()
        while int(await client.get(config.ready_key) or 0) < config.workers and not start.passed():
            await backoff.pause(start)
        end = Deadline(config.duration)

        async def loop() -> None:
            while not end.passed() and not stopped.is_set():
                await hold_once()

        async def watch_for_stop() -> None:
            while not end.passed():
                if await client.get(config.stop_key) is not None:
                    stopped.set()
                    return
                await asyncio.sleep(_STOP_POLL)

        async def hold_once() -> None:
            nonlocal grants, peak, over, lost
            try:
                async with hold():
                    in_use = await client.incr(config.in_use_key)
                    grants += 1
                    peak = max(peak, in_use)
                    over += in_use > config.limit
                    await asyncio.sleep(random.uniform(0, 2 * config.hold))
                    await client.decr(config.in_use_key)
            except PermitLost:
                # Counted, not fatal: the lease ran out under the body (its process stalled),
                # and the in-use counter tells whether anybody ran over the limit meanwhile.
                lost += 1

        watcher = asyncio.create_task(watch_for_stop())
        try:
            await asyncio.gather(*(loop() for _ in range(config.coroutines)))
        finally:
            watcher.cancel()
    finally:
        await close(client)
    return Result(grants, peak, over, lost, stopped.is_set())


def _worker_process(config: Config) -> Result:
    return asyncio.run(_work(config))


#: Set by Ctrl-C within `interrupts_deferred`: the run stops at its next tick.
_interrupted = threading.Event()


def _on_interrupt(signum: int, frame: object) -> None:
    if _interrupted.is_set():
        raise KeyboardInterrupt  # pressed twice: the user will not wait for the workers
    _interrupted.set()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Take Ctrl-C as a request to stop that `run` answers cleanly, at its next tick.

    A terminal sends Ctrl-C's SIGINT to every process of the foreground
    group. Raised as `KeyboardInterrupt` wherever the code happens to be --
    in a worker importing, in the creation of an event loop -- it prints
    tracebacks and leaves permits to their leases. Here it only sets a flag
    (twice, it interrupts); the workers ignore it (see `_spawning`), and
    the run tells them to stop through Redis.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _interrupted.clear()
    previous = signal.signal(signal.SIGINT, _on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _spawning() -> Iterator[None]:
    """Start processes that never see SIGINT, while Ctrl-C is taken by `interrupts_deferred`.

    SIGINT is blocked in this thread meanwhile. A new process keeps its
    parent's blocked signals through its exec, so the workers never see a
    Ctrl-C (the run stops them through Redis). One pressed while they start
    stays pending here until the block ends, and `_on_interrupt` takes it
    then -- or at once, if another thread of this process took delivery.
    (Ignoring SIGINT instead, which a new process keeps too, lost such a
    Ctrl-C: the demo then ran to its end.)
    """
    if signal.getsignal(signal.SIGINT) is not _on_interrupt or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def run(config: Config, *, on_tick: Callable[[int, float], None] | None = None) -> Result:
    """Run ``config.workers`` processes against ``config.url`` and add up what they saw.

    ``on_tick(in_use, elapsed)`` is called about ten times a second with the
    in-use counter as Redis has it. Called within `interrupts_deferred`, a
    Ctrl-C tells the workers to stop, and the run returns what they saw
    until then (``stopped``).
    """
    return asyncio.run(_watch(config, on_tick))


async def _watch(config: Config, on_tick: Callable[[int, float], None] | None) -> Result:
    watcher = connect(config.url)
    try:
        await watcher.delete(config.in_use_key, config.ready_key)
        started = time.monotonic()
        if _interrupted.is_set():
            return Result(0, 0, 0, stopped=True)
        with ProcessPoolExecutor(config.workers, mp_context=get_context("spawn")) as pool:
            with _spawning():
                futures = [asyncio.wrap_future(pool.submit(_worker_process, config)) for _ in range(config.workers)]
            while not all(future.done() for future in futures):
                if _interrupted.is_set():
                    await watcher.set(config.stop_key, 1)
                    await asyncio.wait(futures)
                    break
                if on_tick is not None:
                    on_tick(int(await watcher.get(config.in_use_key) or 0), time.monotonic() - started)
                await asyncio.wait(futures, timeout=0.1)
            total = Result(0, 0, 0)
            for future in futures:
                total += future.result()
            return total
    finally:
        # Every worker has ended: the run's keys go, its fencing counter with
        # them -- the name is the run's own, and nobody will hold it again.
        await watcher.delete(config.in_use_key, config.ready_key, config.stop_key, *config.semaphore_keys)
        await close(watcher)


@contextlib.contextmanager
def embedded_server() -> Iterator[str]:
    """Serve fakeredis on a free loopback port, so that processes can share it.

    Raises:
        ModuleNotFoundError: fakeredis or lupa is missing
            (aiosem's ``memory`` extra).
    """
    import lupa  # noqa: F401, PLC0415 -- fakeredis needs it for Lua, and says so only at the first script
    from fakeredis import TcpFakeServer  # noqa: PLC0415 -- an optional dependency

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="aiosem-embedded-redis", daemon=True)
    thread.start()
    url = f"redis://127.0.0.1:{port}/0"
    try:
        # fakeredis's TCP server drops a connection after any error reply, NOSCRIPT
        # included: load every script up front so that no call ever meets one.
        with redis.Redis.from_url(url) as loader:
            for script in ALL_SCRIPTS:
                loader.script_load(script.source)
        yield url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _live_view(limit: int, duration: float) -> Callable[[int, float], None]:
    interactive = sys.stdout.isatty()
    peak = 0
    last_line = -1.0

    def tick(in_use: int, elapsed: float) -> None:
        nonlocal peak, last_line
        peak = max(peak, in_use)
        bar = "#" * min(in_use, 40) + "." * max(0, min(limit, 40) - in_use)
        line = f"{elapsed:5.1f}/{duration:g} s  in use [{bar}] {in_use}/{limit}  peak {peak}"
        if interactive:
            print(f"\r{line}", end="", flush=True)
        elif elapsed - last_line >= 1.0:
            print(line, flush=True)
            last_line = elapsed

    return tick


def main(config: Config, *, embedded: bool) -> int:
    """Run the demo with a live view; return the exit status.

    1 if the limit was ever exceeded; else 130 if Ctrl-C stopped it early
    (the workers end their holds, and what they saw is shown), else 0.
    """
    # The command line's own redaction: it knows every URL form (imported here, as it imports this module).
    from .__main__ import redact  # noqa: PLC0415

    where = "an embedded Redis (fakeredis)" if embedded else redact(config.url)
    print(
        f"{config.workers} processes x {config.coroutines} coroutines share limit {config.limit} "
        f"of a {config.kind!r} semaphore on {where} for {config.duration:g} s"
    )
    result = run(config, on_tick=_live_view(config.limit, config.duration))
    print()
    print(
        f"{'stopped early: ' if result.stopped else ''}grants {result.grants}  peak in use "
        f"{result.peak}/{config.limit}  over limit {result.over_limit}  permits lost {result.lost}"
    )
    if result.over_limit:
        return 1
    return _EXIT_INTERRUPTED if result.stopped else 0
