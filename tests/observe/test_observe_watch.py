"""watch: the journal as ControlEvents — finite snapshots, the live tail across processes, cursors and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from smthrs_plugin.errors import ControlError, InvalidInput
from smthrs_plugin.observe.watch import PARTITIONS_PER_BATCH, ControlEvent, watch
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.stores.database import Database, open_database

HELPER = str(Path(__file__).with_name("_observe_proc.py"))


class Proc:
    """A helper process whose JSON stdout lines are read one at a time."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, HELPER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def until(self, event: str, timeout: float = 60) -> dict[str, Any]:
        import selectors

        assert self.p.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        while True:
            if not sel.select(timeout):
                raise AssertionError(f"helper said nothing for {timeout}s")
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(
                    f"helper exited: {self.p.wait()} {self.p.stderr.read() if self.p.stderr else ''}"
                )
            msg = json.loads(line)
            if msg["event"] == event:
                return msg

    def finish(self, timeout: float = 60) -> None:
        _out, err = self.p.communicate(timeout=timeout)
        assert self.p.returncode == 0, err

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


def _take(stream: Any, n: int, timeout_s: float = 120.0) -> list[ControlEvent]:
    out = []
    while len(out) < n:
        ev = stream.next_within(timeout_s)
        assert ev is not None, f"no event within {timeout_s}s after {len(out)} of {n}"
        out.append(ev)
    return out


@pytest.mark.slow
def test_follow_resumed_20_times_from_its_cursor_sees_another_process_appends_exactly_once_in_order(
    db_url: str, db: Database, journal: Journal, procs: list[Proc]
) -> None:
    total = 200
    appender = Proc("append", db_url, "run-w", str(total), "6")
    procs.append(appender)
    appender.until(
        "appended"
    )  # some entries exist before the first session: its snapshot→tail handoff matters
    # Uneven session sizes (summing to `total`), so disconnects fall inside the snapshot and inside the tail.
    sizes = [1, 17, 3, 9, 12, 5, 8, 14, 2, 11, 10, 6, 13, 4, 15, 7, 16, 9, 12, 26]
    assert len(sizes) == 20 and sum(sizes) == total
    seen: list[ControlEvent] = []
    cursor: str | None = None
    snapshot = tail = 0
    for size in sizes:
        with watch(db, "run-w", follow=True, after_cursor=cursor, poll_interval_s=0.02) as stream:
            got = _take(stream, size)
        seen += got
        cursor = got[-1].cursor
        snapshot, tail = snapshot + stream.stats.snapshot, tail + stream.stats.tail
    appender.finish()
    assert [e.sequence for e in seen] == list(range(total))
    assert [e.payload["i"] for e in seen] == list(range(total))
    assert {e.kind for e in seen} == {"tick"} and {e.run_id for e in seen} == {"run-w"}
    # Both paths delivered: a resumed session's snapshot, and the polled tail (the only way another process's
    # commits reach this one: its in-process subscription never hears of them).
    assert snapshot > 0 and tail > 0 and snapshot + tail == total
    # Nothing after the last cursor: the 21st session's snapshot is empty.
    assert list(watch(db, "run-w", follow=False, after_cursor=cursor)) == []


def test_follow_hands_off_from_snapshot_to_tail_without_gap_or_duplicate_under_local_appends(
    db: Database, journal: Journal
) -> None:
    for i in range(30):
        journal.append("run-h", "before", {"i": i})
    stream = watch(db, "run-h", follow=True, poll_interval_s=5.0)  # the subscription alone must wake the tail

    def writer() -> None:
        for i in range(30, 90):
            journal.append("run-h", "during", {"i": i})

    t = threading.Thread(target=writer)
    t.start()
    got = _take(stream, 90)
    t.join()
    stream.close()
    assert stream.stats.snapshot >= 30 and stream.stats.tail > 0
    assert [e.payload["i"] for e in got] == list(range(90))
    assert [e.sequence for e in got] == list(range(90))


def test_a_finite_snapshot_ends_and_resumes_after_a_sequence_or_cursor(
    db: Database, journal: Journal
) -> None:
    for i in range(5):
        journal.append("run-s", "step", {"i": i})
    journal.append("run-other", "step", {"i": 99})
    events = list(watch(db, "run-s", follow=False))
    assert [e.sequence for e in events] == [0, 1, 2, 3, 4]
    assert [e.sequence for e in watch(db, "run-s", follow=False, after_sequence=2)] == [3, 4]
    assert [e.sequence for e in watch(db, "run-s", follow=False, after_cursor=events[1].cursor)] == [2, 3, 4]
    assert events[0].occurred_at > 0 and events[0].payload == {"i": 0}


def test_an_unscoped_snapshot_reads_every_partition_in_bounded_batches_keeping_each_partitions_order(
    db: Database, journal: Journal
) -> None:
    partitions = [f"run-{k:02d}" for k in range(3 * PARTITIONS_PER_BATCH + 3)] + ["plan:p1"]
    for round_ in range(4):
        for p in partitions:
            journal.append(p, "step", {"round": round_})
    events = list(watch(db, follow=False))
    assert len(events) == 4 * len(partitions)
    by_partition: dict[str, list[int]] = {}
    for e in events:
        by_partition.setdefault(e.partition, []).append(e.sequence)
    assert by_partition == {p: [0, 1, 2, 3] for p in partitions}
    plan_events = [e for e in events if e.partition == "plan:p1"]
    assert {e.run_id for e in plan_events} == {None}


