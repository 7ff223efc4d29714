"""How a ``@step`` call finds its runtime in any process, and the run it writes under.

Invariants
- Inside a Prefect flow run a step belongs to the flow run's smthrs run (``_flowrun.py``: one run per flow run,
  or the run a driver is driving).
- **The owner token travels with the call** (:class:`StepContext`), so a step body in a process-pool or Dask
  worker writes under the flow process's fence and never reads an owner out of the database.
- Outside any flow run (a step called as a plain function, or from a detached context with no token) each call
  is its own short run (``step-<uuid>``): created, claimed, heartbeated while it runs and settled at once.
- Runtimes are opened from plain data (:class:`RuntimeSpec`) once per process and reused (warm stat cache).
- **A run's entries are in the shared tier when it ends**: its runtime publishes them in the background, and the
  end of a standalone run or a flow run waits for what is queued (:func:`drain_publications`). Likewise the
  artifact naming a flow run's smthrs run is attached off the first call's path (:func:`describe_later`) and
  is there when the flow run ends (:func:`finish_background_work`).
  A store named by a Prefect block travels as the block's NAME (``artifacts_block``), never as its credentials:
  each process that opens the spec loads the block itself (once, with the runtime).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..engine.lease import FRESH, Refused, acquire
from ..errors import FenceLost
from ..records.runs import OwnerId
from ..runtime import Runtime, open_runtime
from ..settings import load_settings
from ._stepjournal import flush_hits

__all__ = [
    "RuntimeSpec",
    "StepContext",
    "step_settings",
    "current_spec",
    "standalone_run",
    "open_runtimes",
    "drain_publications",
    "describe_later",
    "finish_background_work",
]

log = logging.getLogger(__name__)

_OVERRIDES: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "smthrs_step_settings", default=None
)


@dataclass(frozen=True)
class RuntimeSpec:
    """How to open the runtime a step uses, as plain data (it crosses process boundaries). With ``artifacts_block``
    the store is that Prefect block's (``artifacts_url`` is then empty; ``artifacts_options`` are laid over the
    block's)."""

    workspace: str
    db_url: str
    artifacts_url: str
    artifacts_options_json: str
    host_id: str
    artifacts_block: str | None = None
    #: ``auto | shared | remote``: where bodies run when the flow's task runner is not in this process
    #: (``_remote.execution_for``).
    execution: str = "auto"

    @property
    def artifacts_options(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.artifacts_options_json)
        return loaded

    def open(self) -> Runtime:
        """This process's runtime for this spec (opened once, then reused)."""
        key = (os.getpid(), self)
        with _RT_LOCK:
            rt = _RUNTIMES.get(key)
            if rt is None:
                rt = _RUNTIMES[key] = open_runtime(
                    self.workspace,
                    db=self.db_url,
                    artifacts=self.artifacts_url or None,
                    artifacts_options=self.artifacts_options,
                    host_id=self.host_id,
                    artifacts_block=self.artifacts_block,
                )
            return rt


_RUNTIMES: dict[tuple[int, RuntimeSpec], Runtime] = {}
_RT_LOCK = threading.Lock()


def open_runtimes() -> list[Runtime]:
    """The runtimes steps opened in this process (for tests and shutdown)."""
    with _RT_LOCK:
        return [rt for (pid, _), rt in _RUNTIMES.items() if pid == os.getpid()]


def drain_publications(spec: RuntimeSpec) -> None:
    """Wait for the shared-tier publications queued by this process's runtime for ``spec`` (none opened: free);
    raises the first database failure one met journaling its outcome."""
    with _RT_LOCK:
        rt = _RUNTIMES.get((os.getpid(), spec))
    if rt is not None:
        rt.drain_publications()


_DESCRIBING: dict[str, Future[bool]] = {}
_DESCRIBING_LOCK = threading.Lock()
_DESCRIBER: ThreadPoolExecutor | None = None
#: Flow runs whose description is remembered at most (a flow run that never ends here is forgotten past this).
_DESCRIBING_MAX = 4096


def describe_later(run_id: str, flow_run_id: str) -> None:
    """Attach to ``flow_run_id`` the artifact naming its smthrs run (``_events.describe_flow_run``: one Prefect API
    call per flow run) on a background thread, once: a call does not wait for the API."""
    global _DESCRIBER
    if flow_run_id in _DESCRIBING:  # every call after the first of its flow run: read without the lock
        return
    from . import _events

    with _DESCRIBING_LOCK:
        if flow_run_id in _DESCRIBING:
            return
        if len(_DESCRIBING) >= _DESCRIBING_MAX:
            _DESCRIBING.clear()
        if _DESCRIBER is None:
            _DESCRIBER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smthrs-describe")
        # Prefect's settings and API client are context variables: the worker runs in this call's context.
        context = contextvars.copy_context()
        _DESCRIBING[flow_run_id] = _DESCRIBER.submit(
            context.run, _events.describe_flow_run, run_id, flow_run_id
        )


