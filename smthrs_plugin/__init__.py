"""smthrs_plugin — durable execution for Prefect.

A content-addressed step cache keyed on the bytes of declared inputs, step boundaries, fenced ownership,
approval gates and durable waits, with artifacts stored through fsspec (local disk and S3 alike).

This module is the public face for a Prefect flow author (``import smthrs_plugin as sp``). Everything in
``__all__`` is stable; two namespaces hold the rest of the surface:

- :mod:`smthrs_plugin.plan` (``sp.plan``) — declaring plans: ``node``, ``Ref``, ``Pending``, ``Value``,
  ``compile_plan``, ``append_plan``, ``verify_plan``, ``Plan``, ``RuntimeGraph``;
- :mod:`smthrs_plugin.control` (``sp.control``) — the control plane's types: receipts, plan cards, envelopes,
  principals, approval targets and authorities (the facade :class:`Control` is also here, at the top);
- :mod:`smthrs_plugin.errors` — every typed error; the ones a flow author catches are re-exported here.

Running a plan — ONE way from Python, one from the CLI:

- Python: ``with sp.open_runtime() as rt: report = rt.scheduler(run_id).run(plan, executor)``. The scheduler drives
  its own run (creates, claims, heartbeats, settles or parks it; node approval gates; the Prefect host inside a
  flow run, the local thread pool outside). A plan file is loaded with ``plan, executor = sp.load_plan(path)``
  and run the same way.
- CLI: ``smthrs run PLAN.yaml --key IDEMPOTENCY_KEY [--prefect]`` — the same run behind a receipt, with plan
  approval (``smthrs plan`` / ``smthrs approve``) and crash-safe retries under the same key.

Names that look alike name different things: :class:`RunParked` is the signal RAISED to the caller of a flow
whose run parked (the process may exit); :class:`DriveParked` is what :func:`durable_run` RETURNS when the drive
parked; ``sp.control.Parked`` is the control plane's receipt for a plan waiting for approval.

Invariant: ``import smthrs_plugin`` never imports Prefect (nor ``smthrs --help``): every public name loads on
first use, and the Prefect-backed ones (``step``, ``Step``, ``step_settings``, ``durable_run``) import Prefect then.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

# The composition of the public face: waits inside a Prefect @flow body find their run through the Prefect
# integration's provider (asked only when nothing was activated on the thread; free outside a flow run). Both
# modules are light; registering here, at import, means no import order can leave a flow body without its run.
from .engine.context import register_provider as _register_provider
from .prefect import flow_run_context as _flow_run_context

_register_provider(_flow_run_context)

if TYPE_CHECKING:  # pragma: no cover
    from . import control as control
    from . import plan as plan
    from .control.approvals import require_approval
    from .control.facade import Control
    from .engine.context import RunContext, RunParked, current_run
    from .engine.drive.active_run import (
        DriveLost,
        DriveNotClaimed,
        DriveOutcome,
        DriveParked,
        DriveReleased,
        DriveSettled,
        DriveUnregistered,
    )
    from .engine.waits.flow_waits import complete, sleep, sleep_until, wait_for
    from .errors import (
        ApprovalDenied,
        ArtifactError,
        BoundaryError,
        BoundaryRefusal,
        CacheError,
        CanonicalError,
        CodecError,
        ControlError,
        PlanError,
        RemoteError,
        SchedulerError,
        SettingsError,
        SmthrsError,
        StoreError,
        WaitError,
    )
    from .hooks import hookimpl
    from .prefect.flows import durable_run
    from .prefect.step import Step, step
    from .prefect.steprun import step_settings
    from .prefect.workspace import Workspace
    from .runtime import Runtime, open_runtime
    from .scheduler.model import NodeInput
    from .scheduler.planfile import load_plan
    from .settings import Settings, load_settings

__version__ = "0.1.0"

# Every public name loads on first use (PEP 562), so `import smthrs_plugin` — and with it `smthrs --help`, whose
# modules live inside this package — pays for SQLAlchemy, pydantic and the stores only once a name is asked for.
_LAZY: dict[str, tuple[str, str | None]] = {
    "control": ("control", None),
    "plan": ("plan", None),
    "require_approval": ("control.approvals", "require_approval"),
    "Control": ("control.facade", "Control"),
    **{n: ("engine.context", n) for n in ("RunContext", "RunParked", "current_run")},
    **{
        n: ("engine.drive.active_run", n)
        for n in (
            "DriveLost",
            "DriveNotClaimed",
            "DriveOutcome",
            "DriveParked",
            "DriveReleased",
            "DriveSettled",
            "DriveUnregistered",
        )
    },
    **{n: ("engine.waits.flow_waits", n) for n in ("complete", "sleep", "sleep_until", "wait_for")},
    **{
        n: ("errors", n)
        for n in (
            "ApprovalDenied",
            "ArtifactError",
            "BoundaryError",
            "BoundaryRefusal",
            "CacheError",
            "CanonicalError",
            "CodecError",
            "ControlError",
            "PlanError",
            "RemoteError",
            "SchedulerError",
            "SettingsError",
            "SmthrsError",
            "StoreError",
            "WaitError",
        )
    },
    "hookimpl": ("hooks", "hookimpl"),
    "Workspace": ("prefect.workspace", "Workspace"),
    "Runtime": ("runtime", "Runtime"),
    "open_runtime": ("runtime", "open_runtime"),
    "NodeInput": ("scheduler.model", "NodeInput"),
    "load_plan": ("scheduler.planfile", "load_plan"),
    "Settings": ("settings", "Settings"),
    "load_settings": ("settings", "load_settings"),
    # Prefect-backed: these import Prefect.
    "step": ("prefect.step", "step"),
    "Step": ("prefect.step", "Step"),
    "step_settings": ("prefect.steprun", "step_settings"),
    "durable_run": ("prefect.flows", "durable_run"),
}


def __getattr__(name: str) -> object:
    target = _LAZY.get(name)
    if target is None:
        # A subpackage stays an attribute of the package, as it was when this module imported them all eagerly.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'smthrs_plugin' has no attribute {name!r}")
    module = importlib.import_module(f".{target[0]}", __name__)
    value = module if target[1] is None else getattr(module, target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    # steps: a cached, sandboxed Prefect task
    "step", "Step", "step_settings", "Workspace",
    # durable flows: drive a Prefect @flow as a run, and how the drive ended
    "durable_run", "DriveOutcome", "DriveSettled", "DriveParked", "DriveReleased", "DriveLost", "DriveNotClaimed",
    "DriveUnregistered",
    # durable waits, inside a flow body or a driven function
    "sleep", "sleep_until", "wait_for", "complete", "require_approval", "current_run", "RunContext", "RunParked",
    # running plans (declared with sp.plan), the control plane (types in sp.control)
    "open_runtime", "Runtime", "NodeInput", "load_plan", "Control",
    # plugins, settings
    "hookimpl", "Settings", "load_settings",
    # errors a flow author catches (every family: smthrs_plugin.errors)
    "SmthrsError", "SettingsError", "CanonicalError", "CodecError", "PlanError", "SchedulerError", "StoreError",
    "ArtifactError", "BoundaryError", "BoundaryRefusal", "CacheError", "ControlError", "ApprovalDenied",
    "WaitError", "RemoteError",
]  # fmt: skip
