"""Cache revocations remembered by this database's readers (a marker deleted from the bucket stays honoured).

Revision ID: 0007_cache_revocations
Revises: 0006_control_plane
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_cache_revocations"
down_revision = "0006_control_plane"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cache_revocations",
        sa.Column("marker", sa.Text, nullable=False),
        sa.Column("key_digest", sa.String(64), nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("revoked_at_ms", sa.BigInteger, nullable=False),
        sa.Column("entries_json", sa.Text, nullable=False),
        sa.Column("revoked_by", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("seen_at_ms", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("marker", name="pk_cache_revocations"),
    )


def downgrade() -> None:
    op.drop_table("cache_revocations")
