"""The smthrs run of a Prefect flow run: which run a ``@flow`` body's steps and durable waits belong to, who owns
it, and what happens to both sides when it parks.

- One smthrs run per Prefect flow run, bound on its first smthrs call (a step, a wait): *direct* (a script or a
  test calls the flow) → ``prefect-<flow run id>`` of flow ``prefect/<flow name>``, held by an
  :class:`~smthrs_plugin.engine.lease.RunLease` (a fresh suffix if that id is settled or held; released at exit);
  *deployment* → the same id claimed back on every execution (``_deployment.py``); *driven* (a
  :class:`~smthrs_plugin.engine.drive.driver.RunDriver`: ``smthrs worker``,
  :func:`~smthrs_plugin.prefect.flows.durable_run`) → the driver's run, which the driver concludes.
- Completed in smthrs before Completed in Prefect: the run is concluded ``completed`` when the flow run engine
  proposes ``Completed``, before the proposal is sent (:func:`_conclude_before_prefect`).
- Failed and cancelled endings are concluded by a state hook after Prefect set them (a crash by interruption
  releases the run; ``AwaitingRetry`` keeps it).
- Cancelled from either side, ending ``cancelled`` on both: Prefect's ``Cancelling``/``Cancelled`` of a bound flow
  run (read once per ``SMTHRS_HEARTBEAT_INTERVAL_S`` by one watcher thread per process, or the runner's cancel
  intent at exit) is ``Control.cancel`` of its smthrs run, journaled once; a run cancelled in smthrs stops at the
  body's next wait or step call, settles ``cancelled`` and its flow run is set ``Cancelled`` (never ``Crashed``).
- A driver taking a run over shows the earlier flow run whose process died ``Crashed``; ``durable_run`` of a settled
  run sets its last flow run's Prefect state to match (:func:`agree_with_prefect`).
- Every flow run journals ``prefect-flow-run`` (id, flow, parameters, ``deployment_id``) once, when it binds.
- Parking: the smthrs run is parked durably FIRST, then the flow run is set *Paused* (``Parked``) and the wait raises
  :class:`ParkedFlowRun` (both ``RunParked`` and Prefect's ``Pause``). A direct flow run whose parameters are not
  plain JSON refuses to park (``WaitError(unresumable_flow)``).

Why and how, ending by ending: ARCHITECTURE.md ("prefect").
"""

from __future__ import annotations

import atexit
import inspect
import logging
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Any

from ..canonical import canonical_bytes
from ..control.identity import Principal
from ..engine.context import RunCancelled, RunContext, RunParked, RunReleased
from ..engine.lease import (
    RETRY_SUFFIX,
    DriveLost,
    DriveSettled,
    FlowCompleted,
    FlowFailed,
    Refused,
    RunLease,
    acquire,
)
from ..engine.waits.flow_waits import HostWakeFailed
from ..errors import CanonicalError, FenceLost, WaitError
from ..records.journal import Journal
from ..runtime import Runtime
from ..stores.database import Database
from . import _events, _resume_form
from ._deployment import (
    PARKED_STATE,
    Settled,
    claim_run,
    deployment_of,
    parked_state,
    resume_parked,
    settled_signal,
)
from ._stepjournal import flush_hits
from .steprun import StepContext, current_spec, finish_background_work

__all__ = [
    "FLOW_PREFIX",
    "RECORD_TYPE",
    "ParkedFlowRun",
    "flow_name",
    "context_for_call",
    "bind_flow_run",
    "run_context",
    "driving",
    "pause_flow_run",
    "recorded_parameters",
    "deployment_flow_run_of",
    "PREFECT_PRINCIPAL",
    "agree_with_prefect",
]

log = logging.getLogger(__name__)

FLOW_PREFIX = "prefect/"
RECORD_TYPE = "prefect-flow-run"
_PARKED_STATE = PARKED_STATE
#: How a parked Prefect flow's run comes back (a plan run says its own way: ``pause_flow_run(resume=...)``).
FLOW_RESUME = "a worker that registers this flow resumes it: smthrs worker --flow MODULE:FLOW"
#: How a parked flow run of a deployment comes back.
DEPLOYMENT_RESUME = "Prefect runs this flow run of its deployment again (no smthrs worker needed)"
#: The same, in a parked approval's (shorter) message.
_DEPLOYMENT_THEN = "Prefect runs this flow run again"
#: Who a cancellation made in Prefect (UI, API, a runner) is recorded as in the run's journal.
PREFECT_PRINCIPAL = Principal("prefect", "flow-run")


