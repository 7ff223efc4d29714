"""A parked deployment flow run cancelled in Prefect settles its smthrs run ``cancelled`` at the next touch: the
flow run has no process (Prefect moves it Paused → Cancelled directly, as the UI's Cancel does), so nothing
else can tell smthrs. ``smthrs approve`` finds it before deciding — the run settles ``cancelled`` through the
control plane as ``prefect/flow-run``, once, the approval is refused as a decision on a run that settled otherwise
(exit 2), and nothing runs; ``sp.complete`` finds it when its wake reaches Prefect.

A flow served by ``flow.serve`` in a subprocess, started with ``run_deployment``; the session's Prefect server; a
SQLite workspace; the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import smthrs_plugin as sp
from smthrs_plugin.prefect._flowrun import PREFECT_PRINCIPAL

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

FLOW_PY = """\
import os
from prefect import flow
import smthrs_plugin as sp
from smthrs_plugin.prefect._flowrun import PREFECT_PRINCIPAL

def _mark(tag, what):
    with open(os.environ["MARKS"], "a") as f:
        f.write(f"{tag}:{what}\\n")

@sp.step
def first(tag: str) -> str:
    _mark(tag, "first")
    return tag + "-1"

@sp.step
def second(tag: str, one: str) -> str:
    _mark(tag, "second")
    return one + "-2"

@flow(persist_result=False)
def parked(tag: str, wait: str) -> str:
    one = first(tag)
    if wait == "approval":
        sp.require_approval("ship")
    else:
        sp.wait_for("go")
    return second(tag, one)
"""

SERVE_PY = """\
import sys
import cancelflow

if __name__ == "__main__":  # the runner spawns each flow run in a process that imports this module again
    cancelflow.parked.serve(name=sys.argv[1])
"""

DEADLINE_S = 120.0


@dataclass
class Served:
    name: str
    workspace: Path
    marks: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path


def _until(cond: Callable[[], Any], what: str, served: Served) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not reached within {DEADLINE_S} s: {what}\n{served.log.read_text()[-4000:]}"
            )
        time.sleep(0.2)
    return value


def _deployment_ready(served: Served) -> bool:
    from prefect.client.orchestration import get_client

    assert served.proc.poll() is None, f"flow.serve exited {served.proc.returncode}"
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(f"parked/{served.name}")
        except Exception:  # not registered yet
            return False
    return True


@pytest.fixture(scope="module")
def served(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    flows = tmp_path_factory.mktemp("cancelflows")
    (flows / "cancelflow.py").write_text(FLOW_PY)
    (flows / "serve_cancel.py").write_text(SERVE_PY)
    workspace = tmp_path_factory.mktemp("cancelws")
    marks = workspace.parent / f"{workspace.name}-marks.txt"  # outside the workspace: not a step's output
    env = {
        **os.environ,  # PREFECT_API_URL: the session's server
        "SMTHRS_WORKSPACE": str(workspace),
        "SMTHRS_WAIT_BUDGET_S": "0",  # every wait parks at once
        "MARKS": str(marks),
        "PYTHONPATH": os.pathsep.join([str(flows), os.environ.get("PYTHONPATH", "")]),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    name = f"cancel-{uuid.uuid4().hex[:6]}"
    log = workspace.parent / f"{workspace.name}-serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(flows / "serve_cancel.py"), name],
            cwd=flows,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    s = Served(name, workspace, marks, env, proc, log)
    try:
        _until(lambda: _deployment_ready(s), f"deployment parked/{name} served", s)
        yield s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: the runner and any flow-run child
            proc.wait(timeout=60)


def _state(flow_run_id: str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id)).state


def _parked_then_cancelled_in_prefect(served: Served, tag: str, wait: str) -> tuple[str, str]:
    """Start a flow run, wait until it is parked (Paused, smthrs run suspended), then cancel it the way the UI
    does for a paused flow run: straight to Cancelled."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled

    flow_run_id = str(
        run_deployment(f"parked/{served.name}", parameters={"tag": tag, "wait": wait}, timeout=0).id
    )
    run_id = f"prefect-{flow_run_id}"
    _until(lambda: (st := _state(flow_run_id)) is not None and st.is_paused(), "the flow run Paused", served)
    assert _status(served, run_id) == "suspended"
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(flow_run_id), Cancelled(), force=True)
    assert _state(flow_run_id).is_cancelled()
    assert _status(served, run_id) == "suspended"  # no process runs the flow run: smthrs has not heard yet
    return flow_run_id, run_id


def _status(served: Served, run_id: str) -> str | None:
    with sp.open_runtime(served.workspace) as rt:
        rec = rt.runs.get(run_id)
    return None if rec is None else rec.status


def _journal(served: Served, run_id: str) -> list[Any]:
    with sp.open_runtime(served.workspace) as rt:
        return rt.journal.read(run_id, limit=500)


def _marks(served: Served, tag: str) -> list[str]:
    lines = served.marks.read_text().splitlines() if served.marks.exists() else []
    return [line.split(":", 1)[1] for line in lines if line.startswith(f"{tag}:")]


def _cancelled_once_by_prefect(served: Served, run_id: str) -> list[Any]:
    events = _journal(served, run_id)
    requested = [e.payload for e in events if e.type == "control.run.cancel-requested"]
    assert len(requested) == 1, requested
    assert requested[0]["principal"] == dict(PREFECT_PRINCIPAL.to_json()), requested
    assert "cancelled in Prefect" in requested[0]["reason"]
    return events


def test_approving_a_parked_deployment_run_cancelled_in_prefect_settles_it_cancelled_and_refuses(
    served: Served,
) -> None:
    flow_run_id, run_id = _parked_then_cancelled_in_prefect(served, "ui", "approval")

    approve = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "approve", run_id, "--request", "ship", "--json"],
        env=served.env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    # A decision on a run that settled otherwise (exits.py): refused, not done.
    assert approve.returncode == 2, approve.stdout + approve.stderr
    answer = json.loads(approve.stdout)
    assert answer["status"] == "cancelled" and answer["run_id"] == run_id
    assert "Terminal" in json.dumps(answer["receipt"])
    assert flow_run_id in answer["host_wake"]["detail"]
    assert "cancelled in Prefect" in answer["host_wake"]["detail"]

    assert _status(served, run_id) == "cancelled"
    events = _cancelled_once_by_prefect(served, run_id)
    assert not [e for e in events if e.type == "control.approval.approved"]  # nothing was decided
    assert _marks(served, "ui") == ["first"]  # nothing ran after the park
    assert _state(flow_run_id).is_cancelled()

    # Asked again: the settled run answers the same refusal, and nothing is recorded twice.
    again = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "approve", run_id, "--request", "ship", "--json"],
        env=served.env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    _cancelled_once_by_prefect(served, run_id)


def test_a_completion_woken_through_prefect_settles_a_run_whose_flow_run_was_cancelled_there(
    served: Served,
) -> None:
    flow_run_id, run_id = _parked_then_cancelled_in_prefect(served, "event", "event")

    db = f"sqlite:///{served.workspace / '.smthrs' / 'state.db'}"
    sp.complete(run_id, "go", 7, db=db)  # the installed plugins' waker finds the flow run Cancelled

    assert _status(served, run_id) == "cancelled"
    _cancelled_once_by_prefect(served, run_id)
    assert _marks(served, "event") == ["first"]
    assert _state(flow_run_id).is_cancelled()
