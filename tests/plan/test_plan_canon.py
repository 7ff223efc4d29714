"""_canon writes the same canonical text as the generic reference path, or declines: a differential test.

The plan key, the plan digest and the dispatch key are computed by composition (``plan/_canon.py``) with the generic
``canonical.key`` walk kept as the reference (``keys._plan_key_reference``, ``compile._plan_digest_reference``,
``keys._dispatch_key_reference``).
Every generated declaration must key identically on both paths, and a declaration the reference refuses must be
refused by the public function with the reference's exact error.
"""

from __future__ import annotations

import random
from typing import Any

import golden_plans
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import smthrs_plugin as sp
from smthrs_plugin.canonical import MAX_DEPTH
from smthrs_plugin.errors import SmthrsError
from smthrs_plugin.plan import _canon, keys
from smthrs_plugin.plan.compile import _plan_digest_reference, plan_digest
from smthrs_plugin.plan.keys import ABSENT, _plan_key_reference, dispatch_key, plan_key

_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=6)  # includes lone surrogates
_keys = st.one_of(_text, st.sampled_from(["a", "é", "𝔸", "\ue000", "\uffff", "10", "2"]))
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**60), max_value=2**60),
    st.floats(allow_nan=True, allow_infinity=True),
    _text,
)
_json = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(_keys, inner, max_size=3),
        st.dictionaries(st.integers(0, 3), inner, max_size=1),  # non-str keys: refused
    ),
    max_leaves=8,
)


def _with(draft: sp.plan.NodeDraft, **material: Any) -> sp.plan.NodeDraft:
    """``draft`` with key material replaced *without* validation: what a hostile or buggy caller could build."""
    return draft.model_copy(update={"material": draft.material.model_copy(update=material)})


def _same(public: Any, reference: Any, composed: Any) -> None:
    """The public function returns what the reference returns, or raises its exact refusal (type, code,
    message); and whenever the reference succeeds, the composed writer alone (no fallback) produced it."""
    try:
        want = reference()
    except SmthrsError as exc:
        with pytest.raises(type(exc)) as got:
            public()
        assert (got.value.code, got.value.message) == (exc.code, exc.message)
        return
    assert public() == want
    assert composed() == want


def _key(draft: sp.plan.NodeDraft, up: dict[str, str]) -> None:
    _same(
        lambda: plan_key(draft, up),
        lambda: _plan_key_reference(draft, up),
        lambda: _canon.plan_key(draft, up, {}),
    )


_UP = {"up": "key1_" + "a" * 64, "other": "key1_" + "b" * 64}
_INPUTS = [
    sp.plan.Pending("up"),
    sp.plan.Ref("other"),
    sp.plan.Ref("up", path=["value", "é"]),
    sp.plan.Value(1),
]
_BASE = sp.plan.node(
    "n",
    inputs=_INPUTS,
    writes=["out/", "src/**/*.py"],
    reads=["src/a.py", "docs/"],
)


@settings(max_examples=400, deadline=None)
@given(body=_json, literal=_json, approval=st.one_of(st.none(), st.dictionaries(_keys, _json, max_size=2)))
def test_plan_key_equals_the_reference_for_any_body_literal_and_spec(
    body: Any, literal: Any, approval: Any
) -> None:
    inputs = (*_BASE.material.inputs, sp.plan.Value.model_construct(value=literal))
    draft = _with(_BASE, body=body, inputs=inputs).model_copy(update={"approval": approval})
    _key(draft, _UP)


@settings(max_examples=200, deadline=None)
@given(
    layers=st.lists(_text, max_size=4),
    caps=st.dictionaries(_keys, st.lists(_text, max_size=3), max_size=3),
    path=st.lists(_text, max_size=3),
    nondeterministic=st.one_of(st.none(), st.booleans(), st.integers()),
)
def test_plan_key_equals_the_reference_for_any_layers_capabilities_and_paths(
    layers: list[str], caps: dict[str, list[str]], path: list[str], nondeterministic: Any
) -> None:
    inputs = (
        sp.plan.Ref.model_construct(from_="up", path=tuple(path)),
    ) * 12  # > 10 inputs: "10" sorts before "2"
    draft = _with(
        _BASE,
        layers=tuple(layers),
        capabilities={g: tuple(p) for g, p in caps.items()},
        inputs=inputs,
        nondeterministic=nondeterministic,
    )
    _key(draft, _UP)


