"""Every grant, timeout, release and loss is told to observers, to the log, and to OpenTelemetry."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import aiosem
from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore, AsyncRateLimiter, LimiterEvent, Permit, PermitLost

if TYPE_CHECKING:
    from collections.abc import Iterator

    import redis.asyncio

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]

#: The most any wait in these tests may take before the test fails.
BOUND = 15.0


async def hold_until_lost(sem: AsyncFairSemaphore | AsyncLockedSemaphore, client: redis.asyncio.Redis) -> None:
    """Hold a permit of ``sem``, delete it behind its back, and wait for its refresh to notice."""
    async with sem:
        await client.delete(sem.key, f"{sem.key}:owner")
        await anyio.sleep_forever()


@pytest.fixture
def events() -> Iterator[list[LimiterEvent]]:
    seen: list[LimiterEvent] = []
    aiosem.add_observer(seen.append)
    yield seen
    aiosem.remove_observer(seen.append)


async def test_a_grant_and_its_release_are_told_with_the_wait_and_the_hold(
    cls: SemaphoreClass, client: redis.asyncio.Redis, events: list[LimiterEvent]
) -> None:
    sem = cls(client, "observed", 1)
    async with sem as permit:
        await anyio.sleep(0.05)
    acquired, released = events
    assert acquired.kind == "acquired"
    assert (acquired.limiter, acquired.name) == ("semaphore", "observed")
    assert (acquired.identifier, acquired.fencing_token) == (permit.identifier, permit.fencing_token)
    assert 0 <= acquired.duration < BOUND
    assert released.kind == "released"
    assert released.identifier == permit.identifier
    assert 0.05 <= released.duration < BOUND
    assert released.time >= acquired.time


async def test_a_wait_that_runs_out_is_told_as_timed_out_with_its_length(
    cls: SemaphoreClass, client: redis.asyncio.Redis, events: list[LimiterEvent]
) -> None:
    sem = cls(client, "observed", 1)
    permit = await sem.acquire()
    assert permit is not None
    assert await sem.acquire(blocking_timeout=0.1) is None
    assert await sem.acquire(blocking=False) is None
    await sem.release(permit)
    kinds = [(event.kind, event.identifier) for event in events]
    assert kinds == [
        ("acquired", permit.identifier),
        ("timed_out", None),
        ("timed_out", None),
        ("released", permit.identifier),
    ]
    assert events[1].duration >= 0.1


async def test_a_permit_lost_while_kept_alive_is_told_once(
    cls: SemaphoreClass, real_client: redis.asyncio.Redis, events: list[LimiterEvent]
) -> None:
    sem = cls(real_client, "observed", 1, timeout=0.6)
    with pytest.raises(PermitLost), anyio.fail_after(BOUND):
        await hold_until_lost(sem, real_client)
    assert [event.kind for event in events] == ["acquired", "lost"]
    assert events[1].identifier == events[0].identifier


async def test_a_permit_found_gone_at_the_end_of_async_with_is_told_as_lost(
    cls: SemaphoreClass, real_client: redis.asyncio.Redis, events: list[LimiterEvent]
) -> None:
    sem = cls(real_client, "observed", 1, timeout=30)
    with pytest.raises(PermitLost):
        async with sem:
            await real_client.delete(sem.key, f"{sem.key}:owner")
    assert [event.kind for event in events] == ["acquired", "lost"]


async def test_an_auto_refreshed_permit_released_after_it_was_lost_is_told_lost_only_once(
    cls: SemaphoreClass, real_client: redis.asyncio.Redis, events: list[LimiterEvent]
) -> None:
    sem = cls(real_client, "observed", 1, timeout=0.6)
    lost = anyio.Event()
    permit = await sem.acquire(auto_refresh=True, on_lost=lambda _: lost.set())
    assert permit is not None
    await real_client.delete(sem.key, f"{sem.key}:owner")
    with anyio.fail_after(BOUND):
        await lost.wait()
    assert not await sem.release(permit)
    assert [event.kind for event in events] == ["acquired", "lost"]


async def test_rate_limiter_slots_are_told_as_acquired_or_timed_out(
    client: redis.asyncio.Redis, events: list[LimiterEvent]
) -> None:
    limiter = AsyncRateLimiter(client, "observed", rate=1, per=10)
    assert await limiter.acquire()
    assert not await limiter.acquire(blocking=False)
    assert [(event.kind, event.limiter, event.name) for event in events] == [
        ("acquired", "rate", "observed"),
        ("timed_out", "rate", "observed"),
    ]


async def test_a_rate_limiter_event_carries_the_cost_of_its_call(
    client: redis.asyncio.Redis, events: list[LimiterEvent], caplog: pytest.LogCaptureFixture
) -> None:
    limiter = AsyncRateLimiter(client, "observed", rate=1, per=10, burst=5)
    with caplog.at_level(logging.DEBUG, logger="aiosem.events"):
        assert await limiter.acquire(cost=3)
        assert not await limiter.try_acquire(cost=4)
        assert await limiter.try_acquire()
    assert [(event.kind, event.cost) for event in events] == [("acquired", 3), ("timed_out", 4), ("acquired", 1)]
    assert [record.__dict__["aiosem_cost"] for record in caplog.records] == [3, 4, 1]


async def test_an_observer_that_raises_is_logged_and_does_not_disturb_the_caller(
    client: redis.asyncio.Redis, events: list[LimiterEvent], caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: LimiterEvent) -> None:
        raise RuntimeError("observer bug")

    aiosem.add_observer(broken)
    try:
        async with AsyncFairSemaphore(client, "observed", 1):
            pass
    finally:
        aiosem.remove_observer(broken)
    assert [event.kind for event in events] == ["acquired", "released"]
    assert any("observer" in record.getMessage() and record.exc_info for record in caplog.records)


def test_an_observer_is_added_once_and_removed_once(events: list[LimiterEvent]) -> None:
    aiosem.add_observer(events.append)
    aiosem.remove_observer(events.append)
    aiosem.remove_observer(events.append)  # not added any more: ignored


def test_an_observer_must_be_callable() -> None:
    with pytest.raises(TypeError, match="observer must be callable, not int"):
        aiosem.add_observer(3)  # type: ignore[arg-type]


async def test_events_are_debug_records_of_the_events_logger_with_structured_fields(
    client: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="aiosem.events"):
        async with AsyncFairSemaphore(client, "logged", 1) as permit:
            pass
    records = [record for record in caplog.records if record.name == "aiosem.events"]
    assert [record.__dict__["aiosem_event"] for record in records] == ["acquired", "released"]
    for record in records:
        assert record.levelno == logging.DEBUG
        assert record.__dict__["aiosem_name"] == "logged"
        assert record.__dict__["aiosem_identifier"] == permit.identifier
        assert record.__dict__["aiosem_fencing_token"] == permit.fencing_token


async def test_the_warning_of_a_lost_permit_names_the_semaphore_and_the_permit(
    real_client: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    sem = AsyncFairSemaphore(real_client, "logged", 1, timeout=0.6)
    with pytest.raises(PermitLost) as lost, anyio.fail_after(BOUND):
        await hold_until_lost(sem, real_client)
    [warning] = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert warning.__dict__["aiosem_name"] == "logged"
    assert warning.__dict__["aiosem_identifier"] == lost.value.identifier


class Telemetry:
    """An SDK meter and tracer provider that keep what they record in memory."""

    def __init__(self) -> None:
        self.metrics = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metrics])
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))

    def points(self) -> dict[str, list[tuple[dict[str, object], float]]]:
        """Each metric's data points: (attributes, value or histogram count)."""
        data = self.metrics.get_metrics_data()
        assert data is not None
        found: dict[str, list[tuple[dict[str, object], float]]] = {}
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found[metric.name] = [
                        (
                            dict(point.attributes or {}),
                            point.count if isinstance(point, HistogramDataPoint) else point.value,  # type: ignore[union-attr]
                        )
                        for point in metric.data.data_points
                    ]
        return found


