"""`TcpProxy` itself: bytes pass both ways, in order, until the test holds, drops, stalls or partitions them.

Most tests put the proxy in front of an echo server of their own, in the
test's event loop, which keeps what it received: what the client reads back
went to the server and back through the proxy. The last ones put it in front
of the session's Redis, as the fault tests do.

A check that something does *not* arrive waits `QUIET` seconds: nothing can
signal an absence. Every other wait is on the proxy's or the server's state.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import anyio
import pytest
import redis.asyncio

from tests.harness.proxy import TcpProxy

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from tests.harness.support import RedisServer

#: Bound on every wait for something that must happen.
BOUND = 5.0
#: How long a check that nothing arrives watches.
QUIET = 0.2
#: The added latency of the delay test: far above a loopback round trip.
DELAY = 0.1


class EchoServer:
    """A TCP server on loopback that sends back what it reads, and keeps it in `received`."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.ended = 0
        self._changed = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._echo, "127.0.0.1", 0)

    async def aclose(self) -> None:
        assert self._server is not None
        self._server.close()
        with anyio.fail_after(BOUND):
            await self._server.wait_closed()

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        with anyio.fail_after(BOUND):
            while not predicate():
                changed = self._changed
                await changed.wait()

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.received += data
                self._notify()
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass  # reset by the proxy: an end like any other
        finally:
            self.ended += 1
            self._notify()
            writer.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    await server.start()
    yield server
    await server.aclose()


@pytest.fixture
async def echo_proxy(echo: EchoServer) -> AsyncIterator[TcpProxy]:
    async with TcpProxy("127.0.0.1", echo.port) as proxy:
        yield proxy


@contextlib.asynccontextmanager
async def connected(proxy: TcpProxy) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A client connection through ``proxy``, open once the proxy has its connection to the server."""
    opened = proxy.connections
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        with anyio.fail_after(BOUND):
            await proxy.wait_until(lambda: proxy.connections > opened)
        yield reader, writer
    finally:
        writer.transport.abort()


async def read_exactly(reader: asyncio.StreamReader, size: int) -> bytes:
    with anyio.fail_after(BOUND):
        return await reader.readexactly(size)


async def nothing_arrives(reader: asyncio.StreamReader) -> bool:
    """Whether ``reader`` stays silent, with its stream open, for `QUIET` seconds."""
    with anyio.move_on_after(QUIET):
        await reader.read(1)
        return False
    return True


async def ended(reader: asyncio.StreamReader) -> bool:
    """Whether ``reader``'s stream ends (EOF or a reset) within `BOUND`, with nothing more read."""
    with anyio.fail_after(BOUND):
        try:
            return await reader.read(1) == b""
        except ConnectionError:
            return True


# --- passing through -------------------------------------------------------------------


