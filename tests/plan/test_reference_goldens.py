"""Plan keys, dispatch keys and plan digests against the reference implementation's own vectors.

Every vector is the reference's, rewritten as Python data: its key goldens (the checked-in golden keys of its
testing package), its step-key suite (plan-key compiler and dispatch identity), the diamond, environment and
early-cutoff tests of its plan-scheduler suite, the keying tests of its plan suite, and the lease constants of
its journal consensus. Where the reference pins a value, the value is asserted byte for byte; where it pins a
relation (equal, distinct, refused), the relation is. Plan digests, which the reference never pins, are checked
against the document its plan-digest definition hashes, written out here by hand.

Tally (``TALLY``, kept honest by ``test_the_vector_tally_is_as_reported``):

- taken: 52 — the 5 golden keys, the 32 tests of the step-key suite, 4 plan-scheduler tests, 7 plan-suite
  vectors, the 4 lease constants.
- identical: 43 — among them every pinned value this implementation has a counterpart of: the content golden,
  the plan-key and dispatch-key goldens, the three diamond dispatch keys (through the real scheduler).
- deliberately different: 3 — a non-sealed node is keyed here (its plan key folds ``tier``) where the reference
  refuses it; the reference's ordinal golden (``ordinal/basic``) is a key kind this implementation does not mint
  (its run-local key is another document); a missing dependency is refused with this implementation's code
  (``unknown_dependency``), not ``missing_dependency``. Each has a test below showing what would break otherwise
  (and ``plan/keys.py``'s docstring has the section "Deliberate differences from the reference").
- not applicable: 6 — the three ``graph/*`` goldens pin the material the reference's flow-graph builder derives
  (node reflection, placement, effect declarations), which this implementation does not have; the step-key
  suite's untagged digest input, its opaque material ``effects``/``placement`` and its in-flight memo eviction
  have no counterpart here.

Keys changed once when this became true: caches and approvals made before are not reused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import smthrs_plugin as sp
from smthrs_plugin.canonical import is_key, key
from smthrs_plugin.errors import PlanError, SchedulerError
from smthrs_plugin.plan import ABSENT
from smthrs_plugin.plan.keys import (
    dispatch_key,
    input_value_digest,
    plan_key,
    project,
    resolve_refs,
    run_local_key,
)
from smthrs_plugin.plan.model import KeyMaterial
from smthrs_plugin.settings import Settings

TALLY = {"taken": 52, "identical": 43, "deliberately different": 3, "not applicable": 6}
VERSION = "flows/key-material/v1"

# The reference's key goldens (its testing package's checked-in fixture).
KEY_GOLDENS = {
    "content/basic": "key1_11b2e91c473a67599d8110873b2a08150496946e0c0da82bfc56ffbe28df02f6",
    "ordinal/basic": "key1_bba49c6a1c2c26bd9b1b5bbbd45e53d628270e4c907e2165b67f97d357a45a6f",
    "graph/root": "key1_0d2ae1911c83b47582b0b72f867882af86ebd33b624210f6a013dc23030a36cd",
    "graph/root.all.read": "key1_145095f202f310b317aa8ff75dd2244751fb12e723816e3d399d351a83be5693",
    "graph/root.all.review": "key1_4f0947fb1e3ca4ef9890bdded340d9ede92cdd16c45c32038e64c540688729c2",
}
# The reference's step-key suite: the plan key of its default material, and the dispatch key of that material
# under its default hermetic boundary with no environment.
PLAN_KEY_GOLDEN = "key1_594e55424285180f3bcb35e6075d0e6961b6506cc15d78de0613eac91eeb9cd9"
DISPATCH_KEY_GOLDEN = "key1_70bc16b1ef9256f7301167c9d11f332d39383c61d9f630d99bdc920c066b6ac2"
# The reference's plan-scheduler suite: "preserves every dispatch key in a diamond plan".
DIAMOND_DISPATCH_KEYS = {
    "producer": "key1_a2f7c76258f4ab3fa6df7e1668397e17ad3ec97158279b24b8f0f7688cfb50e8",
    "left": "key1_e9e2811e03fa18cf7e5ddae49b3e6a52354f87de283b8a244c02090549c4b623",
    "right": "key1_b556bfd989cf1c299166399064880ded26b2abc2ea43398c6bcc6110352c5002",
}

UP = "key1_upstream"  # the reference suite's stand-in upstream key (any string is folded as given)


def _material(**kw: Any) -> sp.plan.NodeDraft:
    """The step-key suite's default material (``body: {action: "render"}``), as a node."""
    kw.setdefault("body", {"action": "render"})
    return sp.plan.node(kw.pop("id", "n"), **kw)


