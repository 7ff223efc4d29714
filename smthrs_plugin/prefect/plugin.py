"""The Prefect host as a plugin: announced by this distribution's own ``smthrs`` entry point (``prefect``), so the
composition root discovers it like any third-party plugin and never imports this package's other modules.

- ``smthrs_hosts``: a provider that selects a :class:`~.prefect.PrefectHost` whenever a Prefect flow run is active
  on the thread asking (``rt.scheduler(...).run(plan)`` inside a ``@flow``). Outside a flow run it answers None
  and the scheduler keeps its local thread pool.
- ``smthrs_run_settled``: inside a flow run, attach the Report to it as a markdown artifact (key
  :func:`~.prefect.artifact_key`).
- ``smthrs_approval_decided``: emit ``smthrs.approval.approved|denied`` (``_events.py``) from the deciding process —
  only where Prefect is in use (a flow run, or ``PREFECT_API_URL`` configured); a CLI without it imports nothing.
- ``smthrs_run_waker``: :func:`wake_deployment_flow_run` — after an approval, a denial, ``sp.complete``, a signal or
  a cancellation is committed, resume the run's parked flow run of a Prefect DEPLOYMENT through the Prefect API
  (``_deployment.py``), so the deployment's runner or worker executes it again. A run whose latest flow run is not
  a deployment's answers ``HostNotParked`` without importing Prefect (a ``smthrs worker`` continues it).
- A parked deployment flow run cancelled in Prefect (no process runs it, so nothing else tells smthrs) settles its
  run ``cancelled`` at the next touch, through ``Control.cancel`` as ``prefect/flow-run``: BEFORE an approval,
  denial, resume, signal or cancellation decides anything (the waker's ``ended``, asked by the control plane: the
  caller is answered ``Terminal``), and when a wake finds the flow run *Cancelled* (``sp.complete``).

Loading this module costs nothing: Prefect is imported only once a flow run is known to be active (if Prefect
was never imported, no flow run can be).
"""

from __future__ import annotations

import logging
from typing import Any

from ..engine.waits.flow_waits import HostNotParked, HostWake, HostWaker
from ..hooks.specs import HostRequest, hookimpl
from ..records.journal import Journal
from ..scheduler.model import Report
from ..settings import Settings

__all__ = [
    "PrefectHostProvider",
    "smthrs_hosts",
    "smthrs_run_settled",
    "smthrs_approval_decided",
    "smthrs_run_waker",
    "wake_deployment_flow_run",
    "deployment_flow_run_ended",
]

log = logging.getLogger(__name__)


class PrefectHostProvider:
    """Selects a Prefect host inside an active flow run."""

    name = "prefect"

    def __init__(self, execution: str = "auto") -> None:
        self.execution = execution

    def select(self, request: HostRequest) -> Any:
        from .host import PrefectHost, flow_run_active

        if not flow_run_active():
            return None
        return PrefectHost(request.run_id, execution=self.execution)

    def __repr__(self) -> str:
        return f"PrefectHostProvider(execution={self.execution!r})"


@hookimpl
def smthrs_hosts(settings: Settings) -> PrefectHostProvider:
    return PrefectHostProvider(settings.execution)


@hookimpl
def smthrs_run_settled(run_id: str, report: Report) -> None:
    from .host import artifact_key, flow_run_active, host_for_run, report_markdown

    if not flow_run_active():
        return
    from prefect.artifacts import create_markdown_artifact

    host = host_for_run(run_id)
    create_markdown_artifact(
        report_markdown(run_id, report, host.durations_ms if host is not None else None),
        key=artifact_key(run_id),
        description=f"smthrs report of run {run_id} (plan {report.plan_id})",
    )


@hookimpl
def smthrs_approval_decided(
    run_id: str | None,
    plan_id: str | None,
    flow: str | None,
    request_id: str | None,
    token_id: str,
    digest: str,
    envelope: Any,
    decision: str,
    principal: str,
    scope: str | None,
) -> None:
    from . import _events

    _events.emit(
        _events.approval_decided(
            run_id=run_id, plan_id=plan_id, flow=flow, request=request_id, token_id=token_id, digest=digest,
            envelope=envelope, decision=decision, principal=principal, scope=scope, flow_run_id=None,
        )
    )  # fmt: skip


def wake_deployment_flow_run(run_id: str, journal: Journal) -> HostWake:
    """The Prefect host's run waker: resume ``run_id``'s parked flow run when its latest recorded flow run belongs
    to a deployment (``_flowrun.deployment_flow_run_of``); ``HostNotParked`` otherwise. A flow run Prefect shows
    *Cancelled* settles the run ``cancelled`` (module docstring)."""
    from ._flowrun import deployment_flow_run_of

    found = deployment_flow_run_of(journal, run_id)
    if found is None:
        return HostNotParked(
            run_id,
            None,
            "no flow run of a Prefect deployment runs it: a `smthrs worker` or a resume continues it",
        )
    from ._deployment import resume_parked

    return resume_parked(run_id, *found, on_cancelled=lambda why: _settle_cancelled(run_id, journal, why))


def deployment_flow_run_ended(run_id: str, journal: Journal) -> HostWake | None:
    """Asked by the control plane before it decides anything about the parked run ``run_id`` (the waker's
    ``ended``): when its latest flow run belongs to a deployment and Prefect shows it *Cancelled*, settle the run
    ``cancelled`` and answer why (``HostNotParked``); else ``None``. Prefect failing to answer is logged and
    answers ``None``: the decision goes on, and its wake reports the failure."""
    from ._flowrun import deployment_flow_run_of

    found = deployment_flow_run_of(journal, run_id)
    if found is None:
        return None
    from ._deployment import cancelled_in_prefect

    try:
        why = cancelled_in_prefect(*found)
    except Exception as exc:  # logged; the decision's own wake then answers HostWakeFailed with the cause
        log.warning(
            "could not read the Prefect state of flow run %s of smthrs run %s before deciding: %r",
            found[0], run_id, exc, exc_info=exc,
        )  # fmt: skip
        return None
    return None if why is None else _settle_cancelled(run_id, journal, why)


def _settle_cancelled(run_id: str, journal: Journal, why: str) -> HostWake:
    """Settle ``run_id`` ``cancelled`` because Prefect cancelled its flow run: ``Control.cancel`` as
    ``prefect/flow-run`` (recorded once: a second call finds the run settled)."""
    from ..control.facade import Control
    from ._deployment import HOST
    from ._flowrun import PREFECT_PRINCIPAL

    # A plane without a waker: Prefect already shows the flow run final, there is nothing to resume.
    receipt = Control(journal.db, journal=journal).cancel(run_id, principal=PREFECT_PRINCIPAL, reason=why)
    log.info("smthrs run %s: %s: %s", run_id, why, type(receipt).__name__)
    return HostNotParked(
        run_id,
        HOST,
        f"{why}; smthrs run {run_id} is settled cancelled and nothing of it runs again (start a new flow run of "
        "the deployment to run the flow again)",
    )


wake_deployment_flow_run.host = "prefect"  # type: ignore[attr-defined]  # named in a failure it raises
wake_deployment_flow_run.ended = deployment_flow_run_ended  # type: ignore[attr-defined]  # see the docstring


@hookimpl
def smthrs_run_waker(settings: Settings) -> HostWaker:
    return wake_deployment_flow_run
