"""A polite web crawler: it obeys robots.txt, and its per-host limits hold across processes.

For each host it visits, the crawler first fetches ``/robots.txt`` and obeys
it: a disallowed path is never fetched, and a ``Crawl-delay`` or
``Request-rate`` spaces the starts of the requests to that host. It also
sends a host at most ``--per-host`` requests at once (default 2; robots.txt
has no directive for that). It follows links to the seeds' hosts only, never
fetches a URL twice, and stops after ``--max-pages`` pages.

Both limits live in Redis, one semaphore and one rate limiter per host and
port, both named ``crawler:HOST:PORT``, and every request to a host goes
through both, robots.txt included: several crawler processes, on one
machine or many, given the same ``--url`` share them, so that together
they never send a host more than ``--per-host`` requests at once, nor start
two closer together than its robots.txt asks. (Each process keeps its own
set of URLs seen: two given the same seeds each fetch every page.)

**The first request.** Each process reads a host's robots.txt once, itself,
before anything else there. Until then the host's delay is unknown, so
that request is spaced as if the host asked ``Crawl-delay: 1``
(`FIRST_DELAY`): the next request to the host, from any process, starts at
least a second after it. A host that asks for more than a second is given
its delay after every other request, but only a second after each
process's read of its robots.txt.

    python examples/crawler.py                 # three demo sites of its own, memory://
    python examples/crawler.py --url redis://localhost:6379/0 --per-host 2 https://example.com/

Without seeds it starts three small demo sites on loopback ports, each with
its own robots.txt (a crawl delay, a request rate, a disallowed path),
crawls them, and prints what each site saw. (A site sees a request a
little after its slot came, by the time it took to get there, so it may
see two a few milliseconds closer together than the delay.)

**Several crawlers on the same demo sites.** ``crawler.py serve`` serves
the demo sites alone, on ``--port`` and the next two (default: free
ports, printed), until Ctrl-C; then it prints what each site saw. Give
their URLs as seeds to crawlers in other terminals, all with one Redis:

    python examples/crawler.py serve --port 8000        # terminal 1: the sites, until Ctrl-C
    export AIOSEM_REDIS_URL=redis://localhost:6379/0    # terminals 2, 3 and 4, then in each at once:
    python examples/crawler.py http://127.0.0.1:8000/ http://127.0.0.1:8001/ http://127.0.0.1:8002/

Once the three crawlers are done, Ctrl-C in terminal 1 prints (a real run;
each site saw every page three times, robots.txt once per crawler)::

    the demo site 127.0.0.1:8000 (Crawl-delay: 0.3) saw 33 requests (3 for robots.txt), at most 1 at once, ...
    the demo site 127.0.0.1:8001 (Request-rate: 4/1s) saw 33 requests (3 for robots.txt), at most 1 at once, ...
    the demo site 127.0.0.1:8002 (Disallow: /private) saw 33 requests (3 for robots.txt), at most 2 at once, ...

Redis is ``--url`` (or ``--redis``), else ``$AIOSEM_REDIS_URL``, else
``memory://`` (aiosem's ``memory`` extra), which limits this one
process only. A progress bar is drawn on stderr when it is a terminal,
unless ``--quiet``; the summary goes to stdout, ending with one line
``crawled N pages from H hosts in S s; R refused by robots.txt, E
errors``, or as JSON with ``--json``.

Crawlers sharing a Redis must agree on ``--per-host``: a semaphore in use
refuses another limit with `aiosem.LimitMismatch`, and the crawler that
asked for it stops with one line on stderr and exit status 1, as it does
when Redis fails. Ctrl-C stops a crawl with status 130.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import sys
import time
from collections import deque
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urldefrag, urljoin, urlsplit, urlunsplit
from urllib.robotparser import RobotFileParser

import aiohttp
import anyio
import redis
from aiohttp import web
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

import aiosem

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence

    from anyio.abc import TaskGroup

PER_HOST = 2
MAX_PAGES = 200
USER_AGENT = "aiosem-crawler"
#: The most of a response read; RFC 9309 asks crawlers to parse at least 500 KiB of a robots.txt.
MAX_BYTES = 512 * 1024
#: The crawl delay assumed for the request that reads a host's robots.txt, before the host's own is known.
FIRST_DELAY = 1.0
#: The redirects of a robots.txt followed; RFC 9309 asks for at least five.
ROBOTS_REDIRECTS = 5
DEFAULT_PORTS = {"http": 80, "https": 443}
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600}
_CRAWL_DELAY = re.compile(r"\s*crawl-delay\s*:\s*(\d*\.?\d+)\s*(#.*)?", re.IGNORECASE)
_REQUEST_RATE = re.compile(r"\s*request-rate\s*:\s*(\d+)\s*/\s*(\d*\.?\d+)\s*([smh]?)\b.*", re.IGNORECASE)


# --- URLs -----------------------------------------------------------------------------


def host_of(url: str) -> str:
    """A URL's host and port (``example.com:443``): what the limits are per."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{host}:{parts.port or DEFAULT_PORTS[parts.scheme]}"


