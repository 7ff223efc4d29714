"""What a reconciliation verdict does to its node: ``Reorder`` adds a discovered readiness edge (the node runs again
once the named nodes settled, keyed by its declared predecessors only), ``FactorOut`` keeps the staged outcome,
``Fail`` fails it; an unhonourable ``Reorder`` fails the node saying why. Real SQLite, real cache seam."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sched_support import Env, make_env

from smthrs_plugin.errors import GraphError
from smthrs_plugin.plan import Ref, RuntimeGraph, compile_plan, node
from smthrs_plugin.scheduler import (
    ConflictCase,
    Deviation,
    FactorOut,
    NodeInput,
    ReconcileContext,
    Reorder,
)


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


def _recording(env: Env, calls: list[tuple[str, int, tuple[Any, ...]]], undeclared: dict[str, str]) -> Any:
    def executor(ni: NodeInput) -> Any:
        calls.append((ni.id, ni.attempt, ni.inputs))
        for w in ni.node.effects.writes:
            (ni.root / w).write_text(ni.id)
        if ni.id in undeclared:
            (ni.root / undeclared[ni.id]).write_text("undeclared")
        return {"node": ni.id}

    return executor


def test_reorder_reruns_the_node_after_the_named_nodes_and_keys_it_by_declared_predecessors_only(
    env: Env,
) -> None:
    (env.ws / "seed.txt").write_text("seed")
    plan = compile_plan(
        "p",
        "f",
        [
            node("src", body=0, reads=["seed.txt"], writes=["p.txt"]),
            # Reads what "src" produces (a declared predecessor) and writes b.txt, which only "declarer" declares.
            node(
                "reorder", body=1, reads=["p.txt"], writes=["a.txt"], inputs=[Ref("src")], boundary="expected"
            ),
            node("mid", body=2, inputs=[Ref("src")]),
            node("declarer", body=3, writes=["b.txt"], inputs=[Ref("mid")]),
            node("after", body=4, inputs=[Ref("reorder")]),
        ],
    )
    calls: list[tuple[str, int, tuple[Any, ...]]] = []
    report = env.scheduler().run(plan, _recording(env, calls, {"reorder": "b.txt"}))

    # "reorder" first ran before "declarer"; the verdict ordered it after "declarer", so it ran once more after it,
    # and "after" (its dependent) waited for the reconciled settlement.
    assert [c[0] for c in calls] == ["src", "reorder", "mid", "declarer", "reorder", "after"]
    assert report.outcomes == dict.fromkeys(["src", "reorder", "mid", "declarer", "after"], "built")
    assert report.verdicts == (Reorder("reorder", ("declarer",)), Reorder("reorder", ("declarer",)))
    assert report.settlement("reorder").attempts == 2
    # Declared predecessors still determine its inputs and file versions: the same Ref values, the same key.
    first, second = [c for c in calls if c[0] == "reorder"]
    assert first[2] == second[2] == ({"node": "src"},)
    scheduled = [p for t, p in env.records(types=("node-scheduled",)) if p["node_id"] == "reorder"]
    assert [p["attempt"] for p in scheduled] == [1, 2]
    assert (
        scheduled[0]["dispatch_key"]
        == scheduled[1]["dispatch_key"]
        == report.settlement("reorder").dispatch_key
    )
    invalidated = [p for t, p in env.records(types=("node-invalidated",))]
    assert [(p["node_id"], p["reason"], p["from"] == p["to"]) for p in invalidated] == [
        ("reorder", "reordered", True)
    ]
    assert plan.node("reorder").depends_on == ("src",)  # the discovered edge never enters the plan
    rows = [r["state"] for r in env.attempt_rows() if r["node_id"] == "reorder"]
    assert rows == ["completed", "completed"]
    settled = [p["outcome"] for t, p in env.records(types=("node-settled",)) if p["node_id"] == "reorder"]
    assert settled == ["built"]  # one reconciled settlement, never a provisional one


def test_a_reorder_whose_order_already_held_keeps_the_staged_outcome_without_running_again(env: Env) -> None:
    plan = compile_plan(
        "p",
        "f",
        [
            node("declarer", body=0, writes=["b.txt"]),
            node("reorder", body=1, writes=["a.txt"], boundary="expected", inputs=[Ref("declarer")]),
        ],
    )
    calls: list[tuple[str, int, tuple[Any, ...]]] = []
    report = env.scheduler().run(plan, _recording(env, calls, {"reorder": "b.txt"}))
    assert [c[0] for c in calls] == ["declarer", "reorder"]
    assert report.outcomes == {"declarer": "built", "reorder": "built"}
    assert report.verdicts == (Reorder("reorder", ("declarer",)),)


class _Judge:
    """A custom reconciler answering every case about ``node`` with ``verdict`` (others: the default)."""

    def __init__(self, verdict: Any) -> None:
        self.verdict = verdict
        self.cases: list[Deviation | ConflictCase] = []

    def judge(self, case: Deviation | ConflictCase, context: ReconcileContext) -> Any:
        self.cases.append(case)
        return self.verdict


def _intruder(env: Env, node_id: str, times: int) -> Any:
    seen = {"n": 0}

    def executor(ni: NodeInput) -> Any:
        if ni.id == node_id:
            seen["n"] += 1
            if seen["n"] <= times:
                (env.ws / "out.txt").write_text("landed by someone else")
        for w in ni.node.effects.writes:
            (ni.root / w).write_text(f"{ni.id} attempt {ni.attempt}")
        return {"node": ni.id}

    return executor


def test_a_custom_reorder_verdict_on_a_conflict_reruns_the_node_after_the_named_node(env: Env) -> None:
    plan = compile_plan(
        "p", "f", [node("x", body=1, writes=["out.txt"]), node("other", body=2, writes=["o.txt"])]
    )
    judge = _Judge(Reorder("x", ("other",)))
    report = env.scheduler(rebase_limit=0, reconciler=judge).run(plan, _intruder(env, "x", 1))
    assert report.outcomes == {"x": "built", "other": "built"}
    assert report.settlement("x").attempts == 2
    assert [type(c).__name__ for c in judge.cases] == ["ConflictCase"]
    assert report.verdicts == (Reorder("x", ("other",)),)
    assert (env.ws / "out.txt").read_text() == "x attempt 2"


def test_factor_out_keeps_a_staged_outcome_but_cannot_absorb_a_conflict(env: Env) -> None:
    plan = compile_plan(
        "p",
        "f",
        [node("x", body=1, writes=["out.txt"]), node("d", body=2, writes=["d.txt"], boundary="expected")],
    )

    class Factor:
        def judge(self, case: Deviation | ConflictCase, context: ReconcileContext) -> Any:
            return FactorOut(case.node, tuple(getattr(case, "paths", ())))

    executor = _intruder(env, "x", 1)

    def both(ni: NodeInput) -> Any:
        if ni.id == "d":
            (ni.root / "stray.txt").write_text("undeclared")
        return executor(ni)

    report = env.scheduler(rebase_limit=0, reconciler=Factor()).run(plan, both)
    assert report.outcomes == {"x": "failed", "d": "built"}
    assert "FactorOut cannot absorb it" in (report.settlement("x").error or "")
    assert [v.node for v in report.verdicts] == ["x", "d"]


@pytest.mark.parametrize(
    ("after", "why"),
    [(("tail",), "a cycle"), (("x",), "after itself"), (("ghost",), "no such node")],
)
def test_a_reorder_that_cannot_be_honoured_fails_the_node_saying_why(env: Env, after: Any, why: str) -> None:
    plan = compile_plan(
        "p", "f", [node("x", body=1, writes=["out.txt"]), node("tail", body=2, inputs=[Ref("x")])]
    )
    report = env.scheduler(rebase_limit=0, reconciler=_Judge(Reorder("x", after))).run(
        plan, _intruder(env, "x", 1)
    )
    assert report.outcomes == {"x": "failed", "tail": "skipped"}
    assert why in (report.settlement("x").error or "")


def test_an_irreversible_node_is_never_rerun_by_a_reorder(env: Env) -> None:
    plan = compile_plan(
        "p", "f", [node("x", body=1, tier="irreversible", writes=["out.txt"]), node("other", body=2)]
    )
    calls: list[str] = []
    executor = _intruder(env, "x", 1)
    report = env.scheduler(reconciler=_Judge(Reorder("x", ("other",)))).run(
        plan, lambda ni: calls.append(ni.id) or executor(ni)
    )
    assert calls.count("x") == 1 and report.outcomes["x"] == "failed"
    assert "irreversible" in (report.settlement("x").error or "")


def _graph() -> RuntimeGraph:
    plan = compile_plan(
        "g",
        "f",
        [node("a", body=0), node("b", body=1), node("c", body=2, inputs=[Ref("a")]), node("d", body=3)],
    )
    return RuntimeGraph(plan)


def test_a_discovered_edge_waits_for_settlement_of_any_outcome_and_never_skips() -> None:
    g = _graph()
    for n in ("a", "b", "d"):
        g.start(n)
    g.stage("a", "built")
    assert g.discover("a", ["b", "d"]).ready == ()
    assert g.state("a") == "waiting" and g.discovered("a") == ("b", "d")
    assert g.settle("b", "failed").ready == ()  # a failed discovered predecessor does not skip "a"
    assert g.settle("d", "built").ready == ("a",)
    assert g.state("a") == "ready" and g.outcome("a") is None and g.state("c") == "waiting"
    g.start("a")
    assert g.settle("a", "built").ready == (
        "c",
    )  # declared dependents move only on the reconciled settlement
    assert g.node("a").depends_on == ()


def test_a_discovered_edge_closing_a_cycle_is_refused_with_nothing_changed() -> None:
    g = _graph()
    g.start("a")
    g.stage("a", "built")
    with pytest.raises(GraphError) as err:
        g.discover("a", ["c"])  # c waits on a (declared)
    assert err.value.code == "invalid_transition" and "cycle" in err.value.message
    assert g.state("a") == "staged" and g.staged("a") == "built" and g.discovered("a") == ()
    g.start("b")
    g.stage("b", "built")
    g.discover("b", ["d"])  # b now waits on d (discovered)
    g.start("d")
    with pytest.raises(GraphError):
        g.discover("d", ["b"])  # b waits on d: d after b closes a discovered cycle
