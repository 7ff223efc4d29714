"""Durable waits across real processes and real signals (SQLite and PostgreSQL): ``smthrs worker`` processes are
SIGKILLed and SIGTERMed while runs sleep or wait, and other processes carry the runs on. Every wait has a deadline
and the tests assert states and orders (a deadline is compared with the clock reading at fire time), never
elapsed wall time.

No test here depends on the machine's speed: every sleep is an hour or more and every in-process wait budget is
hours (far longer than any command, however busy the machine), so a process is always killed or stopped while it
still waits. Time passes without waiting: the test moves a STORED deadline into the past in the database
(:func:`_let_the_deadline_pass`) and a dead owner's last heartbeat an hour back (:func:`_expire_lease`). A process
that re-armed a fresh deadline instead of keeping the stored one would wait for hours, and the test would fail."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _timetravel import expire_lease, let_the_deadline_pass

from smthrs_plugin.engine.cancellation import cancel_run
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.records.wait_rows import EventWait, ReleasedWait, TimerWait, WaitingRun
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.stores.database import Database, open_database

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
#: A sleep far longer than any command, however busy the machine.
HOUR_S = 3600
#: An in-process wait budget longer than any sleep here: a waiting run stays in its process until the test acts.
IN_PROCESS = str(2 * HOUR_S)
FAST = {
    "SMTHRS_HEARTBEAT_INTERVAL_S": "0.05",
    # The production lease: a live owner never loses its run to a slow machine; a dead one is expired by the test.
    "SMTHRS_STALE_AFTER_S": "30",
    "SMTHRS_SKEW_ALLOWANCE_S": "0.1",
    "SMTHRS_WAIT_POLL_S": "0.05",
}


def eventually(cond: Callable[[], Any], timeout: float = 120.0) -> Any:
    """Poll ``cond`` until truthy (the timeout only guards against a hang; nothing asserts how long it took)."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


class Worker:
    """``python -m smthrs_plugin worker --json ...`` with fast ownership timings."""

    def __init__(self, cwd: Path, db_url: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "smthrs_plugin", "worker", "--json", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(cwd, db_url, env),
        )

    @property
    def pid(self) -> int:
        return self.p.pid

    def line(self, timeout: float = 60.0) -> dict[str, Any]:
        sel = selectors.DefaultSelector()
        assert self.p.stdout is not None
        sel.register(self.p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"worker said nothing for {timeout}s")
        text = self.p.stdout.readline()
        if not text:
            raise AssertionError(
                f"worker exited {self.p.wait()}: {self.p.stderr.read() if self.p.stderr else ''}"
            )
        return dict(json.loads(text))

    def serving(self) -> Worker:
        assert self.line()["event"] == "serving"
        return self

    def terminate(self, timeout: float = 60.0) -> dict[str, Any]:
        """SIGTERM: the worker releases what it drives and exits 0 after one ``stopped`` line."""
        self.p.send_signal(signal.SIGTERM)
        out, err = self.p.communicate(timeout=timeout)
        assert self.p.returncode == 0, err
        return dict(json.loads(out.strip().splitlines()[-1]))

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def _env(cwd: Path, db_url: str, extra: dict[str, str] | None) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        **FAST,
        "PYTHONPATH": str(HERE) + (os.pathsep + path if path else ""),
        "SMTHRS_DB_URL": db_url,
        "SMTHRS_WORKSPACE": str(cwd),
        "WAITS_MARKS": str(cwd),
        **(extra or {}),
    }


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


@pytest.fixture
def stores(db: Database) -> tuple[RunStore, WaitStore, Journal]:
    journal = Journal(db)
    runs = RunStore(db, journal=journal)
    return runs, WaitStore(db, journal=journal, runs_store=runs), journal


def marks(cwd: Path, run_id: str, what: str) -> list[int]:
    f = cwd / f"{run_id}.{what}"
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def status(runs: RunStore, run_id: str) -> str:
    rec = runs.get(run_id)
    return "" if rec is None else rec.status


