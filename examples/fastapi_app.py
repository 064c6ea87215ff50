"""A FastAPI app served by several uvicorn workers that share one limit: 3 requests at a time.

``GET /work`` does 0.1 s of simulated work under a permit of the semaphore
``"api"`` (limit 3), and answers the worker's pid, the permit's fencing
token and the time the work started and ended. A request that gets no
permit within 1 s is answered ``503`` with ``Retry-After: 1``. ``GET /pid``
is not limited. Every response names the worker that answered in an
``X-Worker-Pid`` header. Run it from any directory::

    python examples/fastapi_app.py --redis redis://localhost:6379/0   # 2 workers on 127.0.0.1:8000
    AIOSEM_REDIS_URL=redis://localhost:6379/0 python examples/fastapi_app.py --workers 4 --port 8080

    curl -i http://127.0.0.1:8000/work

The limit holds across the workers because they all use the same Redis:
``--redis`` is put in ``AIOSEM_REDIS_URL``, which uvicorn's worker
processes inherit. ``memory://`` would not do -- each worker would have a
store, and a limit, of its own -- so with several workers and no Redis,
aiosem refuses to guess: the script stops at once (and a worker would fail
its requests with a `RuntimeError` saying so). A single worker runs
without Redis, on ``memory://`` (aiosem's ``memory`` extra).

Fire 200 requests at once and at most 3 run at any moment, over both
workers: about 30 are served in the first second, 3 every 0.1 s, and the
others are answered 503 once they have waited 1 s. Stop with Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import Depends, FastAPI, Request, Response

import aiosem
from aiosem.contrib.fastapi import limit

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

#: How many requests may do their work at once, over all the workers.
LIMIT = 3
#: The simulated work, in seconds.
WORK = 0.1
#: How long a request waits for a permit before its 503, in seconds.
BLOCKING_TIMEOUT = 1.0


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await aiosem.aclose()


app = FastAPI(lifespan=lifespan)


@app.middleware("http")
async def worker_pid(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Tell on every response, 503s included, which worker answered."""
    response = await call_next(request)
    response.headers["X-Worker-Pid"] = str(os.getpid())
    return response


@app.get("/work")
async def work(
    permit: aiosem.Permit = Depends(limit("api", LIMIT, blocking_timeout=BLOCKING_TIMEOUT, retry_after=1)),  # noqa: B008 -- FastAPI's way
) -> dict[str, int | float]:
    started = time.time()
    await asyncio.sleep(WORK)
    return {"pid": os.getpid(), "fencing_token": permit.fencing_token, "started": started, "ended": time.time()}


@app.get("/pid")
async def pid() -> dict[str, int]:
    return {"pid": os.getpid()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--redis", metavar="URL", help="the Redis every worker uses (default: $AIOSEM_REDIS_URL)")
    arguments = parser.parse_args()
    if arguments.redis:
        os.environ["AIOSEM_REDIS_URL"] = arguments.redis
    if arguments.workers > 1 and not os.environ.get("AIOSEM_REDIS_URL"):
        parser.error("several workers share a limit through Redis only: give --redis URL or set AIOSEM_REDIS_URL")
    # The workers import the app by name, from this file's directory, wherever the script runs from.
    uvicorn.run(
        f"{Path(__file__).stem}:app",
        app_dir=str(Path(__file__).parent),
        host=arguments.host,
        port=arguments.port,
        workers=arguments.workers,
    )


if __name__ == "__main__":
    main()
