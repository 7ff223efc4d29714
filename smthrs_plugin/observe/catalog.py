"""The run catalog: filtered pages of runs in creation order, with opaque cursors bound to the query.

Invariants:

- **Filters in SQL, before the limit.** The statement is the runs owner's (``records.runs.catalog_query``); this
  module binds it to filters and cursors. status, flow, effective parent (``None`` selects runs without one),
  lineage, waiting reason (``None`` selects runs with no stored wait), created after/before (inclusive). Omitted
  filters are unconstrained (:data:`ANY` marks "omitted" where ``None`` is a meaningful value).
- **Order** ``(created_at_ms, run_id)`` ascending (both immutable), ties by run id in the database's binary
  order (SQLite ``BINARY``; PostgreSQL in its collation — ``C``/``C.UTF-8`` clusters are binary). Pages are keyset
  pages: a page is ``limit + 1`` rows after the cursor's key, so no numeric offset exists to drift.
- **Cursors** are versioned and opaque (``observe/_cursor.py``), bound to the canonical filter tuple and the
  database's source identity: a changed filter or an edited cursor is ``invalid_cursor``, another database's cursor
  ``source_changed``; the limit may change between pages. Limit 1..200, default 100 (``invalid_options``).
- **Coherence.** Each page is read in one read transaction and carries that transaction's source and revision.
  Successive pages are live reads: a run created after the last key can appear, one before it is not revisited.
  Every run that existed when paging started and still matches is seen exactly once, in order.

Indexes (migration ``0004_run_catalog``, ``stores/catalog_indexes.py``) — why 6 and not the seed's 32 subsets:
each equality predicate P has an index ``(P, created_at_ms, run_id)`` (plus ``(status, flow, ...)`` for the pair
the CLI exposes, and the existing ``(created_at_ms, run_id)`` for unfiltered and time-window pages). A query with
any filters walks ONE of these in order from the cursor's key (a row-value seek), checks the remaining predicates
on the rows it visits and stops at ``limit + 1`` matches: no plan sorts the run history. The price of fewer
indexes is visiting non-matching rows of the chosen predicate for rare combinations (bounded by that predicate's
matches, never a sort); the price of 32 would be write amplification on every run mutation (heartbeats rewrite
the row). The effective-parent filter reads its candidates from ``parent_run_id`` and from that parent's spawn
edges, so its only sort is over that parent's direct children. EXPLAIN on 20,000 runs (ANALYZEd), first page and
a page after a cursor (``tests/observe/test_observe_catalog_plans.py`` re-checks all 32 subsets on both)::

    SQLite 3.40   status=?              SEARCH runs USING INDEX ix_runs_status_created_at_ms_run_id
                                          (status=? AND (created_at_ms,run_id)>(?,?))
                  status=? flow=?       SEARCH runs USING INDEX ix_runs_status_flow_created_at_ms_run_id (...)
                  waiting_reason IS NULL / parent IS NULL / lineage=? / flow=?: the same shape on their index
                  status+waiting+lineage: SEARCH ... ix_runs_lineage_id_created_at_ms_run_id (lineage_id=? ...)
                  no filter             SEARCH runs USING INDEX ix_runs_created_at_ms_run_id ((created_at_ms,run_id)>(?,?))
                  parent=?              SEARCH runs USING INDEX sqlite_autoindex_runs_1 (run_id=?) / LIST SUBQUERY
                                          (ix_runs_parent_run_id_... UNION ix_run_parents_parent_id_seq)
                                          / USE TEMP B-TREE FOR ORDER BY   <- the parent's candidates only
    PostgreSQL 15 status=? flow=?       Limit -> Index Scan using ix_runs_status_flow_created_at_ms_run_id
                                          Index Cond: ((status = ..) AND (flow = ..) AND (ROW(created_at_ms, run_id) > ROW(..)))
                  status=? (43% of rows) Limit -> Index Scan using ix_runs_created_at_ms_run_id, Filter: status
                                          (cost-based: a common value is cheaper to filter in creation order;
                                          a rare one seeks ix_runs_status_created_at_ms_run_id)
                  parent IS NULL        Limit -> Nested Loop Anti Join -> Index Scan (creation order) + pk_run_parents
                  parent=?              Limit -> Sort -> Nested Loop (HashAggregate of the parent's candidates,
                                          Bitmap Index Scans on ix_runs_parent_run_id_... and ix_run_parents_parent_id_seq)

Prior art: the seed's ``RunCatalogRead.listRuns`` (observe-executions, "Filter before pagination"); keyset
pagination ("use the index, Luke").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy.engine import Connection

from ..canonical import sha256_hex
from ..errors import ControlError
from ..records.runs import ANY, RUN_STATUSES, catalog_page_in, catalog_query
from ..records.runs import Unconstrained as _Unconstrained
from ..stores.database import Database
from ._cursor import canonical_or_invalid, check_limit, check_text, decode_cursor, encode_cursor
from .snapshot import Observed, observe_records, watermark_of

__all__ = ["ANY", "RunFilters", "RunPage", "list_runs", "DEFAULT_LIMIT", "MAX_LIMIT"]

DEFAULT_LIMIT = 100
MAX_LIMIT = 200
_MAX_SAFE_INT = 2**53 - 1


@dataclass(frozen=True)
class RunFilters:
    """Catalog filters (all exact; see module invariants). ``parent_run_id=None`` selects runs with no effective
    parent, ``waiting_reason=None`` runs with no stored wait; :data:`ANY` (the default) leaves them open."""

    status: str | None = None
    flow: str | None = None
    parent_run_id: str | None | _Unconstrained = ANY
    lineage_id: str | None = None
    waiting_reason: str | None | _Unconstrained = ANY
    created_after_ms: int | None = None
    created_before_ms: int | None = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in RUN_STATUSES:
            raise ControlError(
                "invalid_options",
                f"unknown status {self.status!r}; one of {list(RUN_STATUSES)}",
                option="status",
            )
        for name in ("flow", "lineage_id"):
            if getattr(self, name) is not None:
                check_text(name, getattr(self, name))
        for name in ("parent_run_id", "waiting_reason"):
            value = getattr(self, name)
            if value is not ANY and value is not None:
                check_text(name, value)
        for name in ("created_after_ms", "created_before_ms"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_SAFE_INT
            ):
                raise ControlError(
                    "invalid_options", f"{name} must be epoch milliseconds (a non-negative int)", option=name
                )

    @classmethod
    def of(cls, value: RunFilters | Mapping[str, Any] | None) -> RunFilters:
        """Filters from a RunFilters, a mapping of its field names, or None (no filter)."""
        if value is None:
            return cls()
        if isinstance(value, RunFilters):
            return value
        if not isinstance(value, Mapping):
            raise ControlError(
                "invalid_options", "filters must be a RunFilters or a mapping", option="filters"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ControlError(
                "invalid_options", f"unknown filters {unknown}; known: {sorted(known)}", option="filters"
            )
        return cls(**value)

    def canonical(self) -> dict[str, Any]:
        """The filter tuple a cursor binds to (every field; an omitted parent/wait filter is ``{"any": true}``,
        distinct from an explicit null)."""
        return {
            f.name: {"any": True} if getattr(self, f.name) is ANY else getattr(self, f.name)
            for f in fields(self)
        }


@dataclass(frozen=True)
class RunPage:
    """One page of runs, the cursor of the next page (None when exhausted), and the page's source and revision."""

    runs: tuple[Observed, ...]
    cursor: str | None
    source: str
    revision: int


