"""SQLAlchemy Core tables of the durable store (one database: SQLite or PostgreSQL).

Invariants:

- This module describes the schema at the HEAD migration; the DDL itself lives in ``stores/migrations/versions``
  (alembic, applied at open). A test diffs a migrated database against :data:`metadata` (alembic
  ``compare_metadata``) on both backends, so the two cannot drift. To add a table: declare it here on
  :data:`metadata`, or in a concept's own table module under ``stores/`` that imports ``metadata`` from here and
  is registered in ``stores/__init__.py`` (so every import of the store sees the whole schema without an import
  circle); then add a NEW migration file whose ``down_revision`` is the current head (see
  ``stores/migrations/README``); never edit a shipped migration.
- JSON columns are TEXT holding canonical JSON written by the stores, and are decoded by the stores: a row
  that does not decode is skipped by list reads (with one warning naming its key) and fails point reads with
  ``decode_failed``; the database never silently "repairs" it.
- Times are epoch milliseconds (BIGINT). ``revision`` columns hold the global per-database revision of the
  transaction that last changed the row (``meta.revision`` is the counter).
- Status strings are not CHECK-constrained on purpose: an unknown value is data corruption the readers report,
  and a future status added by a newer migration must not make older rows unreadable.

Prior art: the reference ``@smthrs/engine-store`` tables.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)

__all__ = [
    "metadata",
    "meta",
    "runs",
    "run_tombstones",
    "run_parents",
    "journal_events",
    "attempts",
    "step_cache",
    "cache_revocations",
    "RUN_STATUSES",
    "TERMINAL_STATUSES",
    "ATTEMPT_STATES",
]

#: Deterministic constraint names, so migrations can refer to them on both backends.
metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

RUN_STATUSES = ("pending", "running", "suspended", "completed", "failed", "cancelled")
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
ATTEMPT_STATES = ("started", "completed", "failed")

#: One row (id = 1): the database's random durable identity and the global revision counter.
meta = Table(
    "meta",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("source_id", String(64), nullable=False),
    Column("revision", BigInteger, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
)

runs = Table(
    "runs",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("flow", Text, nullable=False),
    Column("status", Text, nullable=False),
    # The owner incarnation driving the run (all NULL unless running); every fenced write compares these.
    Column("owner_host", Text),
    Column("owner_pid", Integer),
    Column("owner_nonce", Text),
    # "<boot id>:<start ticks>" of the owner's pid when recorded by the owner itself: a same-host pid probe
    # compares it so that a recycled pid is not mistaken for the owner.
    Column("owner_proc_start", Text),
    Column("heartbeat_at_ms", BigInteger),
    # A pending claim (claim phase of claim → activate); cleared by activation and by recovery fencing.
    Column("claim_host", Text),
    Column("claim_pid", Integer),
    Column("claim_nonce", Text),
    Column("claim_token", Text),
    Column("claimed_at_ms", BigInteger),
    Column("parent_run_id", Text),
    Column("lineage_id", Text),
    Column("round_ordinal", Integer, nullable=False, server_default="0"),
    Column("cancel_requested_at_ms", BigInteger),
    Column("cancel_ack_host", Text),
    Column("cancel_ack_pid", Integer),
    Column("cancel_ack_nonce", Text),
    Column("cancel_ack_at_ms", BigInteger),
    Column("waiting_reason", Text),
    Column("wake_at_ms", BigInteger),
    Column("wait_token_digest", Text),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("started_at_ms", BigInteger),
    Column("finished_at_ms", BigInteger),
    Column("updated_at_ms", BigInteger, nullable=False),
    Column("revision", BigInteger, nullable=False),
    Column("result_json", Text),
    Column("error_json", Text),
    Index(None, "status", "heartbeat_at_ms"),
    Index(None, "created_at_ms", "run_id"),
    Index(None, "waiting_reason", "wake_at_ms"),
    Index(None, "revision"),
    Index(None, "parent_run_id"),
    Index(None, "lineage_id", "round_ordinal"),
)

#: One row per deleted run id, kept forever (a change-feed consumer must be able to learn of every deletion).
run_tombstones = Table(
    "run_tombstones",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("deleted_at_ms", BigInteger, nullable=False),
    Column("revision", BigInteger, nullable=False),
    Index(None, "revision"),
)

#: Run DAG edges (child → parent), first writer wins per pair; ``seq`` orders them (a global revision value).
#: No foreign keys: an edge may be recorded just before the child row it guards, in the same transaction.
#: A trigger (migration 0001) prunes a run's edges when its row is deleted.
run_parents = Table(
    "run_parents",
    metadata,
    Column("child_id", Text, nullable=False),
    Column("parent_id", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("child_id", "parent_id"),
    Index(None, "parent_id", "seq"),
)

journal_events = Table(
    "journal_events",
    metadata,
    Column("partition", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    # Idempotency address: an exact retry at (partition, source_id, source_seq) is a Duplicate.
    Column("source_id", Text),
    Column("source_seq", BigInteger),
    Column("type", Text, nullable=False),
    Column("payload_json", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("partition", "seq"),
    UniqueConstraint("partition", "source_id", "source_seq"),
)

#: Node attempts of a run: what a reclaiming owner replays as ``clean`` after a restart.
attempts = Table(
    "attempts",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    Column("key_digest", String(64), nullable=False),
    Column("key", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("state", Text, nullable=False),
    Column("node_id", Text),
    Column("owner_nonce", Text, nullable=False),
    Column("meta_json", Text),
    Column("result_json", Text),
    Column("error_json", Text),
    Column("started_at_ms", BigInteger, nullable=False),
    Column("finished_at_ms", BigInteger),
    PrimaryKeyConstraint("run_id", "key_digest", "attempt"),
    Index(None, "run_id", "node_id"),
)

#: The LOCAL cache tier (the shared tier lives in the artifact store).
step_cache = Table(
    "step_cache",
    metadata,
    Column("key_digest", String(64), primary_key=True),
    Column("key", Text, nullable=False),
    Column("entry_json", Text, nullable=False),
    Column("components_json", Text),
    Column("run_id", Text),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("last_used_at_ms", BigInteger, nullable=False),
    Column("invalidated_at_ms", BigInteger),
    Column("provenance_json", Text),
    # migration 0003: the node/function identity (explain's "previous entry of this subject") and the scope
    # ("shared": admissible, servable to any run; "run-local": failed admission, kept for its own run only).
    Column("subject", Text),
    Column("scope", Text, nullable=False, server_default="shared"),
    Index(None, "run_id"),
    Index(None, "last_used_at_ms"),
    Index(None, "subject", "created_at_ms"),
)

#: Revocation markers of the shared tier this database's readers have seen (migration 0007): honoured after the
#: marker is deleted from the bucket. Owned by ``records._revocation_rows``; first sighting wins per marker name.
cache_revocations = Table(
    "cache_revocations",
    metadata,
    Column("marker", Text, primary_key=True),
    Column("key_digest", String(64), nullable=False),
    Column("key", Text, nullable=False),
    # min(the marker's revoked_at_ms, this reader's clock when it first saw the marker)
    Column("revoked_at_ms", BigInteger, nullable=False),
    Column("entries_json", Text, nullable=False),
    Column("revoked_by", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("seen_at_ms", BigInteger, nullable=False),
)
