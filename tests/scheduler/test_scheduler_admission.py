"""Admission on a real thread host with executors gated on events, and keys that follow projected values."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from sched_support import Env, make_env

import smthrs_plugin as sp
from smthrs_plugin.scheduler import NodeInput, ThreadHost

_WAIT = 20.0  # a generous bound so a broken scheduler fails instead of hanging; never asserted on


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


def test_gated_completions_admit_by_priority_and_an_agent_waits_for_the_agent_cap(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "gated",
        "f",
        [
            sp.plan.node("slow", body=1, kind="agent", priority=3),
            sp.plan.node("fast", body=2, priority=2),
            sp.plan.node("waiting-agent", body=3, kind="agent", priority=1),
            sp.plan.node("dependent", body=4, inputs=[sp.plan.Ref("fast")]),
        ],
    )
    names = [n.id for n in plan.nodes]
    gate = {n: threading.Event() for n in names}
    started = {n: threading.Event() for n in names}
    finished = {n: threading.Event() for n in names}
    trace: list[str] = []
    lock = threading.Lock()

    def executor(ni: NodeInput) -> Any:
        if ni.id == "fast":
            assert started["slow"].wait(_WAIT)  # both were admitted in one pass: slow (p3) first
        with lock:
            trace.append(f"start:{ni.id}")
        started[ni.id].set()
        assert gate[ni.id].wait(_WAIT)
        with lock:
            trace.append(f"finish:{ni.id}")
        finished[ni.id].set()
        return ni.id

    sched = env.scheduler(concurrency={"steps": 2, "agents": 1}, host=ThreadHost(4))
    out: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: out.setdefault("report", sched.run(plan, executor)))
    runner.start()
    try:
        assert started["fast"].wait(_WAIT)
        assert trace == ["start:slow", "start:fast"]
        gate["fast"].set()
        assert started["dependent"].wait(_WAIT)
        gate["dependent"].set()
        assert finished["dependent"].wait(_WAIT)
        # The agent cap (1) is held by slow: the waiting agent cannot have started, however long we looked.
        with lock:
            assert trace == ["start:slow", "start:fast", "finish:fast", "start:dependent", "finish:dependent"]
        gate["waiting-agent"].set()
        gate["slow"].set()
    finally:
        for g in gate.values():
            g.set()
        runner.join(_WAIT)
        sched.host.close()
    assert trace[5:] == ["finish:slow", "start:waiting-agent", "finish:waiting-agent"]
    assert set(out["report"].outcomes.values()) == {"built"}


def test_changing_an_upstream_body_reruns_only_what_its_projected_value_reaches(env: Env) -> None:
    def plan(version: int) -> sp.plan.Plan:
        return sp.plan.compile_plan(
            "p",
            "f",
            [
                sp.plan.node("up", body={"version": version}),
                sp.plan.node("projected", body="p", inputs=[sp.plan.Ref("up", path=["value"])]),
                sp.plan.node("whole", body="w", inputs=[sp.plan.Ref("up")]),
                sp.plan.node("ordered", body="o", inputs=[sp.plan.Pending("up")]),
                sp.plan.node("below", body="b", inputs=[sp.plan.Ref("projected")]),
            ],
        )

    calls: list[str] = []

    def executor(ni: NodeInput) -> Any:
        calls.append(ni.id)
        if ni.id == "up":
            return {"value": 42, "version": ni.node.draft.material.body["version"]}
        return {"saw": [v for v in ni.inputs]}

    v1, v2 = plan(1), plan(2)
    first = env.scheduler("r1").run(v1, executor)
    calls.clear()
    second = env.scheduler("r2").run(v2, executor)  # a new run: served from the cache where keys match
    assert calls == ["up", "whole"]
    assert second.outcomes == {
        "up": "built",
        "projected": "clean",
        "whole": "built",
        "ordered": "clean",
        "below": "clean",
    }
    for node in ("projected", "ordered", "below"):
        assert v1.node(node).key != v2.node(node).key  # the plan key folds the upstream plan key...
        assert (
            first.settlement(node).dispatch_key == second.settlement(node).dispatch_key
        )  # ...the dispatch key not
    assert first.settlement("whole").dispatch_key != second.settlement("whole").dispatch_key


def test_priorities_beyond_the_json_safe_range_rank_exactly(env: Env) -> None:
    big = 2**80
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("low", body=1, priority=big),
            sp.plan.node("high", body=2, priority=big + 1),
            sp.plan.node("neg", body=3, priority=-big),
        ],
    )
    order: list[str] = []
    env.scheduler(concurrency={"steps": 1}).run(plan, lambda ni: order.append(ni.id) or ni.id)
    assert order == ["high", "low", "neg"]