def limit_name(url: str) -> str:
    """The name of the semaphore and of the rate limiter of a URL's host."""
    return f"crawler:{host_of(url)}"


def normalize(url: str, base: str = "") -> str | None:
    """``url``, relative to ``base``, without its fragment or default port; ``None`` unless it is http(s)."""
    try:
        parts = urlsplit(urldefrag(urljoin(base, url)).url)
        port = parts.port
    except ValueError:  # a malformed IPv6 address or port
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port in (None, DEFAULT_PORTS[parts.scheme]) else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [value for name, value in attrs if name == "href" and value]


# --- robots.txt ---------------------------------------------------------------------------


class Rate(NamedTuple):
    """At most ``requests`` requests to a host per ``seconds`` seconds, evenly spaced."""

    requests: int
    seconds: float

    def __str__(self) -> str:
        return f"{self.requests} request{'s' * (self.requests != 1)} per {self.seconds:g} s"


def in_milliseconds(line: str) -> str:
    """A robots.txt line, with the times of ``Crawl-delay`` and ``Request-rate`` in whole milliseconds.

    `RobotFileParser` takes whole seconds only: it would drop
    ``Crawl-delay: 0.5`` and ``Request-rate: 1/5s`` (the units of the
    original proposal). Written in milliseconds they survive, and it still
    picks the group of rules that applies to our user agent.
    """
    if match := _CRAWL_DELAY.fullmatch(line):
        return f"Crawl-delay: {round(float(match[1]) * 1000)}"
    if match := _REQUEST_RATE.fullmatch(line):
        return f"Request-rate: {match[1]}/{round(float(match[2]) * _SECONDS[match[3].lower()] * 1000)}"
    return line


def parse_robots(lines: Iterable[str], agent: str) -> tuple[RobotFileParser, Rate | None]:
    """The rules of a robots.txt, and the rate it asks of ``agent``: the slower, if it gives two."""
    parser = RobotFileParser()
    parser.parse([in_milliseconds(line) for line in lines])
    rates = []
    delay = parser.crawl_delay(agent)
    if delay is not None and float(delay) > 0:
        rates.append(Rate(1, float(delay) / 1000))
    rate = parser.request_rate(agent)
    if rate is not None and rate.requests > 0 and rate.seconds > 0:
        rates.append(Rate(rate.requests, rate.seconds / 1000))
    return parser, max(rates, key=lambda rate: rate.seconds / rate.requests, default=None)


# --- the crawler ------------------------------------------------------------------------


@dataclass
class Host:
    """What the crawler learnt and did on one host."""

    #: The status of its robots.txt; ``None``: no answer (nothing may be fetched).
    robots_status: int | None = None
    rate: Rate | None = None
    pages: int = 0
    refused: int = 0
    errors: int = 0


@dataclass
class Robots:
    """A host's robots.txt, read: its rules, and the wait for each page's slot."""

    parser: RobotFileParser
    slot: AbstractAsyncContextManager[None] = field(default_factory=nullcontext)


class Response(NamedTuple):
    status: int
    content_type: str
    text: str
    #: Where a redirect points: followed as a link, through the limits of its own host.
    location: str | None

    def links(self, url: str) -> list[str]:
        hrefs = [] if self.location is None else [self.location]
        if self.content_type == "text/html":
            parser = _Links()
            parser.feed(self.text)
            hrefs += parser.hrefs
        return [link for href in hrefs if (link := normalize(href, url)) is not None]


