"""The catalog's query plans: no filter combination sorts the run history (EXPLAIN on SQLite and PostgreSQL).

Six indexes instead of the reference's 32 (see ``observe/catalog.py``): every one of the 32 subsets of the five
equality predicates, with and without a cursor, must still walk an index in ``(created_at_ms, run_id)`` order; the
effective-parent filter may sort, but only the candidates read from that parent's spawn edges and column.
"""

from __future__ import annotations

import itertools

import pytest

from smthrs_plugin.observe.catalog import ANY, RunFilters, _query
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.stores.database import Database

_VALUES = {
    "status": "completed",
    "flow": "flow/a",
    "parent_run_id": "p0",
    "lineage_id": "lin-0",
    "waiting_reason": "timer",
}


def _plan(db: Database, f: RunFilters, after: tuple[int, str] | None) -> list[str]:
    sql = str(
        _query(f, after, 101).compile(
            dialect=db._handle().read_engine.dialect, compile_kwargs={"literal_binds": True}
        )
    )

    def explain(conn: object) -> list[str]:
        c = conn  # type: ignore[assignment]
        if db.dialect == "sqlite":
            return [str(r[-1]) for r in c.exec_driver_sql("EXPLAIN QUERY PLAN " + sql).all()]  # type: ignore[attr-defined]
        # Make a sort or a sequential scan maximally expensive: a plan still containing one has no index
        # alternative at all (the property we pin; the cost model is free to prefer it on tiny tables).
        c.exec_driver_sql("SET LOCAL enable_sort = off")  # type: ignore[attr-defined]
        c.exec_driver_sql("SET LOCAL enable_seqscan = off")  # type: ignore[attr-defined]
        return [str(r[0]) for r in c.exec_driver_sql("EXPLAIN " + sql).all()]  # type: ignore[attr-defined]

    return db.read(explain)


def test_no_filter_combination_sorts_the_run_history(db: Database, runs: RunStore) -> None:
    for i in range(30):
        runs.create(f"r{i}", "flow/a" if i % 2 else "flow/b", parent_run_id="p0" if i % 3 == 0 else None)
    names = list(_VALUES)
    checked = 0
    for mask in itertools.product([False, True], repeat=len(names)):
        chosen = {n: _VALUES[n] for n, on in zip(names, mask, strict=True) if on}
        for after in (None, (1_700_000_000_000, "r5")):
            f = RunFilters(**chosen)  # type: ignore[arg-type]
            plan = "\n".join(_plan(db, f, after))
            by_parent = f.parent_run_id is not ANY
            if db.dialect == "sqlite":
                if by_parent:
                    # Driven from the candidate list, sorting only those rows.
                    assert "LIST SUBQUERY" in plan and "ix_run_parents_parent_id_seq" in plan, (chosen, plan)
                else:
                    assert "TEMP B-TREE FOR ORDER BY" not in plan and "SCAN runs\n" not in plan + "\n", (
                        chosen,
                        plan,
                    )
            else:
                assert "Seq Scan on runs" not in plan, (chosen, plan)
                if by_parent:
                    assert "ix_run_parents_parent_id_seq" in plan, (chosen, plan)
                else:
                    assert "Sort" not in plan, (chosen, plan)
                    # ...and it SEEKS on one of the predicates (a full walk of the creation index would also avoid
                    # the sort, but visits the whole history for a rare value).
                    conds = [line for line in plan.splitlines() if "Index Cond" in line]
                    assert not chosen or any(f"({n} = " in c for c in conds for n in chosen), (chosen, plan)
            checked += 1
    assert checked == 64


@pytest.mark.parametrize("field,value", [("parent_run_id", None), ("waiting_reason", None)])
def test_null_filters_walk_an_index_too(db: Database, runs: RunStore, field: str, value: None) -> None:
    runs.create("r0", "flow/a")
    plan = "\n".join(_plan(db, RunFilters(**{field: value}), None))  # type: ignore[arg-type]
    assert "TEMP B-TREE FOR ORDER BY" not in plan and "Sort" not in plan.replace("Sort Key", ""), plan
