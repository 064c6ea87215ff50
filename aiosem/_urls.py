"""Clients from URLs: one server, a Redis Cluster, or a master found through Sentinel.

=====================================================================  ==================================
``redis://[user:password@]host[:port][/db]``                           one server (``rediss://``: TLS)
``unix://[user:password@]/path/to/socket[?db=n]``                      one server on a Unix socket
``redis+cluster://[user:password@]host:port[,host:port...][/0]``        a cluster, from any of its nodes
``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``  the master Sentinel names
=====================================================================  ==================================

``rediss+cluster://`` and ``rediss+sentinel://`` connect with TLS. Query
parameters are redis-py's connection options (``?socket_timeout=10``). For
Sentinel, the credentials in the URL are the master's;
``sentinel_username`` and ``sentinel_password`` parameters are the
sentinels' own. Clients made here have 5 s socket timeouts and, on one
server, a blocking pool of 64 connections, unless the URL says otherwise.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis.asyncio
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff

from ._connection import let_go_of

if TYPE_CHECKING:
    from ._connection import Client

#: Socket timeouts of the clients aiosem creates from a URL, in seconds: no
#: read, write or connect can hang on a stalled connection for longer.
SOCKET_TIMEOUT: Final = 5.0
#: The size of the connection pool of a client created from a URL. The pool
#: blocks rather than fails when every connection is busy, for at most
#: `POOL_TIMEOUT` seconds. A semaphore object coalesces its calls, so it uses
#: a connection or two at a time whatever the number of its tasks.
MAX_CONNECTIONS: Final = 64
POOL_TIMEOUT: Final = 5.0

SERVER_SCHEMES: Final = ("redis", "rediss", "unix")
CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES: Final = ("redis+sentinel", "rediss+sentinel")
#: The URL of the embedded, in-process store (fakeredis): what aiosem uses when nothing is configured.
MEMORY_URL: Final = "memory://"
_SCHEMES: Final = (*SERVER_SCHEMES, *CLUSTER_SCHEMES, *SENTINEL_SCHEMES, "memory")
_DEFAULT_PORT: Final = 6379
_DEFAULT_SENTINEL_PORT: Final = 26379

#: The sentinels behind each client made from a ``redis+sentinel://`` URL:
#: closing the client closes their connections too.
_sentinels: weakref.WeakKeyDictionary[Any, Sentinel] = weakref.WeakKeyDictionary()


def check_url(value: object, argument: str = "url") -> str:
    """A URL aiosem can connect to, ``memory://`` included; the message never repeats it (it may hold a password)."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    try:
        parts = urlsplit(value)
    except ValueError as error:
        raise ValueError(f"{argument}: {error}") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        shown = f"a {scheme}:// URL" if scheme else "no URL scheme"
        raise ValueError(
            f"{argument} must be a redis://, rediss://, unix://, redis+cluster://, redis+sentinel:// "
            f"or memory:// URL, got {shown}"
        )
    if scheme == "memory" and (parts.netloc or parts.path not in ("", "/") or parts.query or parts.fragment):
        raise ValueError(f"{argument}: a memory:// URL takes no host, path or options")
    check_url_form(value, argument)
    return value


def is_memory(url: str) -> bool:
    """Whether ``url`` names the embedded store."""
    return urlsplit(url).scheme.lower() == "memory"


def check_url_form(url: str, argument: str) -> None:
    """Parse ``url`` as `connect` would, without connecting.

    Raises:
        ValueError: The URL is malformed; the message never repeats it (it
            may hold a password).
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        _cluster_arguments(url, argument)
    elif scheme in SENTINEL_SCHEMES:
        _sentinel_arguments(url, argument)
    elif scheme in SERVER_SCHEMES:
        # redis-py's own parse, and the port: a bad one fails only at connect time otherwise.
        try:
            parse_url(url)
            urlsplit(url).port  # noqa: B018 -- read for the ValueError it raises
        except ValueError as error:
            raise ValueError(f"{argument}: {error}") from None


def connect(url: str) -> Client:
    """A new client for a ``redis``, ``rediss``, ``unix``, cluster or sentinel URL; it connects on first use."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in CLUSTER_SCHEMES:
        nodes, options = _cluster_arguments(url, "url")
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes], **options)
    if scheme in SENTINEL_SCHEMES:
        sentinels, service, options, sentinel_options = _sentinel_arguments(url, "url")
        sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_options, **options)  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8.2
        client: redis.asyncio.Redis = sentinel.master_for(service)
        _sentinels[client] = sentinel
        return client
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_TIMEOUT,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=SOCKET_TIMEOUT,
        retry=_retry(),
    )
    return redis.asyncio.Redis(connection_pool=pool)