def test_a_timer_survives_sigkill_and_fires_once_at_its_stored_deadline(
    db_url: str, tmp_path: Path, stores: tuple[RunStore, WaitStore, Journal], workers: list[Worker]
) -> None:
    runs, waits, journal = stores
    runs.create("n1", "nap")
    nap = ["--flow", "nap=_waits_flows:nap"]
    first = Worker(tmp_path, db_url, *nap, env={"WAITS_NAP_S": str(HOUR_S), "SMTHRS_WAIT_BUDGET_S": "0"})
    workers.append(first)
    parked = eventually(lambda: isinstance(w := waits.waiting("n1"), WaitingRun) and w)
    first.kill()  # the process holding the armed timer dies an hour before the deadline
    clock = waits.clock("nap", "n1", "nap")
    assert clock is not None and clock.pending and parked.wait == TimerWait(clock.due_at_ms)
    due = let_the_deadline_pass(waits.db, "n1", "nap")  # the hour has passed

    second = Worker(tmp_path, db_url, *nap, env={"WAITS_NAP_S": str(HOUR_S), "SMTHRS_WAIT_BUDGET_S": "0"})
    workers.append(second)
    eventually(lambda: status(runs, "n1") == "completed")
    fired = waits.clock("nap", "n1", "nap")
    rec = runs.get("n1")
    # The stored deadline, never re-armed later: a fresh hour-long timer would have parked the run again.
    assert fired is not None and fired.due_at_ms == due
    assert fired.completed_at_ms is not None and fired.completed_at_ms >= fired.due_at_ms
    assert rec is not None and rec.result["woke_at_ms"] >= fired.due_at_ms and rec.result["pid"] == second.pid
    assert marks(tmp_path, "n1", "after-nap") == [second.pid]  # the code after the sleep ran once
    types = [e.type for e in journal.read("n1", limit=1000)]
    assert types.count("clock-scheduled") == 1 and types.count("clock-fired") == 1
    assert second.terminate()["released"] == []


def test_an_in_process_sleep_killed_mid_wait_is_stolen_and_resumes_to_its_original_deadline(
    db_url: str, tmp_path: Path, stores: tuple[RunStore, WaitStore, Journal], workers: list[Worker]
) -> None:
    runs, waits, journal = stores
    runs.create("n2", "nap")
    nap = ["--flow", "nap=_waits_flows:nap"]
    first = Worker(
        tmp_path, db_url, *nap, env={"WAITS_NAP_S": str(HOUR_S), "SMTHRS_WAIT_BUDGET_S": IN_PROCESS}
    )
    workers.append(first)
    eventually(lambda: waits.clock("nap", "n2", "nap"))
    first.kill()  # SIGKILL while sleeping in-process: the run row stays "running" under a dead owner
    assert status(runs, "n2") == "running"
    expire_lease(waits.db, "n2")  # the dead owner's lease has lapsed
    due = let_the_deadline_pass(waits.db, "n2", "nap")  # and the hour has passed
    asks_more = str(2 * HOUR_S)
    second = Worker(
        tmp_path, db_url, *nap, env={"WAITS_NAP_S": asks_more, "SMTHRS_WAIT_BUDGET_S": IN_PROCESS}
    )
    workers.append(second)
    eventually(lambda: status(runs, "n2") == "completed")
    rec = runs.get("n2")
    assert rec is not None and rec.result["pid"] == second.pid and rec.result["woke_at_ms"] >= due
    stolen = [e.payload for e in journal.read("n2", limit=1000) if e.type == "stolen-and-activated"]
    assert (
        len(stolen) == 1
        and stolen[0]["from"]["pid"] == first.pid
        and stolen[0]["evidence"] == "lease-expired"
    )
    # Two hours asked on the re-run, the stored deadline kept: a restart never extends a sleep.
    fired = waits.clock("nap", "n2", "nap")
    assert fired is not None and fired.due_at_ms == due
    assert marks(tmp_path, "n2", "after-nap") == [second.pid]
    second.terminate()


_COMPLETER = """
import os, sys, time
import smthrs_plugin as sp
go, url, run_id, me, ready = sys.argv[1:]
open(ready, "w").close()  # imported and at the start line
while not os.path.exists(go):
    time.sleep(0.002)
print(type(sp.complete(run_id, "approval", {"by": me}, db=url)).__name__, flush=True)
"""


def test_a_pending_deferred_survives_sigkill_and_two_completers_serve_one_value(
    db_url: str, tmp_path: Path, stores: tuple[RunStore, WaitStore, Journal], workers: list[Worker]
) -> None:
    runs, waits, _ = stores
    runs.create("a1", "approval")
    flows = ["--flow", "approval=_waits_flows:approval"]
    first = Worker(tmp_path, db_url, *flows, env={"SMTHRS_WAIT_BUDGET_S": "0"})
    workers.append(first)
    parked = eventually(lambda: isinstance(w := waits.waiting("a1"), WaitingRun) and w)
    assert isinstance(parked.wait, EventWait) and parked.wait.token_digest is not None
    first.kill()

    go = tmp_path / "go"
    env = _env(tmp_path, db_url, None)
    completers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _COMPLETER,
                str(go),
                db_url,
                "a1",
                f"completer-{i}",
                str(tmp_path / f"ready-{i}"),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    eventually(lambda: all((tmp_path / f"ready-{i}").exists() for i in range(2)))  # both at the start line
    go.touch()
    said = [c.communicate(timeout=60)[0].strip() for c in completers]
    assert sorted(said) == ["Completed", "Existing"]
    winner = f"completer-{said.index('Completed')}"

    second = Worker(tmp_path, db_url, *flows, env={"SMTHRS_WAIT_BUDGET_S": IN_PROCESS})
    workers.append(second)
    eventually(lambda: status(runs, "a1") == "completed")
    rec = runs.get("a1")
    assert rec is not None and rec.result == {"value": {"by": winner}, "pid": second.pid}
    served = waits.deferred("approval", "a1", "approval")
    assert served is not None and served.value == {"by": winner} and served.consumed_at_ms is not None
    assert marks(tmp_path, "a1", "approved") == [second.pid]
    second.terminate()


