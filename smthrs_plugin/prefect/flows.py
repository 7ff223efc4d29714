"""Durable Prefect flows: a Prefect ``@flow`` as the code a run driver drives, and :func:`durable_run`.

A Prefect flow that waits (``sp.sleep``, ``sp.wait_for``, ``sp.require_approval``) beyond the in-process budget
parks its smthrs run and ends *Paused* (``_flowrun.py``). What brings it back is a run driver that can call the flow
again: :func:`flow_fn` makes a Prefect flow registrable with :class:`~smthrs_plugin.engine.drive.driver.RunDriver`
under :func:`flow_name` (``prefect/<flow name>``), which is also the flow of every run a direct call created — so
``smthrs worker --flow MODULE:FLOW`` resumes both. A flow run of a Prefect DEPLOYMENT (``flow_run.deployment_id``
set: ``flow.serve()``, a work-pool worker) needs no driver: Prefect itself executes it again (``_deployment.py``);
a driver can still take such a run over — the deployment's parked flow run is then shown ``Resumed``.

Invariants
- A drive calls the flow ONCE with the run's recorded parameters (the first flow run's, ``_flowrun.py``), as a new
  Prefect flow run bound to the driven run: steps that settled before replay ``clean`` from the cache, finished
  waits return at once (clocks keep their stored deadlines, completed deferreds and approvals are read back).
- What the drive stores is the same as a direct call's: ``{"flow_run_id", "state"}``, never the flow's return
  value (a Prefect flow may return anything; the run is a journal, not a result store). A failed flow run fails
  the run with the flow's exception.
- :func:`durable_run` (and ``smthrs worker --run``) refuse before writing anything: a run of another flow under
  that id, parameters other than the ones the run was started with (``WaitError(parameters_mismatch)``: an id
  names ONE computation), parameters that are not plain JSON or do not fit the flow's signature.

Prior art: Temporal's workflow id (re-submitting an id continues or answers for that one execution).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Mapping
from typing import Any

from ..canonical import canonical_bytes
from ..engine.context import RunContext
from ..engine.drive.active_run import DriveNotClaimed, DriveOutcome, FlowCompleted
from ..engine.drive.driver import FlowFn
from ..engine.ownership.arbiter import Terminal
from ..errors import CanonicalError, WaitError
from ..records.journal import Journal
from ..records.runs import RunStore
from ._flowrun import agree_with_prefect, bind_flow_run, driving, flow_name, recorded_parameters
from .environment import translated_startup_timeout
from .steprun import current_spec, step_settings

__all__ = ["durable_run", "flow_fn", "flow_name", "is_prefect_flow", "resolve_parameters"]


def is_prefect_flow(obj: object) -> bool:
    """True for a Prefect ``Flow`` object (checked without importing Prefect when the caller has not)."""
    prefect = sys.modules.get("prefect")
    return prefect is not None and isinstance(obj, prefect.Flow)


def flow_fn(flow: Any, parameters: Mapping[str, Any] | None = None) -> FlowFn:
    """Driver code for the Prefect ``flow``: register it as ``driver.register(flow_name(flow), flow_fn(flow))``.
    ``parameters`` are used for a run with none recorded yet (a run started by a driver). The flow's steps use the
    workspace and artifact store of ``sp.step_settings``/``SMTHRS_*`` at this call, and the driven run's
    database."""
    if not is_prefect_flow(flow):
        raise WaitError("invalid_wait", f"flow_fn takes a Prefect @flow, not {flow!r}")
    fallback = dict(parameters or {})
    # Bound as the flow run starts, not at its first smthrs call: a drive records its flow run and parameters even
    # when the body never calls a step or a wait (a later drive must call it with the same parameters).
    bound_flow = flow.with_options(on_running=[*flow.on_running_hooks, _bind_on_running])
    # Drives run on the driver's threads, where the registering thread's step_settings are not visible: the steps
    # use the workspace and artifacts of the registration and, always, the database of the run being driven.
    spec = current_spec()

    def drive(ctx: RunContext) -> FlowCompleted:
        recorded = recorded_parameters(ctx.waits.journal, ctx.run_id)
        params = fallback if recorded is None else recorded
        with (
            step_settings(
                workspace=spec.workspace,
                db=ctx.waits.db.url,
                artifacts=spec.artifacts_url or None,
                artifacts_options=spec.artifacts_options,
                host_id=spec.host_id,
                artifacts_block=spec.artifacts_block,
            ),
            driving(ctx),
            translated_startup_timeout(),  # Prefect's server not starting in time: a typed, actionable error
        ):
            state = bound_flow(**params, return_state=True)
            if inspect.isawaitable(state):  # an async flow: the driver's thread has no event loop of its own
                state = asyncio.run(_awaited(state))
        if not state.is_completed():
            state.result()  # raises the flow's own exception: the run fails with it
            raise RuntimeError(f"flow run ended {state.name!r} without an exception")  # pragma: no cover
        return FlowCompleted({"flow_run_id": str(state.state_details.flow_run_id), "state": str(state.name)})

    drive.prefect_flow = flow  # type: ignore[attr-defined]  # lets a CLI worker re-register it with parameters
    return drive


async def _awaited(pending: Any) -> Any:
    return await pending


def _bind_on_running(flow: Any, flow_run: Any, state: Any) -> None:
    bind_flow_run(flow, flow_run)


def resolve_parameters(
    flow: Any, run_id: str, parameters: Mapping[str, Any] | None, *, runs: RunStore, journal: Journal
) -> dict[str, Any]:
    """The parameters a drive of ``run_id`` calls ``flow`` with — the recorded ones for a run that has them, else
    ``parameters`` — after every check, before anything is written: the run belongs to this flow
    (``invalid_wait``), ``parameters`` agree with the recorded ones (``parameters_mismatch``), are plain JSON
    (``unresumable_flow``) and bind to the flow's signature (``invalid_wait``)."""
    name = flow_name(flow)
    existing = runs.get(run_id)
    recorded: dict[str, Any] | None = None
    if existing is not None:
        if existing.flow != name:
            raise WaitError(
                "invalid_wait",
                f"run {run_id!r} is a run of {existing.flow!r}, not of {name!r}; choose another run id",
                run_id=run_id,
            )
        recorded = recorded_parameters(journal, run_id)
    if recorded is not None:
        if parameters is not None and _canon(parameters) != _canon(recorded):
            raise WaitError(
                "parameters_mismatch",
                f"run {run_id!r} was started with parameters {recorded!r}, not {dict(parameters)!r}; resume it "
                "without parameters, or choose another run id for another computation",
                run_id=run_id,
            )
        params = recorded
    else:
        params = dict(parameters or {})
        _canon(params)  # a run a driver could never call again is refused before it exists
    try:
        inspect.signature(flow.fn).bind(**params)
    except TypeError as exc:
        raise WaitError(
            "invalid_wait",
            f"flow {flow.name!r} cannot be called with parameters {sorted(params)}: {exc}; pass them with "
            f"sp.durable_run(flow, {run_id!r}, {{...}}) or smthrs worker --run {run_id} --param NAME=VALUE",
            run_id=run_id,
        ) from exc
    return params


