"""Small web sites on loopback ports, each keeping its own access log, for the crawler's tests.

`serve` starts them in a thread with an event loop of its own, so that a
test can run crawlers with a blocking ``subprocess.run`` while the sites
answer. Each site serves a robots.txt (or an error status; or a redirect to it), and pages linked as a
binary tree from ``/`` (page *n* links to pages 2n + 1 and 2n + 2, once with
a fragment, so that only a crawler which drops fragments fetches each page
once), back to ``/``, to every other site served with it, and optionally to
a ``/private/n`` page of its own. A page is answered after a short delay,
so that concurrent requests overlap.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from concurrent.futures import Future
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from collections.abc import Iterator

#: How long a site takes to answer a page, at least and at most, in seconds.
ANSWER_TIME = (0.05, 0.1)
#: The longest the sites may take to start or stop.
_START_STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class SiteSpec:
    """What a site serves: ``pages`` linked pages, and ``robots`` at /robots.txt -- or that HTTP status."""

    robots: str | int
    pages: int
    #: Each page links to ``/private/n`` too.
    private: bool = False
    #: /robots.txt redirects here (301), where ``robots`` is served.
    robots_moved_to: str | None = None


@dataclass(frozen=True)
class Visit:
    """One request, as the site saw it; times are ``time.monotonic()`` of the test process."""

    path: str
    agent: str
    start: float
    end: float


class Site:
    """A site being served: its spec, its URL, and what it saw."""

    def __init__(self, spec: SiteSpec, port: int) -> None:
        self.spec = spec
        self.port = port
        self.url = f"http://127.0.0.1:{port}/"
        #: How the crawler names it: host and port.
        self.host = f"127.0.0.1:{port}"
        self.others: list[str] = []
        self._visits: list[Visit] = []
        self._logged = threading.Condition()

    def __repr__(self) -> str:
        return f"Site({self.url!r}, {self.spec!r})"

    @property
    def page_paths(self) -> set[str]:
        """The pages of the site, all reachable from ``/``."""
        return {"/"} | {f"/page/{number}" for number in range(1, self.spec.pages)}

    @property
    def private_paths(self) -> set[str]:
        """The private pages the site's pages link to."""
        return {f"/private/{number}" for number in range(self.spec.pages)} if self.spec.private else set()

    def visits(self) -> list[Visit]:
        """The access log so far, in the order the requests ended."""
        with self._logged:
            return list(self._visits)

    def wait_for_visits(self, count: int, timeout: float) -> bool:
        """Wait until the access log holds ``count`` requests; ``False`` if it still does not after ``timeout``."""
        with self._logged:
            return self._logged.wait_for(lambda: len(self._visits) >= count, timeout)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        try:
            return await self._answer(request.path)
        finally:
            visit = Visit(request.path, request.headers.get("User-Agent", ""), start, time.monotonic())
            with self._logged:
                self._visits.append(visit)
                self._logged.notify_all()

    async def _answer(self, path: str) -> web.StreamResponse:
        await asyncio.sleep(random.uniform(*ANSWER_TIME))
        if path == "/robots.txt" and self.spec.robots_moved_to is not None:
            raise web.HTTPMovedPermanently(self.spec.robots_moved_to)
        if path == (self.spec.robots_moved_to or "/robots.txt"):
            if isinstance(self.spec.robots, int):
                return web.Response(status=self.spec.robots)
            return web.Response(text=self.spec.robots)
        if path in self.private_paths:
            return web.Response(text="secret", content_type="text/html")
        if path not in self.page_paths:
            raise web.HTTPNotFound
        number = 0 if path == "/" else int(path.rsplit("/", 1)[1])
        links = ["/", *self.others]
        for child in (2 * number + 1, 2 * number + 2):
            if child < self.spec.pages:
                links += [f"/page/{child}", f"/page/{child}#top"]
        if self.spec.private:
            links.append(f"/private/{number}")
        body = "".join(f'<p><a href="{link}">{link}</a></p>' for link in links)
        return web.Response(text=f"<html><body>{body}</body></html>", content_type="text/html")


class _Server(threading.Thread):
    """Serves the sites in an event loop of its own until `stop`."""

    def __init__(self, specs: tuple[SiteSpec, ...]) -> None:
        super().__init__(name="test sites")
        self._specs = specs
        self.started: Future[list[Site]] = Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        try:
            async with AsyncExitStack() as stack:
                sites = []
                for spec in self._specs:
                    # Bound first: a site's pages name its port, and the
                    # routes are fixed once the runner is set up.
                    listening = stack.enter_context(socket.socket())
                    listening.bind(("127.0.0.1", 0))
                    site = Site(spec, listening.getsockname()[1])
                    app = web.Application()
                    app.router.add_get("/{path:.*}", site.handle)
                    runner = web.AppRunner(app, access_log=None)
                    await runner.setup()
                    stack.push_async_callback(runner.cleanup)
                    await web.SockSite(runner, listening).start()
                    sites.append(site)
                for site in sites:
                    site.others = [other.url for other in sites if other is not site]
                self.started.set_result(sites)
                await self._stopping.wait()
        except BaseException as error:
            if not self.started.done():
                self.started.set_exception(error)
            raise

    def stop(self) -> None:
        assert self._loop is not None
        assert self._stopping is not None
        self._loop.call_soon_threadsafe(self._stopping.set)
        self.join(_START_STOP_TIMEOUT)
        assert not self.is_alive(), "the test sites did not stop"


@contextmanager
def serve(*specs: SiteSpec) -> Iterator[list[Site]]:
    """Serve a site per spec, each on a loopback port of its own, while the block runs."""
    server = _Server(specs)
    server.start()
    try:
        sites = server.started.result(_START_STOP_TIMEOUT)
    except BaseException:
        server.join(_START_STOP_TIMEOUT)
        raise
    try:
        yield sites
    finally:
        server.stop()
