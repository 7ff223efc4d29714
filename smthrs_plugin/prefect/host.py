"""The Prefect host: every node dispatch of a plan is one Prefect task run named ``"<node id> #<attempt>"``,
submitted through the current flow run's task runner (threads, processes or Dask).

- Prefect orchestrates, the plugin caches: node tasks are built with ``cache_policy=NO_CACHE,
  persist_result=False, retries=0`` (the scheduler owns rebases, the dispatch seam owns the cache).
- The task run's final state mirrors the dispatch: ``Completed`` (built), ``Completed`` named ``Cached`` (clean),
  ``Failed`` (named ``Conflict`` for a copy-back conflict the scheduler will rebase).
- On an in-process runner the host ``shares_process`` (a sealed node may start before its attempt row commits:
  ``scheduler/_session.py``); other runners get each job only after its attempt row committed. Submission happens
  on the flow's own thread.
- Where a body runs (in process, ``shared``, ``remote``) is decided per submission (:func:`._remote.execution_for`);
  every write is fenced by the run's owner token.
- The coordinator hears a node's outcome as soon as it is durable: from inside its task run on an in-process
  runner (before Prefect records the run's final state), from the task run's future otherwise.
- Completions are mirrored as Prefect events (:mod:`._events`) once the outcome is durable, and a parked plan run
  is announced (:func:`run_plan_in_flow`); Prefect being unreachable never changes a node's outcome.

Costs, placements and what Prefect shows: ARCHITECTURE.md ("prefect").
"""

from __future__ import annotations

import contextvars
import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..engine.context import RunParked
from ..errors import SchedulerError, SettingsError
from ..plan import Concurrency, Plan
from ..runtime import Runtime
from ..scheduler.host import default_workers
from ..scheduler.job import JobOutcome, NodeJob, error_line, is_conflict
from ..scheduler.model import Report
from ..scheduler.scheduler import Executor
from ..scheduler.timer import is_timer
from . import _events
from ._events import artifact_key
from ._flowrun import pause_flow_run
from ._remote import RemoteExecutor, RemoteTarget, coordinator_runner, dask_client, execution_for
from ._taskstate import completed, failed, returned
from ._worker import WorkerDispatcher
from .environment import startup_timeout_updates, translated_startup_timeout

if TYPE_CHECKING:  # pragma: no cover
    from prefect import Task

__all__ = [
    "PrefectHost",
    "host_for_run",
    "run_plan_in_flow",
    "report_markdown",
    "artifact_key",
    "flow_run_active",
    "quiet_flow_settings",
    "share_prefect_api",
    "EVENT_PREFIX",
]

log = logging.getLogger(__name__)

#: Prefect event names are ``smthrs.node.<outcome>`` (catalogue: :mod:`._events`).
EVENT_PREFIX = _events.NODE_PREFIX

_HOSTS_BY_RUN: weakref.WeakValueDictionary[str, PrefectHost] = weakref.WeakValueDictionary()


def flow_run_active() -> bool:
    """Is a Prefect flow run active on this thread? Free when Prefect was never imported (then none can be)."""
    import sys

    ctx_mod = sys.modules.get("prefect.context")
    if ctx_mod is None:
        return False
    return ctx_mod.FlowRunContext.get() is not None


class _JobBox:
    """Keeps the job opaque to Prefect's parameter walkers (``visit_collection`` descends into dataclasses).
    ``settled``: told the job's outcome in the task run itself, as soon as it is durable (in-process runners
    only: never pickled)."""

    __slots__ = ("job", "settled")

    def __init__(self, job: NodeJob, settled: Callable[[JobOutcome], None] | None = None) -> None:
        self.job = job
        self.settled = settled

    def __reduce__(self) -> tuple[Any, ...]:
        return (_JobBox, (self.job,))

    def __repr__(self) -> str:
        return f"<smthrs job {self.job.spec.node_id} #{self.job.spec.attempt}>"


