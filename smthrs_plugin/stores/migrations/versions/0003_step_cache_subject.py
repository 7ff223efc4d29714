"""step_cache: ``subject`` (the node/function identity an entry was built for) and ``scope`` (``shared`` for an
admissible entry any run may be served, ``run-local`` for evidence that failed admission and stays with its run).

``smthrs cache explain`` finds "the previous entry of this subject" through the (subject, created_at_ms) index;
``scope`` lets ``ls``/``gc`` tell the two kinds of rows apart without decoding every entry.

Revision ID: 0003_step_cache_subject
Revises: 0002_plan_scheduler
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_step_cache_subject"
down_revision = "0002_plan_scheduler"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step_cache") as batch:
        batch.add_column(sa.Column("subject", sa.Text))
        batch.add_column(sa.Column("scope", sa.Text, nullable=False, server_default="shared"))
    op.create_index("ix_step_cache_subject_created_at_ms", "step_cache", ["subject", "created_at_ms"])


def downgrade() -> None:
    op.drop_index("ix_step_cache_subject_created_at_ms", table_name="step_cache")
    with op.batch_alter_table("step_cache") as batch:
        batch.drop_column("scope")
        batch.drop_column("subject")
