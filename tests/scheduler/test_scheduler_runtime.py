"""The composition root (open_runtime) and the docs/how-to/plans.md scheduler example, run verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

import smthrs_plugin as sp
from smthrs_plugin.errors import SchedulerError
from smthrs_plugin.records.runs import RunStore

README_EXAMPLE = """
import smthrs_plugin as sp

plan = sp.plan.compile_plan("p1", "ci/build", [
    sp.plan.node("fetch", body={"url": "https://example.org/v"}, writes=["data/v.txt"]),
    sp.plan.node("build", body={"cmd": "make"}, inputs=[sp.plan.Ref("fetch", path=["version"])],
            reads=["data/v.txt"], writes=["dist/app.txt"], priority=1),
    sp.plan.node("lint", body={"cmd": "lint"}, inputs=[sp.plan.Pending("fetch")], kind="agent"),
])

def executor(ni):                   # ni: NodeInput(node, attempt, inputs, root, key, boundary, cancel)
    if ni.id == "fetch":
        (ni.root / "data").mkdir()
        (ni.root / "data/v.txt").write_text("1.4.0")
        return {"version": "1.4.0"}
    if ni.id == "build":
        (ni.root / "dist").mkdir()
        (ni.root / "dist/app.txt").write_text("app " + (ni.root / "data/v.txt").read_text())
        return {"built": ni.inputs[0]}
    return "ok"

with sp.open_runtime(workspace=".") as rt:  # SQLite + artifacts under ./.smthrs
    report = rt.scheduler("r1", concurrency={"steps": 4, "agents": 1}).run(plan, executor)
    print([(s.node, s.outcome) for s in report.settlements])
    again = rt.scheduler("r2").run(plan, executor)         # a new run: served from the cache
    print([s.outcome for s in again.settlements], again.results["build"])
"""


def test_readme_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(README_EXAMPLE, "docs/how-to/plans.md", "exec"), {})
    assert capsys.readouterr().out == (
        "[('fetch', 'built'), ('build', 'built'), ('lint', 'built')]\n"
        "['clean', 'clean', 'clean'] {'built': '1.4.0'}\n"
    )
    assert (tmp_path / "dist/app.txt").read_text() == "app 1.4.0"
    assert (tmp_path / ".smthrs" / "state.db").exists()


def test_open_runtime_takes_settings_from_the_environment_and_explicit_arguments_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_WORKSPACE", str(tmp_path / "from-env"))
    monkeypatch.setenv("SMTHRS_HOST_ID", "env-host")
    with sp.open_runtime() as rt:
        assert rt.workspace == (tmp_path / "from-env").resolve() and rt.owner.host_id == "env-host"
        assert rt.db.url.endswith("from-env/.smthrs/state.db")
    db = tmp_path / "elsewhere" / "x.db"
    with sp.open_runtime(workspace=tmp_path / "ws", db=f"sqlite:///{db}", host_id="mine") as rt:
        assert rt.workspace == (tmp_path / "ws").resolve() and rt.owner.host_id == "mine"
        assert db.exists()


def test_the_runtime_driver_settles_the_run_and_refuses_a_settled_run_id(tmp_path: Path) -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1), sp.plan.node("b", body={"fail": 1})])

    def executor(ni: sp.NodeInput) -> object:
        if ni.id == "b":
            raise RuntimeError("no")
        return 1

    with sp.open_runtime(workspace=tmp_path) as rt:
        rt.scheduler("ok").run(sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1)]), executor)
        report = rt.scheduler("bad").run(plan, executor)
        runs = RunStore(rt.db)
        assert runs.get("ok").status == "completed"  # type: ignore[union-attr]
        assert runs.get("bad").status == "failed" and report.failed  # type: ignore[union-attr]
        with pytest.raises(SchedulerError) as err:
            rt.scheduler("ok").run(plan, executor)
        assert err.value.code == "invalid_plan" and "already settled" in err.value.message


def test_a_refused_reopen_leaves_the_run_resumable(tmp_path: Path) -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1)])
    with sp.open_runtime(workspace=tmp_path) as rt:
        sched = rt.scheduler("r", environment={"v": 1})
        calls: list[str] = []

        def interrupted(ni: sp.NodeInput) -> object:
            raise KeyboardInterrupt  # an interruption, not a node failure

        with pytest.raises(KeyboardInterrupt):
            sched.run(plan, interrupted)
        assert RunStore(rt.db).get("r").status == "suspended"  # type: ignore[union-attr]
        with pytest.raises(SchedulerError):
            rt.scheduler("r", environment={"v": 2}).run(plan, lambda ni: calls.append(ni.id))
        assert RunStore(rt.db).get("r").status == "suspended"  # type: ignore[union-attr]
        report = rt.scheduler("r", environment={"v": 1}).run(plan, lambda ni: calls.append(ni.id) or 7)
        assert report.outcomes == {"a": "built"} and calls == ["a"]


def test_a_served_node_stores_and_reports_its_value_exactly_as_a_built_one(tmp_path: Path) -> None:
    # A hit's value never passed through the executor: its settlement encodes it itself. Every shape must be
    # stored as the canonical text a build stores, and reach downstream nodes and the report unchanged.
    values: dict[str, object] = {
        "none": None,
        "int": 7,
        "text": "é 𝔸 \u2028 \"q\"",
        "nested": {"b": [1.5, None, True], "a": "x", "é": {"n": -0.0}},
        "float": 0.1,
    }
    nodes = [sp.plan.node(n, body={"n": n}) for n in values]
    nodes.append(sp.plan.node("down", body={}, inputs=[sp.plan.Ref("nested", path=["é"])]))
    plan = sp.plan.compile_plan("p-values", "flow", nodes)

    def executor(ni: sp.NodeInput) -> object:
        return {"seen": ni.inputs[0]} if ni.id == "down" else values[ni.id]

    def stored(rt: sp.Runtime, run_id: str) -> dict[str, object]:
        from smthrs_plugin.records.attempts import AttemptStore

        return {a.node_id: a.result for a in AttemptStore(rt.db).list(run_id) if a.state == "completed"}

    with sp.open_runtime(workspace=tmp_path) as rt:
        built = rt.scheduler("r1").run(plan, executor)
        clean = rt.scheduler("r2").run(plan, executor)
        rows_built, rows_clean = stored(rt, "r1"), stored(rt, "r2")

    assert {s.outcome for s in built.settlements} == {"built"}
    assert {s.outcome for s in clean.settlements} == {"clean"}
    assert clean.results == built.results
    assert rows_clean == rows_built and set(rows_clean) == set(values) | {"down"}
    assert rows_clean["nested"] == values["nested"] and rows_clean["down"] == {"seen": {"n": -0.0}}
