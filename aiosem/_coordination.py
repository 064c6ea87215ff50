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
import logging
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, NamedTuple, Protocol, TypeVar

import anyio
import redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import ConnectionPool

from ._background import Background
from ._connection import keeping_connections, redirected
from ._timing import CLOCK_SLACK, Backoff

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from redis.asyncio import Redis
    from redis.asyncio.client import PubSub
    from redis.asyncio.cluster import ClusterNode

    from ._connection import Client

    #: Where a subscriber delivers a channel's messages; held weakly.
    Handler = weakref.ref["Listener"]

logger = logging.getLogger("aiosem")

R = TypeVar("R")
T = TypeVar("T")
P = TypeVar("P", bound="_PerLoop")

#: How long a new subscription may take to be confirmed.
_SUBSCRIBE_TIMEOUT: Final = 5.0
#: How often an idle subscriber looks for semaphores that are gone.
_PRUNE_INTERVAL: Final = 1.0
#: How long the pub/sub connection may stay silent before it is asked for a
#: PONG: a connection stalled without closing delivers nothing and fails
#: nothing, and only an unanswered PING tells.
_PROBE_AFTER: Final = 5.0
#: Pauses between reconnection attempts: from the first, doubling, to the longest.
_RECONNECT_PAUSE: Final = 0.05
_LONGEST_RECONNECT_PAUSE: Final = 1.0


class Listener(Protocol):
    """What a subscriber delivers a channel's messages to: a semaphore object, held weakly."""

    def _on_message(self, message: str) -> None:
        """A message on the listener's channel."""

    @property
    def _listening(self) -> bool:
        """Whether the listener needs its channel now: a connection lost is made again only for one that does."""

    def _channel_lost(self) -> None:
        """The channel was let go of without being asked: its connection failed while it was not needed."""


class Submission(Generic[R]):
    """The identifiers of one call to a `Lane`, and whether a batch carried them to Redis.

    A caller cancelled once its identifiers were sent knows that Redis may
    have acted on them (`sent`), and undoes that by identifier. The lane
    hands the call its outcome through `settle`; a kind of call whose
    caller awaits something else than the values and the whole result (a
    blocking acquire, its waiter's token) sets its own `answer` and
    overrides `settle`.
    """

    __slots__ = ("answer", "identifiers", "sent", "waiting_since")

    def __init__(self, identifiers: Sequence[str]) -> None:
        self.identifiers = identifiers
        #: Set once a batch carrying these identifiers has started: from then
        #: on Redis may act on them, even if the caller is cancelled.
        self.sent = False
        #: When the call began to wait for its batch (loop time).
        self.waiting_since: float | None = None
        #: What the caller awaits -- by default the values of these
        #: identifiers and the whole result -- cancelled the moment the caller is.
        self.answer: asyncio.Future[Any] | None = None

    @property
    def abandoned(self) -> bool:
        """Whether the caller gave up before a batch carried these identifiers: they are left out."""
        # Only the batch settles an answer: one settled before it was sent was given up on.
        return not self.sent and self.answer is not None and self.answer.done()

    def settle(self, outcome: tuple[Sequence[int], R] | BaseException) -> None:
        """Give the caller its outcome, unless it gave up on it.

        Called in the lane's task, as the batch's reply is read: no caller
        has run since.
        """
        if self.answer is not None:
            resolve(self.answer, outcome)


