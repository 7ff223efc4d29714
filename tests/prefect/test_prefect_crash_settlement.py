"""A direct flow run's process SIGKILLed at each step of its settlement — before the smthrs settle commit, after it
but before Prefect is told Completed, after both — leaves a state that a retry (``sp.durable_run`` of the run, which
takes a dead owner's run over at its lease expiry) completes with each step once, and afterwards Prefect and smthrs
agree: the run ``completed``, the flow run recorded last for it Completed, an earlier flow run whose process died
Crashed. The child stops itself at the point through a patch in its own script (no hook in the product). Real
processes, the session's Prefect server, SQLite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

import smthrs_plugin as sp

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

DEADLINE_S = 120.0

FLOW_PY = """\
from prefect import flow

import smthrs_plugin as sp


@sp.step
def double(n: int) -> int:
    return n * 2


@flow(persist_result=False)
def doubler(n: int) -> int:
    return double(n)
"""

#: The flow run's process: SIGKILLs itself at ``sys.argv[1]`` of the settlement of a normal return.
CHILD_PY = """\
import os
import signal
import sys

from smthrs_plugin.prefect import _flowrun

import dying

point = sys.argv[1]
conclude = _flowrun._conclude_completed


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def patched(flow_run_id, state):
    completed = state is not None and state.is_completed()
    if completed and point == "before-smthrs-commit":
        die()  # the smthrs run is still running, Prefect shows Running
    out = conclude(flow_run_id, state)
    if completed and point == "before-prefect-state":
        die()  # the smthrs run completed, Prefect was never told
    return out


_flowrun._conclude_completed = patched
dying.doubler(21)
if point == "after-both":
    die()  # before the exit handlers: nothing of the ending is left to do
"""

#: The retry: drive the run until it is not held (a dead owner's lease lapses; this process's stale window is
#: short), then report how it ended.
RETRY_PY = """\
import json
import sys
import time

import smthrs_plugin as sp

import dying

deadline = time.monotonic() + float(sys.argv[2])
while True:
    out = sp.durable_run(dying.doubler, sys.argv[1])
    decision = getattr(out, "decision", None)
    if type(out).__name__ != "DriveNotClaimed" or type(decision).__name__ == "Terminal":
        break
    if time.monotonic() > deadline:
        raise SystemExit(f"still not claimed: {out}")
    time.sleep(0.1)
print(json.dumps({"outcome": type(out).__name__, "status": getattr(out, "status", getattr(decision, "status", None))}))
"""


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,  # PREFECT_API_URL: the session's server
        "SMTHRS_WORKSPACE": str(tmp / "ws"),
        "PYTHONPATH": str(tmp),
        **extra,
    }


def _prefect_state(flow_run_id: str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id)).state


def _journal(tmp: Path, run_id: str) -> list[Any]:
    with sp.open_runtime(tmp / "ws") as rt:
        return rt.journal.read(run_id, limit=500)


def _run(tmp: Path) -> Any:
    with sp.open_runtime(tmp / "ws") as rt:
        (run,) = rt.runs.list(flow="prefect/doubler")
        return run


@pytest.mark.parametrize(
    ("point", "before_retry"),
    [
        ("before-smthrs-commit", ("running", "RUNNING")),
        ("before-prefect-state", ("completed", "RUNNING")),
        ("after-both", ("completed", "COMPLETED")),
    ],
)
def test_a_flow_run_killed_during_settlement_is_completed_by_a_retry_and_both_sides_agree(
    tmp_path: Path, prefect_api: str, point: str, before_retry: tuple[str, str]
) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "dying.py").write_text(FLOW_PY)
    (tmp_path / "child.py").write_text(CHILD_PY)
    (tmp_path / "retry.py").write_text(RETRY_PY)
    child = subprocess.run(
        [sys.executable, "child.py", point],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S * 2,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr

    run = _run(tmp_path)
    (first,) = [
        e.payload["flow_run_id"] for e in _journal(tmp_path, run.run_id) if e.type == "prefect-flow-run"
    ]
    assert run.run_id == f"prefect-{first}"
    assert (run.status, _prefect_state(first).type.value) == before_retry

    retry = subprocess.run(
        [sys.executable, "retry.py", run.run_id, str(DEADLINE_S)],
        cwd=tmp_path,
        # A short stale window in the retrying process: the dead owner's lease lapses within it.
        env=_env(tmp_path, SMTHRS_STALE_AFTER_S="1", SMTHRS_SKEW_ALLOWANCE_S="0"),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S * 2,
        check=False,
    )
    assert retry.returncode == 0, retry.stdout + retry.stderr

    run = _run(tmp_path)
    assert run.status == "completed"
    events = _journal(tmp_path, run.run_id)
    outcomes = [e.payload["outcome"] for e in events if e.type == "step-settled"]
    assert outcomes.count("built") == 1  # the step body ran once; a takeover replays it clean
    assert [e.payload["status"] for e in events if e.type == "run-settled"] == ["completed"]
    flow_runs = [e.payload["flow_run_id"] for e in events if e.type == "prefect-flow-run"]
    assert flow_runs[0] == first
    # The flow run recorded last shows what the run settled; an earlier one whose process died, Crashed.
    assert _prefect_state(flow_runs[-1]).type.value == "COMPLETED"
    for earlier in flow_runs[:-1]:
        assert _prefect_state(earlier).type.value == "CRASHED"
    assert len(flow_runs) == (2 if point == "before-smthrs-commit" else 1)  # only a running run is taken over