def _run_node(box: _JobBox, node: str, attempt: int) -> Any:
    """The body of every node task run (module-level so it pickles by reference). Its state carries the outcome
    in memory already (:mod:`._taskstate`): Prefect builds no result record of its own."""
    outcome: JobOutcome = box.job.run()
    if box.settled is not None:
        # Durable now: the coordinator schedules the dependents while Prefect finishes this task run's states.
        box.settled(outcome)
    r = outcome.result
    if r.outcome == "clean":
        tier = getattr(r.decision, "tier", None) or "unknown"
        # The time a node hit saved is in the run's Report artifact (its durations), not read here per node.
        return completed(outcome, name="Cached", message=f"smthrs: verified cache hit {r.key}; {tier} tier")
    if r.outcome == "failed":
        name = "Conflict" if is_conflict(r.error) else "Failed"
        return failed(outcome, name=name, message=error_line(r.error) or "node failed")
    return completed(outcome)


class PrefectHost:
    """Runs node jobs as Prefect task runs of the active flow run (see the module invariants).

    ``run_id`` names the smthrs run (for the report artifact); ``tags`` are added to every node task;
    ``emit_events=False`` turns the per-node Prefect events off; ``execution`` (``auto | shared | remote``)
    says where bodies run when the flow's task runner is not in this process (:func:`._remote.execution_for`).
    ``durations_ms`` / ``task_runs`` hold, per node, the last dispatch's submit-to-settle time and every task run
    id it had."""

    def __init__(
        self,
        run_id: str | None = None,
        *,
        tags: Iterable[str] = (),
        emit_events: bool = True,
        execution: str = "auto",
    ) -> None:
        execution_for(None, execution)  # a bad choice is refused here, before any node runs
        self.run_id = run_id
        self.tags = tuple(tags)
        self.emit_events = emit_events
        self.execution = execution
        self._targets: dict[int, RemoteTarget] = {}
        self.durations_ms: dict[str, float] = {}
        self.task_runs: dict[str, list[str]] = {}
        self._tasks: dict[tuple[str, str], Task[Any, Any]] = {}
        self._lock = threading.Lock()
        self._closed = False
        if run_id is not None:
            _HOSTS_BY_RUN[run_id] = self

    def __reduce__(self) -> tuple[Any, ...]:
        # A flow that closes over its host is pickled with it wherever Prefect ships the flow run's context (a
        # Dask worker): the worker gets a fresh host with the same options; locks, task caches and targets stay.
        return (_host, (self.run_id, self.tags, self.emit_events, self.execution))

    # -- Host protocol ---------------------------------------------------------------------------------------

    @property
    def shares_process(self) -> bool:
        """True while jobs run in this process: an in-process runner's threads, or the coordinator-side runner of
        remote execution (see the module invariants); asked by the coordinator on the flow's thread."""
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        return ctx is not None and execution_for(ctx.task_runner, self.execution) != "shared"

    def submit(self, job: NodeJob) -> Future[Any]:
        from prefect.context import FlowRunContext

        if self._closed:
            raise RuntimeError("this PrefectHost is closed; create a new one")
        ctx = FlowRunContext.get()
        if ctx is None or ctx.task_runner is None:
            raise SettingsError(
                "invalid_setting",
                "PrefectHost.submit needs an active Prefect flow run on the submitting thread; call "
                "rt.scheduler(...).run(plan) from inside a @flow, or use `smthrs run --prefect`",
            )
        runner = ctx.task_runner
        mode = execution_for(runner, self.execution)
        if mode == "shared":
            job = replace(job, dispatcher=WorkerDispatcher.of(job.dispatcher))
        elif mode == "remote":
            # The seam (and the workspace) stay here, on the coordinator-side runner; only the body is shipped —
            # except a timer's, which is a durable clock of this run, not work.
            if not is_timer(job.node):
                job = replace(job, executor=RemoteExecutor(job.executor, self._target(runner, job)))
            runner = coordinator_runner()
        spec = job.spec
        task = self._task(spec.node_id, spec.plan_id)
        out: Future[Any] = Future()
        started = time.perf_counter()
        elapsed: list[float] = []
        settle_lock = threading.Lock()

        def settled(data: JobOutcome) -> None:
            # The settlement is durable once the job returned: the coordinator may schedule the node's dependents
            # now — from the task run itself on an in-process runner (before Prefect records its final state),
            # else from its future — and the event (which reports that durable fact) follows without delaying them.
            with settle_lock:
                if out.done():
                    return
                elapsed.append((time.perf_counter() - started) * 1000.0)
                with self._lock:  # before the coordinator hears of it: the Report artifact reads it
                    self.durations_ms[spec.node_id] = elapsed[0]
                out.set_result(data)

        # ``settled`` stays behind when the box is pickled to a worker process: there only the future tells.
        box = _JobBox(job, settled)
        pf = runner.submit(task, {"box": box, "node": spec.node_id, "attempt": spec.attempt})
        with self._lock:
            self.task_runs.setdefault(spec.node_id, []).append(str(pf.task_run_id))
        flow_ctx = contextvars.copy_context()
        flow_run_id = str(ctx.flow_run.id) if ctx.flow_run is not None else None

        def done(fut: Any) -> None:
            try:
                fut.wait()
                state = fut.state
                if not state.is_final():
                    # The runner gave the task run up (its wait swallows why): the state is the server's last
                    # word, never an outcome; say what the runner itself met instead of "run is PENDING".
                    lost = _lost_task_run(spec.node_id, fut, state)
                    if not out.done():
                        out.set_exception(lost)
                    else:
                        log.warning("node %s settled, but %s", spec.node_id, lost.message)
                    return
                data = returned(state)
            except BaseException as exc:  # the bridge itself failed: the coordinator must hear it
                if not out.done():
                    out.set_exception(exc)
                return
            if isinstance(data, JobOutcome):
                settled(data)
                if self.emit_events:
                    flow_ctx.run(_emit, job, data, str(fut.task_run_id), flow_run_id, elapsed[0])
            elif out.done():  # the durable outcome was told already; Prefect's ending of the run is display
                log.warning(
                    "node %s settled, but its Prefect task run %s ended %s (%s)",
                    spec.node_id,
                    fut.task_run_id,
                    state.type.value,
                    state.message,
                )
            elif isinstance(data, BaseException):
                out.set_exception(data)
            else:
                out.set_exception(
                    SchedulerError(
                        "store_failed",
                        f"node {spec.node_id!r}: Prefect task run {fut.task_run_id} ended {state.type.value} "
                        f"({state.message}) without a node outcome",
                    )
                )

        pf.add_done_callback(done)
        return out

    def close(self) -> None:
        self._closed = True

    @property
    def default_concurrency(self) -> dict[str, int]:
        """The step cap a scheduler gets with this host when nobody chose one: the local host's thread count.
        Prefect's thread-pool runner is unbounded by default, and a hundred node settlements racing for one
        SQLite write lock cost far more than they overlap."""
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        runner = None if ctx is None else ctx.task_runner
        if runner is not None and execution_for(runner, self.execution) == "remote":
            # A remote body holds a coordinator thread while it runs elsewhere: cap by the cluster's threads.
            return {"steps": max(default_workers(), _cluster_threads(runner))}
        return {"steps": default_workers()}

    def _target(self, runner: Any, job: NodeJob) -> RemoteTarget:
        with self._lock:
            target = self._targets.get(id(runner))
            if target is None or target.runner is not runner:
                target = self._targets[id(runner)] = RemoteTarget.of(
                    runner, job.dispatcher.artifacts, self.execution
                )
            return target

    def _task(self, node_id: str, plan_id: str) -> Task[Any, Any]:
        with self._lock:
            t = self._tasks.get((node_id, plan_id))
            if t is None:
                # One Task built per plan (its __init__ reads and hashes the function's source: ~1 ms); each node
                # gets a shallow copy renamed after it (Task options are read-only configuration).
                proto = self._tasks.get(("", plan_id))
                if proto is None:
                    proto = self._tasks[("", plan_id)] = _node_task(plan_id, self.tags)
                t = copy.copy(proto)
                t.name = node_id
                self._tasks[(node_id, plan_id)] = t
            return t

    def __repr__(self) -> str:
        return f"PrefectHost(run_id={self.run_id!r})"


