"""An aiohttp app served by several processes that share one limit: 3 requests at a time.

``GET /work`` does 0.1 s of simulated work under a permit of the semaphore
``"api"`` (limit 3), and answers the worker's pid, the permit's fencing
token and the time the work started and ended. A request that gets no
permit within 1 s is answered ``503`` with ``Retry-After: 1``. ``GET /pid``
is not limited. Every response names the worker that answered in an
``X-Worker-Pid`` header. Run it from any directory::

    python examples/aiohttp_app.py --redis redis://localhost:6379/0   # 2 workers on 127.0.0.1:8000
    AIOSEM_REDIS_URL=redis://localhost:6379/0 python examples/aiohttp_app.py --workers 4 --port 8080

    curl -i http://127.0.0.1:8000/work

aiohttp has no worker manager of its own: the script starts the worker
processes, each serving the app on the same port with ``SO_REUSEPORT``
(``web.run_app(..., reuse_port=True)``, which makes a ``web.TCPSite``), so
the kernel spreads the connections over them -- Linux does; other systems
may give every connection to one worker, and Windows has no
``SO_REUSEPORT``. With ``--workers 1`` it serves in its own process. On
Ctrl-C or SIGTERM it stops the workers, each finishing
the requests it is serving, and kills any still running 10 s later; if
a worker ends by itself (it could not bind the port, say), the others are
stopped too, and the script exits with an error.

The limit holds across the workers because they all use the same Redis:
``--redis`` is put in ``AIOSEM_REDIS_URL``, which the worker processes
inherit. ``memory://`` would not do -- each worker would have a store, and a
limit, of its own -- so with several workers and no Redis, aiosem refuses
to guess: the script stops at once (and a worker would fail its requests
with a `RuntimeError` saying so). A single worker runs without Redis, on
``memory://`` (aiosem's ``memory`` extra).

Fire 200 requests at once and at most 3 run at any moment, over all the
workers: about 30 are served in the first second, 3 every 0.1 s, and the
others are answered 503 once they have waited 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from aiohttp import web

import aiosem
from aiosem.contrib.aiohttp import PERMIT, limit

if TYPE_CHECKING:
    from types import FrameType

#: How many requests may do their work at once, over all the workers.
LIMIT = 3
#: The simulated work, in seconds.
WORK = 0.1
#: How long a request waits for a permit before its 503, in seconds.
BLOCKING_TIMEOUT = 1.0
#: How long the workers have to stop before they are killed, in seconds.
STOP_TIMEOUT = 10.0


@limit("api", LIMIT, blocking_timeout=BLOCKING_TIMEOUT, retry_after=1)
async def work(request: web.Request) -> web.Response:
    started = time.time()
    await asyncio.sleep(WORK)
    permit = request[PERMIT]
    return web.json_response(
        {"pid": os.getpid(), "fencing_token": permit.fencing_token, "started": started, "ended": time.time()}
    )


async def pid(request: web.Request) -> web.Response:
    return web.json_response({"pid": os.getpid()})


async def worker_pid(request: web.Request, response: web.StreamResponse) -> None:
    """Tell on every response, 503s included, which worker answered."""
    response.headers["X-Worker-Pid"] = str(os.getpid())


async def close_aiosem(app: web.Application) -> None:
    await aiosem.aclose()


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/work", work)
    app.router.add_get("/pid", pid)
    app.on_response_prepare.append(worker_pid)
    app.on_cleanup.append(close_aiosem)
    return app


def serve(host: str, port: int) -> None:
    """One worker: serve the app until SIGINT or SIGTERM, on a port the other workers share."""
    web.run_app(make_app(), host=host, port=port, reuse_port=True, print=None)


class Stop(Exception):
    """The parent was told to stop."""


def stop(signal_number: int, frame: FrameType | None) -> NoReturn:
    raise Stop(signal.Signals(signal_number).name)


def main() -> str | None:
    """Start the workers and wait; the error to exit with, if a worker ended by itself."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--redis", metavar="URL", help="the Redis every worker uses (default: $AIOSEM_REDIS_URL)")
    arguments = parser.parse_args()
    if arguments.port == 0:
        parser.error("the workers share one port: give it (port 0 would give each worker a port of its own)")
    if arguments.redis:
        os.environ["AIOSEM_REDIS_URL"] = arguments.redis
    if arguments.workers > 1 and not os.environ.get("AIOSEM_REDIS_URL"):
        parser.error("several workers share a limit through Redis only: give --redis URL or set AIOSEM_REDIS_URL")
    if arguments.workers == 1:
        # In this process: aiosem would take a worker process for one of several, and insist on Redis.
        serve(arguments.host, arguments.port)
        return None
    # Spawned, not forked: each worker starts its own event loop from scratch.
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=serve, args=(arguments.host, arguments.port)) for _ in range(arguments.workers)]
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    error = None
    try:
        for worker in workers:
            worker.start()
        print(f"serving http://{arguments.host}:{arguments.port} from {len(workers)} workers", flush=True)
        multiprocessing.connection.wait([worker.sentinel for worker in workers])
        ended = next(worker for worker in workers if not worker.is_alive())
        error = f"worker {ended.pid} ended by itself, with exit code {ended.exitcode}"
    except Stop as reason:
        print(f"stopping on {reason}", flush=True)
    finally:
        # Stopping is bounded below; a second Ctrl-C would only leave workers behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for worker in workers:
            if worker.is_alive():
                worker.terminate()  # SIGTERM: aiohttp finishes the requests under way, then exits
        deadline = time.monotonic() + STOP_TIMEOUT
        for worker in workers:
            if worker.pid is None:
                continue  # never started
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join()
    return error


if __name__ == "__main__":
    sys.exit(main())
