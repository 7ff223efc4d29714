"""A retry finishes the job or says why it cannot, through the REAL ``smthrs`` command line and real
signals: a ``smthrs run plan.yaml --key K`` whose process group was SIGKILLed inside a ``wait:`` node or inside a
slow ``run:`` node is retried at once with the same command. The retry never exits 0 before the run completed: it
waits for the dead owner's lease to expire (30 s by default, shortened here with ``SMTHRS_STALE_AFTER_S``), takes
the run over and drives it to its end (exit 0, every node settled). While the owner is alive (SIGSTOPped, then
SIGCONTed) ``--no-wait`` exits 75 naming it, and a waiting retry follows the run until it settles.

No test depends on the machine's speed: every "the owner got there" is a marker file or a database row polled with
a deadline far above any command's duration; timers are an hour long and pass by moving their STORED deadline into
the past (as ``tests/engine/waits/test_waits_plans.py`` does); nothing asserts elapsed time.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _timetravel import let_the_deadline_pass

from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.stores.database import Database, open_database

pytestmark = pytest.mark.slow

HOUR_S = 3600
DEADLINE_S = 120  # far above any command's duration, however busy the machine

WAIT_PLAN = """\
plan: deploy-wait
flow: ci/deploy-wait
nodes:
  - id: build
    run: "echo $$ >> $MARKS/build"
  - id: cool-down
    wait: {seconds: HOUR_S}
    needs: [build]
  - id: deploy
    run: "echo $$ >> $MARKS/deploy"
    needs: [cool-down]
""".replace("HOUR_S", str(HOUR_S))

SLOW_PLAN = """\
plan: deploy-slow
flow: ci/deploy-slow
nodes:
  - id: build
    run: "echo $$ >> $MARKS/build"
  - id: migrate
    run: "echo $$ >> $MARKS/migrate-started; while [ ! -f $MARKS/release ]; do sleep 0.05; done"
    needs: [build]
  - id: deploy
    run: "echo $$ >> $MARKS/deploy"
    needs: [migrate]
