"""OpenTelemetry engine metrics: closed vocabularies, snake-case outcomes, the observe combinator, listeners.

Read back through the real OpenTelemetry SDK (`InMemoryMetricReader`), never a mock meter.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import logging
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from smthrs_plugin.errors import FenceLost, StoreError
from smthrs_plugin.observe.metrics import BOUNDARY_SETTLEMENTS_METRIC as BOUNDARY
from smthrs_plugin.observe.metrics import (
    CLAIMS,
    DISPATCH_DURATION,
    DISPATCHES,
    INSTRUMENT_NAMES,
    NULL_METRICS,
    SANDBOX_CONFLICTS,
    SANDBOX_EXECUTION_DURATION,
    SANDBOX_EXECUTIONS,
    SANDBOX_MATERIALIZATION_DURATION,
    SANDBOX_MATERIALIZATIONS,
    SCHEDULER_ADMISSIONS,
    SCHEDULER_DISPATCH_DURATION,
    SCHEDULER_NODES,
    STEP_CACHE_DECISIONS,
    Metrics,
    MetricsPort,
    NullMetrics,
    exit_tag,
    observe,
)

Series = dict[tuple[str, tuple[tuple[str, Any], ...]], Any]


def read(reader: InMemoryMetricReader) -> Series:
    """Every data point the SDK holds: counters as their value, histograms as (count, sum)."""
    out: Series = {}
    data = reader.get_metrics_data()
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    key = (metric.name, tuple(sorted((point.attributes or {}).items())))
                    out[key] = point.value if hasattr(point, "value") else (point.count, point.sum)
    return out


def outcome(name: str, value: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    return (name, (("outcome", value),))


def bare(name: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    return (name, ())


class FakeClock:
    """A deterministic monotonic clock: each reading advances by `step` seconds."""

    def __init__(self, step: float) -> None:
        self.now = 100.0
        self.step = step
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        value = self.now
        self.now += self.step
        return value


class Recorder:
    """A listener that keeps every event it is given."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, dict[str, str]]] = []

    def __call__(self, name: str, tag: str | None, attributes: Mapping[str, str]) -> None:
        self.events.append((name, tag, dict(attributes)))


@pytest.fixture
def sdk() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield provider, reader
    provider.shutdown()


@pytest.fixture
def wired(sdk: tuple[MeterProvider, InMemoryMetricReader]) -> tuple[Metrics, InMemoryMetricReader]:
    provider, reader = sdk
    return Metrics(provider), reader


# Every closed vocabulary, with the attribute values written out by hand (not derived by the code under test).
VOCABULARIES: list[tuple[str, str, dict[str, str]]] = [
    ("node_settled", SCHEDULER_NODES, {t: t for t in ("built", "clean", "failed", "skipped", "deferred")}),
    (
        "boundary_settled",
        BOUNDARY,
        {"Clean": "clean", "Deviation": "deviation", "Violation": "violation", "Refused": "refused"},
    ),
    (
        "cache_decision",
        STEP_CACHE_DECISIONS,
        {
            "VerifiedHit": "verified_hit",
            "Miss": "miss",
            "UnverifiableEvidence": "unverifiable_evidence",
            "Unmeasurable": "unmeasurable",
            "StaleReadSet": "stale_read_set",
            "ReplayFailed": "replay_failed",
        },
    ),
    (
        "claim_decision",
        CLAIMS,
        {
            "Activated": "activated",
            "Terminal": "terminal",
            "HeartbeatFresh": "heartbeat_fresh",
            "StealRefusedOwnerAlive": "steal_refused_owner_alive",
            "ClaimLost": "claim_lost",
            "ActivationLost": "activation_lost",
        },
    ),
    ("dispatch_exited", DISPATCHES, {"Success": "success", "Failure": "failure", "Interrupt": "interrupt"}),
    (
        "sandbox_execution_exited",
        SANDBOX_EXECUTIONS,
        {"Success": "success", "Failure": "failure", "Interrupt": "interrupt"},
    ),
    (
        "materialization_exited",
        SANDBOX_MATERIALIZATIONS,
        {"Success": "success", "Failure": "failure", "Interrupt": "interrupt"},
    ),
]


@pytest.mark.parametrize(("method", "name", "expected"), VOCABULARIES, ids=[v[0] for v in VOCABULARIES])
def test_each_outcome_is_counted_once_under_its_snake_case_attribute(
    wired: tuple[Metrics, InMemoryMetricReader], method: str, name: str, expected: dict[str, str]
) -> None:
    metrics, reader = wired
    for tag in expected:
        getattr(metrics, method)(tag)
    assert read(reader) == {outcome(name, snake): 1 for snake in expected.values()}


