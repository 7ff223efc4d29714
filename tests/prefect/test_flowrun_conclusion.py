"""How a direct Prefect flow run's smthrs run is concluded (``prefect/_flowrun.py``): a normal return is settled
``completed`` BEFORE Prefect shows the flow run Completed, so a process dying in Prefect's completion hooks leaves
nothing ``running``; the other endings follow what Prefect records (a returned Failed state, a return value Prefect
could not persist). Real flow runs on the session's Prefect server, real subprocesses killed with SIGKILL, SQLite
and PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.states import Failed

import smthrs_plugin as sp
from smthrs_plugin.prefect.steprun import current_spec
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.stores.database import open_database

pytestmark = pytest.mark.prefect

#: A flow whose FIRST on_completion hook (declared on the flow, so it runs before the one the plugin appends)
#: SIGKILLs its own process: Prefect has set the flow run Completed by then, and nothing after it runs.
DYING_FLOW_PY = """\
import os
import signal

from prefect import flow

import smthrs_plugin as sp


def die(flow, flow_run, state):
    os.kill(os.getpid(), signal.SIGKILL)


@sp.step
def double(n: int) -> int:
    return n * 2


@flow(persist_result=False, on_completion=[die])
def doubler(n: int) -> int:
    return double(n)


@flow(persist_result=False, on_completion=[die])
async def async_doubler(n: int) -> int:
    return double(n)
"""

CALL = {
    "sync": "import dying; dying.doubler(21)",
    "async": "import asyncio, dying; asyncio.run(dying.async_doubler(21))",
}


def _prefect_state(api: str, flow_run_id: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=30) as r:
        state: dict[str, Any] = json.loads(r.read())["state"]
    return state


def _flow_run_ids(journal: Journal, run_id: str) -> list[str]:
    return [e.payload["flow_run_id"] for e in journal.read(run_id, limit=500) if e.type == "prefect-flow-run"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_flow_run_killed_in_its_completion_hooks_leaves_its_smthrs_run_completed(
    tmp_path: Path, db_url: str, prefect_api: str, kind: str
) -> None:
    (tmp_path / "dying.py").write_text(DYING_FLOW_PY)
    env = {
        **os.environ,  # PREFECT_API_URL: the session's server (never an ephemeral one in a process killed here)
        "SMTHRS_WORKSPACE": str(tmp_path),
        "SMTHRS_DB_URL": db_url,
        "PYTHONPATH": str(tmp_path),
    }
    child = subprocess.run(
        [sys.executable, "-c", CALL[kind]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert child.returncode == -signal.SIGKILL, child.stderr  # died in the hook, after Prefect's Completed

    db = open_database(db_url)
    journal = Journal(db)
    name = "prefect/doubler" if kind == "sync" else "prefect/async-doubler"
    (run,) = RunStore(db).list(flow=name)
    (flow_run_id,) = _flow_run_ids(journal, run.run_id)
    assert run.run_id == f"prefect-{flow_run_id}"
    assert run.status == "completed"  # not "running" until someone steals it after the lease
    assert _prefect_state(prefect_api, flow_run_id)["type"] == "COMPLETED"
    events = journal.read(run.run_id, limit=500)
    assert [e.payload["outcome"] for e in events if e.type == "step-settled"] == ["built"]
    (settled,) = [e.payload for e in events if e.type == "run-settled"]
    assert settled["status"] == "completed"


SEEN_BY_HOOK: list[str | None] = []
RUN_IDS: list[str] = []


@sp.step
def triple(n: int) -> int:
    return n * 3


def _record_status(flow: Any, flow_run: Any, state: Any) -> None:
    rt = current_spec().open()
    record = rt.runs.get(f"prefect-{flow_run.id}")
    SEEN_BY_HOOK.append(None if record is None else record.status)


@flow(persist_result=False, on_completion=[_record_status])
def tripler(n: int) -> int:
    RUN_IDS.append(sp.current_run().run_id)
    return triple(n)


@flow(persist_result=False)
def outer(n: int) -> int:
    RUN_IDS.append(sp.current_run().run_id)
    return triple(n) + tripler(n)


@flow(persist_result=False)
def refuses(n: int) -> Any:
    RUN_IDS.append(sp.current_run().run_id)
    triple(n)
    return Failed(message="the body says no")


@flow(persist_result=True, result_serializer="json")
def unpersistable(n: int) -> Any:
    RUN_IDS.append(sp.current_run().run_id)
    triple(n)
    return object()  # Prefect cannot write it as JSON: it warns, and still proposes Completed


@pytest.fixture
def ws(tmp_path: Path, db_url: str) -> Any:
    SEEN_BY_HOOK.clear()
    RUN_IDS.clear()
    with sp.step_settings(workspace=tmp_path, db=db_url):
        yield tmp_path


def test_the_smthrs_run_is_completed_before_prefect_runs_the_flows_completion_hooks(ws: Path) -> None:
    assert tripler(2) == 6
    assert SEEN_BY_HOOK == ["completed"]
    assert tripler(3) == 9  # a later flow run of the same thread (and Prefect client) too
    assert SEEN_BY_HOOK == ["completed", "completed"]


def test_a_nested_flow_run_and_its_parent_are_both_completed(ws: Path) -> None:
    assert outer(1) == 6
    rt = current_spec().open()
    parent, child = RUN_IDS
    assert parent != child and SEEN_BY_HOOK == ["completed"]
    for run_id in (parent, child):
        record = rt.runs.get(run_id)
        assert record is not None and record.status == "completed"


def test_a_body_returning_a_failed_state_fails_its_smthrs_run_like_prefect_shows_it(
    ws: Path, prefect_api: str
) -> None:
    state = refuses(1, return_state=True)
    assert state.is_failed()
    (run_id,) = RUN_IDS
    record = current_spec().open().runs.get(run_id)
    assert record is not None and record.status == "failed"
    assert "the body says no" in json.dumps(record.error)
    assert _prefect_state(prefect_api, run_id.removeprefix("prefect-"))["type"] == "FAILED"


def test_a_return_value_prefect_cannot_persist_ends_the_smthrs_run_as_prefect_shows_it(
    ws: Path, prefect_api: str
) -> None:
    state = unpersistable(1, return_state=True)
    (run_id,) = RUN_IDS
    shown = _prefect_state(prefect_api, run_id.removeprefix("prefect-"))["type"]
    record = current_spec().open().runs.get(run_id)
    assert (
        record is not None and (shown, record.status) == ("COMPLETED", "completed") and state.is_completed()
    )
