"""The Prefect host as a plugin: announced by this distribution's own ``smthrs`` entry point (``prefect``), so the
composition root discovers it like any third-party plugin and never imports ``hosts`` (DESIGN.md §2 layering).

- ``smthrs_hosts``: a provider that selects a :class:`~.prefect.PrefectHost` whenever a Prefect flow run is active
  on the thread asking (``rt.scheduler(...).run(plan)`` inside a ``@flow``). Outside a flow run it answers None
  and the scheduler keeps its local thread pool.
- ``smthrs_run_settled``: inside a flow run, attach the Report to it as a markdown artifact (key
  :func:`~.prefect.artifact_key`).

Loading this module costs nothing: Prefect is imported only once a flow run is known to be active (if Prefect
was never imported, no flow run can be).
"""

from __future__ import annotations

from typing import Any

from ..hooks.specs import HostRequest, hookimpl
from ..scheduler.model import Report
from ..settings import Settings

__all__ = ["PrefectHostProvider", "smthrs_hosts", "smthrs_run_settled"]


class PrefectHostProvider:
    """Selects a Prefect host inside an active flow run."""

    name = "prefect"

    def select(self, request: HostRequest) -> Any:
        from .prefect import PrefectHost, flow_run_active

        if not flow_run_active():
            return None
        return PrefectHost(request.run_id)

    def __repr__(self) -> str:
        return "PrefectHostProvider()"


@hookimpl
def smthrs_hosts(settings: Settings) -> PrefectHostProvider:
    return PrefectHostProvider()


@hookimpl
def smthrs_run_settled(run_id: str, report: Report) -> None:
    from .prefect import artifact_key, flow_run_active, host_for_run, report_markdown

    if not flow_run_active():
        return
    from prefect.artifacts import create_markdown_artifact

    host = host_for_run(run_id)
    create_markdown_artifact(
        report_markdown(run_id, report, host.durations_ms if host is not None else None),
        key=artifact_key(run_id),
        description=f"smthrs report of run {run_id} (plan {report.plan_id})",
    )
