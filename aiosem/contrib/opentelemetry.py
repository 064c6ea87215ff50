"""OpenTelemetry metrics and spans for aiosem (aiosem's ``otel`` extra).

One call, at start-up, after the OpenTelemetry SDK is configured::

    from aiosem.contrib.opentelemetry import instrument

    instrument()  # the global meter and tracer providers

From then on every `aiosem.LimiterEvent` of the process is recorded:

=========================  ==============  ===============================================
instrument                 kind            what it measures
=========================  ==============  ===============================================
``aiosem.wait.duration``   histogram (s)   time from asking to a grant or a timeout
``aiosem.hold.duration``   histogram (s)   time from a grant to its release or loss
``aiosem.grants``          counter         permits and slots granted
``aiosem.timeouts``        counter         waits that ended without a grant
``aiosem.losses``          counter         permits lost while kept alive
``aiosem.held``            up-down counter permits this process holds now
=========================  ==============  ===============================================

Each carries the attributes ``aiosem.name`` (the semaphore's or rate
limiter's name), ``aiosem.limiter`` (``semaphore`` or ``rate``) and, on the
histograms, ``aiosem.outcome`` (the event's kind). Names become attribute
values: a name per host or per user makes one time series each.

Spans, with ``spans=True`` (the default): an ``aiosem.wait`` span for each
wait, and an ``aiosem.hold`` span for each permit held, from its grant to
its release or loss, both with the attributes above plus a semaphore's
``aiosem.identifier``, ``aiosem.fencing_token`` and ``aiosem.weight`` (what
the permit weighs), or a rate limiter's ``aiosem.cost`` (how many slots the
call took or asked for). They are
recorded when the wait or hold ends, with their real start and end times,
as children of the span current in the task where they end; a wait that
timed out and a permit that was lost end with status ``ERROR``.
"""

from __future__ import annotations

import math

from aiosem._extras import install_hint
from aiosem._observing import LimiterEvent, add_observer

try:
    from opentelemetry import metrics, trace
except ModuleNotFoundError as error:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        f"aiosem.contrib.opentelemetry needs opentelemetry-api: {install_hint('otel')}", name=error.name
    ) from error

__all__ = ["Instrumentation", "instrument"]

_NANOSECONDS = 1_000_000_000


class Instrumentation:
    """The observer that records aiosem's events as OpenTelemetry metrics and spans.

    Made and added by `instrument`; remove it with
    ``aiosem.remove_observer(instrumentation)`` to stop recording.
    """

    __slots__ = ("_grants", "_held", "_hold_duration", "_losses", "_timeouts", "_tracer", "_wait_duration")

    def __init__(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        spans: bool = True,
    ) -> None:
        from aiosem import __version__  # noqa: PLC0415 -- aiosem imports nothing from contrib

        meter = metrics.get_meter("aiosem", __version__, meter_provider=meter_provider)
        self._wait_duration = meter.create_histogram(
            "aiosem.wait.duration", unit="s", description="Time from asking for a permit or slot to a grant or timeout"
        )
        self._hold_duration = meter.create_histogram(
            "aiosem.hold.duration",
            unit="s",
            description="Time a permit was held, from its grant to its release or loss",
        )
        self._grants = meter.create_counter("aiosem.grants", description="Permits and slots granted")
        self._timeouts = meter.create_counter("aiosem.timeouts", description="Waits that ended without a grant")
        self._losses = meter.create_counter("aiosem.losses", description="Permits lost while kept alive")
        self._held = meter.create_up_down_counter("aiosem.held", description="Permits this process holds")
        self._tracer = trace.get_tracer("aiosem", __version__, tracer_provider=tracer_provider) if spans else None

    def __repr__(self) -> str:
        return f"Instrumentation(spans={self._tracer is not None})"

    def __call__(self, event: LimiterEvent) -> None:
        """Record one event."""
        common: dict[str, str] = {"aiosem.name": event.name, "aiosem.limiter": event.limiter}
        detailed = {**common, "aiosem.outcome": event.kind}
        kind = event.kind
        if kind in ("acquired", "timed_out"):
            self._wait_duration.record(event.duration, detailed)
            (self._grants if kind == "acquired" else self._timeouts).add(1, common)
            if kind == "acquired" and event.limiter == "semaphore":
                self._held.add(1, common)
        elif not math.isnan(event.duration):  # NaN: a permit made by hand, whose grant was not counted here
            self._hold_duration.record(event.duration, detailed)
            self._held.add(-1, common)
        if kind == "lost":
            self._losses.add(1, common)
        if self._tracer is not None:
            self._span(event, detailed)

    def _span(self, event: LimiterEvent, attributes: dict[str, str]) -> None:
        assert self._tracer is not None  # noqa: S101 -- only called with spans on
        span_attributes: dict[str, str | int] = dict(attributes)
        if event.identifier is not None:
            span_attributes["aiosem.identifier"] = event.identifier
        if event.fencing_token is not None:
            span_attributes["aiosem.fencing_token"] = event.fencing_token
        span_attributes["aiosem.cost" if event.limiter == "rate" else "aiosem.weight"] = event.cost
        end = round(event.time * _NANOSECONDS)
        start = end if math.isnan(event.duration) else end - round(event.duration * _NANOSECONDS)
        waited = event.kind in ("acquired", "timed_out")
        span = self._tracer.start_span(
            "aiosem.wait" if waited else "aiosem.hold", attributes=span_attributes, start_time=start
        )
        if event.kind == "timed_out":
            span.set_status(trace.Status(trace.StatusCode.ERROR, "no grant within the wait allowed"))
        elif event.kind == "lost":
            span.set_status(trace.Status(trace.StatusCode.ERROR, "permit lost"))
        span.end(end_time=end)


def instrument(
    *,
    meter_provider: metrics.MeterProvider | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    spans: bool = True,
) -> Instrumentation:
    """Record every aiosem event of this process as metrics (and spans), from now on.

    Args:
        meter_provider: Where the metrics go; by default the global one
            (``opentelemetry.metrics.set_meter_provider``).
        tracer_provider: Where the spans go; by default the global one.
        spans: Record spans too, not only metrics.

    Returns:
        The observer doing it; ``aiosem.remove_observer`` it to stop.
    """
    instrumentation = Instrumentation(meter_provider=meter_provider, tracer_provider=tracer_provider, spans=spans)
    add_observer(instrumentation)
    return instrumentation
