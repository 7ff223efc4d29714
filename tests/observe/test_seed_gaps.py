"""Two observation contracts shared with the reference engine: ``watch`` without ``follow`` is the live stream
(``follow=False`` is the finite snapshot; the ``smthrs watch`` command keeps the snapshot as its default and
``--follow`` as an explicit flag), and the metric instruments carry the reference's ``flows_engine_*`` names, so a
dashboard built on those names finds these series."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from smthrs_plugin.observe import INSTRUMENT_NAMES, watch
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.stores.database import Database, open_database

#: Generous bound on waiting for a delivery; a broken stream fails instead of hanging. Never asserted on.
_WAIT_S = 60.0

#: The reference engine's instrument names (its metrics guide's table), in that table's order.
REFERENCE_INSTRUMENTS = (
    "flows_engine_dispatches",
    "flows_engine_dispatch_duration",
    "flows_engine_scheduler_admissions",
    "flows_engine_scheduler_dispatch_duration",
    "flows_engine_scheduler_nodes",
    "flows_engine_sandbox_executions",
    "flows_engine_sandbox_execution_duration",
    "flows_engine_sandbox_materializations",
    "flows_engine_sandbox_materialization_duration",
    "flows_engine_sandbox_conflicts",
    "flows_engine_boundary_settlements",
    "flows_engine_step_cache_decisions",
    "flows_engine_claims",
)


# -- watch: live unless asked for a snapshot --------------------------------------------------------------------


def test_watch_with_follow_omitted_opens_the_live_stream_and_does_not_end_after_the_snapshot(
    db: Database, journal: Journal
) -> None:
    journal.append("run-live", "step", {"i": 0})
    journal.append("run-live", "step", {"i": 1})
    with watch(db, "run-live", poll_interval_s=0.02) as stream:
        assert stream.follow is True
        first = [stream.next_within(_WAIT_S), stream.next_within(_WAIT_S)]
        assert [e.payload["i"] for e in first if e is not None] == [0, 1]  # the snapshot
        # The snapshot is exhausted and the stream is still open: a later commit arrives on the same iterator.
        journal.append("run-live", "step", {"i": 2})
        later = stream.next_within(_WAIT_S)
        assert later is not None and later.payload == {"i": 2} and later.sequence == 2
        assert not stream.closed
        assert stream.stats.snapshot == 2 and stream.stats.tail == 1
    assert stream.closed


def test_watch_with_follow_false_is_a_finite_snapshot(db: Database, journal: Journal) -> None:
    for i in range(3):
        journal.append("run-snap", "step", {"i": i})
    stream = watch(db, "run-snap", follow=False)
    assert stream.follow is False
    assert [e.sequence for e in stream] == [0, 1, 2]  # the iteration ends by itself
    assert stream.stats.tail == 0


def test_the_watch_command_keeps_the_snapshot_as_its_default_and_documents_the_library_default(
    tmp_path: Path,
) -> None:
    from smthrs_plugin.cli import app

    url = f"sqlite:///{tmp_path / 'state.db'}"
    db = open_database(url)
    try:
        Journal(db).append("run-cli", "step", {"i": 0})
    finally:
        db.close()
    cli = CliRunner()
    shown = cli.invoke(app, ["watch", "run-cli", "--db", url, "--json"])  # no --follow: it must end
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    assert [e["payload"] for e in doc["events"]] == [{"i": 0}] and doc["run_id"] == "run-cli"
    helped = cli.invoke(app, ["watch", "--help"], env={"COLUMNS": "200"})
    assert helped.exit_code == 0
    text = " ".join(helped.output.split())
    assert "--follow" in text and "follow=False" in text


# -- metric names ---------------------------------------------------------------------------------------------


def test_instruments_carry_the_reference_engine_metric_names() -> None:
    # What a host's reader sees is these names and no other: tests/observe/test_observe_metrics.py records every
    # instrument once and compares the names it finds with INSTRUMENT_NAMES.
    assert INSTRUMENT_NAMES == REFERENCE_INSTRUMENTS
