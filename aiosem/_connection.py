"""Reaching the Redis node that holds a semaphore, on one server or a cluster.

``WATCH`` belongs to a connection, and so does ``WAIT``; redis-py's
pipelines run the commands after a ``WATCH`` one round trip each. Taking a
connection from the pool -- on a cluster, from the pool of the node serving
the semaphore's slot -- and writing whole batches to it lets a Lua-free step
read under WATCH in one round trip and write in another, and a script be
followed by a ``WAIT`` for its replicas on the connection that wrote.

On a cluster, a slot that moves answers ``MOVED``, a slot that is moving
``ASK`` or ``TRYAGAIN``: `redirected` learns the new layout, or waits for
the move to settle, before the step is tried again.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from contextlib import asynccontextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar, Union

import redis
from redis.asyncio.client import PubSub, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import AskError, ClusterError, MovedError, ResponseError, TryAgainError

from . import _fork
from ._background import Background
from ._timing import SHORTEST_STEP_BOUND, Backoff, Bound, Timeout, cancel_scope

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

    from redis.asyncio.cluster import ClusterNode

T = TypeVar("T")

Command = tuple[str | bytes | int | float, ...]
#: What aiosem runs on: a client of one server (or of Sentinel's master), or of a cluster.
Client: TypeAlias = Union[Redis, RedisCluster]  # noqa: UP007 -- evaluated at run time on Python 3.10 too

try:
    # redis.asyncio packs commands in Python: several times slower than this,
    # which matters to steps of twenty commands. The output is the same for
    # the UTF-8 clients it is used with.
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover -- hiredis comes with aiosem's dependencies
    _hiredis_pack = None  # type: ignore[assignment]

_UTF8: Final = frozenset({"utf-8", "utf8", "utf_8"})
#: How redis-py writes to and reads from a connection, which a connection class of the user's may override.
_REDIS_PY_WRITE: Final = AbstractConnection.send_packed_command
_REDIS_PY_READ: Final = AbstractConnection.read_response

logger = logging.getLogger("aiosem")

#: What a cluster answers about a slot that moved or is moving -- or what
#: redis-py raises once it gave up following such answers (``ClusterError``:
#: "TTL exhausted", as a slot half-moved keeps answering TRYAGAIN): the step
#: was not carried out, and is tried again on the slot's owner.
REDIRECTS: Final = (AskError, TryAgainError, ClusterError)
#: How long a step waits for a slot's move to settle between tries: from the
#: first pause, doubling, to the longest.
_FIRST_SETTLE_PAUSE: Final = 0.005
_SETTLE_PAUSE: Final = 0.05


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a ``redis.asyncio.RedisCluster``."""
    return isinstance(client, RedisCluster)


def address(client: Client) -> str:
    """Where ``client`` connects, as a URL with its password shown as ``***``, for messages.

    Read from the client's settings, so it names the Redis the user gave,
    however the client was made: one server (TCP, TLS or a Unix socket), the
    master a Sentinel names, or the startup nodes of a cluster.
    """
    if isinstance(client, RedisCluster):
        nodes = ",".join(node.name for node in client.nodes_manager.startup_nodes.values())
        return f"redis+cluster://{_credentials(client.nodes_manager.connection_kwargs)}{nodes}"
    pool = client.connection_pool
    settings = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):  # its settings are the master's
        sentinels = ",".join(
            f"{sentinel.connection_pool.connection_kwargs.get('host')}:"
            f"{sentinel.connection_pool.connection_kwargs.get('port')}"
            for sentinel in pool.sentinel_manager.sentinels
        )
        return f"redis+sentinel://{_credentials(settings)}{sentinels}/{pool.service_name}"
    database = settings.get("db", 0)
    if "path" in settings:
        return f"unix://{_credentials(settings)}{settings['path']}?db={database}"
    scheme = "rediss" if issubclass(pool.connection_class, SSLConnection) else "redis"
    host = settings.get("host", "localhost")
    return f"{scheme}://{_credentials(settings)}{host}:{settings.get('port', 6379)}/{database}"


def _credentials(settings: dict[str, Any]) -> str:
    user = settings.get("username") or ""
    if settings.get("password") or settings.get("credential_provider"):
        return f"{user}:***@"
    return f"{user}@" if user else ""