def _dispatch(results: dict[str, Any] | None = None, *, read_digest: str = "sha256:a", **kw: Any) -> str:
    """The dispatch-identity suite's helper: its material under the boundary ``readSet [src/a.ts sha256:a],
    writeSet [out/a.js], hard``."""
    removes = kw.pop("removes", ())
    environment = kw.pop("environment", ABSENT)
    d = _material(writes=["out/a.js"], removes=removes, **kw)
    return dispatch_key(
        d,
        ref_values=resolve_refs(d, results or {}),
        read_set=[("src/a.ts", read_digest)],
        environment=environment,
    )


def _ref(path: list[str] | None = None, frm: str = "u") -> sp.plan.Ref:
    return sp.plan.Ref(frm, path=path or [])


# ---------------------------------------------------------------------------------------- key goldens


def test_the_content_golden_is_the_content_document_every_key_here_is_built_on() -> None:
    # {kind: "content", body, inputs, layers, capabilities}: the skeleton of the plan key, the dispatch key and
    # the plan digest alike (an empty-node-list digest document differs only in its body and inputs).
    assert (
        key({"kind": "content", "body": "x", "inputs": {}, "layers": [], "capabilities": {}})
        == KEY_GOLDENS["content/basic"]
    )


def test_the_ordinal_golden_is_reproduced_but_run_local_keys_are_their_own_namespace() -> None:
    # Deliberately different: the reference numbers the steps of its agent runtime ({kind: "ordinal", runId,
    # ordinal, tier}); a run-local key here names a plan node of a run (plan id, node id, plan key). The primitive
    # reproduces the reference's ordinal key; the two documents' kinds keep the namespaces apart.
    ordinal = {"kind": "ordinal", "runId": "golden-run", "ordinal": 0, "tier": "unsealed"}
    assert key(ordinal) == KEY_GOLDENS["ordinal/basic"]
    local = run_local_key("p", "deploy", PLAN_KEY_GOLDEN, "golden-run")
    assert local == key(
        {
            "kind": "run-local",
            "ordinal": ["plan-node/v1", "p", "deploy", PLAN_KEY_GOLDEN],
            "runId": "golden-run",
        }
    )
    # the reference's run-local property holds: another run, another key
    assert local != run_local_key("p", "deploy", PLAN_KEY_GOLDEN, "other-run")


# ------------------------------------------------------------------------------- step keys: plan keys


def test_the_plan_key_golden_is_reproduced_and_declared_nondeterminism_moves_it() -> None:
    assert plan_key(_material(), {}) == PLAN_KEY_GOLDEN
    assert plan_key(_material(nondeterministic=True), {}) != PLAN_KEY_GOLDEN


def test_the_plan_key_document_is_the_references_member_for_member() -> None:
    # fromKeyMaterial's document, written out: literal, pending, ref and ref-projected inputs, sorted NFC layers,
    # the capability list as the "declared" group
    d = _material(
        inputs=[sp.plan.Value(1), sp.plan.Pending("a"), sp.plan.Ref("b"), sp.plan.Ref("b", path=["x", "0"])],
        layers=["z", "e\u0301", "a", "a"],
        capabilities=["fs:write", "fs:read"],
    )
    up = {"a": "key1_" + "a" * 64, "b": "key1_" + "b" * 64}
    assert plan_key(d, up) == key(
        {
            "kind": "content",
            "body": {"version": VERSION, "declaration": {"action": "render"}},
            "inputs": {
                "0": {"kind": "literal", "value": 1},
                "1": {"kind": "digest", "digest": up["a"], "reference": "pending"},
                "2": {"kind": "digest", "digest": up["b"], "reference": "ref"},
                "3": {"kind": "digest", "digest": up["b"], "reference": "ref-projected", "path": ["x", "0"]},
            },
            "layers": ["a", "z", "\u00e9"],
            "capabilities": {"declared": ["fs:read", "fs:write"]},
        }
    )


def test_set_like_declarations_are_keyed_as_sets() -> None:
    left = plan_key(_material(body=1, layers=["b", "a"], capabilities={"fs": ["w", "r", "r"]}), {})
    right = plan_key(_material(body=1, layers=["a", "b"], capabilities={"fs": ["r", "w"]}), {})
    assert is_key(left) and left == right


def test_a_graph_reference_is_distinct_from_a_literal_of_the_same_shape() -> None:
    branded = plan_key(_material(body=1, inputs=[sp.plan.Ref("up")]), {"up": "abc"})
    literal = plan_key(_material(body=1, inputs=[sp.plan.Value({"digest": "abc"})]), {})
    assert branded != literal


