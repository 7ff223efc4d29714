"""Engine metrics through the OpenTelemetry *API* only: counters dimensioned by ``outcome``, duration histograms.

The shape is the reference engine's ``EngineStoreMetrics``: every hot path has an outcome-dimensioned counter and,
where it is an operation rather than a decision, a duration timer. The instrument names are the reference's own
``flows_engine_*`` names, unchanged, so a dashboard built on them finds these series without edits. A Prometheus
exporter adds its own suffixes (``flows_engine_dispatches_total``, ``flows_engine_dispatch_duration_seconds``).

Invariants
- This package never installs an SDK, a reader or an exporter: wiring metrics to a backend is the host's job.
  Without a configured provider OpenTelemetry's API is a no-op; :class:`Metrics` bound to the global provider
  starts recording as soon as the host installs one (the API's proxy instruments).
- Every counter carries exactly one attribute, ``outcome``, whose value is the snake case of a tag from a closed
  vocabulary (``VerifiedHit`` → ``verified_hit``); an unknown tag raises ``ValueError`` before anything is
  recorded. ``scheduler_admissions`` and ``sandbox_conflicts`` carry no attribute, as the reference requires.
- :func:`observe` records one duration (monotonic clock) and one exit outcome on success, failure and interruption
  alike, and never alters the wrapped call: the same value, the same exception object, traceback intact. This is
  the reference's ``Effect.trackDuration`` + ``Effect.onExit`` pair.
- Listeners see each counted event; a listener that raises is logged with its traceback and never changes the
  instrumented operation's outcome (OpenTelemetry's error-handling principle: telemetry must not break the code it
  observes).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, Optional, TypeVar

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import Counter, Histogram, MeterProvider

from .._metrics import (
    BOUNDARY_SETTLEMENTS,
    CACHE_DECISIONS,
    CLAIM_DECISIONS,
    DEFAULT_INTERRUPTS,
    EXIT_TAGS,
    NODE_OUTCOMES,
    NULL_METRICS,
    BoundarySettlement,
    CacheDecision,
    ClaimDecision,
    ExitTag,
    MetricsPort,
    NodeOutcome,
    NullMetrics,
    check_tag,
    classify_exit,
    exit_tag,
    outcome_attributes,
)

__all__ = [
    "METER_NAME",
    "DISPATCHES",
    "DISPATCH_DURATION",
    "SCHEDULER_ADMISSIONS",
    "SCHEDULER_DISPATCH_DURATION",
    "SCHEDULER_NODES",
    "SANDBOX_EXECUTIONS",
    "SANDBOX_EXECUTION_DURATION",
    "SANDBOX_MATERIALIZATIONS",
    "SANDBOX_MATERIALIZATION_DURATION",
    "SANDBOX_CONFLICTS",
    "BOUNDARY_SETTLEMENTS_METRIC",
    "STEP_CACHE_DECISIONS",
    "CLAIMS",
    "INSTRUMENT_NAMES",
    "Listener",
    "Observation",
    "observe",
    "Metrics",
    # re-exported from the floor-0 port, so users find the whole surface here
    "MetricsPort",
    "NullMetrics",
    "NULL_METRICS",
    "exit_tag",
]

_log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

METER_NAME = "smthrs_plugin"
"""The instrumentation scope every instrument is created under."""

DISPATCHES = "flows_engine_dispatches"
DISPATCH_DURATION = "flows_engine_dispatch_duration"
SCHEDULER_ADMISSIONS = "flows_engine_scheduler_admissions"
SCHEDULER_DISPATCH_DURATION = "flows_engine_scheduler_dispatch_duration"
SCHEDULER_NODES = "flows_engine_scheduler_nodes"
SANDBOX_EXECUTIONS = "flows_engine_sandbox_executions"
SANDBOX_EXECUTION_DURATION = "flows_engine_sandbox_execution_duration"
SANDBOX_MATERIALIZATIONS = "flows_engine_sandbox_materializations"
SANDBOX_MATERIALIZATION_DURATION = "flows_engine_sandbox_materialization_duration"
SANDBOX_CONFLICTS = "flows_engine_sandbox_conflicts"
BOUNDARY_SETTLEMENTS_METRIC = "flows_engine_boundary_settlements"
STEP_CACHE_DECISIONS = "flows_engine_step_cache_decisions"
CLAIMS = "flows_engine_claims"

INSTRUMENT_NAMES: tuple[str, ...] = (
    DISPATCHES,
    DISPATCH_DURATION,
    SCHEDULER_ADMISSIONS,
    SCHEDULER_DISPATCH_DURATION,
    SCHEDULER_NODES,
    SANDBOX_EXECUTIONS,
    SANDBOX_EXECUTION_DURATION,
    SANDBOX_MATERIALIZATIONS,
    SANDBOX_MATERIALIZATION_DURATION,
    SANDBOX_CONFLICTS,
    BOUNDARY_SETTLEMENTS_METRIC,
    STEP_CACHE_DECISIONS,
    CLAIMS,
)

# Seconds. OpenTelemetry's default buckets (0…10000) assume milliseconds; a dispatch spans a cache hit (~ms) to
# a long build (~tens of minutes), so the advisory boundaries cover that range. A host's View may override them.
_DURATION_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)

_EXIT = outcome_attributes(EXIT_TAGS)
_NODE = outcome_attributes(NODE_OUTCOMES)
_BOUNDARY = outcome_attributes(BOUNDARY_SETTLEMENTS)
_CACHE = outcome_attributes(CACHE_DECISIONS)
_CLAIM = outcome_attributes(CLAIM_DECISIONS)
_NO_ATTRIBUTES: Mapping[str, str] = MappingProxyType({})

Listener = Callable[[str, Optional[str], Mapping[str, str]], None]
"""``listener(instrument_name, outcome_tag_or_None, attributes)``, called once per counted event, on the thread
that recorded it. ``outcome`` is the vocabulary's own word (``"VerifiedHit"``, ``"built"``); ``attributes`` is the
read-only mapping recorded on the counter (``{"outcome": "verified_hit"}``, empty for attribute-less counters)."""


class Observation:
    """A duration timer composed with an exit-outcome counter; a context manager and a decorator.

    ``with observation:`` times one block. An instance runs one block at a time (entering it twice before it exits
    raises ``RuntimeError``); ``@observation`` wraps a synchronous function and makes a fresh timing per call, so
    the decorated function may run on many threads at once."""

    __slots__ = ("_timer", "_counter", "_clock", "_interrupts", "_on_exit", "_started_at")

    def __init__(
        self,
        timer: Histogram | None,
        counter: Counter | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        interrupts: tuple[type[BaseException], ...] = DEFAULT_INTERRUPTS,
        on_exit: Callable[[ExitTag], None] | None = None,
    ) -> None:
        self._timer = timer
        self._counter = counter
        self._clock = clock
        self._interrupts = interrupts
        self._on_exit = on_exit
        self._started_at: float | None = None

    def _fresh(self) -> Observation:
        return Observation(
            self._timer, self._counter, clock=self._clock, interrupts=self._interrupts, on_exit=self._on_exit
        )

    def __enter__(self) -> Observation:
        if self._started_at is not None:
            raise RuntimeError(
                "this Observation is already timing a block; create one per block (observe(...) or "
                "metrics.observe_*() each return a fresh one), or use it as a decorator"
            )
        self._started_at = self._clock()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        started_at, self._started_at = self._started_at, None
        if started_at is None:
            raise RuntimeError("Observation exited without being entered")
        elapsed = self._clock() - started_at
        tag = classify_exit(exc, self._interrupts)
        if self._timer is not None:
            self._timer.record(elapsed)
        if self._counter is not None:
            self._counter.add(1, _EXIT[tag])
        if self._on_exit is not None:
            self._on_exit(tag)
        # Returning None (falsy) lets the interpreter re-raise the original exception object itself: no wrapping,
        # no new traceback entry, no suppression.
        return None

    def __call__(self, fn: F) -> F:
        if (
            inspect.iscoroutinefunction(fn)
            or inspect.isgeneratorfunction(fn)
            or inspect.isasyncgenfunction(fn)
        ):
            # Such a call returns at once; timing it would record the creation of a coroutine or generator, not
            # the work. The core is synchronous.
            raise TypeError(f"observe cannot decorate {fn!r}: only synchronous, non-generator functions")

        @functools.wraps(fn)
        def observed(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return fn(*args, **kwargs)

        return observed  # type: ignore[return-value]


def observe(
    timer: Histogram | None,
    counter: Counter | None,
    *,
    cancellation: Iterable[type[BaseException]] = (),
    clock: Callable[[], float] = time.monotonic,
) -> Observation:
    """Instrument your own operation the way the engine does: ``timer`` (a histogram, seconds) gets one duration,
    ``counter`` gets one increment with ``outcome`` = ``success|failure|interrupt``. Either may be None.

    ``cancellation`` adds exception types that count as ``Interrupt`` besides :data:`DEFAULT_INTERRUPTS`."""
    return Observation(timer, counter, clock=clock, interrupts=_interrupts(cancellation))


def _interrupts(cancellation: Iterable[type[BaseException]]) -> tuple[type[BaseException], ...]:
    extra = tuple(cancellation)
    for t in extra:
        if not (isinstance(t, type) and issubclass(t, BaseException)):
            raise TypeError(f"cancellation types must be exception classes, got {t!r}")
    return DEFAULT_INTERRUPTS + extra


class Metrics:
    """The engine's instruments on one meter, with typed record methods (implements ``MetricsPort``).

    ``meter_provider`` defaults to OpenTelemetry's global provider. ``cancellation`` adds exception types counted
    as ``Interrupt``. ``clock`` is the monotonic clock durations are measured with (injectable for tests)."""

    def __init__(
        self,
        meter_provider: MeterProvider | None = None,
        *,
        listeners: Iterable[Listener] = (),
        cancellation: Iterable[type[BaseException]] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interrupts = _interrupts(cancellation)
        self._clock = clock
        self._listeners_lock = threading.Lock()
        self._listeners: tuple[Listener, ...] = ()
        for listener in listeners:
            self.add_listener(listener)
        meter = otel_metrics.get_meter(METER_NAME, meter_provider=meter_provider)

        def counter(name: str, unit: str, description: str) -> Counter:
            return meter.create_counter(name, unit=unit, description=description)

        def timer(name: str, description: str) -> Histogram:
            return meter.create_histogram(
                name,
                unit="s",
                description=description,
                explicit_bucket_boundaries_advisory=_DURATION_BUCKETS_S,
            )

        self.dispatches = counter(DISPATCHES, "{dispatch}", "Durable dispatches by exit outcome")
        self.dispatch_duration = timer(
            DISPATCH_DURATION, "One durable dispatch, admission through settlement"
        )
        self.scheduler_admissions = counter(
            SCHEDULER_ADMISSIONS,
            "{pass}",
            "Plan scheduler admission passes that launched at least one dispatch",
        )
        self.scheduler_dispatch_duration = timer(
            SCHEDULER_DISPATCH_DURATION, "One scheduler node dispatch, admission through terminal event"
        )
        self.scheduler_nodes = counter(SCHEDULER_NODES, "{node}", "Plan node settlements by outcome")
        self.sandbox_executions = counter(
            SANDBOX_EXECUTIONS, "{execution}", "Workspace transaction executions by exit outcome"
        )
        self.sandbox_execution_duration = timer(SANDBOX_EXECUTION_DURATION, "One workspace transaction")
        self.sandbox_materializations = counter(
            SANDBOX_MATERIALIZATIONS, "{materialization}", "Sandbox copy-backs by exit outcome"
        )
        self.sandbox_materialization_duration = timer(
            SANDBOX_MATERIALIZATION_DURATION, "One sandbox copy-back"
        )
        self.sandbox_conflicts = counter(
            SANDBOX_CONFLICTS, "{conflict}", "Copy-back compare-and-set refusals (contention, not errors)"
        )
        self.boundary_settlements = counter(
            BOUNDARY_SETTLEMENTS_METRIC, "{settlement}", "Step boundary settlements by outcome"
        )
        self.step_cache_decisions = counter(
            STEP_CACHE_DECISIONS, "{decision}", "Effective cache decisions at the dispatch seam"
        )
        self.claims = counter(CLAIMS, "{decision}", "Run driver claim-and-activate decisions by outcome")

    # -- listeners -------------------------------------------------------------------------------------------

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """The current listeners (an immutable snapshot)."""
        return self._listeners

    def add_listener(self, listener: Listener) -> None:
        """Mirror every counted event to ``listener`` (e.g. the Prefect host emitting Prefect events)."""
        if not callable(listener):
            raise TypeError(f"a metrics listener must be callable, got {listener!r}")
        with self._listeners_lock:
            # Copy-on-write: recording threads read the tuple without taking the lock.
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop mirroring to ``listener``; ``ValueError`` if it was never added."""
        with self._listeners_lock:
            current = list(self._listeners)
            current.remove(listener)
            self._listeners = tuple(current)

    def _notify(self, name: str, outcome: str | None, attributes: Mapping[str, str]) -> None:
        for listener in self._listeners:
            try:
                listener(name, outcome, attributes)
            except Exception:
                # Logged with its traceback, not raised: a mirror's bug must not turn a committed dispatch into a
                # failure, nor replace the exception an observed block is propagating.
                _log.exception("metrics listener %r failed on %s outcome=%s", listener, name, outcome)

    def _count(
        self, counter: Counter, name: str, vocabulary: str, table: Mapping[str, Mapping[str, str]], tag: str
    ) -> None:
        check_tag(vocabulary, tag, table)
        attributes = table[tag]
        counter.add(1, attributes)
        self._notify(name, tag, attributes)

    def _observation(self, timer: Histogram, counter: Counter | None, name: str | None) -> Observation:
        on_exit: Callable[[ExitTag], None] | None = None
        if counter is not None and name is not None:
            counter_name = name

            def on_exit(tag: ExitTag) -> None:
                self._notify(counter_name, tag, _EXIT[tag])

        return Observation(timer, counter, clock=self._clock, interrupts=self._interrupts, on_exit=on_exit)

    # -- classification ----------------------------------------------------------------------------------------

    def exit_tag(self, exc: BaseException | None) -> ExitTag:
        """Classify an exit with this instance's interrupt types (defaults plus ``cancellation``)."""
        return classify_exit(exc, self._interrupts)

    # -- the record methods core code calls (MetricsPort) ------------------------------------------------------

    def dispatch_exited(self, tag: ExitTag) -> None:
        """Count one durable dispatch exit (use :meth:`observe_dispatch` to time it as well)."""
        self._count(self.dispatches, DISPATCHES, "exit", _EXIT, tag)

    def observe_dispatch(self) -> Observation:
        """Time one durable dispatch and count its exit."""
        return self._observation(self.dispatch_duration, self.dispatches, DISPATCHES)

    def scheduler_admission(self) -> None:
        """Count one admission pass that launched at least one dispatch."""
        self.scheduler_admissions.add(1)
        self._notify(SCHEDULER_ADMISSIONS, None, _NO_ATTRIBUTES)

    def observe_scheduler_dispatch(self) -> Observation:
        """Time one scheduler node dispatch (a timer only; the node's outcome is :meth:`node_settled`)."""
        return self._observation(self.scheduler_dispatch_duration, None, None)

    def node_settled(self, outcome: NodeOutcome) -> None:
        """Count one node settlement: ``built|clean|failed|skipped|deferred``."""
        self._count(self.scheduler_nodes, SCHEDULER_NODES, "node outcome", _NODE, outcome)

    def sandbox_execution_exited(self, tag: ExitTag) -> None:
        """Count one workspace transaction exit."""
        self._count(self.sandbox_executions, SANDBOX_EXECUTIONS, "exit", _EXIT, tag)

    def observe_sandbox_execution(self) -> Observation:
        """Time one workspace transaction and count its exit."""
        return self._observation(self.sandbox_execution_duration, self.sandbox_executions, SANDBOX_EXECUTIONS)

    def materialization_exited(self, tag: ExitTag) -> None:
        """Count one copy-back exit."""
        self._count(self.sandbox_materializations, SANDBOX_MATERIALIZATIONS, "exit", _EXIT, tag)

    def observe_materialization(self) -> Observation:
        """Time one copy-back and count its exit."""
        return self._observation(
            self.sandbox_materialization_duration, self.sandbox_materializations, SANDBOX_MATERIALIZATIONS
        )

    def sandbox_conflict(self) -> None:
        """Count one copy-back compare-and-set refusal."""
        self.sandbox_conflicts.add(1)
        self._notify(SANDBOX_CONFLICTS, None, _NO_ATTRIBUTES)

    def boundary_settled(self, tag: BoundarySettlement) -> None:
        """Count one boundary settlement: ``Clean|Deviation|Violation|Refused``."""
        self._count(
            self.boundary_settlements, BOUNDARY_SETTLEMENTS_METRIC, "boundary settlement", _BOUNDARY, tag
        )

    def cache_decision(self, tag: CacheDecision) -> None:
        """Count one effective cache decision (at most one per cache-consulting dispatch)."""
        self._count(self.step_cache_decisions, STEP_CACHE_DECISIONS, "cache decision", _CACHE, tag)

    def claim_decision(self, tag: ClaimDecision) -> None:
        """Count one run-driver claim-and-activate decision."""
        self._count(self.claims, CLAIMS, "claim decision", _CLAIM, tag)