def check_cluster_support(client: object) -> None:
    """Refuse a cluster client on a redis-py without sharded pub/sub on asyncio (before 8.0).

    Raises:
        RuntimeError: ``client`` is a cluster client and redis-py is too old.
    """
    if is_cluster(client) and not hasattr(PubSub, "ssubscribe"):
        raise RuntimeError(
            f"a semaphore on Redis Cluster needs redis-py 8.0 or later (sharded pub/sub on redis.asyncio); "
            f"this is redis-py {redis.__version__}"
        )


def publish_command(client: object) -> str:
    """How a step wakes another process: sharded pub/sub stays inside the semaphore's slot on a cluster."""
    return "SPUBLISH" if is_cluster(client) else "PUBLISH"


async def redirected(
    client: Client, attempt: Callable[[], Awaitable[T]], *, bound: Bound | None = None, most: int | None = None
) -> T:
    """``await attempt()``, tried again on the slot's owner for as long as a cluster turns it away.

    An attempt turned away (`REDIRECTS`) did nothing. ``MOVED``: the slot
    has a new owner, and the client learns the layout anew before the next
    attempt. ``ASK``/``TRYAGAIN``/``CLUSTERDOWN``: the slot is on its way (a
    script whose keys are not all on one side of the move cannot run until
    it ends), and the next attempt waits for the move to settle, after a
    `Backoff` pause (5 ms, doubling, up to 50 ms).

    The whole runs within ``bound``, if given -- a `Bound` the caller made,
    entered here -- and the `redis.TimeoutError` it raises names the last
    redirect as its cause: on a cluster, why it took so long. ``most``, if
    given, also bounds how many redirects are followed. Without either, the
    caller bounds the whole (a cancel scope).

    Raises:
        redis.TimeoutError: ``bound`` ran out.
        redis.RedisError: What ``attempt`` raised; after ``most`` redirects,
            the last one.
    """
    redirect: Exception | None = None
    try:
        with bound if bound is not None else nullcontext():
            backoff: Backoff | None = None  # made at the first pause: most calls never meet one
            redirects = 0
            while True:
                try:
                    return await attempt()
                except REDIRECTS as error:  # noqa: PERF203 -- free until raised; the loop is for trying again
                    if most is not None and redirects >= most:
                        raise
                    redirect = error
                    redirects += 1
                    if isinstance(error, MovedError) and isinstance(client, RedisCluster):
                        await client.nodes_manager.initialize()
                    else:
                        backoff = backoff or Backoff(_SETTLE_PAUSE, first=_FIRST_SETTLE_PAUSE)
                        await backoff.pause()
    except redis.TimeoutError as error:
        if redirect is None:
            raise
        raise error from redirect


