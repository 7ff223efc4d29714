"""Initial store schema: meta (source identity, global revision), runs, run_tombstones, run_parents,
journal_events, attempts, step_cache.

Revision ID: 0001_initial
Revises:
"""

from __future__ import annotations

import time
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    meta = op.create_table(
        "meta",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("source_id", sa.String(64), nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_meta"),
    )
    # The database's random durable identity, minted once here; backups carry it.
    op.bulk_insert(
        meta,
        [{"id": 1, "source_id": uuid.uuid4().hex, "revision": 0, "created_at_ms": time.time_ns() // 10**6}],
    )

    op.create_table(
        "runs",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("flow", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("owner_host", sa.Text),
        sa.Column("owner_pid", sa.Integer),
        sa.Column("owner_nonce", sa.Text),
        sa.Column("owner_proc_start", sa.Text),
        sa.Column("heartbeat_at_ms", sa.BigInteger),
        sa.Column("claim_host", sa.Text),
        sa.Column("claim_pid", sa.Integer),
        sa.Column("claim_nonce", sa.Text),
        sa.Column("claim_token", sa.Text),
        sa.Column("claimed_at_ms", sa.BigInteger),
        sa.Column("parent_run_id", sa.Text),
        sa.Column("lineage_id", sa.Text),
        sa.Column("round_ordinal", sa.Integer, nullable=False, server_default="0"),
        sa.Column("cancel_requested_at_ms", sa.BigInteger),
        sa.Column("cancel_ack_host", sa.Text),
        sa.Column("cancel_ack_pid", sa.Integer),
        sa.Column("cancel_ack_nonce", sa.Text),
        sa.Column("cancel_ack_at_ms", sa.BigInteger),
        sa.Column("waiting_reason", sa.Text),
        sa.Column("wake_at_ms", sa.BigInteger),
        sa.Column("wait_token_digest", sa.Text),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.Column("started_at_ms", sa.BigInteger),
        sa.Column("finished_at_ms", sa.BigInteger),
        sa.Column("updated_at_ms", sa.BigInteger, nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("result_json", sa.Text),
        sa.Column("error_json", sa.Text),
        sa.PrimaryKeyConstraint("run_id", name="pk_runs"),
    )
    op.create_index("ix_runs_status_heartbeat_at_ms", "runs", ["status", "heartbeat_at_ms"])
    op.create_index("ix_runs_created_at_ms_run_id", "runs", ["created_at_ms", "run_id"])
    op.create_index("ix_runs_waiting_reason_wake_at_ms", "runs", ["waiting_reason", "wake_at_ms"])
    op.create_index("ix_runs_revision", "runs", ["revision"])
    op.create_index("ix_runs_parent_run_id", "runs", ["parent_run_id"])
    op.create_index("ix_runs_lineage_id_round_ordinal", "runs", ["lineage_id", "round_ordinal"])

    op.create_table(
        "run_tombstones",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("deleted_at_ms", sa.BigInteger, nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("run_id", name="pk_run_tombstones"),
    )
    op.create_index("ix_run_tombstones_revision", "run_tombstones", ["revision"])

    op.create_table(
        "run_parents",
        sa.Column("child_id", sa.Text, nullable=False),
        sa.Column("parent_id", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("child_id", "parent_id", name="pk_run_parents"),
    )
    op.create_index("ix_run_parents_parent_id_seq", "run_parents", ["parent_id", "seq"])

    op.create_table(
        "journal_events",
        sa.Column("partition", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("source_id", sa.Text),
        sa.Column("source_seq", sa.BigInteger),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("payload_json", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("partition", "seq", name="pk_journal_events"),
        sa.UniqueConstraint(
            "partition", "source_id", "source_seq", name="uq_journal_events_partition_source_id_source_seq"
        ),
    )

    op.create_table(
        "attempts",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("key_digest", sa.String(64), nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("node_id", sa.Text),
        sa.Column("owner_nonce", sa.Text, nullable=False),
        sa.Column("meta_json", sa.Text),
        sa.Column("result_json", sa.Text),
        sa.Column("error_json", sa.Text),
        sa.Column("started_at_ms", sa.BigInteger, nullable=False),
        sa.Column("finished_at_ms", sa.BigInteger),
        sa.PrimaryKeyConstraint("run_id", "key_digest", "attempt", name="pk_attempts"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name="fk_attempts_run_id_runs", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_attempts_run_id_node_id", "attempts", ["run_id", "node_id"])

    op.create_table(
        "step_cache",
        sa.Column("key_digest", sa.String(64), nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("entry_json", sa.Text, nullable=False),
        sa.Column("components_json", sa.Text),
        sa.Column("run_id", sa.Text),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.Column("last_used_at_ms", sa.BigInteger, nullable=False),
        sa.Column("invalidated_at_ms", sa.BigInteger),
        sa.Column("provenance_json", sa.Text),
        sa.PrimaryKeyConstraint("key_digest", name="pk_step_cache"),
    )
    op.create_index("ix_step_cache_run_id", "step_cache", ["run_id"])
    op.create_index("ix_step_cache_last_used_at_ms", "step_cache", ["last_used_at_ms"])

    # A deleted run never leaves ghost DAG edges, whoever deletes the row (the reference's AFTER DELETE trigger).
    if op.get_bind().dialect.name == "sqlite":
        op.execute(
            "CREATE TRIGGER trg_runs_prune_parents AFTER DELETE ON runs BEGIN "
            "DELETE FROM run_parents WHERE child_id = OLD.run_id OR parent_id = OLD.run_id; END"
        )
    else:
        op.execute(
            "CREATE FUNCTION smthrs_prune_run_parents() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "DELETE FROM run_parents WHERE child_id = OLD.run_id OR parent_id = OLD.run_id; RETURN OLD; END $$"
        )
        op.execute(
            "CREATE TRIGGER trg_runs_prune_parents AFTER DELETE ON runs "
            "FOR EACH ROW EXECUTE FUNCTION smthrs_prune_run_parents()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_runs_prune_parents")
    else:
        op.execute("DROP TRIGGER IF EXISTS trg_runs_prune_parents ON runs")
        op.execute("DROP FUNCTION IF EXISTS smthrs_prune_run_parents()")
    for table in (
        "step_cache",
        "attempts",
        "journal_events",
        "run_parents",
        "run_tombstones",
        "runs",
        "meta",
    ):
        op.drop_table(table)