def _host(run_id: str | None, tags: tuple[str, ...], emit_events: bool, execution: str) -> PrefectHost:
    return PrefectHost(run_id, tags=tags, emit_events=emit_events, execution=execution)


def _cluster_threads(runner: Any) -> int:
    """Worker threads of a Dask runner's cluster (0 for a runner that is not one)."""
    client = dask_client(runner)
    return 0 if client is None else int(sum(client.nthreads().values()))


def _node_task(plan_id: str, tags: tuple[str, ...]) -> Task[Any, Any]:
    import prefect
    from prefect.cache_policies import NO_CACHE

    return prefect.Task(
        _run_node,
        name="smthrs-node",
        task_run_name="{node} #{attempt}",
        # No tag of our own: every tagged task run pays Prefect's slot acquire/release round trips (see above).
        tags=list(tags),
        cache_policy=NO_CACHE,
        persist_result=False,
        retries=0,
    )


def _lost_task_run(node_id: str, fut: Any, state: Any) -> SchedulerError:
    """``SchedulerError(task_run_lost)`` for a node task run ``fut`` the runner stopped waiting on before it ended
    (``state``: the server's last state of it), caused by what the runner's own future raised, when it tells."""
    cause = _runner_failure(fut)
    why = "" if cause is None else f": {type(cause).__name__}: {str(cause).strip()}"
    return SchedulerError(
        "task_run_lost",
        f"node {node_id!r}: the task runner gave its Prefect task run {fut.task_run_id} up while it was still "
        f"{state.type.value}{why}. If the cluster cannot import a module the flow or the node's executor comes "
        "from, install it on the scheduler and workers (or cloudpickle.register_pickle_by_value(module)); if "
        "workers died, see the cluster's logs. Then run the plan again: what already built is not built again",
        cause=cause,
        node=node_id,
        task_run_id=str(fut.task_run_id),
        state=state.type.value,
    )


