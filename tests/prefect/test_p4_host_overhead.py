"""The Prefect host adds one task run per node and nothing else: the outcome is read from the
finished state in memory, a node's task run has no ``wait_for`` edges, and what users see stays whole — every
node's task run, its ``smthrs.node.*`` event and its duration in the Report artifact, even for the node that
settles last (its event is sent after the coordinator already had its outcome)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _prefect_support import api_post, events_of, poll, task_runs_of
from prefect import flow
from prefect.exceptions import FailedRun, UnfinishedRun
from prefect.results import ResultStore
from prefect.states import Completed, Failed, Pending

import smthrs_plugin as sp
from smthrs_plugin.prefect._taskstate import returned as _returned
from smthrs_plugin.prefect.host import PrefectHost, artifact_key

pytestmark = pytest.mark.prefect


def noop(ni: sp.NodeInput) -> dict:
    return {"i": ni.node.draft.material.body["i"]}


def tree_plan(n: int) -> sp.plan.Plan:
    """Node i waits for node (i-1)//2: a binary tree, the benchmark's shape."""
    nodes = [
        sp.plan.node(
            f"t{i:02d}", body={"i": i}, inputs=[sp.plan.Pending(f"t{(i - 1) // 2:02d}")] if i else []
        )
        for i in range(n)
    ]
    return sp.plan.compile_plan("tree", "tests/p4-tree", nodes)


def test_a_finished_task_runs_value_is_read_from_its_state_in_memory_as_state_result_would() -> None:
    store = ResultStore()
    record = store.create_result_record({"outcome": "clean"})
    assert _returned(Completed(name="Cached", data=record)) == {"outcome": "clean"}
    boom = ValueError("boom")
    assert _returned(Failed(name="Conflict", data=store.create_result_record(boom))) is boom
    # Shapes that are not an in-memory record get State.result's own answer.
    assert _returned(Completed(data=5)) == 5
    assert isinstance(_returned(Failed(message="no data")), FailedRun)
    with pytest.raises(UnfinishedRun):
        _returned(Pending(data=record))


def test_every_node_of_a_tree_plan_is_one_task_run_with_no_wait_for_edges_its_event_and_its_duration(
    tmp_path: Path, prefect_api: str
) -> None:
    plan = tree_plan(15)

    @flow(persist_result=False)
    def tree_flow() -> dict:
        from prefect.runtime import flow_run

        with sp.open_runtime(tmp_path) as rt:
            sched = rt.scheduler("tree-1")
            report = sched.run(plan, noop)
        return {"flow_run_id": str(flow_run.id), "report": report, "host": sched.host}

    out = tree_flow()
    report, host, flow_run_id = out["report"], out["host"], out["flow_run_id"]
    assert isinstance(host, PrefectHost)
    assert set(report.outcomes.values()) == {"built"} and len(report.outcomes) == 15
    assert report.results["t14"] == {"i": 14}
    assert sorted(host.durations_ms) == sorted(report.outcomes)

    runs = poll(
        lambda: task_runs_of(prefect_api, flow_run_id),
        lambda rs: len(rs) == 15 and all(r["state"]["type"] == "COMPLETED" for r in rs),
    )
    assert sorted(r["name"] for r in runs) == [f"t{i:02d} #1" for i in range(15)]
    assert all(r["tags"] == [] for r in runs)
    # A node is submitted once its inputs settled: Prefect is given no upstream futures to wait for.
    assert all(not r["task_inputs"].get("wait_for") for r in runs)
    assert all(not any(v for v in r["task_inputs"].values()) for r in runs)

    events = poll(
        lambda: events_of(prefect_api, "smthrs.node.", flow_run_id),
        lambda ev: len(ev) >= 15,
    )
    assert sorted(e["payload"]["node"] for e in events) == sorted(report.outcomes)
    by_node = {r["name"].split(" ")[0]: f"prefect.task-run.{r['id']}" for r in runs}
    for e in events:
        assert e["event"] == "smthrs.node.built"
        assert e["related"][0]["prefect.resource.id"] == by_node[e["payload"]["node"]]
        assert e["payload"]["duration_ms"] == pytest.approx(host.durations_ms[e["payload"]["node"]], abs=0.01)

    (artifact,) = api_post(
        prefect_api, "/artifacts/filter", {"artifacts": {"key": {"any_": [artifact_key("tree-1")]}}}
    )
    rows = [line for line in artifact["data"].splitlines() if re.match(r"\| t\d\d \|", line)]
    assert len(rows) == 15
    assert all(row.split("|")[5].strip() != "-" for row in rows)  # every node's duration is in the Report
