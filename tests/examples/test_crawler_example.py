"""examples/crawler.py, run as a user runs it, against local sites that log every request.

Each check reads the sites' own access logs -- what a host really saw --
not what the crawler says it did. One crawl (and, for the slow tests, two
crawlers at once on one Redis) serves every test of the module that only
reads its logs. The recipe of the docs -- ``crawler.py serve``, and
crawlers of other processes on the sites it serves -- is checked by what
that process says its sites saw.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import aiosem
from tests.harness.sites import Site, SiteSpec, Visit, serve

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    import redis.asyncio

    from tests.harness.support import RedisServer

pytestmark = pytest.mark.apps

CRAWLER = Path(__file__).parents[2] / "examples" / "crawler.py"
PER_HOST = 2
#: How much closer together than its delay two requests may reach a host.
#: Slots are granted on Redis's clock, exactly a delay apart, but each
#: request then takes its own time to be seen by the site: the crawler's
#: wake-up, the trip, the site's thread. One request late by that much
#: brings the next one closer. On an idle machine the closest two starts
#: were 1 to 4 ms under the delay, with two busy loops on the two cores
#: 19 ms, and once, with other test suites running, 90 ms. With a load
#: average of 11 to 12 on the 2 cores, the crawlers' sleeps woke up to
#: 0.21 s late, gaps came up to 0.13 s short, and once two requests to a
#: 0.3 s host together: this margin does not cover that. The span of all
#: the starts, checked too, is not shortened by one late request.
TOLERANCE = 0.1
#: The longest a crawler may run.
CRAWL_TIMEOUT = 60
#: The crawl delay the crawler assumes before it has read a host's robots.txt (its FIRST_DELAY).
FIRST_DELAY = 1.0

DELAYED = SiteSpec("User-agent: *\nCrawl-delay: 0.2\n", pages=12)
RATED = SiteSpec("User-agent: otherbot\nDisallow: /\n\nUser-agent: *\nRequest-rate: 5/1s\n", pages=12)
OPEN = SiteSpec("User-agent: *\nDisallow: /private\n", pages=16, private=True)
#: Linked from every page of the others, but never a seed: never to be visited.
ELSEWHERE = SiteSpec(404, pages=4)
#: RFC 9309: a robots.txt that is unavailable (4xx) allows everything, one unreachable (5xx) nothing.
MISSING = SiteSpec(404, pages=6)
FAILING = SiteSpec(503, pages=6)
#: Asks for the delay the crawler assumes before it knows: every request to it, robots.txt too, is that far apart.
SLOW = SiteSpec("User-agent: *\nCrawl-delay: 1\n", pages=2)
#: Its robots.txt redirects to another path of the same host.
MOVED = SiteSpec("User-agent: *\nCrawl-delay: 0.2\n", pages=2, robots_moved_to="/new-robots.txt")
#: The seconds between two requests each site's robots.txt asks for.
SPACING = {DELAYED: 0.2, RATED: 0.2, SLOW: 1.0}


@dataclass(frozen=True)
class Crawl:
    """Sites, and what the crawlers said of their crawl (``--json``)."""

    delayed: Site
    rated: Site
    open: Site
    elsewhere: Site
    summaries: list[dict[str, Any]]

    @property
    def seeds(self) -> list[Site]:
        return [self.delayed, self.rated, self.open]


def command(redis_url: str, *arguments: str) -> list[str]:
    return [sys.executable, str(CRAWLER), "--url", redis_url, "--quiet", *arguments]


def run_together(commands: list[list[str]], env: dict[str, str] | None = None) -> list[str]:
    """Run the commands at once; their outputs, once all of them succeeded."""
    processes = [
        subprocess.Popen(arguments, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for arguments in commands
    ]
    try:
        outputs = [process.communicate(timeout=CRAWL_TIMEOUT) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    for process, (_, errors) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, errors
    return [output for output, _ in outputs]


def crawl_together(redis_url: str, agents: Iterable[str]) -> Iterator[Crawl]:
    with serve(DELAYED, RATED, OPEN, ELSEWHERE) as (delayed, rated, open_, elsewhere):
        seeds = [delayed.url, rated.url, open_.url]
        commands = [command(redis_url, "--json", "--user-agent", agent, *seeds) for agent in agents]
        summaries = [json.loads(output) for output in run_together(commands)]
        yield Crawl(delayed, rated, open_, elsewhere, summaries)


@pytest.fixture(scope="module")
def one_crawler(redis_server: RedisServer) -> Iterator[Crawl]:
    yield from crawl_together(redis_server.url, ["crawler-one"])


@pytest.fixture(scope="module")
def missing_and_failing(redis_server: RedisServer) -> Iterator[tuple[Site, Site, dict[str, Any]]]:
    with serve(MISSING, FAILING) as (missing, failing):
        [output] = run_together([command(redis_server.url, "--json", missing.url, failing.url)])
        yield missing, failing, json.loads(output)


@pytest.fixture(scope="module")
def two_crawlers(redis_server: RedisServer) -> Iterator[Crawl]:
    yield from crawl_together(redis_server.url, ["crawler-one", "crawler-two"])


def requests(site: Site) -> list[Visit]:
    """Every request the site saw, robots.txt included, in the order they started."""
    return sorted(site.visits(), key=lambda visit: visit.start)


def pages(site: Site, agent: str | None = None) -> list[Visit]:
    """The site's page requests (robots.txt aside), by ``agent`` or anyone, in the order they started."""
    visits = [visit for visit in site.visits() if visit.path != "/robots.txt" and agent in (None, visit.agent)]
    return sorted(visits, key=lambda visit: visit.start)


