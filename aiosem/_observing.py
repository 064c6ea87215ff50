"""What happens to permits and slots, told to observers and to the log.

Every grant, timeout, release and loss of a semaphore permit, and every
grant and timeout of a rate limiter's slot, becomes one `LimiterEvent`. It
goes to the observers added with `add_observer` -- the OpenTelemetry
integration is one -- and, as a structured ``DEBUG`` record, to the
``aiosem.events`` logger. With no observer and that level off, an event
costs one check and is never built.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ._permit import Permit

__all__ = ["LimiterEvent", "add_observer", "emit", "emit_permit", "log_fields", "remove_observer"]

EventKind = Literal["acquired", "timed_out", "released", "lost"]

logger = logging.getLogger("aiosem")
event_logger = logging.getLogger("aiosem.events")


@dataclass(frozen=True, slots=True)
class LimiterEvent:
    """One thing that happened to a permit of a semaphore, or to a slot of a rate limiter.

    Attributes:
        kind: ``"acquired"``: a permit or slot was granted, after waiting
            ``duration`` seconds. ``"timed_out"``: none came within the wait
            allowed (for a non-blocking try: none was free), after
            ``duration`` seconds. ``"released"``: a permit was given back
            while still held, after being held ``duration`` seconds.
            ``"lost"``: a permit kept alive (``async with``, the decorators
            and limiters, ``auto_refresh``) was lost -- its lease ran out, or
            its keys were deleted -- ``duration`` seconds after its grant.
            Rate limiters only report ``"acquired"`` and ``"timed_out"``.
        limiter: ``"semaphore"`` or ``"rate"``: what kind of object it
            happened to.
        name: The semaphore's or rate limiter's name.
        identifier: The permit's identifier (``None`` for a rate limiter,
            and for a semaphore's ``"timed_out"``).
        fencing_token: The permit's fencing token (``None`` where
            ``identifier`` is).
        duration: Seconds waited (``"acquired"``, ``"timed_out"``) or held
            (``"released"``, ``"lost"``; NaN for a `Permit` made by hand,
            whose grant this process did not see).
        time: When it happened, as `time.time` (the end of ``duration``).
        cost: How many slots a rate limiter's call asked for (its
            ``cost``, 1 unless given); for a semaphore, what its permit
            weighs (its ``weight``, 1 unless given).
    """

    kind: EventKind
    limiter: Literal["semaphore", "rate"]
    name: str
    identifier: str | None
    fencing_token: int | None
    duration: float
    time: float
    cost: int = 1


#: The observers, in the order they were added; replaced, never mutated, so
#: that an observer removed while events are delivered misses nothing else.
_observers: tuple[Callable[[LimiterEvent], object], ...] = ()


def add_observer(observer: Callable[[LimiterEvent], object]) -> None:
    """Call ``observer`` with every `LimiterEvent` of this process, from now on.

    The observer is called synchronously, in the task where the event
    happened (for a loss: in the task that refreshes the permit), so it must
    be quick and must not block; it may not await. An exception it raises is
    logged and does not reach the code that took or gave back the permit.
    Adding an observer that is already added does nothing.

        def count(event: aiosem.LimiterEvent) -> None:
            if event.kind == "timed_out":
                timeouts[event.name] += 1

        aiosem.add_observer(count)

    Raises:
        TypeError: ``observer`` is not callable.
    """
    global _observers  # noqa: PLW0603 -- one registry per process, by design
    if not callable(observer):
        raise TypeError(f"observer must be callable, not {type(observer).__name__}")
    if observer not in _observers:
        _observers = (*_observers, observer)


def remove_observer(observer: Callable[[LimiterEvent], object]) -> None:
    """Stop calling ``observer``; an observer that was not added is ignored."""
    global _observers  # noqa: PLW0603 -- see add_observer
    _observers = tuple(added for added in _observers if added != observer)


def log_fields(name: str, identifier: str | None = None) -> Mapping[str, object]:
    """The ``extra`` of a log record about a semaphore or rate limiter (and a permit)."""
    return {"aiosem_name": name, "aiosem_identifier": identifier}


def emit(
    kind: EventKind,
    limiter: Literal["semaphore", "rate"],
    name: str,
    duration: float,
    *,
    identifier: str | None = None,
    fencing_token: int | None = None,
    cost: int = 1,
) -> None:
    """Tell the observers and the ``aiosem.events`` logger that ``kind`` happened."""
    observers = _observers
    logged = event_logger.isEnabledFor(logging.DEBUG)
    if not observers and not logged:
        return
    event = LimiterEvent(kind, limiter, name, identifier, fencing_token, duration, time.time(), cost)
    if logged:
        event_logger.debug(
            "%s %s %r%s after %.6f s",
            limiter,
            kind,
            name,
            "" if identifier is None else f" ({identifier})",
            duration,
            extra={
                **log_fields(name, identifier),
                "aiosem_event": kind,
                "aiosem_limiter": limiter,
                "aiosem_fencing_token": fencing_token,
                "aiosem_duration": duration,
                "aiosem_cost": cost,
            },
        )
    for observer in observers:
        _notify(observer, event)


def emit_permit(kind: EventKind, permit: Permit) -> None:
    """Tell that ``permit`` was released or lost, with how long it was held."""
    if not _observers and not event_logger.isEnabledFor(logging.DEBUG):
        return  # as `emit` would, before reading the permit's weight from its identifier
    emit(
        kind,
        "semaphore",
        permit.name,
        time.monotonic() - permit.acquired_at,
        identifier=permit.identifier,
        fencing_token=permit.fencing_token,
        cost=permit.weight,
    )


def _notify(observer: Callable[[LimiterEvent], object], event: LimiterEvent) -> None:
    try:
        observer(event)
    except Exception:
        logger.exception("the aiosem observer %r raised", observer)
