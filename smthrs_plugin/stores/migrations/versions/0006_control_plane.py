"""Control plane: plan cards, approval tokens, decisions, grants, receipts, admitted runs, resume delegations.

Revision ID: 0006_control_plane
Revises: 0005_durable_waits
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_control_plane"
down_revision = "0005_durable_waits"
branch_labels = None
depends_on = None


def _run_fk(table: str, column: str = "run_id") -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        [column], ["runs.run_id"], name=f"fk_{table}_{column}_runs", ondelete="CASCADE"
    )


def upgrade() -> None:
    op.create_table(
        "control_plans",
        sa.Column("plan_id", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("flow_id", sa.Text, nullable=False),
        sa.Column("plan_name", sa.Text, nullable=False),
        sa.Column("plan_digest", sa.Text, nullable=False),
        sa.Column("deploy_class", sa.Integer, nullable=False),
        sa.Column("card_json", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("plan_id", name="pk_control_plans"),
    )
    op.create_index("ix_control_plans_digest_seq", "control_plans", ["digest", "seq"], unique=True)

    op.create_table(
        "control_tokens",
        sa.Column("token_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("plan_id", sa.Text),
        sa.Column("run_id", sa.Text),
        sa.Column("request_id", sa.Text),
        sa.Column("flow_id", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("envelope_json", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("token_id", name="pk_control_tokens"),
        sa.ForeignKeyConstraint(
            ["plan_id"], ["control_plans.plan_id"], name="fk_control_tokens_plan_id_control_plans"
        ),
        _run_fk("control_tokens"),
    )
    op.create_index("ix_control_tokens_plan_id", "control_tokens", ["plan_id"], unique=True)
    op.create_index(
        "ix_control_tokens_run_id_request_id", "control_tokens", ["run_id", "request_id"], unique=True
    )

    op.create_table(
        "control_decisions",
        sa.Column("token_id", sa.Text, nullable=False),
        sa.Column("decision", sa.Text, nullable=False),
        sa.Column("principal_id", sa.Text, nullable=False),
        sa.Column("principal_kind", sa.Text, nullable=False),
        sa.Column("scope", sa.Text),
        sa.Column("grant_id", sa.Text),
        sa.Column("via_grant_id", sa.Text),
        sa.Column("decided_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("token_id", name="pk_control_decisions"),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["control_tokens.token_id"],
            name="fk_control_decisions_token_id_control_tokens",
            ondelete="CASCADE",
        ),
    )

    op.create_table(
        "control_grants",
        sa.Column("grant_id", sa.Text, nullable=False),
        sa.Column("token_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("flow_id", sa.Text, nullable=False),
        sa.Column("digest", sa.Text, nullable=False),
        sa.Column("envelope_digest", sa.Text, nullable=False),
        sa.Column("envelope_json", sa.Text, nullable=False),
        sa.Column("run_id", sa.Text),
        sa.Column("principal_id", sa.Text, nullable=False),
        sa.Column("principal_kind", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.Column("used_at_ms", sa.BigInteger),
        sa.Column("used_by_run", sa.Text),
        sa.PrimaryKeyConstraint("grant_id", name="pk_control_grants"),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["control_tokens.token_id"],
            name="fk_control_grants_token_id_control_tokens",
            ondelete="CASCADE",
        ),
    )
    op.create_index(
        "ix_control_grants_kind_scope_flow_id_digest_envelope_digest",
        "control_grants",
        ["kind", "scope", "flow_id", "digest", "envelope_digest"],
    )
    op.create_index("ix_control_grants_run_id_digest", "control_grants", ["run_id", "digest"])

    op.create_table(
        "control_receipts",
        sa.Column("durable_key", sa.Text, nullable=False),
        sa.Column("operation", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("receipt_json", sa.Text, nullable=False),
        sa.Column("run_id", sa.Text),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("durable_key", name="pk_control_receipts"),
    )
    op.create_index("ix_control_receipts_run_id", "control_receipts", ["run_id"])

    op.create_table(
        "control_runs",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("plan_id", sa.Text, nullable=False),
        sa.Column("card_digest", sa.Text, nullable=False),
        sa.Column("token_id", sa.Text),
        sa.Column("grant_id", sa.Text),
        sa.Column("durable_key", sa.Text, nullable=False),
        sa.Column("admitted_by_id", sa.Text, nullable=False),
        sa.Column("admitted_by_kind", sa.Text, nullable=False),
        sa.Column("admitted_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("run_id", name="pk_control_runs"),
        _run_fk("control_runs"),
        sa.ForeignKeyConstraint(
            ["plan_id"], ["control_plans.plan_id"], name="fk_control_runs_plan_id_control_plans"
        ),
    )
    op.create_index("ix_control_runs_plan_id", "control_runs", ["plan_id"])

    op.create_table(
        "control_resumes",
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("token_id", sa.Text, nullable=False),
        sa.Column("decision", sa.Text, nullable=False),
        sa.Column("principal_id", sa.Text, nullable=False),
        sa.Column("principal_kind", sa.Text, nullable=False),
        sa.Column("created_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("run_id", "token_id", name="pk_control_resumes"),
        _run_fk("control_resumes"),
    )


def downgrade() -> None:
    for table in (
        "control_resumes",
        "control_runs",
        "control_receipts",
        "control_grants",
        "control_decisions",
        "control_tokens",
        "control_plans",
    ):
        op.drop_table(table)