def flow_name(flow: Any) -> str:
    """The smthrs flow name of a Prefect flow: ``prefect/<flow name>`` (what a driver registers it under)."""
    return f"{FLOW_PREFIX}{getattr(flow, 'name', None) or 'flow'}"


class ParkedFlowRun(RunParked):
    """``RunParked`` raised inside a Prefect flow run; also Prefect's ``Pause`` signal (see :func:`_signal_class`)."""


_SIGNAL: type[ParkedFlowRun] | None = None


def _signal_class() -> type[ParkedFlowRun]:
    # Built on first use: deriving from prefect.exceptions.Pause at import time would import Prefect with
    # smthrs_plugin. Prefect's flow engine re-raises a Pause untouched and keeps the state it carries.
    global _SIGNAL
    if _SIGNAL is None:
        from prefect.exceptions import Pause

        _SIGNAL = type("ParkedFlowRun", (ParkedFlowRun, Pause), {"__module__": __name__})
    return _SIGNAL


@dataclass
class _FlowRun:
    ctx: StepContext
    runtime: Runtime
    run: RunContext
    active: RunLease | None  # None: a driver owns the run and concludes it
    parameters_error: str | None
    deployment_id: str | None = None  # set: Prefect continues a park of this flow run (``_deployment.py``)


_FLOW_RUNS: dict[str, _FlowRun] = {}
_FR_LOCK = threading.Lock()
_DRIVEN: ContextVar[RunContext | None] = ContextVar("smthrs_driven_flow", default=None)


@contextmanager
def driving(ctx: RunContext) -> Iterator[RunContext]:
    """Around a driver's call of a flow: flow runs started inside bind to ``ctx``'s run, and a wait that parks
    tells Prefect the flow run paused (the driver parks the run itself). On exit the flow runs bound to the run
    are forgotten and their buffered hit records written, before the driver concludes the run."""
    token = _DRIVEN.set(ctx)
    before = ctx.on_park
    ctx.on_park = partial(_pause_driven, ctx.waits.db)
    try:
        yield ctx
    finally:
        ctx.on_park = before
        _DRIVEN.reset(token)
        _unbind(ctx.run_id)


def _prefect_flow_run() -> Any:
    ctx_mod = sys.modules.get("prefect.context")
    if ctx_mod is None:
        return None
    frc = ctx_mod.FlowRunContext.get()
    if frc is None or frc.flow_run is None or getattr(frc, "detached", False):
        return None
    return frc


def _bound() -> _FlowRun | None:
    frc = _prefect_flow_run()
    if frc is None:
        return None
    return _bind_once(str(frc.flow_run.id), frc)


def bind_flow_run(flow: Any, flow_run: Any) -> None:
    """Bind a flow run from a Prefect state hook (which runs before the flow run's context is entered): a
    driver's flow run is recorded as it starts, whatever its body does."""
    _bind_once(str(flow_run.id), _Started(flow, dict(flow_run.parameters or {})))


def _bind_once(flow_run_id: str, frc: Any) -> _FlowRun:
    with _FR_LOCK:
        fr = _FLOW_RUNS.get(flow_run_id)
        if fr is not None:
            return fr
        bound = _bind(flow_run_id, frc)
        if not isinstance(bound, Settled):
            _FLOW_RUNS[flow_run_id] = bound[0]
    # Prefect API calls, outside the lock: other flow runs of this process keep binding meanwhile.
    if isinstance(bound, Settled):
        raise settled_signal(flow_run_id, bound)
    fr, earlier = bound
    if fr.active is not None:
        _watch_cancellations(fr.runtime.settings.heartbeat_interval_s)
    for previous in earlier:
        _mark_resumed(previous, flow_run_id)
    if fr.deployment_id is not None and fr.active is not None:
        # Before the body reaches its gate: what Prefect's Resume submitted on this flow run's last parked
        # approval is decided now (or said to decide nothing), so the gate reads the decision.
        _resume_form.decide_from_resume(fr.runtime, flow_run_id, fr.ctx.run_id, _PARKED_STATE, _run_logger())
    return fr


@dataclass(frozen=True)
class _Started:
    """What ``_bind`` reads of a flow run context, from a state hook's arguments."""

    flow: Any
    parameters: dict[str, Any]


def context_for_call() -> StepContext | None:
    """In a flow run's own process: that flow run's step context (its smthrs run is bound on first use). ``None``
    outside a flow run or in a detached (worker-side) context: the call runs standalone."""
    fr = _bound()
    if fr is None:
        return None
    if fr.run.interrupt_reason == "cancelled":
        # A step call is a cancellation point too: a flow cancelled between two waits stops at its next step
        # instead of running every remaining step first.
        fr.run.raise_if_interrupted()
    return fr.ctx


