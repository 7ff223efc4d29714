"""Durable waits and node approvals inside Prefect ``@flow`` bodies (real flow runs on the session's server, SQLite
and PostgreSQL): in-process waits, parking beyond the budget (Prefect shows the flow run Paused), resuming through
a run driver with settled steps served ``clean``, approvals, cancellation, and the typed refusals."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import poll
from _timetravel import let_the_deadline_pass
from prefect import flow

import smthrs_plugin as sp
from smthrs_plugin.control import NodeTarget
from smthrs_plugin.engine.cancellation import cancel_run
from smthrs_plugin.engine.context import RunCancelled
from smthrs_plugin.engine.drive.driver import RunDriver
from smthrs_plugin.errors import WaitError
from smthrs_plugin.prefect.flows import flow_fn, flow_name
from smthrs_plugin.prefect.steprun import current_spec
from smthrs_plugin.records.wait_rows import TimerWait


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


pytestmark = pytest.mark.prefect

EXECUTED: list[str] = []
SEEN: list[Any] = []


@sp.step(writes=["built.txt"])
def build(ws: sp.Workspace, n: int) -> int:
    EXECUTED.append(f"build:{n}")
    (ws / "built.txt").write_text(str(n))
    return n * 2


@sp.step
def publish(value: int) -> int:
    EXECUTED.append(f"publish:{value}")
    return value + 1


@flow(persist_result=False)
def nightly(n: int = 1) -> int:
    built = build(n)
    sp.sleep(
        3600, name="cool-down"
    )  # far longer than any drive: the test lets it pass (_timetravel.let_the_deadline_pass)
    return publish(built)


@flow(persist_result=False)
def napping(n: int = 1) -> int:
    SEEN.append(sp.current_run().run_id)
    sp.sleep(0.3, name="nap")
    return build(n)


@flow(persist_result=False)
def gated(n: int = 1) -> int:
    built = build(n)
    sp.require_approval("ship", envelope={"capabilities": ["deploy:prod"]})
    return publish(built)


@flow(persist_result=False)
def waiting(n: int = 1) -> int:
    SEEN.append(sp.wait_for("go"))
    return build(n)


@flow(persist_result=False)
def sleepy(n: int = 1) -> None:
    SEEN.append(sp.current_run().run_id)
    sp.sleep(600, name="long")


@flow(persist_result=False, validate_parameters=False)
def odd(tags: Any = None) -> None:
    sp.sleep(60, name="never")


@pytest.fixture
def ws(tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv(
        "SMTHRS_WAIT_BUDGET_S", "0"
    )  # every wait beyond "now" parks, unless a test says otherwise
    EXECUTED.clear()
    SEEN.clear()
    with sp.step_settings(workspace=tmp_path, db=db_url):
        yield tmp_path


def _flow_runs(rt: sp.Runtime, run_id: str) -> list[str]:
    return [
        e.payload["flow_run_id"] for e in rt.journal.read(run_id, limit=500) if e.type == "prefect-flow-run"
    ]


def _prefect_state(api: str, flow_run_id: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=30) as r:
        state: dict[str, Any] = json.loads(r.read())["state"]
    return state


def test_a_sleep_within_the_budget_inside_a_flow_returns_in_process_at_its_stored_deadline(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_WAIT_BUDGET_S", "30")
    assert napping(4) == 8
    rt = current_spec().open()
    (run_id,) = SEEN
    record = rt.runs.get(run_id)
    assert record is not None and record.status == "completed" and record.flow == "prefect/napping"
    clock = rt.driver.waits.clock(record.flow, run_id, "nap")
    assert clock is not None and not clock.pending
    settled_at = record.finished_at_ms
    assert settled_at is not None and settled_at >= clock.due_at_ms  # never returned before its deadline
    (recorded,) = [e.payload for e in rt.journal.read(run_id) if e.type == "prefect-flow-run"]
    assert recorded["parameters"] == {"n": 4} and run_id == f"prefect-{recorded['flow_run_id']}"


def test_a_sleep_beyond_the_budget_pauses_the_flow_run_and_a_driver_resumes_it_at_the_stored_deadline(
    ws: Path, prefect_api: str
) -> None:
    with pytest.raises(sp.RunParked) as parked:
        nightly(3)
    run_id = parked.value.run_id
    due = parked.value.due_at_ms
    assert due is not None and parked.value.kind == "timer"
    rt = current_spec().open()
    row = rt.runs.get(run_id)
    assert row is not None and row.status == "suspended" and row.waiting is not None
    assert row.waiting.reason == "timer" and row.waiting.wake_at_ms == due
    (first,) = _flow_runs(rt, run_id)
    state = _prefect_state(prefect_api, first)
    assert (state["type"], state["name"]) == ("PAUSED", "Parked") and run_id in state["message"]
    assert EXECUTED == ["build:3"]

    # Driving it again before the deadline re-executes the flow: the step is served clean, the deadline is kept.
    early = sp.durable_run(nightly, run_id, budget_s=0)
    assert isinstance(early, sp.DriveParked) and early.wait == TimerWait(due, None)
    assert EXECUTED == ["build:3"]

    due = let_the_deadline_pass(rt.db, run_id, "cool-down")  # the hour has passed, without waiting for it
    driver = RunDriver(rt.db, settings=rt.settings, wait_budget_s=0, tick_s=0.2)
    driver.register(flow_name(nightly), flow_fn(nightly))
    with driver:
        final = poll(lambda: rt.runs.get(run_id), lambda r: r is not None and r.status == "completed")
    assert final is not None and final.status == "completed"
    fired = [e for e in rt.journal.read(run_id, limit=500) if e.type == "clock-fired"]
    assert len(fired) == 1 and fired[0].created_at_ms >= due  # fired once, never before the stored deadline
    assert EXECUTED == ["build:3", "publish:6"]  # build ran once; each step ran once across three flow runs
    outcomes = [e.payload["outcome"] for e in rt.journal.read(run_id, limit=500) if e.type == "step-settled"]
    assert sorted(outcomes) == ["built", "built", "clean", "clean"]  # hits are journaled in batches: no order
    last = _flow_runs(rt, run_id)[-1]
    assert _flow_runs(rt, run_id)[0] == first and len(_flow_runs(rt, run_id)) == 3
    assert poll(lambda: _prefect_state(prefect_api, last)["type"], lambda t: t == "COMPLETED") == "COMPLETED"
    resumed = _prefect_state(prefect_api, first)  # the parked incarnation no longer shows Paused
    assert (resumed["type"], resumed["name"]) == ("COMPLETED", "Resumed")


def test_require_approval_inside_a_flow_parks_waiting_approval_and_the_driver_resumes_it_once_approved(
    ws: Path,
) -> None:
    out = sp.durable_run(gated, "release-1", {"n": 5})
    assert isinstance(out, sp.DriveParked) and out.wait.reason == "waiting-approval"
    rt = current_spec().open()
    control = rt.control()
    view = control.show("release-1")
    assert view.waiting_approval and [r.request_id for r in view.pending] == ["ship"]
    assert EXECUTED == ["build:5"]

    pending = view.pending[0]
    assert isinstance(
        control.approve(NodeTarget("release-1", "ship", pending.digest, pending.envelope)),
        sp.control.Accepted,
    )
    driver = RunDriver(rt.db, settings=rt.settings, tick_s=0.2)
    driver.register(flow_name(gated), flow_fn(gated))
    with driver:
        final = poll(lambda: rt.runs.get("release-1"), lambda r: r is not None and r.status == "completed")
    assert final is not None and final.status == "completed"
    assert EXECUTED == ["build:5", "publish:10"]  # build served clean on resume, publish ran once


def test_a_denied_approval_inside_a_flow_fails_the_run_with_approval_denied(ws: Path) -> None:
    assert isinstance(sp.durable_run(gated, "release-2", {"n": 1}), sp.DriveParked)
    control = current_spec().open().control()
    pending = control.show("release-2").pending[0]
    assert isinstance(
        control.deny(NodeTarget("release-2", "ship", pending.digest, pending.envelope)), sp.control.Accepted
    )
    out = sp.durable_run(gated, "release-2")
    assert isinstance(out, sp.DriveSettled) and out.status == "failed"
    record = current_spec().open().runs.get("release-2")
    assert record is not None and record.error is not None and record.error["code"] == "approval_denied"
    assert EXECUTED == ["build:1"]  # publish never ran


def test_wait_for_inside_a_flow_is_woken_by_a_completion_from_another_thread(
    ws: Path, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def later() -> None:
        # Complete once the run exists (a completion names an existing run: not_found until the flow run
        # created it); before or after the flow reaches its wait, the wait returns the value (kept as deferred).
        deadline = time.monotonic() + 120  # far above the flow run's start, however busy the machine
        while True:
            try:
                sp.complete("wf-1", "go", {"ok": 42}, db=db_url)
                return
            except sp.StoreError as exc:
                if exc.code != "not_found" or time.monotonic() > deadline:
                    raise
            threading.Event().wait(0.05)

    t = threading.Thread(target=later)
    t.start()
    out = sp.durable_run(waiting, "wf-1", budget_s=60)
    t.join()
    assert isinstance(out, sp.DriveSettled) and out.status == "completed"
    assert SEEN == [{"ok": 42}] and EXECUTED == ["build:1"]


def test_cancelling_a_flow_run_waiting_in_process_settles_its_run_cancelled(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_WAIT_BUDGET_S", "600")
    rt = current_spec().open()

    def cancel_when_waiting() -> None:
        poll(lambda: list(SEEN), bool, timeout_s=60)
        cancel_run(rt.runs, SEEN[0])

    t = threading.Thread(target=cancel_when_waiting)
    t.start()
    with pytest.raises(RunCancelled):
        sleepy()
    t.join()
    record = rt.runs.get(SEEN[0])
    assert record is not None and record.status == "cancelled"
    clock = rt.driver.waits.clock(record.flow, record.run_id, "long")
    assert clock is not None and not clock.pending  # the terminal transaction closed it


def test_a_flow_whose_parameters_are_not_plain_json_refuses_to_park(ws: Path) -> None:
    with pytest.raises(WaitError) as refused:
        odd({1, 2})
    assert refused.value.code == "unresumable_flow"
    rt = current_spec().open()
    (row,) = [r for r in rt.runs.list(limit=10) if r.flow == "prefect/odd"]
    assert row.status == "failed" and row.waiting is None


def test_durable_run_refuses_other_parameters_for_the_same_run_id_before_writing(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = sp.durable_run(napping, "nap-1", {"n": 2}, budget_s=30)
    assert isinstance(out, sp.DriveSettled) and out.status == "completed"
    rt = current_spec().open()
    before = len(rt.journal.read("nap-1", limit=500))
    with pytest.raises(WaitError) as refused:
        sp.durable_run(napping, "nap-1", {"n": 3})
    assert refused.value.code == "parameters_mismatch"
    with pytest.raises(WaitError) as other_flow:
        sp.durable_run(nightly, "nap-1")
    assert other_flow.value.code == "invalid_wait"
    assert len(rt.journal.read("nap-1", limit=500)) == before


COOL = sp.plan.compile_plan("cooling", "ci/cool", [sp.plan.node("cool", body={}, wait={"seconds": 600})])


@flow(persist_result=False)
def with_plan(n: int = 1) -> Any:
    build(n)  # binds this flow run's own smthrs run
    spec = current_spec()
    with sp.open_runtime(spec.workspace, db=spec.db_url) as rt:
        return rt.scheduler("plan-in-flow").run(COOL, lambda ni: None).outcomes


def test_a_plan_run_parking_inside_a_flow_run_parks_itself_and_fails_the_flow_runs_own_run(ws: Path) -> None:
    with pytest.raises(sp.RunParked) as parked:
        with_plan(2)
    assert parked.value.run_id == "plan-in-flow"
    rt = current_spec().open()
    plan_run = rt.runs.get("plan-in-flow")
    assert plan_run is not None and plan_run.status == "suspended" and plan_run.waiting is not None
    assert plan_run.waiting.reason == "timer"  # resumable at its deadline like any plan run
    (own,) = rt.runs.list(flow=flow_name(with_plan))
    assert own.status == "failed" and "plan-in-flow" in own.error["message"]


@sp.step
def gated_step(version: str) -> str:
    sp.require_approval("ship")
    return version


@sp.step
def sleeping_step(seconds: float) -> float:
    sp.sleep(seconds)
    return seconds


@flow(persist_result=False)
def gate_in_step(version: str = "1.0") -> str:
    return gated_step(version)


@flow(persist_result=False)
def sleep_in_step(seconds: float = 0.1) -> float:
    return sleeping_step(seconds)


@pytest.mark.parametrize("body", [gate_in_step, sleep_in_step], ids=["require_approval", "sleep"])
def test_a_wait_inside_a_step_body_is_refused_because_a_cache_hit_would_skip_it(ws: Path, body: Any) -> None:
    out = sp.durable_run(body, "in-step-1", budget_s=30)
    assert isinstance(out, sp.DriveSettled) and out.status == "failed"
    rt = current_spec().open()
    record = rt.runs.get("in-step-1")
    assert (
        record is not None and record.error["code"] == "invalid_wait" and "@step" in record.error["message"]
    )
    types = {e.type for e in rt.journal.read("in-step-1", limit=500)}
    assert "control.approval.requested" not in types and "clock-scheduled" not in types  # nothing was written


@flow(persist_result=False)
def needs_day(day: str, pages: int = 1) -> str:
    return f"{day}:{pages}"


def test_a_flow_that_cannot_be_called_with_its_parameters_is_refused_before_the_run_exists(ws: Path) -> None:
    rt = current_spec().open()
    for params in (None, {"day": "d", "nope": 1}, {"day": {1, 2}}):
        with pytest.raises(WaitError) as refused:
            sp.durable_run(needs_day, "day-1", params)
        assert refused.value.code in ("invalid_wait", "unresumable_flow")
    assert rt.runs.get("day-1") is None


def test_smthrs_worker_run_takes_params_for_a_new_run_and_refuses_other_ones_later(
    ws: Path, db_url: str
) -> None:
    from typer.testing import CliRunner

    from smthrs_plugin.cli import app

    runner = CliRunner()
    base = ["worker", "--flow", "test_flow_waits:needs_day", "--workspace", str(ws), "--db", db_url, "--json"]
    first = runner.invoke(app, [*base, "--run", "day-2", "--param", "day=2026-11-30", "--param", "pages=3"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.output)["status"] == "completed"
    rt = current_spec().open()
    (record,) = [e.payload for e in rt.journal.read("day-2") if e.type == "prefect-flow-run"]
    assert record["parameters"] == {"day": "2026-11-30", "pages": 3}  # JSON where it parses, else a string
    other = runner.invoke(app, [*base, "--run", "day-2", "--param", "day=2026-12-01"])
    assert other.exit_code == 2 and json.loads(other.output)["error"]["code"] == "parameters_mismatch"
    missing = runner.invoke(app, [*base, "--run", "day-3"])
    assert missing.exit_code == 2 and rt.runs.get("day-3") is None


@flow(persist_result=False)
async def async_nightly(n: int = 1) -> int:
    built = build(n)
    sp.sleep(1.0, name="cool-down")
    return built


def test_an_async_flow_parks_and_a_later_drive_resumes_it_after_its_deadline(ws: Path) -> None:
    out = sp.durable_run(async_nightly, "async-1", {"n": 7}, budget_s=0)
    assert isinstance(out, sp.DriveParked) and isinstance(out.wait, TimerWait)
    while time.time() * 1000 < out.wait.wake_at_ms:
        time.sleep(0.05)
    done = sp.durable_run(async_nightly, "async-1", budget_s=0)
    assert isinstance(done, sp.DriveSettled) and done.status == "completed"
    assert EXECUTED == ["build:7"]  # served clean on the second drive


def test_smthrs_resume_with_flow_answers_parked_then_drives_the_flows_run_once_approved(
    ws: Path, db_url: str
) -> None:
    from typer.testing import CliRunner

    from smthrs_plugin.cli import app

    assert isinstance(sp.durable_run(gated, "release-3", {"n": 2}), sp.DriveParked)
    runner = CliRunner()
    opts = ["--workspace", str(ws), "--db", db_url, "--json"]
    resume = ["resume", "release-3", "--flow", "test_flow_waits:gated", *opts]
    waiting = runner.invoke(app, [*resume, "--key", "r1"])
    assert waiting.exit_code == 75, waiting.output
    assert json.loads(waiting.output)["receipt"]["_tag"] == "Parked" and EXECUTED == ["build:2"]
    approved = runner.invoke(app, ["approve", "release-3", "--request", "ship", *opts])
    assert approved.exit_code == 0, approved.output
    done = runner.invoke(app, [*resume, "--key", "r2"])
    assert done.exit_code == 0, done.output
    answer = json.loads(done.output)
    assert answer["receipt"]["_tag"] == "Accepted" and answer["status"] == "completed"
    assert EXECUTED == ["build:2", "publish:4"]  # build served clean, publish ran once
    again = runner.invoke(app, [*resume, "--key", "r2"])
    assert again.exit_code == 0 and json.loads(again.output)["receipt"]["_tag"] == "Terminal"
    assert EXECUTED == ["build:2", "publish:4"]
