"""keys.py: plan key vs dispatch key, projection, ordering-only inputs, absent vs null, run-local keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import smthrs_plugin as sp
from smthrs_plugin.canonical import is_key
from smthrs_plugin.errors import SchedulerError
from smthrs_plugin.plan import ABSENT
from smthrs_plugin.plan.keys import (
    dispatch_key,
    input_value_digest,
    plan_key,
    project,
    resolve_refs,
    run_local_key,
)


def _plan(*drafts: sp.plan.NodeDraft) -> sp.plan.Plan:
    return sp.plan.compile_plan("p", "f", list(drafts))


def _dk(draft: sp.plan.NodeDraft, results: dict[str, object], **kw: object) -> str:
    return dispatch_key(draft, ref_values=resolve_refs(draft, results), read_set=kw.pop("read_set", []), **kw)  # type: ignore[arg-type]


def test_renaming_a_node_keeps_its_key() -> None:
    a = _plan(
        sp.plan.node("fetch", body={"u": 1}),
        sp.plan.node("build", body={"c": 2}, inputs=[sp.plan.Ref("fetch")]),
    )
    b = _plan(
        sp.plan.node("get", body={"u": 1}), sp.plan.node("make", body={"c": 2}, inputs=[sp.plan.Ref("get")])
    )
    assert [n.key for n in a.nodes] == [n.key for n in b.nodes]
    assert all(is_key(n.key) for n in a.nodes)


def test_upstream_body_edit_changes_plan_key_but_not_dispatch_key_when_projection_is_equal() -> None:
    down = sp.plan.node("build", body={"c": 2}, inputs=[sp.plan.Ref("fetch", path=["value"])])
    v1 = _plan(sp.plan.node("fetch", body={"url": "v1"}), down)
    v2 = _plan(sp.plan.node("fetch", body={"url": "v2"}), down)
    assert v1.node("build").key != v2.node("build").key  # transitive re-keying
    same = {"fetch": {"value": 42, "noise": "v1"}}
    other = {"fetch": {"value": 42, "noise": "v2"}}  # unprojected sibling fields do not matter
    assert _dk(down, same) == _dk(down, other)
    assert _dk(down, same) != _dk(down, {"fetch": {"value": 43}})


def test_pending_contributes_only_ordering_only_to_the_dispatch_key() -> None:
    d1 = sp.plan.node("t", body={"c": 1}, inputs=[sp.plan.Pending("a")])
    d2 = sp.plan.node("t", body={"c": 1}, inputs=[sp.plan.Pending("b")])
    assert _dk(d1, {}) == _dk(d2, {})
    assert resolve_refs(d1, {"a": {"secret": 1}}) == {}  # the executor never sees ordering-only values
    # ...while the plan key folds the upstream plan key
    assert plan_key(d1, {"a": "key1_" + "a" * 64}) != plan_key(d1, {"a": "key1_" + "b" * 64})


def test_absent_projection_hashes_differently_from_null() -> None:
    assert project({"a": {"b": None}}, ["a", "b"]) is None
    assert project({"a": {}}, ["a", "b"]) is ABSENT
    assert project({"a": [1]}, ["a", "b"]) is ABSENT  # non-object mid-path
    assert project(3, []) == 3
    assert input_value_digest(ABSENT) != input_value_digest(None)
    d = sp.plan.node("t", inputs=[sp.plan.Ref("a", path=["b"])])
    assert _dk(d, {"a": {"b": None}}) != _dk(d, {"a": {}})


def test_absent_optional_fields_hash_differently_from_declared_ones() -> None:
    keys = {
        plan_key(sp.plan.node("a"), {}),
        plan_key(sp.plan.node("a", nondeterministic=False), {}),
        plan_key(sp.plan.node("a", nondeterministic=True), {}),
        plan_key(sp.plan.node("a", approval={"request": "ship"}), {}),
        plan_key(sp.plan.node("a", wait={"seconds": 1}), {}),
    }
    assert len(keys) == 5
    d = sp.plan.node("a")
    assert _dk(d, {}) != _dk(d, {}, environment=None)  # omitted environment is an identity, not a wildcard


def test_dispatch_key_folds_measured_reads_environment_and_hermetic_sets() -> None:
    d = sp.plan.node("a", reads=["src/**"], writes=["out/x"])
    base = _dk(d, {}, read_set=[("src/b", "h2"), ("src/a", "h1")], environment={"py": "3.11"})
    assert base == _dk(d, {}, read_set=[("src/a", "h1"), ("src/b", "h2")], environment={"py": "3.11"})
    assert base != _dk(d, {}, read_set=[("src/a", "h1"), ("src/b", "h3")], environment={"py": "3.11"})
    assert base != _dk(d, {}, read_set=[("src/a", "h1"), ("src/b", "h2")], environment={"py": "3.12"})
    assert base != _dk(
        d,
        {},
        read_set=[("src/a", "h1"), ("src/b", "h2")],
        environment={"py": "3.11"},
        boundary_mode="expected",
    )
    assert base != _dk(
        d, {}, read_set=[("src/a", "h1"), ("src/b", "h2")], environment={"py": "3.11"}, writes=["out/y"]
    )


def test_scheduling_fields_do_not_enter_keys() -> None:
    a = sp.plan.node("a", body={"x": 1})
    b = sp.plan.node("b", body={"x": 1}, priority=9, conflict="lane", runtime="stop-merge")
    assert plan_key(a, {}) == plan_key(b, {})
    assert _dk(a, {}) == _dk(b, {})


def test_layers_and_capabilities_are_keyed_as_sets_but_groups_matter() -> None:
    k = plan_key(sp.plan.node("a", layers=["b", "a", "a"], capabilities={"declared": ["y", "x"]}), {})
    assert k == plan_key(sp.plan.node("a", layers=["a", "b"], capabilities=["x", "y", "x"]), {})
    assert k != plan_key(sp.plan.node("a", layers=["a", "b"], capabilities={"other": ["x", "y"]}), {})
    # NFC: a precomposed and a decomposed e-acute are the same layer
    assert plan_key(sp.plan.node("a", layers=["\u00e9"]), {}) == plan_key(
        sp.plan.node("a", layers=["e\u0301"]), {}
    )


def test_key_uncomputable_is_typed_never_weaker() -> None:
    d = sp.plan.node("t", inputs=[sp.plan.Ref("a")])
    with pytest.raises(SchedulerError) as err:
        dispatch_key(d, ref_values={}, read_set=[])
    assert err.value.code == "key_uncomputable"
    with pytest.raises(SchedulerError):
        dispatch_key(d, ref_values={0: float("nan")}, read_set=[])
    with pytest.raises(SchedulerError):
        dispatch_key(d, ref_values={0: 1}, read_set=[("../x", "h")])
    with pytest.raises(SchedulerError):
        dispatch_key(d, ref_values={0: 1}, read_set=[], environment={"x": float("inf")})
    with pytest.raises(SchedulerError):
        resolve_refs(d, {})


def test_dispatch_memo_is_keyed_by_from_and_path() -> None:
    memo: dict[tuple[str, tuple[str, ...]], str] = {}
    d = sp.plan.node("t", inputs=[sp.plan.Ref("a", path=["v"])])
    k1 = dispatch_key(d, ref_values={0: 5}, read_set=[], memo=memo)
    assert memo == {("a", ("v",)): input_value_digest(5)}
    assert dispatch_key(d, ref_values={0: 5}, read_set=[], memo=memo) == k1


def test_run_local_key_is_scoped_by_plan_node_declaration_and_run() -> None:
    base = run_local_key("p", "deploy", "key1_" + "a" * 64, "r1")
    assert base != run_local_key("p", "deploy", "key1_" + "a" * 64, "r2")
    assert base != run_local_key("p", "deploy2", "key1_" + "a" * 64, "r1")
    assert base != run_local_key("q", "deploy", "key1_" + "a" * 64, "r1")
    assert base == run_local_key("p", "deploy", "key1_" + "a" * 64, "r1")
    with pytest.raises(SchedulerError):
        run_local_key("p", "", "k", "r")


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=4),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
    max_leaves=6,
)
_declaration = st.fixed_dictionaries(
    {
        "body": _json,
        "literals": st.lists(_json, max_size=2),
        "tier": st.sampled_from(["sealed", "compensable", "irreversible"]),
        "kind": st.sampled_from(["step", "agent", "merge"]),
        "nondeterministic": st.sampled_from([None, True, False]),
        "layers": st.lists(st.sampled_from(["py", "node", "gpu"]), max_size=3, unique=True).map(sorted),
        "writes": st.lists(st.sampled_from(["out/a", "out/b", "dist/"]), max_size=2, unique=True).map(sorted),
        "approval": st.sampled_from([None, {"request": "ship"}]),
    }
)


def _draft(decl: dict[str, object], node_id: str) -> sp.plan.NodeDraft:
    return sp.plan.node(
        node_id,
        body=decl["body"],
        inputs=[sp.plan.Value(v) for v in decl["literals"]],  # type: ignore[attr-defined]
        tier=decl["tier"],  # type: ignore[arg-type]
        kind=decl["kind"],  # type: ignore[arg-type]
        nondeterministic=decl["nondeterministic"],  # type: ignore[arg-type]
        layers=decl["layers"],  # type: ignore[arg-type]
        writes=decl["writes"],  # type: ignore[arg-type]
        approval=decl["approval"],  # type: ignore[arg-type]
    )


def _identity(decl: dict[str, object], *without: str) -> bytes:
    from smthrs_plugin.canonical import canonical_bytes

    return canonical_bytes({k: v for k, v in decl.items() if k not in without})


@settings(max_examples=300, deadline=None)
@given(_declaration, _declaration)
def test_distinct_declarations_get_distinct_keys_and_equal_ones_equal_keys(a: dict, b: dict) -> None:
    # The node kind and the declared file effects are not key material (as in the reference): the plan key
    # folds everything else, the dispatch key also the declared writes, and the plan digest — what an approval
    # binds to — all of it.
    ka, kb = plan_key(_draft(a, "x"), {}), plan_key(_draft(b, "x"), {})
    assert (ka == kb) == (_identity(a, "kind", "writes") == _identity(b, "kind", "writes"))
    if a["tier"] == b["tier"] == "sealed":
        da, db = _dk(_draft(a, "x"), {}), _dk(_draft(b, "x"), {})
        assert (da == db) == (_identity(a, "kind") == _identity(b, "kind"))
    pa, pb = _plan(_draft(a, "x")), _plan(_draft(b, "x"))
    assert (pa.digest == pb.digest) == (_identity(a) == _identity(b))
