"""Timer nodes in plans (``wait: {seconds: N}`` / ``wait: {until: ISO-8601}``), SQLite and PostgreSQL: the run parks
``timer`` (``smthrs run`` exits 75) and resumes at the STORED deadline — on a re-run, after a SIGKILL, or from a
worker — replaying the nodes it settled as ``clean``; a timer is never served to another run; a malformed spec is
refused before anything is written.

No test here depends on the machine's speed: timers are an hour long (far longer than any command), and the test
lets one pass by moving its STORED deadline into the past in the database (:func:`_timetravel.let_the_deadline_pass`) — what
an hour of waiting would do, without waiting. A re-run that computed a fresh deadline would park for an hour."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _timetravel import let_the_deadline_pass

import smthrs_plugin as sp
from smthrs_plugin.errors import PlanError, SchedulerError
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.scheduler.planfile import read_plan_file
from smthrs_plugin.stores.database import open_database

#: A timer far longer than any command, however busy the machine.
HOUR_S = 3600

PLAN = """\
plan: release
flow: ci/release
nodes:
  - id: build
    run: "echo $$ >> $WAITS_MARKS/build"
  - id: cool-down
    wait: {seconds: %(seconds)s}
    needs: [build]
  - id: announce
    run: "echo $$ >> $WAITS_MARKS/announce"
    needs: [cool-down]
