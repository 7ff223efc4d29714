"""The docs/how-to/durable-waits.md "Durable waits" example, run verbatim: a flow file and two ``smthrs worker`` commands in real
processes — the first parks the run on its timer and exits 75, the second (a new process) fires the timer at its
stored deadline and completes the run. The hour passes in the database (``_timetravel``), never on the wall
clock: no step of the test races a short real-time deadline."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _timetravel import let_the_deadline_pass

from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.stores.database import open_database

pytestmark = pytest.mark.slow

# --- example (keep identical to docs/how-to/durable-waits.md, "Durable waits") ---
NIGHTLY_PY = """\
import smthrs_plugin as sp

def nightly(ctx):                     # ctx: sp.RunContext (run_id, clock, ...)
    sp.sleep(3600, name="cool-down")  # a durable clock: its deadline is stored by the first call
    return {"woke_at_ms": ctx.clock.now_ms()}
"""
PARK = "SMTHRS_WAIT_BUDGET_S=0 smthrs worker --flow nightly=nightly:nightly --run night-1"
SERVE = "smthrs worker --flow nightly=nightly:nightly"
# --- end of the example ---


def _command(line: str) -> tuple[dict[str, str], list[str]]:
    """A shell line's leading ``NAME=value`` assignments and its argv."""
    words = shlex.split(line)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def test_readme_durable_waits_example_sleeps_past_a_process_restart(tmp_path: Path) -> None:
    (tmp_path / "nightly.py").write_text(NIGHTLY_PY)
    exe = str(Path(sys.executable).with_name("smthrs"))  # the installed console script
    base = {**os.environ, "SMTHRS_WORKSPACE": str(tmp_path), "SMTHRS_HEARTBEAT_INTERVAL_S": "0.1"}

    env, argv = _command(PARK)
    parked = subprocess.run(
        [exe, *argv[1:], "--json"],
        cwd=tmp_path,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert parked.returncode == 75, parked.stderr
    out = json.loads(parked.stdout)
    assert out["status"] == "parked" and out["wait"]["reason"] == "timer"
    assert out["wait"]["wake_at_ms"] > time.time() * 1000 + 3_000_000  # an hour away: no command outlasts it
    due = let_the_deadline_pass(
        open_database(f"sqlite:///{tmp_path / '.smthrs' / 'state.db'}"), "night-1", "cool-down"
    )

    env, argv = _command(SERVE)
    serving = subprocess.Popen(
        [exe, *argv[1:], "--json"], cwd=tmp_path, env={**base, **env}, stdout=subprocess.PIPE, text=True
    )
    try:
        db = open_database(f"sqlite:///{tmp_path / '.smthrs' / 'state.db'}")
        runs = RunStore(db)
        deadline = time.monotonic() + 60
        while (rec := runs.get("night-1")) is None or rec.status != "completed":
            assert time.monotonic() < deadline and serving.poll() is None
            time.sleep(0.05)
        clock = WaitStore(db).clock("nightly", "night-1", "cool-down")
        assert clock is not None and clock.due_at_ms == due
        assert rec.result["woke_at_ms"] >= due and clock.completed_at_ms is not None
    finally:
        serving.send_signal(signal.SIGTERM)
        serving.communicate(timeout=60)
    assert serving.returncode == 0
