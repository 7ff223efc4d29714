"""A Prefect flow killed (SIGKILL) while it sleeps in-process: a ``smthrs worker`` serving the flow steals the run
once the dead owner's lease lapses, calls the flow again with its recorded parameters, serves the step that settled
``clean`` and wakes at the ORIGINAL deadline (SQLite and PostgreSQL, real processes, the session's Prefect
server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.stores.database import open_database

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

FLOW_PY = """\
import os
from prefect import flow
import smthrs_plugin as sp

def _mark(what):
    with open(os.environ["MARKS"], "a") as f:
        f.write(f"{what}:{os.getpid()}\\n")

@sp.step(writes=["first.txt"])
def first(ws: sp.Workspace, label: str) -> int:
    _mark("first")
    (ws / "first.txt").write_text(label)
    return 1

@flow
def napper(label: str, seconds: float) -> int:
    n = first(label)
    sp.sleep(seconds, name="nap")
    _mark("after-nap")
    return n
"""

FAST = {
    "SMTHRS_HEARTBEAT_INTERVAL_S": "0.05",
    "SMTHRS_STALE_AFTER_S": "1",
    "SMTHRS_SKEW_ALLOWANCE_S": "0.1",
    "SMTHRS_WAIT_POLL_S": "0.05",
    "SMTHRS_WAIT_BUDGET_S": "120",
    # The marks name the process that ran each body: the flow process itself, not an isolated child of it.
    "SMTHRS_ISOLATION": "thread",
}


def _eventually(cond: Any, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)
    return value


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def test_a_flow_killed_mid_sleep_is_stolen_by_a_worker_and_wakes_at_its_original_deadline(
    tmp_path: Path, db_url: str, procs: list[subprocess.Popen[str]]
) -> None:
    (tmp_path / "napflow.py").write_text(FLOW_PY)
    marks = tmp_path.parent / f"{tmp_path.name}-marks.txt"  # outside the workspace (an undeclared output there)
    env = {
        **os.environ,
        **FAST,
        "SMTHRS_WORKSPACE": str(tmp_path),
        "SMTHRS_DB_URL": db_url,
        "MARKS": str(marks),
        "PYTHONPATH": str(tmp_path),
    }
    call = "import napflow; napflow.napper('v1', 4)"
    first = subprocess.Popen([sys.executable, "-c", call], cwd=tmp_path, env=env, text=True)
    procs.append(first)
    db = open_database(db_url)
    runs, waits = RunStore(db), WaitStore(db)
    run = _eventually(lambda: next(iter(runs.list(flow="prefect/napper")), None))
    clock = _eventually(lambda: waits.clock("prefect/napper", run.run_id, "nap"))
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    rec = runs.get(run.run_id)
    assert rec is not None and rec.status == "running"  # a dead owner's row, until someone steals it

    worker = subprocess.Popen(
        [sys.executable, "-m", "smthrs_plugin", "worker", "--flow", "napflow:napper"],
        cwd=tmp_path,
        env=env,
        text=True,
    )
    procs.append(worker)
    _eventually(lambda: (r := runs.get(run.run_id)) is not None and r.status == "completed")
    fired = waits.clock("prefect/napper", run.run_id, "nap")
    assert fired is not None and fired.due_at_ms == clock.due_at_ms and not fired.pending
    events = Journal(db).read(run.run_id, limit=500)
    stolen = [e.payload for e in events if e.type == "stolen-and-activated"]
    assert len(stolen) == 1 and stolen[0]["from"]["pid"] == first.pid
    settled = [e for e in events if e.type == "run-settled"]
    assert len(settled) == 1 and settled[0].created_at_ms >= clock.due_at_ms  # never woke before the deadline
    assert [e.payload["outcome"] for e in events if e.type == "step-settled"] == ["built", "clean"]
    assert marks.read_text().splitlines() == [f"first:{first.pid}", f"after-nap:{worker.pid}"]
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0


def test_sigterm_while_a_worker_drives_a_prefect_flow_releases_the_run_and_exits_75(
    tmp_path: Path, db_url: str, procs: list[subprocess.Popen[str]]
) -> None:
    (tmp_path / "napflow.py").write_text(FLOW_PY)
    env = {
        **os.environ,
        **FAST,
        "SMTHRS_WORKSPACE": str(tmp_path),
        "SMTHRS_DB_URL": db_url,
        "MARKS": str(tmp_path.parent / f"{tmp_path.name}-marks.txt"),
    }
    argv = ["worker", "--flow", "napflow:napper", "--run", "nap-9", "--param", "label=v9", "--param", "seconds=600"]
    worker = subprocess.Popen(
        [sys.executable, "-m", "smthrs_plugin", *argv, "--json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(worker)
    db = open_database(db_url)
    waits = WaitStore(db)
    _eventually(lambda: waits.clock("prefect/napper", "nap-9", "nap"))  # sleeping in-process (budget 120 s)
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 75, out
    rec = RunStore(db).get("nap-9")
    assert rec is not None and rec.status == "suspended"  # released, never cancelled
    assert rec.waiting is not None and rec.waiting.reason == "released"