"""

FAST = {
    "SMTHRS_HEARTBEAT_INTERVAL_S": "0.05",
    "SMTHRS_STALE_AFTER_S": "1",
    "SMTHRS_SKEW_ALLOWANCE_S": "0.1",
    "SMTHRS_WAIT_POLL_S": "0.05",
}


def _setup(tmp_path: Path, db_url: str, seconds: float) -> tuple[Path, dict[str, str]]:
    ws = tmp_path / "ws"
    ws.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    plan = tmp_path / "release.yaml"
    plan.write_text(PLAN % {"seconds": seconds})
    env = {
        **os.environ,
        **FAST,
        "SMTHRS_DB_URL": db_url,
        "SMTHRS_WORKSPACE": str(ws),
        "WAITS_MARKS": str(marks),
    }
    return plan, env


def smthrs(env: dict[str, str], *args: str, budget: str) -> tuple[int, dict[str, Any]]:
    p = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", *args, "--json"],
        env={**env, "SMTHRS_WAIT_BUDGET_S": budget},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.stdout.strip(), p.stderr
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])


def lines(tmp_path: Path, name: str) -> int:
    f = tmp_path / "marks" / name
    return len(f.read_text().split()) if f.exists() else 0


pytestmark = pytest.mark.slow


def test_a_timer_node_parks_the_run_and_a_re_run_resumes_it_at_the_stored_deadline(
    db_url: str, tmp_path: Path
) -> None:
    plan, env = _setup(tmp_path, db_url, HOUR_S)
    code, out = smthrs(env, "run", str(plan), "--run-id", "rel-1", budget="0")
    assert code == 75 and out["status"] == "parked" and out["node"] == "cool-down"
    due = out["wait"]["wake_at_ms"]
    assert out["wait"]["reason"] == "timer" and lines(tmp_path, "build") == 1

    code, again = smthrs(env, "run", str(plan), "--run-id", "rel-1", budget="0")
    assert code == 75 and again["wait"]["wake_at_ms"] == due  # the ORIGINAL deadline, not a new one
    assert lines(tmp_path, "build") == 1  # settled work replays; it does not run again

    due = let_the_deadline_pass_at(db_url, "rel-1", "node:cool-down")  # the hour has passed
    waits = WaitStore(open_database(db_url))
    code, done = smthrs(env, "run", str(plan), "--run-id", "rel-1", budget="0")
    assert code == 0 and done["status"] == "completed"
    assert {s["node"]: s["outcome"] for s in done["settlements"]} == {
        "build": "clean",
        "cool-down": "built",
        "announce": "built",
    }
    assert lines(tmp_path, "build") == 1 and lines(tmp_path, "announce") == 1
    clock = waits.clock("ci/release", "rel-1", "node:cool-down")
    # Fired at the stored deadline: a re-run that armed a fresh hour-long timer would have parked again.
    assert clock is not None and clock.due_at_ms == due and clock.completed_at_ms >= due  # type: ignore[operator]
    rec = RunStore(waits.db).get("rel-1")
    assert rec is not None and rec.status == "completed"


def test_a_timer_node_survives_sigkill_and_a_worker_resumes_it_at_the_stored_deadline(
    db_url: str, tmp_path: Path
) -> None:
    plan, env = _setup(tmp_path, db_url, HOUR_S)  # the runner is still inside the timer when it is killed
    runner = subprocess.Popen(
        [sys.executable, "-m", "smthrs_plugin", "run", str(plan), "--run-id", "rel-2"],
        env={**env, "SMTHRS_WAIT_BUDGET_S": str(2 * HOUR_S)},  # sleeps in-process instead of parking
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    db = open_database(db_url)
    waits, runs = WaitStore(db), RunStore(db)
    deadline = time.monotonic() + 60
    while (clock := waits.clock("ci/release", "rel-2", "node:cool-down")) is None:
        assert time.monotonic() < deadline and runner.poll() is None
        time.sleep(0.01)
    runner.kill()  # SIGKILL while the timer node sleeps in-process
    runner.wait()
    assert clock.pending and runs.get("rel-2").status == "running"  # type: ignore[union-attr]
    due = let_the_deadline_pass_at(db_url, "rel-2", "node:cool-down")  # the hour has passed

    worker = subprocess.Popen(
        [sys.executable, "-m", "smthrs_plugin", "worker", "--plan", str(plan), "--json"],
        env={**env, "SMTHRS_WAIT_BUDGET_S": "600"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120  # a fresh bound for the worker, far above its run
    try:
        while (rec := runs.get("rel-2")) is None or rec.status != "completed":
            assert time.monotonic() < deadline and worker.poll() is None, worker.stderr
            time.sleep(0.05)
    finally:
        worker.terminate()
        worker.communicate(timeout=60)
    assert rec.result["outcomes"] == {"build": "clean", "cool-down": "built", "announce": "built"}
    fired = waits.clock("ci/release", "rel-2", "node:cool-down")
    assert fired is not None and fired.due_at_ms == due
    assert fired.completed_at_ms is not None and fired.completed_at_ms >= fired.due_at_ms
    assert lines(tmp_path, "build") == 1 and lines(tmp_path, "announce") == 1
    types = [e.type for e in Journal(db).read("rel-2", limit=1000)]
    assert "stolen-and-activated" in types and types.count("clock-scheduled") == 1


def test_a_timer_is_run_scoped_and_never_served_to_another_run(db_url: str, tmp_path: Path) -> None:
    plan, env = _setup(tmp_path, db_url, 0)
    os.environ["WAITS_MARKS"] = env["WAITS_MARKS"]
    try:
        pf = read_plan_file(plan)
        with sp.open_runtime(workspace=env["SMTHRS_WORKSPACE"], db=db_url) as rt:
            first = rt.scheduler("one").run(pf.plan, pf.executor)
            second = rt.scheduler("two").run(pf.plan, pf.executor)
    finally:
        del os.environ["WAITS_MARKS"]
    assert first.settlement("cool-down").outcome == "built"
    timer = second.settlement("cool-down")
    assert timer.outcome == "built" and timer.cache_decision is None  # waited again, not served
    assert timer.dispatch_key != first.settlement("cool-down").dispatch_key
    assert second.settlement("build").outcome == "clean"  # ordinary nodes are still shared


def test_a_malformed_wait_spec_is_refused_before_anything_is_written(db_url: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    for spec, why in (
        ("{seconds: -1}", "finite number"),
        ("{minutes: 3}", "exactly one of"),
        ("{until: '2030-01-01T00:00:00'}", "time zone"),
        ("{seconds: 1}\n    run: 'true'", "runs no action"),
    ):
        bad.write_text(f"plan: p\nnodes:\n  - id: t\n    wait: {spec}\n")
        with pytest.raises(PlanError) as err:
            read_plan_file(bad)
        assert (
            err.value.code == "invalid_plan_file"
            and err.value.details["line"] == 4
            and why in err.value.message
        )
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("t", body={}, wait={"seconds": "soon"})])
    with sp.open_runtime(workspace=tmp_path, db=db_url) as rt:
        with pytest.raises(SchedulerError) as refused:
            rt.scheduler("r").run(plan, lambda ni: None)
        assert refused.value.code == "invalid_plan" and rt.runs.get("r") is None


def let_the_deadline_pass_at(db_url: str, run_id: str, clock: str) -> int:
    db = open_database(db_url)
    try:
        return let_the_deadline_pass(db, run_id, clock)
    finally:
        db.close()