def test_every_reference_variant_is_tagged_and_a_literal_spelling_one_is_not_it() -> None:
    up = {"upstream": UP}
    pending = plan_key(_material(inputs=[sp.plan.Pending("upstream")]), up)
    plain = plan_key(_material(inputs=[sp.plan.Ref("upstream")]), up)
    projected = plan_key(_material(inputs=[sp.plan.Ref("upstream", path=["a"])]), up)
    literal = plan_key(_material(inputs=[sp.plan.Value(1)]), up)
    assert len({pending, plain, projected, literal}) == 4
    impostor = plan_key(
        _material(inputs=[sp.plan.Value({"kind": "digest", "digest": UP, "reference": "ref"})]), up
    )
    projected_impostor = plan_key(
        _material(
            inputs=[
                sp.plan.Value({"kind": "digest", "digest": UP, "reference": "ref-projected", "path": ["a"]})
            ]
        ),
        up,
    )
    assert len({plain, impostor, projected, projected_impostor}) == 4


def test_a_missing_dependency_is_refused_with_this_implementations_code() -> None:
    # Deliberately different only in the code's name: the reference says missing_dependency; compile, verify
    # and the plan-file loader here say unknown_dependency for every unknown id, and so does the key.
    with pytest.raises(PlanError) as exc:
        plan_key(_material(inputs=[sp.plan.Ref("missing")]), {})
    assert exc.value.code == "unknown_dependency"


def test_a_non_sealed_node_is_keyed_here_and_its_tier_is_key_material() -> None:
    # Deliberately different: the reference refuses to key non-sealed material. Here a compensable or
    # irreversible node is a plan node (keyed run-locally at dispatch). Its plan key folds body.tier because
    # nothing else would tell the two apart: the plan digest has no tier member, so without it an approval
    # granted for a plan whose node is sealed would release the same plan with that node irreversible.
    sealed = sp.plan.compile_plan("p", "f", [_material(id="deploy")])
    irreversible = sp.plan.compile_plan("p", "f", [_material(id="deploy", tier="irreversible")])
    assert sealed.node("deploy").key == PLAN_KEY_GOLDEN  # a sealed body carries no tier, as the reference's
    assert irreversible.node("deploy").key == key(
        {
            "kind": "content",
            "body": {"version": VERSION, "declaration": {"action": "render"}, "tier": "irreversible"},
            "inputs": {},
            "layers": [],
            "capabilities": {"declared": []},
        }
    )
    assert irreversible.digest != sealed.digest
    with pytest.raises(SchedulerError) as exc:  # and, as in the reference, it has no content dispatch key
        dispatch_key(irreversible.node("deploy").draft, ref_values={}, read_set=[])
    assert exc.value.code == "key_uncomputable"


def test_a_value_without_canonical_form_is_a_typed_refusal() -> None:
    with pytest.raises(PlanError) as exc:
        _material(body=2**64)  # the reference's bigint body
    assert exc.value.code == "invalid_node"


def test_material_dependencies_are_listed_once_in_declaration_order() -> None:
    d = _material(
        inputs=[sp.plan.Value(1), sp.plan.Ref("b"), sp.plan.Pending("a"), sp.plan.Ref("b", path=["x"])]
    )
    assert d.dependencies() == ("b", "a")


def test_stored_material_without_a_nondeterminism_declaration_decodes_as_absent() -> None:
    stored = _material().material.model_dump(mode="json", by_alias=True)
    assert "nondeterministic" not in stored
    decoded = KeyMaterial.model_validate(stored)
    assert decoded.nondeterministic is None
    assert plan_key(_material().model_copy(update={"material": decoded}), {}) == PLAN_KEY_GOLDEN


# --------------------------------------------------------------------------- step keys: hermetic sets


def test_the_hermetic_boundary_is_normalised_and_deduplicated() -> None:
    d = _material(body=1)
    kw: dict[str, Any] = {"ref_values": {}, "boundary_mode": "hard"}
    left = dispatch_key(
        d,
        read_set=[("b", "2"), ("a", "1"), ("a", "1"), ("a", "0")],
        writes=["out", "out"],
        **kw,
    )
    right = dispatch_key(d, read_set=[("a", "0"), ("a", "1"), ("b", "2")], writes=["out"], **kw)
    assert left == right