def durable_run(
    flow: Any,
    run_id: str,
    parameters: Mapping[str, Any] | None = None,
    *,
    budget_s: float | None = None,
) -> DriveOutcome:
    """Drive the Prefect ``flow`` as the durable run ``run_id`` in this process, once, and return how the drive
    ended: ``DriveSettled`` (completed, failed or cancelled), ``DriveParked`` (waiting on a timer, an event or an
    approval — the process may exit; calling again continues it), ``DriveReleased``, or ``DriveNotClaimed`` (a
    live process is driving it). The first call creates the run; later calls with the same id resume it with the
    parameters it started with (see :func:`resolve_parameters` for what is refused, before anything is written).
    Uses the runtime of ``sp.step_settings`` / ``SMTHRS_*``; ``budget_s`` overrides ``SMTHRS_WAIT_BUDGET_S``. A call
    for a settled run also sets the Prefect flow run recorded last for it to the matching final state when Prefect
    still shows it unfinished (the process died between the two settlements)."""
    if not is_prefect_flow(flow):
        raise WaitError("invalid_wait", f"durable_run takes a Prefect @flow, not {flow!r}")
    rt = current_spec().open()
    params = resolve_parameters(flow, run_id, parameters, runs=rt.runs, journal=rt.journal)
    name = flow_name(flow)
    # A driver of its own (wired by the runtime): the flow registered on it carries THIS run's parameters, which a
    # concurrent durable_run of the same flow in this process must not replace before the drive.
    driver = rt.run_driver(wait_budget_s=budget_s)
    driver.register(name, flow_fn(flow, params))
    if rt.runs.get(run_id) is None:
        driver.submit(run_id, name)
    outcome = driver.drive(run_id)
    if isinstance(outcome, DriveNotClaimed) and isinstance(outcome.decision, Terminal):
        # A retry of a settled run: its flow run may still show Running (the process died after the smthrs
        # settlement, before Prefect's) — show the settled status there, so both sides agree.
        agree_with_prefect(rt.journal, run_id, outcome.decision.status)
    return outcome


def _canon(parameters: Mapping[str, Any]) -> bytes:
    try:
        return canonical_bytes(dict(parameters))
    except CanonicalError as exc:
        raise WaitError(
            "unresumable_flow",
            f"durable flow parameters must be plain JSON: {exc.message}",
            cause=exc,
        ) from exc
