"""The Lua scripts, read once from ``aiosem/lua`` and run by EVALSHA.

A script is plain data -- its source and SHA1 -- and never bound to a client
or an event loop, so one module-level instance serves every client. The
first call on a server that has not seen a script (or has flushed its cache,
or received the slot in a migration) gets NOSCRIPT and falls back to EVAL,
which also loads the script for the calls after it. On one server the
fallback loads every other script too, in the same round trip, so that the
first refresh of a new holder does not pay a second one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

from ._connection import Client, Command, PinnedConnection, is_cluster, pinned_connection

if TYPE_CHECKING:
    from collections.abc import Sequence


_LUA = files("aiosem") / "lua"
_PRELUDE = (_LUA / "_prelude.lua").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script: the shared prelude followed by one operation."""

    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> Script:
        body = (_LUA / f"{name}.lua").read_text(encoding="utf-8")
        source = f"{_PRELUDE}\n{body}"
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324 -- Redis names scripts by SHA1

    async def run(self, client: Client, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """Run the script by EVALSHA, falling back to EVAL on NOSCRIPT.

        On one server (or behind Sentinel) the script is written straight to
        a connection of the client's pool, tried again on connection errors
        as the client's ``retry`` policy says: redis-py's command layers cost
        a third of a round trip's CPU, and a step is little else. On a
        cluster, redis-py follows the slot's owner.

        Raises:
            redis.RedisError: Anything but NOSCRIPT, as redis-py raised it.
        """
        if is_cluster(client):
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await client.eval(self.source, len(keys), *keys, *args)
        async with pinned_connection(client, keys[0]) as connection:
            (reply,) = await connection.retried(lambda: self._run_on(connection, keys, args))
        return reply

    async def run_replicated(
        self, client: Client, keys: Sequence[str], args: Sequence[str | int], replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        """Run the script, then ``WAIT`` for ``replicas`` replicas to have it, at most ``timeout_ms``.

        ``WAIT`` counts the replicas that acknowledged the writes made on
        its own connection, so both go in one batch on one connection to
        the node serving ``keys[0]``.

        Returns:
            The script's reply, and how many replicas acknowledged it.

        Raises:
            redis.RedisError: Anything but NOSCRIPT, as redis-py raised it.
        """
        async with pinned_connection(client, keys[0]) as connection:
            reply, acknowledged = await self._run_on(connection, keys, args, ("WAIT", replicas, timeout_ms))
        return reply, int(acknowledged)

    async def _run_on(
        self, connection: PinnedConnection, keys: Sequence[str], args: Sequence[str | int], *after: Command
    ) -> list[Any]:
        """The replies to the script and to the ``after`` commands, in one write to ``connection``.

        On NOSCRIPT -- a server that has not seen the script, flushed its
        cache, or restarted -- every other script is loaded in the same
        round trip as the EVAL, so that the next step does not pay another.
        """
        try:
            return await connection.batch(("EVALSHA", self.sha, len(keys), *keys, *args), *after)
        except NoScriptError:
            loads = [("SCRIPT", "LOAD", script.source) for script in ALL_SCRIPTS if script is not self]
            replies = await connection.batch(*loads, ("EVAL", self.source, len(keys), *keys, *args), *after)
            return replies[len(loads) :]


FAIR_ACQUIRE = Script.load("fair_acquire")
FAIR_RELEASE = Script.load("fair_release")
FAIR_REFRESH = Script.load("fair_refresh")
BASIC_ACQUIRE = Script.load("basic_acquire")
BASIC_RELEASE = Script.load("basic_release")
LOCK_RELEASE = Script.load("lock_release")
RATE_ACQUIRE = Script.load("rate_acquire")

ALL_SCRIPTS = (FAIR_ACQUIRE, FAIR_RELEASE, FAIR_REFRESH, BASIC_ACQUIRE, BASIC_RELEASE, LOCK_RELEASE, RATE_ACQUIRE)