def test_trees_globs_and_removals_are_normalised_as_sets() -> None:
    d = _material(body=1)

    def identity(writes: list[Any], removes: list[str]) -> str:
        return dispatch_key(d, ref_values={}, read_set=[], writes=writes, removes=removes)

    left = identity(
        [
            sp.plan.Glob(include=["src/**/*.ts", "src/**/*.ts"], exclude=["src/z.ts", "src/a.ts"]),
            sp.plan.Glob(include=["assets/**"]),
            sp.plan.TreeArtifact(path="dist"),
            "out",
        ],
        ["stale/z", "stale/a", "stale/a"],
    )
    right = identity(
        [
            "out",
            sp.plan.Glob(include=["assets/**"]),
            sp.plan.TreeArtifact(path="dist"),
            sp.plan.Glob(include=["src/**/*.ts"], exclude=["src/a.ts", "src/z.ts"]),
        ],
        ["stale/a", "stale/z"],
    )
    assert left == right


def test_write_entries_are_ordered_by_code_unit_as_the_reference_orders_them() -> None:
    d = _material(body=1)
    tree = sp.plan.TreeArtifact(path="\u00e4n/out.js")
    left = dispatch_key(d, ref_values={}, read_set=[], writes=[tree, tree, "z/out.js"])
    right = dispatch_key(d, ref_values={}, read_set=[], writes=["z/out.js", tree])
    assert left == right
    # The order itself, written out: entries sort by the compact JSON of ["Path", p] / ["TreeArtifact", p] /
    # ["Glob", include, exclude|null] in UTF-16 code units — so "a b" (its text goes on with a space) comes
    # before "a" (its text goes on with a quote), and the tagged shapes before paths ("Glob" < "Path" < "Tree").
    writes: list[Any] = ["a", "a b", sp.plan.TreeArtifact(path="t"), sp.plan.Glob(include=["g/*", "f/*"])]
    assert dispatch_key(d, ref_values={}, read_set=[("\u00e9", "h"), ("e", "h")], writes=writes) == key(
        {
            "kind": "content",
            "body": {"version": VERSION, "declaration": 1},
            "inputs": {},
            "layers": [],
            "capabilities": {"declared": []},
            "hermetic": {
                "readSet": [{"path": "e", "digest": "h"}, {"path": "\u00e9", "digest": "h"}],
                "writeSet": [
                    {"_tag": "Glob", "include": ["f/*", "g/*"]},
                    "a b",
                    "a",
                    {"_tag": "TreeArtifact", "path": "t"},
                ],
                "boundaryMode": "hard",
            },
        }
    )


# ------------------------------------------------------------------------------ step keys: dispatch


def test_the_dispatch_key_golden_is_reproduced_and_an_environment_moves_it() -> None:
    absent = _dispatch()
    assert absent == DISPATCH_KEY_GOLDEN
    env = {
        "declared": False,
        "layers": ["node-crypto", "workspace"],
        "capabilities": {"fs": ["read", "write"]},
    }
    present = _dispatch(environment=env)
    scoped = _dispatch(environment={**env, "runScope": "run-1"})
    assert present != absent and scoped != present
    assert _dispatch(nondeterministic=True) != DISPATCH_KEY_GOLDEN


def test_the_environment_is_its_own_namespace_normalised_as_the_reference_normalises_it() -> None:
    d = _material(body=1, layers=["a"])
    separate = dispatch_key(
        d,
        ref_values={},
        read_set=[],
        environment={"declared": True, "layers": ["b"], "capabilities": {"fs": ["r"]}},
    )
    merged = dispatch_key(
        _material(body=1, layers=["a", "b"], capabilities={"fs": ["r"]}), ref_values={}, read_set=[]
    )
    undeclared = dispatch_key(
        d,
        ref_values={},
        read_set=[],
        environment={"declared": False, "layers": ["b"], "capabilities": {"fs": ["r"]}, "runScope": "run-1"},
    )
    ordered = dispatch_key(
        d,
        ref_values={},
        read_set=[],
        environment={"declared": True, "layers": ["b", "c"], "capabilities": {}},
    )
    swapped = dispatch_key(
        d,
        ref_values={},
        read_set=[],
        environment={"declared": True, "layers": ["c", "b"], "capabilities": {}},
    )
    assert separate != merged and separate != undeclared and ordered != swapped
    # normalisation, written out: layers NFC in their order, capability groups NFC sorted sets
    env = {"declared": True, "layers": ["z", "e\u0301"], "capabilities": {"fs": ["w", "r", "r"]}}
    assert dispatch_key(d, ref_values={}, read_set=[], environment=env) == key(
        {
            "kind": "content",
            "body": {"version": VERSION, "declaration": 1},
            "inputs": {},
            "layers": ["a"],
            "capabilities": {"declared": []},
            "environment": {"declared": True, "layers": ["z", "\u00e9"], "capabilities": {"fs": ["r", "w"]}},
            "hermetic": {"readSet": [], "writeSet": [], "boundaryMode": "hard"},
        }
    )


