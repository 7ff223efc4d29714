"""Scheduler and lifecycle records shared with the reference engine.

- ``node-scheduled`` carries ``waited``: the admission passes in which capacity left the node waiting before it was
  admitted (its aging bonus), and that count — hence admission order — is the same on the inline and thread hosts.
- A deferred sink journals ``selection-deferred`` (the debt, under its plan key) right before its ``deferred``
  settlement, and only when the deferral took effect: a failed cone settles the sink ``skipped`` with no debt.
- A control lifecycle fact's ``run`` is the run summary in the control vocabulary: camelCase members and the
  control statuses (``accepted``, ``running``, ``parked``, ``waiting-approval``, ``completed``, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sched_support import Env, make_env

import smthrs_plugin as sp
from smthrs_plugin.engine.facts import SUMMARY_STATUSES, lifecycle_fact, run_summary_in, summary_status
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.scheduler import InlineHost, NodeInput, ThreadHost
from smthrs_plugin.stores.schema import runs as runs_table


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


def _scheduled(env: Env, run_id: str) -> list[tuple[str, int]]:
    return [(p["node_id"], p["waited"]) for _, p in env.records(run_id, types=("node-scheduled",))]


# -- waited, and aging identical on every host ------------------------------------------------------------------


def test_node_scheduled_records_how_many_passes_capacity_left_the_node_waiting(env: Env) -> None:
    # The reference's own admission case: one step permit, three ready nodes of different priorities.
    plan = sp.plan.compile_plan(
        "prio",
        "f",
        [
            sp.plan.node("low", body=0),
            sp.plan.node("high", body=1, priority=5),
            sp.plan.node("medium", body=2, priority=2),
        ],
    )
    order: list[str] = []

    def executor(ni: NodeInput) -> Any:
        order.append(ni.id)
        return ni.id

    env.scheduler("r1", concurrency={"steps": 1}, host=InlineHost()).run(plan, executor)
    assert order == ["high", "medium", "low"]
    assert _scheduled(env, "r1") == [("high", 0), ("medium", 1), ("low", 2)]


def _aging_plan() -> sp.plan.Plan:
    # Priorities close enough that one extra pass of aging would reorder admission; a dependent that becomes
    # ready mid-run starts aging from the pass after it became ready.
    return sp.plan.compile_plan(
        "aging",
        "f",
        [
            sp.plan.node("a", body="a", priority=3),
            sp.plan.node("b", body="b", priority=2),
            sp.plan.node("c", body="c", priority=1),
            sp.plan.node("d", body="d", priority=0),
            sp.plan.node("after-a", body="x", priority=4, inputs=[sp.plan.Ref("a")]),
            sp.plan.node("e", body="e", priority=-3),
        ],
    )


@pytest.mark.parametrize("workers", [1, 4])
def test_aging_is_identical_on_the_inline_and_the_thread_host(tmp_path: Path, workers: int) -> None:
    plan = _aging_plan()
    seen: dict[str, list[tuple[str, int]]] = {}
    orders: dict[str, list[str]] = {}
    for name, host in (("inline", InlineHost()), ("thread", ThreadHost(workers))):
        env = make_env(tmp_path / name)
        order: list[str] = []

        def executor(ni: NodeInput, order: list[str] = order) -> Any:
            order.append(ni.id)
            return ni.id

        try:
            report = env.scheduler("r1", concurrency={"steps": 1}, host=host).run(plan, executor)
        finally:
            host.close()
        assert set(report.outcomes.values()) == {"built"}
        seen[name] = _scheduled(env, "r1")
        orders[name] = order
    assert seen["thread"] == seen["inline"]
    assert orders["thread"] == orders["inline"]
    # One permit: each pass admits the best ready node and ages the others by one (after-a from its readiness on).
    assert seen["inline"] == [("a", 0), ("after-a", 0), ("b", 2), ("c", 3), ("d", 4), ("e", 5)]


# -- selection-deferred ---------------------------------------------------------------------------------------


def test_a_deferred_sink_journals_its_selection_debt_just_before_its_deferred_settlement(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "sel", "f", [sp.plan.node("up", body=1), sp.plan.node("sink", body=2, inputs=[sp.plan.Ref("up")])]
    )
    report = env.scheduler("r1").run(plan, lambda ni: ni.id, defer=["sink"])
    assert report.outcomes == {"up": "built", "sink": "deferred"} and report.debt == ("sink",)
    records = env.records("r1", types=("selection-deferred", "node-settled"))
    debt = ("selection-deferred", {"plan_id": "sel", "node_id": "sink", "plan_key": plan.node("sink").key})
    assert debt in records
    at = records.index(debt)
    settled = records[at + 1]
    assert (
        settled[0] == "node-settled"
        and settled[1]["node_id"] == "sink"
        and settled[1]["outcome"] == "deferred"
    )
    assert [r for r in records if r[0] == "selection-deferred"] == [debt]  # one debt, nothing for `up`


def test_a_selected_sink_whose_cone_failed_is_skipped_without_selection_debt(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "sel", "f", [sp.plan.node("up", body=1), sp.plan.node("sink", body=2, inputs=[sp.plan.Ref("up")])]
    )

    def executor(ni: NodeInput) -> Any:
        raise RuntimeError("up fails")

    report = env.scheduler("r1").run(plan, executor, defer=["sink"])
    assert report.outcomes == {"up": "failed", "sink": "skipped"} and report.debt == ()
    assert env.records("r1", types=("selection-deferred",)) == []


# -- the run summary of lifecycle facts -------------------------------------------------------------------------


def test_engine_statuses_map_to_the_control_summary_statuses() -> None:
    assert SUMMARY_STATUSES == (
        "accepted",
        "running",
        "parked",
        "waiting-approval",
        "cancelled",
        "completed",
        "failed",
    )
    assert summary_status("pending", None) == "accepted"
    assert summary_status("running", None) == "running"
    assert summary_status("suspended", "waiting-approval") == "waiting-approval"
    for reason in ("timer", "event", "released", "quarantine"):
        assert summary_status("suspended", reason) == "parked"
    for settled in ("completed", "failed", "cancelled"):
        assert summary_status(settled, None) == settled
    with pytest.raises(ValueError):
        summary_status("exploded", None)


def test_a_parked_run_summary_says_why_it_waits_in_camel_case(env: Env) -> None:
    RunStore(env.db, journal=env.journal).create("p1", "flow/x")
    for reason, status in (("waiting-approval", "waiting-approval"), ("timer", "parked")):
        env.db.write(
            lambda c, reason=reason: c.execute(
                sa.update(runs_table)
                .where(runs_table.c.run_id == "p1")
                .values(status="suspended", waiting_reason=reason, wake_at_ms=123)
            )
        )
        summary = env.db.read(lambda c: run_summary_in(c, "p1"))
        assert summary is not None
        assert summary["status"] == status
        assert summary["waiting"] == {"reason": reason, "wakeAtMs": 123, "tokenDigest": None}
        assert summary["runId"] == "p1" and summary["flowId"] == "flow/x"
        assert "ownerId" not in summary and "planId" not in summary  # absent, never null
        fact = env.db.read(lambda c: lifecycle_fact(c, "p1", "legacy"))
        assert fact == {"factVersion": 1, "baseline": "legacy", "run": summary}
    assert env.db.read(lambda c: lifecycle_fact(c, "gone", "created")) == {
        "factVersion": 1,
        "unavailable": "missing-row",
    }


def test_control_lifecycle_facts_carry_the_run_summary_of_an_admitted_and_driven_run(tmp_path: Path) -> None:
    from smthrs_plugin.cli.control_support import PlanLauncher

    ws = tmp_path / "ws"
    ws.mkdir()
    with sp.open_runtime(workspace=ws, artifacts=str(tmp_path / "artifacts"), host_id="ctl-host") as rt:
        control = rt.control()
        plan = sp.plan.compile_plan("hello", "ci/hello", [sp.plan.node("hi", body={"run": "true"})])
        card = control.plan(plan, envelope={"capabilities": ["deploy:prod"]})
        receipt = control.run(card, idempotency_key="k", launcher=PlanLauncher(rt, {}))
        run_id = receipt.run_id  # type: ignore[union-attr]
        assert run_id is not None
        events = [e for e in rt.journal.read(run_id, limit=1000) if e.type.startswith("control.run.")]
    assert [e.type for e in events] == [
        "control.run.accepted",
        "control.run.running",
        "control.run.completed",
    ]
    runs = [e.payload["run"] for e in events]
    assert [r["status"] for r in runs] == ["accepted", "running", "completed"]
    for r in runs:
        assert r["runId"] == run_id and r["flowId"] == "ci/hello"
        assert r["planId"] == card.plan_id and r["planDigest"] == card.digest
        assert type(r["createdAt"]) is int and type(r["updatedAt"]) is int
        assert not any("_" in k for k in r)  # camelCase members only
    assert (
        runs[1]["ownerId"].startswith("ctl-host/") and "ownerId" not in runs[0] and "ownerId" not in runs[2]
    )
    assert runs[0]["startedAt"] is None and runs[1]["startedAt"] is not None
    assert runs[2]["finishedAt"] is not None and runs[2]["waiting"] is None
