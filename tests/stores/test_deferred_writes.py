"""Deferred writes (``Database.allow_deferred``: the scheduler's group commits), on each SQL backend (the root ``db``
fixture). On PostgreSQL they are sent with the COMMIT in one round trip (pipeline mode), so their errors surface at
the commit: each test pins that such a transaction still behaves as if every statement had run at once."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import pytest
from _store_support import ownership
from _threads import run_threads
from sqlalchemy.engine import Connection

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.canonical import key
from smthrs_plugin.errors import StoreError
from smthrs_plugin.records.attempts import AttemptStore
from smthrs_plugin.records.journal import Journal, JournalEvent
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database, open_database


def _deferred_appends(db: Database, journal: Journal, partition: str, texts: list[str]) -> None:
    def body(conn: Connection) -> None:
        db.allow_deferred()
        for text in texts:
            journal.append_canonical_in(conn, partition, "t", text)

    db.write(body)


def _driver_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What psycopg logged: a failure is the error raised, never also a warning in the user's log."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("psycopg")]


@dataclass
class Begun:
    attempts: AttemptStore
    owner: OwnerId
    key: str


@pytest.fixture
def begun(db: Database, journal: Journal, runs: RunStore, clock: ManualClock, settings: Settings) -> Begun:
    """Run ``r`` claimed, with attempt 1 of one key begun and committed."""
    a = ownership(db, journal, clock, settings, "a")
    attempts = AttemptStore(db, clock=clock)
    runs.create("r", "flow")
    a.claim("r")
    k = key({"node": "build"})
    db.write(lambda c: attempts.begin_in(c, "r", a.owner, k, attempt=1, node_id="build", meta=None))
    return Begun(attempts, a.owner, k)


def test_concurrent_deferred_appends_get_distinct_contiguous_sequences_and_no_driver_warning(
    db: Database, journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    # Every writer allocates max(seq)+1 of one partition at its commit: on PostgreSQL the losers of each race fail
    # with a serialization failure raised by the pipelined COMMIT and run again; none is lost or doubled.
    def writer(i: int) -> None:
        for k in range(10):
            texts = [f'{{"i":{i},"k":{k},"n":0}}', f'{{"i":{i},"k":{k},"n":1}}']
            _deferred_appends(db, journal, "hot", texts)

    with caplog.at_level(logging.WARNING):
        assert run_threads(writer, 4) == []
    # A retried serialization failure is handled, not something for the driver to warn about in the user's log.
    assert _driver_warnings(caplog) == []
    events = journal.read("hot", limit=1000)
    assert [e.seq for e in events] == list(range(80))
    # Each transaction's two records are adjacent and in append order.
    for first, second in zip(events[::2], events[1::2], strict=True):
        assert (first.payload["i"], first.payload["k"]) == (second.payload["i"], second.payload["k"])
        assert (first.payload["n"], second.payload["n"]) == (0, 1)


def test_a_deferred_write_refused_at_commit_rolls_back_the_whole_transaction(
    db: Database, journal: Journal, begun: Begun, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[JournalEvent] = []

    def body(conn: Connection) -> None:
        db.allow_deferred()
        journal.append_canonical_in(conn, "p", "t", '{"n":0}')
        # Attempt 1 is taken: the deferred row is refused by the primary key when it is written, at the commit.
        begun.attempts.begin_in(conn, "r", begun.owner, begun.key, attempt=1, node_id="build", meta=None)
        journal.append_canonical_in(conn, "p", "t", '{"n":1}')

    with caplog.at_level(logging.WARNING), journal.subscribe(seen.append):
        with pytest.raises(StoreError):
            db.write(body)
        # Nothing of it committed and nobody was told; the connection serves the next transaction.
        assert journal.read("p", limit=10) == [] and seen == []
        _deferred_appends(db, journal, "p", ['{"n":2}'])
    assert [(e.seq, e.payload) for e in journal.read("p", limit=10)] == [(0, {"n": 2})]
    assert [e.payload for e in seen] == [{"n": 2}]
    assert _driver_warnings(caplog) == []


def test_records_deferred_after_a_flush_inside_the_transaction_follow_the_flushed_ones(
    db: Database, journal: Journal
) -> None:
    # The first record is written by the body's own flush (a store about to touch its table does this), the second
    # with the commit: one sequence, in append order.
    def body(conn: Connection) -> None:
        db.allow_deferred()
        journal.append_canonical_in(conn, "q", "t", '{"n":0}')
        db.flush_deferred()
        journal.append_canonical_in(conn, "q", "t", '{"n":1}')

    db.write(body)
    assert [(e.seq, e.payload["n"]) for e in journal.read("q", limit=10)] == [(0, 0), (1, 1)]


def test_a_serialization_failure_at_a_pipelined_commit_reruns_the_whole_transaction(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Both transactions read the partition's head, then both defer a record at it: the second commit's pipeline
    # fails with 40001 and Database.write runs that callback again, on a fresh snapshot.
    db = open_database(postgres_url)
    journal = Journal(db)
    barrier = threading.Barrier(2, timeout=120)
    calls: list[str] = []

    def body(conn: Connection, name: str) -> None:
        db.allow_deferred()
        calls.append(name)
        conn.exec_driver_sql("SELECT max(seq) FROM journal_events WHERE partition = 'p'")
        if calls.count(name) == 1:
            barrier.wait()  # both hold a snapshot in which the head is the same
        journal.append_canonical_in(conn, "p", "t", f'{{"by":"{name}"}}')

    with caplog.at_level(logging.WARNING):
        assert run_threads(lambda i: db.write(lambda c: body(c, "ab"[i])), 2) == []
    assert sorted(calls) in (["a", "a", "b"], ["a", "b", "b"])
    assert sorted(e.payload["by"] for e in journal.read("p")) == ["a", "b"]
    assert [e.seq for e in journal.read("p")] == [0, 1]
    assert _driver_warnings(caplog) == []
    db.close()


def test_a_deferred_write_refused_when_flushed_mid_transaction_is_raised_there(
    db: Database, journal: Journal, begun: Begun, caplog: pytest.LogCaptureFixture
) -> None:
    # Settling an attempt begun in an earlier transaction flushes the deferred rows first (the owner's rule): the
    # refusal of one of them is raised by that settlement, inside the body, and nothing of the body commits.
    attempts, owner, k = begun.attempts, begun.owner, begun.key
    db.write(lambda c: attempts.begin_in(c, "r", owner, k, attempt=2, node_id="build", meta=None))
    raised: list[str] = []

    def body(conn: Connection) -> None:
        db.allow_deferred()
        journal.append_canonical_in(conn, "p", "t", '{"n":0}')
        attempts.begin_in(conn, "r", owner, k, attempt=1, node_id="build", meta=None)  # taken: refused
        try:
            attempts.complete_in(conn, "r", owner, k, 2, result=None, meta=None)
        except Exception as exc:  # the driver's refusal; Database.write maps it to StoreError
            raised.append(type(exc).__name__)
            raise

    with caplog.at_level(logging.WARNING), pytest.raises(StoreError):
        db.write(body)
    assert raised == ["IntegrityError"]
    assert journal.read("p", limit=10) == []
    assert _driver_warnings(caplog) == []


def test_without_pipeline_mode_deferred_writes_commit_one_statement_at_a_time(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A psycopg built against a libpq older than 14 has no pipeline mode: the same transactions still commit.
    import psycopg

    def refused(self: object) -> None:
        raise psycopg.NotSupportedError("libpq too old for pipeline mode")

    monkeypatch.setattr(psycopg.Pipeline, "is_supported", classmethod(lambda cls: False))
    monkeypatch.setattr(psycopg.Connection, "pipeline", refused)
    db = open_database(postgres_url)
    journal = Journal(db)
    _deferred_appends(db, journal, "p", ['{"n":0}', '{"n":1}'])

    def body(conn: Connection) -> None:
        db.allow_deferred()
        journal.append_canonical_in(conn, "p", "t", '{"n":2}')
        journal.append_canonical_in(conn, "p", "t", '{"n":3}')
        db.flush_deferred()  # the mid-transaction executemany, outside any pipeline
        journal.append_canonical_in(conn, "p", "t", '{"n":4}')

    db.write(body)
    assert [(e.seq, e.payload["n"]) for e in journal.read("p", limit=10)] == [(i, i) for i in range(5)]
    db.close()