def test_a_projected_value_digest_is_memoised_and_the_memo_changes_nothing() -> None:
    d = _material(inputs=[_ref(["value"], "upstream")])
    memo: dict[tuple[str, tuple[str, ...]], str] = {}
    results = {"upstream": {"value": {"nested": True}}}
    first = dispatch_key(d, ref_values=resolve_refs(d, results), read_set=[], memo=memo)
    assert memo == {("upstream", ("value",)): input_value_digest({"nested": True})}
    second = dispatch_key(d, ref_values=resolve_refs(d, results), read_set=[], memo=memo)
    assert first == second == dispatch_key(d, ref_values=resolve_refs(d, results), read_set=[])


def test_a_ref_folds_the_upstream_value_never_its_identity() -> None:
    inputs = [_ref(frm="upstream")]
    first = _dispatch({"upstream": {"count": 1}}, inputs=inputs)
    assert first == _dispatch({"upstream": {"count": 1}}, inputs=inputs)
    assert first != _dispatch({"upstream": {"count": 2}}, inputs=inputs)


def test_a_projection_ignores_sibling_fields() -> None:
    inputs = [_ref(["taken"], "upstream")]
    base = _dispatch({"upstream": {"taken": "x", "ignored": 1}}, inputs=inputs)
    assert base == _dispatch({"upstream": {"taken": "x", "ignored": 2}}, inputs=inputs)
    assert base != _dispatch({"upstream": {"taken": "y", "ignored": 1}}, inputs=inputs)


def test_a_projection_that_walks_off_the_end_is_one_stable_absence_distinct_from_null() -> None:
    deep = [_ref(["a", "b"], "upstream")]
    off_scalar = _dispatch({"upstream": {"a": "scalar"}}, inputs=deep)
    off_null = _dispatch({"upstream": {"a": None}}, inputs=deep)
    off_missing = _dispatch({"upstream": {}}, inputs=deep)
    present = _dispatch({"upstream": {"a": {"b": None}}}, inputs=deep)
    assert len({off_scalar, off_null, off_missing}) == 1
    assert present != off_scalar


def test_a_projected_reference_is_distinct_from_the_unprojected_one() -> None:
    flat = _dispatch({"u": {"a": 1}}, inputs=[_ref()])
    nested = _dispatch({"u": {"a": 1}}, inputs=[_ref(["a"])])
    bare = _dispatch(
        {"u": 1}, inputs=[_ref()]
    )  # the same value as `nested` projects: the tag tells them apart
    assert nested != bare and flat != nested


def test_pending_folds_nothing_but_its_tag() -> None:
    inputs = [sp.plan.Pending("before")]
    assert _dispatch({"before": {"anything": 1}}, inputs=inputs) == _dispatch(
        {"before": "completely different"}, inputs=inputs
    )


def test_a_literal_spelling_a_resolved_reference_is_not_the_reference() -> None:
    reference = _dispatch({"u": 1}, inputs=[_ref()])
    digest = key({"kind": "content", "body": 0, "inputs": {"0": 1}, "layers": [], "capabilities": {}})
    impostor = _dispatch(
        {"u": 1}, inputs=[sp.plan.Value({"kind": "digest", "digest": digest, "reference": "ref"})]
    )
    assert reference != impostor


def test_the_nodes_own_declaration_and_the_measured_boundary_are_folded() -> None:
    keys = {
        _dispatch(),
        _dispatch(body={"action": "compile"}),
        _dispatch(layers=["fs"]),
        _dispatch(capabilities=["fs:read"]),
        _dispatch(read_digest="sha256:b"),
    }
    assert len(keys) == 5


def test_declared_removals_are_folded() -> None:
    assert _dispatch(removes=["out/stale.js"]) != _dispatch()


def test_dispatch_refuses_an_unsettled_dependency_and_a_value_without_canonical_form() -> None:
    with pytest.raises(SchedulerError) as exc:
        resolve_refs(_material(inputs=[_ref(frm="missing")]), {})
    assert exc.value.code == "key_uncomputable"
    with pytest.raises(SchedulerError) as exc:
        _dispatch({"u": 2**64}, inputs=[_ref()])  # the reference's bigint result
    assert exc.value.code == "key_uncomputable"


# ----------------------------------------------------------------------------------------- scheduler


def _draft(node_id: str, **kw: Any) -> sp.plan.NodeDraft:
    """The plan-scheduler suite's draft: ``body {action: id}``, ``writes [<id>.out]``."""
    kw.setdefault("body", {"action": node_id})
    kw.setdefault("writes", [f"{node_id}.out"])
    return sp.plan.node(node_id, **kw)


def _ran(ni: Any) -> Any:
    (ni.root / f"{ni.id}.out").write_text(ni.id)  # a hard boundary here wants the declared write produced
    return {"ran": ni.id}