async def test_otel_counts_grants_timeouts_and_holds_per_semaphore(
    real_client: redis.asyncio.Redis, telemetry: Telemetry
) -> None:
    sem = AsyncFairSemaphore(real_client, "otel", 1, blocking_timeout=0.05)
    async with sem:
        assert await sem.acquire(blocking=False) is None
        with pytest.raises(aiosem.AcquireTimeout):
            async with sem:
                pass
    points = telemetry.points()
    semaphore = {"aiosem.name": "otel", "aiosem.limiter": "semaphore"}
    assert points["aiosem.grants"] == [(semaphore, 1)]
    assert points["aiosem.timeouts"] == [(semaphore, 2)]
    assert points["aiosem.wait.duration"] == [
        ({**semaphore, "aiosem.outcome": "acquired"}, 1),
        ({**semaphore, "aiosem.outcome": "timed_out"}, 2),
    ]
    assert points["aiosem.hold.duration"] == [({**semaphore, "aiosem.outcome": "released"}, 1)]
    assert "aiosem.losses" not in points


async def test_otel_spans_cover_each_wait_and_hold_with_their_real_times(
    real_client: redis.asyncio.Redis, telemetry: Telemetry
) -> None:
    sem = AsyncFairSemaphore(real_client, "otel", 1, blocking_timeout=0.05)
    tracer = telemetry.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        async with sem as permit:
            await anyio.sleep(0.05)
        with pytest.raises(aiosem.AcquireTimeout):
            async with sem, sem:
                pass
    spans = [span for span in telemetry.spans.get_finished_spans() if span.name.startswith("aiosem.")]
    outcomes = [(span.name, span.attributes and span.attributes["aiosem.outcome"]) for span in spans]
    # The first hold; then the second async with gets a permit and times out on its nested wait.
    assert outcomes == [
        ("aiosem.wait", "acquired"),
        ("aiosem.hold", "released"),
        ("aiosem.wait", "acquired"),
        ("aiosem.wait", "timed_out"),
        ("aiosem.hold", "released"),
    ]
    hold = spans[1]
    assert hold.attributes is not None
    assert hold.attributes["aiosem.identifier"] == permit.identifier
    assert hold.attributes["aiosem.fencing_token"] == permit.fencing_token
    assert hold.start_time is not None
    assert hold.end_time is not None
    assert hold.end_time - hold.start_time >= 50_000_000
    assert [span.status.status_code for span in spans] == [
        StatusCode.UNSET,
        StatusCode.UNSET,
        StatusCode.UNSET,
        StatusCode.ERROR,
        StatusCode.UNSET,
    ]
    assert [span.parent and span.parent.span_id for span in spans] == [request.get_span_context().span_id] * 5


