"""What crosses a process boundary to a Prefect process-pool or Dask worker: a picklable stand-in for the cache
dispatch seam, and the per-process caches behind it.

Invariant: engines, fsspec filesystems, measurers and locks are never pickled. A
:class:`WorkerDispatcher` carries URLs and plain settings only (``Database`` and ``ArtifactStore`` pickle as their
URLs); on first use in a process it opens ONE :class:`~smthrs_plugin.cache.dispatch.CacheDispatcher` per
(process, workspace, database, stores) and keeps it, so a worker's stat cache stays warm across jobs. Writes a
job makes there are fenced by the owner token the job carries, exactly as in the coordinator's process. The
dispatcher itself is wired by the composition root (:func:`~smthrs_plugin.runtime.process_dispatcher`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from ..boundary.evidence import InlineLimits
from ..cache.dispatch import CacheDispatcher
from ..cache.model import DispatchRequest, DispatchResult, Execute, SandboxMode
from ..runtime import process_dispatcher
from ..stores.artifacts import ArtifactStore
from ..stores.database import Database

__all__ = ["WorkerDispatcher"]

_CACHE: dict[tuple[Any, ...], CacheDispatcher] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class WorkerDispatcher:
    """A dispatcher description that pickles; :meth:`dispatch` runs the real seam in whatever process it is in."""

    db: Database
    artifacts: ArtifactStore
    shared: ArtifactStore
    workspace: str
    host_id: str
    sandbox_mode: SandboxMode
    limits: InlineLimits
    temp_dir: str | None

    @classmethod
    def of(cls, d: CacheDispatcher) -> WorkerDispatcher:
        """The picklable description of ``d`` (its metrics sink stays behind: workers count nothing)."""
        if isinstance(d, WorkerDispatcher):
            return d
        return cls(
            db=d.db,
            artifacts=d.artifacts,
            shared=d.shared_store,
            workspace=str(d.workspace),
            host_id=d.host_id,
            sandbox_mode=d.sandbox_mode,
            limits=d.limits,
            temp_dir=None if d.temp_dir is None else str(d.temp_dir),
        )

    def _identity(self) -> tuple[Any, ...]:
        return (
            os.getpid(),
            self.workspace,
            self.db.url,
            self.artifacts.url,
            repr(sorted(self.artifacts.storage_options.items())),
            self.shared.url,
            repr(sorted(self.shared.storage_options.items())),
            self.host_id,
            self.sandbox_mode,
            self.limits,
            self.temp_dir,
        )

    def local(self) -> CacheDispatcher:
        """This process's dispatcher for this description (opened once, then reused)."""
        ident = self._identity()
        with _LOCK:
            d = _CACHE.get(ident)
            if d is None:
                # A forked child inherits its parent's entries; they are keyed by the parent's pid and ignored.
                d = _CACHE[ident] = process_dispatcher(
                    self.db,
                    self.artifacts,
                    self.workspace,
                    shared=self.shared,
                    host_id=self.host_id,
                    sandbox_mode=self.sandbox_mode,
                    limits=self.limits,
                    temp_dir=self.temp_dir,
                )
            return d

    def dispatch(self, request: DispatchRequest, execute: Execute) -> DispatchResult:
        return self.local().dispatch(request, execute)
