"""The production path: a durable flow deployed to a ``process`` work pool (``flow.from_source(...).deploy``) and run
by ``prefect worker start``, against a standalone Prefect server on PostgreSQL, with the smthrs database on the same
PostgreSQL cluster (its own database). The flow parks on a timer, then on an approval; the worker is SIGKILLed at
each park and a new worker continues the same flow run (after ``smthrs approve``, a CLI subprocess), each step body
executing exactly once and Prefect's flow run ending Completed.

Time passes without waiting: the timer is an hour long, and the test moves its deadline into the past in both
places it is stored — the smthrs database (``_timetravel``) and the flow run's Scheduled state in Prefect.
Skipped without ``SMTHRS_TEST_POSTGRES_URL``, as every PostgreSQL test is."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _prefect_support import api_post
from _procs import die_with_parent
from _timetravel import let_the_deadline_pass

import smthrs_plugin as sp

pytestmark = [pytest.mark.prefect, pytest.mark.postgres, pytest.mark.slow]

POSTGRES_URL = os.environ.get("SMTHRS_TEST_POSTGRES_URL")
FLOW_SOURCE = Path(__file__).with_name("_work_pool_flow.py")
FLOW = "prefect/nightly"
POOL = "smthrs-process-pool"
DEPLOYMENT = "nightly/production"
#: A hang bound per condition, never a measurement: a server start on a busy 2-core machine is slow.
DEADLINE_S = 240.0


def _until(cond: Callable[[], Any], what: str, logs: list[Path]) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := cond()):
        if time.monotonic() > deadline:
            tails = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists()
            )
            raise AssertionError(f"not reached within {DEADLINE_S} s: {what}\n{tails}")
        time.sleep(0.25)
    return value


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _healthy(api: str) -> bool:
    try:
        return bool(_get(f"{api}/health"))
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal ``proc``'s whole process group (its own session: the worker and any flow-run process it started)."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture
def databases() -> Iterator[tuple[str, str]]:
    """Two fresh databases on the test cluster: Prefect's (asyncpg, its server's driver) and smthrs's (psycopg)."""
    if not POSTGRES_URL:
        pytest.skip(
            "PostgreSQL not configured: set SMTHRS_TEST_POSTGRES_URL (.ci/run starts a private cluster)"
        )
    base = sa.engine.make_url(POSTGRES_URL)
    names = [f"wp_{kind}_{uuid.uuid4().hex[:12]}" for kind in ("prefect", "smthrs")]
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        for name in names:
            c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield (
            base.set(drivername="postgresql+asyncpg", database=names[0]).render_as_string(
                hide_password=False
            ),
            base.set(drivername="postgresql+psycopg", database=names[1]).render_as_string(
                hide_password=False
            ),
        )
    finally:
        with admin.connect() as c:
            for name in names:
                c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@dataclass
class Site:
    """A standalone Prefect server on PostgreSQL and the environment every client process of the test shares."""

    api: str
    smthrs_db: str
    workspace: Path
    marks: Path
    env: dict[str, str]
    logs: list[Path]
    tmp: Path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args],
            cwd=self.tmp,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=False,
        )

    def worker(self, name: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"worker-{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--name", name],
                cwd=self.tmp,
                # INFO: its log then says which flow runs it submitted.
                env={**self.env, "PREFECT_LOGGING_LEVEL": "INFO"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: the kill takes the worker and its flow-run processes
                preexec_fn=die_with_parent,
            )


