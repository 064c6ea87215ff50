"""What one process shares between the calls it makes to one Redis.

`Lane` coalesces concurrent steps of one kind into one call at a time, so
that a thousand waiters in a process cost a handful of connections, not a
thousand. `Subscriber` keeps one pub/sub connection per client and event
loop, on which every semaphore of the process hears about permits handed to
its waiters; on a cluster, `ShardedSubscriber` keeps one per node, each
subscribed by sharded pub/sub to the channels of the slots the node serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, NamedTuple, TypeVar

import anyio
import redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import ConnectionPool

from ._connection import REDIRECTS, keeping_connections, reroute

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from redis.asyncio import Redis
    from redis.asyncio.client import PubSub
    from redis.asyncio.cluster import ClusterNode

    from ._connection import Client

    #: Where a subscriber delivers a channel's messages; held weakly.
    Handler = weakref.WeakMethod[Callable[[str], None]]

logger = logging.getLogger("aiosem")

R = TypeVar("R")
P = TypeVar("P", bound="_PerLoop")

#: How long a new subscription may take to be confirmed.
_SUBSCRIBE_TIMEOUT: Final = 5.0
#: How often an idle subscriber looks for semaphores that are gone.
_PRUNE_INTERVAL: Final = 1.0
#: How long the pub/sub connection may stay silent before it is asked for a
#: PONG: a connection stalled without closing delivers nothing and fails
#: nothing, and only an unanswered PING tells.
_PROBE_AFTER: Final = 5.0
#: Pauses between reconnection attempts grow by this much, up to the longest.
_RECONNECT_PAUSE: Final = 0.05
_LONGEST_RECONNECT_PAUSE: Final = 1.0


class Submission:
    """The identifiers of one call to a `Lane`, and whether they were sent."""

    __slots__ = ("identifiers", "sent", "waiting_since")

    def __init__(self, identifiers: Sequence[str]) -> None:
        self.identifiers = identifiers
        #: Set once a call carrying these identifiers has started: from then
        #: on Redis may act on them, even if the caller is cancelled.
        self.sent = False
        #: When the call began to wait for a batch (loop time), if it had to.
        self.waiting_since: float | None = None


class Lane(Generic[R]):
    """Coalesces concurrent calls of one kind into one call at a time.

    A call made while none is in flight runs at once, in the caller's own
    task, so an uncontended call costs exactly what a direct one does. Calls
    made while one is in flight wait, and then all go together in the next
    call, whose result each reads its part of. A caller cancelled before its
    batch starts is left out of it.

    While the lane is crowded -- its last batch carried several calls --
    a call made while none is in flight does not go at once either: it
    starts a batch in a task of its own, which the calls made in the same
    turn of the event loop join. Many tasks woken together by one reply
    would otherwise send the first of them alone and the rest after it:
    twice the round trips.

    ``run`` takes the identifiers of a batch, and when the longest-waiting
    call of the batch began to wait (``None``: nobody waited), and returns
    a result whose ``values`` hold one value per identifier. A call's bound
    counts from its call, waiting included.
    """

    __slots__ = ("_busy", "_crowded", "_flusher", "_pending", "_run")

    def __init__(self, run: Callable[[Sequence[str], float | None], Awaitable[R]]) -> None:
        self._run = run
        self._busy = False
        self._crowded = False
        self._pending: list[tuple[Submission, asyncio.Future[tuple[Sequence[int], R]]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, submission: Submission) -> tuple[Sequence[int], R]:
        """Run a step for the submission's identifiers; return their values and the whole result.

        Cancellation:
            If ``submission.sent`` is set, the step may still take effect and
            the caller must undo what it may have done.
        """
        if self._busy or self._crowded:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[tuple[Sequence[int], R]] = loop.create_future()
            submission.waiting_since = loop.time()
            self._pending.append((submission, future))
            if not self._busy:
                self._busy = True
                self._flusher = loop.create_task(self._flush())
            return await future
        self._busy = True
        submission.sent = True
        try:
            result = await self._run(submission.identifiers, None)
        finally:
            if self._pending:
                self._flusher = asyncio.get_running_loop().create_task(self._flush())
            else:
                self._busy = False
        return result.values, result  # type: ignore[attr-defined]

    async def _flush(self) -> None:
        async with keeping_connections():
            try:
                await self._flush_batches()
            finally:
                # Before the kept connections go back: a call made meanwhile starts its own batch.
                self._busy = False
                self._flusher = None

    async def _flush_batches(self) -> None:
        while self._pending:
            batch = [(submission, future) for submission, future in self._pending if not future.done()]
            self._pending = []
            self._crowded = len(batch) > 1
            if not batch:
                continue
            for submission, _ in batch:
                submission.sent = True
            waiting_since = min((s.waiting_since for s, _ in batch if s.waiting_since is not None), default=None)
            try:
                result = await self._run([i for submission, _ in batch for i in submission.identifiers], waiting_since)
            except Exception as error:  # noqa: BLE001 -- every waiter of the batch gets the batch's error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            except BaseException:
                for _, future in batch:
                    future.cancel()
                raise
            values = result.values  # type: ignore[attr-defined]
            offset = 0
            for submission, future in batch:
                count = len(submission.identifiers)
                if not future.done():
                    future.set_result((values[offset : offset + count], result))
                offset += count


class _Kinds(NamedTuple):
    """The commands and message types of classic or of sharded pub/sub."""

    subscribe: str
    unsubscribe: str
    message: str


_CLASSIC: Final = _Kinds("subscribe", "unsubscribe", "message")
_SHARDED: Final = _Kinds("ssubscribe", "sunsubscribe", "smessage")


class _PerLoop:
    """One instance per client and event loop, made on first use: a client's connections belong to one loop."""

    __slots__ = ()

    _registry: ClassVar[weakref.WeakKeyDictionary[Any, Any]]
    _loop: asyncio.AbstractEventLoop

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._registry = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls: type[P], client: Any) -> P:
        """The instance serving ``client`` in the running event loop."""
        instance: P | None = cls._registry.get(client)
        if instance is None or instance.loop is not asyncio.get_running_loop():
            instance = cls._registry[client] = cls(client)  # type: ignore[call-arg]
        return instance

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this instance serves."""
        return self._loop


class Subscriber(_PerLoop):
    """One pub/sub connection of a client, shared by every semaphore of the process.

    Each semaphore subscribes its own channel with a handler, which is held
    weakly: a semaphore that is gone is unsubscribed the next time the
    subscriber is idle. The reader survives connection errors: redis-py
    reconnects and subscribes again, and a message lost meanwhile only
    delays a waiter until its semaphore's next re-check.

    With ``on_dropped`` (a cluster node's subscriber, by sharded pub/sub),
    the subscriber neither reconnects nor subscribes again on its own: the
    channels a failed connection, or the server, dropped -- a slot that moved
    away unsubscribes its channels -- are handed to ``on_dropped``, to be
    subscribed again wherever their slots are served now.
    """

    __slots__ = (
        "__weakref__",
        "_client",
        "_encoder",
        "_handlers",
        "_kinds",
        "_loop",
        "_on_dropped",
        "_pubsub",
        "_reader",
        "_ready",
        "_sending",
        "_subscribing",
    )

    def __init__(self, client: Redis, on_dropped: Callable[[dict[str, Handler]], None] | None = None) -> None:
        self._client = client
        self._pubsub: PubSub = client.pubsub()
        # Channels come back as the client encoded them, which may not be UTF-8.
        self._encoder = client.get_encoder()  # type: ignore[no-untyped-call]
        self._kinds = _CLASSIC if on_dropped is None else _SHARDED
        self._on_dropped = on_dropped
        self._loop = asyncio.get_running_loop()
        self._handlers: dict[str, Handler] = {}
        self._ready: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._subscribing: set[asyncio.Task[None]] = set()
        # redis-py's PubSub connects on its first command, and concurrent first
        # commands each connect: all but one subscription then lands on a
        # connection nobody reads. One command at a time.
        self._sending = asyncio.Lock()

    @property
    def channels(self) -> int:
        """How many channels are subscribed, or being subscribed."""
        return len(self._handlers)

    async def subscribe(self, channel: str, handler: Callable[[str], None] | Handler) -> None:
        """Deliver the messages of ``channel`` to ``handler`` from now on.

        Returns once the server has confirmed the subscription; concurrent
        calls for one channel share one subscription.

        Raises:
            TimeoutError: No confirmation within 5 s.
            redis.RedisError: The subscription failed or was refused.
        """
        ready = self._ready.get(channel)
        if ready is None:
            weak = handler if isinstance(handler, weakref.WeakMethod) else weakref.WeakMethod(handler)
            self._handlers[channel] = weak
            ready = self._ready[channel] = self._loop.create_future()
            # Sent from a task of the subscriber's own, so that a caller
            # cancelled meanwhile cannot take the subscription from the others.
            self._subscribing.add(task := self._loop.create_task(self._send_subscribe(channel, ready)))
            task.add_done_callback(self._subscribing.discard)
        with anyio.fail_after(_SUBSCRIBE_TIMEOUT):
            await asyncio.shield(ready)

    async def unsubscribe(self, channel: str) -> None:
        """Stop delivering the messages of ``channel``; the reader ends with the last channel.

        A failure is logged, not raised: the server forgets the subscription
        with the connection, and the reader prunes it when idle.
        """
        if self._ready.pop(channel, None) is None:
            return
        del self._handlers[channel]
        if not self._handlers and self._reader is not None:
            # The last channel: the reader closes its connection, which ends
            # every subscription on it; a subscribe from now on starts afresh.
            reader, self._reader = self._reader, None
            self._pubsub = self._client.pubsub()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            return
        try:
            async with self._sending:
                await getattr(self._pubsub, self._kinds.unsubscribe)(channel)
        except Exception:  # the connection's end drops the subscription anyway
            logger.debug("unsubscribing from %s failed", channel, exc_info=True)

    async def _send_subscribe(self, channel: str, ready: asyncio.Future[None]) -> None:
        try:
            async with self._sending:
                await getattr(self._pubsub, self._kinds.subscribe)(channel)
        except Exception as error:  # noqa: BLE001 -- every caller waiting on this subscription gets the error
            if self._ready.get(channel) is ready:
                del self._handlers[channel], self._ready[channel]
            if not ready.done():
                ready.set_exception(error)
            return
        if self._reader is None:
            self._reader = self._loop.create_task(self._read())

    async def _read(self) -> None:
        failures = 0
        task = asyncio.current_task()
        pubsub = self._pubsub
        heard, probed = self._loop.time(), None
        try:
            while self._handlers and self._pubsub is pubsub:
                raise_if_cancel_swallowed(task)
                try:
                    message = await pubsub.get_message(timeout=_PRUNE_INTERVAL)
                except redis.ResponseError as error:
                    # A refusal (an ACL without the channel, say) answers the
                    # subscriptions still waiting for their confirmation.
                    self._refuse(error)
                    continue
                except redis.RedisError:
                    if self._on_dropped is not None:
                        # Subscribed again elsewhere, wherever the slots went.
                        logger.debug("a pub/sub connection to a cluster node failed", exc_info=True)
                        self._drop(list(self._handlers))
                        continue
                    # redis-py reconnects and subscribes again on the next read.
                    if failures == 0:
                        logger.warning("aiosem's pub/sub connection failed; reconnecting", exc_info=True)
                    failures += 1
                    await anyio.sleep(min(_RECONNECT_PAUSE * failures, _LONGEST_RECONNECT_PAUSE))
                    continue
                failures = 0
                if message is not None:
                    heard, probed = self._loop.time(), None
                    await self._deliver(message)
                    continue
                await self._prune()
                now = self._loop.time()
                if probed is not None and now - probed >= _SUBSCRIBE_TIMEOUT:
                    await self._close_stalled(pubsub)
                    heard, probed = now, None
                elif probed is None and now - heard >= _PROBE_AFTER:
                    await self._ping(pubsub)
                    probed = now
        finally:
            # A subscribe made while this closes must not lose its connection:
            # it gets a new pub/sub object, and this one is closed alone.
            if self._reader is task:
                self._reader = None
            if self._pubsub is pubsub:
                self._pubsub = self._client.pubsub()
            with anyio.CancelScope(shield=True), anyio.move_on_after(_SUBSCRIBE_TIMEOUT):
                try:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
                except redis.RedisError:
                    logger.debug("closing aiosem's pub/sub connection failed", exc_info=True)

    async def _ping(self, pubsub: PubSub) -> None:
        """Ask a connection silent for a while for a PONG, which the reader takes as any message."""
        with anyio.move_on_after(_SUBSCRIBE_TIMEOUT):
            async with self._sending:
                await pubsub.ping()

    async def _close_stalled(self, pubsub: PubSub) -> None:
        """Close a connection that never answered its PING.

        redis-py connects again at the next read and subscribes to every
        channel anew (on a cluster node, the read fails instead, and the
        channels are subscribed wherever their slots now are).
        """
        logger.warning("aiosem's pub/sub connection stopped answering; reconnecting")
        if pubsub.connection is not None:
            await pubsub.connection.disconnect(nowait=True)

    async def _deliver(self, message: dict[str, Any]) -> None:
        channel = self._text(message["channel"])
        ready = self._ready.get(channel)
        kind = message["type"]
        if kind == self._kinds.subscribe and ready is not None and not ready.done():
            ready.set_result(None)
        elif kind == self._kinds.message:
            handler = self._handlers.get(channel)
            method = None if handler is None else handler()
            if method is not None:
                method(self._text(message["data"]))
        elif kind == self._kinds.unsubscribe and self._on_dropped is not None and ready is not None:
            # Not asked for (those leave `_ready` first): the slot moved to
            # another node, whose subscriber takes the channel over. redis-py
            # forgets it only once it has unsubscribed it itself.
            async with self._sending:
                await self._pubsub.sunsubscribe(channel)
            self._drop([channel])

    def _text(self, value: Any) -> str:
        """A channel or message as a str, decoded as the client encodes."""
        if isinstance(value, bytes):
            return value.decode(self._encoder.encoding, self._encoder.encoding_errors)
        return str(value)

    def _drop(self, channels: Sequence[str]) -> None:
        assert self._on_dropped is not None  # noqa: S101 -- only a cluster node's subscriber drops channels
        dropped = {channel: self._handlers.pop(channel) for channel in channels}
        for channel in channels:
            ready = self._ready.pop(channel)
            if not ready.done():
                ready.set_exception(redis.ConnectionError(f"the subscription to {channel} was dropped"))
        self._on_dropped(dropped)

    def _refuse(self, error: redis.ResponseError) -> None:
        refused = [channel for channel, ready in self._ready.items() if not ready.done()]
        for channel in refused:
            self._ready.pop(channel).set_exception(error)
            del self._handlers[channel]
        if not refused:
            logger.warning("aiosem's pub/sub connection got an error", exc_info=error)

    async def _prune(self) -> None:
        gone = [channel for channel, handler in self._handlers.items() if handler() is None]
        for channel in gone:
            del self._handlers[channel], self._ready[channel]
        # One at a time: sharded channels of several slots in one command
        # would be refused.
        for channel in gone:
            await getattr(self._pubsub, self._kinds.unsubscribe)(channel)


class ShardedSubscriber(_PerLoop):
    """The subscriptions of a cluster client: each channel by sharded pub/sub on its slot's node.

    One `Subscriber` per node, on a connection of its own. A channel whose
    subscription a node drops -- its slot moved, or the node failed -- is
    subscribed again in the background on whichever node serves its slot
    once the client has learnt the new layout, for as long as its handler
    lives; messages lost meanwhile only delay waiters until their next
    re-check.
    """

    __slots__ = ("__weakref__", "_client", "_loop", "_nodes", "_resubscribing", "_wanted")

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        #: The subscriber of each node, by node name.
        self._nodes: dict[str, tuple[Subscriber, Redis]] = {}
        #: Every channel subscribed, or to subscribe again, with its handler.
        self._wanted: dict[str, Handler] = {}
        self._resubscribing: set[asyncio.Task[None]] = set()

    async def subscribe(self, channel: str, handler: Callable[[str], None]) -> None:
        """Deliver the messages of ``channel`` to ``handler`` from now on, from the node of its slot.

        Raises:
            TimeoutError: No confirmation within 5 s.
            redis.RedisError: The subscription failed or was refused.
        """
        self._wanted[channel] = weak = weakref.WeakMethod(handler)
        with anyio.fail_after(_SUBSCRIBE_TIMEOUT):
            await self._subscribe_where_served(channel, weak)

    async def _subscribe_where_served(self, channel: str, handler: Handler) -> None:
        for attempt in itertools.count():
            await self._client.initialize()
            node: ClusterNode = self._client.get_node_from_key(channel)  # type: ignore[assignment]
            try:
                await self._node_subscriber(node).subscribe(channel, handler)
            except REDIRECTS as error:
                await reroute(self._client, error, attempt)
                continue
            return

    def _node_subscriber(self, node: ClusterNode) -> Subscriber:
        entry = self._nodes.get(node.name)
        if entry is None:
            pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            client = redis.asyncio.Redis(connection_pool=pool)
            entry = self._nodes[node.name] = (Subscriber(client, on_dropped=self._dropped), client)
        return entry[0]

    async def unsubscribe(self, channel: str) -> None:
        """Stop delivering the messages of ``channel``; failures are logged, as `Subscriber.unsubscribe` does."""
        if self._wanted.pop(channel, None) is None:
            return
        for subscriber, _ in list(self._nodes.values()):
            await subscriber.unsubscribe(channel)
        await self._close_idle()

    async def _close_idle(self) -> None:
        for name, (subscriber, client) in list(self._nodes.items()):
            if subscriber.channels == 0:
                del self._nodes[name]
                await client.aclose(close_connection_pool=True)

    def _dropped(self, handlers: dict[str, Handler]) -> None:
        wanted = {channel: handler for channel, handler in handlers.items() if self._wanted.get(channel) is handler}
        if wanted:
            task = self._loop.create_task(self._resubscribe(wanted))
            self._resubscribing.add(task)
            task.add_done_callback(self._resubscribing.discard)

    async def _resubscribe(self, handlers: dict[str, Handler]) -> None:
        failures = 0
        while handlers:
            channel, handler = next(iter(handlers.items()))
            if self._wanted.get(channel) is not handler or handler() is None:
                del handlers[channel]
                continue
            try:
                with anyio.fail_after(_SUBSCRIBE_TIMEOUT):
                    await self._subscribe_where_served(channel, handler)
            except (TimeoutError, redis.RedisError, redis.exceptions.RedisClusterException):
                # The cluster is failing over, or the layout is in flux.
                if failures == 0:
                    logger.warning("could not subscribe again to %s on the cluster; retrying", channel, exc_info=True)
                failures += 1
                await anyio.sleep(min(_RECONNECT_PAUSE * failures, _LONGEST_RECONNECT_PAUSE))
                with contextlib.suppress(Exception):
                    await self._client.nodes_manager.initialize()
                continue
            failures = 0
            del handlers[channel]
        await self._close_idle()


def subscriber_of(client: Client) -> Subscriber | ShardedSubscriber:
    """The subscriber of ``client`` in the running event loop: sharded on a cluster."""
    if isinstance(client, RedisCluster):
        return ShardedSubscriber.of(client)
    return Subscriber.of(client)


def raise_if_cancel_swallowed(task: asyncio.Task[Any] | None) -> None:
    """Raise `asyncio.CancelledError` if ``task`` was cancelled and carried on regardless.

    A cancellation that reaches redis-py's read as its own read timeout
    expires can come back as that timeout -- ``get_message`` then returns
    ``None`` -- leaving the task asked to cancel but still looping: seen here,
    under load, as ``asyncio.run`` hanging at exit. Python 3.10 has no
    ``cancelling()`` to tell.
    """
    cancelling = getattr(task, "cancelling", None)
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError
