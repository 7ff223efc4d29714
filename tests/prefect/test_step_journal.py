"""``step-settled`` records of ``@step`` hits (``prefect/_stepjournal.py``): buffered off the hit's path, and
written before the run they belong to is parked or settled — a batch the background flusher already took
included."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

import smthrs_plugin as sp
from smthrs_plugin.engine.lease import FRESH, Refused, acquire
from smthrs_plugin.prefect import _stepjournal
from smthrs_plugin.prefect._stepjournal import EVENT_TYPE, flush_hits, record_settled

DEADLINE_S = 120.0  # an upper bound on waiting for a thread; a failure, never a measurement


def test_a_flush_returns_only_once_a_batch_the_flusher_took_before_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race this pins: the flusher thread takes the run's buffered hits and is still writing them when the
    # flow run parks; the park's flush found nothing pending and returned, the park released the run, and the
    # flusher's late write then failed the fence: the hit records were dropped.
    with sp.open_runtime(tmp_path / "ws") as rt:
        lease = acquire(
            f"step-{uuid.uuid4().hex}", "flow", FRESH, ownership=rt.ownership, runs=rt.runs, waits=rt.waits
        )
        assert not isinstance(lease, Refused)
        with lease:
            run_id, owner = lease.run_id, rt.ownership.owner
            taken, release = threading.Event(), threading.Event()
            order: list[str] = []
            real = _stepjournal._write

            def held_write(rt_: Any, rid: str, own: Any, payloads: Any) -> None:
                if threading.current_thread().name == "smthrs-step-journal":
                    taken.set()  # the flusher has the batch; it writes when the test says so
                    assert release.wait(DEADLINE_S)
                real(rt_, rid, own, payloads)
                order.append("written")

            monkeypatch.setattr(_stepjournal, "_write", held_write)
            record_settled(rt, run_id, owner, {"step": "tests.hit", "outcome": "clean"}, hit=True)
            assert taken.wait(DEADLINE_S), "the flusher never took the buffered hit"

            flusher = threading.Thread(target=lambda: (flush_hits(run_id), order.append("flushed")))
            flusher.start()
            flusher.join(0.5)  # not a synchronisation: with the batch held, the flush must still be waiting
            assert flusher.is_alive(), "flush_hits returned while the run's batch was still being written"
            release.set()
            flusher.join(DEADLINE_S)
            assert not flusher.is_alive()
            assert order == ["written", "flushed"]
            assert [e.type for e in rt.journal.read(run_id)].count(EVENT_TYPE) == 1
            lease.stop_heartbeat()