def test_one_decision_touches_exactly_one_series(wired: tuple[Metrics, InMemoryMetricReader]) -> None:
    metrics, reader = wired
    metrics.cache_decision("VerifiedHit")
    assert read(reader) == {outcome(STEP_CACHE_DECISIONS, "verified_hit"): 1}
    metrics.cache_decision("VerifiedHit")
    metrics.claim_decision("HeartbeatFresh")
    assert read(reader) == {
        outcome(STEP_CACHE_DECISIONS, "verified_hit"): 2,
        outcome(CLAIMS, "heartbeat_fresh"): 1,
    }


def test_admissions_and_conflicts_carry_no_attribute(wired: tuple[Metrics, InMemoryMetricReader]) -> None:
    metrics, reader = wired
    metrics.scheduler_admission()
    metrics.scheduler_admission()
    metrics.sandbox_conflict()
    assert read(reader) == {bare(SCHEDULER_ADMISSIONS): 2, bare(SANDBOX_CONFLICTS): 1}


def test_every_instrument_uses_the_flows_engine_prefix_and_durations_are_seconds(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, reader = wired
    for method, _, expected in VOCABULARIES:
        getattr(metrics, method)(next(iter(expected)))
    metrics.scheduler_admission()
    metrics.sandbox_conflict()
    for observer in (
        metrics.observe_dispatch(),
        metrics.observe_scheduler_dispatch(),
        metrics.observe_sandbox_execution(),
        metrics.observe_materialization(),
    ):
        with observer:
            pass
    data = reader.get_metrics_data()
    assert data is not None
    found = {mt.name: mt.unit for rm in data.resource_metrics for sm in rm.scope_metrics for mt in sm.metrics}
    assert set(found) == set(INSTRUMENT_NAMES)
    assert len(INSTRUMENT_NAMES) == 13
    assert all(n.startswith("flows_engine_") for n in found)
    durations = {
        DISPATCH_DURATION,
        SCHEDULER_DISPATCH_DURATION,
        SANDBOX_EXECUTION_DURATION,
        SANDBOX_MATERIALIZATION_DURATION,
    }
    assert {n for n, unit in found.items() if unit == "s"} == durations


@pytest.mark.parametrize(
    ("method", "bad"),
    [
        ("cache_decision", "verified_hit"),  # the attribute spelling is not a tag
        ("cache_decision", "Hit"),
        ("claim_decision", "Stolen"),
        ("node_settled", "Built"),
        ("boundary_settled", "clean"),
        ("dispatch_exited", "Cancelled"),
        ("sandbox_execution_exited", None),
        ("materialization_exited", 1),
    ],
)
def test_unknown_tag_is_refused_before_anything_is_recorded(
    wired: tuple[Metrics, InMemoryMetricReader], method: str, bad: Any
) -> None:
    metrics, reader = wired
    listener = Recorder()
    metrics.add_listener(listener)
    with pytest.raises(ValueError, match="unknown .* tag"):
        getattr(metrics, method)(bad)
    with pytest.raises(ValueError, match="unknown .* tag"):
        getattr(NULL_METRICS, method)(bad)
    assert read(reader) == {}
    assert listener.events == []


def test_observe_success_returns_the_value_and_records_success_and_one_duration(
    sdk: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    provider, reader = sdk
    clock = FakeClock(step=2.5)
    metrics = Metrics(provider, clock=clock)
    with metrics.observe_dispatch() as observation:
        value = 42
    assert observation is not None
    assert value == 42
    assert clock.readings == 2
    assert read(reader) == {outcome(DISPATCHES, "success"): 1, bare(DISPATCH_DURATION): (1, 2.5)}


def test_observe_failure_reraises_the_same_exception_object_and_records_failure(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, reader = wired
    original = RuntimeError("boom")

    def explode() -> None:
        raise original

    with pytest.raises(RuntimeError) as caught, metrics.observe_sandbox_execution():
        explode()
    assert caught.value is original
    # The traceback still ends in the frame that raised: nothing re-raised or wrapped it.
    assert traceback.extract_tb(original.__traceback__)[-1].name == "explode"
    assert original.__context__ is None and original.__cause__ is None
    points = read(reader)
    assert set(points) == {outcome(SANDBOX_EXECUTIONS, "failure"), bare(SANDBOX_EXECUTION_DURATION)}
    assert points[outcome(SANDBOX_EXECUTIONS, "failure")] == 1
    assert points[bare(SANDBOX_EXECUTION_DURATION)][0] == 1  # one duration point on failure too


def test_keyboard_interrupt_is_an_interrupt_and_propagates_unchanged(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, reader = wired
    original = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as caught, metrics.observe_materialization():
        raise original
    assert caught.value is original
    points = read(reader)
    assert points[outcome(SANDBOX_MATERIALIZATIONS, "interrupt")] == 1
    assert points[bare(SANDBOX_MATERIALIZATION_DURATION)][0] == 1
    assert outcome(SANDBOX_MATERIALIZATIONS, "failure") not in points


def test_fence_lost_and_declared_cancellations_are_interrupts(
    sdk: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    provider, reader = sdk

    class Cancelled(BaseException):
        pass

    metrics = Metrics(provider, cancellation=[Cancelled])
    for exc in (FenceLost("fence_lost", "another owner holds run r1"), Cancelled()):
        with pytest.raises(type(exc)), metrics.observe_dispatch():
            raise exc
    with pytest.raises(StoreError), metrics.observe_dispatch():
        raise StoreError("store_failed", "disk full")  # a store failure is a Failure, not an interrupt
    points = read(reader)
    assert points[outcome(DISPATCHES, "interrupt")] == 2
    assert points[outcome(DISPATCHES, "failure")] == 1
    assert points[bare(DISPATCH_DURATION)][0] == 3


def test_exit_tag_classifies_success_failure_and_interrupt_only_causes() -> None:
    class Cancelled(Exception):
        pass

    assert exit_tag(None) == "Success"
    assert exit_tag(ValueError("x")) == "Failure"
    assert exit_tag(KeyboardInterrupt()) == "Interrupt"
    assert exit_tag(SystemExit(1)) == "Interrupt"
    assert exit_tag(FenceLost("cancel_requested", "cancellation requested")) == "Interrupt"
    assert exit_tag(concurrent.futures.CancelledError()) == "Interrupt"
    assert exit_tag(asyncio.CancelledError()) == "Interrupt"
    assert exit_tag(Cancelled()) == "Failure"
    assert exit_tag(Cancelled(), cancellation=(Cancelled,)) == "Interrupt"


@pytest.mark.skipif(not hasattr(builtins, "BaseExceptionGroup"), reason="exception groups need Python 3.11")
def test_an_exception_group_is_an_interrupt_only_when_every_leaf_is() -> None:
    # The reference's Cause.hasInterruptsOnly.
    group = builtins.BaseExceptionGroup
    only_interrupts = group("g", [KeyboardInterrupt(), group("h", [SystemExit()])])
    mixed = group("g", [KeyboardInterrupt(), ValueError("x")])
    assert exit_tag(only_interrupts) == "Interrupt"
    assert exit_tag(mixed) == "Failure"


def test_decorator_form_records_every_call_and_returns_its_value(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, reader = wired

    @metrics.observe_dispatch()
    def double(x: int) -> int:
        """Docstring kept."""
        if x < 0:
            raise ValueError(x)
        return 2 * x

    assert double.__name__ == "double" and double.__doc__ == "Docstring kept."
    assert double(21) == 42
    assert double(1) == 2
    with pytest.raises(ValueError):
        double(-1)
    points = read(reader)
    assert points[outcome(DISPATCHES, "success")] == 2
    assert points[outcome(DISPATCHES, "failure")] == 1
    assert points[bare(DISPATCH_DURATION)][0] == 3


def test_decorated_function_may_run_on_many_threads_at_once(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, reader = wired
    n = 6
    inside = threading.Barrier(n, timeout=120)

    @metrics.observe_dispatch()
    def work(i: int) -> int:
        inside.wait()  # all n calls are inside the observed block together
        return i

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = sorted(pool.map(work, range(n)))
    assert results == list(range(n))
    assert read(reader)[outcome(DISPATCHES, "success")] == n


def test_module_observe_instruments_your_own_counter_and_timer(
    sdk: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    provider, reader = sdk
    meter = provider.get_meter("my.app")
    timer = meter.create_histogram("my_upload_duration", unit="s")
    counter = meter.create_counter("my_uploads")

    @observe(timer, counter, clock=FakeClock(step=0.5))
    def upload() -> str:
        return "etag"

    assert upload() == "etag"
    with pytest.raises(SystemExit), observe(timer, counter):
        raise SystemExit(3)
    points = read(reader)
    assert points[outcome("my_uploads", "success")] == 1
    assert points[outcome("my_uploads", "interrupt")] == 1
    count, total = points[bare("my_upload_duration")]
    assert count == 2 and total >= 0.5


def test_an_observation_refuses_to_time_two_blocks_at_once(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, reader = wired
    observation = metrics.observe_dispatch()
    with observation, pytest.raises(RuntimeError, match="already timing"):
        observation.__enter__()
    assert read(reader)[outcome(DISPATCHES, "success")] == 1
    with observation:  # reusable once the first block has exited
        pass
    assert read(reader)[outcome(DISPATCHES, "success")] == 2


def test_decorator_refuses_generator_and_coroutine_functions(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, _ = wired

    def gen() -> Iterator[int]:
        yield 1

    async def coro() -> int:
        return 1

    for fn in (gen, coro):
        with pytest.raises(TypeError, match="synchronous"):
            metrics.observe_dispatch()(fn)


def test_null_metrics_records_nothing_and_costs_nothing() -> None:
    null = NullMetrics()
    assert isinstance(null, MetricsPort)
    assert not hasattr(null, "__dict__")  # no instruments, no clock, no listeners to hold
    observer = null.observe_dispatch()
    # One shared stateless observer, and the decorator hands back the function itself: no wrapper, no clock read.
    assert observer is null.observe_sandbox_execution() is NULL_METRICS.observe_materialization()

    def fn() -> int:
        return 7

    assert observer(fn) is fn
    original = KeyError("k")
    with pytest.raises(KeyError) as caught, null.observe_scheduler_dispatch():
        raise original
    assert caught.value is original
    with observer, observer:  # stateless: nesting is fine
        pass
    null.cache_decision("Miss")
    null.node_settled("built")
    null.claim_decision("ActivationLost")
    null.boundary_settled("Refused")
    null.scheduler_admission()
    null.sandbox_conflict()


def test_metrics_implements_the_port_core_code_calls(wired: tuple[Metrics, InMemoryMetricReader]) -> None:
    metrics, _ = wired
    assert isinstance(metrics, MetricsPort)
    assert isinstance(NULL_METRICS, MetricsPort)


def test_listener_receives_each_counted_event_with_tag_and_attributes(
    wired: tuple[Metrics, InMemoryMetricReader],
) -> None:
    metrics, _ = wired
    listener = Recorder()
    metrics.add_listener(listener)
    metrics.cache_decision("StaleReadSet")
    metrics.node_settled("clean")
    metrics.scheduler_admission()
    with pytest.raises(OSError), metrics.observe_dispatch():
        raise OSError("disk")
    with metrics.observe_scheduler_dispatch():  # a timer only: no counted event
        pass
    assert listener.events == [
        (STEP_CACHE_DECISIONS, "StaleReadSet", {"outcome": "stale_read_set"}),
        (SCHEDULER_NODES, "clean", {"outcome": "clean"}),
        (SCHEDULER_ADMISSIONS, None, {}),
        (DISPATCHES, "Failure", {"outcome": "failure"}),
    ]
    metrics.remove_listener(listener)
    metrics.claim_decision("Activated")
    assert len(listener.events) == 4
    with pytest.raises(ValueError):
        metrics.remove_listener(listener)


def test_a_failing_listener_is_logged_and_changes_no_outcome(
    wired: tuple[Metrics, InMemoryMetricReader], caplog: pytest.LogCaptureFixture
) -> None:
    metrics, reader = wired

    def broken(name: str, tag: str | None, attributes: Mapping[str, str]) -> None:
        raise RuntimeError("listener bug")

    after = Recorder()
    metrics.add_listener(broken)
    metrics.add_listener(after)
    original = LookupError("the real failure")
    with caplog.at_level(logging.ERROR, logger="smthrs_plugin.observe.metrics"):
        with pytest.raises(LookupError) as caught, metrics.observe_dispatch():
            raise original
        metrics.cache_decision("Miss")
    assert caught.value is original  # the listener's error did not replace the block's exception
    assert original.__context__ is None
    assert [e[1] for e in after.events] == ["Failure", "Miss"]  # later listeners still ran
    assert read(reader)[outcome(STEP_CACHE_DECISIONS, "miss")] == 1
    logged = [r for r in caplog.records if "metrics listener" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info and r.exc_info[0] is RuntimeError for r in logged)


def test_listener_and_cancellation_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="callable"):
        Metrics(listeners=["not callable"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="exception classes"):
        Metrics(cancellation=[str])  # type: ignore[list-item]


def test_metrics_on_the_global_provider_records_without_an_sdk() -> None:
    # No provider installed: OpenTelemetry's API is a no-op and recording must still work (no SDK forced on users).
    metrics = Metrics()
    seen: list[Callable[..., Any]] = []
    metrics.add_listener(lambda *event: seen.append(event))  # type: ignore[arg-type]
    metrics.cache_decision("VerifiedHit")
    with metrics.observe_dispatch():
        pass
    assert len(seen) == 2


README_EXAMPLE = """
import threading
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from smthrs_plugin.observe.metrics import Metrics
from smthrs_plugin.engine.wakebus import WakeBus

reader = InMemoryMetricReader()                      # any reader/exporter the host chooses
metrics = Metrics(MeterProvider(metric_readers=[reader]))
metrics.cache_decision("VerifiedHit")                # flows_engine_step_cache_decisions{outcome="verified_hit"}
with metrics.observe_dispatch():                     # one duration + flows_engine_dispatches{outcome="success"}
    pass

bus, committed = WakeBus(), threading.Event()        # `committed` stands in for a durable row
def writer():
    committed.set()                                  # 1. commit the durable write
    bus.wake("run-1")                                # 2. then wake
with bus.subscribe("run-1") as sub:                  # a. subscribe BEFORE checking durable state
    threading.Thread(target=writer).start()
    while not committed.is_set():                    # b. check durable state
        sub.wait(timeout=1.0)                        # c. Woken early, or TimedOut -> poll again
"""


def test_readme_example_runs() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(README_EXAMPLE, "README.md", "exec"), namespace)
    points = read(namespace["reader"])
    assert points[outcome(STEP_CACHE_DECISIONS, "verified_hit")] == 1
    assert points[outcome(DISPATCHES, "success")] == 1
    assert namespace["committed"].is_set()
    assert namespace["bus"].watched() == 0


# -- the sandbox's materializations (copy-back), recorded by boundary.sandbox.run_in_sandbox ---------------------


def _sandbox_ws(tmp_path: Any) -> Any:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "in.txt").write_bytes(b"input\n")
    return ws


def test_a_sandbox_copy_back_is_one_successful_materialization_with_one_duration(
    wired: tuple[Metrics, InMemoryMetricReader], tmp_path: Any
) -> None:
    from smthrs_plugin.boundary import Declaration, run_in_sandbox

    metrics, reader = wired
    ws = _sandbox_ws(tmp_path)
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt"])

    def body(root: Any) -> None:
        (root / "out.txt").write_bytes((root / "in.txt").read_bytes().upper())

    run_in_sandbox(ws, decl, body, artifacts=None, temp_dir=tmp_path, metrics=metrics)
    series = read(reader)
    assert series[outcome(SANDBOX_MATERIALIZATIONS, "success")] == 1
    assert series[bare(SANDBOX_MATERIALIZATION_DURATION)][0] == 1
    assert (ws / "out.txt").read_bytes() == b"INPUT\n"


def test_a_materialization_conflict_is_one_failed_materialization_and_nothing_is_copied(
    wired: tuple[Metrics, InMemoryMetricReader], tmp_path: Any
) -> None:
    from smthrs_plugin.boundary import Declaration, run_in_sandbox
    from smthrs_plugin.errors import MaterializationConflict

    metrics, reader = wired
    ws = _sandbox_ws(tmp_path)
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt"])

    def body(root: Any) -> None:
        (root / "out.txt").write_bytes(b"from the step")
        (ws / "out.txt").write_bytes(b"someone else")  # the real workspace changes while the step runs

    with pytest.raises(MaterializationConflict):
        run_in_sandbox(ws, decl, body, artifacts=None, temp_dir=tmp_path, metrics=metrics)
    series = read(reader)
    assert series[outcome(SANDBOX_MATERIALIZATIONS, "failure")] == 1
    assert outcome(SANDBOX_MATERIALIZATIONS, "success") not in series
    assert series[bare(SANDBOX_MATERIALIZATION_DURATION)][0] == 1
    assert (ws / "out.txt").read_bytes() == b"someone else"


def test_a_body_that_fails_before_copy_back_records_no_materialization(
    wired: tuple[Metrics, InMemoryMetricReader], tmp_path: Any
) -> None:
    from smthrs_plugin.boundary import Declaration, run_in_sandbox

    metrics, reader = wired
    ws = _sandbox_ws(tmp_path)

    def body(root: Any) -> None:
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError):
        run_in_sandbox(ws, Declaration.of(reads=["in.txt"], writes=["out.txt"]), body, artifacts=None,
                       temp_dir=tmp_path, metrics=metrics)  # fmt: skip
    assert not [
        k for k in read(reader) if k[0] in (SANDBOX_MATERIALIZATIONS, SANDBOX_MATERIALIZATION_DURATION)
    ]
