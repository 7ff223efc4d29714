"""How the composition root applies plugin answers: scheduler options, the observing run lifecycle, and the
metrics mirror. ``runtime.py`` calls these so its own change stays a few lines.

Invariants
- Explicit arguments always win over plugin answers, which win over the built-in defaults.
- Observers hear about a plan pass only after the run driver settled (or released) the run: a report they see
  is durable. An observer can never turn a pass into a failure (see :func:`._calls.notify`).
- A host a provider selected belongs to the runtime that asked (it closes it); an explicit host belongs to the
  caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._metrics import MetricsPort
from ..plan import ABSENT, Concurrency, Plan
from ..scheduler.host import Host
from ..scheduler.model import Report
from ..scheduler.reconcile import Reconciler
from ..scheduler.scheduler import RunLifecycle
from ..settings import Settings
from .manager import Plugins
from .specs import HostRequest

__all__ = [
    "SchedulerOptions",
    "scheduler_options",
    "ObservedLifecycle",
    "ObservedMetrics",
    "observed_metrics",
]


@dataclass(frozen=True)
class SchedulerOptions:
    """Resolved options for one scheduler. ``host_owned`` is true when a provider made the host (the runtime
    must close it); ``host_provider`` names that provider."""

    host: Host | None
    host_owned: bool
    host_provider: str | None
    reconciler: Reconciler
    environment: Any
    concurrency: Concurrency | Mapping[str, Any] | None
    lifecycle: RunLifecycle


def scheduler_options(
    plugins: Plugins,
    settings: Settings,
    run_id: str,
    *,
    host: Host | None,
    reconciler: Reconciler | None,
    environment: Any,
    concurrency: Concurrency | Mapping[str, Any] | None,
    lifecycle: RunLifecycle,
) -> SchedulerOptions:
    """Fill what the caller left open from the plugins (see the module invariants)."""
    provider: str | None = None
    owned = False
    if host is None:
        chosen = plugins.select_host(HostRequest(run_id, settings.workspace, settings))
        if chosen is not None:
            provider, host = chosen
            owned = True
    defaults = plugins.runtime_defaults(settings)
    if environment is ABSENT and "environment" in defaults:
        environment = defaults["environment"]
    if concurrency is None and "concurrency" in defaults:
        concurrency = defaults["concurrency"]
    if concurrency is None and owned:
        # A provider's host may say how much it can take at once (the Prefect host: the local pool's size).
        concurrency = getattr(host, "default_concurrency", None)
    observed: RunLifecycle = lifecycle
    if plugins.has_observers("smthrs_node_settled") or plugins.has_observers("smthrs_run_settled"):
        observed = ObservedLifecycle(lifecycle, plugins)
    return SchedulerOptions(
        host=host,
        host_owned=owned,
        host_provider=provider,
        reconciler=reconciler if reconciler is not None else plugins.reconciler(settings),
        environment=environment,
        concurrency=concurrency,
        lifecycle=observed,
    )


class ObservedLifecycle:
    """Wraps a run driver: after it settled the pass, tell the observers (each settlement, then the report)."""

    def __init__(self, inner: RunLifecycle, plugins: Plugins) -> None:
        self.inner = inner
        self.plugins = plugins

    def enter(self, run_id: str, plan: Plan) -> None:
        self.inner.enter(run_id, plan)

    def exit(self, run_id: str, report: Report | None, error: BaseException | None) -> None:
        self.inner.exit(run_id, report, error)
        if report is None:
            return
        for s in report.settlements:
            self.plugins.notify_node_settled(run_id, report.plan_id, s)
        self.plugins.notify_run_settled(run_id, report)


class ObservedMetrics:
    """A metrics port that also tells ``smthrs_cache_decision`` observers; everything else is delegated."""

    def __init__(self, inner: MetricsPort, plugins: Plugins) -> None:
        self._inner = inner
        self._plugins = plugins

    def cache_decision(self, tag: Any) -> None:
        self._inner.cache_decision(tag)
        self._plugins.notify_cache_decision(str(tag))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def observed_metrics(metrics: MetricsPort, plugins: Plugins) -> MetricsPort:
    """``metrics`` itself when no plugin observes cache decisions (the hot path stays untouched)."""
    if not plugins.has_observers("smthrs_cache_decision"):
        return metrics
    return ObservedMetrics(metrics, plugins)  # type: ignore[return-value]
