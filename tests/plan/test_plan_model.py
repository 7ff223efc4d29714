"""model.py: declarations, typed refusals, absent-field omission, JSON round trip."""

from __future__ import annotations

import json

import pytest

import smthrs_plugin as sp
from smthrs_plugin.errors import PlanError
from smthrs_plugin.plan import NodeDraft, Plan
from smthrs_plugin.plan.model import Effects, KeyMaterial


def test_ref_and_pending_are_constructible_positionally_by_name_and_by_alias() -> None:
    assert (
        sp.plan.Ref("fetch", path=["value"])
        == sp.plan.Ref(from_="fetch", path=("value",))
        == sp.plan.Ref(**{"from": "fetch", "path": ["value"]})
    )
    assert sp.plan.Pending("lint").from_ == "lint"
    assert sp.plan.Value(None).value is None
    assert sp.plan.Ref("a").model_dump() == {"kind": "ref", "from": "a", "path": ()}


def test_node_builds_the_design_example() -> None:
    d = sp.plan.node(
        "build",
        body={"cmd": "make"},
        inputs=[sp.plan.Ref("fetch", path=["value"]), sp.plan.Pending("lint")],
        reads=["src/**", "Makefile"],
        writes=["dist/"],
        removes=[],
        boundary="hard",
        tier="sealed",
        kind="step",
        priority=0,
    )
    assert d.dependencies() == ("fetch", "lint")
    assert d.effects.writes == (sp.plan.TreeArtifact(path="dist"),)
    assert d.material.version == "flows/key-material/v1"


@pytest.mark.parametrize("priority", [True, 1.0, "1", None])
def test_priority_must_be_an_exact_int(priority: object) -> None:
    with pytest.raises(PlanError) as err:
        sp.plan.node("a", priority=priority)  # type: ignore[arg-type]
    assert err.value.code == "invalid_node"
    assert "'a'" in err.value.message and "priority" in err.value.message


def test_priority_may_be_arbitrarily_large() -> None:
    assert sp.plan.node("a", priority=2**200).priority == 2**200
    assert sp.plan.node("a", priority=-(2**70)).priority == -(2**70)


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"kind": "robot"}, "invalid_node"),
        ({"tier": "forever"}, "invalid_node"),
        ({"conflict": "merge"}, "invalid_node"),
        ({"runtime": "pray"}, "invalid_node"),
        ({"boundary": "soft"}, "invalid_node"),
        ({"inputs": ["fetch"]}, "invalid_node"),
        ({"body": {"x": float("nan")}}, "invalid_node"),
        ({"body": {"big": 2**60}}, "invalid_node"),
        ({"nondeterministic": 1}, "invalid_node"),
        ({"approval": "yes"}, "invalid_node"),
        ({"reads": ["../secret"]}, "invalid_effects"),
        ({"writes": ["/abs"]}, "invalid_effects"),
        ({"writes": ["dist/"], "removes": ["dist/old.txt"]}, "invalid_effects"),
        ({"writes": ["out/a"], "removes": ["out/a"]}, "invalid_effects"),
        ({"writes": ["out/*.o"], "removes": ["out/x.o"]}, "invalid_effects"),
    ],
)
def test_bad_declarations_are_refused_with_a_code_and_the_node_name(
    kwargs: dict[str, object], code: str
) -> None:
    with pytest.raises(PlanError) as err:
        sp.plan.node("n1", **kwargs)  # type: ignore[arg-type]
    assert err.value.code == code
    assert "'n1'" in err.value.message


def test_writes_and_removes_under_disjoint_prefixes_are_accepted() -> None:
    d = sp.plan.node("a", writes=["out/*.o"], removes=["tmp/*"])
    assert len(d.effects.removes) == 1


@pytest.mark.parametrize("bad", ["", 3, None, "a\x00b"])
def test_node_ids_must_be_non_empty_strings(bad: object) -> None:
    with pytest.raises(PlanError) as err:
        sp.plan.node(bad)  # type: ignore[arg-type]
    assert err.value.code == "invalid_node"


def test_absent_optional_fields_are_omitted_never_null() -> None:
    d = sp.plan.node("a")
    dumped = d.model_dump(mode="json")
    assert "approval" not in dumped and "wait" not in dumped
    assert "nondeterministic" not in dumped["material"]
    # ...while a Literal(None) keeps its null value
    assert sp.plan.Value(None).model_dump() == {"kind": "literal", "value": None}


def test_caller_mutation_after_construction_does_not_change_the_declaration() -> None:
    body = {"cmd": ["make", "all"]}
    value = {"k": [1]}
    d = sp.plan.node("a", body=body, inputs=[sp.plan.Value(value)])
    body["cmd"].append("evil")
    value["k"].append(2)
    assert d.material.body == {"cmd": ["make", "all"]}
    assert d.material.inputs[0].value == {"k": [1]}  # type: ignore[union-attr]


def test_plan_json_round_trip_is_lossless_and_verifies() -> None:
    p = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node(
                "a", body={"x": 1.5}, writes=["out/", {"include": ["gen/*.c"], "exclude": ["gen/x.c"]}]
            ),
            sp.plan.node(
                "b",
                inputs=[sp.plan.Ref("a", path=["v"]), sp.plan.Value(None)],
                reads=["out/a"],
                priority=2**64,
            ),
            sp.plan.node(
                "c", inputs=[sp.plan.Pending("b")], wait={"seconds": 600}, nondeterministic=True, kind="agent"
            ),
        ],
    )
    data = json.loads(json.dumps(p.to_json()))
    back = Plan.from_json(data)
    assert back == p
    assert sp.plan.verify_plan(back) is back


def test_malformed_stored_plan_is_invalid_plan() -> None:
    with pytest.raises(PlanError) as err:
        Plan.from_json({"plan_id": "p"})
    assert err.value.code == "invalid_plan"


def test_models_are_frozen() -> None:
    d = sp.plan.node("a")
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        d.priority = 3  # type: ignore[misc]
    assert isinstance(d, NodeDraft) and isinstance(d.material, KeyMaterial) and isinstance(d.effects, Effects)
