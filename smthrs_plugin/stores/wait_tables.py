"""Tables of durable waits: deferred completions and clock deadlines (DDL: migration ``0005_durable_waits``).

Declared on :data:`~smthrs_plugin.stores.schema.metadata` and registered in ``stores/__init__.py`` so the
migrated-schema diff test covers them.

Invariants:

- Both are addressed by ``(flow, execution_id, name)``: the flow name, the run id and a name unique within that
  run. A row is written once (first writer wins); only its completion /
  consumption columns move afterwards, and only from NULL to a value.
- ``deferred_completions.value_json`` is the canonical JSON the resumed run receives; ``consumed_at_ms`` is set
  (by the owner, fenced) BEFORE the value is served, so registration-time recovery skips completions a run
  already observed.
- ``clock_deadlines.due_at_ms`` is the absolute deadline recorded by the first scheduler; a re-run keeps it.
  ``completed_at_ms`` is NULL while the clock is pending.
- Rows cascade with their run (like ``attempts``): a deleted run leaves no waits behind.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, ForeignKey, Index, PrimaryKeyConstraint, Table, Text

from .schema import metadata

__all__ = ["deferred_completions", "clock_deadlines"]

deferred_completions = Table(
    "deferred_completions",
    metadata,
    Column("flow", Text, nullable=False),
    Column("execution_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    Column("name", Text, nullable=False),
    Column("value_json", Text, nullable=False),
    Column("completed_at_ms", BigInteger, nullable=False),
    Column("consumed_at_ms", BigInteger),
    PrimaryKeyConstraint("flow", "execution_id", "name"),
    Index(None, "flow", "consumed_at_ms"),
    Index(None, "execution_id"),
)

clock_deadlines = Table(
    "clock_deadlines",
    metadata,
    Column("flow", Text, nullable=False),
    Column("execution_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    Column("name", Text, nullable=False),
    Column("due_at_ms", BigInteger, nullable=False),
    Column("scheduled_at_ms", BigInteger, nullable=False),
    Column("completed_at_ms", BigInteger),
    PrimaryKeyConstraint("flow", "execution_id", "name"),
    Index(None, "completed_at_ms", "due_at_ms"),
    Index(None, "execution_id", "completed_at_ms"),
)
