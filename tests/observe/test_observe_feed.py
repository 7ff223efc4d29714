"""The change feed: coalesced revision-ordered changes, tombstones kept forever, rebuilding a projection from 0."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.errors import ControlError
from smthrs_plugin.observe.feed import Change, changes_since, current, is_newer
from smthrs_plugin.observe.snapshot import Missing, Observed, read
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.stores.database import Database, open_database


def _drain(db: Database, source: str, revision: int, limit: int) -> tuple[list[Change], int]:
    out: list[Change] = []
    while True:
        page = changes_since(db, source, revision, limit=limit)
        assert page.source == source and page.next_revision <= page.revision
        assert all(c.revision > revision for c in page.changes)
        out += page.changes
        revision = page.next_revision
        if not page.has_more:
            return out, revision


def test_deletes_produce_tombstones_that_survive_later_writes_and_reopening(
    db_url: str, db: Database, runs: RunStore
) -> None:
    runs.create("doomed", "flow/x")
    runs.create("keeper", "flow/x")
    deleted = runs.delete("doomed", force=True)
    for i in range(20):
        runs.create(f"later-{i}", "flow/x")
        runs.request_cancel(f"later-{i}")
    db.close()
    reopened = open_database(db_url)
    source = current(reopened).source
    changes, _ = _drain(reopened, source, 0, 7)
    tomb = [c for c in changes if c.run_id == "doomed"]
    assert tomb == [Change("doomed", source, deleted.revision, True)]
    # A consumer whose checkpoint is just before the deletion still learns of it.
    assert [c.run_id for c in changes_since(reopened, source, deleted.revision - 1, limit=1).changes] == [
        "doomed"
    ]
    # Recreating the id replaces absence with a strictly newer live revision: one live entry, no tombstone.
    RunStore(reopened).create("doomed", "flow/y")
    again, _ = _drain(reopened, source, 0, 1000)
    doomed = [c for c in again if c.run_id == "doomed"]
    assert len(doomed) == 1 and not doomed[0].deleted and doomed[0].revision > deleted.revision
    reopened.close()


def test_changes_are_coalesced_per_run_in_revision_order_and_exhaustion_lands_on_the_watermark(
    db: Database, runs: RunStore
) -> None:
    runs.create("a", "flow/x")
    runs.create("b", "flow/x")
    runs.request_cancel("a")  # a's latest revision is now after b's
    pos = current(db)
    page = changes_since(db, pos.source, 0, limit=1000)
    assert [(c.run_id, c.deleted) for c in page.changes] == [("b", False), ("a", False)]
    assert [c.revision for c in page.changes] == sorted(c.revision for c in page.changes)
    assert page.has_more is False and page.next_revision == page.revision == pos.revision
    empty = changes_since(db, pos.source, pos.revision)
    assert empty.changes == () and empty.next_revision == pos.revision and not empty.has_more


def test_a_consumer_starting_at_revision_0_rebuilds_exactly_the_current_set(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock
) -> None:
    rnd = random.Random(11)
    own = Ownership(db, owner=OwnerId("host-a", 1, "nonce-feed"), journal=journal, clock=clock)
    projection: dict[str, Observed] = {}
    source = current(db).source
    checkpoint = 0

    def catch_up() -> None:
        nonlocal checkpoint
        while True:
            page = changes_since(db, source, checkpoint, limit=3)
            live = [c.run_id for c in page.changes if not c.deleted]
            fresh = dict(zip(live, read(db, live).items, strict=True))
            for c in page.changes:
                seen = projection.get(c.run_id)
                obs = fresh.get(c.run_id)
                if c.deleted or isinstance(obs, Missing):
                    evidence = obs if isinstance(obs, Missing) else c  # deleted again after the feed entry
                    if seen is None or is_newer(evidence, seen):
                        projection.pop(c.run_id, None)
                elif isinstance(obs, Observed) and is_newer(obs, seen):
                    projection[c.run_id] = obs
            checkpoint = page.next_revision  # stored with the projection, in the same local transaction
            if not page.has_more:
                return

    alive: list[str] = []
    for step in range(150):
        op = rnd.random()
        if op < 0.45 or not alive:
            rid = f"r{rnd.randrange(60):02d}"  # ids recur: deleted ids get recreated
            runs.create(rid, rnd.choice(["flow/a", "flow/b"]))
            if rid not in alive:
                alive.append(rid)
        elif op < 0.6:
            rid = rnd.choice(alive)
            if isinstance(own.claim(rid), Activated):
                runs.finish(rid, own.owner, "completed")
        elif op < 0.75:
            runs.request_cancel(rnd.choice(alive))
        else:
            rid = rnd.choice(alive)
            runs.delete(rid, force=True)
            alive.remove(rid)
        if step % 37 == 0:
            catch_up()  # consumers catch up in the middle of history, not only at the end
    catch_up()
    truth = {o.run_id: o for o in read(db, sorted(alive)).items if isinstance(o, Observed)}
    assert projection == truth and len(truth) == len(alive)
    # From scratch, too.
    projection.clear()
    checkpoint = 0
    catch_up()
    assert projection == truth


def test_a_foreign_or_rewound_checkpoint_and_bad_limits_are_refused(
    db: Database, runs: RunStore, tmp_path: Path
) -> None:
    runs.create("a", "flow/x")
    pos = current(db)
    other = open_database(f"sqlite:///{tmp_path / 'other.db'}")
    with pytest.raises(ControlError) as err:
        changes_since(other, pos.source, 0)
    assert err.value.code == "source_changed"
    with pytest.raises(ControlError) as err:
        changes_since(db, pos.source, pos.revision + 1)
    assert err.value.code == "source_changed" and "rebuild" in str(err.value)
    for limit in (0, 1001, True):
        with pytest.raises(ControlError) as err:
            changes_since(db, pos.source, 0, limit=limit)
        assert err.value.code == "invalid_options"
    with pytest.raises(ControlError) as err:
        changes_since(db, pos.source, -1)
    assert err.value.code == "invalid_options"
    other.close()
