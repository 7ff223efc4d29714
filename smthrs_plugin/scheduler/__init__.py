"""The plan scheduler: record/append/run with Reports, conflicts, reconciliation and hosts.

``PlanScheduler`` drives a persisted plan through the cache dispatch seam on a host; ``reconcile`` judges
deviations and unabsorbed conflicts; ``inputs`` pins source reads and the environment per run; ``planfile``
reads the YAML plan format.
"""

from __future__ import annotations

from ._inputs import environment_fingerprint, normalize_environment
from .cancel import CancelToken
from .host import Host, InlineHost, ThreadHost
from .job import JobOutcome, NodeJob
from .model import AlreadyRecorded, NodeInput, Recorded, RecordResult, Report, Settlement
from .reconcile import (
    ConflictCase,
    DefaultReconciler,
    Deviation,
    FactorOut,
    Fail,
    ReconcileContext,
    Reconciler,
    Reorder,
    Verdict,
)
from .scheduler import Executor, PlanScheduler, RunLifecycle

__all__ = [
    "AlreadyRecorded",
    "CancelToken",
    "ConflictCase",
    "DefaultReconciler",
    "Deviation",
    "Executor",
    "FactorOut",
    "Fail",
    "Host",
    "InlineHost",
    "JobOutcome",
    "NodeInput",
    "NodeJob",
    "PlanScheduler",
    "ReconcileContext",
    "Reconciler",
    "RecordResult",
    "Recorded",
    "Reorder",
    "RunLifecycle",
    "Report",
    "Settlement",
    "ThreadHost",
    "Verdict",
    "environment_fingerprint",
    "normalize_environment",
]
