"""One connection held for several round trips, for WATCH-based steps.

``WATCH`` belongs to a connection, and redis-py's pipelines run the commands
after it one round trip each. Taking a connection from the pool and writing
whole batches to it lets a Lua-free step read under WATCH in one round trip
and write in another.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from redis.exceptions import ResponseError

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.connection import AbstractConnection

Command = Sequence[str | bytes | int | float]


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
        await connection.send_packed_command(connection.pack_commands(commands))
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