async def test_bytes_pass_both_ways_in_order(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (reader, writer):
        for chunk in (b"one ", b"two ", b"three"):
            writer.write(chunk)
        assert await read_exactly(reader, 13) == b"one two three"
    assert bytes(echo.received) == b"one two three"
    assert echo_proxy.accepted == 1


async def test_each_client_gets_a_connection_of_its_own(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (first, first_writer), connected(echo_proxy) as (second, second_writer):
        assert echo_proxy.connections == 2
        first_writer.write(b"first")
        second_writer.write(b"second")
        assert await read_exactly(second, 6) == b"second"
        assert await read_exactly(first, 5) == b"first"


async def test_a_client_that_closes_closes_the_servers_side_too(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (reader, writer):
        writer.write(b"bye")
        assert await read_exactly(reader, 3) == b"bye"
        writer.write_eof()
        assert await ended(reader)
    with anyio.fail_after(BOUND):
        await echo_proxy.wait_until(lambda: echo_proxy.connections == 0)
    await echo.wait_until(lambda: echo.ended == 1)
    assert echo_proxy.closed == 1


async def test_delay_adds_latency_to_every_chunk(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    echo_proxy.delay(DELAY, "replies")
    async with connected(echo_proxy) as (reader, writer):
        started = asyncio.get_running_loop().time()
        writer.write(b"slow")
        assert await read_exactly(reader, 4) == b"slow"
        assert asyncio.get_running_loop().time() - started >= DELAY
    with pytest.raises(ValueError, match="seconds must not be negative, got -1"):
        echo_proxy.delay(-1)
    with pytest.raises(ValueError, match="direction must be 'requests', 'replies' or 'both', got 'up'"):
        echo_proxy.delay(0, "up")  # type: ignore[arg-type]


# --- holding and releasing ---------------------------------------------------------------


async def test_held_requests_are_read_kept_and_released_in_order(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (reader, writer):
        echo_proxy.hold_requests()
        writer.write(b"held")
        with anyio.fail_after(BOUND):
            await echo_proxy.wait_until(lambda: echo_proxy.held_requests == 4)
        writer.write(b" too")
        with anyio.fail_after(BOUND):
            await echo_proxy.wait_until(lambda: echo_proxy.held_requests == 8)
        assert echo.received == b""
        assert "held_requests=8" in repr(echo_proxy)
        echo_proxy.release_requests()
        assert await read_exactly(reader, 8) == b"held too"
        assert echo_proxy.held_requests == 0


async def test_requests_are_held_from_the_one_that_contains_the_trigger(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (reader, writer):
        echo_proxy.hold_requests(at=b"STOP")
        writer.write(b"go ST")
        assert await read_exactly(reader, 5) == b"go ST"
        writer.write(b"OP here")  # the trigger straddles two chunks
        with anyio.fail_after(BOUND):
            await echo_proxy.wait_until(lambda: echo_proxy.held_requests == 7)
        assert echo.received == b"go ST"
        echo_proxy.release_requests()
        assert await read_exactly(reader, 7) == b"OP here"


async def test_replies_are_held_from_the_request_that_contains_the_trigger(
    echo: EchoServer, echo_proxy: TcpProxy
) -> None:
    async with connected(echo_proxy) as (reader, writer):
        echo_proxy.hold_replies(after=b"LAST")
        writer.write(b"first")
        assert await read_exactly(reader, 5) == b"first"
        writer.write(b"LAST")
        await echo.wait_until(lambda: echo.received.endswith(b"LAST"))  # the request went through
        with anyio.fail_after(BOUND):
            await echo_proxy.wait_until(lambda: echo_proxy.held_replies == 4)
        assert await nothing_arrives(reader)
        echo_proxy.release_replies()
        assert await read_exactly(reader, 4) == b"LAST"


async def test_a_disarmed_hold_keeps_what_it_holds_and_holds_nothing_more(
    echo: EchoServer, echo_proxy: TcpProxy
) -> None:
    async with connected(echo_proxy) as (held_reader, held), connected(echo_proxy) as (reader, writer):
        echo_proxy.hold_replies(after=b"LAST")
        held.write(b"LAST")
        with anyio.fail_after(BOUND):
            await echo_proxy.wait_until(lambda: echo_proxy.held_replies == 4)
        echo_proxy.disarm_replies()
        writer.write(b"LAST")  # armed with the first connection, and disarmed before it sent the bytes
        assert await read_exactly(reader, 4) == b"LAST"
        assert await nothing_arrives(held_reader)
        echo_proxy.release_replies()
        assert await read_exactly(held_reader, 4) == b"LAST"


async def test_a_hold_stops_only_the_connections_open_now(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (_, held):
        echo_proxy.hold_requests()
        held.write(b"held")
        async with connected(echo_proxy) as (reader, writer):
            writer.write(b"free")
            assert await read_exactly(reader, 4) == b"free"
        with anyio.fail_after(BOUND):
            await echo_proxy.wait_until(lambda: echo_proxy.held_requests == 4)
        assert echo.received == b"free"


# --- dropping, black-holing, partitioning and healing --------------------------------------


async def test_drop_resets_every_open_connection_at_once(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (first, _), connected(echo_proxy) as (second, _):
        echo_proxy.drop()
        assert echo_proxy.connections == 0
        assert echo_proxy.closed == 2
        assert await ended(first)
        assert await ended(second)
        await echo.wait_until(lambda: echo.ended == 2)
        async with connected(echo_proxy) as (reader, writer):  # the proxy itself still serves
            writer.write(b"again")
            assert await read_exactly(reader, 5) == b"again"


async def test_a_blackhole_forwards_nothing_and_closes_nothing(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (reader, writer):
        writer.write(b"before")
        assert await read_exactly(reader, 6) == b"before"
        echo_proxy.blackhole()
        writer.write(b"lost")
        assert await nothing_arrives(reader)
        assert echo.received == b"before"
        assert echo_proxy.connections == 1
        assert echo.ended == 0
        async with connected(echo_proxy) as (later, later_writer):  # only the open connections stall
            later_writer.write(b"later")
            assert await read_exactly(later, 5) == b"later"


async def test_a_partition_stalls_new_connections_too_until_healed(echo: EchoServer, echo_proxy: TcpProxy) -> None:
    async with connected(echo_proxy) as (before, before_writer):
        echo_proxy.partition()
        async with connected(echo_proxy) as (during, during_writer):  # accepted, as a lost host's would seem
            for writer in (before_writer, during_writer):
                writer.write(b"lost")
            assert await nothing_arrives(during)
            assert await nothing_arrives(before)
            assert echo.received == b""
            echo_proxy.heal()
            async with connected(echo_proxy) as (after, after_writer):
                after_writer.write(b"healed")
                assert await read_exactly(after, 6) == b"healed"
            during_writer.write(b"still lost")  # what the partition stalled stays stalled
            assert await nothing_arrives(during)
        assert echo.received == b"healed"


# --- starting and closing ------------------------------------------------------------------


async def test_closing_resets_every_connection_and_stops_listening(echo: EchoServer) -> None:
    proxy = TcpProxy("127.0.0.1", echo.port)
    with pytest.raises(RuntimeError, match="the proxy is not started"):
        _ = proxy.port
    await proxy.start()
    port = proxy.port
    with pytest.raises(RuntimeError, match="is already started"):
        await proxy.start()
    async with connected(proxy) as (reader, _):
        await proxy.aclose()
        assert await ended(reader)
        assert proxy.connections == 0
        await echo.wait_until(lambda: echo.ended == 1)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    await proxy.aclose()  # a second close does nothing


async def test_a_client_of_a_proxy_whose_server_is_gone_is_closed(echo: EchoServer) -> None:
    port = echo.port
    await echo.aclose()
    async with TcpProxy("127.0.0.1", port) as proxy:
        reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
        try:
            assert await ended(reader)
            with anyio.fail_after(BOUND):
                await proxy.wait_until(lambda: proxy.closed == 1)
            assert proxy.connections == 0
        finally:
            writer.transport.abort()
    await echo.start()  # for the fixture's close


# --- in front of Redis ---------------------------------------------------------------------


async def test_a_redis_client_through_the_proxy_sees_the_server(proxy: TcpProxy, redis_server: RedisServer) -> None:
    client = redis.asyncio.Redis(host=proxy.host, port=proxy.port, socket_timeout=BOUND)
    try:
        assert await client.ping()
        info = await client.info("server")
        assert info["tcp_port"] == redis_server.port
        assert proxy.connections == 1
        proxy.hold_replies(after=b"PING")

        async def ping() -> bool:
            return await client.ping()

        pinged = asyncio.create_task(ping())
        with anyio.fail_after(BOUND):
            await proxy.wait_until(lambda: proxy.held_replies > 0)
        assert not pinged.done()
        proxy.release_replies()
        with anyio.fail_after(BOUND):
            assert await pinged
    finally:
        await client.aclose()


async def test_a_redis_client_through_a_dropped_connection_connects_again(proxy: TcpProxy) -> None:
    client = redis.asyncio.Redis(host=proxy.host, port=proxy.port, socket_timeout=BOUND)
    try:
        assert await client.ping()
        proxy.drop()
        with contextlib.suppress(redis.ConnectionError):
            await client.ping()  # on the dropped connection: an error, or redis-py's retry on a new one
        assert await client.ping()
        assert proxy.accepted == 2
    finally:
        await client.aclose()
