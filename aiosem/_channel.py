"""The pub/sub channel of one semaphore object: how other processes wake its waiters.

A step that hands a permit to a waiter of another process publishes the
grant on that waiter's object's channel. The channel is subscribed in the
background when a waiter is queued -- never in a caller's way: a grant
published before the server confirmed the subscription goes unheard, so the
confirmation has the pump look at once -- and let go of a short while after
the last waiter has gone, so that waits that follow one another closely
share one subscription, and a client closed meanwhile is let go of well
within half a second.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Final

import redis

from ._coordination import subscriber_of
from ._observing import log_fields

if TYPE_CHECKING:
    from ._core import Core
    from ._waiting import WaitQueue

logger = logging.getLogger("aiosem")

#: How long a channel stays subscribed once its object's last waiter has gone.
SUBSCRIPTION_LINGER: Final = 0.25


class Channel:
    """The channel of one semaphore object, subscribed while it has waiters (a `Listener` of the subscriber)."""

    __slots__ = ("__weakref__", "_core", "_linger", "_queue", "_subscribed", "_subscribing", "_unsubscribing")

    def __init__(self, core: Core, queue: WaitQueue) -> None:
        self._core = core
        self._queue = queue
        #: Subscribed (or failed to, and not tried again yet); being
        #: subscribed, or unsubscribed; and when it goes, unused.
        self._subscribed = False
        self._subscribing: asyncio.Task[None] | None = None
        self._unsubscribing: asyncio.Task[None] | None = None
        self._linger: asyncio.TimerHandle | None = None

    def reset(self) -> None:
        """Forget the subscription: the object moved to another event loop (the old one is closed)."""
        self._subscribed = False
        self._subscribing = self._unsubscribing = self._linger = None

    @property
    def name(self) -> str:
        """The channel's name: the semaphore's channel prefix and the object's identity."""
        return self._core.keys.channels + self._core.process

    @property
    def ready(self) -> bool:
        """Whether the channel is subscribed, as far as this object knows, and no subscription is under way."""
        return self._subscribed and self._subscribing is None

    @property
    def in_use(self) -> bool:
        """Whether the channel is subscribed, or being subscribed or unsubscribed."""
        return self._subscribed or self._subscribing is not None or self._unsubscribing is not None

    # --- the listener protocol of the subscriber ---------------------------------

    def _on_message(self, message: str) -> None:
        self._queue.on_message(message)

    @property
    def _listening(self) -> bool:
        """Whether the object needs its channel now: it has waiters."""
        return self._queue.has_waiters

    def _channel_lost(self) -> None:
        """The subscriber dropped the channel (its connection failed while the object had no waiter)."""
        self._subscribed = False

    # --- subscribing ---------------------------------------------------------------

    def listen(self) -> None:
        """Have the channel subscribed, in the background, for a waiter just queued."""
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if not self._subscribed and self._subscribing is None:
            self._subscribing = asyncio.get_running_loop().create_task(self._subscribe(), name="aiosem subscribe")

    def unlisten(self) -> None:
        """The last waiter has gone: the channel goes unless a waiter comes soon."""
        if (self._subscribed or self._subscribing is not None) and self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(SUBSCRIPTION_LINGER, self._stop_listening)

    def _stop_listening(self) -> None:
        self._linger = None
        if not self._queue.has_waiters and self._unsubscribing is None:
            self._unsubscribing = asyncio.get_running_loop().create_task(self._unsubscribe(), name="aiosem unsubscribe")

    async def _subscribe(self) -> None:
        semaphore = self._core.semaphore
        settings = self._core.settings
        try:
            if self._unsubscribing is not None:
                await asyncio.shield(self._unsubscribing)
            await subscriber_of(self._core.client).subscribe(self.name, self)
        except (TimeoutError, redis.RedisError, redis.exceptions.RedisClusterException):
            # Waiters still get their permits, from the pump's re-checks; the
            # object tries again once it has had no waiter for a while.
            logger.warning(
                "could not subscribe for %r; waiters will be slower to wake",
                semaphore,
                exc_info=True,
                extra=log_fields(settings.name),
            )
        finally:
            self._subscribing = None
        self._subscribed = True
        self._queue.recheck_now()

    async def _unsubscribe(self) -> None:
        try:
            if self._subscribing is not None:
                await asyncio.shield(self._subscribing)
            if self._queue.has_waiters:
                return  # one came meanwhile, and finds the channel subscribed
            self._subscribed = False
            await subscriber_of(self._core.client).unsubscribe(self.name)
        finally:
            self._unsubscribing = None

    def stop(self) -> list[asyncio.Task[None]]:
        """Cancel the channel's tasks and timer; return the tasks, to wait for before unsubscribing."""
        background = [task for task in (self._subscribing, self._unsubscribing) if task is not None]
        for task in background:
            task.cancel()
        self._subscribed = False
        self._subscribing = self._unsubscribing = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        return background

    async def unsubscribe(self) -> None:
        """Let go of the channel now (closing)."""
        await subscriber_of(self._core.client).unsubscribe(self.name)