def most_at_once(visits: list[Visit]) -> int:
    """The most requests a site was serving at one moment."""
    # An end sorts before a start at the same moment: those two did not overlap.
    events = sorted([(visit.start, 1) for visit in visits] + [(visit.end, -1) for visit in visits])
    return max(itertools.accumulate(change for _, change in events), default=0)


def closest_starts(visits: list[Visit]) -> tuple[float, Visit, Visit]:
    """The shortest time between two requests' starts, and those two."""
    earlier, later = min(itertools.pairwise(visits), key=lambda pair: pair[1].start - pair[0].start)
    return later.start - earlier.start, earlier, later


def assert_spaced(site: Site, visits: list[Visit]) -> None:
    """The requests started as far apart as the site's robots.txt asks, two by two and all together."""
    spacing = SPACING[site.spec]
    gap, earlier, later = closest_starts(visits)
    assert gap >= spacing - TOLERANCE, (site, earlier, later)
    assert visits[-1].start - visits[0].start >= (len(visits) - 1) * spacing - TOLERANCE, site


# --- one crawler ---------------------------------------------------------------------------------


def test_every_allowed_page_of_a_seeds_host_is_fetched_once(one_crawler: Crawl) -> None:
    for site in one_crawler.seeds:
        fetched = Counter(visit.path for visit in pages(site))
        assert fetched == dict.fromkeys(site.page_paths, 1), site


def test_robots_txt_is_fetched_once_per_host(one_crawler: Crawl) -> None:
    for site in one_crawler.seeds:
        assert [visit.path for visit in site.visits()].count("/robots.txt") == 1, site


def test_a_disallowed_path_is_never_requested(one_crawler: Crawl) -> None:
    assert not [visit.path for visit in one_crawler.open.visits() if visit.path.startswith("/private")]
    [summary] = one_crawler.summaries
    assert summary["hosts"][one_crawler.open.host]["refused"] == len(one_crawler.open.private_paths)


def test_a_host_that_is_no_seeds_is_never_visited(one_crawler: Crawl) -> None:
    assert one_crawler.elsewhere.visits() == []
    [summary] = one_crawler.summaries
    assert one_crawler.elsewhere.host not in summary["hosts"]


def test_crawl_delay_and_request_rate_are_read_in_fractions_and_units(one_crawler: Crawl) -> None:
    [summary] = one_crawler.summaries
    hosts = summary["hosts"]
    assert hosts[one_crawler.delayed.host]["rate"] == {"requests": 1, "seconds": 0.2}
    assert hosts[one_crawler.rated.host]["rate"] == {"requests": 5, "seconds": 1.0}
    assert hosts[one_crawler.open.host]["rate"] is None


def test_requests_to_a_host_start_no_closer_together_than_its_robots_txt_asks(one_crawler: Crawl) -> None:
    for site in (one_crawler.delayed, one_crawler.rated):
        assert_spaced(site, requests(site))