def test_a_released_run_is_re_driven_by_the_sweep_of_another_process(
    db_url: str, tmp_path: Path, stores: tuple[RunStore, WaitStore, Journal], workers: list[Worker]
) -> None:
    runs, waits, journal = stores
    runs.create("h1", "approval")
    flows = ["--flow", "approval=_waits_flows:approval"]
    first = Worker(tmp_path, db_url, *flows, env={"SMTHRS_WAIT_BUDGET_S": IN_PROCESS}).serving()
    workers.append(first)
    eventually(lambda: (r := runs.get("h1")) is not None and r.owner is not None and r.owner.pid == first.pid)
    assert first.terminate()["released"] == ["h1"]
    released = waits.waiting("h1")
    assert isinstance(released, WaitingRun) and released.wait == ReleasedWait("shutdown")
    assert released.cancel_requested_at_ms is None  # shutdown released it; nothing cancelled it

    second = Worker(tmp_path, db_url, *flows, env={"SMTHRS_WAIT_BUDGET_S": IN_PROCESS})
    workers.append(second)
    eventually(
        lambda: (r := runs.get("h1")) is not None and r.owner is not None and r.owner.pid == second.pid
    )
    from smthrs_plugin import complete

    complete("h1", "approval", "ship it", db=db_url)
    eventually(lambda: status(runs, "h1") == "completed")
    assert runs.get("h1").result == {"value": "ship it", "pid": second.pid}  # type: ignore[union-attr]
    lifecycle = [
        (e.type, (e.payload.get("owner") or {}).get("pid"))
        for e in journal.read("h1", limit=1000)
        if e.type in ("interrupt-released", "run-activated", "run-settled")
    ]
    assert lifecycle == [
        ("run-activated", first.pid),
        ("interrupt-released", first.pid),
        ("run-activated", second.pid),
        ("run-settled", None),
    ]
    second.terminate()


def test_cancelling_a_parent_from_another_process_cancels_its_parked_and_running_descendants(
    db_url: str, tmp_path: Path, stores: tuple[RunStore, WaitStore, Journal], workers: list[Worker]
) -> None:
    runs, waits, _ = stores
    runs.create("parent", "nap")
    runs.create("child", "approval", parent_run_id="parent")
    runs.create("grandchild", "approval", parent_run_id="child")
    flows = ["--flow", "nap=_waits_flows:nap", "--flow", "approval=_waits_flows:approval"]
    # The nap (four hours) is beyond the budget: the parent parks; the approvals wait in-process.
    worker = Worker(
        tmp_path, db_url, *flows, env={"WAITS_NAP_S": str(4 * HOUR_S), "SMTHRS_WAIT_BUDGET_S": IN_PROCESS}
    )
    workers.append(worker)
    eventually(lambda: isinstance(waits.waiting("parent"), WaitingRun))
    eventually(lambda: status(runs, "child") == "running" and status(runs, "grandchild") == "running")

    report = cancel_run(RunStore(open_database(db_url)), "parent")
    assert report.requested == ("parent", "child", "grandchild")
    eventually(lambda: all(status(runs, r) == "cancelled" for r in ("parent", "child", "grandchild")))
    for rid in ("child", "grandchild"):  # interrupted within one poll by their owner, not by a sweep steal
        rec = runs.get(rid)
        assert rec is not None and rec.cancel_ack is not None and rec.cancel_ack.owner.pid == worker.pid
    assert waits.pending_clocks() == []  # the parked parent's timer closed with it
    assert marks(tmp_path, "child", "approved") == []
    assert worker.terminate()["released"] == []


def test_sigterm_while_driving_one_run_releases_it_and_exits_75(
    db_url: str, tmp_path: Path, stores: tuple[RunStore, WaitStore, Journal]
) -> None:
    runs, waits, _ = stores
    one = Worker(
        tmp_path,
        db_url,
        "--flow",
        "approval=_waits_flows:approval",
        "--run",
        "t1",
        env={"SMTHRS_WAIT_BUDGET_S": IN_PROCESS},
    )
    try:
        eventually(lambda: status(runs, "t1") == "running")
        one.p.send_signal(signal.SIGTERM)
        out, _ = one.p.communicate(timeout=60)
    finally:
        one.kill()
    assert one.p.returncode == 75 and json.loads(out.strip().splitlines()[-1])["outcome"] == "DriveReleased"
    released = waits.waiting("t1")
    assert isinstance(released, WaitingRun) and released.wait == ReleasedWait("shutdown")
    assert released.cancel_requested_at_ms is None
