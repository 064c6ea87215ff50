"""One connection held for several round trips, for WATCH-based steps.

``WATCH`` belongs to a connection, and redis-py's pipelines run the commands
after it one round trip each. Taking a connection from the pool and writing
whole batches to it lets a Lua-free step read under WATCH in one round trip
and write in another.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import anyio
from redis.exceptions import ResponseError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from redis.asyncio import Redis
    from redis.asyncio.connection import AbstractConnection

Command = tuple[str | bytes | int | float, ...]

try:
    # redis.asyncio packs commands in Python: several times slower than this,
    # which matters to steps of twenty commands. The output is the same for
    # the UTF-8 clients it is used with.
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover -- hiredis comes with aiosem's dependencies
    _hiredis_pack = None  # type: ignore[assignment]

_UTF8: Final = frozenset({"utf-8", "utf8", "utf_8"})


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
        await connection.send_packed_command(self._pack(commands))
        replies: list[Any] = []
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


@asynccontextmanager
async def pinned_connection(client: Redis) -> AsyncIterator[PinnedConnection]:
    """Borrow one connection of ``client``'s pool for a block.

    A block left by an exception -- a cancellation included -- may have left
    replies unread or a WATCH in place, so its connection is closed rather
    than reused.
    """
    pool = client.connection_pool
    connection: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        yield PinnedConnection(connection)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await connection.disconnect(nowait=True)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await pool.release(connection)
