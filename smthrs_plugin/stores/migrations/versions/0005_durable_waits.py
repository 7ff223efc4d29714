"""Durable waits: deferred completions and clock deadlines, addressed by (flow, execution_id, name).

Revision ID: 0005_durable_waits
Revises: 0004_run_catalog
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_durable_waits"
down_revision = "0004_run_catalog"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deferred_completions",
        sa.Column("flow", sa.Text, nullable=False),
        sa.Column("execution_id", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("value_json", sa.Text, nullable=False),
        sa.Column("completed_at_ms", sa.BigInteger, nullable=False),
        sa.Column("consumed_at_ms", sa.BigInteger),
        sa.PrimaryKeyConstraint("flow", "execution_id", "name", name="pk_deferred_completions"),
        sa.ForeignKeyConstraint(
            ["execution_id"],
            ["runs.run_id"],
            name="fk_deferred_completions_execution_id_runs",
            ondelete="CASCADE",
        ),
    )
    op.create_index(
        "ix_deferred_completions_flow_consumed_at_ms", "deferred_completions", ["flow", "consumed_at_ms"]
    )
    op.create_index("ix_deferred_completions_execution_id", "deferred_completions", ["execution_id"])

    op.create_table(
        "clock_deadlines",
        sa.Column("flow", sa.Text, nullable=False),
        sa.Column("execution_id", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("due_at_ms", sa.BigInteger, nullable=False),
        sa.Column("scheduled_at_ms", sa.BigInteger, nullable=False),
        sa.Column("completed_at_ms", sa.BigInteger),
        sa.PrimaryKeyConstraint("flow", "execution_id", "name", name="pk_clock_deadlines"),
        sa.ForeignKeyConstraint(
            ["execution_id"], ["runs.run_id"], name="fk_clock_deadlines_execution_id_runs", ondelete="CASCADE"
        ),
    )
    op.create_index(
        "ix_clock_deadlines_completed_at_ms_due_at_ms", "clock_deadlines", ["completed_at_ms", "due_at_ms"]
    )
    op.create_index(
        "ix_clock_deadlines_execution_id_completed_at_ms",
        "clock_deadlines",
        ["execution_id", "completed_at_ms"],
    )


def downgrade() -> None:
    op.drop_table("clock_deadlines")
    op.drop_table("deferred_completions")