def test_the_diamond_plans_dispatch_keys_are_the_references_through_the_real_scheduler(
    tmp_path: Path,
) -> None:
    plan = sp.plan.compile_plan(
        "diamond-plan",
        "example/Build",
        [
            _draft("producer"),
            _draft("left", inputs=[_ref(frm="producer")]),
            _draft("right", inputs=[_ref(frm="producer")]),
        ],
    )
    with sp.open_runtime(workspace=tmp_path) as rt:
        report = rt.scheduler("run-diamond").run(plan, _ran)
        assert {s.node: s.dispatch_key for s in report.settlements} == DIAMOND_DISPATCH_KEYS
        env = {"declared": True, "layers": ["workspace"], "capabilities": {"fs": ["read"]}}
        present = rt.scheduler("run-environment-present", environment=env).run(plan, _ran)
        assert present.settlement("producer").dispatch_key != DIAMOND_DISPATCH_KEYS["producer"]


def test_an_upstream_edit_that_leaves_its_value_alone_stops_at_the_dependent(tmp_path: Path) -> None:
    def graph(seed: int) -> sp.plan.Plan:
        return sp.plan.compile_plan(
            "plan-1",
            "example/Build",
            [
                _draft("source", body={"seed": seed}),
                _draft("derived", inputs=[_ref(frm="source")]),
                _draft("sibling"),
                _draft("sibling-child", inputs=[sp.plan.Pending("sibling")]),
            ],
        )

    def tracking(ni: Any) -> Any:
        _ran(ni)
        return {"seed": ni.node.draft.material.body["seed"]} if ni.id == "source" else {"ran": ni.id}

    with sp.open_runtime(workspace=tmp_path) as rt:
        first = rt.scheduler("run-rekey-1").run(graph(1), _ran)
        assert set(first.outcomes.values()) == {"built"}
        second = rt.scheduler("run-rekey-2").run(graph(2), _ran)
        assert second.outcomes == {
            "source": "built",
            "derived": "clean",  # the early cutoff: its input VALUE did not change
            "sibling": "clean",
            "sibling-child": "clean",
        }
        rt.scheduler("run-value-1").run(graph(3), tracking)
        changed = rt.scheduler("run-value-2").run(graph(4), tracking)
        assert (changed.outcomes["source"], changed.outcomes["derived"]) == ("built", "built")


# ------------------------------------------------------------------------------ plan keys and digests


def _reference_digest(plan_id: str, flow: str, nodes: list[dict[str, Any]]) -> str:
    """The reference's plan digest document, written out from its definition."""
    return key(
        {
            "kind": "content",
            "body": {"kind": "plan", "planId": plan_id, "flow": flow},
            "inputs": {"nodes": {"kind": "literal", "value": nodes}},
            "layers": [],
            "capabilities": {},
        }
    )


def _node(
    nid: str, plan: sp.plan.Plan, depends_on: list[str], effects: dict[str, Any], **kw: Any
) -> dict[str, Any]:
    return {
        "id": nid,
        "kind": kw.get("kind", "step"),
        "key": plan.node(nid).key,
        "dependsOn": depends_on,
        "conflicts": kw.get("conflicts", []),
        "effects": effects,
        "priority": kw.get("priority", 0),
    }


_NO_EFFECTS = {"reads": [], "writes": [], "boundaryMode": "hard"}


def test_compile_orders_keys_and_digests_as_the_reference() -> None:
    plan = sp.plan.compile_plan(
        "plan-1",
        "example/Build",
        [
            sp.plan.node("late", body={"action": "late"}, inputs=[_ref(frm="early")]),
            sp.plan.node("early", body={"action": "early"}),
        ],
    )
    assert [n.id for n in plan.nodes] == ["early", "late"]
    assert plan.digest == plan.base_digest and plan.generation == 0
    early = plan_key(sp.plan.node("early", body={"action": "early"}), {})
    assert plan.node("early").key == early
    assert plan.digest == _reference_digest(
        "plan-1",
        "example/Build",
        [_node("early", plan, [], _NO_EFFECTS), _node("late", plan, ["early"], _NO_EFFECTS)],
    )


