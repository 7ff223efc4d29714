"""The Prefect host: plan nodes as Prefect task runs (names, tags, final states, events, the report artifact),
on the thread pool and the process pool, and ``smthrs run --prefect``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import api_post, events_of, poll, task_runs_of
from prefect import flow
from prefect.task_runners import ProcessPoolTaskRunner
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin.prefect.host import PrefectHost, artifact_key

pytestmark = pytest.mark.prefect


def write_part(ni: sp.NodeInput) -> dict:
    """Module-level, so process-pool workers import it by reference."""
    i = ni.node.draft.material.body["i"]
    src = (ni.root / "seed.txt").read_text()
    (ni.root / f"out/{i}.txt").parent.mkdir(exist_ok=True)
    (ni.root / f"out/{i}.txt").write_text(f"{src}:{i}")
    if ni.node.draft.material.body.get("fail"):
        raise RuntimeError(f"node {ni.id} was told to fail")
    return {"i": i, "pid": os.getpid()}


@sp.step
def pid_of(x: int) -> dict:
    """A step for the process pool: where did its body run?"""
    return {"x": x, "pid": os.getpid()}


def plan_of(
    n: int, *, plan_id: str = "wide", fail: int | None = None, chain_after_fail: bool = False
) -> sp.plan.Plan:
    nodes = [
        sp.plan.node(
            f"n{i:02d}",
            body={"i": i, **({"fail": True} if i == fail else {})},
            reads=["seed.txt"],
            writes=[f"out/{i}.txt"],
        )
        for i in range(n)
    ]
    if chain_after_fail and fail is not None:
        nodes.append(
            sp.plan.node(
                "after",
                body={"i": 999},
                inputs=[sp.plan.Pending(f"n{fail:02d}")],
                reads=["seed.txt"],
                writes=["out/999.txt"],
            )
        )
    return sp.plan.compile_plan(plan_id, "tests/prefect-host", nodes)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "seed.txt").write_text("seed")
    return tmp_path


def _run_in_flow(ws: Path, run_id: str, plan: sp.plan.Plan, task_runner: Any = None) -> dict:
    @flow(persist_result=False, **({"task_runner": task_runner} if task_runner is not None else {}))
    def plan_flow() -> dict:
        from prefect.runtime import flow_run

        with sp.open_runtime(ws) as rt:
            sched = rt.scheduler(run_id)
            report = sched.run(plan, write_part)
            host = sched.host
        return {"flow_run_id": str(flow_run.id), "report": report, "host": host}

    out: dict = plan_flow()
    return out


def _final(api: str, flow_run_id: str, n: int) -> list[dict]:
    return poll(  # type: ignore[no-any-return]
        lambda: task_runs_of(api, flow_run_id),
        lambda runs: len(runs) == n and all(r["state"]["type"] in ("COMPLETED", "FAILED") for r in runs),
    )


def test_a_plan_of_30_nodes_is_30_task_runs_named_after_the_nodes_with_their_final_states(
    ws: Path, prefect_api: str
) -> None:
    plan = plan_of(30)
    first = _run_in_flow(ws, "wide-1", plan)
    assert isinstance(first["host"], PrefectHost)  # picked automatically inside a flow run
    assert set(first["report"].outcomes.values()) == {"built"}
    runs = _final(prefect_api, first["flow_run_id"], 30)
    assert sorted(r["name"] for r in runs) == [f"n{i:02d} #1" for i in range(30)]
    assert {r["state"]["name"] for r in runs} == {"Completed"}
    assert all(r["tags"] == [] for r in runs)  # untagged: a tag costs Prefect a slot request per task run
    assert {r["task_key"].split("-")[0] for r in runs} == {"_run_node"}

    second = _run_in_flow(ws, "wide-2", plan)
    assert set(second["report"].outcomes.values()) == {"clean"}
    cached = _final(prefect_api, second["flow_run_id"], 30)
    assert {r["state"]["name"] for r in cached} == {"Cached"}

    # Each settlement mirrored as an event tied to its task run; the Report attached as a markdown artifact.
    events = poll(
        lambda: events_of(prefect_api, "smthrs.node.", second["flow_run_id"]),
        lambda ev: len(ev) >= 30,
    )
    assert len(events) == 30 and {e["event"] for e in events} == {"smthrs.node.clean"}
    task_run_ids = {f"prefect.task-run.{r['id']}" for r in cached}
    for e in events:
        assert e["payload"]["cache_decision"] == "VerifiedHit"
        assert e["related"][0]["prefect.resource.id"] in task_run_ids
    artifacts = api_post(
        prefect_api, "/artifacts/filter", {"artifacts": {"key": {"any_": [artifact_key("wide-2")]}}}
    )
    assert len(artifacts) == 1 and artifacts[0]["type"] == "markdown"
    md = artifacts[0]["data"]
    assert "wide-2" in md and md.count("| **clean** |") == 30 and "VerifiedHit" in md


def test_a_failed_node_is_a_failed_task_run_and_its_dependent_never_becomes_one(
    ws: Path, prefect_api: str
) -> None:
    out = _run_in_flow(ws, "fails-1", plan_of(3, plan_id="fails", fail=1, chain_after_fail=True))
    report = out["report"]
    assert report.outcomes == {"n00": "built", "n01": "failed", "n02": "built", "after": "skipped"}
    assert "told to fail" in (report.settlement("n01").error or "")
    runs = _final(prefect_api, out["flow_run_id"], 3)
    states = {r["name"]: r["state"]["type"] for r in runs}
    assert states == {"n00 #1": "COMPLETED", "n01 #1": "FAILED", "n02 #1": "COMPLETED"}


def test_the_process_pool_runner_runs_node_bodies_and_steps_in_worker_processes(
    ws: Path, prefect_api: str
) -> None:
    plan = plan_of(4, plan_id="procs")

    @flow(persist_result=False, task_runner=ProcessPoolTaskRunner(max_workers=2))
    def procs() -> dict:
        from prefect.runtime import flow_run

        with sp.open_runtime(ws) as rt:
            report = rt.scheduler("procs-1").run(plan, write_part)
        with sp.step_settings(workspace=ws):
            steps = [f.result() for f in pid_of.map([1, 2, 3])]
        return {"flow_run_id": str(flow_run.id), "report": report, "steps": steps}

    out = procs()
    report = out["report"]
    assert set(report.outcomes.values()) == {"built"}
    pids = {v["pid"] for v in report.results.values()} | {s["pid"] for s in out["steps"]}
    assert os.getpid() not in pids  # engines and filesystems were opened in the workers
    assert [s["x"] for s in out["steps"]] == [1, 2, 3]
    assert sorted(p.name for p in (ws / "out").iterdir()) == ["0.txt", "1.txt", "2.txt", "3.txt"]
    assert (ws / "out/3.txt").read_text() == "seed:3"
    runs = _final(prefect_api, out["flow_run_id"], 7)
    assert {r["state"]["name"] for r in runs} == {"Completed"}
    # The workers' writes were fenced by this process's owner tokens and journaled into its runs.
    rt = sp.open_runtime(ws)
    settled = [e.payload for e in rt.journal.read("procs-1") if e.type == "node-settled"]
    assert sorted(p["node_id"] for p in settled) == ["n00", "n01", "n02", "n03"]
    assert rt.runs.get("procs-1").status == "completed"  # type: ignore[union-attr]
    step_run = rt.runs.get(f"prefect-{out['flow_run_id']}")
    assert step_run is not None and step_run.status == "completed"
    records = [e.payload for e in rt.journal.read(step_run.run_id) if e.type == "step-settled"]
    assert sorted((r["node"], r["outcome"]) for r in records) == [("pid_of", "built")] * 3
    rt.close()


def test_smthrs_run_prefect_wraps_the_run_in_a_flow_run(
    ws: Path, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ws / "in.txt").write_text("hello\n")
    (ws / "plan.yaml").write_text(
        "plan: cli-demo\nflow: ci/demo\nnodes:\n"
        '  - id: upper\n    run: "tr a-z A-Z < in.txt > up.txt"\n    reads: [in.txt]\n    writes: [up.txt]\n'
    )
    monkeypatch.chdir(ws)
    from smthrs_plugin.cli import app

    runner = CliRunner()
    first = runner.invoke(app, ["run", "plan.yaml", "--prefect", "--json", "--run-id", "cli-1"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.output.strip().splitlines()[-1])["settlements"][0]["outcome"] == "built"
    again = runner.invoke(app, ["run", "plan.yaml", "--prefect", "--json", "--run-id", "cli-2"])
    assert json.loads(again.output.strip().splitlines()[-1])["settlements"][0]["outcome"] == "clean"
    assert (ws / "up.txt").read_text() == "HELLO\n"
    flow_runs = api_post(
        prefect_api, "/flow_runs/filter", {"flow_runs": {"name": {"any_": ["cli-1", "cli-2"]}}}
    )
    assert sorted(f["name"] for f in flow_runs) == ["cli-1", "cli-2"]
    for fr in flow_runs:
        (tr,) = _final(prefect_api, fr["id"], 1)
        assert tr["name"] == "upper #1"
        assert tr["state"]["name"] == ("Completed" if fr["name"] == "cli-1" else "Cached")


def test_smthrs_run_prefect_shows_a_run_parked_on_a_node_approval_as_paused_not_crashed(
    ws: Path, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ws / "plan.yaml").write_text(
        "plan: gated\nflow: ci/gated\nnodes:\n"
        '  - id: build\n    run: "true"\n'
        '  - id: deploy\n    run: "true"\n    needs: [build]\n    approval: {request: ship}\n'
    )
    monkeypatch.chdir(ws)
    from smthrs_plugin.cli import app

    parked = CliRunner().invoke(app, ["run", "plan.yaml", "--prefect", "--json", "--key", "gated:1"])
    assert parked.exit_code == 75, parked.output
    (fr,) = api_post(prefect_api, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [json.loads(
        parked.output.strip().splitlines()[-1])["run_id"]]}}})  # fmt: skip
    assert (fr["state"]["type"], fr["state"]["name"]) == ("PAUSED", "Parked")
    assert "approval 'ship'" in fr["state"]["message"]
    with sp.open_runtime(ws) as rt:  # the plan run is the only run, and nothing is left running
        assert [(r.flow, r.status) for r in rt.runs.list()] == [("ci/gated", "suspended")]