def run_context() -> RunContext | None:
    """The run context of the Prefect flow run this code runs in (the provider ``prefect/`` registers)."""
    fr = _bound()
    return None if fr is None else fr.run


def _plain_parameters(parameters: Any) -> tuple[dict[str, Any], str | None]:
    params = dict(parameters or {})
    try:
        canonical_bytes(params)
    except CanonicalError as exc:
        return {}, exc.message
    return params, None


def _bind(flow_run_id: str, frc: Any) -> tuple[_FlowRun, list[str]] | Settled:
    """The binding of a new flow run and the earlier incarnations of its run to show as resumed; ``Settled`` for
    an execution of a deployment flow run whose run already completed or was cancelled (nothing is bound)."""
    spec = current_spec()
    rt = spec.open()
    name = flow_name(frc.flow)
    params, params_error = _plain_parameters(frc.parameters)
    outer = _DRIVEN.get()
    active: RunLease | None = None
    # A driver's flow run is a direct call (no deployment); ``_Started`` (a state hook's view) has no flow run.
    deployment = None if outer is not None else deployment_of(getattr(frc, "flow_run", None))
    if outer is not None:
        run = outer
    else:
        if deployment is not None:
            claimed = claim_run(rt, flow_run_id, name, deployment)
            if isinstance(claimed, Settled):
                return claimed
            active = claimed
        else:
            active = _claim(rt, flow_run_id, name)
        run = active.context
        run.on_park = partial(_park_direct, flow_run_id)
        _conclude_before_prefect(getattr(frc, "client", None))
    _hook_flow(frc.flow)
    payload: dict[str, Any] = {"flow_run_id": flow_run_id, "flow": name, "parameters": params}
    if params_error is not None:
        payload = {**payload, "parameters": None, "parameters_error": params_error}
    if deployment is not None:
        payload["deployment_id"] = deployment
    earlier = _flow_runs_of(rt.journal, run.run_id) if outer is not None else []
    rt.journal.append(
        run.run_id, RECORD_TYPE, payload, source_id=f"prefect/flow-run/{flow_run_id}", source_seq=0
    )
    ctx = StepContext(run.run_id, run.owner, spec, flow_run_id)
    return _FlowRun(ctx, rt, run, active, params_error, deployment), [p for p in earlier if p != flow_run_id]


def _claim(rt: Runtime, flow_run_id: str, name: str) -> RunLease:
    """A direct flow run's run: ``prefect-<flow run id>``, or a fresh suffix when that one is settled or held (a
    direct flow run id is never executed twice by Prefect, so nothing needs to find the suffix again)."""
    lease = acquire(
        f"prefect-{flow_run_id}", name, RETRY_SUFFIX, ownership=rt.ownership, runs=rt.runs, waits=rt.waits
    )
    if isinstance(lease, Refused):  # pragma: no cover - a retry-suffix lease activates or raises
        raise RuntimeError(f"could not claim run {lease.run_id}: {lease.decision}")
    if lease.displaced is not None:
        log.warning(
            "smthrs run %s of flow run %s is %s; this flow run's steps journal into %s instead",
            lease.displaced.run_id,
            flow_run_id,
            type(lease.displaced.decision).__name__,
            lease.run_id,
        )
    return lease


def _unbind(run_id: str) -> None:
    with _FR_LOCK:
        for key in [k for k, fr in _FLOW_RUNS.items() if fr.run.run_id == run_id]:
            del _FLOW_RUNS[key]
    flush_hits(run_id)


# -- the end of a direct flow run ------------------------------------------------------------------------------
def _hook_flow(flow: Any) -> None:
    """Append the settle hook to each of the flow's ending hook lists unless it is there already (Prefect reads
    them when the final state is set, one list per state). Judged by the lists, not by a mark on the flow:
    ``flow.with_options`` (``flow_fn``, a deployment's runner) copies the lists, hook included, into a new flow
    without the mark, and a second append ran the hook twice per flow run."""
    if flow is None:
        return
    for attr in ("on_completion_hooks", "on_failure_hooks", "on_crashed_hooks", "on_cancellation_hooks"):
        hooks = getattr(flow, attr, None)
        if isinstance(hooks, list) and _settle_flow_run not in hooks:
            hooks.append(_settle_flow_run)


