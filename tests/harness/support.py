"""Test helpers: our own ``redis-server`` processes, and a clock moved by hand.

With ``AIOSEM_TEST_ACL=1`` in the environment, every `RedisServer` also
creates `SUITE_USER` -- aiosem's commands and nothing else -- and its `url`
and `client` authenticate as that user, while `admin_url` and `admin_client`
stay the unrestricted ``default`` user, for the set-up and the poking at
Redis that tests do on purpose. Each command the server refuses the suite
user is kept (`take_denials`), so that a test cannot pass on a refusal that
aiosem swallowed (a subscription refused, an unlock given up).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal
from urllib.parse import quote

import anyio
import redis
import redis.asyncio

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, _connection
from aiosem._fair import ScriptedSteps
from aiosem._locked import WatchedSteps

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    import pytest

    from aiosem._connection import Client
    from aiosem._protocol import Step

Semaphore = AsyncFairSemaphore | AsyncLockedSemaphore

#: How long a server may take to answer its first PING.
_START_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class AclUser:
    """A Redis user: its name, its password and its ACL rules (``ACL SETUSER`` arguments after the name)."""

    name: str
    password: str
    rules: tuple[str, ...]

    def rules_for(self, server: Software) -> tuple[str, ...]:
        """The rules as ``server`` takes them: without `SETINFO` where the command does not exist."""
        if SETINFO in self.rules and not server.has_client_setinfo:
            return tuple(rule for rule in self.rules if rule != SETINFO)
        return self.rules

    def setuser(self, server: Software) -> tuple[str, ...]:
        """The ``ACL SETUSER`` command that makes this user from scratch on ``server``."""
        return ("ACL", "SETUSER", self.name, "reset", "on", f">{self.password}", *self.rules_for(server))

    def directive(self, server: Software) -> tuple[str, ...]:
        """The ``--user`` command-line argument that makes this user as ``server`` starts."""
        return ("--user", self.name, "on", f">{self.password}", *self.rules_for(server))

    def credentials(self) -> str:
        """``user:password@``, as a URL carries them."""
        return f"{quote(self.name, safe='')}:{quote(self.password, safe='')}@"


# The commands of the ACL lines of docs/security.md, found by running aiosem as users without them and
# reading the refusals in the ACL log (tests/deployment/test_security.py runs each line as the page prints it).
# AUTH and HELLO need no rule: every user may run them.

#: Every command one of aiosem's Lua scripts may call: Redis checks those too against the caller's ACL.
SCRIPT_COMMANDS: Final = (
    "+del", "+get", "+hdel", "+hmget", "+hset", "+incr", "+incrby", "+persist", "+pexpire", "+pttl", "+set", "+time",
    "+zadd", "+zcard", "+zintercard", "+zinterstore", "+zmscore", "+zrange", "+zrangebyscore", "+zrem",
    "+zremrangebyscore", "+zscore",
)  # fmt: skip
#: `AsyncFairSemaphore` and `AsyncRateLimiter` (and the decorators of ``kind="fair"``): the scripts (a
#: server that lacks one gets them all by SCRIPT LOAD), pub/sub for wake-ups, MULTI for `holders`.
FAIR_COMMANDS: Final = (
    "+evalsha", "+eval", "+script|load", *SCRIPT_COMMANDS, "+publish", "+subscribe", "+unsubscribe", "+ping",
    "+multi", "+exec",
)  # fmt: skip
#: `AsyncLockedSemaphore` (``kind="locked"``): no Lua, its steps read under WATCH and write in MULTI.
LOCKED_COMMANDS: Final = (
    "+ping", "+subscribe", "+unsubscribe", "+publish", "+multi", "+exec", "+watch", "+unwatch", "+time", "+get",
    "+set", "+del", "+incrby", "+persist", "+pexpire", "+pttl", "+zadd", "+zrem", "+zrange", "+zremrangebyscore",
    "+zcard", "+zmscore", "+hset", "+hdel", "+hmget",
)  # fmt: skip
#: `aiosem.recipes`: the scripts, and a wake-up for an aiosem waiter of a semaphore they share.
RECIPE_COMMANDS: Final = ("+evalsha", "+eval", "+script|load", *SCRIPT_COMMANDS, "+publish")
#: ``python -m aiosem status`` (SCAN, then one MULTI per semaphore) and ``reset`` (ZCARD and DEL too).
CLI_COMMANDS: Final = (
    "+scan", "+multi", "+exec", "+time", "+get", "+pttl", "+exists", "+zrange", "+hgetall", "+zcard", "+del",
)  # fmt: skip
#: What ``python -m aiosem demo`` adds: its workers count who holds a permit, under ``aiosem-demo:``.
DEMO_COMMANDS: Final = ("+incrby", "+decrby")
#: What a Redis Cluster client adds: redis-py learns the slots and the commands' keys, follows ASK,
#: and aiosem wakes waiters by sharded pub/sub.
CLUSTER_COMMANDS: Final = ("+cluster|slots", "+command", "+asking", "+spublish", "+ssubscribe", "+sunsubscribe")
#: What ``replicas=`` adds: WAIT for the replicas after each acquire and refresh.
REPLICA_COMMANDS: Final = ("+wait",)
#: What the suite's own clients add: some name their connections, to find them in CLIENT LIST.
#: aiosem never does; an application that sets ``client_name`` needs it too.
TEST_COMMANDS: Final = ("+client|setname",)
#: Sent by redis-py on every connection, its refusal ignored, to a server that has it (Redis 7.2 and later,
#: Valkey); Redis 7.0 refuses the rule itself, as an unknown command (`AclUser` leaves it out there).
SETINFO: Final = "+client|setinfo"
#: The refusals aiosem expects and takes in its stride: it asks for the eviction policy once per
#: client, and a user may not read the configuration (CONFIG GET would show it ``requirepass`` too).
TOLERATED_DENIALS: Final = frozenset({"config|get"})


def _union(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(command for group in groups for command in group))


#: Everything the suite does through `RedisServer.url` and `RedisServer.client`: every line's commands,
#: with every key and channel, since the tests use many prefixes and names (tests/deployment/test_security.py
#: runs the documented key and channel patterns).
SUITE_RULES: Final = (
    "resetkeys", "~*", "resetchannels", "&*", "-@all",
    *_union(
        FAIR_COMMANDS, LOCKED_COMMANDS, RECIPE_COMMANDS, CLI_COMMANDS, DEMO_COMMANDS, CLUSTER_COMMANDS,
        REPLICA_COMMANDS, TEST_COMMANDS,
    ),
    SETINFO,
)  # fmt: skip

#: Whether the real-server fixtures hand tests `SUITE_USER` (``AIOSEM_TEST_ACL=1``).
ACL_MODE: Final = os.environ.get("AIOSEM_TEST_ACL", "") == "1"
#: The restricted user of the ACL mode: one password for the session, as a cluster's nodes share it.
SUITE_USER: Final = AclUser("aiosem-suite", secrets.token_hex(16), SUITE_RULES)
#: Reads and clears the ACL log for `take_denials`, and does nothing else.
_AUDITOR: Final = AclUser("aiosem-auditor", secrets.token_hex(16), ("-@all", "+acl|log"))


@dataclass(frozen=True, slots=True)
class Software:
    """Which server software a binary or a process is, for the tests whose expectations differ by server.

    Valkey answers ``redis_version:7.2.4`` in INFO whatever its own version, for
    the clients that check it: its version is ``valkey_version``.
    """

    name: Literal["redis", "valkey"]
    version: tuple[int, ...]

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> Software:
        """The server that answered ``info``, INFO's ``server`` section."""
        if info.get("server_name") == "valkey":
            return cls("valkey", _version(str(info["valkey_version"])))
        return cls("redis", _version(str(info["redis_version"])))

    @property
    def has_client_setinfo(self) -> bool:
        """Whether it has ``CLIENT SETINFO``, which redis-py sends on every connection: Redis 7.2 and later, Valkey."""
        return self.name == "valkey" or self.version >= (7, 2)

    @property
    def refuses_reads_in_a_transaction_when_full(self) -> bool:
        """Whether a ``MULTI`` of reads only is refused over ``maxmemory``: Redis before 7.4 queues nothing then.

        redis/redis#12961 (Redis 7.4) let a transaction of commands that need
        no memory run; Valkey has it from 8.0, its first release after the fork.
        """
        return self.version < ((7, 4) if self.name == "redis" else (8,))

    def __str__(self) -> str:
        return f"{self.name.capitalize()} {'.'.join(map(str, self.version))}"


