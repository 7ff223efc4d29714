"""Remote execution: node and ``@step`` bodies run on task-runner workers that share only the artifact store
(S3) with the coordinator; the workspace never leaves the coordinator's machine.

The coordinator keys, looks up (a hit never involves a worker) and seeds the sandbox; on a miss the body is shipped
with the sandbox's manifest (small files' bytes inline, missing blobs of the others uploaded,
``boundary/transfer.py``), the worker hydrates an empty tree from those alone, runs the body and returns the value
with a content delta (small outputs inline, every changed blob stored), and the coordinator applies it to its
sandbox before the usual diff, copy-back, settlement and publication.

- A worker never opens the workspace path and writes nothing but content-addressed blobs; every durable record is
  written by the coordinator, fenced by the run's owner token.
- Hermetic by construction (the worker's tree holds only the declared reads); no clock crosses from a worker.
- A missing input is ``RemoteError(input_unavailable)``: every input blob is replaced and the body submitted once
  more; a second failure is the node's typed failure.
- A worker that dies mid-body is the task runner's to retry; if it gives up, the attempt settles ``failed``, fenced.
- Cancellation (Dask): when the pass's cancel token fires (``NodeInput.cancel``: a sibling's typed failure, an
  interrupt), the coordinator cancels the body's Dask future and stops waiting: the node fails
  :class:`RemoteInterrupted`, like a ``run:`` command killed by the same interrupt (the scheduler has already
  marked the attempt ``failed``), and the seam removes its sandbox. On the worker the cancelled task's body sees
  a token that fires (``NodeInput.cancel``, so a plan-file command's process group is killed there too); a body
  that ignores it runs to its end, its outcome dropped, and its tree is removed then. Other task runners' bodies
  are not interrupted: the pass waits for them.
- Where bodies run: :func:`execution_for` (the flow's task runner and ``SMTHRS_EXECUTION``,
  ``PrefectHost(execution=...)``, ``step_settings(execution=...)``).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from ..boundary.fsops import rmtree_force
from ..boundary.transfer import Delta, Manifest, apply_delta, delta_of, hydrate, shipped_tree, upload
from ..engine.context import waits_forbidden
from ..errors import RemoteError, SettingsError
from ..scheduler.cancel import NEVER_CANCELLED, CancelToken
from ..scheduler.model import NodeInput
from ..settings import Execution
from ..stores.artifacts import ArtifactStore
from ._taskstate import returned
from .workspace import with_workspace

if TYPE_CHECKING:  # pragma: no cover
    from prefect import Task

__all__ = [
    "ExecutionMode",
    "execution_for",
    "RemoteTarget",
    "RemoteExecutor",
    "RemoteInterrupted",
    "StepBody",
    "coordinator_runner",
    "dask_client",
]

#: Where one flow run's bodies run: in this process (a thread-pool runner), in other processes that see the
#: workspace at the same path (``shared``), or on workers that see only the artifact store (``remote``).
ExecutionMode = Literal["in-process", "shared", "remote"]
_CHOICES: tuple[str, ...] = get_args(Execution)
log = logging.getLogger(__name__)
#: Threads of the coordinator-side runner: each holds one remote body's seam while the body runs elsewhere, so
#: this bounds how many bodies one process has in flight (plans are capped lower by their ``steps`` cap).
_COORDINATOR_THREADS = 64
#: The Dask key prefix of every shipped body: the worker-side cancel plugin acts on these keys only.
_KEY_PREFIX = "smthrs-body-"


class RemoteInterrupted(Exception):
    """A remote body was cancelled on its cluster because its scheduler pass was interrupted (the node's failure
    outcome, as :class:`~smthrs_plugin.scheduler.planfile.CommandInterrupted` is for a ``run:`` command)."""

    def __init__(self, label: str, reason: str | None) -> None:
        super().__init__(
            f"the remote body {label!r} was cancelled: the scheduler pass was interrupted ({reason})"
        )
        self.label = label
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteInterrupted, (self.label, self.reason))


def execution_for(runner: Any, choice: str) -> ExecutionMode:
    """Where bodies submitted to ``runner`` run under ``choice`` (``auto | shared | remote``).

    ``remote`` always ships bodies through the store. Otherwise a thread-pool runner runs them in this process;
    ``shared`` trusts any other runner's workers to see the workspace at the same path; ``auto`` knows that of a
    ``ProcessPoolTaskRunner`` (children of this process) and of a ``DaskTaskRunner`` that starts its own
    ``LocalCluster`` (worker processes on this machine), and ships bodies for every other runner (a Dask runner
    given an ``address`` or another cluster class, Ray, anything unknown)."""
    if choice not in _CHOICES:
        raise SettingsError(
            "invalid_setting",
            f"execution={choice!r} is not one of {list(_CHOICES)}; set SMTHRS_EXECUTION or execution= to one of them",
        )
    if choice == "remote":
        return "remote"
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    if runner is None or isinstance(runner, ThreadPoolTaskRunner):
        return "in-process"
    if choice == "shared" or isinstance(runner, ProcessPoolTaskRunner) or _starts_local_cluster(runner):
        return "shared"
    return "remote"


def _starts_local_cluster(runner: Any) -> bool:
    try:
        from distributed import LocalCluster
        from prefect_dask import DaskTaskRunner
    except ImportError:
        return False
    if not isinstance(runner, DaskTaskRunner):
        return False
    cluster = getattr(runner, "_cluster", None)
    if cluster is not None:
        return isinstance(cluster, LocalCluster)
    if runner.address:
        return False
    cls = runner.resolved_cluster_class
    return cls is None or (isinstance(cls, type) and issubclass(cls, LocalCluster))


_LOCAL: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()


def coordinator_runner() -> Any:
    """This process's thread-pool task runner for the coordinator side of remote bodies (started once, never
    pickled): a remote node's or step's own task run runs here — the seam needs the workspace — and submits its
    body to the flow's runner."""
    from prefect.task_runners import ThreadPoolTaskRunner

    with _LOCAL_LOCK:
        runner = _LOCAL.get("runner")
        if runner is None or _LOCAL.get("pid") != os.getpid():
            runner = ThreadPoolTaskRunner(max_workers=_COORDINATOR_THREADS)
            runner.__enter__()
            _LOCAL.update(runner=runner, pid=os.getpid())
        return runner


