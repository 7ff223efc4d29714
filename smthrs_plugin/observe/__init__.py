"""Observation of the engine: OpenTelemetry metrics (``metrics``); journal watch, snapshots and feeds live beside it.

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

__all__ = [
    "BOUNDARY_SETTLEMENTS",
    "CACHE_DECISIONS",
    "CLAIM_DECISIONS",
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
    "attribute_value",
    "exit_tag",
    "observe",
]
