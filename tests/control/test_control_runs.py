"""Approvals on real runs, on SQLite and PostgreSQL: plan runs through the runtime and its scheduler (node gates
asked before the attempt begins, parking ``waiting-approval``, resume replaying settled nodes), ``@step``-style
flows driven by the ``RunDriver`` (``sp.require_approval``), and a plan changed after its approval."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import smthrs_plugin as sp
from smthrs_plugin.cli.control_support import PlanLauncher
from smthrs_plugin.control.approvals import require_approval
from smthrs_plugin.control.authority import NodeTarget
from smthrs_plugin.control.facade import Control, Launch
from smthrs_plugin.control.receipts import Accepted, AlreadyApplied, Parked, Terminal
from smthrs_plugin.engine.context import RunContext
from smthrs_plugin.engine.drive.active_run import DriveParked, DriveSettled
from smthrs_plugin.engine.drive.driver import RunDriver
from smthrs_plugin.errors import ControlError
from smthrs_plugin.plan import Plan, compile_plan, node
from smthrs_plugin.records.wait_rows import ApprovalWait
from smthrs_plugin.runtime import Runtime, open_runtime
from smthrs_plugin.scheduler.planfile import PlanFileExecutor
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.database import Database

ENV = {"capabilities": ["deploy:prod"]}


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.txt").write_text("release 1.4.0\n")
    return root


@pytest.fixture
def rt(ws: Path, db_url: str, tmp_path: Path) -> Iterator[Runtime]:
    with open_runtime(
        workspace=ws, db=db_url, artifacts=str(tmp_path / "artifacts"), host_id="ctl-host"
    ) as r:
        yield r


def pipeline(log: Path, deploy: str = "cp dist/app.txt deployed/app.txt") -> Plan:
    """build → test → deploy (irreversible, gated by ``ship``); every command appends its name to ``log`` (outside
    the workspace), so the test counts real executions."""
    return compile_plan(
        "release",
        "ci/release",
        [
            node("build", body={"run": f"echo build >> {log} && mkdir -p dist && cp src/app.txt dist/app.txt"},
                 reads=["src/**"], writes=["dist/"]),
            node("test", body={"run": f"echo test >> {log} && grep -q release dist/app.txt"}, reads=["dist/**"]),
            node("deploy", body={"run": f"echo deploy >> {log} && mkdir -p deployed && {deploy}"},
                 reads=["dist/**"], writes=["deployed/"], tier="irreversible", inputs=[sp.plan.Pending("test")],
                 approval={"request": "ship", "envelope": ENV}),
        ],
    )  # fmt: skip


def executions(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def deploy_attempts(db: Database, run_id: str) -> int:
    return int(
        db.read(
            lambda c: c.execute(
                sa.text("SELECT count(*) FROM attempts WHERE run_id = :r AND node_id = 'deploy'"),
                {"r": run_id},
            ).scalar_one()
        )
    )


def test_a_node_gate_parks_the_run_before_its_attempt_and_resume_replays_settled_nodes_clean(
    rt: Runtime, ws: Path, tmp_path: Path
) -> None:
    log = tmp_path / "executions.log"
    control = rt.control()
    card = control.plan(pipeline(log), envelope=ENV, approval=True)
    control.approve(card.approval)
    launcher = PlanLauncher(rt, {})
    receipt = control.run(card, idempotency_key="deploy:v1.4.0", launcher=launcher)
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    run_id = receipt.run_id
    view = control.show(run_id)
    assert view.waiting_approval and [r.request_id for r in view.pending] == ["ship"]
    assert executions(log) == ["build", "test"] and deploy_attempts(rt.db, run_id) == 0
    assert not (ws / "deployed").exists()

    # The same key while it waits: AlreadyApplied, nothing re-executed, still parked.
    assert control.run(card, idempotency_key="deploy:v1.4.0", launcher=launcher) == receipt.replayed()
    assert executions(log) == ["build", "test"]

    assert isinstance(control.approve(NodeTarget(run_id, "ship", view.pending[0].digest, view.pending[0].envelope)),
                      Accepted)  # fmt: skip
    resumed = PlanLauncher(rt, {})
    assert isinstance(control.resume(run_id, idempotency_key="resume:1", launcher=resumed), Accepted)
    assert resumed.report is not None
    assert resumed.report.outcomes == {"build": "clean", "test": "clean", "deploy": "built"}
    assert executions(log) == ["build", "test", "deploy"]  # build and test were served, not re-executed
    assert (ws / "deployed" / "app.txt").read_text() == "release 1.4.0\n"
    assert control.show(run_id).status == "completed"
    assert control.resume(run_id, idempotency_key="resume:1") == Terminal(run_id, "completed")


def test_a_denied_node_request_fails_the_node_with_approval_denied(rt: Runtime, tmp_path: Path) -> None:
    log = tmp_path / "executions.log"
    control = rt.control()
    card = control.plan(pipeline(log), envelope=ENV)
    receipt = control.run(card, idempotency_key="k", launcher=PlanLauncher(rt, {}))
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    pending = control.show(receipt.run_id).pending[0]
    control.deny(NodeTarget(receipt.run_id, "ship", pending.digest, pending.envelope))
    resumed = PlanLauncher(rt, {})
    control.resume(receipt.run_id, idempotency_key="r", launcher=resumed)
    assert resumed.report is not None
    deploy = resumed.report.settlement("deploy")
    assert deploy.outcome == "failed" and "approval_denied" in (deploy.error or "")
    assert control.show(receipt.run_id).status == "failed"
    assert "deploy" not in executions(log) and deploy_attempts(rt.db, receipt.run_id) == 0


def test_a_changed_plan_after_approval_does_not_run_under_the_old_approval(
    rt: Runtime, tmp_path: Path
) -> None:
    log = tmp_path / "executions.log"
    control = rt.control()
    approved = control.plan(pipeline(log), envelope=ENV, approval=True)
    control.approve(approved.approval)
    edited = control.plan(pipeline(log, deploy="rm -rf / --no-preserve-root"), envelope=ENV, approval=True)
    assert edited.digest != approved.digest and edited.plan_id != approved.plan_id
    launcher = PlanLauncher(rt, {})
    assert control.run(edited, idempotency_key="k", launcher=launcher) == Parked(edited.plan_id)
    with pytest.raises(ControlError) as info:  # the old card's id with the new content's digest
        control.run(Launch(approved.plan_id, edited.digest, edited.envelope), idempotency_key="k2")
    assert info.value.code == "plan_digest_mismatch"
    assert executions(log) == [] and launcher.report is None


def test_the_runtime_gates_every_plan_run_it_schedules_even_without_the_control_plane(
    rt: Runtime, tmp_path: Path
) -> None:
    log = tmp_path / "executions.log"
    plan = pipeline(log)
    with pytest.raises(sp.RunParked) as parked:
        rt.scheduler("direct-1").run(plan, PlanFileExecutor())
    assert parked.value.kind == "approval" and isinstance(parked.value.waiting, ApprovalWait)
    control = rt.control()
    state = control.approvals.node_state("direct-1", "ship")
    assert state is not None and state.tag == "Pending"
    assert executions(log) == ["build", "test"] and deploy_attempts(rt.db, "direct-1") == 0


# -- @step-style flows driven by the RunDriver -------------------------------------------------------------------


@pytest.fixture
def fast() -> Settings:
    return load_settings(heartbeat_interval_s=0.05, stale_after_s=1.0, skew_allowance_s=0.1,
                         heartbeat_failure_interrupt_s=0.6, wait_budget_s=5.0, wait_poll_s=0.05, host_id="ctl-host")  # fmt: skip


@pytest.fixture
def driver(db: Database, fast: Settings) -> Iterator[RunDriver]:
    d = RunDriver(db, settings=fast)
    yield d
    d.stop(grace_s=5)


def _ship_flow(calls: list[str]) -> Callable[[RunContext], Any]:
    def flow(ctx: RunContext) -> Any:
        calls.append("asked")
        approved = require_approval("ship", envelope=ENV)
        calls.append("shipped")
        return {"by": str(approved.principal)}

    return flow


def eventually(cond: Callable[[], Any], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (v := cond()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)
    return v


def test_require_approval_parks_a_flow_and_the_driver_resumes_it_after_the_decision(
    db: Database, driver: RunDriver, fast: Settings
) -> None:
    calls: list[str] = []
    driver.register("ops/ship", _ship_flow(calls))
    driver.submit("ship-1", "ops/ship")
    parked = driver.drive("ship-1")
    assert isinstance(parked, DriveParked) and isinstance(parked.wait, ApprovalWait)
    control = Control(db, settings=fast)
    req = control.show("ship-1").pending[0]
    assert req.digest == "ops/ship:ship"
    assert isinstance(control.approve(NodeTarget("ship-1", "ship", req.digest, req.envelope)), Accepted)
    driver.tick()  # the sweep finds the woken run of a registered flow and drives it
    eventually(lambda: control.show("ship-1").status == "completed")
    assert calls == ["asked", "asked", "shipped"]
    assert control.show("ship-1").requests[0].state == "approved"


def test_require_approval_denied_fails_the_flow_with_approval_denied(
    db: Database, driver: RunDriver, fast: Settings
) -> None:
    calls: list[str] = []
    driver.register("ops/ship", _ship_flow(calls))
    driver.submit("ship-2", "ops/ship")
    assert isinstance(driver.drive("ship-2"), DriveParked)
    control = Control(db, settings=fast)
    control.deny(NodeTarget("ship-2", "ship", "ops/ship:ship", ENV))  # type: ignore[arg-type]
    outcome = driver.drive("ship-2")
    assert isinstance(outcome, DriveSettled) and outcome.status == "failed"
    assert control.show("ship-2").error["code"] == "approval_denied"
    assert calls == ["asked", "asked"]
    assert isinstance(control.resume("ship-2", idempotency_key="r"), Terminal)


def test_a_same_key_retry_of_a_run_woken_by_its_decision_drives_it(rt: Runtime, tmp_path: Path) -> None:
    log = tmp_path / "executions.log"
    control = rt.control()
    card = control.plan(pipeline(log), envelope=ENV)
    first = control.run(card, idempotency_key="k", launcher=PlanLauncher(rt, {}))
    assert isinstance(first, Accepted) and first.run_id is not None
    req = control.show(first.run_id).pending[0]
    control.approve(NodeTarget(first.run_id, "ship", req.digest, req.envelope))
    retry = PlanLauncher(rt, {})
    assert isinstance(control.run(card, idempotency_key="k", launcher=retry), AlreadyApplied)
    assert retry.report is not None and retry.report.outcomes["deploy"] == "built"
    assert executions(log) == ["build", "test", "deploy"]
