"""examples/crawler.py, run as a user runs it, against local sites that log every request.

Each check reads the sites' own access logs -- what a host really saw --
not what the crawler says it did. One crawl (and, for the slow tests, two
crawlers at once on one Redis) serves every test of the module that only
reads its logs.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.harness.sites import Site, SiteSpec, Visit, serve

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

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
#: 19 ms, and once, with other test suites running, 90 ms. The span of all
#: the starts, checked too, is not shortened by one late request.
TOLERANCE = 0.1
#: The longest a crawler may run.
CRAWL_TIMEOUT = 60

DELAYED = SiteSpec("User-agent: *\nCrawl-delay: 0.2\n", pages=12)
RATED = SiteSpec("User-agent: otherbot\nDisallow: /\n\nUser-agent: *\nRequest-rate: 5/1s\n", pages=12)
OPEN = SiteSpec("User-agent: *\nDisallow: /private\n", pages=16, private=True)
#: Linked from every page of the others, but never a seed: never to be visited.
ELSEWHERE = SiteSpec(404, pages=4)
#: RFC 9309: a robots.txt that is unavailable (4xx) allows everything, one unreachable (5xx) nothing.
MISSING = SiteSpec(404, pages=6)
FAILING = SiteSpec(503, pages=6)
#: The seconds between two requests each site's robots.txt asks for.
SPACING = {DELAYED: 0.2, RATED: 0.2}


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
    return [sys.executable, str(CRAWLER), "--redis", redis_url, "--quiet", *arguments]


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
    """The page requests started as far apart as the site's robots.txt asks, two by two and all together."""
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
        assert_spaced(site, pages(site))


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
        visits = pages(site)
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
