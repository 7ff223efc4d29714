"""Plan files: parsing, typed errors naming line and field, the file executor, and ``smthrs run`` in a real
subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import smthrs_plugin as sp
from smthrs_plugin.errors import PlanError

GOOD = """\
plan: demo
flow: ci/demo
nodes:
  - id: build
    run: "mkdir -p out && cat src/a.txt > out/built.txt && printf built"
    reads: ["src/a.txt"]
    writes: ["out/built.txt"]
    priority: 2
  - id: check
    run: "test -s out/built.txt && printf '%s' \\"$SMTHRS_INPUTS\\""
    reads: ["out/built.txt"]
    inputs: [{ref: build, path: [stdout]}]
  - id: report
    call: "sched_calls:summarise"
    with: {indent: 1}
    needs: [check]
    kind: agent
    tier: compensable
"""


def _write(tmp: Path, text: str) -> Path:
    p = tmp / "plan.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_a_plan_file_compiles_to_the_same_plan_as_its_python_declaration(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    plan, executor = sp.load_plan(path)
    expected = sp.plan.compile_plan(
        "demo",
        "ci/demo",
        [
            sp.plan.node(
                "build",
                body={"run": "mkdir -p out && cat src/a.txt > out/built.txt && printf built"},
                reads=["src/a.txt"],
                writes=["out/built.txt"],
                priority=2,
            ),
            sp.plan.node(
                "check",
                body={"run": "test -s out/built.txt && printf '%s' \"$SMTHRS_INPUTS\""},
                reads=["out/built.txt"],
                inputs=[sp.plan.Ref("build", path=["stdout"])],
            ),
            sp.plan.node(
                "report",
                body={"call": "sched_calls:summarise", "with": {"indent": 1}},
                inputs=[sp.plan.Pending("check")],
                kind="agent",
                tier="compensable",
            ),
        ],
    )
    assert plan == expected and callable(executor)


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        ("plan: p\nnodes:\n  - id: a\n    run: x\n    priority: high\n", 5, "priority"),
        ("plan: p\nnodes:\n  - id: a\n    run: x\n    colour: red\n", 5, "colour"),
        ("plan: p\nnodes:\n  - id: a\n    run: x\n  - id: b\n    tier: eternal\n    run: y\n", 6, "tier"),
        ("plan: p\nnodes:\n  - id: a\n    run: x\n  - id: b\n    run: y\n    needs: [nope]\n", 7, "needs"),
        ("plan: p\nnodes:\n  - id: a\n    run: x\n  - id: a\n    run: y\n", 5, "id"),
        ("plan: p\nnodes:\n  - id: a\n    run: x\n    writes: ['../escape']\n", 5, "writes"),
        ("plan: p\nnodes:\n  - id: a\n    run: x\n    inputs: [{ref: a, path: 3}]\n", 5, "inputs"),
        ("plan: p\nnodes:\n  - id: a\n    reads: [x]\n", 3, "run"),
        ("plan: p\nnodes: {a: 1}\n", 2, "nodes"),
        ("plan: p\nnodes:\n  - id: a\n    run: [unclosed\n", 5, None),
        ("plan: 7\nnodes:\n  - id: a\n    run: x\n", 1, "plan"),
    ],
)
def test_a_malformed_plan_file_names_the_line_and_the_field(
    tmp_path: Path, text: str, line: int, field: str | None
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(PlanError) as err:
        sp.load_plan(path)
    e = err.value
    assert e.code == "invalid_plan_file"
    assert e.details["line"] == line, e.message
    assert f"{path}:{line}:" in e.message
    if field is not None:
        assert e.details["field"] == field and f"field {field!r}" in e.message


def test_a_cycle_is_located_at_a_node_of_the_cycle(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "plan: p\nnodes:\n  - id: a\n    run: x\n    needs: [b]\n  - id: b\n    run: y\n    needs: [a]\n",
    )
    with pytest.raises(PlanError) as err:
        sp.load_plan(path)
    assert err.value.code == "invalid_plan_file" and "cycle" in err.value.message
    assert err.value.details["line"] in (5, 8)


def test_the_file_executor_runs_commands_in_the_sandbox_and_calls_functions(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "a.txt").write_text("hello")
    path = _write(tmp_path, GOOD)
    plan, executor = sp.load_plan(path)
    with sp.open_runtime(workspace=ws) as rt:
        report = rt.scheduler("r1").run(plan, executor)
    assert report.outcomes == {"build": "built", "check": "built", "report": "built"}
    assert report.results["build"] == {"exit_code": 0, "stdout": "built"}
    assert report.results["check"] == {"exit_code": 0, "stdout": '["built"]'}
    assert report.results["report"] == {"node": "report", "attempt": 1, "inputs": [], "indent": 1}
    assert (ws / "out" / "built.txt").read_text() == "hello"


def test_wait_and_approval_nodes_are_kept_as_data_the_gate_refused_and_the_timer_parks(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        """\
        plan: gates
        nodes:
          - id: ship
            run: "true"
            approval: {request: ship}
          - id: cool-down
            wait: {seconds: 600}
        """,
    )
    plan, executor = sp.load_plan(path)
    assert plan.node("ship").draft.approval == {"request": "ship"}
    assert plan.node("cool-down").draft.wait == {"seconds": 600}
    with sp.open_runtime(workspace=tmp_path / "ws") as rt:
        # Both are enforced now: a pending approval gate and a timer beyond the in-process budget (600 s) each
        # park the run durably; the pass stops at whichever it meets first (tests/engine/waits, tests/control).
        with pytest.raises(sp.RunParked) as parked:
            rt.scheduler("r1").run(plan, executor)
        rec = rt.runs.get("r1")
    assert parked.value.waiting is not None and rec is not None and rec.status == "suspended"


def _smthrs(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("smthrs")), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_smthrs_run_prints_the_report_as_json_and_exits_by_outcome(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "a.txt").write_text("hello")
    (ws / "plan.yaml").write_text(
        GOOD.replace('call: "sched_calls:summarise"', 'run: "true"').replace("    with: {indent: 1}\n", "")
    )
    first = _smthrs("run", "plan.yaml", "--run-id", "ci-1", "--steps", "2", "--json", cwd=ws)
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert (doc["run_id"], doc["plan_id"], doc["status"]) == ("ci-1", "demo", "completed")
    assert [s["node"] for s in doc["settlements"]] == ["build", "check", "report"]
    assert set(doc["settlements"][0]) == {
        "node",
        "outcome",
        "plan_key",
        "dispatch_key",
        "attempts",
        "rebases",
        "cache_decision",
    }
    assert [s["outcome"] for s in doc["settlements"]] == ["built", "built", "built"]
    again = _smthrs("run", "plan.yaml", "--json", cwd=ws)  # a new run: sealed work is served from the cache
    assert again.returncode == 0
    assert [s["outcome"] for s in json.loads(again.stdout)["settlements"]] == ["clean", "clean", "built"]
    (ws / "bad.yaml").write_text("plan: p\nnodes:\n  - id: a\n    run: x\n    priority: high\n")
    refused = _smthrs("run", "bad.yaml", "--json", cwd=ws)
    assert refused.returncode == 2
    error = json.loads(refused.stdout)["error"]
    assert error["code"] == "invalid_plan_file" and error["line"] == 5 and error["field"] == "priority"
    (ws / "fails.yaml").write_text("plan: f\nnodes:\n  - id: boom\n    run: 'exit 3'\n")
    failed = _smthrs("run", "fails.yaml", cwd=ws)
    assert failed.returncode == 1 and "failed" in failed.stdout and "status 3" in failed.stdout
