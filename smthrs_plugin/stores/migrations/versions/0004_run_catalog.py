"""Run catalog: creation-order indexes, one per equality filter of ``list_runs`` plus (status, flow).

See ``stores/catalog_indexes.py`` (declarations) and ``observe/catalog.py`` (the queries and their plans).

Revision ID: 0004_run_catalog
Revises: 0003_step_cache_subject
"""

from __future__ import annotations

from alembic import op

revision = "0004_run_catalog"
down_revision = "0003_step_cache_subject"
branch_labels = None
depends_on = None

# Frozen copy of the shipped index set (a migration never imports the live declarations).
_INDEXES = (
    ("ix_runs_status_created_at_ms_run_id", ["status", "created_at_ms", "run_id"]),
    ("ix_runs_flow_created_at_ms_run_id", ["flow", "created_at_ms", "run_id"]),
    ("ix_runs_status_flow_created_at_ms_run_id", ["status", "flow", "created_at_ms", "run_id"]),
    ("ix_runs_parent_run_id_created_at_ms_run_id", ["parent_run_id", "created_at_ms", "run_id"]),
    ("ix_runs_lineage_id_created_at_ms_run_id", ["lineage_id", "created_at_ms", "run_id"]),
    ("ix_runs_waiting_reason_created_at_ms_run_id", ["waiting_reason", "created_at_ms", "run_id"]),
)


def upgrade() -> None:
    for name, columns in _INDEXES:
        op.create_index(name, "runs", columns)


def downgrade() -> None:
    for name, _columns in reversed(_INDEXES):
        op.drop_index(name, table_name="runs")