@dataclass(frozen=True)
class _Shipment:
    """What crosses to the worker: the body, the tree it starts from, the store both sides reach, and the bytes of
    the tree's small files by digest (``boundary/transfer.py``: they travel with the task, not through the store)."""

    call: Callable[[Path], Any]
    manifest: Manifest
    store: ArtifactStore
    inline: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class _Returned:
    """What comes back: the body's value and what it changed in its tree."""

    value: Any
    delta: Delta


class _Box:
    """Keeps the shipment opaque to Prefect's parameter walkers (``visit_collection`` descends into dataclasses)."""

    __slots__ = ("shipment",)

    def __init__(self, shipment: _Shipment) -> None:
        self.shipment = shipment

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Box, (self.shipment,))

    def __repr__(self) -> str:
        return "<smthrs remote body>"


def _run_body(box: _Box, label: str) -> _Returned:
    """The function of every ``smthrs-body`` task run, on the worker (module-level: it pickles by reference)."""
    return _run_shipment(box.shipment, label)


def _run_pickled_body(blob: bytes, label: str, key: str | None = None) -> _Returned:
    """The function of a body shipped as a plain Dask task: the shipment was cloudpickled by the coordinator.
    ``key``: the task's own Dask key, whose cancellation fires the body's token (:class:`_CancelPlugin`)."""
    import cloudpickle

    shipment: _Shipment = cloudpickle.loads(blob)
    if key is None:
        return _run_shipment(shipment, label)
    try:
        return _run_shipment(shipment, label, _worker_token(key, label))
    finally:
        with _WORKER_LOCK:
            _WORKER_TOKENS.pop(key, None)


#: The cancel token of the body running on this thread (a node body's ``NodeInput.cancel`` on the worker).
_BODY_CANCEL: contextvars.ContextVar[CancelToken] = contextvars.ContextVar("smthrs_body_cancel")


