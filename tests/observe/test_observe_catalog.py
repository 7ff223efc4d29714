"""list_runs: filters in SQL before the limit, keyset pages in creation order, cursors bound to query and source."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.errors import ControlError
from smthrs_plugin.observe.catalog import ANY, RunFilters, list_runs
from smthrs_plugin.observe.snapshot import Observed
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.stores.database import Database, open_database

HELPER = str(Path(__file__).with_name("_observe_proc.py"))


def _all_pages(db: Database, filters: Any, limit: int) -> list[Observed]:
    out: list[Observed] = []
    cursor = None
    while True:
        page = list_runs(db, filters, cursor=cursor, limit=limit)
        out += page.runs
        if page.cursor is None:
            return out
        cursor = page.cursor


@pytest.mark.slow
def test_paging_1000_runs_under_concurrent_inserts_sees_every_prior_run_once_in_order(
    db_url: str, db: Database, runs: RunStore, clock: ManualClock
) -> None:
    rnd = random.Random(7)
    for i in range(1000):
        runs.create(f"run-{rnd.randrange(10**6):06d}-{i:04d}", "flow/a")
        if rnd.random() < 0.4:  # ties on created_at_ms are ordered by run id
            clock.advance(0.001)
    before = _all_pages(db, None, 200)
    assert len(before) == 1000
    # Another process inserts 300 runs while this one pages with varying limits; their creation times spread
    # over the whole key range, so some land behind the cursor (never revisited) and some ahead (may appear).
    first, last = before[0].created_at_ms, before[-1].created_at_ms
    step = max(1, (last - first) // 300)
    inserter = subprocess.Popen(
        [sys.executable, HELPER, "create-runs", db_url, "late-", "300", str(first), str(step)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert inserter.stdout is not None
        inserter.stdout.readline()  # the first insert committed: paging now interleaves with the rest
        seen: list[Observed] = []
        cursor = None
        while True:
            page = list_runs(db, None, cursor=cursor, limit=rnd.choice([1, 7, 20, 50]))
            seen += page.runs
            if page.cursor is None:
                break
            cursor = page.cursor
            inserter.stdout.readline()  # let ~10 more inserts commit between two pages (until it is done)
        _out, err = inserter.communicate(timeout=120)
        assert inserter.returncode == 0, err
    finally:
        if inserter.poll() is None:
            inserter.kill()
    keys = [(r.created_at_ms, r.run_id) for r in seen]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)  # in order, nothing twice
    assert [r.run_id for r in seen if not r.run_id.startswith("late-")] == [r.run_id for r in before]
    # Exhaustion is exact for what it read: the last page ended after every committed run of that moment.
    after = [r.run_id for r in _all_pages(db, None, 200)]
    assert len(after) == 1300 and set(r.run_id for r in seen) <= set(after)
    # Inserts committed between pages, ahead of the cursor, appeared (and those behind it were not revisited).
    late_seen = sum(r.run_id.startswith("late-") for r in seen)
    assert late_seen > 1


def test_a_tampered_or_foreign_cursor_or_changed_filters_are_refused(
    db: Database, runs: RunStore, clock: ManualClock, tmp_path: Path
) -> None:
    for i in range(5):
        runs.create(f"r{i}", "flow/a")
        clock.advance(0.001)
    page = list_runs(db, {"flow": "flow/a"}, limit=2)
    assert [r.run_id for r in page.runs] == ["r0", "r1"] and page.cursor is not None
    # The limit may change between pages; the filters may not.
    assert [r.run_id for r in list_runs(db, {"flow": "flow/a"}, cursor=page.cursor, limit=3).runs] == [
        "r2",
        "r3",
        "r4",
    ]
    head, body, check = page.cursor.split(".")
    for tampered in (
        f"{head}.{body[:-1]}{'A' if body[-1] != 'A' else 'B'}.{check}",
        f"{head}.{body}.{check[:-1]}0" if check[-1] != "0" else f"{head}.{body}.{check[:-1]}1",
        f"smc9.{body}.{check}",
        page.cursor[:-3],
        "not-a-cursor",
        "",
        "x" * 70_000,
    ):
        with pytest.raises(ControlError) as err:
            list_runs(db, {"flow": "flow/a"}, cursor=tampered)
        assert err.value.code == "invalid_cursor", tampered[:40]
    with pytest.raises(ControlError) as err:
        list_runs(db, {"flow": "flow/b"}, cursor=page.cursor)
    assert err.value.code == "invalid_cursor"
    other = open_database(f"sqlite:///{tmp_path / 'other.db'}")
    RunStore(other).create("r0", "flow/a")
    with pytest.raises(ControlError) as err:
        list_runs(other, {"flow": "flow/a"}, cursor=page.cursor)
    assert err.value.code == "source_changed"
    other.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"limit": 0},
        {"limit": 201},
        {"limit": True},
        {"filters": {"colour": "red"}},
        {"filters": {"status": "sleeping"}},
        {"filters": {"flow": ""}},
        {"filters": {"flow": "x" * 1025}},
        {"filters": {"created_after_ms": -1}},
        {"filters": {"waiting_reason": "\ud800"}},
    ],
)
def test_unsupported_options_are_refused_as_invalid_options(db: Database, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ControlError) as err:
        list_runs(db, **kwargs)
    assert err.value.code == "invalid_options"


def _corpus(db: Database, runs: RunStore, journal: Journal, clock: ManualClock) -> None:
    """~40 runs over every status, two flows, parents by column and by spawn edge, lineages and waits."""
    own = Ownership(db, owner=OwnerId("host-a", 1, "nonce-corpus"), journal=journal, clock=clock)
    rnd = random.Random(3)
    made: list[str] = []
    for i in range(40):
        rid = f"r{rnd.randrange(100):02d}-{i:02d}"
        flow = rnd.choice(["flow/a", "flow/b"])
        parent = rnd.choice([None, None, "p0", "p1"]) if made else None
        lineage = rnd.choice([None, None, "lin-0"])
        runs.create(rid, flow, parent_run_id=parent, lineage_id=lineage, round_ordinal=i if lineage else 0)
        if parent is None and rnd.random() < 0.3:
            runs.record_run_parent(rid, rnd.choice(["p0", "p1"]))  # effective parent by edge only
            runs.record_run_parent(rid, "p1")  # a later edge never changes the effective parent
        fate = rnd.choice(["pending", "running", "timer", "event", "completed", "failed", "cancelled"])
        if fate != "pending":
            assert isinstance(own.claim(rid), Activated)
        if fate in ("timer", "event"):
            runs.suspend(rid, own.owner, fate, wake_at_ms=clock.now_ms() + 1000)
        elif fate in ("completed", "failed"):
            runs.finish(rid, own.owner, fate)
        elif fate == "cancelled":
            runs.request_cancel(rid)
            runs.finish(rid, own.owner, "completed")
        made.append(rid)
        if rnd.random() < 0.5:
            clock.advance(0.001)
    runs.create("p0", "flow/a")
    runs.create("p1", "flow/b")


def _matches(o: Observed, f: RunFilters) -> bool:
    return (
        (f.status is None or o.status == f.status)
        and (f.flow is None or o.flow == f.flow)
        and (f.parent_run_id is ANY or o.parent_run_id == f.parent_run_id)
        and (f.lineage_id is None or o.lineage_id == f.lineage_id)
        and (f.waiting_reason is ANY or (o.wait.reason if o.wait else None) == f.waiting_reason)
        and (f.created_after_ms is None or o.created_at_ms >= f.created_after_ms)
        and (f.created_before_ms is None or o.created_at_ms <= f.created_before_ms)
    )


def test_every_filter_combination_matches_a_brute_force_filter_of_the_corpus(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock
) -> None:
    _corpus(db, runs, journal, clock)
    everything = _all_pages(db, None, 200)
    assert len(everything) == 42
    assert [(o.created_at_ms, o.run_id) for o in everything] == sorted(
        (o.created_at_ms, o.run_id) for o in everything
    )
    times = sorted(o.created_at_ms for o in everything)
    lo, hi = times[10], times[30]
    assert {o.status for o in everything} == {
        "pending",
        "running",
        "suspended",
        "completed",
        "failed",
        "cancelled",
    }
    assert any(o.parent_run_id for o in everything if o.parent_run_id) and any(o.wait for o in everything)
    combos = itertools.product(
        [None, "pending", "suspended", "completed"],
        [None, "flow/a"],
        [ANY, None, "p0", "p1"],
        [None, "lin-0"],
        [ANY, None, "timer"],
        [None, lo],
        [None, hi],
    )
    checked = nonempty = 0
    for status, flow, parent, lineage, waiting, after, before in combos:
        f = RunFilters(status, flow, parent, lineage, waiting, after, before)
        expected = [o.run_id for o in everything if _matches(o, f)]
        assert [o.run_id for o in list_runs(db, f, limit=200).runs] == expected, f
        if expected and (checked % 3 == 0):
            assert [o.run_id for o in _all_pages(db, f, 3)] == expected, f
        checked += 1
        nonempty += bool(expected)
    assert checked == 4 * 2 * 4 * 2 * 3 * 2 * 2 and nonempty > 100


def test_cli_runs_pages_with_filters_and_show_reports_a_run_or_its_absence(
    db: Database, db_url: str, runs: RunStore, clock: ManualClock
) -> None:
    from smthrs_plugin.cli import app

    for i in range(3):
        runs.create(f"cli-{i}", "flow/cli")
        clock.advance(0.001)
    runs.create("gone", "flow/cli")
    runs.delete("gone", force=True)
    cli = CliRunner()
    first = cli.invoke(app, ["runs", "--db", db_url, "--flow", "flow/cli", "--limit", "2", "--json"])
    assert first.exit_code == 0, first.output
    doc = json.loads(first.output)
    assert [r["run_id"] for r in doc["runs"]] == ["cli-0", "cli-1"] and doc["cursor"]
    nxt = cli.invoke(app, ["runs", "--db", db_url, "--flow", "flow/cli", "--cursor", doc["cursor"], "--json"])
    assert [r["run_id"] for r in json.loads(nxt.output)["runs"]] == ["cli-2"]
    text = cli.invoke(app, ["runs", "--db", db_url, "--status", "pending", "--roots"])
    assert text.exit_code == 0 and "cli-0" in text.output and "next page" not in text.output
    bad = cli.invoke(app, ["runs", "--db", db_url, "--status", "sleeping", "--json"])
    assert bad.exit_code == 2 and json.loads(bad.output)["error"]["code"] == "invalid_options"
    shown = cli.invoke(app, ["show", "cli-1", "--db", db_url, "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["run"]["flow"] == "flow/cli"
    gone = cli.invoke(app, ["show", "gone", "--db", db_url, "--json"])
    assert gone.exit_code == 2 and json.loads(gone.output)["run"] == {
        "tag": "missing",
        "run_id": "gone",
        "deleted": True,
        "revision": json.loads(gone.output)["run"]["revision"],
    }
