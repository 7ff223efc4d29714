"""Plan scheduler: plan generations, run input heads and generations (source pins, environment), merge decisions.

Revision ID: 0002_plan_scheduler
Revises: 0001_initial
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_plan_scheduler"
down_revision = "0001_initial"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "plan_generations",
        sa.Column("plan_id", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("base_digest", sa.Text, nullable=False),
        sa.Column("parent_digest", sa.Text),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("flow", sa.Text, nullable=False),
        sa.Column("maximum_plan_nodes", sa.Integer, nullable=False),
        sa.Column("nodes_json", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("plan_id", "digest", name="pk_plan_generations"),
    )
    op.create_index(
        "ix_plan_generations_plan_id_base_digest_generation",
        "plan_generations",
        ["plan_id", "base_digest", "generation"],
    )

    op.create_table(
        "plan_input_heads",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("plan_id", sa.Text, nullable=False),
        sa.Column("base_digest", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("environment_fingerprint", sa.Text, nullable=False),
        sa.Column("environment_json", sa.Text),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("run_id", name="pk_plan_input_heads"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name="fk_plan_input_heads_run_id_runs", ondelete="CASCADE"
        ),
    )

    op.create_table(
        "plan_input_generations",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("generation", sa.Integer, nullable=False),
        sa.Column("plan_digest", sa.Text, nullable=False),
        sa.Column("pins_json", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("run_id", "generation", name="pk_plan_input_generations"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name="fk_plan_input_generations_run_id_runs", ondelete="CASCADE"
        ),
    )

    op.create_table(
        "plan_merges",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("node_id", sa.Text, nullable=False),
        sa.Column("plan_id", sa.Text, nullable=False),
        sa.Column("winners_json", sa.Text, nullable=False),
        sa.Column("paths_json", sa.Text, nullable=False),
        sa.Column("decided_digest", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("merge_node_id", sa.Text),
        sa.Column("generation", sa.Integer),
        sa.Column("parent_digest", sa.Text),
        sa.Column("digest", sa.Text),
        sa.Column("decided_at_ms", sa.BigInteger, nullable=False),
        sa.Column("completed_at_ms", sa.BigInteger),
        sa.PrimaryKeyConstraint("run_id", "node_id", name="pk_plan_merges"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name="fk_plan_merges_run_id_runs", ondelete="CASCADE"
        ),
    )


def downgrade() -> None:
    for table in ("plan_merges", "plan_input_generations", "plan_input_heads", "plan_generations"):
        op.drop_table(table)
