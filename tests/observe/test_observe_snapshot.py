"""snapshot.read / related / is_newer: coherent batches of run observations, explicit absence, relations."""

from __future__ import annotations

import threading

import pytest

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.errors import ControlError, InvalidInput
from smthrs_plugin.observe.snapshot import (
    MAX_BATCH,
    Acknowledgement,
    Missing,
    Observed,
    Wait,
    is_newer,
    read,
    related,
)
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.stores.database import Database


def _owner(db: Database, journal: Journal, clock: ManualClock, tag: str) -> Ownership:
    return Ownership(db, owner=OwnerId("host-a", 4242, f"nonce-{tag}"), journal=journal, clock=clock)


def test_a_batch_keeps_request_order_and_duplicates_and_tells_deleted_from_never_seen(
    db: Database, runs: RunStore
) -> None:
    runs.create("a", "flow/x")
    runs.create("b", "flow/y")
    runs.create("gone", "flow/x")
    deleted = runs.delete("gone", force=True)
    batch = read(db, ["b", "nobody", "a", "gone", "b"])
    assert [i.run_id for i in batch.items] == ["b", "nobody", "a", "gone", "b"]
    b1, nobody, a, gone, b2 = batch.items
    assert isinstance(b1, Observed) and b1 == b2 and b1.flow == "flow/y" and b1.status == "pending"
    assert isinstance(a, Observed) and a.flow == "flow/x"
    assert gone == Missing("gone", deleted=True, revision=deleted.revision)
    # Never seen: no tombstone; its revision is the batch watermark, so a later creation is strictly newer.
    assert nobody == Missing("nobody", deleted=False, revision=batch.revision)
    assert batch.source == db.source_id and batch.revision == db.revision()
    runs.create("nobody", "flow/z")
    later = read(db, ["nobody"]).items[0]
    assert isinstance(later, Observed) and is_newer(later, nobody)


def test_more_than_200_ids_are_refused_and_an_empty_batch_still_reads_the_watermark(
    db: Database, runs: RunStore
) -> None:
    runs.create("a", "f")
    with pytest.raises(InvalidInput) as err:
        read(db, ["a"] * (MAX_BATCH + 1))
    assert err.value.details["bound"] == "ids" and "at most 200" in str(err.value)
    assert len(read(db, ["a"] * MAX_BATCH).items) == MAX_BATCH
    empty = read(db, [])
    assert empty.items == () and empty.revision == db.revision() and empty.source == db.source_id
    for bad in ("a", [""], ["x\x00y"], [3]):
        with pytest.raises(InvalidInput):
            read(db, bad)  # type: ignore[arg-type]


def test_an_observation_carries_lifecycle_parent_lineage_wait_and_cancellation(
    db: Database, runs: RunStore, journal: Journal, clock: ManualClock
) -> None:
    runs.create("root", "flow/x")
    runs.create("child", "flow/x", parent_run_id="root")
    runs.create("spawned", "flow/x")  # no parent column: its earliest spawn edge is its effective parent
    runs.record_run_parent("spawned", "second-parent")
    runs.record_run_parent("spawned", "later-parent")
    runs.create("round-2", "flow/x", lineage_id="root", round_ordinal=2)
    own = _owner(db, journal, clock, "one")
    assert isinstance(own.claim("child"), Activated)
    clock.advance(1)
    runs.suspend("child", own.owner, "event", wake_at_ms=clock.now_ms() + 5000, token="wake-me")
    assert isinstance(own.claim("root"), Activated)
    runs.request_cancel("root")
    runs.acknowledge_cancel("root", own.owner)
    root, child, spawned, round2 = read(db, ["root", "child", "spawned", "round-2"]).items
    assert isinstance(root, Observed) and isinstance(child, Observed)
    assert isinstance(spawned, Observed) and isinstance(round2, Observed)
    assert (
        child.parent_run_id == "root"
        and spawned.parent_run_id == "second-parent"
        and root.parent_run_id is None
    )
    assert (round2.lineage_id, round2.round_ordinal) == ("root", 2) and (
        root.lineage_id,
        root.round_ordinal,
    ) == (
        "root",
        0,
    )
    assert child.status == "suspended" and child.wait is not None
    assert child.wait == Wait("signal", "event", clock.now_ms() + 5000, child.wait.token_digest)
    assert child.wait.token_digest is not None and "wake-me" not in child.wait.token_digest
    assert root.status == "running" and root.started_at_ms is not None and root.finished_at_ms is None
    assert root.cancellation.requested_at_ms is not None
    assert root.cancellation.acknowledgement == Acknowledgement("host-a", 4242, "nonce-one", clock.now_ms())
    assert child.cancellation.requested_at_ms is None and child.cancellation.acknowledgement is None
    assert root.to_json()["cancellation"]["acknowledgement"]["nonce"] == "nonce-one"