@pytest.mark.parametrize("extra", [-3, -2, -1, 0, 1])
def test_the_depth_limit_counts_where_the_value_sits_in_the_whole_document(extra: int) -> None:
    # a body sits 2 containers deep in the key document, a literal value 3: the limit must bite at the same depth
    for depth_in_doc, make in (
        (2, lambda v: _with(_BASE, body=v)),
        (3, lambda v: _with(_BASE, inputs=(sp.plan.Value.model_construct(value=v),))),
    ):
        value: Any = 0
        for _ in range(MAX_DEPTH - depth_in_doc + extra):
            value = [value]
        draft = make(value)
        _key(draft, _UP)


def test_a_missing_upstream_key_is_the_reference_refusal() -> None:
    _key(_BASE, {"up": _UP["up"]})


@pytest.mark.parametrize("seed", range(0, 240, 4))
def test_plan_digest_equals_the_reference_on_generated_plans(seed: int) -> None:
    for plan in golden_plans._plan_generations(random.Random(seed), seed):
        assert plan.digest == _plan_digest_reference(plan.plan_id, plan.flow, plan.nodes)
        for flow in ("é/𝔸", "bad\ud800", 'q"\\\n'):
            _same(
                lambda f=flow, p=plan: plan_digest(p.plan_id, f, p.nodes),
                lambda f=flow, p=plan: _plan_digest_reference(p.plan_id, f, p.nodes),
                lambda f=flow, p=plan: _canon.digest(
                    p.plan_id,
                    f,
                    [_canon.digest_node(n, _canon.effects(n.effects), {}, None) for n in p.nodes],
                ),
            )


def test_effects_text_equals_the_canonical_effects_json() -> None:
    from smthrs_plugin.canonical import canonical_bytes
    from smthrs_plugin.plan.keys import effects_json

    rng = random.Random(7)
    for _ in range(300):
        reads = golden_plans._entries(rng, golden_plans._READS, 4)
        writes = golden_plans._entries(rng, golden_plans._PRODUCED, 3)
        effects = sp.plan.node(
            "e", reads=reads, writes=writes, boundary=rng.choice(["hard", "expected"])
        ).effects
        assert _canon.effects(effects) == canonical_bytes(effects_json(effects)).decode("utf-8")


def test_exact_file_entries_keep_their_declared_order_and_duplicates_as_the_reference_path_does() -> None:
    # The digest's node effects are the declaration as made (declaration order; the duplicates a bypassing
    # caller could plant stay): '"', control characters and non-ASCII escape, and must not reorder anything
    from smthrs_plugin.canonical import canonical_bytes
    from smthrs_plugin.plan.keys import effects_json

    names = ["a", 'a"', "a#", "a\x01", "a\x1f", "a ", "é", "a/é", "a\u2028", "𝔸", "A", "a]", "ab"]
    rng = random.Random(11)
    for _ in range(300):
        picked = tuple(rng.sample(names, rng.randint(1, 6)))
        picked += tuple(
            rng.sample(picked, rng.randint(0, min(2, len(picked))))
        )  # duplicates, as a bypassing caller could
        effects = sp.plan.node("e").effects.model_copy(update={"reads": picked, "writes": picked[:1]})
        assert _canon.effects(effects) == canonical_bytes(effects_json(effects)).decode("utf-8")
    lone = sp.plan.node("e").effects.model_copy(update={"reads": ("a\ud800", "b")})
    with pytest.raises(_canon.Slow):
        _canon.effects(lone)


# -- the dispatch key ----------------------------------------------------------------------------------------------
# ``keys.dispatch_key`` composes its text from parts (the draft's body, capabilities and layers text its plan key
# wrote last, when there is one), with ``keys._dispatch_key_reference`` as the reference.

_paths = st.sampled_from(["a.txt", "src/é.py", "b", "b/../c", "../x", "/abs", "x\ud800", "e\u0301", "z"])
_read_sets = st.lists(st.tuples(_paths, st.sampled_from(["h1", "h2", "", "absent", "é"])), max_size=4)
_environments = st.one_of(
    st.just(ABSENT),
    _json,
    st.fixed_dictionaries(
        {
            "declared": st.booleans(),
            "layers": st.lists(st.sampled_from(["py", "e\u0301", "a"]), max_size=3),
            "capabilities": st.dictionaries(_keys, st.lists(_text, max_size=2), max_size=2),
        }
    ),
)

