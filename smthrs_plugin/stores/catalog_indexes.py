"""Creation-order indexes of the run catalog (``observe/catalog.py``); the DDL is migration ``0004_run_catalog``.

Invariant: every catalog page is an ordered walk of ONE index in ``(created_at_ms, run_id)`` order that stops after
``limit + 1`` matches; no query sorts the run history. Each equality filter has an index whose suffix is
``(created_at_ms, run_id)``, so filtering by it is a seek plus an ordered range scan; combinations walk the index of
one of their predicates and check the others on the rows they visit (see ``observe/catalog.py`` for the EXPLAIN
plans on both backends and why the reference's 32 subset indexes are not needed here).

Declared on :data:`~smthrs_plugin.stores.schema.metadata` through the ``runs`` table, so the migrated-schema diff
test covers them.
"""

from __future__ import annotations

from sqlalchemy import Index

from .schema import runs

__all__ = ["CATALOG_INDEXES"]

_r = runs.c

#: name → index; the names are the metadata naming convention's, spelled out so the migration can use them.
CATALOG_INDEXES: dict[str, Index] = {
    idx.name: idx  # type: ignore[misc]
    for idx in (
        Index("ix_runs_status_created_at_ms_run_id", _r.status, _r.created_at_ms, _r.run_id),
        Index("ix_runs_flow_created_at_ms_run_id", _r.flow, _r.created_at_ms, _r.run_id),
        Index("ix_runs_status_flow_created_at_ms_run_id", _r.status, _r.flow, _r.created_at_ms, _r.run_id),
        Index("ix_runs_parent_run_id_created_at_ms_run_id", _r.parent_run_id, _r.created_at_ms, _r.run_id),
        Index("ix_runs_lineage_id_created_at_ms_run_id", _r.lineage_id, _r.created_at_ms, _r.run_id),
        Index("ix_runs_waiting_reason_created_at_ms_run_id", _r.waiting_reason, _r.created_at_ms, _r.run_id),
    )
}
