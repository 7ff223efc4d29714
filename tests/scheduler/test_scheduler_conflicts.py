"""Materialisation conflicts (delay-rebase, stop-merge), effect tiers, and reconciliation of deviations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sched_support import Env, make_env

import smthrs_plugin as sp
from smthrs_plugin.errors import SchedulerError
from smthrs_plugin.scheduler import (
    ConflictCase,
    Deviation,
    FactorOut,
    Fail,
    NodeInput,
    ReconcileContext,
    Reorder,
)
from smthrs_plugin.stores.plan_tables import plan_generations, plan_merges


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


def _intruder(env: Env, node: str, times: int, path: str = "out.txt") -> Any:
    """An executor whose first ``times`` attempts of ``node`` see another writer land on ``path`` underneath them."""
    seen = {"n": 0}

    def executor(ni: NodeInput) -> Any:
        if ni.id == node:
            seen["n"] += 1
            if seen["n"] <= times:
                (env.ws / path).write_text(f"landed by someone else #{seen['n']}")
        for w in ni.node.effects.writes:
            (ni.root / w).write_text(f"{ni.id} attempt {ni.attempt}")
        return {"node": ni.id}

    return executor


@pytest.mark.parametrize("conflicts", [1, 2, 3])
def test_delay_rebase_is_bounded_by_the_rebase_limit(env: Env, conflicts: int) -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("x", body=1, writes=["out.txt"]),
            sp.plan.node("after", body=2, inputs=[sp.plan.Ref("x")]),
        ],
    )
    report = env.scheduler(rebase_limit=2).run(plan, _intruder(env, "x", conflicts))
    x = report.settlement("x")
    assert (x.attempts, x.rebases) == (min(conflicts + 1, 3), min(conflicts, 2))
    assert (x.outcome == "failed") == (conflicts == 3)
    assert report.outcomes["after"] == ("skipped" if conflicts == 3 else "built")
    invalidated = [p for t, p in env.records(types=("node-invalidated",))]
    assert len(invalidated) == min(conflicts, 2)
    assert all(
        p["reason"] == "materialization-conflict" and p["from"] == p["to"] == x.dispatch_key
        for p in invalidated
    )
    rows = [r for r in env.attempt_rows() if r["node_id"] == "x"]
    assert [r["state"] for r in rows] == ["failed"] * min(conflicts, 3) + (
        ["completed"] if conflicts < 3 else []
    )
    if conflicts == 3:
        assert [type(v).__name__ for v in report.verdicts] == ["Fail"]
        assert (env.ws / "out.txt").read_text() == "landed by someone else #3"  # never clobbered
    else:
        assert (env.ws / "out.txt").read_text() == f"x attempt {conflicts + 1}"


def test_a_rebased_node_on_the_thread_host_takes_a_step_permit_again_before_its_body_reruns(env: Env) -> None:
    # On the thread host a node frees its permit when its body returns; a conflict sends it round again, and its
    # next body must wait for a permit like any other: never more than ``steps`` bodies at once.
    import threading

    from smthrs_plugin.scheduler import ThreadHost

    plan = sp.plan.compile_plan(
        "p",
        "f",
        [sp.plan.node("x", body=1, writes=["out.txt"], priority=9)]
        + [sp.plan.node(f"w{i}", body=10 + i) for i in range(8)],
    )
    inner = _intruder(env, "x", 2)
    lock = threading.Lock()
    bodies = {"now": 0, "most": 0}

    def executor(ni: NodeInput) -> Any:
        with lock:
            bodies["now"] += 1
            bodies["most"] = max(bodies["most"], bodies["now"])
        try:
            return inner(ni)
        finally:
            with lock:
                bodies["now"] -= 1

    with ThreadHost(4) as host:
        report = env.scheduler(rebase_limit=2, concurrency={"steps": 2}, host=host).run(plan, executor)
    x = report.settlement("x")
    assert (x.outcome, x.attempts, x.rebases) == ("built", 3, 2)
    assert all(report.outcomes[f"w{i}"] == "built" for i in range(8))
    assert bodies["most"] <= 2


def test_an_irreversible_node_is_never_retried(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "p", "f", [sp.plan.node("deploy", body=1, tier="irreversible", writes=["out.txt"])]
    )
    report = env.scheduler(rebase_limit=3).run(plan, _intruder(env, "deploy", 1))
    d = report.settlement("deploy")
    assert (d.outcome, d.attempts, d.rebases) == ("failed", 1, 0)
    calls: list[str] = []
    again = env.scheduler().run(plan, lambda ni: calls.append(ni.id) or {})
    assert calls == [] and again.outcomes == {"deploy": "failed"}
    assert "irreversible" in (again.settlement("deploy").error or "")


def test_non_sealed_tiers_use_run_local_keys_that_never_reach_the_shared_cache(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("c", body=1, tier="compensable", writes=["c.txt"]),
            sp.plan.node("s", body=1, writes=["s.txt"]),
        ],
    )
    from smthrs_plugin.plan.keys import run_local_key

    report = env.scheduler().run(plan, _intruder(env, "none", 0))
    assert report.settlement("c").dispatch_key == run_local_key("p", "c", plan.node("c").key, "r1")
    other = env.scheduler("r2").run(plan, _intruder(env, "none", 0))
    assert other.settlement("c").dispatch_key != report.settlement("c").dispatch_key
    assert other.outcomes == {"c": "built", "s": "clean"}  # sealed work is shared; compensable work is not


def _race_plan(*extra: sp.plan.NodeDraft, maximum: int = 100) -> sp.plan.Plan:
    return sp.plan.compile_plan(
        "race",
        "f",
        [
            sp.plan.node("winner", body="w", writes=["shared.txt"], conflict="lane", runtime="stop-merge"),
            sp.plan.node("loser", body="l", writes=["shared.txt"], conflict="lane", runtime="stop-merge"),
            sp.plan.node("tail", body="t", inputs=[sp.plan.Ref("loser")]),
            *extra,
        ],
        maximum_plan_nodes=maximum,
    )


def test_stop_merge_skips_the_loser_and_appends_a_merge_node_at_the_first_free_name(env: Env) -> None:
    plan = _race_plan(sp.plan.node("loser+merge", body="user node of that name"))
    calls: list[tuple[str, str]] = []
    base_executor = _intruder(env, "loser", 1, "shared.txt")

    def executor(ni: NodeInput) -> Any:
        calls.append((ni.id, ni.node.kind))
        return base_executor(ni)

    report = env.scheduler().run(plan, executor)
    assert report.merges == ("loser+merge#1",)
    assert report.outcomes == {
        "winner": "built",
        "loser": "skipped",
        "tail": "skipped",
        "loser+merge": "built",
        "loser+merge#1": "built",
    }
    merge = report.settlement("loser+merge#1")
    assert ("loser+merge#1", "merge") in calls and merge.plan_key != plan.node("loser").key
    assert report.digest != plan.digest
    grown = env.scheduler().plans.load("race", report.digest)
    assert grown is not None and grown.generation == 1 and grown.base_digest == plan.digest
    assert grown.node("loser+merge#1").depends_on == ("winner",)
    assert "stop-merge" in (report.settlement("loser").error or "") or "conflict" in (
        report.settlement("loser").error or ""
    )
    assert [t for t, _ in env.records("plan:race")] == ["plan-recorded", "subgraph-appended"]
    assert len([p for t, p in env.records(types=("node-settled",)) if p["node_id"] == "loser"]) == 1
    assert (env.ws / "shared.txt").read_text().startswith("loser+merge#1")


def test_a_merge_over_maximum_plan_nodes_is_elaboration_failed_with_nothing_committed(env: Env) -> None:
    plan = _race_plan(maximum=3)
    with pytest.raises(SchedulerError) as err:
        env.scheduler().run(plan, _intruder(env, "loser", 1, "shared.txt"))
    assert err.value.code == "elaboration_failed"
    gens = env.db.read(lambda c: c.execute(sa.select(plan_generations.c.generation)).scalars().all())
    assert gens == [0]
    states = env.db.read(lambda c: c.execute(sa.select(plan_merges.c.state)).scalars().all())
    assert states == ["intent"]  # a recoverable intent, not a partial extension


def _deviating(env: Env, undeclared: dict[str, str]) -> Any:
    def executor(ni: NodeInput) -> Any:
        for w in ni.node.effects.writes:
            (ni.root / w).write_text(ni.id)
        if ni.id in undeclared:
            (ni.root / undeclared[ni.id]).write_text("undeclared")
        return ni.id

    return executor


def test_default_reconciliation_reorders_factors_out_or_fails_after_attributing_the_whole_page(
    env: Env,
) -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("declarer", body=0, writes=["b.txt"]),
            sp.plan.node("reorder", body=1, writes=["a.txt"], boundary="expected"),
            sp.plan.node("twin1", body=2, writes=["t1.txt"], boundary="expected"),
            sp.plan.node("twin2", body=3, writes=["t2.txt"], boundary="expected"),
            sp.plan.node("alone", body=4, writes=["y1.txt"], boundary="expected"),
            sp.plan.node("after", body=5, inputs=[sp.plan.Ref("alone")]),
        ],
    )
    executor = _deviating(env, {"reorder": "b.txt", "twin1": "x.txt", "twin2": "x.txt", "alone": "y.txt"})
    report = env.scheduler().run(plan, executor)
    assert report.outcomes == {
        "declarer": "built",
        "reorder": "built",
        "twin1": "built",
        "twin2": "built",
        "alone": "failed",
        "after": "skipped",
    }
    assert report.verdicts == (
        Reorder("reorder", ("declarer",)),
        FactorOut("twin1", ("x.txt",)),
        FactorOut("twin2", ("x.txt",)),  # symmetric: both saw each other
        report.verdicts[3],
        # "reorder" ran beside "declarer": it ran again once "declarer" had settled, deviated the same way, and
        # that second verdict found its order already held, so the built outcome stands.
        Reorder("reorder", ("declarer",)),
    )
    assert isinstance(report.verdicts[3], Fail) and report.verdicts[3].node == "alone"
    assert report.settlement("reorder").attempts == 2
    types = [t for t, _ in env.records(types=("deviation-recorded", "node-reconciled"))]
    assert types == ["deviation-recorded"] * 4 + ["node-reconciled"] * 4 + [
        "deviation-recorded",
        "node-reconciled",
    ]
    assert not (env.ws / "x.txt").exists()  # undeclared writes never reach the workspace


def test_the_reconciler_is_injected_at_construction(env: Env) -> None:
    seen: list[Any] = []

    class Strict:
        def judge(self, case: Deviation | ConflictCase, context: ReconcileContext) -> Any:
            seen.append((case, len(context.deviations)))
            return Fail(case.node, "strict")

    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("d", body=1, writes=["d.txt"], boundary="expected")])
    report = env.scheduler(reconciler=Strict()).run(plan, _deviating(env, {"d": "e.txt"}))
    assert report.outcomes == {"d": "failed"} and report.settlement("d").error == "strict"
    assert seen == [(Deviation("d", "expected-set-deviation", ("e.txt",)), 1)]


def test_a_hard_boundary_refusal_is_the_nodes_failure(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "p", "f", [sp.plan.node("h", body=1, writes=["h.txt"]), sp.plan.node("ok", body=2)]
    )
    report = env.scheduler().run(plan, _deviating(env, {"h": "z.txt"}))
    assert report.outcomes == {"h": "failed", "ok": "built"}
    assert "undeclared_write" in (report.settlement("h").error or "")