def list_runs(
    db: Database,
    filters: RunFilters | Mapping[str, Any] | None = None,
    *,
    cursor: str | None = None,
    limit: int = DEFAULT_LIMIT,
) -> RunPage:
    """One page of runs matching ``filters`` in ``(created_at_ms, run_id)`` order (see module invariants)."""
    f = RunFilters.of(filters)
    check_limit(limit, maximum=MAX_LIMIT)
    binding = sha256_hex(canonical_or_invalid(f.canonical(), "filters"))

    def fn(conn: Connection) -> RunPage:
        source, revision = watermark_of(conn)
        after = None if cursor is None else _after(cursor, source, binding)
        page, more = catalog_page_in(conn, _filters(f), after, limit)
        observed = tuple(observe_records(conn, page))
        nxt = None
        if more:
            last = page[-1]
            nxt = encode_cursor(
                "runs", source, {"f": binding, "at": int(last.created_at_ms), "id": last.run_id}
            )
        return RunPage(observed, nxt, source, revision)

    return db.read(fn)


def _after(cursor: str, source: str, binding: str) -> tuple[int, str]:
    body = decode_cursor(cursor, kind="runs", source=source)
    if body.get("f") != binding:
        raise ControlError(
            "invalid_cursor",
            "this cursor belongs to a query with different filters; keep the filters of the first page, or start "
            "again without a cursor",
        )
    at, rid = body.get("at"), body.get("id")
    if type(at) is not int or not isinstance(rid, str):
        raise ControlError(
            "invalid_cursor", "this cursor has an unknown layout; start again without a cursor"
        )
    return at, rid


def _filters(f: RunFilters) -> dict[str, Any]:
    return {x.name: getattr(f, x.name) for x in fields(f)}


def _query(f: RunFilters, after: tuple[int, str] | None, n: int) -> Any:
    """The catalog's statement for ``f`` (what a page reads; the query-plan tests EXPLAIN it)."""
    return catalog_query(**_filters(f), after=after, n=n)
