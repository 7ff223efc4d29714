"""The docs/how-to/durable-waits.md Prefect example of "Durable waits", run verbatim in real processes: a ``@flow`` that sleeps and
asks for an approval, driven by ``smthrs worker --run`` — exit 75 on the timer, 75 again on the approval (the
step before it served ``clean``, not re-executed), ``smthrs approve``, then 0."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _timetravel import let_the_deadline_pass

from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.stores.database import open_database

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

# --- example (keep identical to docs/how-to/durable-waits.md, "Durable waits") ---
NIGHTLY_FLOW_PY = """\
from prefect import flow

import smthrs_plugin as sp

@sp.step(writes=["report.txt"])
def report(ws: sp.Workspace, day: str) -> int:
    (ws / "report.txt").write_text(f"report for {day}\\n")
    return 1

@flow
def nightly(day: str = "2026-11-30") -> int:
    pages = report(day)
    sp.sleep(3600, name="cool-down")  # a durable clock: the process may exit, the deadline stays
    sp.require_approval("publish")  # parks waiting-approval until someone approves
    return pages
"""
COMMANDS = """\
SMTHRS_WAIT_BUDGET_S=0 smthrs worker --flow nightly_flow:nightly --run night-1   # exit 75: parked on the timer
smthrs worker --flow nightly_flow:nightly --run night-1   # an hour later: report served clean; exit 75: approval
smthrs approve night-1 --request publish                  # records the decision, wakes the run
smthrs worker --flow nightly_flow:nightly --run night-1   # exit 0: completed
"""
# --- end of the example ---


def test_durable_waits_page_shows_these_commands() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "durable-waits.md").read_text(encoding="utf-8")
    for line in COMMANDS.splitlines():
        assert f"$ {line}" in readme, line


def _command(line: str) -> tuple[dict[str, str], list[str]]:
    """A shell line's leading ``NAME=value`` assignments and its argv (comments dropped)."""
    words = shlex.split(line.split("#", 1)[0])
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def _run(line: str, cwd: Path, base: dict[str, str]) -> Any:
    env, argv = _command(line)
    exe = str(Path(sys.executable).with_name("smthrs"))  # the installed console script
    return subprocess.run(
        [exe, *argv[1:], "--json"], cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=240
    )


def test_readme_prefect_flow_sleeps_and_asks_for_approval_across_process_exits(tmp_path: Path) -> None:
    (tmp_path / "nightly_flow.py").write_text(NIGHTLY_FLOW_PY)
    base = {**os.environ, "SMTHRS_WORKSPACE": str(tmp_path)}
    park, again, approve, finish = COMMANDS.splitlines()

    parked = _run(park, tmp_path, base)
    assert parked.returncode == 75, parked.stderr
    out = json.loads(parked.stdout)
    assert out["status"] == "parked" and out["wait"]["reason"] == "timer"
    assert out["wait"]["wake_at_ms"] > time.time() * 1000 + 3_000_000  # an hour away: no command outlasts it
    # "An hour later", in the database: the test never races a real-time deadline.
    let_the_deadline_pass(
        open_database(f"sqlite:///{tmp_path / '.smthrs' / 'state.db'}"), "night-1", "cool-down"
    )

    asked = _run(again, tmp_path, base)
    assert asked.returncode == 75, asked.stderr
    assert json.loads(asked.stdout)["wait"]["reason"] == "waiting-approval"

    decided = _run(approve, tmp_path, base)
    assert decided.returncode == 0, decided.stderr

    done = _run(finish, tmp_path, base)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "completed"

    db = open_database(f"sqlite:///{tmp_path / '.smthrs' / 'state.db'}")
    rec = RunStore(db).get("night-1")
    assert rec is not None and rec.status == "completed" and rec.flow == "prefect/nightly"
    events = Journal(db).read("night-1", limit=500)
    outcomes = [e.payload["outcome"] for e in events if e.type == "step-settled"]
    assert outcomes == ["built", "clean", "clean"]  # the report ran once, in the first process
    # Every drive called the flow with what the first one recorded (defaults included).
    assert [e.payload["parameters"] for e in events if e.type == "prefect-flow-run"] == [
        {"day": "2026-11-30"}
    ] * 3
    assert (tmp_path / "report.txt").read_text() == "report for 2026-11-30\n"
