"""Coherent execution snapshots: what the engine's run rows say about a batch of run ids, at one revision.

Invariants:

- **One read transaction.** :func:`read` and :func:`related` run every statement of a call (source identity,
  revision watermark, rows, parent edges, tombstones: the runs and run-DAG owners' ``*_in`` reads) in ONE
  :meth:`Database.read` transaction: a deferred
  ``BEGIN`` on SQLite (WAL: the snapshot is fixed at the first read and a writer may commit meanwhile) and a
  ``REPEATABLE READ`` transaction on PostgreSQL (one snapshot for the whole transaction). Every field of a batch
  therefore describes the same database state, and ``batch.revision`` is the watermark of that state.
- **Request order, duplicates kept, at most 200 ids**; more is refused (``InvalidInput``) before anything is read.
- **Absence is explicit.** :class:`Missing` ``deleted=True`` means a tombstone is kept for the id (its revision is
  the deletion's); ``deleted=False`` means no row and no deletion was ever observed (its revision is the batch
  watermark, so a later creation is strictly newer). Neither is a lifecycle status.
- **Effective parent** = ``parent_run_id`` when set, else the durable spawn edge with the lowest ``seq`` (ties by
  parent id). An old root with no lineage columns is round 0 of its own lineage.
- **Fail closed.** A stored row that does not decode raises ``StoreError(decode_failed)`` naming the run (a point
  read must not report "missing" for a run whose effects may have happened).
- :func:`is_newer` is the one ordering rule projections use: revisions are global per database, so a delayed
  older observation never overwrites a newer one.

Prior art: the reference's ``ExecutionSnapshot``; Kubernetes' resourceVersion comparisons.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from sqlalchemy.engine import Connection

from ..errors import ControlError, InvalidInput
from ..records.run_dag import child_keys_in, first_parents_in
from ..records.runs import RunRecord, records_in, round_keys_in, tombstone_revisions_in, watermark_in
from ..stores.database import Database
from ._cursor import check_limit, check_text, decode_cursor, encode_cursor

__all__ = [
    "Observed",
    "Missing",
    "Observation",
    "Wait",
    "Cancellation",
    "Acknowledgement",
    "SnapshotBatch",
    "RelatedPage",
    "read",
    "related",
    "is_newer",
    "MAX_BATCH",
    "MAX_RELATED_LIMIT",
]

MAX_BATCH = 200
MAX_RELATED_LIMIT = 200

#: Durable waiting reasons → the structured wait kind (unknown plugin reasons stay ``other``: never approval).
_WAIT_KINDS = {
    "timer": "timer",
    "event": "signal",
    "signal": "signal",
    "approval": "approval",
    "waiting-approval": "approval",
    "quota": "quota",
    "human": "human",
}


@dataclass(frozen=True)
class Wait:
    """Why a run waits: ``kind`` (timer|signal|approval|quota|human|other), the durable ``reason``, its deadline,
    and the SHA-256 of the wake token (the token itself resolves the wait, so it is never exposed)."""

    kind: str
    reason: str
    wake_at_ms: int | None
    token_digest: str | None


@dataclass(frozen=True)
class Acknowledgement:
    """The first owner incarnation that observed a cancellation request, and when."""

    host_id: str
    pid: int
    nonce: str
    observed_at_ms: int


@dataclass(frozen=True)
class Cancellation:
    """Cancellation intent (``requested_at_ms``) and the owner's acknowledgement, each None when absent.

    An acknowledgement means the driver observed the intent; terminality comes from ``status`` alone."""

    requested_at_ms: int | None
    acknowledgement: Acknowledgement | None


@dataclass(frozen=True)
class Observed:
    """One run row as observed at ``revision`` (the row's own revision, not the batch watermark)."""

    run_id: str
    revision: int
    status: str
    flow: str
    created_at_ms: int
    started_at_ms: int | None
    finished_at_ms: int | None
    updated_at_ms: int
    parent_run_id: str | None
    lineage_id: str
    round_ordinal: int
    wait: Wait | None
    cancellation: Cancellation
    tag: Literal["observed"] = "observed"

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly view (CLI ``--json``)."""
        ack = self.cancellation.acknowledgement
        return {
            "tag": self.tag,
            "run_id": self.run_id,
            "revision": self.revision,
            "status": self.status,
            "flow": self.flow,
            "created_at_ms": self.created_at_ms,
            "started_at_ms": self.started_at_ms,
            "finished_at_ms": self.finished_at_ms,
            "updated_at_ms": self.updated_at_ms,
            "parent_run_id": self.parent_run_id,
            "lineage_id": self.lineage_id,
            "round_ordinal": self.round_ordinal,
            "wait": None if self.wait is None else vars(self.wait).copy(),
            "cancellation": {
                "requested_at_ms": self.cancellation.requested_at_ms,
                "acknowledgement": None if ack is None else vars(ack).copy(),
            },
        }


@dataclass(frozen=True)
class Missing:
    """No run row for ``run_id``. ``deleted``: a tombstone is kept (``revision`` is the deletion's); otherwise
    ``revision`` is the watermark of the read that found nothing."""

    run_id: str
    deleted: bool
    revision: int
    tag: Literal["missing"] = "missing"

    def to_json(self) -> dict[str, Any]:
        return {"tag": self.tag, "run_id": self.run_id, "deleted": self.deleted, "revision": self.revision}


Observation = Observed | Missing


@dataclass(frozen=True)
class SnapshotBatch:
    """Observations in request order, read in one transaction of database ``source`` at watermark ``revision``."""

    source: str
    revision: int
    items: tuple[Observation, ...]


@dataclass(frozen=True)
class RelatedPage:
    """The ``anchor``'s observation, a page of related observations, and the continuation cursor (None at the
    end), all from one read transaction."""

    anchor: Observation
    kind: str
    items: tuple[Observation, ...]
    cursor: str | None
    source: str
    revision: int


class _Revisioned(Protocol):
    @property
    def revision(self) -> int: ...


def is_newer(incoming: _Revisioned, stored: _Revisioned | None) -> bool:
    """Whether a projection should apply ``incoming`` over ``stored`` (any pair of observations, feed changes or
    batches of ONE source). Both carrying a ``source`` that differ is refused: revisions of two databases do not
    compare (``source_changed``; rebuild the projection)."""
    if stored is None:
        return True
    a, b = getattr(incoming, "source", None), getattr(stored, "source", None)
    if a is not None and b is not None and a != b:
        raise ControlError(
            "source_changed",
            f"cannot order revisions of two databases ({a!r} vs {b!r}); rebuild the projection from the new source",
        )
    return incoming.revision > stored.revision


# ---------------------------------------------------------------------------------------------------------------
# Reading


def read(db: Database, ids: Sequence[str]) -> SnapshotBatch:
    """Observe up to 200 run ids in one read transaction (request order, duplicates kept; see module invariants).

    An empty batch still reads the source and the watermark."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidInput("invalid_input", "ids must be a list of run ids", bound="ids")
    if len(ids) > MAX_BATCH:
        raise InvalidInput(
            "invalid_input",
            f"a snapshot reads at most {MAX_BATCH} ids at once, got {len(ids)}; split the request",
            bound="ids",
        )
    checked = [check_text("run id", i, error="invalid_input") for i in ids]

    def fn(conn: Connection) -> SnapshotBatch:
        source, watermark = watermark_of(conn)
        found = observe_ids(conn, checked, watermark)
        return SnapshotBatch(source, watermark, tuple(found[i] for i in checked))

    return db.read(fn)


def related(
    db: Database,
    run_id: str,
    kind: str = "children",
    *,
    cursor: str | None = None,
    limit: int = 100,
) -> RelatedPage:
    """Direct children (durable spawn edges, in ``(seq, child_id)`` order) or the rounds of the anchor's lineage
    (``(round_ordinal, run_id)`` order), a page at a time; the cursor is bound to source, anchor and kind."""
    check_text("run id", run_id, error="invalid_input")
    if kind not in ("children", "rounds"):
        raise ControlError(
            "invalid_options", f"kind must be 'children' or 'rounds', got {kind!r}", option="kind"
        )
    check_limit(limit, maximum=MAX_RELATED_LIMIT)

    def fn(conn: Connection) -> RelatedPage:
        source, watermark = watermark_of(conn)
        after = _related_after(cursor, source, run_id, kind)
        anchor = observe_ids(conn, [run_id], watermark)[run_id]
        if kind == "children":
            keys = child_keys_in(conn, run_id, after, limit + 1)
        else:
            lineage = anchor.lineage_id if isinstance(anchor, Observed) else run_id
            keys = round_keys_in(conn, lineage, after, limit + 1)
        page, more = keys[:limit], len(keys) > limit
        found = observe_ids(conn, [k[1] for k in page], watermark)
        nxt = None
        if more and page:
            nxt = encode_cursor("related", source, {"anchor": run_id, "rel": kind, "key": list(page[-1])})
        return RelatedPage(anchor, kind, tuple(found[k[1]] for k in page), nxt, source, watermark)

    return db.read(fn)


def _related_after(cursor: str | None, source: str, run_id: str, kind: str) -> tuple[int, str] | None:
    if cursor is None:
        return None
    body = decode_cursor(cursor, kind="related", source=source)
    key = body.get("key")
    if body.get("anchor") != run_id or body.get("rel") != kind:
        raise ControlError(
            "invalid_cursor",
            f"this cursor continues {body.get('rel')!r} of {body.get('anchor')!r}, not {kind!r} of {run_id!r}; "
            "start again without a cursor",
        )
    if not (isinstance(key, list) and len(key) == 2 and type(key[0]) is int and isinstance(key[1], str)):
        raise ControlError(
            "invalid_cursor", "this cursor has an unknown layout; start again without a cursor"
        )
    return (key[0], key[1])


# ---------------------------------------------------------------------------------------------------------------
# Shared with the catalog and the feed (same floor): observations of the runs owner's records, inside the caller's
# read transaction.


def watermark_of(conn: Connection) -> tuple[str, int]:
    """(source identity, global revision) as seen by ``conn``'s transaction."""
    return watermark_in(conn)


def observe_ids(conn: Connection, ids: Iterable[str], watermark: int) -> dict[str, Observation]:
    """Observation of every distinct id, read on ``conn``."""
    unique = list(dict.fromkeys(ids))
    records = records_in(conn, unique)
    out: dict[str, Observation] = dict(
        zip((r.run_id for r in records), observe_records(conn, records), strict=True)
    )
    absent = [i for i in unique if i not in out]
    tombs = tombstone_revisions_in(conn, absent)
    for rid in absent:
        out[rid] = Missing(rid, True, tombs[rid]) if rid in tombs else Missing(rid, False, watermark)
    return out


def observe_records(conn: Connection, records: Sequence[RunRecord]) -> list[Observed]:
    """Observations of decoded runs, resolving effective parents on ``conn``; order kept."""
    orphans = [rec.run_id for rec in records if rec.parent_run_id is None]
    first_edge = first_parents_in(conn, orphans)
    return [_observed(rec, rec.parent_run_id or first_edge.get(rec.run_id)) for rec in records]


def _observed(rec: RunRecord, parent: str | None) -> Observed:
    wait = None
    if rec.waiting is not None:
        w = rec.waiting
        wait = Wait(_WAIT_KINDS.get(w.reason, "other"), w.reason, w.wake_at_ms, w.token_digest)
    ack = None
    if rec.cancel_ack is not None:
        o = rec.cancel_ack.owner
        ack = Acknowledgement(o.host_id, o.pid, o.nonce, rec.cancel_ack.at_ms)
    return Observed(
        run_id=rec.run_id,
        revision=rec.revision,
        status=rec.status,
        flow=rec.flow,
        created_at_ms=rec.created_at_ms,
        started_at_ms=rec.started_at_ms,
        finished_at_ms=rec.finished_at_ms,
        updated_at_ms=rec.updated_at_ms,
        parent_run_id=parent,
        lineage_id=rec.lineage_id if rec.lineage_id is not None else rec.run_id,
        round_ordinal=rec.round_ordinal if rec.lineage_id is not None else 0,
        wait=wait,
        cancellation=Cancellation(rec.cancel_requested_at_ms, ack),
    )