async def test_otel_wait_spans_of_a_rate_limiter_carry_the_cost(
    real_client: redis.asyncio.Redis, telemetry: Telemetry
) -> None:
    limiter = AsyncRateLimiter(real_client, "otel", rate=1, per=10, burst=5)
    assert await limiter.acquire(cost=3)
    assert not await limiter.try_acquire(cost=4)
    spans = [span for span in telemetry.spans.get_finished_spans() if span.name.startswith("aiosem.")]
    assert [(span.name, dict(span.attributes or {})) for span in spans] == [
        (
            "aiosem.wait",
            {"aiosem.name": "otel", "aiosem.limiter": "rate", "aiosem.outcome": "acquired", "aiosem.cost": 3},
        ),
        (
            "aiosem.wait",
            {"aiosem.name": "otel", "aiosem.limiter": "rate", "aiosem.outcome": "timed_out", "aiosem.cost": 4},
        ),
    ]
    rate = {"aiosem.name": "otel", "aiosem.limiter": "rate"}
    assert telemetry.points()["aiosem.grants"] == [(rate, 1)]  # calls are counted, not slots


async def test_otel_counts_a_lost_permit(real_client: redis.asyncio.Redis, telemetry: Telemetry) -> None:
    sem = AsyncFairSemaphore(real_client, "otel", 1, timeout=30)
    with pytest.raises(PermitLost):
        async with sem:
            await real_client.delete(sem.key, f"{sem.key}:owner")
    points = telemetry.points()
    assert points["aiosem.losses"] == [({"aiosem.name": "otel", "aiosem.limiter": "semaphore"}, 1)]
    assert points["aiosem.held"] == [({"aiosem.name": "otel", "aiosem.limiter": "semaphore"}, 0)]
    [lost] = [span for span in telemetry.spans.get_finished_spans() if span.name == "aiosem.hold"]
    assert lost.status.status_code is StatusCode.ERROR


async def test_otel_takes_the_release_of_a_permit_made_by_hand_without_counting_it_held(
    real_client: redis.asyncio.Redis, telemetry: Telemetry
) -> None:
    sem = AsyncFairSemaphore(real_client, "otel", 1)
    granted = await sem.acquire()
    assert granted is not None
    by_hand = Permit(granted.name, granted.identifier, granted.fencing_token, granted.key)
    assert await sem.release(by_hand)
    points = telemetry.points()
    assert points["aiosem.held"] == [({"aiosem.name": "otel", "aiosem.limiter": "semaphore"}, 1)]
    assert "aiosem.hold.duration" not in points
    [hold] = [span for span in telemetry.spans.get_finished_spans() if span.name == "aiosem.hold"]
    assert hold.start_time == hold.end_time
