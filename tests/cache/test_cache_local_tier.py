"""The local tier's contract on both SQL backends (SQLite and PostgreSQL via ``db_url``): first writer wins,
invalidation, replacement, run-local scoping, undecodable rows, and the seam's fenced settle transaction."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _cache_support import make_machine, upper, upper_node

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.boundary.evidence import Evidence, Output, diff_identity
from smthrs_plugin.cache.entry import CacheEntry, check_cacheable
from smthrs_plugin.cache.local import (
    DifferentResult,
    Inserted,
    LocalHit,
    LocalTier,
    LocalUndecodable,
    Replaced,
    SameResult,
)
from smthrs_plugin.canonical import key
from smthrs_plugin.engine.ownership.arbiter import Ownership
from smthrs_plugin.errors import FenceLost
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.settings import load_settings
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import Database
from smthrs_plugin.stores.schema import step_cache


def _entry(k: str, value: Any, *, subject: str = "s", scope: str = "shared", run: str = "r1") -> CacheEntry:
    outs = (Output("out.txt", "a" * 64, 3, 0o644, None),)
    ev = Evidence(outs, (), diff_identity(outs, ()), (), True, True, (), "hard")
    cacheable = check_cacheable(value)
    assert not hasattr(cacheable, "reason")
    return CacheEntry.build(
        key=k,
        subject=subject,
        components={"inputs": {"0": value}},
        evidence=ev,
        value=value,
        canonical_value=cacheable.canonical,  # type: ignore[union-attr]
        admission={
            "tier": "sealed",
            "allReadsExact": True,
            "readSetVerified": True,
            "nondeterministic": False,
        },
        provenance={"run_id": run, "node_id": "n", "attempt": 1, "host": "h", "created_at_ms": 1},
        scope=scope,  # type: ignore[arg-type]
    )


def test_first_writer_wins_and_a_different_result_is_reported_not_written(db: Database) -> None:
    tier = LocalTier(db)
    k = key({"t": 1})
    assert isinstance(db.write(lambda c: tier.record_in(c, _entry(k, 1))), Inserted)
    assert isinstance(db.write(lambda c: tier.record_in(c, _entry(k, 1))), SameResult)
    other = db.write(lambda c: tier.record_in(c, _entry(k, 2)))
    assert isinstance(other, DifferentResult) and other.existing.value == 1
    hit = tier.lookup(k)
    assert isinstance(hit, LocalHit) and hit.entry.value == 1


def test_an_invalidated_row_is_not_served_and_is_replaced_by_the_next_result(db: Database) -> None:
    tier = LocalTier(db)
    k = key({"t": 2})
    db.write(lambda c: tier.record_in(c, _entry(k, 1)))
    assert tier.invalidate(_entry(k, 1).name) is True
    assert tier.invalidate(_entry(k, 1).name) is False  # already invalid
    assert tier.lookup(k) is None
    assert isinstance(db.write(lambda c: tier.record_in(c, _entry(k, 2))), Replaced)
    hit = tier.lookup(k)
    assert isinstance(hit, LocalHit) and hit.entry.value == 2


def test_a_run_local_row_is_never_found_by_its_dispatch_key(db: Database) -> None:
    tier = LocalTier(db)
    k = key({"t": 3})
    db.write(lambda c: tier.record_in(c, _entry(k, 1, scope="run-local")))
    assert tier.lookup(k) is None
    # the same run records again (a second attempt): replaced, never two rows
    assert isinstance(db.write(lambda c: tier.record_in(c, _entry(k, 2, scope="run-local"))), Replaced)
    assert [(r.scope, r.run_id) for r in tier.rows()] == [("run-local", "r1")]


def test_an_undecodable_row_is_reported_with_its_key_and_replaced(db: Database, caplog: Any) -> None:
    tier = LocalTier(db)
    k = key({"t": 4})
    db.write(lambda c: tier.record_in(c, _entry(k, 1)))
    name = _entry(k, 1).name
    db.write(
        lambda c: c.execute(
            sa.update(step_cache).where(step_cache.c.key_digest == name).values(entry_json="{")
        )
    )
    # Pin the level on our own logger: Prefect's import (other test packages' conftests) raises the root level.
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.cache.local"):
        found = tier.lookup(k)
    assert isinstance(found, LocalUndecodable) and found.key_digest == name
    assert name in caplog.text
    assert isinstance(db.write(lambda c: tier.record_in(c, _entry(k, 3))), Replaced)


def test_rows_by_subject_are_newest_first_and_iteration_pages_through_everything(db: Database) -> None:
    clock = ManualClock()
    tier = LocalTier(db, clock=clock)
    for i in range(205):
        clock.advance(1)
        db.write(lambda c, i=i: tier.record_in(c, _entry(key({"i": i}), i, subject=f"s{i % 2}")))
    newest = tier.rows(subject="s0", limit=2)
    assert [r.components["inputs"]["0"] for r in newest if r.components] == [204, 202]
    assert sum(1 for _ in tier.iter_entries()) == 205


def test_the_settle_transaction_is_fenced_by_the_runs_owner(db_url: str, tmp_path: Path) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    m = make_machine(tmp_path, "a", shared, db_url=db_url, files={"in.txt": "x"})
    runs = RunStore(m.db)
    runs.create("r1", "flow")
    settings = load_settings(host_id="host-a")
    me = OwnerId("host-a", 1, "nonce-me")
    Ownership(m.db, owner=me, settings=settings).claim("r1")
    journaled: list[int] = []

    def hook(conn: Any, result: Any) -> None:
        journaled.append(m.journal.append_in(conn, "r1", "attempt-finished", {"outcome": result.outcome}).seq)

    assert m.dispatch(upper_node(), upper, owner=me, on_settled=hook).outcome == "built"
    assert [e.type for e in m.journal.read("r1")][-1] == "attempt-finished"
    zombie = OwnerId("host-a", 2, "nonce-zombie")
    with pytest.raises(FenceLost):
        m.dispatch(upper_node(), upper, run_id="r1", owner=zombie, on_settled=hook)
    assert len(journaled) == 1  # the zombie's hit was refused inside its transaction: nothing recorded
    m.db.close()