def resolve(future: asyncio.Future[T], outcome: T | BaseException) -> None:
    """Settle ``future`` with ``outcome`` -- a value, an error, or a cancellation -- unless it is settled already."""
    if future.done():
        return
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class Lane(Generic[R]):
    """Coalesces concurrent calls of one kind into one call at a time, run in a task of the lane's own.

    A call joins the next batch; the batches run one after another in the
    lane's flusher task, which starts with the first call and ends once no
    call is left. Calls made in one turn of the event loop, as the callers
    one reply wakes make theirs, go together; so do the calls made while a
    batch is in flight. Each reads its part of the batch's result.

    No batch ever runs in a caller's task, so a caller's cancellation never
    interrupts a call to Redis half-way: it reaches the caller at once, as
    `CancelledError`, and never the client library (redis-py's
    ``wait_for`` on Python 3.10 and 3.11 would swallow it, and a command
    cut short drops its connection). A caller cancelled before its batch
    starts is left out of it; one cancelled later knows the step went out
    (`Submission.sent`) and undoes what it may have done.

    ``run`` takes the identifiers of a batch, and when the longest-waiting
    call of the batch began to wait, and returns one value per identifier
    and the batch's whole result. A call's bound counts from its call,
    waiting included. ``failure`` gives each call of a failed batch the
    error it is to raise (a fresh one each: an exception raised in several
    tasks gathers all their tracebacks). ``behind``, if given, tells whether
    calls of another lane are about to go (`about_to_go`): this lane's
    next batch then lets them go first, one loop pass later.

    ``hold``, if given, tells whether a batch's result woke callers of
    other calls -- a release's reply grants waiters of the process -- that
    may make this lane's next calls at once: the batch's own callers are
    then answered once the lane's next batch is on its way, or
    `HOLD_TURNS` loop turns later, whichever comes first. The callers woken
    by the result run first, and their calls go out before this batch's
    callers make theirs; the process works on those while Redis runs the
    batch, where it would otherwise have sat idle waiting for it.
    """

    __slots__ = ("_behind", "_failure", "_flusher", "_held", "_hold", "_in_flight", "_pending", "_run")

    def __init__(
        self,
        run: Callable[[Sequence[str], float | None], Awaitable[tuple[Sequence[int], R]]],
        failure: Callable[[Exception], BaseException] | None = None,
        *,
        behind: Callable[[], bool] | None = None,
        hold: Callable[[R], bool] | None = None,
    ) -> None:
        self._run = run
        self._failure = failure
        self._behind = behind
        self._hold = hold
        self._pending: list[Submission[R]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._in_flight = False
        #: The answers of the last batch, held back (see ``hold``).
        self._held: list[tuple[Submission[R], tuple[Sequence[int], R]]] = []

    @property
    def about_to_go(self) -> bool:
        """Whether calls are waiting for a batch that no batch in flight holds up: they go at the next loop pass."""
        return bool(self._pending) and not self._in_flight

    async def submit(self, submission: Submission[R], loop: asyncio.AbstractEventLoop) -> tuple[Sequence[int], R]:
        """Run a step for the submission's identifiers; return their values and the whole result.

        ``loop`` is the running one, as for `enqueue`.

        Cancellation:
            Raised at once. If ``submission.sent`` is set by then, the step
            goes on and may take effect: the caller must undo what it did.
        """
        # Awaited directly, not through `asyncio.shield`: the flusher settles
        # it, and a caller's cancellation cancels only it, one loop turn sooner.
        answer: asyncio.Future[tuple[Sequence[int], R]] = loop.create_future()
        submission.answer = answer
        self.enqueue(submission, loop)
        return await answer

    def enqueue(self, submission: Submission[R], loop: asyncio.AbstractEventLoop) -> None:
        """Have the submission's identifiers go with the next batch; its `Submission.settle` hears the outcome.

        ``loop`` is the running one, which the caller has at hand (see `Core.bind`).
        """
        submission.waiting_since = loop.time()
        self._pending.append(submission)
        if self._flusher is None:
            # Not the loop's task factory: an eager one would start the batch
            # before the other calls of this turn could join it.
            self._flusher = asyncio.Task(self._flush(), loop=loop, name="aiosem lane")

    async def _flush(self) -> None:
        async with keeping_connections():
            try:
                while self._pending:
                    if self._behind is not None and self._behind():
                        await asyncio.sleep(0)
                    batch = [submission for submission in self._pending if not submission.abandoned]
                    self._pending = []
                    if batch:
                        # Their callers wake once this task next waits: with the batch written.
                        self._answer_held()
                        self._in_flight = True
                        try:
                            await self._run_batch(batch)
                        finally:
                            self._in_flight = False
            finally:
                # Before the kept connections go back: a call made meanwhile starts a flusher of its own.
                self._flusher = None
                for submission in self._pending:
                    submission.settle(asyncio.CancelledError())
                self._pending = []

    async def _run_batch(self, batch: list[Submission[R]]) -> None:
        for submission in batch:
            submission.sent = True
        waiting_since = min((s.waiting_since for s in batch if s.waiting_since is not None), default=None)
        try:
            values, result = await self._run([i for submission in batch for i in submission.identifiers], waiting_since)
        except Exception as error:  # noqa: BLE001 -- every call of the batch gets the batch's error
            for submission in batch:
                submission.settle(error if self._failure is None else self._failure(error))
            return
        except BaseException as error:
            for submission in batch:
                submission.settle(asyncio.CancelledError() if isinstance(error, asyncio.CancelledError) else error)
            raise
        answers = []
        offset = 0
        for submission in batch:
            count = len(submission.identifiers)
            answers.append((submission, (values[offset : offset + count], result)))
            offset += count
        if self._hold is not None and self._hold(result):
            self._held = answers
            asyncio.get_running_loop().call_soon(self._answer_held_after, HOLD_TURNS - 1, answers)
            return
        for submission, outcome in answers:
            submission.settle(outcome)

    def _answer_held(self) -> None:
        held, self._held = self._held, []
        for submission, outcome in held:
            submission.settle(outcome)

    def _answer_held_after(self, turns: int, answers: list[tuple[Submission[R], tuple[Sequence[int], R]]]) -> None:
        if self._held is not answers:
            return  # answered with the lane's next batch
        if turns > 0:
            asyncio.get_running_loop().call_soon(self._answer_held_after, turns - 1, answers)
        else:
            self._answer_held()


#: How many loop turns a lane holds its callers' answers at most (see `Lane`): enough for the callers a
#: release woke to hold their permits two passes of the loop, and release them, first.
HOLD_TURNS: Final = 3


class LaneOfLoop(Generic[R]):
    """A `Lane` for an object any event loop may use: the lane of the loop that calls, made on first use.

    A lane's task belongs to the loop it runs in, so an object used again
    in another loop (the first one closed) starts a lane of its own there;
    the loop is held weakly, so a lane never keeps a closed loop alive.
    """

    __slots__ = ("_failure", "_lane", "_loop", "_run")

    def __init__(
        self,
        run: Callable[[Sequence[str], float | None], Awaitable[tuple[Sequence[int], R]]],
        failure: Callable[[Exception], BaseException],
    ) -> None:
        self._run = run
        self._failure = failure
        self._lane: Lane[R] | None = None
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None

    def of(self, loop: asyncio.AbstractEventLoop) -> Lane[R]:
        """The lane of ``loop``, the running one."""
        if self._lane is None or self._loop is None or self._loop() is not loop:
            self._lane, self._loop = Lane(self._run, self._failure), weakref.ref(loop)
        return self._lane


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

    Each semaphore subscribes its own channel as a `Listener`, held weakly:
    a semaphore that is gone is unsubscribed the next time the subscriber
    is idle. The reader survives connection errors while a listener needs
    its channel: redis-py reconnects and subscribes again, and a message
    lost meanwhile only delays a waiter until its semaphore's next
    re-check. A connection lost while no listener needs it -- the client
    was closed, say -- is not made again: every channel is let go of, each
    listener told, and the reader ends.

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
        #: Subscriptions being sent, each from a task of its own.
        self._subscribing = Background()
        # redis-py's PubSub connects on its first command, and concurrent first
        # commands each connect: all but one subscription then lands on a
        # connection nobody reads. One command at a time.
        self._sending = asyncio.Lock()

    @property
    def channels(self) -> int:
        """How many channels are subscribed, or being subscribed."""
        return len(self._handlers)

    async def subscribe(self, channel: str, listener: Listener | Handler) -> None:
        """Deliver the messages of ``channel`` to ``listener`` from now on.

        Returns once the server has confirmed the subscription; concurrent
        calls for one channel share one subscription.

        Raises:
            TimeoutError: No confirmation within 5 s.
            redis.RedisError: The subscription failed or was refused.
        """
        ready = self._ready.get(channel)
        if ready is None:
            self._handlers[channel] = listener if isinstance(listener, weakref.ref) else weakref.ref(listener)
            ready = self._ready[channel] = self._loop.create_future()
            # Sent from a task of the subscriber's own, so that a caller
            # cancelled meanwhile cannot take the subscription from the others.
            self._subscribing.start(self._send_subscribe(channel, ready), name="aiosem subscribe")
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
        backoff = Backoff(_LONGEST_RECONNECT_PAUSE, first=_RECONNECT_PAUSE)
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
                    if not await self._read_on_after(backoff):
                        return
                    continue
                backoff.reset()
                if message is not None:
                    heard, probed = self._loop.time(), None
                    await self._deliver(message)
                    # The waiters a grant woke return before the next read is
                    # set up: that set-up is redis-py's, and on nobody's way.
                    await asyncio.sleep(0)
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
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8.2
                except redis.RedisError:
                    logger.debug("closing aiosem's pub/sub connection failed", exc_info=True)

    async def _read_on_after(self, backoff: Backoff) -> bool:
        """Act on the reader's connection failing (``backoff.failures`` times in a row before); whether to read on."""
        if self._on_dropped is not None:
            # Subscribed again elsewhere, wherever the slots went.
            logger.debug("a pub/sub connection to a cluster node failed", exc_info=True)
            self._drop(list(self._handlers))
            return True
        if not self._needed():
            logger.debug("aiosem's pub/sub connection ended while no channel was needed", exc_info=True)
            self._let_go()
            return False
        # redis-py reconnects and subscribes again on the next read.
        if not backoff.failures:
            logger.warning("aiosem's pub/sub connection failed; reconnecting", exc_info=True)
        await backoff.pause()
        return True

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
            listener = None if handler is None else handler()
            if listener is not None:
                listener._on_message(self._text(message["data"]))  # noqa: SLF001 -- the listener protocol
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

    def _needed(self) -> bool:
        """Whether some channel is needed now: its listener has waiters, or its subscription is awaited."""
        return any(not ready.done() for ready in self._ready.values()) or any(
            (listener := handler()) is not None and listener._listening  # noqa: SLF001 -- the listener protocol
            for handler in self._handlers.values()
        )

    def _let_go(self) -> None:
        """Forget every channel, as the lost connection's end did on the server, and tell their listeners."""
        handlers, self._handlers, self._ready = self._handlers, {}, {}
        for handler in handlers.values():
            listener = handler()
            if listener is not None:
                listener._channel_lost()  # noqa: SLF001 -- the listener protocol

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
    once the client has learnt the new layout, while its listener needs it;
    messages lost meanwhile only delay waiters until their next re-check. A
    listener that does not need its channel any more is told it was let go.
    """

    __slots__ = ("__weakref__", "_client", "_loop", "_nodes", "_resubscribing", "_wanted")

    def __init__(self, client: RedisCluster) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        #: The subscriber of each node, by node name.
        self._nodes: dict[str, tuple[Subscriber, Redis]] = {}
        #: Every channel subscribed, or to subscribe again, with its handler.
        self._wanted: dict[str, Handler] = {}
        self._resubscribing = Background()

    async def subscribe(self, channel: str, listener: Listener) -> None:
        """Deliver the messages of ``channel`` to ``listener`` from now on, from the node of its slot.

        Raises:
            TimeoutError: No confirmation within 5 s.
            redis.RedisError: The subscription failed or was refused.
        """
        self._wanted[channel] = weak = weakref.ref(listener)
        with anyio.fail_after(_SUBSCRIBE_TIMEOUT):
            await self._subscribe_where_served(channel, weak)

    async def _subscribe_where_served(self, channel: str, handler: Handler) -> None:
        # Bounded by the callers, as long as a subscription may take.
        async def attempt() -> None:
            await self._client.initialize()
            node: ClusterNode = self._client.get_node_from_key(channel)  # type: ignore[assignment]
            await self._node_subscriber(node).subscribe(channel, handler)

        await redirected(self._client, attempt)

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
            self._resubscribing.start(self._resubscribe(wanted), name="aiosem resubscribe")

    async def _resubscribe(self, handlers: dict[str, Handler]) -> None:
        backoff = Backoff(_LONGEST_RECONNECT_PAUSE, first=_RECONNECT_PAUSE)
        while handlers:
            channel, handler = next(iter(handlers.items()))
            listener = handler()
            if self._wanted.get(channel) is not handler or listener is None:
                del handlers[channel]
                continue
            if not listener._listening:  # noqa: SLF001 -- the listener protocol
                del handlers[channel], self._wanted[channel]
                listener._channel_lost()  # noqa: SLF001 -- the listener protocol
                continue
            try:
                with anyio.fail_after(_SUBSCRIBE_TIMEOUT):
                    await self._subscribe_where_served(channel, handler)
            except (TimeoutError, redis.RedisError, redis.exceptions.RedisClusterException):
                # The cluster is failing over, or the layout is in flux.
                if not backoff.failures:
                    logger.warning("could not subscribe again to %s on the cluster; retrying", channel, exc_info=True)
                await backoff.pause()
                with contextlib.suppress(Exception):
                    await self._client.nodes_manager.initialize()
                continue
            backoff.reset()
            del handlers[channel]
        await self._close_idle()


def subscriber_of(client: Client) -> Subscriber | ShardedSubscriber:
    """The subscriber of ``client`` in the running event loop: sharded on a cluster."""
    if isinstance(client, RedisCluster):
        return ShardedSubscriber.of(client)
    return Subscriber.of(client)


#: Calls whose callers were cancelled, running on.
_detached = Background()


def _ended(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # read: a caller that gave up on it hears of its own cancellation instead


#: How long what a cancelled caller must still do may take before it is left to the background.
CLEANUP_TIMEOUT: Final = 5.0


class Watchdog:
    """Settles the futures of one event loop watched with one bound, once that bound has passed.

    A timer set and cancelled for each future cost more than the rest of its
    wait: the wait for the release of every ``async with``, and the deadline
    of every queued waiter. Futures watched with one bound come due in the
    order they were watched, so one timer serves them all: set for the
    oldest still watched, and moved on to the next when it fires. A future
    that comes due is settled with what ``time_up`` returns: a value, or an
    exception to raise.
    """

    __slots__ = ("_armed", "_due", "_time_up")

    #: Held weakly, as its loop holds nothing of it but a timer.
    _registry: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, Watchdog]]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, time_up: Callable[[], object]) -> None:
        self._time_up = time_up
        #: Each future watched, and when it is due (loop time), oldest first.
        self._due: dict[asyncio.Future[Any], float] = {}
        self._armed = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop, seconds: float) -> Watchdog:
        """The watchdog of ``loop``, the running one, that wakes the calls `to_the_end` bounds to ``seconds``."""
        watchdogs = cls._registry.get(loop)
        if watchdogs is None:
            watchdogs = cls._registry[loop] = {}
        watchdog = watchdogs.get(seconds)
        if watchdog is None:
            watchdog = watchdogs[seconds] = cls(_nothing)
        return watchdog

    def watch(self, future: asyncio.Future[Any], at: float) -> None:
        """Settle ``future`` at loop time ``at``, no earlier than any watched before, unless `unwatch`-ed by then."""
        self._due[future] = at
        if not self._armed:
            self._arm(future.get_loop(), at)

    def unwatch(self, future: asyncio.Future[Any]) -> None:
        self._due.pop(future, None)

    @property
    def idle(self) -> bool:
        """Whether it watches nothing now."""
        return not self._due

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self._armed = True
        loop.call_at(at, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._armed = False
        # The loop fires a timer up to its clock's resolution early.
        now = loop.time() + CLOCK_SLACK
        due = self._due
        while due:
            future, at = next(iter(due.items()))
            if at > now:
                self._arm(loop, at)
                return
            del due[future]
            resolve(future, self._time_up())


def _nothing() -> None:
    """What a call `to_the_end` waits for is woken with when its bound has passed."""


async def to_the_end(call: Awaitable[T], *, name: str | Callable[[], str], seconds: float = CLEANUP_TIMEOUT) -> T:
    """Wait for ``call`` -- run in a task of its own, unless a future -- through any cancellation, up to ``seconds``.

    ``name`` says what the call is, in its task's name and a timeout's
    message; a callable makes it only when it is needed (most calls of a
    future never do).

    What a cancelled caller must still do -- give back a permit, leave the
    queue -- is done before its cancellation goes on, whether that came from
    an anyio cancel scope or from asyncio itself (``Task.cancel``,
    ``asyncio.timeout``), which a shielded cancel scope does not hold off.
    The first cancellation is raised once the call has ended.

    Raises:
        TimeoutError: The call took longer than ``seconds``; it goes on in
            the background, within its own bound. (A cancellation, if one
            came, is raised instead.)
        Exception: What the call raised.
    """
    task = asyncio.ensure_future(call)
    if isinstance(task, asyncio.Task):
        task.set_name(name if isinstance(name, str) else name())
        _detached.keep(task)  # a future is kept by whoever is to settle it
        task.add_done_callback(_ended)
    if task.done():  # an eager task factory ran it to its end already
        return task.result()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    # Most calls meet no cancellation: they wait on a future of their own,
    # which a cancellation cancels instead of the call, and enter a shielded
    # scope only once one came -- a release in every `async with` pays for
    # neither the scope nor `asyncio.wait`'s machinery, nor a timer.
    ended: asyncio.Future[None] = loop.create_future()

    def end(_: object) -> None:
        if not ended.done():
            ended.set_result(None)

    task.add_done_callback(end)
    watchdog = Watchdog.of(loop, seconds)
    watchdog.watch(ended, deadline)
    try:
        await ended
    except asyncio.CancelledError:
        _read_when_done(task)
        # Shielded, anyio stops delivering its cancellation over and over.
        with anyio.CancelScope(shield=True):
            while not task.done() and (remaining := deadline - loop.time()) > 0:
                with contextlib.suppress(asyncio.CancelledError):  # held off until the call ends
                    await asyncio.wait({task}, timeout=remaining)
        raise
    finally:
        watchdog.unwatch(ended)
        task.remove_done_callback(end)
    if not task.done():
        _read_when_done(task)
        what = name if isinstance(name, str) else name()
        raise TimeoutError(f"{what} took longer than {seconds:g} s; left to finish in the background")
    return task.result()


async def clean_up(call: Awaitable[object], *, name: str, failed: Callable[[], None]) -> None:
    """`to_the_end` for what a cancelled caller must still do, and nobody hears the outcome of: told if it fails.

    ``failed`` is called in an ``except`` block (so a log call's
    ``exc_info`` finds the error) if ``call`` raises -- in its own task,
    even after its caller's cancellation went on -- or outlasts the bound
    (then it goes on in the background, and is told there if it fails).
    """

    async def telling() -> None:
        try:
            await call
        except Exception:  # noqa: BLE001 -- told, as nobody awaits it
            failed()

    try:
        await to_the_end(telling(), name=name)
    except TimeoutError:
        failed()


def _read_when_done(call: asyncio.Future[Any]) -> None:
    """Have a future's outcome read once it ends, its waiter gone: a task's is read already."""
    if not isinstance(call, asyncio.Task):
        call.add_done_callback(_ended)


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