def test_the_digest_carries_effects_conflicts_kind_and_priority_as_the_reference_spells_them() -> None:
    plan = sp.plan.compile_plan(
        "plan-1",
        "example/Build",
        [
            sp.plan.node("first", body={"action": "first"}, writes=["out", "log"], reads=["src/a.py"]),
            sp.plan.node(
                "second",
                body={"action": "second"},
                writes=["out", sp.plan.TreeArtifact(path="dist")],
                removes=["stale"],
                reads=[sp.plan.Glob(include=["src/**"], exclude=["src/skip/**"])],
                kind="agent",
                priority=3,
                boundary="expected",
            ),
        ],
    )
    annotation = {"paths": ["out"], "strategy": "serialize", "runtime": "delay-rebase"}
    assert plan.digest == _reference_digest(
        "plan-1",
        "example/Build",
        [
            _node(
                "first",
                plan,
                [],
                {"reads": ["src/a.py"], "writes": ["out", "log"], "boundaryMode": "hard"},
                conflicts=[{"with": "second", **annotation}],
            ),
            _node(
                "second",
                plan,
                ["first"],
                {
                    "reads": [{"_tag": "Glob", "include": ["src/**"], "exclude": ["src/skip/**"]}],
                    "writes": ["out", {"_tag": "TreeArtifact", "path": "dist"}],
                    "removes": ["stale"],
                    "boundaryMode": "expected",
                },
                conflicts=[{"with": "first", **annotation}],
                kind="agent",
                priority=3,
            ),
        ],
    )


def test_a_leaf_edit_rekeys_its_dependent_cone_and_nothing_else() -> None:
    def graph(seed: int) -> sp.plan.Plan:
        return sp.plan.compile_plan(
            "plan-1",
            "example/Build",
            [
                sp.plan.node("source", body={"seed": seed}),
                sp.plan.node("derived", body={"action": "derived"}, inputs=[_ref(frm="source")]),
                sp.plan.node("sibling", body={"action": "sibling"}),
            ],
        )

    before, after = graph(1), graph(2)
    assert after.node("source").key != before.node("source").key
    assert after.node("derived").key != before.node("derived").key
    assert after.node("sibling").key == before.node("sibling").key
    assert after.digest != before.digest


def test_renaming_a_node_changes_no_key() -> None:
    left = sp.plan.compile_plan(
        "plan-1",
        "f",
        [
            sp.plan.node("a", body={"action": "a"}),
            sp.plan.node("b", body={"action": "b"}, inputs=[sp.plan.Pending("a")]),
        ],
    )
    right = sp.plan.compile_plan(
        "plan-1",
        "f",
        [
            sp.plan.node("renamed", body={"action": "a"}),
            sp.plan.node("b", body={"action": "b"}, inputs=[sp.plan.Pending("renamed")]),
        ],
    )
    assert right.node("b").key == left.node("b").key


def test_ordering_edges_and_file_effects_are_not_key_material() -> None:
    # serialize: the later writer keeps the key it has when nothing overlaps
    disjoint = sp.plan.compile_plan(
        "plan-1", "f", [_draft("first", writes=["out"]), _draft("second", writes=[])]
    )
    serialized = sp.plan.compile_plan(
        "plan-1", "f", [_draft("first", writes=["out", "log"]), _draft("second", writes=["out"])]
    )
    assert serialized.node("second").depends_on == ("first",)
    assert serialized.node("second").key == disjoint.node("second").key
    # reader after writer: neither node is re-keyed by the edge
    unrelated = sp.plan.compile_plan(
        "plan-1", "f", [_draft("writer", writes=["out"]), _draft("reader", writes=[], reads=["other"])]
    )
    ordered = sp.plan.compile_plan(
        "plan-1", "f", [_draft("writer", writes=["out"]), _draft("reader", writes=[], reads=["out"])]
    )
    assert ordered.node("reader").depends_on == ("writer",)
    assert ordered.node("reader").key == unrelated.node("reader").key
    assert ordered.node("writer").key == unrelated.node("writer").key
    assert ordered.digest != unrelated.digest  # the digest, which approvals bind to, does see both


def test_an_append_grows_the_digest_and_keeps_the_approved_base() -> None:
    base = sp.plan.compile_plan("plan-1", "f", [_draft("root", writes=["out"])])
    grown = sp.plan.append_plan(base, [_draft("child", writes=[], inputs=[_ref(frm="root")])])
    assert grown.nodes[0] == base.nodes[0]
    assert (grown.generation, grown.base_digest) == (1, base.base_digest)
    assert grown.digest != base.digest


def test_body_member_order_is_not_identity() -> None:
    a = sp.plan.node("node", body={"a": 1, "b": [1, "x", None]})
    b = sp.plan.node("node", body={"b": [1, "x", None], "a": 1})
    assert plan_key(a, {}) == plan_key(b, {})


# ------------------------------------------------------------------------------------ lease constants


def test_the_lease_constants_are_the_references() -> None:
    s = Settings()
    assert s.heartbeat_interval_s == 1.0
    assert s.stale_after_s == 30.0
    assert s.skew_allowance_s == 10.0
    # the write tolerance is derived in the reference: stale-after minus skew allowance minus one interval
    assert (
        s.heartbeat_failure_interrupt_s
        == s.stale_after_s - s.skew_allowance_s - s.heartbeat_interval_s
        == 19.0
    )