def test_every_observation_of_a_batch_is_at_or_below_its_watermark_under_concurrent_writes(
    db: Database, runs: RunStore
) -> None:
    ids = [f"r{i:03d}" for i in range(60)]
    stop = threading.Event()

    def writer() -> None:
        for rid in ids:
            runs.create(rid, "flow/x")
            runs.request_cancel(rid)
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    batches = 0
    while not stop.is_set() or batches < 3:
        batch = read(db, ids)
        batches += 1
        observed = [i for i in batch.items if isinstance(i, Observed)]
        assert all(i.revision <= batch.revision for i in observed)
        assert all(i.revision == batch.revision for i in batch.items if isinstance(i, Missing))
        # Creations commit in id order, so one coherent snapshot sees a prefix of the ids.
        present = [isinstance(i, Observed) for i in batch.items]
        assert present == sorted(present, reverse=True)
    t.join()
    assert batches >= 3


def test_related_pages_children_and_rounds_with_cursors_bound_to_anchor_and_kind(
    db: Database, runs: RunStore
) -> None:
    runs.create("p", "flow/x")
    for i in range(5):
        runs.create(f"c{i}", "flow/x", parent_run_id="p")
    for r in (3, 1, 2):
        runs.create(f"p-round-{r}", "flow/x", lineage_id="p", round_ordinal=r)
    first = related(db, "p", "children", limit=2)
    assert isinstance(first.anchor, Observed) and first.anchor.run_id == "p"
    assert [i.run_id for i in first.items] == ["c0", "c1"] and first.cursor is not None
    seen = [i.run_id for i in first.items]
    cursor = first.cursor
    while cursor is not None:
        page = related(db, "p", "children", cursor=cursor, limit=2)
        seen += [i.run_id for i in page.items]
        cursor = page.cursor
    assert seen == ["c0", "c1", "c2", "c3", "c4"]
    rounds = related(db, "p-round-2", "rounds")
    assert [(i.run_id, getattr(i, "round_ordinal", None)) for i in rounds.items] == [
        ("p", 0),
        ("p-round-1", 1),
        ("p-round-2", 2),
        ("p-round-3", 3),
    ]
    assert rounds.cursor is None
    with pytest.raises(ControlError) as err:
        related(db, "c0", "children", cursor=first.cursor)
    assert err.value.code == "invalid_cursor"
    with pytest.raises(ControlError) as err:
        related(db, "p", "rounds", cursor=first.cursor)
    assert err.value.code == "invalid_cursor"
    with pytest.raises(ControlError) as err:
        related(db, "p", "forks")
    assert err.value.code == "invalid_options"
    with pytest.raises(ControlError) as err:
        related(db, "p", "children", limit=201)
    assert err.value.code == "invalid_options"
    missing = related(db, "nobody", "children")
    assert isinstance(missing.anchor, Missing) and missing.items == ()


def test_is_newer_orders_by_revision_and_refuses_two_sources(db: Database, runs: RunStore) -> None:
    runs.create("a", "flow/x")
    old = read(db, ["a"]).items[0]
    runs.request_cancel("a")
    new = read(db, ["a"]).items[0]
    assert is_newer(new, old) and not is_newer(old, new) and not is_newer(new, new) and is_newer(old, None)

    class Foreign:
        source = "another-db"
        revision = 1

    class Local:
        source = db.source_id
        revision = 0

    with pytest.raises(ControlError) as err:
        is_newer(Foreign(), Local())
    assert err.value.code == "source_changed"
