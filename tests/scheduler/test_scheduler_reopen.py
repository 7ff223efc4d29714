"""Crash and reopen with real processes: SIGKILL a scheduler mid-run, reopen the run in a new process (which steals
it from the dead owner on the same-host pid probe) and check that settled work is reused, interrupted work is
compensated or refused by tier, and durable stop-merge decisions are recovered — never re-invented.

Nothing here depends on the machine's speed: the parent waits for marker files (bounded by ``_BOUND``, a failure,
never a measurement), and the dead owner's lease is expired by moving its heartbeat back (``_timetravel.expire_lease``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _timetravel import expire_lease
from sched_support import make_env
from sched_worker import RUN, executor_for, scenario_plan

from smthrs_plugin.scheduler import ThreadHost
from smthrs_plugin.stores.database import open_database
from smthrs_plugin.stores.plan_tables import plan_generations, plan_merges

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("sched_worker.py")
_BOUND = 60.0  # upper bound on waiting for a child; a failure, never a measurement


def _cmd(root: Path, scenario: str, phase: str, which: str = "base") -> list[str]:
    return [sys.executable, str(WORKER), str(root), scenario, phase, which]


def _kill_when(root: Path, scenario: str, ready: Callable[[], bool]) -> None:
    proc = subprocess.Popen(_cmd(root, scenario, "first"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + _BOUND
    try:
        while not ready():
            if proc.poll() is not None:
                raise AssertionError(f"the first phase exited early: {proc.communicate()}")
            assert time.monotonic() < deadline, "the first phase never reached the kill point"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(_BOUND)
    assert proc.returncode == -signal.SIGKILL
    db = open_database(f"sqlite:///{(root / 'state.db').as_posix()}")
    try:
        expire_lease(db, RUN)
    finally:
        db.close()


def _resume(root: Path, scenario: str, which: str = "base") -> dict[str, Any]:
    done = subprocess.run(
        _cmd(root, scenario, "second", which), capture_output=True, text=True, timeout=_BOUND
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _calls(root: Path, phase: str) -> list[tuple[str, ...]]:
    lines = (root / "calls.log").read_text().splitlines() if (root / "calls.log").exists() else []
    return [tuple(line.split(" ", 3)[1:]) for line in lines if line.split(" ", 1)[0] == phase]


def _outcomes(report: dict[str, Any]) -> dict[str, str]:
    return {s["node"]: s["outcome"] for s in report["settlements"]}


def _uninterrupted(tmp: Path, scenario: str) -> Any:
    env = make_env(tmp, ws=tmp / "ws")
    sched = env.scheduler(RUN, host=ThreadHost(4))
    try:
        return sched.run(scenario_plan(scenario), executor_for(tmp, env.ws, scenario, "second"))
    finally:
        sched.host.close()


def _rows(root: Path, table: sa.Table, *cols: str) -> list[Any]:
    db = open_database(f"sqlite:///{(root / 'state.db').as_posix()}")
    try:
        return db.read(lambda c: [tuple(r) for r in c.execute(sa.select(*(table.c[x] for x in cols))).all()])
    finally:
        db.close()


def test_a_killed_run_resumes_in_a_new_process_without_rerunning_settled_nodes(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _kill_when(root, "chain", lambda: (root / "blocked-block").exists())
    assert [c[0] for c in _calls(root, "first")] == ["a", "b", "c", "block"]
    report = _resume(root, "chain")
    assert [c[0] for c in _calls(root, "second")] == ["block", "d"]  # a, b, c replayed from durable attempts
    assert _outcomes(report) == {"a": "clean", "b": "clean", "c": "clean", "block": "built", "d": "built"}
    reference = _uninterrupted(tmp_path / "reference", "chain")
    assert report["results"] == reference.results
    assert [s["dispatch_key"] for s in report["settlements"]] == [
        s.dispatch_key for s in reference.settlements
    ]
    assert [s["plan_key"] for s in report["settlements"]] == [s.plan_key for s in reference.settlements]


def test_a_compensable_retry_restores_the_preimage_first(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "ws").mkdir(parents=True)
    (root / "ws" / "state.txt").write_text("original")
    _kill_when(root, "compensable", lambda: (root / "blocked-comp").exists())
    assert (root / "ws" / "state.txt").read_text() == "half-written garbage"
    report = _resume(root, "compensable")
    assert _calls(root, "first") == [("comp", "step", "original")]
    assert _calls(root, "second") == [
        ("comp", "step", "original"),
        ("z", "step", ""),
    ]  # restored before the retry
    assert _outcomes(report) == {"comp": "built", "z": "built"}
    assert (root / "ws" / "state.txt").read_text() == "comp:[]"


def test_an_irreversible_node_interrupted_mid_attempt_is_refused_not_retried(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _kill_when(root, "irreversible", lambda: (root / "blocked-deploy").exists())
    report = _resume(root, "irreversible")
    assert "deploy" not in [c[0] for c in _calls(root, "second")]
    assert _outcomes(report)["deploy"] == "failed" and _outcomes(report)["after"] == "skipped"
    assert _outcomes(report)["free"] in ("built", "clean")
    deploy = next(s for s in report["settlements"] if s["node"] == "deploy")
    assert "irreversible" in deploy["error"] and deploy["attempts"] == 1


def test_a_stop_merge_intent_is_recovered_on_the_base_plan(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _kill_when(
        root,
        "merge",
        lambda: (
            (root / "blocked-winner").exists()
            and (root / "state.db").exists()
            and bool(_rows(root, plan_merges, "node_id", "state"))
        ),
    )
    assert _rows(root, plan_merges, "node_id", "state") == [("loser", "intent")]
    report = _resume(root, "merge")
    assert [c[:2] for c in _calls(root, "second")] == [("winner", "step"), ("loser+merge", "merge")]
    assert _outcomes(report) == {
        "winner": "built",
        "loser": "skipped",
        "tail": "skipped",
        "loser+merge": "built",
    }
    assert report["merges"] == ["loser+merge"]
    assert _rows(root, plan_merges, "node_id", "state", "merge_node_id") == [
        ("loser", "completed", "loser+merge")
    ]
    env = make_env(root, ws=root / "ws")
    loser_settled = [p for t, p in env.records(RUN, types=("node-settled",)) if p["node_id"] == "loser"]
    assert [p["outcome"] for p in loser_settled] == ["skipped"]  # the decision's record, never written twice


@pytest.mark.parametrize("resume_with", ["base", "grown"])
def test_a_completed_stop_merge_is_recovered_on_the_base_and_on_the_grown_plan(
    tmp_path: Path, resume_with: str
) -> None:
    root = tmp_path / "run"
    _kill_when(root, "merge-grown", lambda: (root / "blocked-loser+merge").exists())
    generations = sorted(_rows(root, plan_generations, "generation"))
    assert generations == [(0,), (1,)]
    copy = tmp_path / f"copy-{resume_with}"
    shutil.copytree(root, copy)
    report = _resume(copy, "merge-grown", resume_with)
    assert [c[:2] for c in _calls(copy, "second")] == [("loser+merge", "merge")]
    assert _outcomes(report) == {
        "winner": "clean",
        "loser": "skipped",
        "tail": "skipped",
        "loser+merge": "built",
    }
    assert report["merges"] == ["loser+merge"]
    assert sorted(_rows(copy, plan_generations, "generation")) == generations  # no invented extension


def test_inconsistent_merge_recovery_data_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _kill_when(root, "merge-grown", lambda: (root / "blocked-loser+merge").exists())
    db = open_database(f"sqlite:///{(root / 'state.db').as_posix()}")
    db.write(lambda c: c.execute(sa.update(plan_merges).values(merge_node_id="someone-else")))
    db.close()
    done = subprocess.run(_cmd(root, "merge-grown", "second"), capture_output=True, text=True, timeout=_BOUND)
    assert done.returncode != 0 and "invalid_plan" in done.stderr and "invent" in done.stderr
    assert not any(c[0] == "loser+merge" for c in _calls(root, "second"))


def test_worker_processes_do_not_leak(tmp_path: Path) -> None:
    # The kill helper reaps its child: nothing of ours is left running after a crash test.
    root = tmp_path / "run"
    _kill_when(root, "irreversible", lambda: (root / "blocked-deploy").exists())
    out = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True)
    assert out.stdout.strip() == "" or all(int(p) == os.getpid() for p in out.stdout.split())
