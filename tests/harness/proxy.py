"""A TCP proxy in front of a Redis server, for tests that need the network to misbehave.

The proxy listens on a free loopback port and runs in the test's own event
loop. Each connection it accepts gets a connection of its own to the server,
and the bytes of each direction -- *requests* (client to server) and
*replies* (server to client) -- pass through a pipe the test can act on:

- `TcpProxy.delay` adds latency to every chunk (ordered, not a bandwidth cap);
- `TcpProxy.hold_requests` / `TcpProxy.hold_replies` stop forwarding on the
  connections open now -- at once, or from the request that contains a given
  command -- while still reading what arrives, and `release_requests` /
  `release_replies` forward what was held, in order;
- `TcpProxy.drop` closes every connection open now, abruptly (RST);
- `TcpProxy.blackhole` stalls the connections open now: nothing more is
  forwarded in either direction, and nothing is closed;
- `TcpProxy.partition` stalls every connection, open now or opened later
  (a client still connects: the proxy accepts it, as a host whose replies
  are lost would seem to), until `TcpProxy.heal` lets new connections
  through again.

A client that closes while its bytes are held behaves as it would on a real
network: what it sent before closing still reaches the server, first, once
released. So a cancelled redis-py command whose connection was dropped can
be made to arrive *after* cleanup sent on another connection.

Nothing here sleeps to wait for something: every wait is on an event, and
tests wait for the proxy's state with `TcpProxy.wait_until`. The only sleep
is the latency `delay` asks for.

    async with TcpProxy(server.host, server.port) as proxy:
        client = redis.asyncio.Redis(host=proxy.host, port=proxy.port)
        proxy.hold_replies(after=b"EVALSHA")
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from typing import TYPE_CHECKING, Final, Literal, cast

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

__all__ = ["Direction", "TcpProxy"]

#: Which way bytes travel: ``requests`` from client to server, ``replies``
#: back, or ``both``.
Direction = Literal["requests", "replies", "both"]

#: The most one read takes from a socket.
_CHUNK: Final = 65536
#: How long closing the proxy, or one of its sockets, may take.
_CLOSE_TIMEOUT: Final = 5.0
#: How much of the last forwarded request a trigger may straddle.
_TAIL: Final = 256


class _Pipe:
    """One direction of one connection: reads chunks as they come, forwards them in order."""

    __slots__ = (
        "_chunks",
        "_notify",
        "_on_chunk",
        "_source",
        "_tail",
        "_target",
        "_wakeup",
        "blackholed",
        "buffered",
        "delay",
        "held",
    )

    def __init__(
        self,
        source: asyncio.StreamReader,
        target: asyncio.StreamWriter,
        *,
        delay: float,
        notify: Callable[[], None],
        on_chunk: Callable[[bytes, bytes], bool] | None = None,
    ) -> None:
        self._source = source
        self._target = target
        self._notify = notify
        #: Called with the end of the last chunk forwarded and the next chunk,
        #: before the chunk is forwarded; ``True`` holds it.
        self._on_chunk = on_chunk
        self._tail = b""
        #: Chunks read and not yet forwarded, each with when it may go; ``b""`` is the end of stream.
        self._chunks: deque[tuple[float, bytes]] = deque()
        self._wakeup = asyncio.Event()
        #: Latency added to each chunk, in seconds.
        self.delay = delay
        #: Forwarding is stopped; reading goes on.
        self.held = False
        #: Everything read is discarded, and the end of stream is not passed on.
        self.blackholed = False
        #: Bytes read and not yet forwarded.
        self.buffered = 0

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False
        self._wakeup.set()

    def blackhole(self) -> None:
        self.blackholed = True
        self._chunks.clear()
        self.buffered = 0

    async def read(self) -> None:
        """Read until the end of stream, queueing each chunk for `forward`."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await self._source.read(_CHUNK)
            except OSError:  # a reset is an end of stream too
                data = b""
            if not self.blackholed:
                self._chunks.append((loop.time() + self.delay, data))
                self.buffered += len(data)
                self._wakeup.set()
                self._notify()
            if not data:
                return

    async def forward(self) -> None:
        """Forward queued chunks in order until the end of stream has been passed on."""
        loop = asyncio.get_running_loop()
        while True:
            while self.held or self.blackholed or not self._chunks:
                self._wakeup.clear()
                await self._wakeup.wait()
            due, data = self._chunks[0]
            if (late := due - loop.time()) > 0:
                await asyncio.sleep(late)  # the latency asked for, not a wait for something to happen
                continue  # held or blackholed meanwhile?
            if data and self._on_chunk is not None and self._on_chunk(self._tail, data):
                continue
            self._chunks.popleft()
            self.buffered -= len(data)
            if not data:
                self._end()
                self._notify()
                return
            self._tail = (self._tail + data)[-_TAIL:]
            await self._send(data)
            self._notify()

    async def _send(self, data: bytes) -> None:
        if self._target.transport.is_closing():
            return  # the peer is gone: what it would have received is lost, as on a network
        self._target.write(data)
        with contextlib.suppress(OSError):
            await self._target.drain()

    def _end(self) -> None:
        if self._target.transport.is_closing() or not self._target.can_write_eof():
            return
        with contextlib.suppress(OSError):
            self._target.write_eof()