def finish_background_work(ctx: StepContext) -> None:
    """Before ``ctx``'s run ends: its flow run's description is attached (never raises: it is a display link,
    logged when it fails) and the shared-tier publications queued by its runtime in this process are done."""
    if ctx.flow_run_id is not None:
        with _DESCRIBING_LOCK:
            described = _DESCRIBING.pop(ctx.flow_run_id, None)
        if described is not None:
            described.result()
    drain_publications(ctx.spec)


@contextmanager
def step_settings(
    workspace: str | os.PathLike[str] | None = None,
    db: str | None = None,
    artifacts: str | None = None,
    artifacts_options: Mapping[str, Any] | None = None,
    host_id: str | None = None,
    artifacts_block: str | None = None,
    execution: str | None = None,
) -> Iterator[RuntimeSpec]:
    """Within this block, steps called from this thread (and flows it runs) use these settings instead of the
    ``SMTHRS_*`` environment. Yields the resolved spec. Settings are fixed per flow run at its first step call.
    ``artifacts_block`` names a saved Prefect block the artifact store is built from (as ``open_runtime``);
    ``execution`` (``auto | shared | remote``, default ``SMTHRS_EXECUTION``) says where step bodies run when the
    flow's task runner is not in this process."""
    spec = _resolve(
        workspace=workspace,
        db=db,
        artifacts=artifacts,
        artifacts_options=artifacts_options,
        host_id=host_id,
        artifacts_block=artifacts_block,
        execution=execution,
    )
    token = _OVERRIDES.set(
        {
            "workspace": spec.workspace,
            "db_url": spec.db_url,
            "artifacts_url": spec.artifacts_url or None,
            "artifacts_options": spec.artifacts_options,
            "host_id": spec.host_id,
            "artifacts_block": spec.artifacts_block,
            "execution": spec.execution,
        }
    )
    try:
        yield spec
    finally:
        _OVERRIDES.reset(token)


def _resolve(**kw: Any) -> RuntimeSpec:
    s = load_settings(
        workspace=kw.get("workspace"),
        db_url=kw.get("db"),
        artifacts_url=kw.get("artifacts"),
        artifacts_options=dict(kw["artifacts_options"]) if kw.get("artifacts_options") is not None else None,
        host_id=kw.get("host_id"),
        artifacts_block=kw.get("artifacts_block"),
        execution=kw.get("execution"),
    )
    block = s.effective_artifacts_block  # not loaded here: a step call must not ask Prefect every time
    return RuntimeSpec(
        workspace=str(s.workspace),
        db_url=s.resolved_db_url,
        artifacts_url="" if block is not None else s.resolved_artifacts_url,
        artifacts_options_json=json.dumps(s.artifacts_options, sort_keys=True),
        host_id=s.host_id,
        artifacts_block=block,
        execution=s.execution,
    )


def current_spec() -> RuntimeSpec:
    """The runtime spec a step called now would use (``step_settings`` overrides, else ``SMTHRS_*``)."""
    o = _OVERRIDES.get()
    if o is None:
        return _resolve()
    return _resolve(
        workspace=o["workspace"],
        db=o["db_url"],
        artifacts=o["artifacts_url"],
        artifacts_options=o["artifacts_options"],
        host_id=o["host_id"],
        artifacts_block=o["artifacts_block"],
        execution=o["execution"],
    )


class StepContext:
    """The run a step call belongs to: run id, the owner token fencing its writes, the runtime spec. A plain,
    non-iterable object on purpose: Prefect's parameter walkers and ``map`` leave it alone."""

    __slots__ = ("run_id", "owner", "spec", "flow_run_id")

    def __init__(self, run_id: str, owner: OwnerId, spec: RuntimeSpec, flow_run_id: str | None) -> None:
        self.run_id = run_id
        self.owner = owner
        self.spec = spec
        self.flow_run_id = flow_run_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (StepContext, (self.run_id, self.owner, self.spec, self.flow_run_id))

    def __repr__(self) -> str:
        return f"StepContext(run_id={self.run_id!r})"


@contextmanager
def standalone_run(flow: str) -> Iterator[StepContext]:
    """A short run of its own for one step call outside any flow run; settled when the block exits."""
    spec = current_spec()
    rt = spec.open()
    lease = acquire(
        f"step-{uuid.uuid4().hex}", flow, FRESH, ownership=rt.ownership, runs=rt.runs, waits=rt.waits
    )
    if isinstance(lease, Refused):  # pragma: no cover - a fresh lease activates or raises
        raise RuntimeError(f"could not claim fresh run {lease.run_id}: {lease.decision}")
    run_id = lease.run_id
    ctx = StepContext(run_id, rt.ownership.owner, spec, None)
    error: BaseException | None = None
    with lease:
        try:
            yield ctx
        except BaseException as exc:
            error = exc
            raise
        finally:
            flush_hits(run_id)
            drain_publications(spec)
            lease.stop_heartbeat()
            if not isinstance(
                error, FenceLost
            ):  # a lost fence: another owner holds the run, nothing of ours to write
                # The step's own ending, not the flow mapping of ``conclude``: any error fails its run.
                lease.settle(
                    "failed" if error is not None else "completed",
                    error=None if error is None else {"type": type(error).__name__, "message": str(error)},
                )
