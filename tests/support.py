"""Test helpers: our own ``redis-server`` processes, and a clock moved by hand."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any

import anyio
import redis
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from aiosem._connection import Client

Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: How long a server may take to answer its first PING.
_START_TIMEOUT = 10.0


def find_redis_server() -> str | None:
    """The ``redis-server`` binary: ``$AIOSEM_REDIS_SERVER``, else the one on ``PATH``."""
    return os.environ.get("AIOSEM_REDIS_SERVER") or shutil.which("redis-server")


class RedisServer:
    """A ``redis-server`` process of our own on a loopback port."""

    def __init__(self, binary: str, directory: Path, *extra: str) -> None:
        self.binary = binary
        self.directory = directory
        self.extra = extra
        self.host = "127.0.0.1"
        self.port = 0
        self.version = ""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **options: object) -> redis.asyncio.Redis:
        return redis.asyncio.Redis(host=self.host, port=self.port, **options)  # type: ignore[arg-type]

    def start(self, *, same_port: bool = False) -> None:
        """Start on a free port (a port taken between probe and bind is retried), or on the last one."""
        for _ in range(1 if same_port else 5):
            if not same_port:
                with socket.socket() as probe:
                    probe.bind((self.host, 0))
                    self.port = probe.getsockname()[1]
            log = self.directory / f"redis-{self.port}.log"
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port", str(self.port),
                    "--bind", self.host,
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(self.directory),
                    "--logfile", str(log),
                    *self.extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if self._wait_until_ready():
                return
            self.stop()
        raise RuntimeError(f"redis-server would not start; see {self.directory}")

    def _wait_until_ready(self) -> bool:
        """Wait for this process to answer; ``False`` if it died or another server holds the port."""
        assert self.process is not None
        deadline = time.monotonic() + _START_TIMEOUT
        probe = redis.Redis(host=self.host, port=self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    info = probe.info("server")
                except redis.ConnectionError:
                    time.sleep(0.02)
                    continue
                self.version = str(info["redis_version"])
                return int(info["process_id"]) == self.process.pid
        finally:
            probe.close()
        return False

    def stop(self) -> None:
        """Stop the process by its PID: SIGTERM, then SIGKILL if it lingers."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def save_and_stop(self) -> None:
        """Write the data to disk and stop: the next `start` on the same port and directory loads it."""
        probe = redis.Redis(host=self.host, port=self.port, socket_timeout=5)
        try:
            probe.save()
        finally:
            probe.close()
        self.stop()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=5)
        self.process = None


class FakeClock:
    """A clock the tests move by hand, passed to a semaphore as ``clock``."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.asynccontextmanager
async def two_processes(
    connect: Callable[[], Client],
    cls: type[AsyncFairSemaphore] | type[AsyncLockedSemaphore],
    name: str,
    limit: int,
    **options: Any,
) -> AsyncIterator[tuple[Semaphore, Semaphore]]:
    """Two objects of one semaphore, each on a client of its own, as two processes would have them.

    Both objects and both clients are closed when the block ends.
    """
    clients = [connect(), connect()]
    first, second = (cls(client, name, limit, **options) for client in clients)
    try:
        yield first, second
    finally:
        for semaphore in (first, second):
            await semaphore.aclose()
        for client in clients:
            await client.aclose()


async def until_queued(semaphore: Semaphore, count: int = 1) -> None:
    """Wait until Redis lists ``count`` waiters of ``semaphore`` (bounded to 5 s)."""
    with anyio.fail_after(5):
        while await semaphore.waiting() < count:  # noqa: ASYNC110 -- a bounded poll of Redis's own state
            await asyncio.sleep(0.01)