class _Connection:
    """A client's connection and the proxy's own connection to the server for it."""

    __slots__ = ("client", "replies", "reply_trigger", "request_trigger", "requests", "server", "task")

    def __init__(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        *,
        delays: dict[Literal["requests", "replies"], float],
        notify: Callable[[], None],
    ) -> None:
        self.client = client[1]
        self.server = server[1]
        self.requests = _Pipe(client[0], server[1], delay=delays["requests"], notify=notify, on_chunk=self._on_request)
        self.replies = _Pipe(server[0], client[1], delay=delays["replies"], notify=notify)
        #: Start holding requests at the first one that contains this.
        self.request_trigger: bytes | None = None
        #: Start holding replies just before forwarding a request that contains this.
        self.reply_trigger: bytes | None = None
        self.task: asyncio.Task[None] | None = None

    def pipe(self, direction: Literal["requests", "replies"]) -> _Pipe:
        return self.requests if direction == "requests" else self.replies

    def _on_request(self, tail: bytes, data: bytes) -> bool:
        if self.reply_trigger is not None and _arrives_in(self.reply_trigger, tail, data):
            self.reply_trigger = None
            self.replies.hold()
        if self.request_trigger is not None and _arrives_in(self.request_trigger, tail, data):
            self.request_trigger = None
            self.requests.hold()
            return True
        return False

    async def run(self) -> None:
        """Pass bytes both ways until each direction has passed on its end of stream."""
        loops = [
            asyncio.create_task(loop())
            for loop in (self.requests.read, self.requests.forward, self.replies.read, self.replies.forward)
        ]
        try:
            await asyncio.gather(*loops)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.wait(loops, timeout=_CLOSE_TIMEOUT)

    def abort(self) -> None:
        """Reset both sockets at once, and stop passing bytes."""
        for writer in (self.client, self.server):
            writer.transport.abort()
        if self.task is not None:
            self.task.cancel()

    async def close(self) -> None:
        """Close both sockets and wait, boundedly, until they are closed."""
        for writer in (self.client, self.server):
            writer.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(self.client.wait_closed(), self.server.wait_closed(), return_exceptions=True),
                _CLOSE_TIMEOUT,
            )


