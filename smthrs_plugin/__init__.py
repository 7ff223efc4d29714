"""smthrs_plugin — durable execution for Prefect.

A content-addressed step cache keyed on the bytes of declared inputs, step boundaries, fenced ownership,
approval gates and durable waits, with artifacts stored through fsspec (local disk and S3 alike).

This module is the public face: everything a flow author, a data team or a CI job needs is importable from here.
Prefect-backed names (``step``, ``Step``, ``step_settings``, ``PrefectHost``, ``run_plan_in_flow``,
``durable_run``) load on first use, so ``import smthrs_plugin`` (and ``smthrs --help``) never pays for importing
Prefect.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .boundary import Declaration
from .cache import CacheDispatcher, DispatchRequest, DispatchResult
from .canonical import canonical_bytes, key, key_digest
from .control import (
    Control,
    DelegatedAuthority,
    Delegation,
    Envelope,
    NodeTarget,
    PlanCard,
    PlanTarget,
    Principal,
    require_approval,
)
from .control.receipts import Accepted, AlreadyApplied, Conflict, Parked, Terminal
from .engine.active_run import FlowCompleted, FlowFailed, FlowParked
from .engine.cancellation import cancel_run
from .engine.context import RunCancelled, RunContext, RunParked, RunReleased, current_run
from .engine.driver import RunDriver
from .engine.fence import OwnerId
from .engine.flow_waits import complete, sleep, sleep_until, wait_for
from .errors import (
    ApprovalDenied,
    ArtifactError,
    BoundaryError,
    BoundaryRefusal,
    CacheError,
    CanonicalError,
    ControlError,
    FenceLost,
    GraphError,
    InvalidInput,
    PlanError,
    PluginError,
    ReplayError,
    RunParentCycleError,
    SchedulerError,
    SettingsError,
    SmthrsError,
    StoreError,
    WaitError,
)
from .hooks import Plugins, get_plugins, hookimpl
from .hosts.local import LocalHost
from .hosts.workspace import Workspace
from .observe.catalog import RunFilters, list_runs
from .observe.metrics import Metrics
from .observe.watch import ControlEvent, watch
from .plan import (
    ABSENT,
    Admission,
    Concurrency,
    Literal,
    NodeDraft,
    Pending,
    Plan,
    PlanNode,
    Ref,
    RuntimeGraph,
    append_plan,
    compile_plan,
    node,
    verify_plan,
)
from .runtime import Runtime, open_runtime
from .scheduler import (
    DefaultReconciler,
    FactorOut,
    Fail,
    InlineHost,
    NodeInput,
    PlanScheduler,
    Reorder,
    Report,
    Settlement,
)
from .scheduler.planfile import load_plan, read_plan_file
from .settings import Settings, load_settings
from .stores.artifacts import ArtifactStore
from .stores.database import open_database

if TYPE_CHECKING:  # pragma: no cover
    from .hosts._steprun import step_settings
    from .hosts.flows import durable_run
    from .hosts.prefect import PrefectHost, run_plan_in_flow
    from .hosts.step import Step, step

__version__ = "0.1.0"

_LAZY = {
    "step": ("hosts.step", "step"),
    "Step": ("hosts.step", "Step"),
    "step_settings": ("hosts._steprun", "step_settings"),
    "PrefectHost": ("hosts.prefect", "PrefectHost"),
    "run_plan_in_flow": ("hosts.prefect", "run_plan_in_flow"),
    "durable_run": ("hosts.flows", "durable_run"),
}


def __getattr__(name: str) -> object:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'smthrs_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{target[0]}", __name__), target[1])
    globals()[name] = value
    return value


__all__ = [
    # plans
    "ABSENT", "Admission", "Concurrency", "Literal", "NodeDraft", "Pending", "Plan", "PlanNode", "Ref",
    "RuntimeGraph", "append_plan", "compile_plan", "node", "verify_plan", "load_plan", "read_plan_file",
    # runtime, scheduler, hosts
    "Runtime", "open_runtime", "PlanScheduler", "Report", "Settlement", "NodeInput", "DefaultReconciler",
    "Reorder", "FactorOut", "Fail", "InlineHost", "LocalHost", "Workspace",
    "step", "Step", "step_settings", "PrefectHost", "run_plan_in_flow", "durable_run",
    # stores, cache, boundary
    "open_database", "OwnerId", "ArtifactStore", "Declaration", "CacheDispatcher", "DispatchRequest",
    "DispatchResult",
    # waits and the run driver
    "sleep", "sleep_until", "wait_for", "complete", "cancel_run", "current_run", "RunContext", "RunDriver",
    "RunParked", "RunCancelled", "RunReleased", "FlowCompleted", "FlowFailed", "FlowParked",
    # control plane
    "Control", "PlanCard", "Envelope", "Principal", "Delegation", "DelegatedAuthority", "PlanTarget",
    "NodeTarget", "require_approval", "Accepted", "AlreadyApplied", "Parked", "Conflict", "Terminal",
    # observation
    "watch", "ControlEvent", "list_runs", "RunFilters", "Metrics",
    # plugins
    "Plugins", "get_plugins", "hookimpl",
    # keys, settings
    "canonical_bytes", "key", "key_digest", "Settings", "load_settings",
    # errors
    "SmthrsError", "CanonicalError", "SettingsError", "PlanError", "GraphError", "SchedulerError", "StoreError",
    "FenceLost", "RunParentCycleError", "ArtifactError", "BoundaryError", "BoundaryRefusal", "ReplayError",
    "CacheError", "ControlError", "InvalidInput", "ApprovalDenied", "WaitError", "PluginError",
]  # fmt: skip
