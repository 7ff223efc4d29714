"""``step-settled`` journal records of ``@step`` calls, written fenced by the run's owner — hits in batches.

Invariants
- Every step call journals one ``step-settled`` record into its run, inside a transaction that first checks the
  run's owner token (``assert_owner``): a call whose run was settled or taken over writes nothing.
- A ``built`` or ``failed`` call is journaled synchronously before the call returns. A verified hit changed no
  state, so in the process that owns the run its record is buffered and written with others in ONE fenced
  transaction — at most :data:`FLUSH_INTERVAL_S` later, and always before the run is settled (the flow-run hook
  and the standalone run flush first) or the process exits. This keeps a cache hit free of a synchronous
  ``fsync``-bound write; a crash can lose the hit records of the last interval, never a state change.
- Worker processes (process pools, Dask) do not own the run: their records are written synchronously, since the
  owner may settle the run as soon as the futures resolve.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection

from ..errors import FenceLost
from ..records.runs import OwnerId, assert_owner
from ..runtime import Runtime

__all__ = ["record_settled", "flush_hits", "FLUSH_INTERVAL_S", "EVENT_TYPE"]

log = logging.getLogger(__name__)

EVENT_TYPE = "step-settled"
#: Longest a buffered hit record waits before it is written.
FLUSH_INTERVAL_S = 0.2

_Key = tuple[int, str, OwnerId]  # (id of the runtime, run id, owner)

_lock = threading.Lock()
_pending: dict[_Key, tuple[Runtime, list[Mapping[str, Any]]]] = {}
_wake = threading.Event()
_flusher: threading.Thread | None = None


def _write(rt: Runtime, run_id: str, owner: OwnerId, payloads: list[Mapping[str, Any]]) -> None:
    def tx(conn: Connection) -> None:
        assert_owner(conn, run_id, owner)
        for p in payloads:
            rt.journal.append_in(conn, run_id, EVENT_TYPE, dict(p))

    rt.db.write(tx)


def record_settled(
    rt: Runtime, run_id: str, owner: OwnerId, payload: Mapping[str, Any], *, hit: bool
) -> None:
    """Journal one step settlement (see the module invariants). Raises ``FenceLost`` for a synchronous write whose
    run is no longer ours."""
    if not hit or owner.pid != os.getpid():
        _write(rt, run_id, owner, [payload])
        return
    with _lock:
        entry = _pending.setdefault((id(rt), run_id, owner), (rt, []))
        entry[1].append(payload)
        _ensure_flusher()
    _wake.set()


def flush_hits(run_id: str | None = None) -> None:
    """Write the buffered hit records now (of ``run_id`` only, or all). A run no longer ours drops its records
    with a warning: they describe hits of a run someone else settled."""
    with _lock:
        keys = [k for k in _pending if run_id is None or k[1] == run_id]
        batches = [(k, _pending.pop(k)) for k in keys]
    for (_, rid, owner), (rt, payloads) in batches:
        try:
            _write(rt, rid, owner, payloads)
        except FenceLost as exc:
            log.warning("dropped %d step-settled hit records of run %s: %s", len(payloads), rid, exc)


def _ensure_flusher() -> None:
    global _flusher
    if _flusher is None or not _flusher.is_alive():
        _flusher = threading.Thread(target=_loop, name="smthrs-step-journal", daemon=True)
        _flusher.start()


def _loop() -> None:
    while True:
        _wake.wait()
        _wake.clear()
        # Gather a batch: hits arriving within the interval share one transaction.
        threading.Event().wait(FLUSH_INTERVAL_S)
        try:
            flush_hits()
        except Exception:  # a storage failure: reported, and the next batch tries again
            log.exception("could not write buffered step-settled records")


atexit.register(flush_hits)