def _run_shipment(s: _Shipment, label: str, cancel: CancelToken = NEVER_CANCELLED) -> _Returned:
    """Hydrate a private tree from the store, run the body there, return its value with its delta."""
    parent = Path(tempfile.mkdtemp(prefix="smthrs-remote-"))
    reset = _BODY_CANCEL.set(cancel)
    try:
        root = parent / "root"
        root.mkdir()
        hydrate(s.manifest, s.store, root, inline=s.inline)
        with waits_forbidden(f"the remote body {label!r}"):
            value = s.call(root)
        return _Returned(value, delta_of(root, s.manifest, s.store, inline=True))
    finally:
        _BODY_CANCEL.reset(reset)
        try:
            rmtree_force(parent)
        except (
            OSError
        ):  # a leftover temp tree is the worker's disk concern; the body's outcome is what matters
            log.warning("could not remove the remote body's temporary tree %s", parent, exc_info=True)


# -- cancellation on a Dask worker -------------------------------------------------------------------------------
#: Per worker process: the token of each shipped body this worker executes, by Dask key. Created when the task
#: starts executing (before the body runs, so a cancel racing the start is not missed), fired when the scheduler
#: releases the executing task (the coordinator cancelled its future), dropped when the body returns.
_WORKER_TOKENS: dict[str, CancelToken] = {}
_WORKER_LOCK = threading.Lock()


def _worker_token(key: str, label: str) -> CancelToken:
    with _WORKER_LOCK:
        token = _WORKER_TOKENS.get(key)
        if token is None:
            # Only without the plugin on this worker (a worker that joined while it was being registered): the body
            # runs, but a cancel of its pass no longer reaches it, and the coordinator does not wait for it.
            log.warning("the remote body %r runs without the smthrs cancel plugin on this worker", label)
            token = _WORKER_TOKENS[key] = CancelToken()
        return token


def _on_transition(key: Any, start: str, finish: str) -> None:
    """The worker's task transitions (on its event loop): make and fire the tokens of shipped bodies."""
    if not isinstance(key, str) or not key.startswith(_KEY_PREFIX):
        return
    if finish == "executing":
        with _WORKER_LOCK:
            _WORKER_TOKENS.setdefault(key, CancelToken())
        return
    if start == "executing" and finish in ("released", "cancelled", "forgotten"):
        with _WORKER_LOCK:
            token = _WORKER_TOKENS.get(key)
        if token is not None:
            # Fired on the event loop: callbacks are short (kill a process group), the body reacts on its thread.
            token.cancel("its Dask task was cancelled by the coordinator")


_PLUGIN_NAME = "smthrs-remote-cancel"
_PLUGIN_CLASS: list[type] = []


def _cancel_plugin() -> Any:
    """The worker plugin firing body tokens (built on first use: ``distributed`` is imported only with Dask). It
    pickles as a call of this function, so a worker builds the class from its own ``smthrs_plugin``."""
    if not _PLUGIN_CLASS:
        from distributed.diagnostics.plugin import WorkerPlugin

        class _CancelPlugin(WorkerPlugin):  # type: ignore[misc]  # distributed is untyped here
            idempotent = True  # registered by every coordinator: the first registration stays

            def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
                _on_transition(key, start, finish)

            def __reduce__(self) -> tuple[Any, ...]:
                return (_cancel_plugin, ())

        _PLUGIN_CLASS.append(_CancelPlugin)
    return _PLUGIN_CLASS[0]()


#: Clients whose cluster has the plugin (weak: a closed client is forgotten; a new one registers again).
_PLUGGED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _ensure_cancel_plugin(client: Any) -> None:
    """Register the cancel plugin with ``client``'s cluster once per client (idempotent on the cluster too)."""
    with _LOCAL_LOCK:
        if _PLUGGED.get(id(client)) is client:
            return
    client.register_plugin(_cancel_plugin(), name=_PLUGIN_NAME)
    with _LOCAL_LOCK:
        _PLUGGED[id(client)] = client


_TASK: dict[str, Task[Any, Any]] = {}


