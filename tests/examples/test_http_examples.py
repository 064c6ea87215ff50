"""The web examples, each served by two worker processes, never run more requests at once than their limit.

Each example is started once, as its docstring says -- ``python
examples/NAME.py --workers 2 --port P --redis URL`` -- on a Redis of its
own, and sent 200 requests at once; each test reads one side of the
answers: the start and end of each request's guarded work (one machine,
one clock), which worker answered, how long each 503 waited.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
import pytest

from tests.harness.support import RedisServer

if TYPE_CHECKING:
    from collections.abc import Iterator

EXAMPLES = Path(__file__).parents[2] / "examples"

#: What both examples are written with.
LIMIT = 3
WORK = 0.1
BLOCKING_TIMEOUT = 1.0
RETRY_AFTER = "1"
WORKERS = 2

#: 200 requests at once, each doing 0.1 s of work 3 at a time: about 30 fit in the 1 s the others wait.
REQUESTS = 200
#: How much earlier than ``blocking_timeout`` a client may see its 503: timer granularity only.
EARLY = 0.01

pytestmark = [pytest.mark.slow, pytest.mark.apps]


@dataclass(frozen=True)
class Answer:
    status: int
    #: The worker that answered, from the examples' ``X-Worker-Pid`` header.
    pid: int
    retry_after: str | None
    #: The JSON of a 200, ``{}`` otherwise.
    body: dict[str, Any]
    #: Seconds from sending the request to the end of the response, as the client measured them.
    elapsed: float


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass(frozen=True)
class Burst:
    """The answers to 200 requests sent at once, and how long they took."""

    answers: list[Answer]
    duration: float

    @property
    def served(self) -> list[Answer]:
        return [answer for answer in self.answers if answer.status == 200]

    @property
    def refused(self) -> list[Answer]:
        return [answer for answer in self.answers if answer.status == 503]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@contextmanager
def running(example: str, redis_url: str, log: Path) -> Iterator[Server]:
    """The example, started as its docstring says, with two workers; stopped by SIGTERM, killed if it lingers."""
    port = free_port()
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                sys.executable, str(EXAMPLES / example),
                "--workers", str(WORKERS), "--port", str(port), "--redis", redis_url,
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            # A group of its own: workers a killed supervisor leaves behind are killed with it.
            start_new_session=True,
        )  # fmt: skip
    try:
        yield Server(f"http://127.0.0.1:{port}", process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


@pytest.fixture(scope="module", params=["fastapi_app.py", "aiohttp_app.py"])
def burst(
    request: pytest.FixtureRequest, redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Burst]:
    """What the example answered to 200 requests at once, on a Redis of its own; each test reads one side of it."""
    directory = tmp_path_factory.mktemp(request.param)
    with (
        RedisServer(redis_binary, directory) as redis_server,
        running(request.param, redis_server.url, directory / "server.log") as server,
    ):
        yield asyncio.run(fire(server))


async def fire(server: Server) -> Burst:
    await wait_for_every_worker(server)
    # One connection per request: none waits for a free one in the client.
    connector = aiohttp.TCPConnector(limit=REQUESTS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
        started = time.monotonic()
        answers = await asyncio.gather(*(work(session, server.url) for _ in range(REQUESTS)))
        return Burst(answers, time.monotonic() - started)


async def wait_for_every_worker(server: Server) -> None:
    """Until each worker has answered ``/pid``: a burst must not find one still starting."""
    pids: set[int | None] = set()
    # A connection a request, closed after it: a kept one would go on asking the same worker.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        with anyio.fail_after(20):
            while len(pids - {None}) < WORKERS:
                assert server.process.poll() is None, server.log.read_text()
                pids |= set(await asyncio.gather(*(pid_of(session, server.url) for _ in range(10))))
                await anyio.sleep(0.05)


async def pid_of(session: aiohttp.ClientSession, url: str) -> int | None:
    """The pid of the worker that answers, or ``None`` while none listens yet."""
    try:
        async with session.get(f"{url}/pid") as response:
            pid: int = (await response.json())["pid"]
    except aiohttp.ClientConnectionError:
        return None
    return pid


async def work(session: aiohttp.ClientSession, url: str) -> Answer:
    started = time.monotonic()
    async with session.get(f"{url}/work") as response:
        body = await response.json() if response.status == 200 else {}
    pid = int(response.headers["X-Worker-Pid"])
    return Answer(response.status, pid, response.headers.get("Retry-After"), body, time.monotonic() - started)


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant; one that ends as another starts does not overlap it."""
    # At a tie, an end (0) sorts before a start (1).
    events = sorted([(start, 1) for start, _ in intervals] + [(end, 0) for _, end in intervals])
    open_now = peak = 0
    for _, starts in events:
        open_now += 1 if starts else -1
        peak = max(peak, open_now)
    return peak


# The figures go to each test's user properties, for a report (--junitxml=... -o junit_family=xunit1).


def test_every_request_is_served_or_refused_with_503(burst: Burst, request: pytest.FixtureRequest) -> None:
    request.node.user_properties += [
        ("served", len(burst.served)),
        ("refused", len(burst.refused)),
        ("duration", round(burst.duration, 2)),
    ]
    assert len(burst.served) + len(burst.refused) == REQUESTS, sorted({answer.status for answer in burst.answers})


def test_both_workers_answer(burst: Burst, request: pytest.FixtureRequest) -> None:
    pids = Counter(answer.pid for answer in burst.answers)
    served = Counter(answer.pid for answer in burst.served)
    request.node.user_properties += [
        ("answers by worker", sorted(pids.values())),
        ("served by worker", sorted(served.values())),
    ]
    assert len(pids) == WORKERS
    assert all(answer.body["pid"] == answer.pid for answer in burst.served)


def test_the_guarded_work_never_overlaps_beyond_the_limit_and_reaches_it(
    burst: Burst, request: pytest.FixtureRequest
) -> None:
    peak = peak_overlap([(answer.body["started"], answer.body["ended"]) for answer in burst.served])
    request.node.user_properties += [("peak", peak)]
    assert peak == LIMIT


def test_each_served_request_has_a_fencing_token_of_its_own(burst: Burst) -> None:
    tokens = [answer.body["fencing_token"] for answer in burst.served]
    assert len(set(tokens)) == len(tokens)


def test_more_requests_than_fit_in_blocking_timeout_are_refused(burst: Burst) -> None:
    # 3 at a time for 0.1 s each: about 30 of the 200 fit in the 1 s a request waits.
    assert len(burst.served) >= LIMIT
    assert burst.refused


def test_a_503_says_when_to_retry_and_comes_only_past_blocking_timeout(
    burst: Burst, request: pytest.FixtureRequest
) -> None:
    request.node.user_properties += [("earliest 503 (s)", round(min(answer.elapsed for answer in burst.refused), 3))]
    assert all(answer.retry_after == RETRY_AFTER for answer in burst.refused)
    assert min(answer.elapsed for answer in burst.refused) >= BLOCKING_TIMEOUT - EARLY
