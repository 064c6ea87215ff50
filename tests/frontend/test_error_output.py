"""What a person sees when something goes wrong: the error once, in few lines.

Each test runs a program as its user would -- a script of the quick start,
the command line -- in a process of its own, and counts what it printed.
The counts are pinned: a change that brings back a traceback per waiter, a
chained traceback through redis-py, a warning per permit or an error
never retrieved makes them fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING

import pytest
import redis

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from tests.harness.support import RedisServer

#: A traceback of a script of the quick start that failed in an aiosem call:
#: the script's and asyncio.run's frames, and at most four of aiosem's, each
#: with its source line and, on Python 3.11 and later, its markers.
MOST_TRACEBACK_LINES = 36

QUICK_START = """
import asyncio
import sys

from redis.asyncio import Redis

from aiosem import AsyncFairSemaphore


async def query(db: AsyncFairSemaphore, number: int) -> None:
    async with db:
        if number == 4 and sys.argv[2] == "fail":
            raise RuntimeError("query 4 failed")
        await asyncio.sleep(0.2)


async def main() -> None:
    redis = Redis.from_url(sys.argv[1])
    db = AsyncFairSemaphore(redis, "db", limit=3, timeout=10)
    try:
        await asyncio.gather(*(query(db, number) for number in range(10)))
    finally:
        await db.aclose()
        await redis.aclose()


asyncio.run(main())
"""

DECORATED = """
import asyncio
import sys

import aiosem


@aiosem.limit_concurrency("db", 3)
async def query(number: int) -> None:
    if number == 4 and sys.argv[2] == "fail":
        raise RuntimeError("query 4 failed")
    await asyncio.sleep(0.2)


async def main() -> None:
    aiosem.configure(url=sys.argv[1])
    try:
        await asyncio.gather(*(query(number) for number in range(10)))
    finally:
        await aiosem.aclose()


asyncio.run(main())
"""


def run_script(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60, check=False)


def aiosem_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiosem", *args], capture_output=True, text=True, timeout=120, check=False
    )


def interruptible(*args: str) -> list[str]:
    """Python with ``args``, taking SIGINT as a terminal's process would, even if this process ignores it."""
    restore = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    return [sys.executable, "-c", restore, *args]


def assert_told_once(stderr: str, last_line: str) -> None:
    """One traceback, short, ending in ``last_line``; nothing else."""
    lines = stderr.splitlines()
    assert stderr.count("Traceback") == 1, stderr
    assert stderr.startswith("Traceback"), stderr
    assert lines[-1].startswith(last_line), stderr
    assert len(lines) <= MOST_TRACEBACK_LINES, stderr
    assert "During handling" not in stderr, stderr
    assert "direct cause" not in stderr, stderr
    assert "never retrieved" not in stderr, stderr


@pytest.mark.parametrize("program", [QUICK_START, DECORATED], ids=["quick-start", "decorator"])
def test_a_redis_that_is_not_running_is_named_once_with_its_password_hidden(
    tmp_path: Path, refusing_port: int, program: str
) -> None:
    url = f"redis://:s3cret@127.0.0.1:{refusing_port}/0"
    completed = run_script(tmp_path, program, url, "ok")
    assert completed.returncode == 1
    shown = f"redis://:***@127.0.0.1:{refusing_port}/0"
    last_line = f"aiosem.RedisUnavailable: Redis at {shown} is unreachable, for semaphore 'db': "
    assert_told_once(completed.stderr, last_line)
    assert "s3cret" not in completed.stderr


@pytest.mark.parametrize("program", [QUICK_START, DECORATED], ids=["quick-start", "decorator"])
def test_one_failing_task_of_a_gather_is_the_only_thing_reported(
    tmp_path: Path, redis_server: RedisServer, program: str
) -> None:
    completed = run_script(tmp_path, program, redis_server.admin_url, "fail")
    assert completed.returncode == 1
    assert_told_once(completed.stderr, "RuntimeError: query 4 failed")
    assert "lost" not in completed.stderr
    assert "closed" not in completed.stderr


def test_the_demo_on_a_redis_that_is_not_running_ends_with_one_line(refusing_port: int) -> None:
    completed = aiosem_command("demo", "--url", f"redis://:s3cret@127.0.0.1:{refusing_port}/0", "--duration", "1")
    assert completed.returncode == 3
    assert completed.stderr.splitlines() == [
        f"aiosem demo: error: Redis at redis://:***@127.0.0.1:{refusing_port}/0 is unreachable: "
        + completed.stderr.partition("is unreachable: ")[2].rstrip("\n")
    ]
    assert "Connect call failed" in completed.stderr


@contextlib.contextmanager
def in_a_terminal(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -m aiosem ARGS`` in a process group of its own, as a terminal's foreground job; killed if left."""
    process = subprocess.Popen(
        interruptible("-m", "aiosem", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def ctrl_c(process: subprocess.Popen[str]) -> tuple[str, str]:
    """A terminal's Ctrl-C, SIGINT to every process of the group; what the job printed then."""
    os.killpg(process.pid, signal.SIGINT)
    return process.communicate(timeout=60)


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_quietly_and_shows_what_it_saw(redis_server: RedisServer) -> None:
    with in_a_terminal("demo", "--url", redis_server.admin_url, "--duration", "60") as demo:
        assert demo.stdout is not None
        deadline = time.monotonic() + 60
        while "in use" not in demo.stdout.readline():  # the workers run
            assert time.monotonic() < deadline
        stdout, stderr = ctrl_c(demo)
    assert demo.returncode == 130
    assert stderr == ""
    assert stdout.splitlines()[-1].startswith("stopped early: grants ")
    assert "over limit 0" in stdout


@pytest.mark.slow
def test_ctrl_c_while_the_demo_starts_stops_it_quietly() -> None:
    with in_a_terminal("demo", "--duration", "60") as demo:
        assert demo.stdout is not None
        assert "share limit" in demo.stdout.readline()  # started, workers not yet up
        _, stderr = ctrl_c(demo)
    assert demo.returncode == 130
    assert stderr == ""


CTRL_C_WHILE_SPAWNING = """
import os, signal, subprocess, sys, time
from aiosem._demo import _interrupted, _spawning, interrupts_deferred
with interrupts_deferred():
    with _spawning():
        worker = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(1); print('worked on')"], stdout=subprocess.PIPE, text=True
        )
        os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C, to the whole group, while the worker starts
    deadline = time.monotonic() + 5
    while not _interrupted.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("heard" if _interrupted.is_set() else "lost")
    print(worker.communicate(timeout=30)[0].strip(), worker.returncode)
"""


def test_a_ctrl_c_while_the_workers_start_reaches_the_run_and_not_the_workers() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", CTRL_C_WHILE_SPAWNING],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        start_new_session=True,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == ["heard", "worked on 0"]


def test_status_into_a_reader_that_stops_early_ends_quietly(redis_server: RedisServer) -> None:
    # `status --json | head -1`: the reader leaves after one line of more than a pipe holds.
    with redis.Redis.from_url(redis_server.admin_url) as admin, admin.pipeline() as pipeline:
        admin.flushall()
        for number in range(1000):
            pipeline.set(f"aiosem:{{crawl-{number}}}:counter", 1)
        pipeline.execute()
    with subprocess.Popen(
        [sys.executable, "-m", "aiosem", "status", "--json", "--url", redis_server.admin_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as process:
        assert process.stdout is not None
        assert process.stderr is not None
        process.stdout.readline()
        process.stdout.close()
        stderr = process.stderr.read().decode()
        process.wait(timeout=60)
    assert process.returncode == 141
    assert stderr == ""
