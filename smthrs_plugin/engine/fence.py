"""Owner identity and the fence every durable write of an owned run passes.

Invariants:

- An :class:`OwnerId` is one process *incarnation*: ``(host_id, pid, nonce)`` with a fresh uuid4 nonce minted
  once per process (:func:`current_owner`; a forked child mints its own). A restarted process that reuses a pid
  still has a different nonce, so it never inherits the runs of its predecessor.
- :func:`assert_owner` runs INSIDE the caller's write transaction and refuses (``FenceLost``) unless the run row
  is ``running`` and owned by exactly this incarnation. Because writes are serialized (SQLite write lock,
  PostgreSQL SERIALIZABLE with whole-transaction retry), a steal that commits first makes every later write of
  the old owner fail, and a steal that commits later sees the old owner's write as already done. A zombie
  (SIGSTOPped, partitioned) owner is therefore harmless: the row it writes to refuses it.
- Terminal transitions pass ``terminal=True``, which also refuses when a cancellation was requested
  (``FenceLost(cancel_requested)``); ``RunStore.finish`` instead turns that case into an explicit
  ``Cancelled`` outcome (see runs.py).

Prior art: Temporal's shard ownership fencing (range id checked in the same transaction), Kleppmann's fencing
tokens.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import FenceLost, StoreError
from ..settings import Settings, load_settings
from ..stores.database import Database
from ..stores.schema import meta, runs

__all__ = [
    "OwnerId",
    "current_owner",
    "assert_owner",
    "update_run",
    "bump_run",
    "BUMP_REVISION_CTE",
    "FenceRow",
    "CLEAR_OWNER",
    "CLEAR_CLAIM",
    "CLEAR_WAIT",
]

#: Column values that clear a run row's owner, pending claim and waiting payload.
CLEAR_OWNER: dict[str, Any] = {
    "owner_host": None,
    "owner_pid": None,
    "owner_nonce": None,
    "owner_proc_start": None,
}
CLEAR_CLAIM: dict[str, Any] = {
    "claim_host": None,
    "claim_pid": None,
    "claim_nonce": None,
    "claim_token": None,
    "claimed_at_ms": None,
}
CLEAR_WAIT: dict[str, Any] = {"waiting_reason": None, "wake_at_ms": None, "wait_token_digest": None}


@dataclass(frozen=True)
class OwnerId:
    """One process incarnation that may own runs."""

    host_id: str
    pid: int
    nonce: str

    def to_json(self) -> dict[str, Any]:
        return {"host_id": self.host_id, "pid": self.pid, "nonce": self.nonce}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OwnerId:
        return cls(str(data["host_id"]), int(data["pid"]), str(data["nonce"]))

    def __str__(self) -> str:
        return f"{self.host_id}/{self.pid}/{self.nonce}"


_lock = threading.Lock()
_current: dict[tuple[int, str], OwnerId] = {}


def current_owner(settings: Settings | None = None) -> OwnerId:
    """This process incarnation's owner id (host id from settings: ``SMTHRS_HOST_ID``, default the hostname).

    Minted once per (process, host id); a forked child gets a new one because its pid differs."""
    host_id = (settings or load_settings()).host_id
    k = (os.getpid(), host_id)
    with _lock:
        owner = _current.get(k)
        if owner is None:
            owner = _current[k] = OwnerId(host_id, os.getpid(), str(uuid.uuid4()))
        return owner


_FENCE_ROW = sa.select(
    runs.c.status,
    runs.c.owner_host,
    runs.c.owner_pid,
    runs.c.owner_nonce,
    runs.c.cancel_requested_at_ms,
    runs.c.revision,
).where(runs.c.run_id == sa.bindparam("b_run_id"))


# SET columns come from the execution parameters: one cached compiled form per column set, no expression
# building per call (the hot transitions run thousands of times a second).
_UPDATE_RUN = sa.update(runs).where(runs.c.run_id == sa.bindparam("b_run_id"))


#: ``WITH rev AS (UPDATE meta SET revision = revision + 1 RETURNING revision)`` (PostgreSQL statements).
BUMP_REVISION_CTE = (
    sa.update(meta)
    .where(meta.c.id == 1)
    .values(revision=meta.c.revision + 1)
    .returning(meta.c.revision)
    .cte("rev")
)
# PostgreSQL: the global revision bump rides in a data-modifying CTE of the row update (one round trip).
_UPDATE_RUN_BUMP_PG = (
    sa.update(runs)
    .where(runs.c.run_id == sa.bindparam("b_run_id"))
    .values(revision=sa.select(BUMP_REVISION_CTE.c.revision).scalar_subquery())
    .returning(runs.c.revision)
)


def update_run(conn: Connection, run_id: str, values: dict[str, Any]) -> int:
    """``UPDATE runs SET <values> WHERE run_id = :run_id`` on ``conn``; returns the matched row count."""
    return int(conn.execute(_UPDATE_RUN, {"b_run_id": run_id, **values}).rowcount)


_OWNED = sa.and_(
    runs.c.status == "running",
    runs.c.owner_host == sa.bindparam("b_host"),
    runs.c.owner_pid == sa.bindparam("b_pid"),
    runs.c.owner_nonce == sa.bindparam("b_nonce"),
)
_UPDATE_OWNED_RUN = _UPDATE_RUN.where(_OWNED)
_UPDATE_OWNED_RUN_BUMP_PG = _UPDATE_RUN_BUMP_PG.where(_OWNED)


def bump_run(
    conn: Connection, db: Database, run_id: str, values: dict[str, Any], *, owner: OwnerId | None = None
) -> int:
    """Update run ``run_id`` with ``values`` and a new global revision (same transaction); return the revision.

    With ``owner``, the update is FENCED in its own WHERE clause (running and owned by ``owner``), which saves
    the separate fence read; a miss is diagnosed by :func:`assert_owner` and raises ``FenceLost``."""
    params: dict[str, Any] = {"b_run_id": run_id, **values}
    if owner is not None:
        params.update(b_host=owner.host_id, b_pid=owner.pid, b_nonce=owner.nonce)
    rev: Any
    if db.dialect == "postgresql":
        rev = conn.execute(_UPDATE_OWNED_RUN_BUMP_PG if owner else _UPDATE_RUN_BUMP_PG, params).scalar()
    else:
        rev = db.next_revision(conn)
        if not conn.execute(
            _UPDATE_OWNED_RUN if owner else _UPDATE_RUN, {**params, "revision": rev}
        ).rowcount:
            rev = None
    if rev is None:
        if owner is not None:
            assert_owner(conn, run_id, owner)  # raises FenceLost saying who holds the run now
        raise StoreError("store_failed", f"run {run_id!r} vanished inside its own write transaction")
    return int(rev)


@dataclass(frozen=True)
class FenceRow:
    """What the fence read from the run row (so the caller need not read it again)."""

    run_id: str
    status: str
    cancel_requested_at_ms: int | None
    revision: int


def assert_owner(conn: Connection, run_id: str, owner: OwnerId, *, terminal: bool = False) -> FenceRow:
    """Refuse (``FenceLost``) unless ``run_id`` is running and owned by ``owner``; call inside the write.

    With ``terminal=True`` also refuse when a cancellation was requested (code ``cancel_requested``)."""
    row = conn.execute(_FENCE_ROW, {"b_run_id": run_id}).first()
    if row is None:
        raise FenceLost(
            "fence_lost",
            f"run {run_id!r} no longer exists, so {owner} cannot write to it; stop working on this run",
            run_id=run_id,
            owner=str(owner),
        )
    holder = (row.owner_host, row.owner_pid, row.owner_nonce)
    if row.status != "running" or holder != (owner.host_id, owner.pid, owner.nonce):
        now_held = (
            "nobody" if row.owner_nonce is None else f"{row.owner_host}/{row.owner_pid}/{row.owner_nonce}"
        )
        raise FenceLost(
            "fence_lost",
            f"{owner} no longer owns run {run_id!r} (status {row.status}, owner {now_held}); another process took "
            "it over or recovery fenced it: stop working on this run and never retry the write under this owner",
            run_id=run_id,
            owner=str(owner),
            status=row.status,
        )
    if terminal and row.cancel_requested_at_ms is not None:
        raise FenceLost(
            "cancel_requested",
            f"run {run_id!r} had a cancellation requested at {row.cancel_requested_at_ms} ms; settle it as "
            "cancelled instead of completing it",
            run_id=run_id,
            cancel_requested_at_ms=int(row.cancel_requested_at_ms),
        )
    return FenceRow(
        run_id,
        row.status,
        None if row.cancel_requested_at_ms is None else int(row.cancel_requested_at_ms),
        int(row.revision),
    )