"""


class Job:
    """One CI workspace: a SQLite database, a plan file, marker files, the ``smthrs`` command line."""

    def __init__(self, tmp_path: Path, plan: str, stale_after_s: float) -> None:
        self.ws = tmp_path / "ws"
        self.ws.mkdir()
        self.marks = tmp_path / "marks"
        self.marks.mkdir()
        self.plan = tmp_path / "plan.yaml"
        self.plan.write_text(plan)
        self.db_url = f"sqlite:///{tmp_path / 'state.db'}"
        self.env = {
            **os.environ,
            "SMTHRS_DB_URL": self.db_url,
            "SMTHRS_WORKSPACE": str(self.ws),
            "SMTHRS_HEARTBEAT_INTERVAL_S": "0.1",
            "SMTHRS_STALE_AFTER_S": str(stale_after_s),
            "SMTHRS_WAIT_POLL_S": "0.1",
            "SMTHRS_WAIT_BUDGET_S": str(
                2 * HOUR_S
            ),  # a timer node sleeps in-process (running) instead of parking
            "MARKS": str(self.marks),
        }
        self.db: Database | None = None

    def argv(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "smthrs_plugin", "run", str(self.plan), "--key", "deploy:v1", *extra]

    def start_owner(self) -> subprocess.Popen[str]:
        # Its own process group: killing the group is a machine/container death (the run: node's shell dies too).
        return subprocess.Popen(
            self.argv("--json"),
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    def retry(self, *extra: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
        p = subprocess.run(
            self.argv("--json", *extra),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
        assert p.stdout.strip(), p.stderr
        return p.returncode, json.loads(p.stdout), p.stderr

    def database(self) -> Database:
        if self.db is None:
            self.db = open_database(self.db_url)
        return self.db

    def run_id(self, owner: subprocess.Popen[str]) -> str:
        deadline = time.monotonic() + DEADLINE_S
        while not (listed := RunStore(self.database()).list(limit=5)):
            assert time.monotonic() < deadline and owner.poll() is None, "the owner never admitted its run"
            time.sleep(0.02)
        return listed[0].run_id

    def until(self, owner: subprocess.Popen[str], what: str, ready: Any) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not ready():
            assert time.monotonic() < deadline and owner.poll() is None, f"the owner never reached {what}"
            time.sleep(0.02)

    def lines(self, name: str) -> int:
        f = self.marks / name
        return len(f.read_text().split()) if f.exists() else 0


def _stop_outside_a_write(owner: subprocess.Popen[str], db_path: Path) -> None:
    """SIGSTOP the owner at a moment it holds no SQLite write lock: stopped inside its heartbeat's transaction it
    would hold the lock for as long as it stays stopped, and every other writer would wait out its busy timeout
    (a test artefact, not what a retry meets when an owner is merely slow). Probed, never timed."""
    for _ in range(1000):
        os.kill(owner.pid, signal.SIGSTOP)
        probe = sqlite3.connect(db_path, timeout=0.2, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
        finally:
            probe.close()
        os.kill(owner.pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("the owner held the write lock at every one of 1,000 probes")


def _kill_group(owner: subprocess.Popen[str]) -> None:
    os.killpg(owner.pid, signal.SIGKILL)
    owner.wait(timeout=DEADLINE_S)


def _steals(db: Database, run_id: str) -> list[Any]:
    return [e for e in Journal(db).read(run_id, limit=1000) if e.type == "stolen-and-activated"]


def _assert_stolen_at_lease_expiry(db: Database, run_id: str, stale_after_s: float) -> None:
    (steal,) = _steals(db, run_id)
    assert steal.payload["evidence"] == "lease-expired"
    # Never earlier than the reference's rule: the stolen lease was at least stale_after old when it was stolen.
    assert steal.created_at_ms - int(steal.payload["lease"]) >= int(stale_after_s * 1000)


def test_a_retry_of_a_run_killed_inside_a_wait_node_waits_for_the_lease_takes_over_and_completes(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path, WAIT_PLAN, stale_after_s=3)
    owner = job.start_owner()
    try:
        run_id = job.run_id(owner)
        waits = WaitStore(job.database())
        job.until(owner, "the wait node", lambda: waits.clock("ci/deploy-wait", run_id, "node:cool-down"))
    finally:
        _kill_group(owner)  # SIGKILL inside the hour-long wait: the run is left running under a dead owner
    assert RunStore(job.database()).get(run_id).status == "running"  # type: ignore[union-attr]
    let_the_deadline_pass(job.database(), run_id, "node:cool-down")  # the hour has passed, without waiting

    code, out, _ = job.retry()  # at once, the same command
    assert code == 0, out
    assert (
        out["receipt"]["_tag"] == "AlreadyApplied"
        and out["run_id"] == run_id
        and out["status"] == "completed"
    )
    assert {s["node"]: s["outcome"] for s in out["settlements"]} == {
        "build": "clean",
        "cool-down": "built",
        "deploy": "built",
    }
    assert job.lines("build") == 1 and job.lines("deploy") == 1
    _assert_stolen_at_lease_expiry(job.database(), run_id, 3)
    assert RunStore(job.database()).get(run_id).status == "completed"  # type: ignore[union-attr]


def test_a_retry_of_a_run_killed_inside_a_slow_run_node_takes_it_over_and_drives_every_node(
    tmp_path: Path,
) -> None:
    job = Job(tmp_path, SLOW_PLAN, stale_after_s=3)
    owner = job.start_owner()
    try:
        run_id = job.run_id(owner)
        job.until(owner, "the slow node", lambda: job.lines("migrate-started") == 1)
    finally:
        _kill_group(owner)
    assert RunStore(job.database()).get(run_id).status == "running"  # type: ignore[union-attr]
    (job.marks / "release").touch()  # the slow node finishes when it runs again

    code, out, _ = job.retry()
    assert code == 0 and out["status"] == "completed", out
    assert {s["node"]: s["outcome"] for s in out["settlements"]} == {
        "build": "clean",
        "migrate": "built",
        "deploy": "built",
    }
    assert job.lines("migrate-started") == 2 and job.lines("deploy") == 1  # the killed node ran again, once
    _assert_stolen_at_lease_expiry(job.database(), run_id, 3)


def test_a_retry_while_the_owner_lives_exits_75_naming_it_with_no_wait_and_follows_it_to_its_end_otherwise(
    tmp_path: Path,
) -> None:
    # A stale window far above the test's duration: the owner's lease never expires here, whatever the machine.
    job = Job(tmp_path, SLOW_PLAN, stale_after_s=HOUR_S)
    owner = job.start_owner()
    follower: subprocess.Popen[str] | None = None
    try:
        run_id = job.run_id(owner)
        job.until(owner, "the slow node", lambda: job.lines("migrate-started") == 1)
        _stop_outside_a_write(owner, tmp_path / "state.db")  # alive, but not heartbeating
        try:
            for _ in range(2):  # an identical retry answers the same
                code, out, err = job.retry("--no-wait")
                assert code == 75 and out["status"] == "running" and out["run_id"] == run_id, (out, err)
                assert out["owner"]["pid"] == owner.pid and out["owner"]["host"]
                assert out["receipt"]["_tag"] == "AlreadyApplied" and out["settlements"] == []
            follower = subprocess.Popen(
                job.argv("--json"), env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            # The follower announces that it follows the owner (its progress line on stderr) ...
            assert follower.stderr is not None
            seen: list[str] = []
            while (line := follower.stderr.readline()) and not line.startswith("smthrs: run "):
                seen.append(line)  # anything else it logs first (readline returns "" if it exits instead)
            assert f"pid {owner.pid}" in line and "waiting" in line, (line, seen)
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        (job.marks / "release").touch()  # ... and the owner finishes the run
        assert owner.wait(timeout=DEADLINE_S) == 0
        stdout, _ = follower.communicate(timeout=DEADLINE_S)
        out = json.loads(stdout)
        assert follower.returncode == 0 and out["status"] == "completed" and out["owner"] is None
        assert job.lines("migrate-started") == 1 and job.lines("deploy") == 1  # nothing ran twice
        assert _steals(job.database(), run_id) == []
    finally:
        # The slow node's shell runs in its own session (a killed owner's group does not include it): release it.
        (job.marks / "release").touch()
        if owner.poll() is None:
            os.kill(owner.pid, signal.SIGCONT)
            _kill_group(owner)
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.communicate()
