"""Tables of the plan scheduler: persisted plan generations, a run's input observations and merge decisions.

Declared on :data:`~smthrs_plugin.stores.schema.metadata` (registered by ``stores/__init__.py``) so the
migrated-schema diff test covers them; the DDL is migration ``0002_plan_scheduler``.

Invariants:

- ``plan_generations`` is append-only and content-addressed: a row is one generation of one plan, named by the
  plan digest after that generation; ``parent_digest`` chains it to the previous generation (NULL for generation
  0, whose digest is the ``base_digest`` an approval binds to). ``nodes_json`` holds only the nodes that
  generation added, so earlier nodes are stored once and never rewritten. Two runs that grow a plan the same
  way write the same row (first writer wins).
- ``plan_input_heads`` binds a run to one plan id, one approved base and one environment fingerprint, and names
  the newest plan generation the run observed. ``plan_input_generations`` holds the source pins each observed
  generation added (earlier pins are kept, only new sources are recorded), written before any dispatch that
  reads them.
- ``plan_merges`` is the durable stop-merge decision of a run: the stopped node, the winners, and — once the
  merge node was appended in the same transaction as the plan generation — the generated node id and the
  parent/child digests that recovery validates. A decision without completion is a recoverable intent.

Run-scoped rows cascade with their run (like ``attempts``).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, ForeignKey, Index, Integer, PrimaryKeyConstraint, Table, Text

from .schema import metadata

__all__ = ["plan_generations", "plan_input_heads", "plan_input_generations", "plan_merges"]

plan_generations = Table(
    "plan_generations",
    metadata,
    Column("plan_id", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("base_digest", Text, nullable=False),
    Column("parent_digest", Text),
    Column("generation", Integer, nullable=False),
    Column("flow", Text, nullable=False),
    Column("maximum_plan_nodes", Integer, nullable=False),
    Column("nodes_json", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("plan_id", "digest"),
    Index(None, "plan_id", "base_digest", "generation"),
)

plan_input_heads = Table(
    "plan_input_heads",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
    Column("plan_id", Text, nullable=False),
    Column("base_digest", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("generation", Integer, nullable=False),
    Column("environment_fingerprint", Text, nullable=False),
    Column("environment_json", Text),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("updated_at_ms", BigInteger, nullable=False),
)

plan_input_generations = Table(
    "plan_input_generations",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    Column("generation", Integer, nullable=False),
    Column("plan_digest", Text, nullable=False),
    Column("pins_json", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("run_id", "generation"),
)

plan_merges = Table(
    "plan_merges",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    Column("node_id", Text, nullable=False),
    Column("plan_id", Text, nullable=False),
    Column("winners_json", Text, nullable=False),
    Column("paths_json", Text, nullable=False),
    Column("decided_digest", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("merge_node_id", Text),
    Column("generation", Integer),
    Column("parent_digest", Text),
    Column("digest", Text),
    Column("decided_at_ms", BigInteger, nullable=False),
    Column("completed_at_ms", BigInteger),
    PrimaryKeyConstraint("run_id", "node_id"),
)