class Crawler:
    """Crawls the seeds' hosts from the seeds, politely; `run` it once."""

    def __init__(
        self, session: aiohttp.ClientSession, *, agent: str, per_host: int, max_pages: int, progress: Progress
    ) -> None:
        self._session = session
        self._agent = agent
        self._max_pages = max_pages
        #: How many more pages may be fetched, less those being fetched.
        self._budget = max_pages
        self._seen: set[str] = set()
        self._frontier: deque[str] = deque()
        self._seed_hosts: set[str] = set()
        self._robots: dict[str, Robots] = {}
        self._reading: dict[str, asyncio.Lock] = {}
        self.hosts: dict[str, Host] = {}
        #: An error of the limits themselves, which ended the crawl.
        self._failure: aiosem.SemaphoreError | redis.RedisError | None = None
        self._progress = progress
        self._rows: dict[str, TaskID] = {}
        self._total = progress.add_task("all hosts", total=None, note="")
        # Decorated here, not where defined: --per-host is known only now.
        # robots.txt and pages take the same permits: --per-host bounds every request.
        per_host_limit = aiosem.limit_concurrency(limit_name, per_host)
        self._fetch_robots = per_host_limit(self._get_robots)
        self._fetch_page = per_host_limit(self._get_page)

    async def run(self, seeds: Sequence[str]) -> None:
        """Crawl until no URL is left or the budget is spent.

        Raises:
            aiosem.SemaphoreError: Such as `aiosem.LimitMismatch`: another
                process uses a host's semaphore with another ``per_host``.
            redis.RedisError: Redis failed or could not be reached.
        """
        self._seed_hosts = {host_of(seed) for seed in seeds}
        async with anyio.create_task_group() as group:
            for seed in seeds:
                self._discover(seed)
            self._start(group)
        if self._failure is not None:
            # Raised alone: out of the task group, it would have come
            # wrapped in an ExceptionGroup, with one copy per task it hit.
            raise self._failure
        for name, row in self._rows.items():
            self._progress.update(row, total=self.hosts[name].pages)

    def _discover(self, url: str) -> None:
        if url not in self._seen and host_of(url) in self._seed_hosts:
            self._seen.add(url)
            self._frontier.append(url)

    def _start(self, group: TaskGroup) -> None:
        """Visit the frontier's URLs, as many as the budget allows; a task each, waiting in the limits."""
        while self._frontier and self._budget > 0 and not group.cancel_scope.cancel_called:
            self._budget -= 1
            group.start_soon(self._visit, self._frontier.popleft(), group)

    async def _visit(self, url: str, group: TaskGroup) -> None:
        host = self._host(url)
        try:
            robots = await self._robots_of(url)
            if not robots.parser.can_fetch(self._agent, url):
                host.refused += 1
                self._budget += 1  # nothing fetched
                return
            try:
                response = await self._fetch_page(url)
            except (aiohttp.ClientError, TimeoutError):
                host.errors += 1
                return
            host.pages += 1
            for link in response.links(url):
                self._discover(link)
        except (aiosem.SemaphoreError, redis.RedisError) as error:
            # Not this page's fault but the limits': no request may go out
            # unlimited, so the whole crawl ends, and `run` raises the first.
            self._failure = self._failure or error
            group.cancel_scope.cancel()
        finally:
            self._start(group)
            self._show(host_of(url))

    def _host(self, url: str) -> Host:
        name = host_of(url)
        if name not in self.hosts:
            self.hosts[name] = Host()
            self._rows[name] = self._progress.add_task(name, total=None, note="")
        return self.hosts[name]

    def _show(self, name: str) -> None:
        host = self.hosts[name]
        delay = "reading robots.txt" if name not in self._robots else str(host.rate or "no delay asked")
        self._progress.update(self._rows[name], completed=host.pages, note=f"{host.refused} refused; {delay}")
        done = sum(host.pages + host.errors for host in self.hosts.values())
        refused = sum(host.refused for host in self.hosts.values())
        total = min(self._max_pages, len(self._seen) - refused)
        self._progress.update(self._total, completed=done, total=total, note=f"{refused} refused")

    async def _robots_of(self, url: str) -> Robots:
        """The robots.txt of the URL's host: read once, by the first of its URLs to ask."""
        name = host_of(url)
        async with self._reading.setdefault(name, asyncio.Lock()):
            if name not in self._robots:
                self._robots[name] = await self._read_robots(url)
        return self._robots[name]

    async def _read_robots(self, url: str) -> Robots:
        parts = urlsplit(url)
        location: str | None = urlunsplit((parts.scheme, parts.netloc, "/robots.txt", "", ""))
        response = None
        try:
            # Redirects followed here, not by aiohttp: each hop is a request
            # to its own host, which goes through that host's limits.
            for _ in range(ROBOTS_REDIRECTS):
                if location is None:
                    break
                response = await self._fetch_robots(location)
                location = None if response.location is None else normalize(response.location, location)
        except (aiohttp.ClientError, TimeoutError):
            response = None
        # RFC 9309: a robots.txt that is unavailable (4xx, or still a
        # redirect after so many) allows everything; one that is unreachable
        # (5xx, no answer) allows nothing.
        if response is None or response.status >= 500:  # noqa: PLR2004 -- HTTP's server errors
            lines = ["User-agent: *", "Disallow: /"]
        elif response.status >= 300:  # noqa: PLR2004 -- HTTP's redirects and client errors
            lines = []
        else:
            lines = response.text.splitlines()
        parser, rate = parse_robots(lines, self._agent)
        host = self.hosts[host_of(url)]
        host.robots_status = None if response is None else response.status
        host.rate = rate
        if rate is None:
            return Robots(parser)
        # The host's own rate, under its own name. Not @limit_rate: it has
        # one rate for every name its function gives. All processes read the
        # same robots.txt, so all of them ask one rate of each name.
        return Robots(parser, aiosem.rate_limiter(limit_name(url), rate.requests, per=rate.seconds))

    async def _get_robots(self, url: str) -> Response:
        # The host's rate is what this very request is about to tell: until
        # then, FIRST_DELAY. GCRA spaces the request after each slot by that
        # slot's own interval, so the next request to the host, from any
        # process, starts at least FIRST_DELAY after this one.
        async with aiosem.rate_limiter(limit_name(url), 1, per=FIRST_DELAY):
            return await self._get(url)

    async def _get_page(self, url: str) -> Response:
        # The permit first (the decorator), then the slot, then the request.
        # In the other order, slots would pass while their callers wait for
        # permits, and callers whose permits came back together would start
        # together: a burst, where robots.txt asked for spacing. And only
        # permit holders reserve slots, so at most --per-host reservations
        # per host are outstanding, however many URLs wait.
        async with self._robots[host_of(url)].slot:
            return await self._get(url)

    async def _get(self, url: str) -> Response:
        async with self._session.get(url, allow_redirects=False) as response:
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) >= MAX_BYTES:
                    break
            redirect = 300 <= response.status < 400  # noqa: PLR2004 -- HTTP's redirects
            return Response(
                response.status,
                response.content_type,
                decode(bytes(body[:MAX_BYTES]), response.charset),
                response.headers.get("Location") if redirect else None,
            )


