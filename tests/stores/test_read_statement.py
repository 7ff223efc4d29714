"""``Database.read_statement`` on each SQL backend (the root ``db`` fixture): the local cache tier's lookup of every
hit runs on a reader connection kept between calls (SQLite), and a kept reader must never answer from an old
snapshot — a row invalidated or written after the last read is seen by the next one, from any thread."""

from __future__ import annotations

import pytest
from _threads import run_threads

from smthrs_plugin.errors import StoreError
from smthrs_plugin.records import cache_index
from smthrs_plugin.stores.database import Database


def _row(entry: str) -> cache_index.NewRow:
    return cache_index.NewRow(
        key="key1_x", entry_json=entry, components={}, run_id="r", provenance={}, subject="s", scope="shared"
    )


def test_a_kept_reader_sees_every_commit_made_after_its_last_read(db: Database) -> None:
    assert cache_index.served(db, "k") is None  # the reader is kept now, between two statements

    db.write(lambda c: cache_index.insert_in(c, "k", _row('{"v":1}'), 1))
    first = cache_index.served(db, "k")
    db.write(lambda c: cache_index.replace_in(c, "k", _row('{"v":2}'), 2))
    second = cache_index.served(db, "k")
    db.write(lambda c: cache_index.invalidate_in(c, "k", 3))
    third = cache_index.served(db, "k")

    assert first is not None and first.entry_json == '{"v":1}'
    assert second is not None and second.entry_json == '{"v":2}'
    assert third is None  # an invalidated row is never served from a reader's earlier snapshot


def test_readers_on_other_threads_see_a_commit_as_soon_as_it_returns(db: Database) -> None:
    db.write(lambda c: cache_index.insert_in(c, "k", _row('{"v":1}'), 1))
    for _ in range(4):  # several readers kept, each having read the old row
        assert cache_index.served(db, "k") is not None
    db.write(lambda c: cache_index.invalidate_in(c, "k", 2))
    seen: list[object] = []
    errors = run_threads(lambda _i: seen.append(cache_index.served(db, "k")), 4)

    assert errors == [] and seen == [None] * 4


def test_inside_an_open_write_it_sees_that_transactions_own_rows(db: Database) -> None:
    def tx(c: object) -> object:
        cache_index.insert_in(c, "k", _row('{"v":1}'), 1)  # type: ignore[arg-type]
        return cache_index.served(db, "k")

    inside = db.write(tx)

    assert inside is not None and inside.entry_json == '{"v":1}'


def test_a_failing_read_is_a_typed_store_error_and_the_next_read_works(db: Database) -> None:
    db.write(lambda c: cache_index.insert_in(c, "k", _row('{"v":1}'), 1))
    assert cache_index.served(db, "k") is not None
    db.write(lambda c: c.exec_driver_sql("ALTER TABLE step_cache RENAME TO step_cache_gone"))

    with pytest.raises(StoreError):
        cache_index.served(db, "k")

    db.write(lambda c: c.exec_driver_sql("ALTER TABLE step_cache_gone RENAME TO step_cache"))
    again = cache_index.served(db, "k")
    assert again is not None and again.entry_json == '{"v":1}'