@pytest.fixture
def site(databases: tuple[str, str], tmp_path: Path) -> Iterator[Site]:
    prefect_db, smthrs_db = databases
    home = tmp_path / "prefect-home"
    home.mkdir()
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    # Not the session server's URL nor any database a developer's shell names: this site's own.
    inherited = {
        k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "PREFECT_SERVER_DATABASE_"))
    }
    server_log = tmp_path / "server.log"
    with open(server_log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env={
                **inherited,
                "PREFECT_HOME": str(home),
                "PREFECT_SERVER_DATABASE_CONNECTION_URL": prefect_db,
                "PREFECT_UI_ENABLED": "false",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            },
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    try:
        _until(
            lambda: server.poll() is not None or _healthy(api), "the Prefect server is healthy", [server_log]
        )
        assert server.poll() is None, server_log.read_text(errors="replace")[-3000:]
        source = tmp_path / "source"  # the deployment's code: a directory the worker's flow runs start in
        source.mkdir()
        shutil.copy(FLOW_SOURCE, source / "wpflow.py")
        workspace = tmp_path / "ws"
        workspace.mkdir()
        # Outside the workspace: a body's write there would be an undeclared output.
        marks = tmp_path / "marks.txt"
        env = {
            **inherited,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": api,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "SMTHRS_DB_URL": smthrs_db,
            "SMTHRS_WORKSPACE": str(workspace),
            "SMTHRS_WAIT_BUDGET_S": "0",  # every wait parks: Prefect and its workers bring the flow run back
            "WORK_POOL_MARKS": str(marks),
        }
        yield Site(api, smthrs_db, workspace, marks, env, [server_log], tmp_path)
    finally:
        _stop(server, signal.SIGTERM)


def _flow_run(site: Site, flow_run_id: str) -> dict[str, Any]:
    run: dict[str, Any] = _get(f"{site.api}/flow_runs/{flow_run_id}")
    return run


def _state(site: Site, flow_run_id: str) -> tuple[str, str]:
    state = _flow_run(site, flow_run_id)["state"]
    assert state["type"] not in ("FAILED", "CRASHED", "CANCELLED"), state
    return state["type"], state["name"]


def _history(site: Site, flow_run_id: str) -> list[tuple[str, str]]:
    states = _get(f"{site.api}/flow_run_states/?flow_run_id={flow_run_id}")
    return [(s["type"], s["name"]) for s in sorted(states, key=lambda s: s["timestamp"])]


def _after(history: list[tuple[str, str]], *states: tuple[str, str]) -> bool:
    """``states`` occur in ``history`` in this order (other states may come between)."""
    it = iter(history)
    return all(any(seen == want for seen in it) for want in states)


def _marks(site: Site) -> list[str]:
    return site.marks.read_text().splitlines() if site.marks.exists() else []


def _status(site: Site, run_id: str) -> str | None:
    with sp.open_runtime(site.workspace, db=site.smthrs_db) as rt:
        rec = rt.runs.get(run_id)
    return None if rec is None else rec.status


@pytest.mark.timeout(1200)  # several hang bounds in a row; each condition is met in seconds
def test_a_work_pool_worker_killed_at_each_park_is_replaced_and_the_flow_run_completes_each_step_once(
    site: Site,
) -> None:
    made = site.run(sys.executable, "-m", "prefect", "work-pool", "create", POOL, "--type", "process")
    assert made.returncode == 0, made.stdout + made.stderr
    deployed = site.run(sys.executable, str(site.tmp / "source" / "wpflow.py"), "production", POOL)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    deployment = _get(f"{site.api}/deployments/name/{DEPLOYMENT}")
    assert deployment["work_pool_name"] == POOL

    first = site.worker("first")
    try:
        flow_run_id = str(
            api_post(
                site.api,
                f"/deployments/{deployment['id']}/create_flow_run",
                {"parameters": {"day": "2026-12-01", "seconds": 3600}},
            )["id"]
        )
        run_id = f"prefect-{flow_run_id}"
        _until(
            lambda: (
                _state(site, flow_run_id) == ("SCHEDULED", "Parked") and _status(site, run_id) == "suspended"
            ),
            "the flow run parked on its timer (Prefect: Scheduled 'Parked')",
            site.logs,
        )
        assert _marks(site) == ["extract"]
    finally:
        _stop(first)  # SIGKILL while the flow run is parked: nothing of it runs anywhere now

    second = site.worker("second")
    try:
        # The hour passes: the stored deadline first (an execution before it would park again at the original
        # deadline), then Prefect's copy of it, the flow run's Scheduled time.
        with sp.open_runtime(site.workspace, db=site.smthrs_db) as rt:
            clock = rt.driver.waits.clock(FLOW, run_id, "cool-down")
            assert clock is not None and clock.due_at_ms > time.time() * 1000 + 1_800_000
            let_the_deadline_pass(rt.db, run_id, "cool-down")
        now = datetime.now(timezone.utc).isoformat()
        moved = api_post(
            site.api,
            f"/flow_runs/{flow_run_id}/set_state",
            {
                "state": {"type": "SCHEDULED", "name": "Parked", "state_details": {"scheduled_time": now}},
                "force": True,
            },
        )
        assert moved["status"] == "ACCEPT", moved
        _until(
            lambda: (
                _state(site, flow_run_id) == ("PAUSED", "Parked") and _status(site, run_id) == "suspended"
            ),
            "the new worker continued the flow run past its timer to the approval (Prefect: Paused 'Parked')",
            site.logs,
        )
        assert _marks(site) == ["extract", "transform"]
    finally:
        _stop(second)  # SIGKILL again, parked on the approval this time

    third = site.worker("third")
    try:
        approve = site.run(
            sys.executable, "-m", "smthrs_plugin", "approve", run_id, "--request", "publish", "--json"
        )
        assert approve.returncode == 0, approve.stdout + approve.stderr
        assert (
            json.loads(approve.stdout)["host_wake"]["type"] == "HostWoken"
        )  # Prefect was told: Scheduled now
        _until(
            lambda: _state(site, flow_run_id) == ("COMPLETED", "Completed"),
            "the third worker ran the approved flow run to Completed",
            site.logs,
        )
    finally:
        _stop(third)

    # Settled in smthrs before Prefect showed Completed (prefect/_flowrun.py); one smthrs run, each body once.
    assert _status(site, run_id) == "completed"
    assert _marks(site) == ["extract", "transform", "publish"]
    flow_run = _flow_run(site, flow_run_id)
    assert flow_run["deployment_id"] == deployment["id"] and flow_run["work_pool_name"] == POOL
    assert _after(
        _history(site, flow_run_id),
        ("SCHEDULED", "Parked"),
        ("RUNNING", "Running"),
        ("PAUSED", "Parked"),
        ("SCHEDULED", "Resuming"),
        ("RUNNING", "Running"),
        ("COMPLETED", "Completed"),
    )
    # Each park was continued by the worker started after the kill.
    for name in ("first", "second", "third"):
        log = (site.tmp / f"worker-{name}.log").read_text(errors="replace")
        assert f"submitting flow run '{flow_run_id}'" in log, name
    with sp.open_runtime(site.workspace, db=site.smthrs_db) as rt:
        assert sorted(r.run_id for r in rt.runs.list(flow=FLOW, limit=50)) == [run_id]  # no fresh suffix
        events = rt.journal.read(run_id, limit=500)
    outcomes = sorted(
        (e.payload["step"].rsplit(".", 1)[-1], e.payload["outcome"])
        for e in events
        if e.type == "step-settled"
    )
    assert outcomes == [
        ("wpflow:extract", "built"),
        ("wpflow:extract", "clean"),
        ("wpflow:extract", "clean"),
        ("wpflow:publish", "built"),
        ("wpflow:transform", "built"),
        ("wpflow:transform", "clean"),
    ]
    assert len([e for e in events if e.type == "run-activated"]) == 3  # one per execution, one per worker
    records = [e.payload for e in events if e.type == "prefect-flow-run"]
    assert len(records) == 1 and records[0]["deployment_id"] == deployment["id"]
    approved = next(e for e in events if e.type == "control.approval.approved")
    assert approved.seq < [e for e in events if e.type == "step-settled"][-1].seq
