"""Explain a miss: which declared read (path, old → new digest), which input value, which environment field — in
one components shape, whether the entry was built by a plan node or by a ``@step`` call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _cache_support import make_machine, upper

import smthrs_plugin as sp
from smthrs_plugin.cache.explain import Change, diff_components, explain, explain_request
from smthrs_plugin.cache.local import LocalTier
from smthrs_plugin.canonical import is_key
from smthrs_plugin.errors import CacheError
from smthrs_plugin.plan.compile import compile_plan
from smthrs_plugin.plan.model import Ref, Value, node
from smthrs_plugin.prefect.step import step
from smthrs_plugin.prefect.steprun import current_spec, step_settings
from smthrs_plugin.prefect.workspace import Workspace
from smthrs_plugin.runtime import open_runtime
from smthrs_plugin.stores.artifacts import ArtifactStore

#: The one shape of recorded components (cache/requests.py), for plan nodes and @step calls alike.
SHAPE = {"key", "body", "inputs", "hermetic", "environment"}
HERMETIC = {"readSet", "writeSet", "removes", "boundaryMode"}


def _node(threshold: float) -> sp.plan.NodeDraft:
    return sp.plan.node(
        "clean",
        body={"cmd": "clean"},
        inputs=[sp.plan.Value(threshold)],
        reads=["in.txt", "cfg.txt"],
        writes=["out.txt"],
    )


def test_explain_names_the_changed_read_the_input_and_the_environment_field(tmp_path: Path) -> None:
    m = make_machine(
        tmp_path, "a", ArtifactStore((tmp_path / "s").as_uri()), files={"in.txt": "a\n", "cfg.txt": "c"}
    )
    first = m.dispatch(_node(0.5), upper, plan_id="p", environment={"python": "3.11", "os": "linux"})
    before = dict(m.measurer.measure_paths(["in.txt"]))["in.txt"]
    m.write("in.txt", "b\n")
    second = m.dispatch(_node(0.7), upper, plan_id="p", environment={"python": "3.12", "os": "linux"})
    assert first.key != second.key

    explained = explain(m.dispatcher.local, "clean")  # a node id finds the "p/clean" subject
    assert explained.subject == "p/clean" and explained.status == "changed"
    assert (explained.key, explained.previous_key) == (second.key, first.key)
    by_category = {c.category: c for c in explained.changes}
    read = by_category["read"]
    assert before is not None
    assert (read.where, read.old, read.kind) == ("in.txt", before.digest, "changed")
    assert by_category["input"] == Change("input", "changed", "inputs.0.literal", 0.5, 0.7)
    assert by_category["environment"] == Change(
        "environment", "changed", "environment.python", "3.11", "3.12"
    )
    assert set(by_category) == {"read", "input", "environment"}  # cfg.txt, os and the body did not change
    text = "\n".join(explained.lines())
    assert "read in.txt:" in text and "environment environment.python: 3.11 → 3.12" in text

    # by key: the same answer
    assert explain(m.dispatcher.local, second.key).changes == explained.changes


def test_explain_before_dispatch_says_why_it_will_miss(tmp_path: Path) -> None:
    m = make_machine(
        tmp_path, "a", ArtifactStore((tmp_path / "s").as_uri()), files={"in.txt": "a", "cfg.txt": "c"}
    )
    m.dispatch(_node(0.5), upper)
    m.write("cfg.txt", "tuned")
    request = m.request(_node(0.5))
    assert request.components["environment"] == {"omitted": True}  # none declared: its own identity, recorded
    pending = explain_request(m.dispatcher.local, request)
    assert [(c.category, c.where) for c in pending.changes] == [("read", "cfg.txt")]


def test_the_first_entry_of_a_subject_has_nothing_to_compare_and_unknown_names_are_refused(
    tmp_path: Path,
) -> None:
    m = make_machine(
        tmp_path, "a", ArtifactStore((tmp_path / "s").as_uri()), files={"in.txt": "a", "cfg.txt": "c"}
    )
    m.dispatch(_node(0.5), upper)
    assert explain(m.dispatcher.local, "clean").status == "first-entry"
    with pytest.raises(CacheError) as err:
        explain(m.dispatcher.local, "no-such-node")
    assert err.value.code == "not_found"


def test_read_sets_are_compared_by_path() -> None:
    old = {"hermetic": {"readSet": [{"path": "a", "digest": "1" * 64}, {"path": "b", "digest": "2" * 64}]}}
    new = {"hermetic": {"readSet": [{"path": "b", "digest": "3" * 64}, {"path": "c", "digest": "4" * 64}]}}
    assert diff_components(old, new) == (
        Change("read", "removed", "a", "1" * 64, None),
        Change("read", "changed", "b", "2" * 64, "3" * 64),
        Change("read", "added", "c", None, "4" * 64),
    )


@step(reads=["in.txt"], writes=["step-out.txt"], environment={"os": "linux"})
def shout(ws: Workspace, threshold: float) -> int:
    text = (ws / "in.txt").read_text()
    (ws / "step-out.txt").write_text(text.upper())
    return len(text)


def _fetch_and_clean(ni: Any) -> Any:
    if ni.id == "fetch":
        return {"v": 1}
    (ni.root / "plan-out.txt").write_text((ni.root / "in.txt").read_text().upper())
    return ni.inputs[0]


def _newest_components(local: LocalTier, subject: str) -> dict[str, Any]:
    row = local.rows(subject=subject, limit=1)[0]
    assert row.components is not None
    return dict(row.components)


def test_a_plan_node_and_a_step_record_and_explain_the_same_component_shape(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("a")
    plan = compile_plan(
        "p",
        "f",
        [
            node("fetch", body={"cmd": "fetch"}),
            node(
                "clean",
                body={"cmd": "clean"},
                inputs=[Ref("fetch", path=["v"]), Value(0.5)],
                reads=["in.txt"],
                writes=["plan-out.txt"],
            ),
        ],
    )
    with open_runtime(workspace=tmp_path) as rt, step_settings(workspace=tmp_path):
        rt.scheduler("r1", environment={"os": "linux"}).run(plan, _fetch_and_clean)
        # The task's own body: the real @step dispatch path (bind, key, seam, step-settled), minus Prefect's
        # task engine, which needs a server and is not what builds the request.
        assert shout.fn(0.5) == 1
        (tmp_path / "in.txt").write_text("bb")
        rt.scheduler("r2", environment={"os": "linux"}).run(plan, _fetch_and_clean)
        assert shout.fn(0.5) == 2
        assert current_spec().open().workspace == rt.workspace  # both wrote the one local tier
        local = rt.dispatcher.local
        by_plan = explain(local, "p/clean")
        by_step = explain(local, shout.step_spec.identity)
        plan_components = _newest_components(local, "p/clean")
        step_components = _newest_components(local, shout.step_spec.identity)

    assert set(plan_components) == set(step_components) == SHAPE
    assert set(plan_components["hermetic"]) == set(step_components["hermetic"]) == HERMETIC
    assert plan_components["key"] == step_components["key"] == {"kind": "content"}
    assert plan_components["environment"] == {"os": "linux"}
    assert step_components["environment"]["os"] == "linux"  # beside the Python version a step always folds
    # A Ref records the digest its key folded; a literal (a step's bound arguments are one) its value.
    assert plan_components["inputs"]["0"]["ref"] == "fetch" and plan_components["inputs"]["0"]["path"] == [
        "v"
    ]
    assert is_key(plan_components["inputs"]["0"]["digest"])
    assert plan_components["inputs"]["1"] == {"literal": 0.5}
    assert step_components["inputs"]["0"] == {"literal": {"threshold": 0.5}}
    for explained in (by_plan, by_step):
        assert explained.status == "changed"
        assert [(c.category, c.where) for c in explained.changes] == [("read", "in.txt")]


def test_a_run_local_key_is_explained_by_the_run_it_belongs_to(tmp_path: Path) -> None:
    plan = compile_plan("p", "f", [node("deploy", body={"cmd": "deploy"}, tier="irreversible")])
    with open_runtime(workspace=tmp_path) as rt:
        for run_id in ("r1", "r2"):
            report = rt.scheduler(run_id).run(plan, lambda ni: "deployed")
            assert [s.outcome for s in report.settlements] == ["built"]
        explained = explain(rt.dispatcher.local, "p/deploy")
        components = _newest_components(rt.dispatcher.local, "p/deploy")

    assert set(components) == SHAPE
    assert components["key"] == {
        "kind": "run-local",
        "ordinal": ["plan-node/v1", "p", "deploy", plan.node("deploy").key],
        "runId": "r2",
    }
    assert explained.changes == (Change("other", "changed", "key.runId", "r1", "r2"),)
