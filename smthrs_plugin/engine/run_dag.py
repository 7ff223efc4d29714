"""The run DAG, as the engine names it: re-exported from its owner, :mod:`smthrs_plugin.records.run_dag`."""

from __future__ import annotations

from ..records.run_dag import (
    ParentExisting,
    ParentRecorded,
    RunEdge,
    cycle_error,
    edges,
    record_parent,
)

__all__ = ["ParentRecorded", "ParentExisting", "RunEdge", "record_parent", "edges", "cycle_error"]