class PinnedConnection:
    """A pool connection that stays the caller's until the block ends."""

    __slots__ = ("_connection",)

    def __init__(self, connection: AbstractConnection) -> None:
        self._connection = connection

    def encode(self, value: str | bytes) -> bytes:
        """Return a member as the bytes Redis stores, whatever the client decodes."""
        if isinstance(value, bytes):
            return value
        encoded: bytes = self._connection.encoder.encode(value)  # type: ignore[no-untyped-call]
        return encoded

    def _pack(self, commands: Sequence[Command]) -> list[bytes]:
        encoder = self._connection.encoder
        if _hiredis_pack is not None and encoder.encoding.lower() in _UTF8 and encoder.encoding_errors == "strict":
            # hiredis's stub types the argument as a tuple of one element.
            return [b"".join([_hiredis_pack(command) for command in commands])]  # type: ignore[arg-type]
        return self._connection.pack_commands(commands)

    async def close(self) -> None:
        """Close the connection now: it goes back to its pool closed, which opens it anew when next needed."""
        await _disconnect(self._connection)

    async def retried(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run ``attempt()``, trying it again on a new connection as the client's own commands are.

        The connection's ``retry`` policy -- the client's -- decides which
        errors are tried again, how often and after what pause; the failed
        connection is closed first, and the next write opens a new one.
        """
        connection = self._connection

        async def close(_error: Exception) -> None:
            await connection.disconnect()

        result: T = await connection.retry.call_with_retry(attempt, close)
        return result

    def _stream(self) -> asyncio.StreamWriter | None:
        """The connection's stream, if a batch may be written to and read from it directly; else ``None``.

        With a ``socket_timeout``, redis-py bounds every write by
        ``asyncio.wait_for``, which runs it as a task of its own, and every
        reply read by a timeout of its own: a task, three loop turns and a
        timer per reply more a batch, for a write the kernel takes at once
        and replies that arrive together. A batch is written directly, and
        its replies read from the connection's parser under one timeout.

        That takes two private attributes of redis-py's connections (5.x to
        8.x), ``_writer`` and ``_parser``. Without them, and wherever
        redis-py does more than write and parse -- a connection not yet
        open, health checks, a class that writes or reads its own way, a
        transport that cannot tell what it holds back (fakeredis's) -- a
        batch goes redis-py's way. The parser handles RESP3's push messages
        itself; redis-py 8 relaxes the timeout of the read under way when
        one announces a maintenance, and so it does this one's.
        """
        connection = self._connection
        writer: asyncio.StreamWriter | None = getattr(connection, "_writer", None)
        if (
            writer is None
            or getattr(writer.transport, "get_write_buffer_size", None) is None
            or getattr(connection, "_parser", None) is None
            or not connection.socket_timeout
            or connection.health_check_interval
            or type(connection).send_packed_command is not _REDIS_PY_WRITE
            or type(connection).read_response is not _REDIS_PY_READ
        ):
            return None
        return writer

    async def _write(self, writer: asyncio.StreamWriter, packed: list[bytes]) -> None:
        """Write ``packed`` as redis-py's ``send_packed_command`` does: only a write the kernel did not take waits.

        Raises:
            redis.ConnectionError: The write failed; the connection is closed.
            redis.TimeoutError: The write took longer than ``socket_timeout``.
        """
        connection = self._connection
        try:
            writer.writelines(packed)
            if writer.transport.get_write_buffer_size():
                await asyncio.wait_for(writer.drain(), connection.socket_timeout)
            else:
                await writer.drain()  # never waits: raises what a lost connection left
        except asyncio.TimeoutError:
            await connection.disconnect(nowait=True)
            raise redis.TimeoutError("Timeout writing to socket") from None
        except OSError as error:
            await connection.disconnect(nowait=True)
            raise redis.ConnectionError(f"Error while writing to socket: {error}") from error

    async def _read(self, count: int) -> list[Any]:
        """Read ``count`` replies from the parser, as redis-py's ``read_response`` reads each, under one timeout.

        Error replies are returned, not raised. Anything else that ends the
        read -- a cancellation included -- closes the connection, which may
        be out of step with the server.

        Raises:
            redis.ConnectionError: The connection failed; it is closed.
            redis.TimeoutError: The replies took longer than ``socket_timeout``.
        """
        connection = self._connection
        parser: Any = connection._parser  # noqa: SLF001 -- see _stream
        replies: list[Any] = []
        relaxable = hasattr(connection, "_active_read_timeout")
        try:
            with Timeout(connection.socket_timeout) as timeout:
                if relaxable:
                    connection._active_read_timeout = timeout  # type: ignore[assignment,unused-ignore] # noqa: SLF001
                try:
                    for _ in range(count):
                        replies.append(await parser.read_response())  # noqa: PERF401 -- awaited one by one
                finally:
                    if relaxable:
                        connection._active_read_timeout = None  # noqa: SLF001
        except asyncio.TimeoutError:
            # Named as redis-py names the server in its errors, only when one is raised.
            where = connection._host_error()  # noqa: SLF001
            await connection.disconnect(nowait=True)
            raise redis.TimeoutError(f"Timeout reading from {where}") from None
        except OSError as error:
            where = connection._host_error()  # noqa: SLF001
            await connection.disconnect(nowait=True)
            raise redis.ConnectionError(f"Error while reading from {where} : {error.args}") from error
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        return replies

    async def batch(self, *commands: Command) -> list[Any]:
        """Send ``commands`` in one write and return their raw replies in order.

        Every reply is read before an error is raised, so the connection stays
        in step with the server.

        Raises:
            redis.ResponseError: The first error reply, at the top level or
                inside an EXEC reply.
            redis.RedisError: The connection failed.
        """
        connection = self._connection
        packed = self._pack(commands)
        writer = self._stream()
        replies: list[Any]
        if writer is not None:
            await self._write(writer, packed)
            replies = await self._read(len(commands))
        else:
            await connection.send_packed_command(packed)
            replies = []
            for _ in commands:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as error:  # noqa: PERF203 -- every reply must be read to stay in step
                    replies.append(error)
        for reply in replies:
            for item in reply if isinstance(reply, list) else (reply,):
                if isinstance(item, ResponseError):
                    raise item
        return replies


#: The connections a task keeps between its blocks of `pinned_connection`,
#: by pool, while it runs `keeping_connections`; and which task that is (a
#: task it starts inherits the variable, not the right to use them).
_kept: ContextVar[tuple[asyncio.Task[Any] | None, dict[Any, AbstractConnection]] | None] = ContextVar(
    "aiosem_kept", default=None
)


class keeping_connections:  # noqa: N801 -- used as a function: `async with keeping_connections():`
    """Within the block, keep each one-server connection of the current task for its next `pinned_connection`.

    A task that sends steps back to back -- a lane's flusher -- then takes
    a connection from the pool once, not once a step: the pool's locks and
    checks cost a sixth of a step. At the end of the block, which holds no
    more of them than the task uses at once, each connection is parked for
    the next such block of the event loop (see `_Park`), or goes back to
    its pool. (A class, not an async generator: a flusher enters one for
    every run, and a generator costs the loop's hooks and a weak reference
    each time.)
    """

    __slots__ = ("_kept", "_park", "_token")

    async def __aenter__(self) -> None:
        self._park = await _Park.of_running_loop()
        self._kept: dict[Any, AbstractConnection] = {}
        self._token = _kept.set((asyncio.current_task(), self._kept))

    async def __aexit__(self, *exc_info: object) -> None:
        _kept.reset(self._token)
        for pool, connection in self._kept.items():
            # Most ends park their one connection: no scope to enter for them.
            if not self._park.leave(pool, connection):
                await _give_back(pool, connection)


#: How long a connection stays parked for the next flusher of its event loop before it goes back to its pool.
PARKED_FOR: Final = 0.1
#: How many connections of one pool may be parked at once: one for each
#: kind of step a busy object sends in turn -- its acquires' and its
#: releases' flushers end and start again one after the other.
PARKED_PER_POOL: Final = 2


class _Park:
    """The connections of each pool that the flushers of one event loop let go of last, kept for the next ones.

    A lane's flusher ends once its lane is empty, so a lone caller starts
    one for every step, and each borrowed a connection from the pool and
    gave it back: the pool's lock, its health check and its bookkeeping cost
    a sixth of a lone caller's CPU. The connection waits here instead, up
    to `PARKED_PER_POOL` of them per pool, for at most `PARKED_FOR`; then
    it goes back to its pool. The next flusher takes the one parked last
    if it is still fit -- connected, nothing unread, no reconnect due -- as
    the pool would. The loop's shutdown (its async generators closed),
    closing a semaphore object, and `aiosem.aclose` give them back at once.
    """

    __slots__ = ("_closed", "_expiry", "_loop", "_parked", "_watcher")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: Each pool's parked connections, each with when it was parked (loop time), the latest last.
        self._parked: dict[Any, list[tuple[AbstractConnection, float]]] = {}
        #: One timer for the whole park, armed while anything is parked: a
        #: flusher parks its connection every run, and a timer made and
        #: cancelled each time would stay in the loop's heap until cleaned.
        self._expiry: asyncio.TimerHandle | None = None
        self._closed = False
        self._watcher = self._watch()

    def __repr__(self) -> str:
        return f"_Park(parked={len(self._parked)}, closed={self._closed})"

    @classmethod
    async def of_running_loop(cls) -> _Park:
        """The park of the running event loop, made on first use."""
        loop = asyncio.get_running_loop()
        park = _parks.get(loop)
        if park is None:
            for closed in [other for other in _parks if other.is_closed()]:
                # Closed without closing its async generators: what was parked
                # there can only be forgotten, not given back.
                del _parks[closed]
            park = _parks[loop] = cls(loop)
            await anext(park._watcher)
        return park

    def take(self, pool: Any) -> AbstractConnection | None:
        """The connection parked last for ``pool``, if any, no longer parked."""
        parked = self._parked.get(pool)
        if not parked:
            return None
        connection, _ = parked.pop()
        if not parked:
            del self._parked[pool]
        return connection

    def leave(self, pool: Any, connection: AbstractConnection) -> bool:
        """Park ``connection`` of ``pool``, unless as many as may be are parked for it already: whether it was.

        Only a connection that steps write to directly is parked: redis-py
        does more around the others (health checks, a class of the user's).
        Nor is the last connection a bounded pool could hand out: the
        application's next command would wait for it, or -- from a pool that
        does not block -- fail with "Too many connections".
        """
        parked = self._parked.get(pool, [])
        if (
            self._closed
            or len(parked) >= PARKED_PER_POOL
            or not _spares_one(pool)
            or PinnedConnection(connection)._stream() is None  # noqa: SLF001
        ):
            return False
        self._parked[pool] = [*parked, (connection, self._loop.time())]
        if self._expiry is None:
            self._expiry = self._loop.call_later(PARKED_FOR, self._expire)
        return True

    def _expire(self) -> None:
        """Give back what has been parked for `PARKED_FOR`; come back for the rest when its time is up."""
        self._expiry = None
        now = self._loop.time()
        for pool, parked in list(self._parked.items()):
            kept = []
            for connection, since in parked:
                if now - since < PARKED_FOR:
                    kept.append((connection, since))
                else:
                    _returns.start(_give_back(pool, connection), name="aiosem connection back to its pool")
            if kept:
                self._parked[pool] = kept
            else:
                del self._parked[pool]
        if self._parked:
            earliest = min(since for parked in self._parked.values() for _, since in parked)
            self._expiry = self._loop.call_at(earliest + PARKED_FOR, self._expire)

    async def give_back(self, pool: Any = None) -> None:
        """Give back at once the connections parked for ``pool`` (for every pool, with ``None``)."""
        for parked_pool in [parked for parked in self._parked if pool is None or parked is pool]:
            for connection, _ in self._parked.pop(parked_pool):
                await _give_back(parked_pool, connection)
        if not self._parked and self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _watch(self) -> AsyncIterator[None]:
        # Suspended for the loop's life, as one of its async generators: closed, as
        # `aiosem._loop_cache` closes its state, when the loop shuts down.
        try:
            yield
        finally:
            self._closed = True
            await self.give_back()
            if _parks.get(self._loop) is self:
                del _parks[self._loop]


def _spares_one(pool: Any) -> bool:
    """Whether ``pool`` could hand out one more connection now (a pool that does not say so: yes)."""
    in_use = getattr(pool, "_in_use_connections", None)  # redis-py 5 to 8
    bound = getattr(pool, "max_connections", None)
    return in_use is None or bound is None or len(in_use) < bound


async def _give_back(pool: Any, connection: AbstractConnection) -> None:
    with cancel_scope(shield=True):
        await pool.release(connection)


async def _fit(connection: AbstractConnection) -> bool:
    """Whether a parked connection may carry the next step, as a pool checks: connected, nothing unread or due."""
    # Marked by redis-py 8 for a reconnect, which the pool does as a connection comes back.
    should_reconnect = getattr(connection, "should_reconnect", None)
    if should_reconnect is not None and should_reconnect():
        return False
    # redis-py 8 renamed the check, and deprecated the old name.
    pending = getattr(connection, "can_read", None) or connection.can_read_destructive
    try:
        return connection.is_connected and not await pending()
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


async def let_go_of(client: Client) -> None:
    """Leave ``client`` with nothing of aiosem's under way in the running event loop, and no connection out of its pool.

    The eviction-policy check its first call started ends -- cancelled, it
    is asked again on the client's next call -- and the connections parked
    for its pool go back at once. A client closed straight after finds
    every connection in its pool, and nothing of aiosem's opens one again:
    a check still under way then would reconnect the closed pool for its
    one command.
    """
    check = _policy_checking.get(client)
    if check is not None and check.get_loop() is asyncio.get_running_loop():
        check.cancel()
        await asyncio.wait([check])
    if isinstance(client, RedisCluster):
        return  # a cluster's connections are never parked
    park = _parks.get(asyncio.get_running_loop())
    if park is not None:
        await park.give_back(client.connection_pool)


_parks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Park] = weakref.WeakKeyDictionary()
#: Parked connections on their way back to their pools.
_returns = Background()


def _forget_parks() -> object:
    """In a forked child: forget the parent's parked connections, which are its sockets."""
    global _parks  # a new process
    parks, _parks = _parks, weakref.WeakKeyDictionary()
    return dict(parks)


_fork.forget(_forget_parks)


def _kept_by_this_task() -> dict[Any, AbstractConnection] | None:
    kept = _kept.get()
    return kept[1] if kept is not None and kept[0] is asyncio.current_task() else None


async def _borrow(pool: Any, *, parked: bool) -> AbstractConnection:
    """A connection of ``pool``: with ``parked``, the one parked in this event loop if it is still fit."""
    park = _parks.get(asyncio.get_running_loop()) if parked else None
    connection = None if park is None else park.take(pool)
    if connection is not None:
        try:
            fit = await _fit(connection)
        except BaseException:
            # Interrupted mid-check -- a step's bound, the loop's shutdown: the
            # connection, out of the park, would stay out of its pool for good.
            await _close_and_give_back(pool, connection)
            raise
        if fit:
            return connection
        # Closed, so that the pool opens it anew: redis-py 8's pool hands out a
        # connection with something unread when it may be a maintenance notice.
        await _close_and_give_back(pool, connection)
    borrowed: AbstractConnection = await pool.get_connection()
    return borrowed


async def _close_and_give_back(pool: Any, connection: AbstractConnection) -> None:
    """Close ``connection``, whose state is not known, and give it back to ``pool``."""
    await _disconnect(connection)
    await _give_back(pool, connection)


async def _disconnect(connection: AbstractConnection) -> None:
    """Close ``connection`` through any cancellation: one left half-closed would be handed out again."""
    with cancel_scope(shield=True):
        await connection.disconnect(nowait=True)


@asynccontextmanager
async def pinned_connection(client: Client, key: str) -> AsyncIterator[PinnedConnection]:
    """Borrow, for a block, one connection to the node that serves ``key``.

    On one server (or behind Sentinel) that is a connection of the client's
    pool; on a cluster, one of the pool of the primary serving ``key``'s
    slot, as the client last knew the layout: a stale layout answers
    `REDIRECTS`. A block left by an exception -- a cancellation included --
    may have left replies unread or a WATCH in place, so its connection is
    closed rather than reused.
    """
    connection: AbstractConnection
    if isinstance(client, RedisCluster):
        await client.initialize()
        node: ClusterNode = client.get_node_from_key(key)  # type: ignore[assignment]
        node_connection = connection = node.acquire_connection()

        async def give_back() -> None:
            node.release(node_connection)

    else:
        pool = client.connection_pool
        kept = _kept_by_this_task()
        if kept is not None and pool in kept:
            connection = kept.pop(pool)
        else:
            connection = await _borrow(pool, parked=kept is not None)

        async def give_back() -> None:
            if kept is not None and pool not in kept and connection.is_connected:
                kept[pool] = connection  # nothing awaited: nothing to shield
            else:
                with cancel_scope(shield=True):
                    await pool.release(connection)

    try:
        yield PinnedConnection(connection)
    except BaseException:
        await _disconnect(connection)
        raise
    finally:
        await give_back()


#: How often a read-only transaction follows a moving slot before it gives up.
MOST_REDIRECTS: Final = 20


async def transaction(client: Client, key: str, *commands: Command) -> list[Any]:
    """Run ``commands`` in one MULTI/EXEC on the node that serves ``key``; return their replies.

    A transaction turned away because its slot moved or is moving did
    nothing, and is tried again on the slot's owner (at most
    `MOST_REDIRECTS` times). A pooled connection the server closed meanwhile
    -- it restarted, say -- fails its first use; as redis-py's own commands
    do, the transaction is tried once more on a new one. All of it is
    bounded to 5 s, so that a stalled connection cannot hang it.

    Raises:
        redis.RedisError: Redis failed or could not be reached.
    """

    async def attempt() -> list[Any]:
        try:
            return await _transaction(client, key, commands)
        except redis.ConnectionError:
            return await _transaction(client, key, commands)

    return await redirected(
        client, attempt, bound=Bound(SHORTEST_STEP_BOUND, "a read-only transaction"), most=MOST_REDIRECTS
    )


async def _transaction(client: Client, key: str, commands: tuple[Command, ...]) -> list[Any]:
    async with pinned_connection(client, key) as connection:
        *_, replies = await connection.batch(("MULTI",), *commands, ("EXEC",))
    return list(replies)


def scored(reply: Any) -> list[tuple[str, float]]:
    """The members and scores of a ZRANGE WITHSCORES reply: flat in RESP2, in pairs in RESP3."""
    pairs = reply if reply and isinstance(reply[0], list) else zip(reply[::2], reply[1::2], strict=True)
    return [(text(member), float(score)) for member, score in pairs]


def text(value: Any) -> str:
    """A reply's member or channel as a str, whether or not the client decodes replies."""
    return value.decode() if isinstance(value, bytes) else str(value)


#: The clients whose server's eviction policy was looked at, each once.
_policy_checked: weakref.WeakSet[Client] = weakref.WeakSet()


async def check_eviction_policy(client: Client, key: str) -> None:
    """Warn, once per client, if the server serving ``key`` may evict a live permit.

    With a ``maxmemory`` set, an ``allkeys-*`` policy may delete a
    semaphore's permits -- and then grant more than its limit. A
    ``volatile-*`` policy deletes only keys with a TTL, and the keys that
    bear live permits have none: it may cost waiters their place or a rate
    limiter its schedule, never the limit, and is not warned about.
    ``noeviction`` refuses writes instead, which aiosem reports as
    `OutOfMemory`.

    One plain ``CONFIG GET`` asks, on a connection to the node serving
    ``key``: queued in a ``MULTI``, even a read is refused while memory is
    full. A server that will not say (``CONFIG`` renamed or not allowed to
    the user, as on managed services) is not asked again; one out of reach
    is asked again next time.

    The connection is closed afterwards, not kept in the pool: the
    application may close its client while the look is under way -- a
    one-request script does -- and a connection the look opened again then
    would stay open in the closed pool.
    """
    if client in _policy_checked:
        return
    _policy_checked.add(client)
    try:
        with Bound(SHORTEST_STEP_BOUND, "reading the eviction policy"):
            async with pinned_connection(client, key) as connection:
                # Whatever interrupts the batch, the block's end closes the connection already.
                (reply,) = await connection.batch(("CONFIG", "GET", "maxmemory", "maxmemory-policy"))
                await connection.close()
    except ResponseError as error:
        logger.debug("could not read the eviction policy of Redis: %s", error)
        return
    except redis.RedisError:
        _policy_checked.discard(client)  # out of reach: asked again next time
        return
    except BaseException:
        _policy_checked.discard(client)  # cancelled: asked again next time
        raise
    config = _config_values(reply)
    policy = config.get("maxmemory-policy", "")
    if int(config.get("maxmemory") or 0) > 0 and policy.startswith("allkeys-"):
        logger.warning(
            "Redis evicts any key when it reaches maxmemory (maxmemory-policy %s): it may delete aiosem's "
            "permits and then grant more than a limit; set maxmemory-policy noeviction or a volatile-* policy",
            policy,
        )


#: The clients whose eviction policy is being looked at, each with the task doing it.
_policy_checking: weakref.WeakKeyDictionary[Client, asyncio.Task[None]] = weakref.WeakKeyDictionary()
_policy_checks = Background()


def watch_eviction_policy(client: Client, key: str) -> None:
    """Run `check_eviction_policy` in the background, unless it ran, or runs, for ``client``.

    A call that needs the check never waits for it: one-time set-up must
    neither reorder callers nor stretch their timeouts.
    """
    if client in _policy_checked or client in _policy_checking:
        return
    task = _policy_checking[client] = _policy_checks.start(
        check_eviction_policy(client, key), name="aiosem eviction policy"
    )
    task.add_done_callback(lambda _: _policy_checking.pop(client, None))


def _config_values(reply: Any) -> dict[str, str]:
    """The parameters of a CONFIG GET reply, by name: a flat list in RESP2, a map in RESP3."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {text(name): text(value) for name, value in pairs}
