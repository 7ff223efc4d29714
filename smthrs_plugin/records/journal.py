"""The journal's owner: an append-only, per-partition sequence of typed records, and ALL of its SQL.

Invariants:

- **One owner.** Every statement on ``journal_events`` is in this module, and :func:`decode_payload` is the only
  decoder of a stored entry: readers (the run views, ``observe.watch``) get :class:`JournalEvent` values from
  here, so a corrupt entry is refused the same way wherever it is read.

- **Partitions.** One per run (the run id) and one per plan (``plan:<plan_id>``). Sequence numbers are per
  partition, start at 0 and are allocated inside the writer's transaction (``max(seq) + 1``), so the order of a
  partition is its commit order. Gaps are allowed (readers must not assume contiguity).
- **Idempotent appends.** A record may carry an address ``(source_id, source_seq)``; the pair is unique within
  its partition. An exact retry (same type and canonical payload) answers :class:`Duplicate` with the first
  record's sequence; a different record at the same address is refused with ``idempotency_conflict``. The
  ownership arbiter uses this to journal "steal refused" once per (run, owner, lease, evidence).
- **Same transaction as the state change.** :meth:`Journal.append` called inside an open
  :meth:`Database.write` joins that transaction (as a savepoint) and :meth:`Journal.append_in` writes on the
  caller's connection: a run transition and its record commit together or not at all.
- **Publication after commit.** In-process subscribers are notified only after the OUTERMOST commit (never on
  rollback), in commit order per thread. Cross-process delivery is store-driven: followers read by sequence.

Prior art: Kafka's idempotent producer (producer id + sequence), event-sourcing outboxes written in the state
transaction.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import canonical_bytes
from ..errors import CanonicalError, StoreError
from ..stores.database import Database
from ..stores.schema import journal_events
from ..stores.statements import DriverStatement

__all__ = [
    "Journal",
    "PendingRecord",
    "record_cte",
    "JournalEvent",
    "Appended",
    "Duplicate",
    "AppendOutcome",
    "Subscription",
    "plan_partition",
    "MAX_READ_LIMIT",
    "decode_payload",
    "high_water",
    "read_page",
    "partition_page",
    "latest_payload_json_in",
    "addressed_seq",
]

# The logger keeps the name operators configure (it predates the move to records/).
log = logging.getLogger(__name__)

MAX_READ_LIMIT = 1000
_MAX_TEXT = 1024


def plan_partition(plan_id: str) -> str:
    """The journal partition of a plan."""
    return f"plan:{plan_id}"


@dataclass(frozen=True)
class JournalEvent:
    """One committed journal record."""

    partition: str
    seq: int
    type: str
    payload: Any
    created_at_ms: int
    source_id: str | None = None
    source_seq: int | None = None


@dataclass(frozen=True)
class Appended:
    """A new record was written at ``event.seq``."""

    event: JournalEvent

    @property
    def seq(self) -> int:
        return self.event.seq


@dataclass(frozen=True)
class Duplicate:
    """An exact retry: the record already exists at ``seq``; nothing was written."""

    seq: int
    event: JournalEvent


AppendOutcome = Appended | Duplicate


class Subscription:
    """Handle of an in-process subscriber; :meth:`close` stops delivery."""

    def __init__(
        self,
        hub: _Hub,
        fn: Callable[[JournalEvent], None],
        partition: str | None,
        types: frozenset[str] | None = None,
    ) -> None:
        self._hub, self.fn, self.partition, self.types = hub, fn, partition, types

    def wants(self, partition: str, type: str) -> bool:
        """Whether a record of ``type`` in ``partition`` is delivered to this subscriber."""
        return (self.partition is None or self.partition == partition) and (
            self.types is None or type in self.types
        )

    def close(self) -> None:
        self._hub.remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Hub:
    """Subscribers of one database in this process (shared by every Journal over the same URL)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: tuple[Subscription, ...] = ()

    def add(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = (*self._subs, sub)

    def remove(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    def wanted(self, partition: str, type: str) -> bool:
        """Whether a subscriber wants records of ``type`` in ``partition`` now."""
        return any(sub.wants(partition, type) for sub in self._subs)

    def publish_text(
        self, partition: str, seq: int, type: str, payload_json: str, created_at_ms: int
    ) -> None:
        """:meth:`publish` a record committed as text, decoded only when a subscriber wants it (most records of a
        busy scheduler have nobody to tell, and decoding each was a measurable share of its work)."""
        for sub in self._subs:
            if sub.wants(partition, type):
                self.publish(JournalEvent(partition, seq, type, json.loads(payload_json), created_at_ms))
                return

    def publish(self, event: JournalEvent) -> None:
        for sub in self._subs:
            if sub.wants(event.partition, event.type):
                try:
                    sub.fn(event)
                except Exception:
                    # The record is committed; one failing subscriber must not starve the others.
                    log.exception("journal subscriber %r failed on %s#%d", sub.fn, event.partition, event.seq)


_J = journal_events.c
_BY_ADDRESS = DriverStatement(
    sa.select(_J.seq, _J.type, _J.payload_json, _J.created_at_ms).where(
        _J.partition == sa.bindparam("b_partition"),
        _J.source_id == sa.bindparam("b_source_id"),
        _J.source_seq == sa.bindparam("b_source_seq"),
    )
)
# The next sequence is allocated and the record inserted in ONE statement (one round trip), inside the
# writer's serialized transaction: max(seq) + 1 of the partition, 0 for a new one.
_APPEND = sa.insert(journal_events).from_select(
    ["partition", "seq", "source_id", "source_seq", "type", "payload_json", "created_at_ms"],
    sa.select(
        sa.bindparam("b_partition", type_=sa.Text),
        sa.func.coalesce(sa.func.max(_J.seq), -1) + 1,
        sa.bindparam("b_source_id", type_=sa.Text),
        sa.bindparam("b_source_seq", type_=sa.BigInteger),
        sa.bindparam("b_type", type_=sa.Text),
        sa.bindparam("b_payload", type_=sa.Text),
        sa.bindparam("b_now", type_=sa.BigInteger),
    ).where(_J.partition == sa.bindparam("b_partition", type_=sa.Text)),
)
_INSERT_NEXT = DriverStatement(_APPEND.returning(_J.seq))
#: The same, once per record of a batch (``executemany``: each row sees the rows inserted before it).
_APPEND_NEXT = DriverStatement(_APPEND)


@dataclass(frozen=True)
class PendingRecord:
    """A validated record (no idempotency address) to be inserted by a statement built with :func:`record_cte`."""

    partition: str
    type: str
    payload_json: str
    created_at_ms: int

    def params(self) -> dict[str, Any]:
        """The bind parameters :func:`record_cte` reads."""
        return {
            "j_partition": self.partition,
            "j_type": self.type,
            "j_payload": self.payload_json,
            "j_now": self.created_at_ms,
        }


def record_cte(source: sa.CTE, name: str = "journaled") -> sa.CTE:
    """``INSERT INTO journal_events ... RETURNING seq`` as a data-modifying CTE (PostgreSQL) that appends the
    :class:`PendingRecord` in the ``j_*`` parameters once per row of ``source`` (a one-row CTE of the state
    change it records): the record commits with the change in one statement, or neither exists. The sequence
    is allocated as by :meth:`Journal.append` (``max(seq) + 1`` in the writer's serializable transaction)."""
    partition = sa.bindparam("j_partition", type_=sa.Text)
    head = sa.select(sa.func.coalesce(sa.func.max(_J.seq), -1) + 1).where(_J.partition == partition)
    return (
        sa.insert(journal_events)
        .from_select(
            ["partition", "seq", "source_id", "source_seq", "type", "payload_json", "created_at_ms"],
            sa.select(
                partition,
                head.scalar_subquery(),
                sa.null(),
                sa.null(),
                sa.bindparam("j_type", type_=sa.Text),
                sa.bindparam("j_payload", type_=sa.Text),
                sa.bindparam("j_now", type_=sa.BigInteger),
            ).select_from(source),
        )
        .returning(_J.seq)
        .cte(name)
    )


#: Insert one record at a sequence allocated by :class:`_Appends` (one statement per partition and flush).
_INSERT_AT = DriverStatement(
    sa.insert(journal_events).values(
        partition=sa.bindparam("b_partition", type_=sa.Text),
        seq=sa.bindparam("b_seq", type_=sa.BigInteger),
        source_id=None,
        source_seq=None,
        type=sa.bindparam("b_type", type_=sa.Text),
        payload_json=sa.bindparam("b_payload", type_=sa.Text),
        created_at_ms=sa.bindparam("b_now", type_=sa.BigInteger),
    )
)
_NEXT_SEQ = DriverStatement(
    sa.select(sa.func.coalesce(sa.func.max(_J.seq), -1) + 1).where(
        _J.partition == sa.bindparam("b_partition", type_=sa.Text)
    )
)


class _Appends:
    """The records :meth:`Journal.append_canonical_in` deferred in one transaction (:meth:`Database.deferred`),
    in append order, inserted by one statement (``executemany``), so each gets exactly the sequence it would have
    got appended alone (``max(seq) + 1`` in the writer's serialized transaction). The sequences are read back
    only when a subscriber of this process wants one of the records (one read per partition); the subscribers
    asked are the ones subscribed when the transaction writes them, just before its commit."""

    __slots__ = ("db", "records")

    def __init__(self, db: Database) -> None:
        self.db = db
        self.records: list[tuple[_Hub, str, str, str, int]] = []

    def flush(self, conn: Connection) -> None:
        records, self.records = self.records, []
        if not records:
            return
        if not any(hub.wanted(partition, type) for hub, partition, type, _, _ in records):
            _APPEND_NEXT.many(
                conn,
                [
                    {
                        "b_partition": p,
                        "b_source_id": None,
                        "b_source_seq": None,
                        "b_type": t,
                        "b_payload": j,
                        "b_now": n,
                    }
                    for _, p, t, j, n in records
                ],
            )
            return
        heads: dict[str, int] = {}
        rows: list[dict[str, Any]] = []
        published = []
        for hub, partition, type, payload_json, now in records:
            seq = heads.get(partition)
            if seq is None:
                head = _NEXT_SEQ.first(conn, {"b_partition": partition})
                assert head is not None  # an aggregate always yields one row
                seq = int(head[0])
            heads[partition] = seq + 1
            rows.append(
                {
                    "b_partition": partition,
                    "b_seq": seq,
                    "b_type": type,
                    "b_payload": payload_json,
                    "b_now": now,
                }
            )
            published.append(partial(hub.publish_text, partition, seq, type, payload_json, now))
        _INSERT_AT.many(conn, rows)
        for callback in published:
            self.db.on_commit(callback)


_HUBS: dict[str, _Hub] = {}
_HUBS_LOCK = threading.Lock()


def _hub_for(url: str) -> _Hub:
    with _HUBS_LOCK:
        hub = _HUBS.get(url)
        if hub is None:
            hub = _HUBS[url] = _Hub()
        return hub


class Journal:
    """Append and read journal records of one database."""

    def __init__(self, db: Database, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.clock = clock
        self._hub = _hub_for(db.url)

    def append(
        self,
        partition: str,
        type: str,
        payload: Any,
        *,
        source_id: str | None = None,
        source_seq: int | None = None,
    ) -> AppendOutcome:
        """Append one record (joining the caller's open write transaction, if any). See module invariants."""
        payload_json = _validate(partition, type, payload, source_id, source_seq)
        return self.db.write(
            lambda conn: self._append(conn, partition, type, payload_json, source_id, source_seq)
        )

    def encode(self, partition: str, type: str, payload: Any) -> PendingRecord:
        """Validate and encode a record for a statement that inserts it itself (:func:`record_cte`); refused
        exactly as :meth:`append` refuses it, before anything is written."""
        return PendingRecord(
            partition, type, _validate(partition, type, payload, None, None), self.clock.now_ms()
        )

    def written(self, record: PendingRecord, seq: int) -> Appended:
        """The outcome of a :class:`PendingRecord` its statement inserted at ``seq``; subscribers are notified
        after the commit (at once when the statement committed alone, else when the open write commits)."""
        event = JournalEvent(
            record.partition, seq, record.type, json.loads(record.payload_json), record.created_at_ms
        )
        if self.db.in_write():
            self.db.on_commit(lambda: self._hub.publish(event))
        else:
            self._hub.publish(event)
        return Appended(event)

    def append_in(
        self,
        conn: Connection,
        partition: str,
        type: str,
        payload: Any,
        *,
        source_id: str | None = None,
        source_seq: int | None = None,
    ) -> AppendOutcome:
        """Append on ``conn``, which must be the connection of an open :meth:`Database.write` of this database."""
        if not self.db.in_write():
            raise StoreError(
                "invalid_argument",
                "append_in() needs the connection of an open Database.write on this thread",
            )
        payload_json = _validate(partition, type, payload, source_id, source_seq)
        return self._append(conn, partition, type, payload_json, source_id, source_seq)

    def append_canonical_in(self, conn: Connection, partition: str, type: str, payload_json: str) -> None:
        """Append a record whose payload the caller already wrote as canonical JSON text, on ``conn`` (the
        connection of an open :meth:`Database.write` of this database on this thread).

        For hot writers whose payloads are composed from parts validated once where they entered (the scheduler:
        ids checked when the plan compiled, keys it computed, ints): ``payload_json`` MUST equal
        ``canonical_bytes(payload).decode()`` of the plain JSON payload it stands for, which is what readers
        decode. The partition and type are checked as :meth:`append` checks them; the payload is not walked
        again. No idempotency address; subscribers are notified after the outermost commit, as for every
        append. Where the transaction allows deferred writes (:meth:`Database.allow_deferred`) the record is
        inserted with the others of its transaction, one statement per partition, before any other statement on
        the journal (sequences are allocated then, in append order)."""
        if _text_invalid(partition) or _text_invalid(type):
            _validate(partition, type, None, None, None)  # raises the refusal append() gives
        now = self.clock.now_ms()
        db = self.db
        appends = db.deferred(_Appends, lambda: _Appends(db))
        if appends is not None:
            appends.records.append((self._hub, partition, type, payload_json, now))
            return
        inserted = _INSERT_NEXT.first(
            conn,
            {
                "b_partition": partition,
                "b_source_id": None,
                "b_source_seq": None,
                "b_type": type,
                "b_payload": payload_json,
                "b_now": now,
            },
        )
        assert inserted is not None  # INSERT ... SELECT of an aggregate always yields one row
        self.db.on_commit(
            partial(self._hub.publish_text, partition, int(inserted.seq), type, payload_json, now)
        )

    def _append(
        self,
        conn: Connection,
        partition: str,
        type: str,
        payload_json: str,
        source_id: str | None,
        source_seq: int | None,
    ) -> AppendOutcome:
        self.db.flush_deferred()  # records appended before this one take their sequences first
        if source_id is not None:
            row = _BY_ADDRESS.first(
                conn, {"b_partition": partition, "b_source_id": source_id, "b_source_seq": source_seq}
            )
            if row is not None:
                if row.type == type and row.payload_json == payload_json:
                    existing = JournalEvent(
                        partition, int(row.seq), type, json.loads(payload_json), int(row.created_at_ms),
                        source_id, source_seq,
                    )  # fmt: skip
                    return Duplicate(int(row.seq), existing)
                raise StoreError(
                    "idempotency_conflict",
                    f"journal address ({partition!r}, {source_id!r}, {source_seq}) already holds a different "
                    f"record ({row.type!r}); a retry must append exactly the same record, a new record needs a "
                    "new source sequence",
                    partition=partition,
                    source_id=source_id,
                    source_seq=source_seq,
                )
        now = self.clock.now_ms()
        inserted = _INSERT_NEXT.first(
            conn,
            {
                "b_partition": partition,
                "b_source_id": source_id,
                "b_source_seq": source_seq,
                "b_type": type,
                "b_payload": payload_json,
                "b_now": now,
            },
        )
        assert inserted is not None  # INSERT ... SELECT of an aggregate always yields one row
        seq = inserted.seq
        event = JournalEvent(partition, int(seq), type, json.loads(payload_json), now, source_id, source_seq)
        self.db.on_commit(lambda: self._hub.publish(event))
        return Appended(event)

    def read(self, partition: str, after_seq: int | None = None, limit: int = 100) -> list[JournalEvent]:
        """Records of ``partition`` with ``seq > after_seq`` (all when None), ascending, at most ``limit``."""
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_READ_LIMIT:
            raise StoreError(
                "invalid_argument", f"limit must be an int in 1..{MAX_READ_LIMIT}, got {limit!r}"
            )
        if after_seq is not None and (not isinstance(after_seq, int) or isinstance(after_seq, bool)):
            raise StoreError("invalid_argument", f"after_seq must be an int or None, got {after_seq!r}")
        self.db.flush_deferred()
        j = journal_events
        q = sa.select(j).where(j.c.partition == partition)
        if after_seq is not None:
            q = q.where(j.c.seq > after_seq)
        q = q.order_by(j.c.seq).limit(limit)
        rows = self.db.read(lambda c: c.execute(q).all())
        out: list[JournalEvent] = []
        for r in rows:
            out.append(
                JournalEvent(
                    r.partition, int(r.seq), r.type, decode_payload(partition, r.seq, r.payload_json),
                    int(r.created_at_ms), r.source_id, None if r.source_seq is None else int(r.source_seq),
                )
            )  # fmt: skip
        return out

    def high_water(self, partition: str) -> int | None:
        """The highest committed sequence of ``partition`` (None when empty)."""
        self.db.flush_deferred()
        j = journal_events
        return self.db.read(
            lambda c: c.execute(sa.select(sa.func.max(j.c.seq)).where(j.c.partition == partition)).scalar()
        )

    def subscribe(
        self,
        fn: Callable[[JournalEvent], None],
        *,
        partition: str | None = None,
        types: Iterable[str] | None = None,
    ) -> Subscription:
        """Call ``fn(event)`` for every record committed by this process (of ``partition`` when given, of one of
        ``types`` when given), after its transaction commits. Runs on the committing thread: keep ``fn`` short
        (hand off to a queue)."""
        sub = Subscription(self._hub, fn, partition, None if types is None else frozenset(types))
        self._hub.add(sub)
        return sub


def _text_invalid(value: Any) -> bool:
    """Whether ``value`` is NOT an acceptable partition or record type (a non-empty str of at most 1,024
    characters without NUL)."""
    return not isinstance(value, str) or not value or len(value) > _MAX_TEXT or "\x00" in value


def _validate(partition: Any, type: Any, payload: Any, source_id: Any, source_seq: Any) -> str:
    for name, value in (("partition", partition), ("type", type)):
        if _text_invalid(value):
            raise StoreError(
                "invalid_argument",
                f"journal {name} must be a non-empty string of at most {_MAX_TEXT} characters",
            )
    if (source_id is None) != (source_seq is None):
        raise StoreError("invalid_argument", "give both source_id and source_seq, or neither")
    if source_id is not None and (
        not isinstance(source_id, str) or not source_id or len(source_id) > _MAX_TEXT
    ):
        raise StoreError(
            "invalid_argument", f"source_id must be a non-empty string of at most {_MAX_TEXT} chars"
        )
    if source_seq is not None and (
        not isinstance(source_seq, int) or isinstance(source_seq, bool) or source_seq < 0
    ):
        raise StoreError("invalid_argument", f"source_seq must be a non-negative int, got {source_seq!r}")
    try:
        return canonical_bytes(payload).decode("utf-8")
    except CanonicalError as exc:
        raise StoreError(
            "invalid_argument", f"journal payload is not plain JSON data: {exc.message}", cause=exc
        ) from exc


def decode_payload(partition: str, seq: Any, payload_json: Any) -> Any:
    """The payload of stored entry ``partition#seq``; ``StoreError(decode_failed)`` when it is not JSON.

    A journal is an ordered log: a reader that skipped a record would silently reorder history, so a corrupt
    entry stops the read instead."""
    try:
        return json.loads(payload_json)
    except ValueError as exc:
        raise StoreError(
            "decode_failed",
            f"journal record {partition!r}#{seq} does not decode as JSON; the store is corrupt there",
            cause=exc,
        ) from exc


# -- paged reads for projections (each its own short read transaction: a live reader never holds a snapshot) --


def high_water(db: Database, partition: str) -> int | None:
    """The highest committed sequence of ``partition`` (None when empty), as an int."""
    value = db.read(
        lambda c: c.execute(sa.select(sa.func.max(_J.seq)).where(_J.partition == partition)).scalar()
    )
    return None if value is None else int(value)


def read_page(db: Database, partition: str, after: int, upto: int | None, limit: int) -> list[JournalEvent]:
    """Entries of ``partition`` with ``after < seq <= upto`` (no upper bound when None), ascending, at most
    ``limit``; decoded by :func:`decode_payload` (the idempotency address is not read)."""
    q = sa.select(_J.seq, _J.type, _J.payload_json, _J.created_at_ms).where(
        _J.partition == partition, _J.seq > after
    )
    if upto is not None:
        q = q.where(_J.seq <= upto)
    q = q.order_by(_J.seq).limit(limit)
    rows = db.read(lambda c: c.execute(q).all())
    return [
        JournalEvent(
            partition, int(r.seq), r.type, decode_payload(partition, int(r.seq), r.payload_json),
            int(r.created_at_ms),
        )
        for r in rows
    ]  # fmt: skip


# A loose index scan over the journal's primary key: each step is one seek ("the smallest partition after p"),
# so discovering k partitions costs k seeks whatever the size of each partition. Portable SQLite/PostgreSQL.
_LOOSE_SCAN = """
    WITH RECURSIVE parts(p, n) AS (
        SELECT (SELECT MIN("partition") FROM journal_events {first}), 1
        UNION ALL
        SELECT (SELECT MIN("partition") FROM journal_events WHERE "partition" > parts.p), parts.n + 1
        FROM parts WHERE parts.p IS NOT NULL AND parts.n < :n
    )
    SELECT p, (SELECT MAX(seq) FROM journal_events WHERE "partition" = parts.p) AS mark
    FROM parts WHERE p IS NOT NULL ORDER BY n
"""
_FIRST_PAGE = sa.text(_LOOSE_SCAN.format(first="")).bindparams(sa.bindparam("n", type_=sa.Integer))
_NEXT_PAGE = sa.text(_LOOSE_SCAN.format(first='WHERE "partition" > :after')).bindparams(
    sa.bindparam("after", type_=sa.Text), sa.bindparam("n", type_=sa.Integer)
)


def partition_page(db: Database, after: str | None, n: int) -> list[tuple[str, int]]:
    """Up to ``n`` partitions named after ``after`` (from the first when None), with their high-water marks."""
    if after is None:
        rows = db.read(lambda c: c.execute(_FIRST_PAGE, {"n": n}).all())
    else:
        rows = db.read(lambda c: c.execute(_NEXT_PAGE, {"after": after, "n": n}).all())
    return [(str(r.p), int(r.mark)) for r in rows if r.mark is not None]


def latest_payload_json_in(conn: Connection, partition: str, type: str) -> str | None:
    """The stored payload text of the newest ``type`` entry of ``partition`` on ``conn`` (None when there is none);
    left undecoded for an owner that refuses a corrupt one in its own terms (``waits``: the release cause)."""
    text = conn.execute(
        sa.select(_J.payload_json)
        .where(_J.partition == partition, _J.type == type)
        .order_by(_J.seq.desc())
        .limit(1)
    ).scalar()
    return None if text is None else str(text)


def addressed_seq(partition: Any, source_id: str, source_seq: int) -> Any:
    """A scalar subquery: the sequence of the entry of ``partition`` (a value or bind parameter) at the idempotency
    address ``(source_id, source_seq)``, NULL when there is none — for an owner that probes an address in a
    statement of its own (one round trip; ``records._control``: a run's ``control.run.accepted``)."""
    return (
        sa.select(_J.seq)
        .where(_J.partition == partition, _J.source_id == source_id, _J.source_seq == source_seq)
        .scalar_subquery()
    )
