"""The dispatch key written by composition (``plan/_canon.dispatch_key``) equals the generic reference path.

``keys.dispatch_key`` composes the key text from its parts (the draft's body, capabilities and layers text that
its plan key wrote last, when there is one) and keeps the whole-document ``canonical.key`` walk as the reference
(``keys._dispatch_key_reference``). Every generated declaration, read set, Ref value and environment must key
identically on both paths, and whatever the reference refuses the public function refuses with the reference's
exact error.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import smthrs_plugin as sp
from smthrs_plugin.errors import SmthrsError
from smthrs_plugin.plan import _canon, keys
from smthrs_plugin.plan.keys import ABSENT, dispatch_key

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
        st.dictionaries(_keys, inner, max_size=3),
        st.dictionaries(st.integers(0, 3), inner, max_size=1),  # non-str keys: refused
    ),
    max_leaves=8,
)
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

_BASE = sp.plan.node(
    "n",
    inputs=[
        sp.plan.Pending("up"),
        sp.plan.Ref("other"),
        sp.plan.Ref("up", path=["value", "é"]),
        sp.plan.Value(1),
    ],
    writes=["out/", "src/**/*.py", "a\"b"],
    removes=["gone.txt", "old/"],
    reads=["src/a.py", "docs/"],
)
_UP = {"up": "key1_" + "a" * 64, "other": "key1_" + "b" * 64}


def _with(draft: sp.plan.NodeDraft, **material: Any) -> sp.plan.NodeDraft:
    """``draft`` with key material replaced *without* validation: what a hostile or buggy caller could build."""
    return draft.model_copy(update={"material": draft.material.model_copy(update=material)})


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


def _same(draft: sp.plan.NodeDraft, refs: dict[int, Any], read_set: Any, environment: Any) -> None:
    def reference() -> str:
        digests = keys._ref_digests(draft, refs, None)
        return keys._dispatch_key_reference(
            draft, digests, read_set, environment, writes=None, removes=None, boundary_mode=None
        )

    def public() -> str:
        return dispatch_key(draft, ref_values=refs, read_set=iter(read_set), environment=environment)

    try:
        want = reference()
    except SmthrsError as exc:
        with pytest.raises(type(exc)) as got:
            public()
        assert (got.value.code, got.value.message) == (exc.code, exc.message)
        return
    assert public() == want
    assert _composed(draft, refs, read_set, environment) == want


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
    inputs = (*_BASE.material.inputs, sp.plan.Value.model_construct(value=literal))
    draft = _with(_BASE, body=body, inputs=inputs).model_copy(update={"approval": approval})
    if planned:
        try:  # the plan key writes (and remembers) the body text the dispatch key then reuses
            _canon.plan_key(draft, _UP, {})
        except Exception:  # noqa: BLE001 - declined (Slow) or refused: keys.plan_key then takes the reference path
            pass
    _same(draft, {1: ref, 2: {"é": ref}}, read_set, environment)


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
    draft = _with(_BASE, layers=tuple(layers), capabilities={g: tuple(p) for g, p in caps.items()}, inputs=inputs)
    _same(draft, {i: {"x": i} for i in range(12)}, [("a", "h")], ABSENT)


def test_a_compiled_node_keys_from_the_body_text_its_plan_key_wrote() -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body={"cmd": "é"}), sp.plan.node("b", body=[1.5])])
    for node in plan.nodes:
        assert id(node.draft) in _canon._STATIC  # remembered by compile
        _same(node.draft, {}, [("x", "h")], {"declared": True, "layers": [], "capabilities": {}})