def decode(body: bytes, charset: str | None) -> str:
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


# --- demo sites --------------------------------------------------------------------------------------

#: Each demo site's robots.txt, and whether its pages link to /private pages.
DEMO_SITES = (
    ("User-agent: *\nCrawl-delay: 0.3\n", False),
    ("User-agent: *\nRequest-rate: 4/1s\n", False),
    ("User-agent: *\nDisallow: /private\n", True),
)
DEMO_PAGES = 10


class DemoSite:
    """A small site: a robots.txt, pages linked as a tree, and what it saw of its visitors."""

    def __init__(self, robots: str, private: bool) -> None:
        self.robots = robots
        self._private = private
        self.url = ""
        self.others: list[str] = []
        self._running = 0
        #: When each request arrived, robots.txt included; how many were for robots.txt; the most served at once.
        self.starts: list[float] = []
        self.robots_requests = 0
        self.most = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.starts.append(time.monotonic())
        self._running += 1
        self.most = max(self.most, self._running)
        try:
            await asyncio.sleep(random.uniform(0.05, 0.15))  # the work of serving a request
            if request.path == "/robots.txt":
                self.robots_requests += 1
                return web.Response(text=self.robots)
            number = 0 if request.path == "/" else int(request.path.rsplit("/", 1)[-1])
            children = [child for child in (2 * number + 1, 2 * number + 2) if child < DEMO_PAGES]
            links = [f'<a href="/page/{child}">page {child}</a>' for child in children]
            links += [f'<a href="/private/{number}">private</a>'] if self._private else []
            links += [f'<a href="{url}">another site</a>' for url in self.others]
            return web.Response(text="<p>".join(links), content_type="text/html")
        finally:
            self._running -= 1

    def report(self) -> dict[str, Any]:
        gaps = [later - earlier for earlier, later in itertools.pairwise(self.starts)]
        return {
            "robots.txt": self.robots.splitlines()[-1],
            "requests": len(self.starts),
            "robots_txt_requests": self.robots_requests,
            "most_at_once": self.most,
            "closest_starts": min(gaps, default=None),
        }


