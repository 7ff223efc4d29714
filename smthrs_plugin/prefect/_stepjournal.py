"""``step-settled`` journal records of ``@step`` calls, written fenced by the run's owner — hits in batches.

Invariants
- Every step call journals one ``step-settled`` record into its run, inside a transaction that first checks the
  run's owner token (``assert_owner``): a call whose run was settled or taken over writes nothing.
- A ``built`` or ``failed`` call is journaled synchronously before the call returns. A verified hit changed no
  state, so in the process that owns the run its record is buffered and written with others in ONE fenced
  transaction — at most :data:`FLUSH_INTERVAL_S` later, and always before the run is parked or settled (the
  park, the flow-run hook and the standalone run call :func:`flush_hits`, which also waits for a batch the flusher
  thread is writing) or the process exits. This keeps a cache hit free of a synchronous ``fsync``-bound write; a
  crash can lose the hit records of the last interval, never a state change.
- A ``built`` record carries ``execute_ms``, how long the body ran (no key folds it): what a later hit of the
  same dispatch key reports as the time it saved (:func:`build_ms`, read back through the served entry's
  provenance run, once per run and process).
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

__all__ = ["record_settled", "flush_hits", "FLUSH_INTERVAL_S", "EVENT_TYPE", "remember_build", "build_ms"]

log = logging.getLogger(__name__)

EVENT_TYPE = "step-settled"
#: Longest a buffered hit record waits before it is written.
FLUSH_INTERVAL_S = 0.2

_Key = tuple[int, str, OwnerId]  # (id of the runtime, run id, owner)

_lock = threading.Lock()
_pending: dict[_Key, tuple[Runtime, list[Mapping[str, Any]]]] = {}
#: Batches taken off ``_pending`` and not written yet, by key (the flusher thread's, or another flush's).
_writing: dict[_Key, int] = {}
_written = threading.Condition(_lock)
_wake = threading.Event()
_flusher: threading.Thread | None = None


def _write(rt: Runtime, run_id: str, owner: OwnerId, payloads: list[Mapping[str, Any]]) -> None:
    # Encoded (and refused, typed as an append refuses) before the transaction opens.
    encoded = [rt.journal.encode(run_id, EVENT_TYPE, dict(p)).payload_json for p in payloads]
    # A batch of hits goes in as one INSERT (the transaction's deferred appends); only at the outermost level.
    batched = len(encoded) > 1 and not rt.db.in_write()

    def tx(conn: Connection) -> None:
        assert_owner(conn, run_id, owner)
        if batched:
            rt.db.allow_deferred()
        for payload_json in encoded:
            rt.journal.append_canonical_in(conn, run_id, EVENT_TYPE, payload_json)

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
    """Write the buffered hit records now (of ``run_id`` only, or all), and return only once every batch of them
    is written — a batch the flusher thread took before this call included: a caller parks or settles the run
    next, and a batch still in flight then would find the run no longer ours and be dropped. A run no longer ours
    drops its records with a warning: they describe hits of a run someone else settled."""

    def ours(k: _Key) -> bool:
        return run_id is None or k[1] == run_id

    with _lock:
        batches = [(k, _pending.pop(k)) for k in [k for k in _pending if ours(k)]]
        for k, _ in batches:
            _writing[k] = _writing.get(k, 0) + 1
    try:
        for (_, rid, owner), (rt, payloads) in batches:
            try:
                _write(rt, rid, owner, payloads)
            except FenceLost as exc:
                log.warning("dropped %d step-settled hit records of run %s: %s", len(payloads), rid, exc)
    finally:
        with _lock:
            for k, _ in batches:
                _writing[k] -= 1
                if not _writing[k]:
                    del _writing[k]
            _written.notify_all()
            while any(ours(k) for k in _writing):
                _written.wait()


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


# -- what a hit saved -------------------------------------------------------------------------------------------

#: Bounds of the per-process memo of build durations (dispatch key -> ms) and of the runs read into it.
_MAX_BUILDS = 10_000
_MAX_RUNS = 1_000
_built_ms: dict[str, float] = {}
_runs_read: dict[str, None] = {}
_memo_lock = threading.Lock()


def remember_build(key: str, ms: float) -> None:
    """Remember that a build of dispatch key ``key`` ran its body for ``ms`` milliseconds (this process)."""
    with _memo_lock:
        _built_ms.pop(key, None)
        if len(_built_ms) >= _MAX_BUILDS:
            _built_ms.pop(next(iter(_built_ms)))
        _built_ms[key] = ms


def build_ms(rt: Runtime, key: str) -> float | None:
    """How long the body whose result a hit of ``key`` served ran (``execute_ms`` of its ``built`` record; the
    whole dispatch's ``ms`` for a record written before that was recorded); None when this database has no
    record of that build (an entry published by another machine)."""
    with _memo_lock:
        if key in _built_ms:
            return _built_ms[key]
    run_id = _entry_run(rt, key)
    if run_id is None or run_id in _runs_read:
        return None
    found: dict[str, float] = {}
    after: int | None = None
    while True:
        page = rt.journal.read(run_id, after_seq=after, limit=500)
        for e in page:
            p = e.payload
            if e.type == EVENT_TYPE and isinstance(p, dict) and p.get("outcome") == "built":
                ms = p.get("execute_ms", p.get("ms"))
                if isinstance(ms, (int, float)) and isinstance(p.get("dispatch_key"), str):
                    found[p["dispatch_key"]] = float(ms)
        if len(page) < 500:
            break
        after = page[-1].seq
    with _memo_lock:
        if len(_runs_read) >= _MAX_RUNS:
            _runs_read.pop(next(iter(_runs_read)))
        _runs_read[run_id] = None
    for k, ms in found.items():
        remember_build(k, ms)
    return found.get(key)


def _entry_run(rt: Runtime, key: str) -> str | None:
    """The run that built the local entry of ``key`` (its provenance), or None."""
    from ..cache.local import LocalHit

    local = rt.dispatcher.local
    remembered = local.recall(key, local.change_token())
    if remembered is not None:
        entry = remembered.entry
    else:
        hit = local.lookup(key)
        if not isinstance(hit, LocalHit):
            return None
        entry = hit.entry
    run_id = entry.provenance.get("run_id")
    return run_id if isinstance(run_id, str) else None