def test_the_request_after_robots_txt_waits_the_first_delay_though_the_host_asks_less(one_crawler: Crawl) -> None:
    for site in (one_crawler.delayed, one_crawler.rated):
        robots, first_page, *_ = requests(site)
        assert robots.path == "/robots.txt"
        assert first_page.start - robots.start >= FIRST_DELAY - TOLERANCE, site


def test_a_host_serves_at_most_per_host_requests_at_once_and_as_many_without_a_delay(one_crawler: Crawl) -> None:
    for site in one_crawler.seeds:
        assert most_at_once(site.visits()) <= PER_HOST, site
    assert most_at_once(one_crawler.open.visits()) == PER_HOST


def test_a_host_whose_robots_txt_is_missing_is_crawled_whole(
    missing_and_failing: tuple[Site, Site, dict[str, Any]],
) -> None:
    missing, _, summary = missing_and_failing
    assert Counter(visit.path for visit in pages(missing)) == dict.fromkeys(missing.page_paths, 1)
    assert summary["hosts"][missing.host]["robots_status"] == 404


def test_a_host_whose_robots_txt_fails_is_not_crawled_at_all(
    missing_and_failing: tuple[Site, Site, dict[str, Any]],
) -> None:
    _, failing, summary = missing_and_failing
    assert [visit.path for visit in failing.visits()] == ["/robots.txt"]
    assert summary["hosts"][failing.host] == {
        "robots_status": 503,
        "rate": None,
        "pages": 0,
        "refused": 1,
        "errors": 0,
    }


def test_a_redirect_of_robots_txt_is_followed_as_a_request_of_its_own_through_the_limits(
    redis_server: RedisServer,
) -> None:
    with serve(MOVED) as (site,):
        [output] = run_together([command(redis_server.url, "--json", site.url)])
    first, second, *_ = requests(site)
    assert (first.path, second.path) == ("/robots.txt", "/new-robots.txt")
    assert second.start - first.start >= FIRST_DELAY - TOLERANCE
    assert json.loads(output)["hosts"][site.host]["rate"] == {"requests": 1, "seconds": 0.2}


def test_the_per_host_option_sets_the_limit(redis_server: RedisServer) -> None:
    with serve(OPEN) as (site,):
        run_together([command(redis_server.url, "--per-host", "3", site.url)])
        assert most_at_once(site.visits()) == 3


def test_max_pages_bounds_the_pages_fetched_but_not_the_refusals(redis_server: RedisServer) -> None:
    with serve(OPEN) as (site,):
        [output] = run_together([command(redis_server.url, "--max-pages", "5", "--json", site.url)])
        assert len(pages(site)) == 5
        assert json.loads(output)["pages"] == 5


def test_the_last_line_sums_the_crawl_up(redis_server: RedisServer) -> None:
    with serve(OPEN) as (site,):
        [output] = run_together([command(redis_server.url, site.url)])
    last = output.splitlines()[-1]
    assert re.fullmatch(r"crawled 16 pages from 1 host in \d+\.\d s; 16 refused by robots\.txt, 0 errors", last)


