"""A typed scheduler failure interrupts running siblings: a ``run:`` command's process group is killed, and every
attempt still ``started`` is marked ``failed`` (with its ``attempt-finished``) in one fenced transaction before the
typed error propagates. Real SQLite, a real thread host, real subprocesses."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _procs import alive
from sched_support import Env, make_env

from smthrs_plugin.errors import SchedulerError
from smthrs_plugin.plan import Pending, compile_plan, node
from smthrs_plugin.scheduler import NodeInput, PlanScheduler, ThreadHost
from smthrs_plugin.scheduler.planfile import PlanFileExecutor

DEADLINE_S = 60.0


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


def _until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {DEADLINE_S} s for {what}")
        time.sleep(0.05)


def _run_in_thread(
    scheduler: PlanScheduler, plan: Any, executor: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["report"] = scheduler.run(plan, executor)
        except BaseException as exc:  # the test asserts on it
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


def _interrupting_plan(sleeper_body: Any, pid_file: Path) -> Any:
    """``sleeper`` runs long; ``trigger`` returns once the sleeper is running; ``victim`` (after ``trigger``) is a
    compensable node on a scheduler without an artifact store, so preparing it raises
    ``SchedulerError(boundary_unavailable)`` while the sleeper still runs."""
    wait_for_pid = f"for i in $(seq 1 1200); do [ -s '{pid_file}' ] && exit 0; sleep 0.05; done; exit 1"
    return compile_plan(
        "p",
        "f",
        [
            node("sleeper", body=sleeper_body),
            node("trigger", body={"run": wait_for_pid}),
            node("victim", body={"run": "true"}, tier="compensable", inputs=[Pending("trigger")]),
        ],
    )


def _scheduler(env: Env, host: ThreadHost) -> PlanScheduler:
    env.claim("r1")
    return PlanScheduler(
        "r1",
        env.owner,
        db=env.db,
        dispatcher=env.dispatcher,
        workspace=env.ws,
        host=host,
        journal=env.journal,
        measurer=env.dispatcher.measurer,
        artifacts=None,  # the victim's pre-image cannot be captured: a typed failure mid-run
    )


def test_a_typed_scheduler_failure_kills_a_running_command_and_fails_its_attempt(
    env: Env, tmp_path: Path
) -> None:
    pid_file = tmp_path / "sleeper.pid"
    plan = _interrupting_plan({"run": f"echo $$ > '{pid_file}'; exec sleep 600"}, pid_file)
    pid: int | None = None
    with ThreadHost(max_workers=4) as host:
        scheduler = _scheduler(env, host)
        thread, box = _run_in_thread(scheduler, plan, PlanFileExecutor())
        try:
            _until(lambda: pid_file.exists() and pid_file.read_text().strip(), "the sleeper's pid")
            pid = int(pid_file.read_text())
            _until(lambda: not alive(pid), "the interrupted command to be gone")
            thread.join(DEADLINE_S)
            assert not thread.is_alive(), "the scheduler did not return after the interrupt"
        finally:
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)

    err = box.get("error")
    assert isinstance(err, SchedulerError) and err.code == "boundary_unavailable", box
    assert err.cleanup_errors == ()
    rows = {r["node_id"]: r for r in env.attempt_rows()}
    assert rows["sleeper"]["state"] == "failed" and rows["sleeper"]["error"]["type"] == "interrupted"
    assert rows["trigger"]["state"] == "completed"  # completed evidence stays valid
    assert "victim" not in rows  # refused before its attempt began
    assert all(r["state"] != "started" for r in env.attempt_rows())
    finished = [p for t, p in env.records(types=("attempt-finished",)) if p["node_id"] == "sleeper"]
    assert [p["outcome"] for p in finished] == ["failed"]  # exactly one: the interrupt's


def test_an_executor_can_wait_on_the_cancellation_token(env: Env, tmp_path: Path) -> None:
    pid_file = tmp_path / "started"
    seen: dict[str, Any] = {}
    plan = _interrupting_plan({"python": "waits"}, pid_file)
    commands = PlanFileExecutor()

    def executor(ni: NodeInput) -> Any:
        if ni.id != "sleeper":
            return commands(ni)
        pid_file.write_text(str(os.getpid()))
        seen["cancelled"] = ni.cancel.wait(DEADLINE_S)
        seen["reason"] = ni.cancel.reason
        return {"waited": True}

    with ThreadHost(max_workers=4) as host:
        thread, box = _run_in_thread(_scheduler(env, host), plan, executor)
        thread.join(DEADLINE_S * 2)
        assert not thread.is_alive()
    assert isinstance(box.get("error"), SchedulerError)
    assert seen["cancelled"] is True and "boundary_unavailable" in seen["reason"]
    rows = {r["node_id"]: r["state"] for r in env.attempt_rows()}
    assert rows == {"sleeper": "failed", "trigger": "completed"}