def _retry() -> Retry:
    """Send a command again, on a new connection, when its connection failed.

    A pool given to a client replaces redis-py's default retry with none:
    after a Redis restart, every pooled connection would fail its first
    command, and a release failing so would keep its permit until its lease
    ran out. Each aiosem step may run twice: a retried acquire finds its own
    permit, a retried refresh or release changes nothing more. (Cluster and
    Sentinel clients keep redis-py's own ways: a cluster client retries by
    itself, and a Sentinel one finds the master again on its next command.)
    """
    return Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.01), 3, supported_errors=(redis.ConnectionError,))


async def close(client: Client) -> None:
    """Close a client `connect` made, with its pool, and its sentinels' connections."""
    await let_go_of(client)
    if isinstance(client, RedisCluster):
        await client.aclose()
        return
    await client.aclose(close_connection_pool=True)
    sentinel = _sentinels.pop(client, None)
    if sentinel is not None:
        for connection in sentinel.sentinels:
            await connection.aclose(close_connection_pool=True)


def _split_hosts(url: str, default_port: int, argument: str) -> tuple[str, list[tuple[str, int]]]:
    """The ``user:password@`` part (or '') and the ``host:port`` list of a several-host URL."""
    netloc = urlsplit(url).netloc
    credentials, _, hosts = netloc.rpartition("@")
    nodes = []
    for item in hosts.split(","):
        # urlsplit parses one host and port at a time; IPv6 hosts keep their brackets.
        probe = urlsplit(f"//{item}")
        try:
            port = probe.port or default_port
        except ValueError:
            raise ValueError(f"{argument}: a host has a bad port") from None
        if not probe.hostname:
            raise ValueError(f"{argument}: every host must be named, as host:port, separated by commas")
        nodes.append((probe.hostname, port))
    return credentials, nodes


def _options(url: str, credentials: str, query: list[tuple[str, str]], argument: str) -> dict[str, Any]:
    """redis-py's connection options from the credentials and the query, with aiosem's timeouts."""
    tls = urlsplit(url).scheme.lower().startswith("rediss")
    at = f"{credentials}@" if credentials else ""
    try:
        options: dict[str, Any] = dict(parse_url(f"{'rediss' if tls else 'redis'}://{at}localhost/?{urlencode(query)}"))
    except ValueError as error:
        raise ValueError(f"{argument}: {error}") from None
    for key in ("host", "port", "db", "connection_class"):
        options.pop(key, None)
    options.setdefault("socket_timeout", SOCKET_TIMEOUT)
    options.setdefault("socket_connect_timeout", SOCKET_TIMEOUT)
    if tls:
        options["ssl"] = True
    return options


def _cluster_arguments(url: str, argument: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    parts = urlsplit(url)
    credentials, nodes = _split_hosts(url, _DEFAULT_PORT, argument)
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"{argument}: a cluster has only database 0")
    return nodes, _options(url, credentials, parse_qsl(parts.query), argument)


def _sentinel_arguments(url: str, argument: str) -> tuple[list[tuple[str, int]], str, dict[str, Any], dict[str, Any]]:
    parts = urlsplit(url)
    credentials, sentinels = _split_hosts(url, _DEFAULT_SENTINEL_PORT, argument)
    service, _, db = unquote(parts.path).strip("/").partition("/")
    if not service:
        raise ValueError(f"{argument}: a sentinel URL names its service: redis+sentinel://host:port/service")
    own = ("sentinel_username", "sentinel_password")
    query = parse_qsl(parts.query)
    options = _options(url, credentials, [(key, value) for key, value in query if key not in own], argument)
    if db:
        if not db.isdigit():
            raise ValueError(f"{argument}: the database after the service must be a number")
        options["db"] = int(db)
    # The sentinels are reached as the master is: same timeouts, same TLS (CA, certificate, checks).
    sentinel_options: dict[str, Any] = {
        key: value for key, value in options.items() if key.startswith(("ssl", "socket_"))
    }
    sentinel_options.update((key.removeprefix("sentinel_"), value) for key, value in query if key in own)
    return sentinels, service, options, sentinel_options