def _runner_failure(fut: Any) -> BaseException | None:
    """What the runner's own future (``PrefectWrappedFuture.wrapped_future``: a Dask or concurrent future) ended
    with, if it ended; None when it did not or is not such a future."""
    wrapped = getattr(fut, "wrapped_future", None)
    if wrapped is None or not wrapped.done():
        return None
    try:
        return wrapped.exception()  # type: ignore[no-any-return]
    except BaseException as err:  # a cancelled future answers by raising: that is its reason
        return err


def _emit(job: NodeJob, outcome: JobOutcome, task_run_id: str, flow_run_id: str | None, ms: float) -> None:
    r = outcome.result
    spec = job.spec
    _events.emit(
        _events.node_settled(
            run_id=spec.run_id,
            plan_id=spec.plan_id,
            node=spec.node_id,
            attempt=spec.attempt,
            dispatch_key=r.key,
            outcome=r.outcome,
            cache_decision=None if r.decision is None else r.decision.tag,
            conflict=is_conflict(r.error),
            error=error_line(r.error),
            duration_ms=ms,
            task_run_id=task_run_id,
            flow_run_id=flow_run_id,
        )
    )
    _events.emit(
        _events.cache_refused(
            run_id=spec.run_id,
            subject=f"{spec.plan_id}/{spec.node_id}",
            kind="node",
            dispatch_key=r.key,
            decision=r.decision,
            outcome=r.outcome,
            task_run_id=task_run_id,
            flow_run_id=flow_run_id,
            subject_resource=_events.node_resource_id(spec.plan_id, spec.node_id),
        )
    )


def host_for_run(run_id: str) -> PrefectHost | None:
    """The Prefect host a provider created for ``run_id`` (while it lives)."""
    return _HOSTS_BY_RUN.get(run_id)


# ------------------------------------------------------------------------------------------------- report