async def test_a_crawler_whose_per_host_differs_from_the_others_exits_with_one_line(
    redis_server: RedisServer, real_client: redis.asyncio.Redis, unconfigured: None
) -> None:
    with serve(OPEN) as (site,):
        name = f"crawler:{site.host}"
        # Another crawler's permit, held by the test: the semaphore is in use with limit 2.
        async with aiosem.limiter(name, PER_HOST, client=real_client):
            crawler = await asyncio.create_subprocess_exec(
                *command(redis_server.url, "--per-host", "3", site.url),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            with anyio.fail_after(CRAWL_TIMEOUT):
                _, errors = await crawler.communicate()
        assert site.visits() == []
    assert crawler.returncode == 1
    [line] = errors.decode().splitlines()
    assert re.fullmatch(
        rf"crawler: semaphore '{re.escape(name)}' is in use with limit 2; this client asked for 3 \(.*--per-host\)",
        line,
    )


def test_ctrl_c_ends_a_crawl_quietly_with_status_130(redis_server: RedisServer) -> None:
    with serve(SLOW) as (site,):
        crawler = subprocess.Popen(command(redis_server.url, site.url), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            # robots.txt read: the crawler now waits a second for its first page's slot.
            assert site.wait_for_visits(1, timeout=CRAWL_TIMEOUT)
            crawler.send_signal(signal.SIGINT)
            output, errors = crawler.communicate(timeout=CRAWL_TIMEOUT)
        finally:
            if crawler.poll() is None:
                crawler.kill()
                crawler.communicate()
    assert crawler.returncode == 130
    assert (output, errors) == (b"", b"")


def test_without_seeds_it_crawls_demo_sites_of_its_own_in_memory() -> None:
    env = {name: value for name, value in os.environ.items() if name != "AIOSEM_REDIS_URL"}
    [output] = run_together([[sys.executable, str(CRAWLER), "--quiet", "--json"]], env=env)
    summary = json.loads(output)
    assert (summary["pages"], summary["refused"], summary["errors"]) == (30, 10, 0)
    # The last demo site asks for no delay.
    most = [saw["most_at_once"] for saw in summary["demo_sites_saw"].values()]
    assert max(most) == most[-1] == PER_HOST


# --- two crawlers, one Redis -------------------------------------------------------------------------


@pytest.mark.slow
def test_two_crawlers_together_send_a_host_at_most_per_host_requests_at_once(two_crawlers: Crawl) -> None:
    for site in two_crawlers.seeds:
        assert most_at_once(site.visits()) <= PER_HOST, site
    assert most_at_once(two_crawlers.open.visits()) == PER_HOST


@pytest.mark.slow
def test_two_crawlers_together_keep_each_hosts_spacing(two_crawlers: Crawl) -> None:
    for site in (two_crawlers.delayed, two_crawlers.rated):
        visits = requests(site)
        assert {visit.agent for visit in visits} == {"crawler-one", "crawler-two"}
        assert_spaced(site, visits)


@pytest.mark.slow
def test_each_of_two_crawlers_reads_robots_txt_once_per_host_and_fetches_every_page(two_crawlers: Crawl) -> None:
    for site in two_crawlers.seeds:
        robots = Counter(visit.agent for visit in site.visits() if visit.path == "/robots.txt")
        assert robots == {"crawler-one": 1, "crawler-two": 1}, site
        for agent in ("crawler-one", "crawler-two"):
            assert Counter(visit.path for visit in pages(site, agent)) == dict.fromkeys(site.page_paths, 1)
    assert two_crawlers.elsewhere.visits() == []


@pytest.mark.slow
def test_three_crawlers_started_together_space_every_request_to_a_host_robots_txt_included(
    redis_server: RedisServer,
) -> None:
    with serve(SLOW) as (site,):
        run_together([command(redis_server.url, site.url) for _ in range(3)])
    visits = requests(site)
    assert Counter(visit.path for visit in visits) == {"/robots.txt": 3, "/": 3, "/page/1": 3}
    assert_spaced(site, visits)


# --- crawler.py serve, and crawlers of other processes ---------------------------------------------------------


def first_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The first line the process prints, within ``timeout``."""
    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], timeout)
    assert readable, f"nothing printed within {timeout} s"
    return process.stdout.readline()


@pytest.mark.slow
def test_crawlers_on_the_served_demo_sites_send_a_host_at_most_per_host_requests_at_once_together(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    with (tmp_path / "stderr").open("w+") as errors:
        server = subprocess.Popen(
            [sys.executable, str(CRAWLER), "serve", "--json"], stdout=subprocess.PIPE, stderr=errors, text=True
        )
        try:
            urls = json.loads(first_line(server, timeout=CRAWL_TIMEOUT))["sites"]
            run_together([command(redis_server.url, *urls) for _ in range(3)])
            server.send_signal(signal.SIGINT)
            output, _ = server.communicate(timeout=CRAWL_TIMEOUT)
        finally:
            if server.poll() is None:
                server.kill()
                server.communicate()
        errors.seek(0)
        assert errors.read() == ""
    assert server.returncode == 0
    saw = list(json.loads(output).values())
    assert [site["robots_txt_requests"] for site in saw] == [3, 3, 3]
    assert [site["most_at_once"] <= PER_HOST for site in saw] == [True, True, True], saw
    # The last demo site asks for no delay: the three crawlers together reach the limit there.
    assert saw[-1]["most_at_once"] == PER_HOST
