"""How a ``@step`` call finds its runtime in any process, and the run it writes under.

Invariants
- Inside a Prefect flow run a step belongs to the flow run's smthrs run (``_flowrun.py``: one run per flow run,
  or the run a driver is driving).
- **The owner token travels with the call** (:class:`StepContext`), so a step body in a process-pool or Dask
  worker writes under the flow process's fence and never reads an owner out of the database.
- Outside any flow run (a step called as a plain function, or from a detached context with no token) each call
  is its own short run (``step-<uuid>``): created, claimed, heartbeated while it runs and settled at once.
- Runtimes are opened from plain data (:class:`RuntimeSpec`) once per process and reused (warm stat cache).
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
            lease.stop_heartbeat()
            if not isinstance(
                error, FenceLost
            ):  # a lost fence: another owner holds the run, nothing of ours to write
                # The step's own ending, not the flow mapping of ``conclude``: any error fails its run.
                lease.settle(
                    "failed" if error is not None else "completed",
                    error=None if error is None else {"type": type(error).__name__, "message": str(error)},
                )