# ---------------------------------------------------------------------- deliberate differences, shown


def test_approval_wait_and_an_explicit_nondeterministic_false_enter_the_body_only_when_declared() -> None:
    assert plan_key(_material(), {}) == PLAN_KEY_GOLDEN  # none declared: the reference's key
    declared = {
        plan_key(_material(nondeterministic=False), {}),
        plan_key(_material(approval={"request": "ship"}), {}),
        plan_key(_material(wait={"seconds": 1}), {}),
    }
    assert len(declared) == 3 and PLAN_KEY_GOLDEN not in declared


def test_capability_groups_beside_declared_are_folded_and_a_list_is_the_declared_group() -> None:
    as_list = plan_key(_material(capabilities=["deploy:prod"]), {})
    assert as_list == plan_key(_material(capabilities={"declared": ["deploy:prod"]}), {})
    assert as_list != plan_key(_material(capabilities={"deploy": ["prod"]}), {})
    assert plan_key(_material(capabilities=[]), {}) == PLAN_KEY_GOLDEN  # {declared: []}, as the reference


def test_an_environment_not_in_the_references_shape_is_folded_as_given() -> None:
    d = _material(body=1)
    env = {"python": "3.12", "layers": ["b", "a"]}
    assert dispatch_key(d, ref_values={}, read_set=[], environment=env) == key(
        {
            "kind": "content",
            "body": {"version": VERSION, "declaration": 1},
            "inputs": {},
            "layers": [],
            "capabilities": {"declared": []},
            "environment": env,
            "hermetic": {"readSet": [], "writeSet": [], "boundaryMode": "hard"},
        }
    )


def test_an_empty_removal_set_is_no_removal_set_and_declarations_are_normalised_spellings() -> None:
    # The reference keys `removes: []` apart from no `removes`; one Effects here cannot tell them apart.
    assert _dispatch(removes=[]) == _dispatch() == DISPATCH_KEY_GOLDEN
    plan = sp.plan.compile_plan("p", "f", [_draft("n", writes=["dist/", "src/*.py", "a\\b", "a/b"])])
    assert plan.digest == _reference_digest(
        "p",
        "f",
        [
            _node(
                "n",
                plan,
                [],
                {
                    "reads": [],
                    "writes": [
                        {"_tag": "TreeArtifact", "path": "dist"},
                        {"_tag": "Glob", "include": ["src/*.py"]},
                        "a/b",
                    ],
                    "boundaryMode": "hard",
                },
            )
        ],
    )


def test_projection_reads_array_elements_by_index_but_no_runtime_property() -> None:
    value = {"items": ["x", {"k": 1}], "o": {}}
    assert project(value, ["items", "1", "k"]) == 1  # as the reference: an array element by its index
    for path in (
        ["items", "length"],
        ["items", "01"],
        ["items", "2"],
        ["o", "constructor"],
        ["o", "__proto__"],
    ):
        assert project(value, path) is ABSENT  # the reference reads a JavaScript property here


def test_a_priority_beyond_the_safe_range_enters_the_digest_as_its_decimal_string() -> None:
    big = 2**53
    plan = sp.plan.compile_plan("p", "f", [_draft("n", writes=[], priority=big)])
    assert plan.digest == _reference_digest("p", "f", [_node("n", plan, [], _NO_EFFECTS, priority=str(big))])


# ------------------------------------------------------------------------------------------------ tally

#: Per group: (taken, identical, deliberately different, not applicable).
_GROUPS = {
    "key goldens": (5, 1, 1, 3),  # content ✓; ordinal ≠; graph/root, graph/root.all.read, .review n/a
    # 32 step-key tests: ≠ non-content material (plan key), missing_dependency's code; n/a untagged digest input,
    # opaque material effects/placement, in-flight memo eviction
    "step-key suite": (32, 27, 2, 3),
    "plan-scheduler suite": (4, 4, 0, 0),  # diamond, environment, early cutoff, value change
    "plan suite": (
        7,
        7,
        0,
        0,
    ),  # topological order/digest, cone, rename, serialize, reader, append, body order
    "lease constants": (4, 4, 0, 0),
}


def test_the_vector_tally_is_as_reported() -> None:
    totals = [sum(g[i] for g in _GROUPS.values()) for i in range(4)]
    assert totals == [
        TALLY["taken"],
        TALLY["identical"],
        TALLY["deliberately different"],
        TALLY["not applicable"],
    ]
    for name, (taken, *parts) in _GROUPS.items():
        assert sum(parts) == taken, name