class TcpProxy:
    """A TCP proxy on ``127.0.0.1`` in front of ``host:port``, running in the current event loop.

    Start it with ``async with`` (or `start` and `aclose`) and point a client
    at `host` and `port`. Every control acts at once and synchronously; to
    wait for its effect, use `wait_until` with the counters the proxy keeps
    (`connections`, `accepted`, `closed`, `held_requests`, `held_replies`).

    Args:
        host: The server's address.
        port: The server's port.
    """

    __slots__ = (
        "_changed",
        "_delays",
        "_errors",
        "_listener",
        "_open",
        "_partitioned",
        "_pending",
        "_tasks",
        "_upstream",
        "accepted",
        "closed",
    )

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._listener: socket.socket | None = None
        #: Sockets accepted and not yet in the hands of a transport.
        self._pending: set[socket.socket] = set()
        self._open: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._delays: dict[Literal["requests", "replies"], float] = {"requests": 0.0, "replies": 0.0}
        self._changed = asyncio.Event()
        self._errors: list[BaseException] = []
        self._partitioned = False
        #: Connections accepted so far.
        self.accepted = 0
        #: Connections that ended so far: both directions done, dropped, or shut down.
        self.closed = 0

    def __repr__(self) -> str:
        return (
            f"TcpProxy({self.host}:{self.port} -> {self._upstream[0]}:{self._upstream[1]}, "
            f"connections={self.connections}, held_requests={self.held_requests}, held_replies={self.held_replies})"
        )

    # --- life cycle --------------------------------------------------------------

    async def start(self) -> None:
        """Listen on a free loopback port."""
        if self._listener is not None:
            raise RuntimeError(f"{self!r} is already started")
        # A socket and a reader callback of our own, not asyncio.start_server
        # or sock_accept: closed just as they accept, both leak that socket.
        listener = socket.socket()
        listener.setblocking(False)  # noqa: FBT003 -- the socket API
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept, listener)

    async def aclose(self) -> None:
        """Stop listening, reset every connection, and wait (at most 5 s) until all is closed.

        Raises:
            Exception: The first error a connection of the proxy died of, if
                any: a bug in the proxy, not a network failure.
        """
        listener, self._listener = self._listener, None
        if listener is None:
            return
        asyncio.get_running_loop().remove_reader(listener.fileno())
        listener.close()
        for connection in list(self._open):
            connection.abort()
        for task in self._tasks:
            task.cancel()  # connections still being set up
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_CLOSE_TIMEOUT)
        for accepted in self._pending:
            accepted.close()  # its task was cancelled before it began
            self.closed += 1
        self._pending.clear()
        if self._errors:
            raise self._errors[0]

    async def __aenter__(self) -> TcpProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def host(self) -> str:
        """The address clients connect to."""
        return "127.0.0.1"

    @property
    def port(self) -> int:
        """The port clients connect to."""
        if self._listener is None:
            raise RuntimeError("the proxy is not started")
        port: int = self._listener.getsockname()[1]
        return port

    # --- state ------------------------------------------------------------------

    @property
    def connections(self) -> int:
        """Connections open now (a half-closed one counts until both directions are done)."""
        return len(self._open)

    @property
    def held_requests(self) -> int:
        """Bytes from clients the proxy holds now."""
        return sum(c.requests.buffered for c in self._open if c.requests.held)

    @property
    def held_replies(self) -> int:
        """Bytes from the server the proxy holds now."""
        return sum(c.replies.buffered for c in self._open if c.replies.held)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` is true; it is checked after every change in the proxy.

        Bound the wait yourself (``anyio.fail_after``).
        """
        while True:
            changed = self._changed
            if predicate():
                return
            await changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- controls -----------------------------------------------------------------

    def delay(self, seconds: float, direction: Direction = "both") -> None:
        """Hold each chunk ``seconds`` before forwarding it, on every connection, now and later."""
        if seconds < 0:
            raise ValueError(f"seconds must not be negative, got {seconds}")
        for side in _sides(direction):
            self._delays[side] = seconds
            for connection in self._open:
                connection.pipe(side).delay = seconds

    def hold_requests(self, at: bytes | None = None) -> None:
        """Stop forwarding requests on the connections open now; new connections are not held.

        Args:
            at: Hold from the first request containing these bytes (a
                command's name, say) instead of at once; it and everything
                after it is held.
        """
        for connection in self._open:
            if at is None:
                connection.requests.hold()
            else:
                connection.request_trigger = at

    def release_requests(self) -> None:
        """Forward every held request, in order, and disarm `hold_requests`."""
        for connection in self._open:
            connection.request_trigger = None
            connection.requests.release()

    def hold_replies(self, after: bytes | None = None) -> None:
        """Stop forwarding replies on the connections open now; new connections are not held.

        Args:
            after: Hold from just before the first request containing these
                bytes is forwarded instead of at once, so that its reply,
                and everything after it, is held.
        """
        for connection in self._open:
            if after is None:
                connection.replies.hold()
            else:
                connection.reply_trigger = after

    def disarm_replies(self) -> None:
        """Disarm `hold_replies` on the connections that have not met its bytes yet; what is held stays held.

        For a test that holds one step's reply while other steps -- which
        may send the same bytes, on other connections opened before the
        hold -- must go on.
        """
        for connection in self._open:
            connection.reply_trigger = None

    def release_replies(self) -> None:
        """Forward every held reply, in order, and disarm `hold_replies`."""
        for connection in self._open:
            connection.reply_trigger = None
            connection.replies.release()

    def drop(self) -> None:
        """Reset every connection open now, both sides, at once."""
        for connection in list(self._open):
            self._open.discard(connection)
            self.closed += 1
            connection.abort()
        self._notify()

    def blackhole(self) -> None:
        """Stall the connections open now: forward nothing more either way, close nothing."""
        for connection in self._open:
            connection.requests.blackhole()
            connection.replies.blackhole()
        self._notify()

    def partition(self) -> None:
        """Stall every connection, those open now and those opened later, until `heal`."""
        self._partitioned = True
        self.blackhole()

    def heal(self) -> None:
        """Let connections opened from now on through; those stalled by `partition` stay stalled."""
        self._partitioned = False

    # --- connections ------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        try:
            accepted, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return  # another wake-up took it
        accepted.setblocking(False)  # noqa: FBT003 -- the socket API
        # Forward each chunk at once: with Nagle's algorithm a reply split in
        # two waits for the client's delayed ACK (40 ms on Linux).
        accepted.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending.add(accepted)
        self.accepted += 1
        task = asyncio.get_running_loop().create_task(self._serve(accepted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, accepted: socket.socket) -> None:
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            client = await asyncio.open_connection(sock=accepted)
            self._pending.discard(accepted)
            upstream = await asyncio.open_connection(*self._upstream)
        except (OSError, asyncio.CancelledError):  # the server is gone, or the proxy is closing
            if client is None:
                self._pending.discard(accepted)
                accepted.close()
            else:
                client[1].transport.abort()
            self.closed += 1
            self._notify()
            return
        connection = _Connection(client, upstream, delays=self._delays, notify=self._notify)
        connection.task = cast("asyncio.Task[None]", asyncio.current_task())
        if self._partitioned:
            connection.requests.blackhole()
            connection.replies.blackhole()
        self._open.add(connection)
        self._notify()
        try:
            await connection.run()
        except asyncio.CancelledError:
            pass  # dropped, or the proxy is closing: this task is the connection's own
        except Exception as error:  # noqa: BLE001 -- kept, and raised by aclose: a bug in the proxy
            self._errors.append(error)
        finally:
            if connection in self._open:
                self._open.discard(connection)
                self.closed += 1
            await connection.close()
            self._notify()


def _arrives_in(pattern: bytes, tail: bytes, data: bytes) -> bool:
    """Whether ``pattern`` ends inside ``data``, which follows ``tail`` in the stream."""
    keep = len(pattern) - 1
    return pattern in (tail[-keep:] if keep > 0 else b"") + data


def _sides(direction: Direction) -> tuple[Literal["requests", "replies"], ...]:
    if direction == "both":
        return ("requests", "replies")
    if direction not in ("requests", "replies"):
        raise ValueError(f"direction must be 'requests', 'replies' or 'both', got {direction!r}")
    return (direction,)