@asynccontextmanager
async def demo_sites(port: int = 0) -> AsyncIterator[list[DemoSite]]:
    """Three `DemoSite` linking to each other, served in this event loop on ``port`` and the next two (0: any free)."""
    sites = [DemoSite(robots, private) for robots, private in DEMO_SITES]
    async with AsyncExitStack() as stack:
        for number, site in enumerate(sites):
            app = web.Application()
            for path in ("/", "/robots.txt", r"/page/{number:\d+}", r"/private/{number:\d+}"):
                app.router.add_get(path, site.handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            await web.TCPSite(runner, "127.0.0.1", port + number if port else 0).start()
            site.url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
        for site in sites:
            site.others = [other.url for other in sites if other is not site]
        yield sites


def show_sites(saw: dict[str, dict[str, Any]]) -> None:
    for name, site in saw.items():
        closest = "" if site["closest_starts"] is None else f", starting at least {site['closest_starts']:.3f} s apart"
        print(
            f"the demo site {name} ({site['robots.txt']}) saw {site['requests']} requests "
            f"({site['robots_txt_requests']} for robots.txt), at most {site['most_at_once']} at once{closest}"
        )


async def serve(arguments: argparse.Namespace) -> None:
    """Serve the demo sites for crawlers of other processes until Ctrl-C or SIGTERM; then say what each saw."""
    # SIGTERM too, and taken over from the shell: a job started with `&`
    # from a script ignores SIGINT, so `kill %1` must stop it as well.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as stop:
        async with demo_sites(arguments.port) as sites:
            urls = " ".join(site.url for site in sites)
            if arguments.json:
                print(json.dumps({"sites": [site.url for site in sites]}), flush=True)
            else:
                print(f"serving the demo sites {urls} until Ctrl-C; crawl them from several terminals with", flush=True)
                print(f"    python examples/crawler.py --url redis://localhost:6379/0 {urls}", flush=True)
            await anext(aiter(stop))
    saw = {host_of(site.url): site.report() for site in sites}
    if arguments.json:
        print(json.dumps(saw))
    else:
        show_sites(saw)


# --- the command ---------------------------------------------------------------------------------------


def seed_url(value: str) -> str:
    url = normalize(value)
    if url is None:
        raise argparse.ArgumentTypeError(f"not an http:// or https:// URL with a host: {value!r}")
    return url


def positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    arguments = sys.argv[1:] if argv is None else list(argv)
    # A subcommand by hand: argparse would take every seed URL for one.
    if arguments[:1] == ["serve"]:
        serving = argparse.ArgumentParser(
            prog="crawler.py serve", description="Serve the demo sites until Ctrl-C, for crawlers of other processes."
        )
        serving.add_argument("--port", type=positive, default=0, help="the first of three (default: any free)")
        serving.add_argument("--json", action="store_true", help="print the URLs, then what the sites saw, as JSON")
        return serving.parse_args(arguments[1:], argparse.Namespace(command="serve"))
    parser = argparse.ArgumentParser(
        usage="%(prog)s [options] [SEED_URL ...]\n       %(prog)s serve [--port PORT] [--json]",
        description="Crawl the seeds' hosts, obeying robots.txt and per-host limits.",
        epilog="crawler.py serve: serve the demo sites alone, for several crawlers (see crawler.py serve --help)",
    )
    parser.add_argument("seeds", nargs="*", type=seed_url, metavar="SEED_URL", help="default: start demo sites")
    parser.add_argument(
        "--url",
        "--redis",
        default=os.environ.get("AIOSEM_REDIS_URL") or "memory://",
        help="the Redis the limits live in (default: $AIOSEM_REDIS_URL, else memory://, this process only)",
    )
    parser.add_argument(
        "--per-host", type=positive, default=PER_HOST, help=f"requests to a host at once (default {PER_HOST})"
    )
    parser.add_argument(
        "--max-pages", type=positive, default=MAX_PAGES, help=f"pages to fetch at most (default {MAX_PAGES})"
    )
    parser.add_argument(
        "--user-agent", default=USER_AGENT, help=f"sent, and looked up in robots.txt (default {USER_AGENT})"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(arguments, argparse.Namespace(command="crawl"))


async def crawl(arguments: argparse.Namespace) -> dict[str, Any]:
    """Crawl as ``arguments`` say, and return the summary."""
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"))
    async with AsyncExitStack() as stack:
        seeds: list[str] = arguments.seeds
        sites: list[DemoSite] = []
        if not seeds:
            sites = await stack.enter_async_context(demo_sites())
            seeds = [site.url for site in sites]
        session = await stack.enter_async_context(
            aiohttp.ClientSession(headers={"User-Agent": arguments.user_agent}, timeout=aiohttp.ClientTimeout(total=30))
        )
        progress = stack.enter_context(
            Progress(*columns, TimeElapsedColumn(), console=console, disable=arguments.quiet or not console.is_terminal)
        )
        crawler = Crawler(
            session,
            agent=arguments.user_agent,
            per_host=arguments.per_host,
            max_pages=arguments.max_pages,
            progress=progress,
        )
        started = time.monotonic()
        await crawler.run(seeds)
        seconds = time.monotonic() - started
    hosts = crawler.hosts.values()
    summary: dict[str, Any] = {
        "pages": sum(host.pages for host in hosts),
        "refused": sum(host.refused for host in hosts),
        "errors": sum(host.errors for host in hosts),
        "seconds": round(seconds, 3),
        "hosts": {
            name: {
                "robots_status": host.robots_status,
                "rate": None if host.rate is None else host.rate._asdict(),
                "pages": host.pages,
                "refused": host.refused,
                "errors": host.errors,
            }
            for name, host in sorted(crawler.hosts.items())
        },
    }
    if sites:
        summary["demo_sites_saw"] = {host_of(site.url): site.report() for site in sites}
    return summary


def show(summary: dict[str, Any]) -> None:
    for name, host in summary["hosts"].items():
        rate = "no delay asked" if host["rate"] is None else str(Rate(**host["rate"]))
        print(
            f"{name}: {host['pages']} pages, {host['refused']} refused by robots.txt, {host['errors']} errors; "
            f"robots.txt {host['robots_status'] or 'unreachable'}, {rate}"
        )
    show_sites(summary.get("demo_sites_saw", {}))
    print(
        f"crawled {summary['pages']} pages from {len(summary['hosts'])} host{'s' * (len(summary['hosts']) != 1)} "
        f"in {summary['seconds']:.1f} s; "
        f"{summary['refused']} refused by robots.txt, {summary['errors']} errors"
    )


async def main(arguments: argparse.Namespace) -> None:
    if arguments.command == "serve":
        await serve(arguments)
        return
    aiosem.configure(url=arguments.url)
    try:
        summary = await crawl(arguments)
    finally:
        await aiosem.aclose()
    if arguments.json:
        print(json.dumps(summary, indent=2))
    else:
        show(summary)


if __name__ == "__main__":
    try:
        asyncio.run(main(parse_arguments()))
    except KeyboardInterrupt:
        sys.exit(130)  # what a shell reports of a command ended by Ctrl-C (128 + SIGINT), without a traceback
    except aiosem.LimitMismatch as error:
        sys.exit(f"crawler: {error} (every crawler sharing a Redis must give the same --per-host)")
    except (aiosem.SemaphoreError, redis.RedisError) as error:
        sys.exit(f"crawler: {error}")