def report_markdown(run_id: str, report: Report, durations_ms: Mapping[str, float] | None = None) -> str:
    """The Report as markdown: headed by the smthrs run id, one row per node (outcome, cache decision, attempts,
    duration, dispatch key), then the commands that inspect the run (and the review page when
    ``SMTHRS_SERVE_URL`` is set). A Report is attached when the pass settled the run, so there is nothing left to
    approve or cancel; a parked run's artifact names those commands instead (:func:`._events.parked_markdown`)."""
    durations = durations_ms or {}
    counts: dict[str, int] = {}
    for s in report.settlements:
        counts[s.outcome] = counts.get(s.outcome, 0) + 1
    summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
    lines = [
        f"## smthrs run `{run_id}`",
        "",
        f"plan `{report.plan_id}` · digest `{report.digest}` · {summary}",
        "",
        "| node | outcome | cache decision | attempts | duration (ms) | dispatch key |",
        "|---|---|---|---|---|---|",
    ]
    for s in report.settlements:
        ms = durations.get(s.node)
        key = f"`{s.dispatch_key[:17]}…`" if s.dispatch_key else "-"
        err = f" ({s.error})" if s.error else ""
        lines.append(
            f"| {s.node} | **{s.outcome}**{err} | {s.cache_decision or '-'} | {s.attempts} | "
            f"{'-' if ms is None else f'{ms:.1f}'} | {key} |"
        )
    lines += ["", "### Inspect it", "", _events.links_markdown(run_id, settled=True)]
    return "\n".join(lines)


def share_prefect_api() -> str:
    """Export this process's Prefect API as ``PREFECT_API_URL`` so its children (process-pool and Dask workers,
    subprocesses) report to the same server instead of each starting an ephemeral one (10-15 s each,
    and their task runs would be invisible). The configured server, or Prefect's ephemeral server — started now if
    it is not running yet (given the startup budget of :mod:`.environment`; a time-out is
    ``SchedulerError(prefect_unavailable)``). Returns the URL. Call it before creating the task runner's workers."""
    import os

    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()
        with quiet_flow_settings(), translated_startup_timeout():
            server.start()
        url = server.api_url
    os.environ["PREFECT_API_URL"] = str(url)
    return str(url)


# ----------------------------------------------------------------------------------------- smthrs run --prefect


def quiet_flow_settings() -> Any:
    """A settings context that switches Prefect's per-flow-run heartbeat thread off (its join costs ~0.5 s per
    flow run); smthrs heartbeats its own runs. It also gives Prefect's ephemeral server 180 s to start
    unless the user chose a startup timeout (:mod:`.environment`)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, **startup_timeout_updates()})


def run_plan_in_flow(
    rt: Runtime,
    run_id: str,
    plan: Plan,
    executor: Executor,
    *,
    concurrency: Concurrency | Mapping[str, Any] | None = None,
    task_runner: Any = None,
    flow_name: str | None = None,
) -> Report:
    """Run ``plan`` as run ``run_id`` inside a Prefect flow run named after the run (``smthrs run --prefect``):
    every node dispatch is a task run of that flow run, and the Report is attached as a markdown artifact.
    ``task_runner`` defaults to Prefect's thread pool. A scheduler refusal fails the flow run and is raised;
    Prefect's ephemeral server not starting in time is ``SchedulerError(prefect_unavailable)``."""
    from prefect import Flow
    from prefect.task_runners import ThreadPoolTaskRunner

    name = flow_name or "smthrs-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in plan.flow)

    def body() -> Report:
        if not flow_run_active():  # pragma: no cover - Prefect guarantees it
            raise SchedulerError("store_failed", "internal: no flow run context inside the smthrs flow")
        try:
            return rt.scheduler(run_id, concurrency=concurrency).run(plan, executor)
        except RunParked as parked:
            # The plan run is already parked (the runtime's run driver wrote it): tell Prefect (events an
            # automation can use, the artifact naming the commands), then show the flow run Paused ("Parked"), not
            # Crashed. The signal raised is still a RunParked for the caller.
            resume = f"`smthrs resume {run_id} --key K` (or the same `smthrs run` again) continues it"
            _events.announce_parked(parked, rt.db, resume=resume)
            raise pause_flow_run(parked, resume) from None  # its message adds how to inspect and decide

    smthrs_flow: Flow[[], Report] = Flow(
        body,
        name=name,
        flow_run_name=run_id,
        task_runner=task_runner or ThreadPoolTaskRunner(),  # type: ignore[arg-type]
        persist_result=False,
        validate_parameters=False,
        log_prints=False,
    )
    with quiet_flow_settings(), translated_startup_timeout():
        report: Report = smthrs_flow()
    return report
