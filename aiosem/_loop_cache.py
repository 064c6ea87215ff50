"""The objects the functions by name use, cached per event loop and closed with it.

Per event loop: the clients created from a URL -- a ``redis.asyncio``
client must never cross event loops -- and the semaphore and rate limiter
objects, in a cache bounded to `CACHE_SIZE` idle objects that never evicts
one in use. Each `LoopState` closes itself when its loop shuts down
(``asyncio.run``, ``asyncio.Runner`` and pytest-asyncio close the loop's
async generators first; the state watches its loop with one), and `aclose`
closes it at once. A forked child forgets every state without closing it:
the sockets are its parent's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import anyio

from . import _fork
from ._config import settings
from ._default_client import client_from_url, default_url
from ._specs import UNSET, Limited
from ._urls import close

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable

    from ._connection import Client
    from ._specs import Spec

__all__ = ["CACHE_SIZE", "Entry", "LoopState", "aclose", "checkout"]

logger = logging.getLogger("aiosem")

L = TypeVar("L", bound=Limited)

#: How many idle objects (semaphores and rate limiters) each event loop keeps, least recently used
#: first out. Objects in use (holding or waiting) are never evicted and not
#: counted. (Not `Final`: the tests make it small.)
CACHE_SIZE = 1024
#: How long closing may take, per step, before it is abandoned.
_CLOSE_TIMEOUT: Final = 5.0

_lock = threading.Lock()
_states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopState] = weakref.WeakKeyDictionary()


class Entry(Generic[L]):
    """A cached object -- a semaphore or a rate limiter -- and how many calls use it (hold or wait)."""

    __slots__ = ("cached", "epoch", "key", "state", "users")

    def __init__(self, state: LoopState, key: Hashable, cached: L) -> None:
        self.state = state
        self.key = key
        self.cached = cached
        self.epoch = state.epoch
        self.users = 0

    def __repr__(self) -> str:
        return f"Entry({self.cached!r}, users={self.users})"


class LoopState:
    """What aiosem created for one event loop: clients, semaphore and rate limiter objects.

    Used from its own loop only. ``busy`` holds the objects some call uses,
    ``idle`` the others, least recently used first; only idle objects are
    evicted. `close` empties both and closes the clients; the state can be
    used again afterwards (new clients, new objects).
    """

    __slots__ = (
        "__weakref__",
        "busy",
        "clients",
        "closed",
        "epoch",
        "idle",
        "loop",
        "retired",
        "unused",
        "users",
        "watcher",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.clients: dict[str, Client] = {}
        #: Clients closed by `aiosem.aclose` while calls still ran: a late
        #: release may have reopened a connection, closed again at the end.
        self.retired: list[Client] = []
        self.busy: dict[Hashable, Entry[Any]] = {}
        self.idle: OrderedDict[Hashable, Entry[Any]] = OrderedDict()
        #: How many calls use an object, of this epoch or an earlier one;
        #: `unused` is set while none does.
        self.users = 0
        self.unused = asyncio.Event()
        self.unused.set()
        #: Bumped by each `close`: entries of an earlier epoch are not cached again.
        self.epoch = 0
        self.closed = False
        self.watcher = _watch(self)

    def __repr__(self) -> str:
        return (
            f"LoopState(clients={len(self.clients)}, busy={len(self.busy)}, idle={len(self.idle)}, "
            f"closed={self.closed})"
        )

    def client_for(self, url: str) -> Client:
        client = self.clients.get(url)
        if client is None:
            client = self.clients[url] = client_from_url(url)
        return client

    def checkout(self, key: Hashable, create: Callable[[], L]) -> Entry[L]:
        """The object for ``key``, counted as in use until `checkin`."""
        entry: Entry[L] | None = self.busy.get(key)
        if entry is None:
            entry = self.idle.pop(key, None)
            if entry is None:
                entry = Entry(self, key, create())
            self.busy[key] = entry
        entry.users += 1
        self.users += 1
        self.unused.clear()
        return entry

    def checkin(self, entry: Entry[Any]) -> None:
        """A call is done with ``entry``; an object nobody uses joins the idle ones, and the oldest go."""
        entry.users -= 1
        self.users -= 1
        if entry.users == 0 and self.busy.get(entry.key) is entry:
            del self.busy[entry.key]
            if entry.epoch == self.epoch:
                self.idle[entry.key] = entry
                while len(self.idle) > CACHE_SIZE:
                    # Idle: it holds nothing, nobody waits on it, and it lets
                    # go of its subscription by itself: it needs no closing.
                    self.idle.popitem(last=False)
        if self.users == 0:
            self.unused.set()

    async def close(self, *, final: bool) -> None:
        """Close the objects and the clients aiosem created.

        `aiosem.aclose` closes every object. At the loop's end, running
        calls are first given time to finish, and only the objects still
        in use then are closed: an idle one holds nothing, and closing it
        would only talk to a client its owner may have closed already.
        """
        with anyio.CancelScope(shield=True):
            if final and not self.unused.is_set():
                # The loop's tasks are cancelled by now, but async generators
                # closed alongside this one may still be giving permits back.
                with anyio.move_on_after(_CLOSE_TIMEOUT):
                    await self.unused.wait()
            objects: list[Limited] = [entry.cached for entry in self.busy.values()]
            if not final:
                objects += [entry.cached for entry in self.idle.values()]
            self.busy.clear()
            self.idle.clear()
            self.epoch += 1
            clients = [*self.clients.values()]
            self.clients.clear()
            if final:
                clients += self.retired
                self.retired.clear()
                self.closed = True
            else:
                self.retired += clients
            for cached in objects:
                await _quietly(cached.aclose(), "closing %r", cached)
            for client in clients:
                await _quietly(close(client), "closing the client %r", client)


async def _quietly(step: Awaitable[None], message: str, subject: object) -> None:
    """Run a clean-up step, bounded; a failure is logged, so the other steps still run."""
    try:
        with anyio.fail_after(_CLOSE_TIMEOUT):
            await step
    except Exception:
        logger.warning(message + " failed", subject, exc_info=True)


async def _watch(state: LoopState) -> AsyncGenerator[None, None]:
    """Close ``state`` when its event loop shuts down.

    Started once, it stays suspended, known to the loop as one of its async
    generators; ``asyncio.run`` and ``asyncio.Runner`` (pytest-asyncio's,
    uvicorn's) close those after cancelling the loop's tasks and before
    closing the loop.
    """
    try:
        yield
    finally:
        await state.close(final=True)
        with _lock:
            if _states.get(state.loop) is state:
                del _states[state.loop]


async def loop_state() -> LoopState:
    """The state of the running event loop, created on first use."""
    loop = asyncio.get_running_loop()
    with _lock:
        state = _states.get(loop)
        if state is not None and not state.closed:
            return state
        for other in [other for other in _states if other.is_closed()]:
            # Closed without closing its async generators: nothing can be
            # closed any more, only forgotten.
            del _states[other]
        state = _states[loop] = LoopState(loop)
    await anext(state.watcher)
    return state


async def checkout(name: str, given: Spec[L]) -> Entry[L]:
    """Find or create the object of a call in the running loop, counted as in use.

    Every setting not given is read from the configuration now; an object
    is shared by every call with the same settings in this loop. A
    semaphore and a rate limiter of one name are two objects.

    Raises:
        LookupError: No limit (or rate) for ``name``.
        RuntimeError: Nothing is configured and this looks like one of
            several worker processes.
        ImportError: ``memory://`` without fakeredis and lupa.
        TypeError, ValueError: The object refused the settings.
    """
    current = settings()
    specific, create = given.resolve(name, current)
    state = await loop_state()
    client = given.client if given.client is not None else current.client
    if client is None:
        client = state.client_for(default_url(current.url))
    prefix = current.prefix if given.prefix is None else given.prefix
    blocking_timeout = current.blocking_timeout if given.blocking_timeout is UNSET else given.blocking_timeout
    key = (id(client), prefix, name, blocking_timeout, specific)
    return state.checkout(key, lambda: create(client, name, prefix, blocking_timeout))


async def aclose() -> None:
    """Close everything aiosem created in the running event loop.

    Every semaphore object the decorators and limiters created in this loop
    gives back the permits held through it -- calls still holding then
    raise `PermitLost` at their end, those still waiting fail -- and every
    client aiosem created from a URL in this loop is closed. Clients you
    gave (``client=``) are never closed. Call it at shutdown, once the
    limited work is done:

        try:
            await main()
        finally:
            await aiosem.aclose()

    Without it, the same happens when the event loop shuts down through
    ``asyncio.run`` or ``asyncio.Runner`` (as pytest-asyncio and uvicorn
    do). Other event loops are not touched: each is closed by its own
    `aclose` or shutdown. aiosem can be used again afterwards; it then
    creates new clients and objects.

    Failures are logged (logger ``aiosem``), not raised, so that every step
    runs; a permit that could not be given back ends with its lease.

    Cancellation:
        Shielded: a cancelled `aclose` still closes everything, each step
        bounded to 5 s.
    """
    with _lock:
        state = _states.get(asyncio.get_running_loop())
    if state is not None:
        await state.close(final=False)


def _forget() -> list[tuple[asyncio.AbstractEventLoop, LoopState]]:
    """Drop the parent's states, and the lock it may have held at the fork."""
    global _lock, _states  # noqa: PLW0603 -- a new process
    _lock = threading.Lock()
    inherited = [*_states.items()]
    _states = weakref.WeakKeyDictionary()
    return inherited


_fork.forget(_forget)
