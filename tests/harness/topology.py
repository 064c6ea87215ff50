"""Redis Cluster and Redis Sentinel on loopback, built from ``redis-server`` processes of our own.

`RedisClusterGroup` starts three masters that share the 16384 hash slots and
moves a slot live, by hand, phase by phase. `SentinelGroup` starts a master,
its replica and three sentinels, and fails the master over on request or by
killing it. Both are context managers::

    with RedisClusterGroup(binary, tmp_path) as cluster:
        client = cluster.client()

Every process is one of ours, on 127.0.0.1, and is stopped by its PID. Every
wait has a deadline and, when it runs out, says what it was waiting for and
what it saw last. Admin work uses redis-py's synchronous client: these helpers
run between the steps of a test, not alongside its event loop's work.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any, Final

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from aiosem._connection import check_cluster_support
from tests.harness.support import RedisServer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

__all__ = [
    "RedisClusterGroup",
    "SentinelGroup",
    "SentinelMasterClient",
    "SentinelServer",
    "cluster_support_missing",
    "free_port",
    "hash_tag",
]

#: Every process listens here, and nowhere else.
HOST: Final = "127.0.0.1"

#: Slots in a Redis Cluster.
SLOTS: Final = 16384

#: How often a bounded wait looks again.
_POLL_INTERVAL: Final = 0.05

#: Bounds, generous because the machine is shared: the happy path takes a fraction of each.
_CLUSTER_TIMEOUT: Final = 30.0
_SENTINEL_TIMEOUT: Final = 60.0


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port nobody listens on; with ``with_bus``, port + 10000 is free too (a cluster bus).

    The port is only probed, so another process may take it before ours binds:
    callers start the server and retry on a fresh port if it would not start.
    """
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind((HOST, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair (port, port + 10000) found in 100 tries")


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes: the text between the first ``{`` and the first ``}`` after it, if non-empty."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def cluster_support_missing() -> str | None:
    """Why this redis-py cannot run aiosem on a cluster (it needs sharded pub/sub on asyncio), or ``None``.

    The oldest redis-py run skips the cluster tests with this reason.
    """
    try:
        check_cluster_support(redis.asyncio.cluster.RedisCluster.__new__(redis.asyncio.cluster.RedisCluster))
    except RuntimeError as error:
        return str(error)
    return None


def _wait_for(check: Callable[[], str | None], timeout: float, what: str) -> None:
    """Poll ``check`` until it returns ``None``; any other answer says why not yet.

    A connection refused, dropped or timed out, or a server still loading,
    counts as "not yet": a node may be restarting. Any other error is raised.
    The last reason is in the ``TimeoutError``.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            reason = check()
        except (redis.ConnectionError, redis.TimeoutError) as error:
            reason = f"{type(error).__name__}: {error}"
        if reason is None:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not reached within {timeout:g} s; last seen: {reason}")
        time.sleep(_POLL_INTERVAL)


def _execute(client: redis.Redis, *args: Any) -> Any:
    """``client.execute_command(*args)``: the raw reply, as no redis-py wrapper reshapes it."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]  # untyped in redis-py


def _pairs(flat: list[Any]) -> dict[str, Any]:
    """``[k1, v1, k2, v2, ...]``, as RESP2 answers ``SENTINEL MASTER`` and ``CLUSTER SHARDS``, as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _parse_info_lines(text: str) -> dict[str, str]:
    """``key:value`` lines (``CLUSTER INFO``) as a dict."""
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class _Admin:
    """Synchronous admin connections, one per address, kept for the life of a group.

    Kept rather than opened per command: polling opens thousands otherwise,
    each leaving a socket in TIME_WAIT. One retry without backoff rides over a
    connection that a restart or ``CLIENT KILL`` dropped; redis-py's default
    backoff would stall a poll for seconds.
    """

    def __init__(self) -> None:
        self._clients: dict[int, redis.Redis] = {}

    def __call__(self, port: int) -> redis.Redis:
        client = self._clients.get(port)
        if client is None:
            # RESP2, explicitly: redis-py 8 speaks RESP3 by default, and one shape of answer keeps parsing simple.
            client = redis.Redis(
                host=HOST,
                port=port,
                protocol=2,
                decode_responses=True,
                socket_timeout=10,
                socket_connect_timeout=2,
                retry=Retry(NoBackoff(), 1),
            )
            self._clients[port] = client
        return client

    def raw(self, port: int) -> redis.Redis:
        """A one-off connection that answers bytes: key names need not be UTF-8."""
        return redis.Redis(host=HOST, port=port, protocol=2, socket_timeout=10, socket_connect_timeout=2)

    def command(self, port: int, *args: Any) -> Any:
        """The raw reply of ``args`` from the server on ``port``."""
        return _execute(self(port), *args)

    def info(self, port: int, section: str) -> dict[str, Any]:
        """``INFO section`` of the server on ``port``, parsed."""
        return self(port).info(section)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _stop_all(servers: Iterable[RedisServer]) -> None:
    """Stop every server by its PID, in order, even if stopping one of them fails."""
    # An ExitStack runs every callback whatever the others raise, last pushed first.
    with contextlib.ExitStack() as stack:
        for server in reversed(list(servers)):
            stack.callback(server.stop)


# --------------------------------------------------------------------------------------------- cluster


class RedisClusterGroup:
    """Three Redis Cluster masters on loopback, owning a third of the slots each, no replicas.

    Each node runs in a sub-directory of ``directory`` of its own (its
    ``nodes-<port>.conf`` and log live there), on a port whose cluster bus
    port (port + 10000) was free too. `start` assigns the slots, introduces
    the nodes and waits until every node says ``cluster_state:ok``, knows all
    three and agrees on who owns each slot.

    A slot can be moved live with `move_slot`, or phase by phase
    (`begin_migration`, `migrate_keys`, `finish_migration`) so that a test can
    hold it half-migrated and watch clients meet ``ASK`` redirections.

    Args:
        binary: The ``redis-server`` to run.
        directory: Where the nodes keep their files; created if missing.
        node_timeout_ms: ``cluster-node-timeout``.
    """

    def __init__(self, binary: str, directory: Path, *, node_timeout_ms: int = 2000) -> None:
        self.binary = binary
        self.directory = directory
        self.node_timeout_ms = node_timeout_ms
        #: The three masters, in slot order: ``nodes[0]`` owns slot 0 at the start.
        self.nodes: list[RedisServer] = []
        self._admin = _Admin()

    def __repr__(self) -> str:
        ports = ",".join(str(node.port) for node in self.nodes) or "not started"
        return f"<{type(self).__name__} nodes={ports}>"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node."""
        return [(node.host, node.port) for node in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3``."""
        return "redis+cluster://" + ",".join(f"{host}:{port}" for host, port in self.startup_nodes)

    def client(self, **options: Any) -> redis.asyncio.cluster.RedisCluster:
        """A new asyncio cluster client that starts from the first node; ``options`` go to `RedisCluster`."""
        first = self.nodes[0]
        return redis.asyncio.cluster.RedisCluster(host=first.host, port=first.port, **options)

    def start(self) -> None:
        """Start the nodes, give each a third of the slots, join them, and wait until they agree.

        Raises:
            RuntimeError: A node would not start.
            TimeoutError: The cluster did not settle in time.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            for index in range(3):
                node = self._start_node()
                self.nodes.append(node)
                admin = self._admin(node.port)
                # Distinct config epochs from the start, as redis-cli does, spare the nodes resolving a collision.
                _execute(admin, "CLUSTER", "SET-CONFIG-EPOCH", index + 1)
                first, last = index * SLOTS // 3, (index + 1) * SLOTS // 3 - 1
                _execute(admin, "CLUSTER", "ADDSLOTSRANGE", first, last)
            for node in self.nodes[1:]:
                self._admin.command(self.nodes[0].port, "CLUSTER", "MEET", node.host, node.port)
            self.wait_until_stable()
        except BaseException:
            self.stop()
            raise

    def _start_node(self) -> RedisServer:
        """One cluster-enabled node on a port whose bus port is free too; a port taken meanwhile is retried."""
        for _ in range(5):
            port = free_port(with_bus=True)
            directory = self.directory / f"node-{port}"
            directory.mkdir()
            node = RedisServer(
                self.binary,
                directory,
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # Announced, not learned from the first MEET: CLUSTER SLOTS shows the address from the start.
                "--cluster-announce-ip", HOST,
            )  # fmt: skip
            node.port = port
            try:
                node.start(same_port=True)
            except RuntimeError:
                continue
            return node
        raise RuntimeError(f"no cluster node would start in 5 tries; see {self.directory}")

    def stop(self) -> None:
        """Stop every node by its PID."""
        self._admin.close()
        try:
            _stop_all(self.nodes)
        finally:
            self.nodes = []

    def __enter__(self) -> RedisClusterGroup:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_until_stable(self, timeout: float = _CLUSTER_TIMEOUT) -> None:
        """Wait until every node says ``cluster_state:ok``, sees all three nodes and agrees on slot owners.

        Raises:
            TimeoutError: Not so within ``timeout`` seconds; the message says what was last seen.
        """
        _wait_for(self._instability, timeout, f"cluster {self!r} stable")

    def _instability(self) -> str | None:
        """Why the cluster is not stable yet, or ``None``."""
        views: dict[int, list[tuple[int, int, int]]] = {}
        for node in self.nodes:
            admin = self._admin(node.port)
            info = _parse_info_lines(_execute(admin, "CLUSTER", "INFO"))
            if info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != "3":
                return f"node {node.port}: state {info.get('cluster_state')}, knows {info.get('cluster_known_nodes')}"
            for line in _execute(admin, "CLUSTER", "NODES").splitlines():
                fields = line.split()
                flags, link = set(fields[2].split(",")), fields[7]
                if not flags <= {"myself", "master"} or link != "connected":
                    return f"node {node.port} sees {fields[1]} as {fields[2]}, {link}"
            views[node.port] = self._slot_ranges(node)
        first = views[self.nodes[0].port]
        for port, view in views.items():
            if view != first:
                return f"node {port} disagrees on slot owners: {view} against {first}"
        return None

    def _slot_ranges(self, node: RedisServer) -> list[tuple[int, int, int]]:
        """``(first, last, owner port)`` of every slot range, as ``node`` sees them."""
        return sorted(
            (int(first), int(last), int(owner[1]))
            for first, last, owner, *_ in self._admin.command(node.port, "CLUSTER", "SLOTS")
        )

    def node_for_slot(self, slot: int) -> RedisServer:
        """The node that owns ``slot``, as the first node sees it (during a migration: the source).

        Raises:
            LookupError: No node owns the slot.
        """
        for first, last, port in self._slot_ranges(self.nodes[0]):
            if first <= slot <= last:
                return self._node_at(port)
        raise LookupError(f"no node owns slot {slot}")

    def _node_at(self, port: int) -> RedisServer:
        for node in self.nodes:
            if node.port == port:
                return node
        raise LookupError(f"no node of {self!r} on port {port}")

    def node_id(self, node: RedisServer) -> str:
        """The cluster node ID of ``node`` (``CLUSTER MYID``)."""
        return str(self._admin.command(node.port, "CLUSTER", "MYID"))

    def move_slot(self, slot: int, to: RedisServer, *, timeout: float = _CLUSTER_TIMEOUT) -> None:
        """Move ``slot`` and its keys to ``to``, live: the three phases below, one after the other.

        Raises:
            ValueError: ``to`` owns the slot already.
            redis.RedisError: A node refused a step.
            TimeoutError: The keys did not all move, or the nodes did not agree afterwards, in time.
        """
        self.begin_migration(slot, to)
        self.migrate_keys(slot, to, timeout=timeout)
        self.finish_migration(slot, to, timeout=timeout)

    def begin_migration(self, slot: int, to: RedisServer) -> None:
        """Mark ``slot`` importing on ``to`` and migrating on its owner; the keys stay where they are.

        From here on the owner answers ``ASK`` for keys of the slot it no longer
        holds, and ``to`` serves them to clients that send ``ASKING``.

        Raises:
            ValueError: ``to`` owns the slot already.
            redis.RedisError: A node refused.
        """
        source = self.node_for_slot(slot)
        if source is to:
            raise ValueError(f"slot {slot} is on node {to.port} already")
        # Importing first, as redis-cli does: a client sent to the target by an ASK must find it ready.
        self._admin.command(to.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        self._admin.command(source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to))

    def migrate_keys(self, slot: int, to: RedisServer, *, batch: int = 100, timeout: float = _CLUSTER_TIMEOUT) -> int:
        """``MIGRATE`` the keys of ``slot`` from its owner to ``to``, ``batch`` at a time, until none is left.

        The slot must be migrating (`begin_migration`). Returns how many keys moved.

        Raises:
            redis.RedisError: ``MIGRATE`` failed (e.g. ``BUSYKEY``: ``to`` holds a key of that name).
            TimeoutError: Keys were still there after ``timeout`` seconds.
        """
        source = self.node_for_slot(slot)
        moved = 0
        deadline = time.monotonic() + timeout
        with self._admin.raw(source.port) as admin:
            while keys := _execute(admin, "CLUSTER", "GETKEYSINSLOT", slot, batch):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"slot {slot}: keys still on node {source.port} after {timeout:g} s")
                reply = _execute(admin, "MIGRATE", to.host, to.port, "", 0, 5000, "KEYS", *keys)
                # NOKEY: every key of the batch expired or was deleted after GETKEYSINSLOT listed it.
                if reply not in {b"OK", b"NOKEY"}:
                    raise redis.ResponseError(f"MIGRATE of slot {slot} answered {reply!r}")
                if reply == b"OK":
                    moved += len(keys)
        return moved

    def finish_migration(self, slot: int, to: RedisServer, *, timeout: float = _CLUSTER_TIMEOUT) -> None:
        """Give ``slot`` to ``to`` on every node and wait until all three agree.

        The slot's keys must have moved (`migrate_keys`): the old owner refuses
        while it still holds some.

        Raises:
            redis.RedisError: A node refused.
            TimeoutError: The nodes did not agree in time.
        """
        target_id = self.node_id(to)
        # Target first: it then bumps its config epoch and its claim wins over any stale gossip.
        for node in [to, *(node for node in self.nodes if node is not to)]:
            self._admin.command(node.port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.wait_until_stable(timeout)


# -------------------------------------------------------------------------------------------- sentinel


class SentinelServer(RedisServer):
    """A ``redis-server <config> --sentinel`` process, its config file in its own directory.

    A sentinel needs a config file it can rewrite, and the file must come first
    on the command line, so this overrides `RedisServer.start`; stopping,
    killing and waiting for readiness are `RedisServer`'s.

    Args:
        binary: The ``redis-server`` to run.
        directory: Where the sentinel keeps its config file and log; created if missing.
        settings: ``sentinel ...`` lines for the config file (``monitor`` and the rest).
    """

    def __init__(self, binary: str, directory: Path, settings: list[str]) -> None:
        super().__init__(binary, directory)
        self.settings = settings
        self.config = directory / "sentinel.conf"

    def start(self, *, same_port: bool = False) -> None:
        """Start on a free port with a new config file, or on the last port with the file as the sentinel left it.

        Raises:
            RuntimeError: The sentinel would not start.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(1 if same_port else 5):
            if not same_port:
                self.port = free_port()
                self._write_config()
            self.process = subprocess.Popen(
                [self.binary, str(self.config), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_until_ready():
                return
            self.stop()
        raise RuntimeError(f"redis sentinel would not start; see {self.directory}")

    def _write_config(self) -> None:
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            f"dir {self.directory}",
            f"logfile {self.directory / f'sentinel-{self.port}.log'}",
            *self.settings,
        ]
        self.config.write_text("\n".join(lines) + "\n")


class SentinelMasterClient(redis.asyncio.Redis):
    """A client of the master a `redis.asyncio.sentinel.Sentinel` names; closing it closes that ``Sentinel`` too."""

    #: The sentinels this client asks where the master is.
    sentinel_manager: redis.asyncio.sentinel.Sentinel

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            # One by one: `Sentinel.aclose` is younger than the oldest redis-py aiosem supports.
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


class SentinelGroup:
    """A master, its replica and three sentinels watching them, on loopback.

    The two data nodes swap roles on every `failover` and `kill_master`;
    `master` and `replica` say which is which, as the sentinels see it. Both
    nodes run without persistence, so a node restarted after a crash comes
    back empty, and is restarted as a replica so that it never serves that
    empty data set as a master.

    Args:
        binary: The ``redis-server`` to run.
        directory: Where the processes keep their files; created if missing.
        down_after_ms: ``sentinel down-after-milliseconds``: how long a
            silent master takes to be judged down.
        failover_timeout_ms: ``sentinel failover-timeout``: a failover whose
            replica is not seen promoted within this long is abandoned, and
            the sentinels then wait twice this long before trying again (a
            failover that completes lets the next one start at once).
    """

    #: The name the sentinels know the master by.
    service_name: Final = "aiosem-master"

    #: How many sentinels must find the master down before they fail it over.
    quorum: Final = 2

    #: Sentinel's internal periods (ms) that ``SENTINEL DEBUG`` shortens, as Redis's own tests do:
    #:
    #: - ``ping-period`` (1000): a sentinel reconnects to an instance at most once per period. After a
    #:   failover away from a dead master it reaches the new master up to a period late, and with
    #:   ``down-after-milliseconds`` at 1000 it then often judges the new master down and fails over
    #:   again, promoting the restarted, empty node. Not below 500: a replica whose last ping reply or
    #:   ``INFO`` is older than 5 periods is no candidate for promotion, and ``INFO`` comes once a second.
    #: - ``info-period`` (10000): how often a healthy instance is asked for ``INFO``, so how stale what a
    #:   sentinel says of a replica may be, and how late it finds a new one.
    _TIMERS: Final = ("ping-period", 500, "info-period", 1000)

    #: ``publish-period`` (2000), the hello messages by which sentinels find each other, while the group
    #: starts, and after. Not shortened for good: a sentinel turns a replica that claims to be master back
    #: into a replica after 4 periods, unless it has heard by then that another sentinel promoted it; at
    #: 4 x 500 ms that is barely longer than the news takes, and it undid a failover in our trials.
    _DISCOVERY_PUBLISH_PERIOD: Final = 500
    _PUBLISH_PERIOD: Final = 2000

    def __init__(
        self, binary: str, directory: Path, *, down_after_ms: int = 1000, failover_timeout_ms: int = 3000
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        #: The two data nodes, in the order they were started (the first was master then).
        self.nodes: list[RedisServer] = []
        #: The three sentinels.
        self.sentinel_servers: list[SentinelServer] = []
        self._admin = _Admin()

    def __repr__(self) -> str:
        nodes = ",".join(str(node.port) for node in self.nodes) or "not started"
        sentinels = ",".join(str(sentinel.port) for sentinel in self.sentinel_servers)
        return f"<{type(self).__name__} nodes={nodes} sentinels={sentinels}>"

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every sentinel."""
        return [(sentinel.host, sentinel.port) for sentinel in self.sentinel_servers]

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:s1,127.0.0.1:s2,127.0.0.1:s3/aiosem-master/0``."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service_name}/0"

    def client(self, **options: Any) -> SentinelMasterClient:
        """A new asyncio client of the master, found through the sentinels; ``options`` go to ``master_for``.

        The client reconnects to the new master after a failover (redis-py's
        ``SentinelConnectionPool``). Closing it closes its ``Sentinel`` too.
        """
        sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8.2
            self.sentinels, sentinel_kwargs={"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
        )
        client: SentinelMasterClient = sentinel.master_for(
            self.service_name, redis_class=SentinelMasterClient, **options
        )
        client.sentinel_manager = sentinel
        return client

    def start(self) -> None:
        """Start the master, then its replica, then the sentinels, and wait until all of them agree.

        The sentinels start last: a sentinel learns of replicas from the
        master's ``INFO``, which it asks for as soon as it connects, so a
        replica already in sync is known from the start.

        Raises:
            RuntimeError: A process would not start.
            TimeoutError: The group did not settle in time.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            master = self._data_node("node-a")
            master.start()
            self.nodes.append(master)
            replica = self._data_node("node-b", replica_of=master)
            replica.start()
            self.nodes.append(replica)
            _wait_for(lambda: self._replication_lag(master, replica), _SENTINEL_TIMEOUT, "replica in sync")
            settings = [
                # Before `monitor`: with hostnames resolved, addresses could be announced as names.
                "sentinel resolve-hostnames no",
                f"sentinel monitor {self.service_name} {master.host} {master.port} {self.quorum}",
                f"sentinel down-after-milliseconds {self.service_name} {self.down_after_ms}",
                f"sentinel failover-timeout {self.service_name} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {self.service_name} 1",
            ]
            for index in range(3):
                sentinel = SentinelServer(self.binary, self.directory / f"sentinel-{index}", settings)
                sentinel.start()
                self.sentinel_servers.append(sentinel)
                self._admin.command(
                    sentinel.port, "SENTINEL", "DEBUG", *self._TIMERS, "publish-period", self._DISCOVERY_PUBLISH_PERIOD
                )
            self._wait_until_settled(master, replica)
            for sentinel in self.sentinel_servers:
                self._admin.command(sentinel.port, "SENTINEL", "DEBUG", "publish-period", self._PUBLISH_PERIOD)
        except BaseException:
            self.stop()
            raise

    def _data_node(self, name: str, *, replica_of: RedisServer | None = None) -> RedisServer:
        node = RedisServer(self.binary, self.directory / name)
        node.directory.mkdir(exist_ok=True)
        self._configure(node, replica_of)
        return node

    @staticmethod
    def _configure(node: RedisServer, replica_of: RedisServer | None) -> None:
        """Set the arguments the next start of ``node`` uses: a master, or a replica of ``replica_of``."""
        node.extra = (
            # The address sentinels and clients are told; loopback, whatever the socket says.
            "--replica-announce-ip", HOST,
            # Redis 7 syncs replicas diskless by default and waits 5 s for more replicas to share the transfer.
            "--repl-diskless-sync-delay", "0",
            # On SIGTERM a Redis 7 master waits up to 10 s for its replicas to catch up; `stop` need not.
            "--shutdown-timeout", "0",
        )  # fmt: skip
        if replica_of is not None:
            node.extra += ("--replicaof", replica_of.host, str(replica_of.port))

    def stop(self) -> None:
        """Stop every process by its PID: sentinels first, so that they fail nothing over meanwhile."""
        self._admin.close()
        try:
            _stop_all([*self.sentinel_servers, *self.nodes])
        finally:
            self.sentinel_servers = []
            self.nodes = []

    def __enter__(self) -> SentinelGroup:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------------- roles

    def master(self) -> RedisServer:
        """The data node every sentinel names as master.

        Raises:
            RuntimeError: The sentinels disagree, or name a node that is not ours.
        """
        ports = {self._master_port(sentinel) for sentinel in self.sentinel_servers}
        if len(ports) != 1:
            raise RuntimeError(f"sentinels disagree on the master: ports {sorted(ports)}")
        (port,) = ports
        for node in self.nodes:
            if node.port == port:
                return node
        raise RuntimeError(f"sentinels name port {port} as master, not one of {self!r}")

    def replica(self) -> RedisServer:
        """The data node that is not the master (see `master`)."""
        master = self.master()
        (replica,) = (node for node in self.nodes if node is not master)
        return replica

    def _master_port(self, sentinel: SentinelServer) -> int:
        _, port = self._admin.command(sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service_name)
        return int(port)

    # ------------------------------------------------------------------------------------- failover

    def failover(self, *, timeout: float = _SENTINEL_TIMEOUT) -> None:
        """Promote the replica with ``SENTINEL FAILOVER``, and wait until the old master is its replica, in sync.

        Returns once every sentinel names the new master, the new master says
        ``role:master`` and the old one replicates from it with the link up:
        `failover` can be called again at once.

        Sentinel itself demotes a live old master only 8 s after it last saw
        it change role (4 hello periods, time for news of a failover led by
        another sentinel to arrive), 8 to 10 s after the switch. This does it
        as soon as every sentinel has switched, the way sentinel does it
        (``REPLICAOF``, ``CLIENT KILL TYPE normal`` and ``pubsub`` in one
        transaction), so a client still talking to the old master is cut off
        and asks the sentinels again.

        Raises:
            redis.RedisError: The sentinel refused the failover.
            TimeoutError: A step did not happen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        old, new = self.master(), self.replica()
        self._request_failover(deadline)
        _wait_for(lambda: self._promotion_lag(new), deadline - time.monotonic(), f"port {new.port} promoted")
        self._demote(old, new)
        self._wait_until_settled(new, old, deadline - time.monotonic())

    def _request_failover(self, deadline: float) -> None:
        """``SENTINEL FAILOVER``, retried while the sentinel is still busy with the last one or its replica view."""

        def request() -> str | None:
            try:
                self._admin.command(self.sentinel_servers[0].port, "SENTINEL", "FAILOVER", self.service_name)
            except redis.ResponseError as error:
                if str(error).startswith(("INPROG", "NOGOODSLAVE")):
                    return str(error)
                raise
            return None

        _wait_for(request, deadline - time.monotonic(), "SENTINEL FAILOVER accepted")

    def _demote(self, old: RedisServer, new: RedisServer) -> None:
        """Make ``old`` a replica of ``new`` as sentinel would, cutting off its clients (but not this one)."""
        with self._admin(old.port).pipeline(transaction=True) as transaction:
            _execute(transaction, "REPLICAOF", new.host, new.port)
            _execute(transaction, "CLIENT", "KILL", "TYPE", "normal")
            _execute(transaction, "CLIENT", "KILL", "TYPE", "pubsub")
            transaction.execute()

    def kill_master(self, *, timeout: float = _SENTINEL_TIMEOUT) -> None:
        """SIGKILL the master, wait for the sentinels to promote the replica, restart the dead node as its replica.

        Returns once every sentinel names the new master, the new master says
        ``role:master``, and the restarted node (empty: nothing was persisted)
        replicates from it with the link up: `kill_master` can be called
        again at once.

        The dead node is restarted with ``--replicaof`` the new master: started
        as a master, it would serve its empty data set until the sentinels
        turned it into a replica, 8 s later. If the sentinels promoted nobody
        within ``timeout``, it is restarted anyway (as the master it was) before
        the error is raised, so the group is left whole.

        Raises:
            TimeoutError: A step did not happen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        old, new = self.master(), self.replica()
        assert old.process is not None, "the master is not running"
        old.kill()
        try:
            _wait_for(lambda: self._promotion_lag(new), deadline - time.monotonic(), f"port {new.port} promoted")
        except TimeoutError:
            self._configure(old, replica_of=None)
            old.start(same_port=True)
            raise
        self._configure(old, replica_of=new)
        old.start(same_port=True)
        self._wait_until_settled(new, old, deadline - time.monotonic())

    # --------------------------------------------------------------------------------------- checks

    def _wait_until_settled(
        self, master: RedisServer, replica: RedisServer, timeout: float = _SENTINEL_TIMEOUT
    ) -> None:
        """Wait until the nodes replicate and every sentinel names ``master`` and sees the others healthy."""
        _wait_for(
            lambda: self._replication_lag(master, replica) or self._sentinel_lag(master, replica),
            timeout,
            f"master {master.port} with replica {replica.port} in sync, seen so by every sentinel",
        )

    def _promotion_lag(self, new: RedisServer) -> str | None:
        """Why ``new`` is not yet the master for every sentinel and for itself, or ``None``."""
        for sentinel in self.sentinel_servers:
            port = self._master_port(sentinel)
            if port != new.port:
                return f"sentinel {sentinel.port} names {port}"
        role = self._admin.info(new.port, "replication")["role"]
        return None if role == "master" else f"port {new.port} says role:{role}"

    def _replication_lag(self, master: RedisServer, replica: RedisServer) -> str | None:
        """Why ``replica`` is not yet a replica of ``master`` in sync, seen from both, or ``None``."""
        info = self._admin.info(replica.port, "replication")
        if info["role"] != "slave" or int(info["master_port"]) != master.port:
            return f"port {replica.port} is {info['role']} of {info.get('master_port')}"
        if info["master_link_status"] != "up":
            return f"port {replica.port}: link to master {info['master_link_status']}"
        info = self._admin.info(master.port, "replication")
        if info["role"] != "master":
            return f"port {master.port} says role:{info['role']}"
        online = [
            value
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
        ]
        if [int(value["port"]) for value in online] != [replica.port]:
            return f"port {master.port} lists online replicas {online}"
        # Online is not yet streaming: after a diskless sync the master holds
        # new writes back until the replica's first REPLCONF ACK, up to a
        # second later, and a master killed meanwhile takes them with it.
        # A write the replica acknowledged proves the stream flows.
        admin = self._admin(master.port)
        admin.set("topology:replicated", "1")
        acknowledged = int(_execute(admin, "WAIT", 1, 100))
        if acknowledged < 1:
            return f"port {replica.port} has not acknowledged a write yet"
        return None

    def _sentinel_lag(self, master: RedisServer, replica: RedisServer) -> str | None:
        """Why a sentinel does not yet see ``master`` with ``replica`` and two other sentinels, healthy."""
        for sentinel in self.sentinel_servers:
            admin = self._admin(sentinel.port)
            state = _pairs(_execute(admin, "SENTINEL", "MASTER", self.service_name))
            if int(state["port"]) != master.port or state["flags"] != "master":
                return f"sentinel {sentinel.port}: master {state['port']} flags {state['flags']}"
            if state["num-slaves"] != "1" or state["num-other-sentinels"] != "2":
                return (
                    f"sentinel {sentinel.port}: {state['num-slaves']} replicas,"
                    f" {state['num-other-sentinels']} other sentinels"
                )
            (seen,) = (_pairs(flat) for flat in _execute(admin, "SENTINEL", "REPLICAS", self.service_name))
            if int(seen["port"]) != replica.port or seen["flags"] != "slave":
                return f"sentinel {sentinel.port}: replica {seen['port']} flags {seen['flags']}"
            # Every sentinel must have seen the old master turn replica: one that still thinks it claims to
            # be master would turn it back into a replica at once if the next failover promotes it.
            if int(seen["master-port"]) != master.port or seen["master-link-status"] != "ok":
                return (
                    f"sentinel {sentinel.port}: replica {replica.port} of {seen['master-port']},"
                    f" link {seen['master-link-status']}"
                )
            for other in map(_pairs, _execute(admin, "SENTINEL", "SENTINELS", self.service_name)):
                # master_down is another sentinel's opinion of the last master, kept for 5 s: not a fault.
                if set(other["flags"].split(",")) - {"master_down"} != {"sentinel"}:
                    return f"sentinel {sentinel.port} sees sentinel {other['port']} as {other['flags']}"
        return None