def _body_task() -> Task[Any, Any]:
    task = _TASK.get("task")
    if task is None:
        import prefect
        from prefect.cache_policies import NO_CACHE

        task = _TASK["task"] = prefect.Task(
            _run_body,
            name="smthrs-body",
            task_run_name="{label}",
            cache_policy=NO_CACHE,
            persist_result=False,
            retries=0,  # a body is retried by the runner when its worker dies, and by smthrs once for an input
        )
    return task


@dataclass(frozen=True)
class RemoteTarget:
    """Where remote bodies go: the flow's task runner and the artifact store its workers reach. Lives in the
    coordinator's process only (the runner is not picklable)."""

    runner: Any
    store: ArtifactStore

    @classmethod
    def of(cls, runner: Any, store: ArtifactStore, choice: str) -> RemoteTarget:
        """Refuses (``RemoteError(store_not_shared)``) a store the workers cannot reach: ``memory://`` never, a local
        path unless remote execution was chosen explicitly (then the path must be mounted on every worker)."""
        if store.kind == "memory" or (store.kind == "local" and choice != "remote"):
            raise RemoteError(
                "store_not_shared",
                f"the flow's task runner ({type(runner).__name__}) runs bodies on workers that may not see this "
                f"machine, and remote execution ships inputs and outputs through the artifact store, which is "
                f"{store.url} (this {'process' if store.kind == 'memory' else 'machine'} only); point "
                "SMTHRS_ARTIFACTS_URL at s3://..., or set SMTHRS_EXECUTION=shared (execution='shared') if every "
                "worker sees the workspace at the same path",
                url=store.url,
            )
        return cls(runner, store)

    def run(
        self, label: str, call: Callable[[Path], Any], root: Path, cancel: CancelToken = NEVER_CANCELLED
    ) -> Any:
        """Run ``call(tree)`` on a worker, ``tree`` built from ``root``'s content; make ``root`` what the worker's
        tree became; return the body's value (or raise the body's own exception). ``cancel`` firing cancels the
        body's task on a Dask cluster and raises :class:`RemoteInterrupted` (module invariants)."""
        # Small files ride with the task (read while hashing); only the others go through the store.
        manifest, inline = shipped_tree(root)
        upload(root, manifest, self.store, skip=inline)
        shipment = _Shipment(call, manifest, self.store, inline)
        for attempt in (1, 2):
            if cancel.cancelled:  # interrupted before (another) submission: nothing is shipped
                raise RemoteInterrupted(label, cancel.reason)
            out = self._submit(shipment, label, cancel)
            if isinstance(out, _Returned):
                apply_delta(out.delta, self.store, root)
                return out.value
            if isinstance(out, RemoteError) and out.code == "input_unavailable" and attempt == 1:
                upload(root, manifest, self.store, force=True, skip=inline)
                continue
            if isinstance(out, BaseException):
                raise out
            raise RemoteError(
                "worker_failed",
                f"the remote body {label!r} ended without an outcome ({type(out).__name__}); see its task run",
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def _submit(self, shipment: _Shipment, label: str, cancel: CancelToken) -> Any:
        client = dask_client(self.runner)
        if client is not None:
            return _on_dask(client, shipment, label, cancel)
        future = contextvars.copy_context().run(self._submit_outside_task, shipment, label)
        future.wait()
        state = future.state
        if (
            not state.is_final()
        ):  # the runner gave up on the body (its workers died) before Prefect heard an end
            return RemoteError(
                "worker_failed",
                f"the remote body {label!r} ended without an outcome (its task run is {state.type.value}); the "
                "task runner lost it; run the node again",
            )
        return returned(state)

    def _submit_outside_task(self, shipment: _Shipment, label: str) -> Any:
        from prefect.context import TaskRunContext

        # The body is submitted from inside the node's (or step's) own task run, whose context a runner
        # serialises for the worker — with that task run's parameters: the job, its seam, the step's arguments.
        # In this private copy of the context there is no task run: the worker gets the flow run's context only.
        TaskRunContext.__var__.set(None)  # type: ignore[arg-type]
        return self.runner.submit(_body_task(), {"box": _Box(shipment), "label": label})


def dask_client(runner: Any) -> Any:
    """The distributed client of a started ``prefect_dask.DaskTaskRunner`` (None for any other runner)."""
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        return None
    return runner.client if isinstance(runner, DaskTaskRunner) else None  # connects on first use


def _on_dask(client: Any, shipment: _Shipment, label: str, cancel: CancelToken = NEVER_CANCELLED) -> Any:
    """Run the body as a plain task of the Dask runner's own cluster: no Prefect task run of its own (the node's
    or step's task run on the coordinator is the one Prefect shows), so neither Prefect's context serialisation
    nor Dask's argument tokenizing (``pure=False``) nor a second task engine is paid per body. Dask still
    reschedules a body whose worker died. ``cancel`` firing cancels the task (module invariants). Returns the
    body's outcome or its exception."""
    from concurrent.futures import CancelledError

    import cloudpickle
    from distributed import KilledWorker

    _ensure_cancel_plugin(client)
    key = f"{_KEY_PREFIX}{uuid.uuid4().hex}"
    # Pickled here, by cloudpickle, as Prefect's runner pickles a task: a body or an executor defined in a script
    # (or a module registered by value) travels by value. Dask would try plain pickle first, by reference, and
    # its scheduler would then fail to import the user's module. Bytes also spare the scheduler unpickling it.
    blob = cloudpickle.dumps(shipment)
    future = client.submit(_run_pickled_body, blob, label, key, pure=False, key=key)
    try:
        # The callback runs on the canceller's thread (the coordinator's abort): the scheduler forgets the task,
        # its worker fires the body's token, and this wait ends at once with CancelledError.
        with cancel.on_cancel(lambda: future.cancel(reason="smthrs: the scheduler pass was interrupted")):
            return future.result()
    except CancelledError as exc:
        if cancel.cancelled:
            return RemoteInterrupted(label, cancel.reason)
        return RemoteError(
            "worker_failed",
            f"the remote body {label!r} was cancelled on the Dask cluster by someone else ({exc}); run the node "
            "again",
            cause=exc,
        )
    except KilledWorker as exc:
        return RemoteError(
            "worker_failed",
            f"the remote body {label!r} was lost with the workers Dask ran it on ({exc}); run the node again",
            cause=exc,
        )
    except Exception as exc:  # the body's own failure (or a refusal of its tree): the caller decides
        return exc


@dataclass(frozen=True)
class _NodeBody:
    """A plan node's executor with its input, minus the root (the worker's tree replaces it)."""

    executor: Callable[[NodeInput], Any]
    ni: NodeInput

    def __call__(self, root: Path) -> Any:
        # The worker-side token of this body's task (never cancelled outside a Dask worker).
        return self.executor(replace(self.ni, root=root, cancel=_BODY_CANCEL.get(NEVER_CANCELLED)))


class RemoteExecutor:
    """A node executor that runs ``inner`` remotely through ``target`` (``PrefectHost`` puts it in a job)."""

    def __init__(self, inner: Callable[[NodeInput], Any], target: RemoteTarget) -> None:
        self.inner = inner
        self.target = target

    def __call__(self, ni: NodeInput) -> Any:
        # The pass's cancellation token stays here (it cannot travel): firing it cancels the body's task, and on
        # a Dask worker the body gets that task's own token instead (module invariants).
        shipped = _NodeBody(self.inner, replace(ni, root=Path("."), cancel=NEVER_CANCELLED))
        return self.target.run(f"{ni.node.id} #{ni.attempt} · remote", shipped, ni.root, ni.cancel)

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("a RemoteExecutor runs on the coordinator; only its body is shipped")


@dataclass(frozen=True)
class StepBody:
    """A ``@step`` function call to run on a worker: the function, its workspace parameter (name and positional
    index, if it takes one), its bound arguments. An async function's coroutine runs to completion on the worker's
    own event loop."""

    fn: Callable[..., Any]
    workspace_param: str | None
    workspace_at: int | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self, root: Path) -> Any:
        args, kwargs = with_workspace(self.args, self.kwargs, self.workspace_param, self.workspace_at, root)
        out = self.fn(*args, **kwargs)
        if inspect.iscoroutine(out):
            return asyncio.run(out)
        return out