def test_an_unscoped_follow_delivers_old_and_new_partitions_exactly_once(
    db: Database, journal: Journal
) -> None:
    old = [f"a-{k:02d}" for k in range(2 * PARTITIONS_PER_BATCH)]
    for p in old:
        journal.append(p, "old", {})
    stream = watch(db, follow=True, poll_interval_s=0.02)
    first = _take(stream, 3)  # mid-snapshot: new partitions sort both before and after the scan position
    new = ["0-first", "m-middle", "z-last"]
    for p in new + old[:2]:
        journal.append(p, "new", {})
    rest = _take(stream, len(old) + len(new) + 2 - 3)
    stream.close()
    got = first + rest
    assert sorted((e.partition, e.sequence) for e in got) == sorted(
        [(p, 0) for p in old + new] + [(p, 1) for p in old[:2]]
    )
    assert len(set((e.partition, e.sequence) for e in got)) == len(got)
    assert list(stream) == []  # closed


def test_closing_from_another_thread_ends_a_blocked_follow(db: Database) -> None:
    stream = watch(db, "run-quiet", follow=True, poll_interval_s=0.05)
    results: list[list[ControlEvent]] = []
    t = threading.Thread(target=lambda: results.append(list(stream)))
    t.start()
    threading.Timer(0.2, stream.close).start()
    t.join(timeout=120)
    assert not t.is_alive() and results == [[]] and stream.closed


@pytest.mark.parametrize(
    "kwargs,bound",
    [({"after_sequence": 3}, "after_sequence"), ({"after_cursor": "smc1.x.y"}, "after_cursor")],
)
def test_a_cursor_without_a_run_id_is_refused_saying_it_needs_one(
    db: Database, kwargs: dict[str, Any], bound: str
) -> None:
    with pytest.raises(InvalidInput) as err:
        watch(db, None, **kwargs)
    assert err.value.code == "invalid_input" and err.value.details["bound"] == bound
    assert f"{bound}: a watch cursor resumes one run, so it requires run_id" in str(err.value)


def test_bad_watch_options_are_refused_before_reading(db: Database) -> None:
    with pytest.raises(InvalidInput):
        watch(db, "r", after_sequence=1, after_cursor="smc1.x.y")
    with pytest.raises(InvalidInput):
        watch(db, "r", after_sequence=-1)
    with pytest.raises(InvalidInput):
        watch(db, "")
    with pytest.raises(ControlError) as err:
        watch(db, "r", poll_interval_s=0)
    assert err.value.code == "invalid_options"


def test_watch_cursors_are_bound_to_their_partition_and_database(
    db: Database, journal: Journal, tmp_path: Path
) -> None:
    journal.append("run-a", "step", {})
    cursor = next(iter(watch(db, "run-a", follow=False))).cursor
    with pytest.raises(ControlError) as err:
        watch(db, "run-b", after_cursor=cursor)
    assert err.value.code == "invalid_cursor"
    head, body, check = cursor.split(".")
    tampered = f"{head}.{body[:-2]}{'A' if body[-2] != 'A' else 'B'}{body[-1]}.{check}"
    with pytest.raises(ControlError) as err:
        watch(db, "run-a", after_cursor=tampered)
    assert err.value.code == "invalid_cursor"
    other = open_database(f"sqlite:///{tmp_path / 'other.db'}")
    with pytest.raises(ControlError) as err:
        watch(other, "run-a", after_cursor=cursor)
    assert err.value.code == "source_changed"
    other.close()


def test_cli_watch_prints_the_snapshot_as_one_json_object_and_follows_as_json_lines(
    db: Database, db_url: str, journal: Journal
) -> None:
    from smthrs_plugin.cli import app

    for i in range(3):
        journal.append("run-cli", "step", {"i": i})
    runner = CliRunner()
    snap = runner.invoke(app, ["watch", "run-cli", "--db", db_url, "--json"])
    assert snap.exit_code == 0, snap.output
    doc = json.loads(snap.output)
    assert [e["payload"]["i"] for e in doc["events"]] == [0, 1, 2] and doc["cursor"] == doc["events"][-1][
        "cursor"
    ]
    after = runner.invoke(
        app, ["watch", "run-cli", "--db", db_url, "--json", "--after-cursor", doc["events"][0]["cursor"]]
    )
    assert [e["sequence"] for e in json.loads(after.output)["events"]] == [1, 2]
    live = runner.invoke(app, ["watch", "run-cli", "--db", db_url, "--json", "--follow", "--max-events", "2"])
    assert live.exit_code == 0 and [json.loads(x)["sequence"] for x in live.output.splitlines()] == [0, 1]
    refused = runner.invoke(app, ["watch", "run-cli", "--db", db_url, "--json", "--after-cursor", "nope"])
    assert refused.exit_code == 2 and json.loads(refused.output)["error"]["code"] == "invalid_cursor"


def test_an_abandoned_follow_stream_leaves_no_subscription_behind(db: Database, journal: Journal) -> None:
    import gc

    from smthrs_plugin.records.journal import _hub_for

    hub = _hub_for(db.url)
    before = len(hub._subs)
    stream = watch(db, "run-x", follow=True)
    assert len(hub._subs) == before + 1
    del stream
    gc.collect()
    assert len(hub._subs) == before
    journal.append("run-x", "step", {})  # publishing to nobody is harmless
