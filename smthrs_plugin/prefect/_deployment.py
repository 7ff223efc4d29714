"""Deployed durable flows: a flow run of a Prefect deployment waits in Prefect's own states, so the deployment's
runner (``flow.serve()``) or work-pool worker continues it — no ``smthrs worker`` is needed.

- A deployment flow run is one whose ``flow_run.deployment_id`` is set (:func:`deployment_of`); a direct call of the
  flow has none, parks *Paused* and ``smthrs worker --flow MODULE:FLOW`` continues it (``_flowrun.py``).
- Durable first: the smthrs run is parked (fenced) before Prefect hears anything; Prefect's state only decides WHEN
  the flow run executes again, never what it finds there.
- A timer → ``Scheduled`` at the stored deadline plus :data:`EARLY_START_MARGIN_MS`; an approval or an event →
  ``Paused`` with ``pause_reschedule``, turned ``Scheduled`` by :func:`resume_parked` (a flow run no longer paused
  answers :class:`HostNotParked`). State name ``Parked``.
- No lost wake-up: once Prefect shows Paused, the park checks its wait again and resumes the flow run itself when it
  was answered meanwhile.
- :func:`claim_run`: every execution binds ``prefect-<flow run id>`` (after one settled ``failed``: ``-2``, ``-3``,
  ...); one settled ``completed``/``cancelled`` ends the flow run in the matching state without running the body;
  one held by a live owner is ``FenceLost``.
- Prefect is reached with THIS process's Prefect settings; without an API URL nothing is attempted and the waker
  answers :class:`HostWakeFailed`.
- A parked flow run has no process: cancelled in Prefect (the UI moves *Paused*/*Scheduled* straight to
  *Cancelled*), nothing tells smthrs. The next touch does: :func:`cancelled_in_prefect` before a decision, and
  :func:`resume_parked` (``on_cancelled``) after one; the plugin then settles the run ``cancelled``
  (``plugin.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..engine.context import RunParked
from ..engine.lease import Refused, RunLease, acquire, chain_on_failure
from ..engine.ownership.arbiter import Terminal
from ..engine.waits.flow_waits import HostNotParked, HostWake, HostWakeFailed, HostWoken
from ..errors import FenceLost
from ..runtime import Runtime

__all__ = [
    "HOST",
    "PARKED_STATE",
    "EARLY_START_MARGIN_MS",
    "Settled",
    "deployment_of",
    "claim_run",
    "parked_state",
    "resume_parked",
    "cancelled_in_prefect",
    "settled_signal",
]

#: The host name a wake outcome carries (``HostWoken.host``...), the Prefect plugin's name.
HOST = "prefect"
#: The name of every Prefect state that shows a parked smthrs run (Paused, or Scheduled for a deployment's timer).
PARKED_STATE = "Parked"
#: Added to a timer's deadline in Prefect's ``scheduled_time`` (see the module invariants).
EARLY_START_MARGIN_MS = 1000
#: How many successors of a failed run one flow run may start (a bound, not a policy: each is a Prefect retry).
_MAX_ATTEMPT_RUNS = 1000


def deployment_of(flow_run: Any) -> str | None:
    """The deployment id of a Prefect flow run (``flow_run.deployment_id``), or ``None`` for a direct call."""
    deployment = getattr(flow_run, "deployment_id", None)
    return None if deployment is None else str(deployment)


@dataclass(frozen=True)
class Settled:
    """The flow run's smthrs run already settled ``status`` (completed or cancelled): nothing left to execute."""

    run_id: str
    status: str


def claim_run(rt: Runtime, flow_run_id: str, flow: str, deployment_id: str) -> RunLease | Settled:
    """Claim the smthrs run of an execution of the deployment flow run ``flow_run_id`` (see the module invariants):
    the parked (or pending, or first) run of the ``prefect-<id>`` chain, activated; ``Settled`` when it completed
    or was cancelled; ``FenceLost`` when a live owner holds it."""
    base = f"prefect-{flow_run_id}"
    lease = acquire(
        base,
        flow,
        chain_on_failure(_MAX_ATTEMPT_RUNS),
        ownership=rt.ownership,
        runs=rt.runs,
        waits=rt.waits,
    )
    if not isinstance(lease, Refused):
        return lease
    if lease.exhausted:
        raise FenceLost(
            "fence_lost",
            f"flow run {flow_run_id} (deployment {deployment_id}) already failed {_MAX_ATTEMPT_RUNS} smthrs runs; "
            "start a new flow run of the deployment",
            run_id=base,
        )
    run_id, decision = lease.run_id, lease.decision
    if isinstance(decision, Terminal):  # completed or cancelled: a failed one moved the chain on
        return Settled(run_id, decision.status)
    raise FenceLost(
        "fence_lost",
        f"smthrs run {run_id!r} of flow run {flow_run_id} (deployment {deployment_id}) is held by another live "
        f"owner ({type(decision).__name__}): Prefect started this flow run while another process still runs "
        f"it, and this execution stops. If that process died, retry the flow run once its lease lapses "
        f"({rt.settings.stale_after_s:g} s)",
        run_id=run_id,
    )