_DISPATCH_BASE = sp.plan.node(
    "n",
    inputs=_INPUTS,
    writes=["out/", "src/**/*.py", 'a"b'],
    removes=["gone.txt", "old/"],
    reads=["src/a.py", "docs/"],
)


def _composed(draft: sp.plan.NodeDraft, refs: dict[int, Any], read_set: Any, environment: Any) -> str:
    """The composed writer alone, given the parts as ``keys.dispatch_key`` computes them (no fallback)."""
    e = draft.effects
    env = None if environment is ABSENT else _canon.value(keys.environment_json(environment), 1)
    return _canon.dispatch_key(
        draft,
        keys._ref_digests(draft, refs, None),
        env,
        e.boundary_mode,
        keys._read_pairs(read_set),
        keys._removes(e.removes),
        keys._write_set(e.writes),
    )


def _same_dispatch(draft: sp.plan.NodeDraft, refs: dict[int, Any], read_set: Any, environment: Any) -> None:
    _same(
        lambda: dispatch_key(draft, ref_values=refs, read_set=iter(read_set), environment=environment),
        lambda: keys._dispatch_key_reference(
            draft,
            keys._ref_digests(draft, refs, None),
            read_set,
            environment,
            writes=None,
            removes=None,
            boundary_mode=None,
        ),
        lambda: _composed(draft, refs, read_set, environment),
    )


@settings(max_examples=300, deadline=None)
@given(
    body=_json,
    literal=_json,
    approval=st.one_of(st.none(), st.dictionaries(_keys, _json, max_size=2)),
    ref=_json,
    read_set=_read_sets,
    environment=_environments,
    planned=st.booleans(),
)
def test_the_composed_dispatch_key_equals_the_reference(
    body: Any, literal: Any, approval: Any, ref: Any, read_set: Any, environment: Any, planned: bool
) -> None:
    inputs = (*_DISPATCH_BASE.material.inputs, sp.plan.Value.model_construct(value=literal))
    draft = _with(_DISPATCH_BASE, body=body, inputs=inputs).model_copy(update={"approval": approval})
    if planned:
        try:  # the plan key writes (and remembers) the body text the dispatch key then reuses
            _canon.plan_key(draft, _UP, {})
        except Exception:  # noqa: BLE001 - declined (Slow) or refused: keys.plan_key then takes the reference path
            pass
    _same_dispatch(draft, {1: ref, 2: {"é": ref}}, read_set, environment)


@settings(max_examples=100, deadline=None)
@given(
    layers=st.lists(_text, max_size=4),
    caps=st.dictionaries(_keys, st.lists(_text, max_size=3), max_size=3),
    path=st.lists(_text, max_size=3),
)
def test_the_composed_dispatch_key_equals_the_reference_for_layers_capabilities_and_paths(
    layers: list[str], caps: dict[str, list[str]], path: list[str]
) -> None:
    inputs = (sp.plan.Ref.model_construct(from_="up", path=tuple(path)),) * 12  # "10" sorts before "2"
    draft = _with(
        _DISPATCH_BASE,
        layers=tuple(layers),
        capabilities={g: tuple(p) for g, p in caps.items()},
        inputs=inputs,
    )
    _same_dispatch(draft, {i: {"x": i} for i in range(12)}, [("a", "h")], ABSENT)


def test_a_verified_node_keys_from_the_body_text_its_plan_key_wrote() -> None:
    plan = sp.plan.compile_plan(
        "p", "f", [sp.plan.node("a", body={"cmd": "é"}), sp.plan.node("b", body=[1.5])]
    )
    # compile alone remembers nothing (every run verifies its plan first); verify_plan remembers every draft.
    assert all(id(node.draft) not in _canon._STATIC for node in plan.nodes)
    sp.plan.verify_plan(plan)
    for node in plan.nodes:
        assert id(node.draft) in _canon._STATIC
        _same_dispatch(node.draft, {}, [("x", "h")], {"declared": True, "layers": [], "capabilities": {}})


def test_a_node_keyed_without_its_remembered_texts_gets_the_same_dispatch_key() -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body={"cmd": "é", "n": [1, 2.5]})])
    draft = plan.nodes[0].draft
    cold = dispatch_key(draft, ref_values={}, read_set=[("x", "h")])
    sp.plan.verify_plan(plan)
    assert id(draft) in _canon._STATIC
    assert dispatch_key(draft, ref_values={}, read_set=[("x", "h")]) == cold
