"""Observation of the engine: OpenTelemetry metrics, the journal :func:`watch` (a live stream unless called with
``follow=False``, which gives a finite snapshot), the run catalog (:func:`list_runs`);
the namespaces ``observe.snapshot`` (coherent reads of many runs) and ``observe.feed`` (the change feed).

Core code below this package records through the floor-0 port ``smthrs_plugin._metrics`` (``MetricsPort``,
``NULL_METRICS``); the composition root injects :class:`Metrics` from here.
"""

from __future__ import annotations

from .._metrics import (
    BOUNDARY_SETTLEMENTS,
    CACHE_DECISIONS,
    CLAIM_DECISIONS,
    DEFAULT_INTERRUPTS,
    EXIT_TAGS,
    NODE_OUTCOMES,
    attribute_value,
)
from .catalog import RunFilters, RunPage, list_runs
from .metrics import (
    INSTRUMENT_NAMES,
    NULL_METRICS,
    Listener,
    Metrics,
    MetricsPort,
    NullMetrics,
    Observation,
    exit_tag,
    observe,
)
from .watch import ControlEvent, watch

__all__ = [
    "BOUNDARY_SETTLEMENTS",
    "CACHE_DECISIONS",
    "CLAIM_DECISIONS",
    "ControlEvent",
    "DEFAULT_INTERRUPTS",
    "EXIT_TAGS",
    "INSTRUMENT_NAMES",
    "NODE_OUTCOMES",
    "NULL_METRICS",
    "Listener",
    "Metrics",
    "MetricsPort",
    "NullMetrics",
    "Observation",
    "RunFilters",
    "RunPage",
    "attribute_value",
    "exit_tag",
    "list_runs",
    "observe",
    "watch",
]