def _version(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@functools.cache
def binary_software(binary: str) -> Software:
    """The server a binary is, as ``--version`` prints it (``Redis server v=7.0.15``, ``Valkey server v=9.1.2``)."""
    printed = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    match = re.match(r"(Redis|Valkey) server v=(\d+(?:\.\d+)*)", printed)
    if match is None:
        raise RuntimeError(f"{binary} --version printed no server and version: {printed!r}")
    return Software("valkey" if match[1] == "Valkey" else "redis", _version(match[2]))


def find_redis_server() -> str | None:
    """The ``redis-server`` binary: ``$AIOSEM_REDIS_SERVER``, else the one on ``PATH``."""
    return os.environ.get("AIOSEM_REDIS_SERVER") or shutil.which("redis-server")


class RedisServer:
    """A ``redis-server`` process of our own on a loopback port.

    Args:
        binary: The ``redis-server`` to run.
        directory: Where it keeps its files and log.
        extra: More command-line arguments.
        user: A user to create at each start, that `url` and `client` then
            authenticate as; by default `SUITE_USER` in the ACL mode, else
            none (`url` and `client` are the unrestricted ``default`` user).
    """

    #: The denials read from servers since `take_denials` was last called.
    _denials: ClassVar[list[str]] = []
    #: Every server started with a user and not yet stopped.
    _audited: ClassVar[list[RedisServer]] = []

    def __init__(self, binary: str, directory: Path, *extra: str, user: AclUser | None = None) -> None:
        self.binary = binary
        self.directory = directory
        self.extra = extra
        self.host = "127.0.0.1"
        self.port = 0
        self.version = ""
        #: Which server software answers, from INFO, once started.
        self.software: Software | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.user = user if user is not None or not ACL_MODE else SUITE_USER
        #: Whether the user exists on the running process (not so for a subclass that starts otherwise).
        self._user_created = False

    #: The scheme of `url`.
    scheme = "redis"

    @property
    def url(self) -> str:
        """The server's URL, with the user's credentials if it has one."""
        credentials = self.user.credentials() if self._user_created and self.user is not None else ""
        return f"{self.scheme}://{credentials}{self.host}:{self.port}/0{self.url_query()}"

    @property
    def admin_url(self) -> str:
        """The server's URL for the unrestricted ``default`` user."""
        return f"{self.scheme}://{self.host}:{self.port}/0{self.url_query()}"

    def url_query(self) -> str:
        """What `url` ends with after the database: nothing here, a subclass's connection options."""
        return ""

    def connection_options(self) -> dict[str, Any]:
        """What every client of this server is made with, besides its address: nothing here."""
        return {}

    def client(self, **options: object) -> redis.asyncio.Redis:
        """A new client, authenticated as the user if there is one; ``options`` go to ``Redis``."""
        if self._user_created and self.user is not None:
            options = {"username": self.user.name, "password": self.user.password, **options}
        return self.admin_client(**options)

    def admin_client(self, **options: object) -> redis.asyncio.Redis:
        """A new client of the unrestricted ``default`` user; ``options`` go to ``Redis``."""
        return redis.asyncio.Redis(host=self.host, port=self.port, **{**self.connection_options(), **options})

    def _sync_client(self, **options: Any) -> redis.Redis:
        """A synchronous client for the set-up between tests' steps: the ``default`` user unless told."""
        return redis.Redis(host=self.host, port=self.port, **{**self.connection_options(), **options})

    def listen_arguments(self) -> tuple[str, ...]:
        """The command-line arguments that say where the server listens."""
        return ("--port", str(self.port))

    def start(self, *, same_port: bool = False) -> None:
        """Start on a free port (a port taken between probe and bind is retried), or on the last one."""
        for _ in range(1 if same_port else 5):
            if not same_port:
                with socket.socket() as probe:
                    probe.bind((self.host, 0))
                    self.port = probe.getsockname()[1]
            log = self.directory / f"redis-{self.port}.log"
            self.process = subprocess.Popen(
                [
                    self.binary,
                    *self.listen_arguments(),
                    "--bind", self.host,
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(self.directory),
                    "--logfile", str(log),
                    *self._user_directives(),
                    *self.extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if self._wait_until_ready():
                if self.user is not None:
                    self._user_created = True
                    RedisServer._audited.append(self)
                return
            self.stop()
        raise RuntimeError(f"redis-server would not start; see {self.directory}")

    def _user_directives(self) -> tuple[str, ...]:
        """The users to create as the server starts: before anyone connects, restarts included."""
        if self.user is None:
            return ()
        server = binary_software(self.binary)
        return (*self.user.directive(server), *_AUDITOR.directive(server))

    def _read_denials(self) -> None:
        """Move the ACL log's entries about the user to `_denials`, and clear the log."""
        assert self.user is not None
        auditor = self._sync_client(username=_AUDITOR.name, password=_AUDITOR.password, socket_timeout=5)
        try:
            entries = auditor.acl_log()
            auditor.acl_log_reset()
        finally:
            auditor.close()
        RedisServer._denials.extend(
            f"{entry['reason']} {entry['object']!r} ({entry['context']}, {entry['count']}x) on port {self.port}"
            for entry in entries
            if entry["username"] == self.user.name and entry["object"] not in TOLERATED_DENIALS
        )

    @classmethod
    def take_denials(cls) -> list[str]:
        """What the servers refused their users since the last call, running servers read now."""
        for server in cls._audited:
            server._read_denials()
        denials, cls._denials[:] = list(cls._denials), []
        return denials

    def _wait_until_ready(self) -> bool:
        """Wait for this process to answer; ``False`` if it died or another server holds the port."""
        assert self.process is not None
        deadline = time.monotonic() + _START_TIMEOUT
        probe = self._sync_client(socket_timeout=1, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    info = probe.info("server")
                except redis.ConnectionError:
                    time.sleep(0.02)
                    continue
                self.version = str(info["redis_version"])
                self.software = Software.from_info(info)
                return int(info["process_id"]) == self.process.pid
        finally:
            probe.close()
        return False

    def stop(self) -> None:
        """Stop the process by its PID: SIGTERM, then SIGKILL if it lingers."""
        if self.process is None:
            return
        if self._user_created:
            self._forget_user(read=self.process.poll() is None)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def save_and_stop(self) -> None:
        """Write the data to disk and stop: the next `start` on the same port and directory loads it."""
        probe = self._sync_client(socket_timeout=5)
        try:
            probe.save()
        finally:
            probe.close()
        self.stop()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would."""
        assert self.process is not None
        if self._user_created:
            self._forget_user(read=False)
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=5)
        self.process = None

    def _forget_user(self, *, read: bool) -> None:
        """Before the process ends: its ACL log read (if ``read``), and the server no longer audited."""
        RedisServer._audited.remove(self)
        self._user_created = False
        # A test may stop a server it paused or broke on purpose: its log is lost, not its stop.
        if read:
            with contextlib.suppress(redis.RedisError):
                self._read_denials()


async def flushed_client(server: RedisServer, *, admin: bool = False) -> redis.asyncio.Redis:
    """A new client of ``server``'s emptied database: `RedisServer.client`, or with ``admin`` the unrestricted one."""
    unrestricted_client = server.admin_client()
    try:
        await unrestricted_client.flushdb()
    except BaseException:
        await unrestricted_client.aclose()
        raise
    if admin:
        return unrestricted_client
    await unrestricted_client.aclose()
    return server.client()


@contextlib.asynccontextmanager
async def unrestricted(client: redis.asyncio.Redis) -> AsyncIterator[redis.asyncio.Redis]:
    """``client``'s server as the unrestricted ``default`` user, for a test's own set-up and inspection.

    A client that has no user name -- outside the ACL mode, or of fakeredis -- is itself.
    """
    pool = client.connection_pool
    options = dict(pool.connection_kwargs)
    if options.pop("username", None) is None:
        yield client
        return
    options.pop("password", None)
    admin = redis.asyncio.Redis(connection_pool=redis.asyncio.ConnectionPool(pool.connection_class, **options))
    try:
        yield admin
    finally:
        await admin.aclose(close_connection_pool=True)


class FakeClock:
    """A clock the tests move by hand, passed to a semaphore as ``clock``."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.asynccontextmanager
async def two_processes(
    connect: Callable[[], Client],
    cls: type[AsyncFairSemaphore] | type[AsyncLockedSemaphore],
    name: str,
    limit: int,
    **options: Any,
) -> AsyncIterator[tuple[Semaphore, Semaphore]]:
    """Two objects of one semaphore, each on a client of its own, as two processes would have them.

    Both objects and both clients are closed when the block ends.
    """
    clients = [connect(), connect()]
    first, second = (cls(client, name, limit, **options) for client in clients)
    try:
        yield first, second
    finally:
        for semaphore in (first, second):
            await semaphore.aclose()
        for client in clients:
            await client.aclose()


async def until_subscribed(semaphore: Semaphore) -> None:
    """Wait until ``semaphore``'s channel is subscribed (bounded to 5 s).

    An object subscribes in the background once a waiter of its is queued:
    a grant published before the server confirmed it is not heard by
    message (the object re-checks its waiters once the subscription is
    confirmed). A test that means a hand-off to come by message waits for
    this first.
    """
    with anyio.fail_after(5):
        while not semaphore._core.queue.channel.ready:  # noqa: ASYNC110 -- set in the background
            await asyncio.sleep(0.002)


def record_steps(semaphore_class: type[Semaphore], monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Every atomic step the objects of ``semaphore_class`` carry out from now on, in the order they are carried out.

    Recorded as each step starts, whichever object or task it is for: a
    holder's refresh and a waiter's heartbeat are steps too.
    """
    backend: Any = ScriptedSteps if semaphore_class is AsyncFairSemaphore else WatchedSteps
    execute = backend.execute
    steps: list[Step] = []

    async def recording(self: Any, step: Step, identifiers: Any, call: Any) -> Any:
        steps.append(step)
        return await execute(self, step, identifiers, call)

    monkeypatch.setattr(backend, "execute", recording)
    return steps


async def until_one_time_checks_done() -> None:
    """Wait until the one-time checks a client's first call starts in the background end (bounded to 5 s).

    The eviction policy is read on a connection of its own, opened from the
    client's pool: a test that counts a client's connections or writes
    waits for this first.
    """
    with anyio.fail_after(5):
        while _connection._policy_checks:  # noqa: ASYNC110 -- a task in the background, not ours to await
            await asyncio.sleep(0.002)


async def until_idle(semaphore: Semaphore) -> None:
    """Wait until ``semaphore``'s object has no step in flight, nor a re-check due, nor its pump woken (bounded to 5 s).

    Once subscribed, an object re-checks its waiters in the background: a
    test that tells the object's writes apart waits for this after
    `until_subscribed`. A reply can wake the pump (to set its next
    re-check) in the turn its step ends: woken, it has yet to run, and would
    run before anything the test starts next.
    """
    core = semaphore._core
    queue = core.queue
    loop = asyncio.get_running_loop()
    with anyio.fail_after(5):
        while True:
            due = queue.recheck_at
            if (
                (due is None or due > loop.time())
                and all(lane._flusher is None for lane in core._lanes.values())
                and (queue._pump is None or not queue._wake.is_set())
            ):
                return
            await asyncio.sleep(0.002)


async def until_queued(semaphore: Semaphore, count: int = 1) -> None:
    """Wait until Redis lists ``count`` waiters of ``semaphore`` (bounded to 5 s)."""
    with anyio.fail_after(5):
        while await semaphore.waiting() < count:  # noqa: ASYNC110 -- a bounded poll of Redis's own state
            await asyncio.sleep(0.01)


#: The project's root: where a worker process imports ``tests`` from.
ROOT: Final = Path(__file__).resolve().parents[2]


async def worker_outputs(script: str, arguments: Sequence[str], within: float) -> list[bytes]:
    """Run ``python -c script argument`` for each argument, all at once, in the project's root: their stdouts.

    Every worker must exit with status 0 within ``within`` seconds; those
    still running then are killed.
    """
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, argument, cwd=ROOT, stdout=asyncio.subprocess.PIPE
        )
        for argument in arguments
    ]
    try:
        with anyio.fail_after(within):
            outputs = await asyncio.gather(*(process.communicate() for process in processes))
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()
    statuses = [process.returncode for process in processes]
    assert statuses == [0] * len(processes), f"workers exited with {statuses} (their stderr is above)"
    return [stdout for stdout, _ in outputs]
