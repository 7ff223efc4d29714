"""The run catalog: filtered pages of runs in creation order, with opaque cursors bound to the query.

Invariants:

- **Filters in SQL, before the limit** (the statement is ``records.runs.catalog_query``). Omitted filters are
  unconstrained (:data:`ANY` marks "omitted" where ``None`` is meaningful).
- **Order** ``(created_at_ms, run_id)`` ascending; keyset pages of ``limit + 1`` rows after the cursor's key.
- **Cursors** are versioned and opaque (``observe/_cursor.py``), bound to the filters and the database's source:
  a changed filter or edited cursor is ``invalid_cursor``, another database's ``source_changed``. Limit 1..200,
  default 100.
- **Coherence**: each page is one read transaction carrying its source and revision; every run that existed when
  paging started and still matches is seen exactly once, in order.
- **Indexes**: one ``(P, created_at_ms, run_id)`` per equality predicate plus ``(status, flow, ...)``
  (``stores/catalog_indexes.py``), not one per subset of filters: fewer indexes cost visiting non-matching rows
  of rare combinations, never a sort; 32 would amplify every run write. ``tests/observe/test_observe_catalog_plans.py``
  checks the query plan of every subset on both backends.
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