def parked_state(signal: RunParked, message: str) -> Any:
    """The Prefect state a deployment flow run parked on ``signal`` is set to (see the module invariants)."""
    from prefect.states import Paused, Scheduled

    if signal.kind == "timer" and signal.due_at_ms is not None:
        when = datetime.fromtimestamp((signal.due_at_ms + EARLY_START_MARGIN_MS) / 1000, tz=timezone.utc)
        return Scheduled(scheduled_time=when, name=PARKED_STATE, message=message)
    return Paused(reschedule=True, name=PARKED_STATE, message=message)


def resume_parked(
    run_id: str,
    flow_run_id: str,
    deployment_id: str,
    *,
    on_cancelled: Callable[[str], HostWake] | None = None,
) -> HostWake:
    """Resume the parked deployment flow run ``flow_run_id`` of smthrs run ``run_id`` through the Prefect API:
    ``HostWoken`` (Prefect made it Scheduled now), ``HostNotParked`` (it is not Paused — running again, scheduled
    at its timer, finished), or ``HostWakeFailed`` with the cause (no API URL, the server unreachable). A flow run
    Prefect shows *Cancelled* answers ``on_cancelled(why)`` when given (it will never execute again)."""
    where = _where(flow_run_id, deployment_id)
    try:
        from prefect.settings import get_current_settings

        if not get_current_settings().api.url:
            return HostWakeFailed(
                run_id,
                HOST,
                f"{where} waits in Prefect, but this process has no Prefect API to resume it through "
                "(PREFECT_API_URL is unset): set PREFECT_API_URL, or a Prefect profile, to the server that runs the "
                "deployment — or resume it from the Prefect UI",
            )
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.responses import SetStateStatus

        with get_client(sync_client=True) as client:
            result = client.resume_flow_run(uuid.UUID(flow_run_id))
            if result.status == SetStateStatus.ACCEPT:
                return HostWoken(run_id, HOST, f"{where} resumed: Prefect runs it again now")
            state: Any = client.read_flow_run(uuid.UUID(flow_run_id)).state
    except Exception as exc:  # answered with its cause: the caller's decision is committed already
        return HostWakeFailed(
            run_id,
            HOST,
            f"could not resume {where} through the Prefect API ({type(exc).__name__}: {exc}); resume it from the "
            "Prefect UI once the server is reachable",
            exc,
        )
    if on_cancelled is not None and state is not None and state.is_cancelled():
        return on_cancelled(_cancelled_why(where, state))
    shown = "without a state" if state is None else f"{state.type.value} ({state.name!r})"
    return HostNotParked(run_id, HOST, f"{where} is {shown}, not paused: Prefect runs it without being asked")


def cancelled_in_prefect(flow_run_id: str, deployment_id: str) -> str | None:
    """Why the deployment flow run ``flow_run_id`` will never execute again — Prefect shows it *Cancelled* — or
    ``None`` (any other state, or no Prefect API configured here: the caller's wake reports that). A Prefect API
    that fails raises (the caller reports it)."""
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        return None
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state: Any = client.read_flow_run(uuid.UUID(flow_run_id)).state
    if state is None or not state.is_cancelled():
        return None
    return _cancelled_why(_where(flow_run_id, deployment_id), state)


def _where(flow_run_id: str, deployment_id: str) -> str:
    return f"flow run {flow_run_id} of deployment {deployment_id}"


def _cancelled_why(where: str, state: Any) -> str:
    said = f": {state.message}" if state.message else ""
    return f"{where} was cancelled in Prefect ({state.type.value} {state.name!r}{said})"


def settled_signal(flow_run_id: str, settled: Settled) -> BaseException:
    """What an execution of a deployment flow run raises when its smthrs run already settled: Prefect's ``Abort``
    carrying the matching final state (set first, so the runner sees the flow run end ``Completed``/``Cancelled``
    without running the body again), or ``FenceLost`` naming the cause when Prefect cannot be told."""
    message = (
        f"smthrs run {settled.run_id} already settled {settled.status}: this flow run has nothing left to do "
        "(start a new flow run of the deployment to run the flow again)"
    )
    try:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import Abort
        from prefect.states import Cancelled, Completed

        state: Any = (
            Completed(name="Settled", message=message)
            if settled.status == "completed"
            else Cancelled(message=message)
        )
        with get_client(sync_client=True) as client:
            result = client.set_flow_run_state(uuid.UUID(flow_run_id), state, force=True)
    except Exception as exc:  # raised below as the flow run's failure, with its cause
        return FenceLost(
            "fence_lost", f"{message}; Prefect could not be told ({exc!r})", run_id=settled.run_id, cause=exc
        )
    signal = Abort(message)
    signal.state = result.state if result.state is not None else state  # type: ignore[attr-defined]  # read by Prefect's engine
    return signal