def _settle_flow_run(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect state hook: the flow run ended — conclude its smthrs run (a driven run is the driver's; a normal
    return was concluded before Prefect heard of it, :func:`_conclude_before_prefect`)."""
    with _FR_LOCK:
        fr = _FLOW_RUNS.pop(str(flow_run.id), None)
    if fr is None:
        return
    flush_hits(fr.ctx.run_id)  # buffered hit records land before the run is settled
    finish_background_work(fr.ctx)  # its entries are in the shared tier, its page names its run
    if fr.active is None:
        return
    instead = _conclude(fr, fr.active, state)
    if instead is not None:
        _show_state(str(fr.ctx.flow_run_id), instead)


def _conclude(fr: _FlowRun, active: RunLease, state: Any) -> Any:
    """Conclude ``fr``'s run from Prefect's ``state``; answers the state Prefect should show instead (``Cancelled``
    for a run that settled ``cancelled``), else ``None``."""
    summary = {"flow_run_id": fr.ctx.flow_run_id, "state": str(state.name)}
    data = getattr(state, "data", None)
    if state.is_completed():
        outcome = active.conclude(FlowCompleted(summary))
        if isinstance(outcome, DriveSettled) and outcome.status == "cancelled":
            # The cancellation won the race with the body's return (``RunStore.finish``): Prefect shows it too.
            return _cancelled_state(fr.ctx.run_id)
        if isinstance(outcome, DriveLost):
            # Another owner took the run while this process stalled past its lease: that owner continues it.
            log.warning(
                "flow run %s completed, but its smthrs run %s was taken over meanwhile (%s): the new owner "
                "settles it",
                fr.ctx.flow_run_id,
                fr.ctx.run_id,
                outcome.reason,
            )
    elif isinstance(data, RunParked) and data.run_id != fr.ctx.run_id:
        # Another run parked inside this flow run (a plan run's timer node): that run is parked and resumable on
        # its own; this flow run ended without finishing its body, and no driver would know to resume it.
        active.conclude(
            FlowFailed({**summary, "message": f"run {data.run_id!r} parked inside this flow run: {data}"})
        )
    elif state.is_crashed() and isinstance(data, BaseException) and not isinstance(data, Exception):
        # RunCancelled → cancelled; RunReleased, KeyboardInterrupt, SystemExit → released (never cancelled).
        outcome = active.conclude(error=data)
        if isinstance(outcome, DriveSettled) and outcome.status == "cancelled":
            # Prefect's engine calls any BaseException a crash; the run was cancelled, so the flow run is too.
            _show_state(str(fr.ctx.flow_run_id), _cancelled_state(fr.ctx.run_id))
    else:
        active.conclude(FlowFailed({**summary, "message": str(state.message or "")}))
    return None


def _cancelled_state(run_id: str) -> Any:
    from prefect.states import Cancelled

    return Cancelled(message=f"smthrs run {run_id} was cancelled")


def _show_state(flow_run_id: str, state: Any) -> None:
    """Force ``state`` on the flow run: display only, so a failure is logged (the smthrs run settled already)."""
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(uuid.UUID(flow_run_id), state, force=True)
    except Exception as exc:  # noqa: BLE001 - reported; the smthrs status is the durable truth
        log.warning("could not show flow run %s %s in Prefect: %r", flow_run_id, state.type.value, exc)


def _conclude_before_prefect(client: Any) -> None:
    """Make the flow run engine's ``client`` conclude a bound flow run's smthrs run ``completed`` right before it
    asks Prefect to set that flow run ``Completed`` (see the module invariants). Installed once per client (the
    engine's client may be shared by nested flow runs and later flow runs of a thread); every other call, state
    and flow run passes through untouched. Called under ``_FR_LOCK``."""
    if client is None or getattr(client, "_smthrs_concludes", False):
        return
    propose = client.set_flow_run_state
    wrapper: Any
    if inspect.iscoroutinefunction(propose):  # an async flow's engine holds the async client

        async def set_flow_run_state_async(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _instead(_conclude_completed(*_proposal(args, kwargs)), args, kwargs)
            return await propose(*args, **kwargs)

        wrapper = set_flow_run_state_async
    else:

        def set_flow_run_state(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _instead(_conclude_completed(*_proposal(args, kwargs)), args, kwargs)
            return propose(*args, **kwargs)

        wrapper = set_flow_run_state
    client.set_flow_run_state = wrapper
    client._smthrs_concludes = True


def _proposal(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``(flow_run_id, state)`` of a ``set_flow_run_state(flow_run_id, state, force=...)`` call."""
    flow_run_id = args[0] if args else kwargs.get("flow_run_id")
    state = args[1] if len(args) > 1 else kwargs.get("state")
    return flow_run_id, state


def _instead(
    state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The proposal's arguments with ``state`` in place of the proposed one (unchanged when ``state`` is None)."""
    if state is None:
        return args, kwargs
    if len(args) > 1:
        return (args[0], state, *args[2:]), kwargs
    return args, {**kwargs, "state": state}


def _conclude_completed(flow_run_id: Any, state: Any) -> Any:
    """A ``Completed`` proposal for a bound direct or deployment flow run: conclude its smthrs run first. Taken out
    of the bindings before concluding, so the completion hook (and a proposal Prefect repeats after a WAIT) finds
    nothing left to do; an error propagates (see the module invariants)."""
    is_completed = getattr(state, "is_completed", None)
    if flow_run_id is None or is_completed is None or not is_completed():
        return None
    with _FR_LOCK:
        fr = _FLOW_RUNS.get(str(flow_run_id))
        if fr is None or fr.active is None:  # not ours, parked already, or a driver's (the driver concludes)
            return None
        del _FLOW_RUNS[str(flow_run_id)]
    flush_hits(fr.ctx.run_id)  # buffered hit records land before the run is settled
    finish_background_work(fr.ctx)  # its entries are in the shared tier, its page names its run
    return _conclude(fr, fr.active, state)


@atexit.register
def _release_all() -> None:
    with _FR_LOCK:
        leftovers = list(_FLOW_RUNS.values())
        _FLOW_RUNS.clear()
    _stop_watching()
    flush_hits()
    cancelled_by_runner = _runner_cancel_intent()
    for fr in leftovers:
        if fr.active is None:
            continue
        try:
            if cancelled_by_runner:
                # The runner SIGTERMed this flow run because it was cancelled in Prefect: so is its run.
                _cancel_from_prefect(fr, "the runner's cancel intent")
                fr.active.conclude(error=RunCancelled(fr.ctx.run_id))
                continue
            # Released, never cancelled: claimable at once by any driver that registers the flow.
            fr.active.conclude(error=RunReleased(fr.ctx.run_id, "shutdown"))
        except Exception:  # the process is exiting: report, the lease lapses on its own
            log.exception("could not release smthrs run %s at exit", fr.ctx.run_id)


def _runner_cancel_intent() -> bool:
    """Did a Prefect runner deliver its ``cancel`` intent to this process (before the SIGTERM that ends it)? Read
    from Prefect's control listener only when Prefect's engine was loaded (no flow run, no intent)."""
    if "prefect.flow_engine" not in sys.modules:
        return False
    from prefect._internal.control_listener import get_intent

    return get_intent() == "cancel"


# -- cancellation from Prefect -------------------------------------------------------------------------------
_WATCH_LOCK = threading.Lock()
_WATCH_STOP = threading.Event()
_WATCH_WAKE = threading.Event()  # set by each binding: an idle watcher looks again
_WATCHER: threading.Thread | None = None
_CANCEL_SEEN: set[str] = set()  # flow run ids whose cancellation was recorded: journaled once


def _watch_cancellations(interval_s: float) -> None:
    """Make sure the process's one watcher thread runs: it reads the Prefect state of every bound flow run this
    process holds the run of, every ``interval_s``, and cancels the run of one shown Cancelling or Cancelled.
    With nothing bound it waits for the next binding, keeping its API client: building one costs ≈25 ms of CPU
    (an SSL context), which every flow run of a process paid when the thread ended between flow runs."""
    global _WATCHER
    with _WATCH_LOCK:
        _WATCH_WAKE.set()
        if _WATCHER is not None and _WATCHER.is_alive():
            return
        _WATCH_STOP.clear()
        _WATCHER = threading.Thread(
            target=_watch_loop, args=(interval_s,), name="smthrs-prefect-cancel-watch", daemon=True
        )
        _WATCHER.start()


def _stop_watching() -> None:
    _WATCH_STOP.set()
    _WATCH_WAKE.set()


def _watched() -> dict[str, _FlowRun]:
    with _FR_LOCK:
        return {k: fr for k, fr in _FLOW_RUNS.items() if fr.active is not None and k not in _CANCEL_SEEN}


def _api_url() -> str | None:
    """The Prefect API this thread's client would talk to (None: the process's ephemeral server)."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _watch_loop(interval_s: float) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    client: Any = None
    client_api: str | None = None
    try:
        while not _WATCH_STOP.is_set():
            watched = _watched()
            if not watched:
                _WATCH_WAKE.clear()
                if not _watched():  # a binding between the two reads set the event after it was cleared
                    _WATCH_WAKE.wait()
                continue
            try:
                api = _api_url()
                if client is None or api != client_api:
                    # A client talks to one API: the one configured when the binding woke us, not a stale one.
                    if client is not None:
                        client.__exit__(None, None, None)
                        client = None
                    client = get_client(sync_client=True).__enter__()
                    client_api = api
                flow_runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(k) for k in watched]))
                )
                for flow_run in flow_runs:
                    state = flow_run.state
                    fr = watched.get(str(flow_run.id))
                    if (
                        fr is not None
                        and state is not None
                        and (state.is_cancelling() or state.is_cancelled())
                    ):
                        _cancel_from_prefect(fr, f"Prefect shows it {state.type.value}")
            except Exception as exc:  # noqa: BLE001 - reported; read again at the next tick
                log.warning(
                    "could not read the Prefect state of this process's flow runs: %r", exc, exc_info=exc
                )
            _WATCH_STOP.wait(interval_s)
    finally:
        if client is not None:
            client.__exit__(None, None, None)


def _cancel_from_prefect(fr: _FlowRun, why: str) -> None:
    """Record the cancellation of ``fr``'s run that Prefect asked for (once per flow run): the lease interrupts the
    body now, and it stops at its next wait or step call."""
    flow_run_id = str(fr.ctx.flow_run_id)
    with _FR_LOCK:
        if flow_run_id in _CANCEL_SEEN:
            return
        _CANCEL_SEEN.add(flow_run_id)
    reason = f"flow run {flow_run_id} was cancelled in Prefect ({why})"
    receipt = fr.runtime.control().cancel(fr.ctx.run_id, principal=PREFECT_PRINCIPAL, reason=reason)
    log.info("smthrs run %s: %s: %s", fr.ctx.run_id, reason, type(receipt).__name__)


# -- parking ---------------------------------------------------------------------------------------------------
def _park_direct(flow_run_id: str, signal: RunParked) -> RunParked:
    """``on_park`` of a direct flow run's context: park the smthrs run now, then pause the Prefect flow run."""
    with _FR_LOCK:
        fr = _FLOW_RUNS.get(flow_run_id)
    if fr is None or fr.active is None:  # pragma: no cover - the context only exists while it is bound
        return signal
    if fr.parameters_error is not None:
        raise WaitError(
            "unresumable_flow",
            f"flow run {flow_run_id} would park ({signal.kind} {signal.name!r}), but no driver could call the flow "
            f"again: its parameters are not plain JSON ({fr.parameters_error}). Pass plain JSON parameters (write "
            "the data to a file, pass its path), or keep the wait within SMTHRS_WAIT_BUDGET_S",
            run_id=fr.ctx.run_id,
        )
    flush_hits(fr.ctx.run_id)
    outcome = fr.active.conclude(error=signal)
    with _FR_LOCK:
        _FLOW_RUNS.pop(flow_run_id, None)
    if isinstance(outcome, DriveLost):
        raise FenceLost(
            "fence_lost",
            f"flow run {flow_run_id} lost its smthrs run {fr.ctx.run_id!r} before it could park it: {outcome.reason}",
            run_id=fr.ctx.run_id,
        )
    _events.announce_parked(
        signal,
        fr.runtime.db,
        flow_run_id=flow_run_id,
        resume=DEPLOYMENT_RESUME if fr.deployment_id is not None else FLOW_RESUME,
    )
    if fr.deployment_id is not None:
        return _park_deployment_flow_run(fr, flow_run_id, signal)
    return pause_flow_run(signal)


def _park_deployment_flow_run(fr: _FlowRun, flow_run_id: str, signal: RunParked) -> RunParked:
    """Tell Prefect how to continue a deployment's flow run parked on ``signal`` (``_deployment.py``), then look
    at the wait once more: answered between the durable park and now, nobody else would resume the flow run."""
    if signal.kind == "approval":
        pending = [
            t for t in fr.runtime.control().pending_requests(fr.ctx.run_id) if t.request_id == signal.name
        ]
        offer = _resume_form.approval_offer(
            signal,
            deployment=True,
            principal=_resume_form.ui_principal(fr.runtime.settings),
            digest=pending[0].digest if pending else None,
            then=_DEPLOYMENT_THEN,
            state_name=_PARKED_STATE,
        )
        out = _tell_prefect_offer(signal, flow_run_id, offer)
    else:
        out = _tell_prefect(signal, parked_state(signal, _describe(signal, DEPLOYMENT_RESUME)))
    if out is signal or signal.kind == "timer":
        return out  # not told (logged), or Scheduled at the deadline: Prefect comes back on its own
    if _answered(fr, signal):
        assert fr.deployment_id is not None
        woke = resume_parked(fr.ctx.run_id, flow_run_id, fr.deployment_id)
        if isinstance(woke, HostWakeFailed):
            log.warning(
                "smthrs run %s: its wait was answered while it parked, but %s", fr.ctx.run_id, woke.detail,
                exc_info=woke.cause,
            )  # fmt: skip
    return out


def _answered(fr: _FlowRun, signal: RunParked) -> bool:
    """Was the wait ``signal`` parked on answered meanwhile? A completion or a decision on a parked run woke it
    (no longer ``suspended``); a decision that landed before the park leaves the run parked with the request
    decided (the next execution reads it)."""
    record = fr.runtime.runs.get(fr.ctx.run_id)
    if record is None or record.status != "suspended":
        return True
    if signal.kind == "approval":
        pending = fr.runtime.control().pending_requests(fr.ctx.run_id)
        return all(target.request_id != signal.name for target in pending)
    return False


def _pause_driven(db: Database, signal: RunParked) -> RunParked:
    """``on_park`` of a driven flow run: announce the park (the driver writes it right after this signal
    propagates), then pause the Prefect flow run."""
    _events.announce_parked(signal, db)
    return pause_flow_run(signal)


def pause_flow_run(signal: RunParked, resume: str = FLOW_RESUME) -> RunParked:
    """Mark the current Prefect flow run Paused (``Parked``; its message says what the run waits for and, from
    ``resume``, how it comes back) and return the signal to raise: a :class:`ParkedFlowRun` carrying that state.
    If Prefect cannot be told (API down), the plain signal is returned and the reason logged: the durable park
    does not depend on Prefect's display."""
    frc = _prefect_flow_run()
    if frc is None:
        return signal
    if signal.kind == "approval":
        offer = _resume_form.approval_offer(
            signal, deployment=False, principal=None, digest=None, then=resume, state_name=_PARKED_STATE
        )
        return _tell_prefect_offer(signal, str(frc.flow_run.id), offer)
    from prefect.states import Paused

    return _tell_prefect(
        signal, Paused(reschedule=False, name=_PARKED_STATE, message=_describe(signal, resume))
    )


def _tell_prefect_offer(signal: RunParked, flow_run_id: str, offer: _resume_form.Offer) -> RunParked:
    """Show a flow run parked on an approval: its Resume form's inputs stored first (a state whose form cannot be
    loaded would refuse every resume, smthrs's own wake included — so without them the state goes without a
    form, said in the log), the state set, and the message logged on the flow run."""
    try:
        _resume_form.publish(flow_run_id, offer)
    except Exception as exc:  # noqa: BLE001 - reported; the park is durable, the form is display
        log.warning(
            "smthrs run %s is parked, but its Resume form could not be stored on flow run %s (%r): the flow run "
            "shows no form; decide with smthrs approve / smthrs deny",
            signal.run_id,
            flow_run_id,
            exc,
            exc_info=exc,
        )
        offer.state.state_details.run_input_keyset = None
    out = _tell_prefect(signal, offer.state)
    _run_logger().info("parked: %s", offer.message)
    return out


def _run_logger() -> Any:
    """The current flow (or task) run's Prefect logger — what the flow run's log shows — else this module's."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return log


def _tell_prefect(signal: RunParked, state: Any) -> RunParked:
    """Set the current flow run to ``state`` and return the :class:`ParkedFlowRun` carrying it; the plain
    ``signal`` when Prefect cannot be told (logged with its cause: the park is durable either way, and a
    ``smthrs worker`` registering the flow still continues it)."""
    frc = _prefect_flow_run()
    if frc is None:
        return signal
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            result = client.set_flow_run_state(frc.flow_run.id, state, force=True)
        if result.state is not None:
            state = result.state
    except Exception as exc:  # noqa: BLE001 - reported; the run is parked whatever Prefect shows
        log.warning(
            "smthrs run %s is parked, but Prefect could not be told (the flow run will show Crashed, and Prefect "
            "will not continue it; a `smthrs worker --flow MODULE:FLOW` does): %r",
            signal.run_id,
            exc,
            exc_info=exc,
        )
        return signal
    out = _signal_class()(
        signal.run_id,
        signal.kind,
        signal.name,
        due_at_ms=signal.due_at_ms,
        token=signal.token,
        waiting=signal.waiting,
    )
    out.state = state  # type: ignore[attr-defined]  # read by Prefect's engine (Pause.state)
    return out


def _flow_runs_of(journal: Journal, run_id: str) -> list[str]:
    return [str(r["flow_run_id"]) for r in _records(journal, run_id) if "flow_run_id" in r]


def _mark_resumed(previous: str, current: str) -> None:
    """An earlier incarnation still shown Paused (``Parked``) is done: show it Completed (``Resumed``), naming the
    flow run that continues it. So is a deployment's flow run waiting in ``Scheduled`` (its timer, or resumed):
    Prefect would otherwise execute it again beside the driver. One still shown Running or Pending lost the run
    (the driver took it over on liveness evidence: its process died): show it Crashed. Display only, like the pause
    itself: a failure is logged, never raised (fencing keeps a second execution from writing to the run)."""
    try:
        from prefect.client.orchestration import get_client
        from prefect.states import Completed, Crashed

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(uuid.UUID(previous)).state
            if state is None:
                return
            parked = state.is_paused() and state.name == _PARKED_STATE
            if parked or state.is_scheduled():
                shown: Any = Completed(
                    name="Resumed", message=f"parked here; continued by flow run {current}"
                )
            elif state.is_running() or state.is_pending():
                shown = Crashed(
                    message=f"its process stopped; its smthrs run was taken over by flow run {current}"
                )
            else:
                return
            client.set_flow_run_state(uuid.UUID(previous), shown, force=True)
    except Exception as exc:  # noqa: BLE001 - reported; the smthrs run's state does not depend on it
        log.warning("could not show flow run %s as resumed in Prefect: %r", previous, exc)


def agree_with_prefect(journal: Journal, run_id: str, status: str) -> str | None:
    """Show the settled ``status`` of ``run_id`` on the flow run recorded last for it when Prefect still shows that
    flow run unfinished (its process died between the smthrs settlement and Prefect's, or before Prefect heard):
    ``completed`` → Completed, ``failed`` → Failed, ``cancelled`` → Cancelled. Answers the flow run id it set, else
    ``None`` (nothing recorded, already final, or Prefect unreachable: logged)."""
    states = {"completed": "Completed", "failed": "Failed", "cancelled": "Cancelled"}
    if status not in states:
        return None
    latest: str | None = None
    for record in _records(journal, run_id):
        latest = str(record["flow_run_id"]) if "flow_run_id" in record else latest
    if latest is None:
        return None
    import prefect.states

    message = f"smthrs run {run_id} settled {status} (shown after the flow run's process stopped)"
    shown: Any = getattr(prefect.states, states[status])(message=message)
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(uuid.UUID(latest)).state
            if state is not None and state.is_final():
                return None
            client.set_flow_run_state(uuid.UUID(latest), shown, force=True)
    except Exception as exc:  # noqa: BLE001 - reported; the smthrs status is the durable truth
        log.warning("could not show flow run %s %s in Prefect: %r", latest, status, exc)
        return None
    return latest


def _describe(signal: RunParked, resume: str) -> str:
    return f"{_waits_for(signal, resume)}; {_events.parked_hint(signal.run_id)}"


def _waits_for(signal: RunParked, resume: str) -> str:
    run = signal.run_id
    if signal.kind == "timer" and signal.due_at_ms is not None:
        due = datetime.fromtimestamp(signal.due_at_ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")
        return f"smthrs run {run} parked until {due} (timer {signal.name!r}); then {resume}"
    if signal.kind == "approval":
        return (
            f"smthrs run {run} waits for approval {signal.name!r}: smthrs approve {run} --request {signal.name}; "
            f"then {resume}"
        )
    return f"smthrs run {run} waits for {signal.name!r}: sp.complete({run!r}, {signal.name!r}, value); then {resume}"


def _records(journal: Journal, run_id: str) -> Iterator[dict[str, Any]]:
    """The ``prefect-flow-run`` payloads of ``run_id``, oldest first (read page by page)."""
    after: int | None = None
    while True:
        page = journal.read(run_id, after_seq=after, limit=500)
        yield from (e.payload for e in page if e.type == RECORD_TYPE and isinstance(e.payload, dict))
        if len(page) < 500:
            return
        after = page[-1].seq


def deployment_flow_run_of(journal: Journal, run_id: str) -> tuple[str, str] | None:
    """``(flow run id, deployment id)`` when the LATEST flow run recorded for ``run_id`` belongs to a deployment —
    the flow run Prefect continues — else ``None`` (a direct call, or a driver that took the run over)."""
    latest: dict[str, Any] | None = None
    for record in _records(journal, run_id):
        latest = record
    if latest is None or not latest.get("deployment_id") or not latest.get("flow_run_id"):
        return None
    return str(latest["flow_run_id"]), str(latest["deployment_id"])


def recorded_parameters(journal: Journal, run_id: str) -> dict[str, Any] | None:
    """The parameters the run's first flow run was called with (``None``: no flow run recorded yet);
    ``WaitError(unresumable_flow)`` when they were not plain JSON."""
    for record in _records(journal, run_id):
        if record.get("parameters_error") is not None:
            raise WaitError(
                "unresumable_flow",
                f"run {run_id!r} cannot be resumed: its flow's parameters were not plain JSON "
                f"({record['parameters_error']}); start a new run with plain JSON parameters",
                run_id=run_id,
            )
        params = record.get("parameters")
        return dict(params) if isinstance(params, dict) else {}
    return None
