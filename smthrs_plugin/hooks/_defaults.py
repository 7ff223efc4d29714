"""The built-in implementations, registered first and answering last (``trylast``): any installed plugin that
answers a ``firstresult`` hook overrides them.

- reconciler: :class:`~smthrs_plugin.scheduler.reconcile.DefaultReconciler` (Reorder / FactorOut / Fail);
- liveness: :class:`~smthrs_plugin.engine.ownership.liveness.LeaseLiveness` (the only evidence every host has);
- approval authority: ``control.authority.DEFAULT_AUTHORITY`` — only principal ``local/operator`` may decide
  (the reference's "who may decide" rule; delegations are ``control.authority.DelegatedAuthority``).

No run waker is built in (``smthrs_run_waker``): a run no plugin's host continues on its own is continued by a
``smthrs worker`` or a resume, which read the durable wake themselves.

Hosts are not built in here: without a selecting provider the scheduler keeps its local thread pool, and the
Prefect host is itself a plugin announced by this distribution's own ``smthrs`` entry point (``prefect`` sits above
``hooks`` in the layering, so it is discovered, never imported from here).
"""

from __future__ import annotations

from typing import Any

from ..control.authority import DEFAULT_AUTHORITY
from ..engine.ownership.liveness import LeaseLiveness, LivenessCheck
from ..scheduler.reconcile import DefaultReconciler, Reconciler
from ..settings import Settings
from .specs import hookimpl

__all__ = ["BuiltinPlugin", "BUILTIN_NAME"]

BUILTIN_NAME = "smthrs-builtin"


class BuiltinPlugin:
    """The built-in answers (see the module docstring)."""

    @hookimpl(trylast=True)
    def smthrs_reconciler(self, settings: Settings) -> Reconciler:
        return DefaultReconciler()

    @hookimpl(trylast=True)
    def smthrs_liveness_check(self, settings: Settings) -> LivenessCheck:
        return LeaseLiveness()

    @hookimpl(trylast=True)
    def smthrs_approval_authority(self, settings: Settings) -> Any:
        return DEFAULT_AUTHORITY

    def __repr__(self) -> str:
        return "BuiltinPlugin()"
