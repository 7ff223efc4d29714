"""canonical.py: RFC 8785 vectors, typed refusals, determinism and key injectivity."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smthrs_plugin.canonical import canonical_bytes, is_key, key, key_digest
from smthrs_plugin.errors import CanonicalError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.0, b"1"),
        (1e21, b"1e+21"),
        (-0.0, b"0"),
        (5e-7, b"5e-7"),
        (1e-7, b"1e-7"),
        (123456789012.0, b"123456789012"),
        ({"b": 1, "a": 2}, b'{"a":2,"b":1}'),
        ([None, True, False], b"[null,true,false]"),
        ("\u20ac$\u000f\nA'B\"\\\\\"/", b'"\xe2\x82\xac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"'),
    ],
)
def test_rfc8785_vectors(value: object, expected: bytes) -> None:
    assert canonical_bytes(value) == expected


def test_member_order_is_by_utf16_code_units_including_non_bmp_keys() -> None:
    # U+1F600 is the surrogate pair D83D DE00 in UTF-16, which sorts *before* U+FB33 (FB33 > D83D),
    # although its code point is larger. Sorting by code point would put it last.
    value = {"\ufb33": 1, "\U0001f600": 2, "a": 3}
    out = canonical_bytes(value).decode("utf-8")
    assert list(json.loads(out)) == ["a", "\U0001f600", "\ufb33"]


@pytest.mark.parametrize(
    "bad",
    [
        math.nan,
        math.inf,
        -math.inf,
        {1: "x"},
        b"bytes",
        "\ud800",
        {"\udfff": 1},
        2**53,
        object(),
        {1.5},
    ],
)
def test_values_without_canonical_form_raise_typed_error(bad: object) -> None:
    with pytest.raises(CanonicalError) as exc:
        key(bad)
    assert exc.value.code == "not_canonicalizable"


def test_cycles_are_refused_but_shared_subtrees_are_fine() -> None:
    shared = {"x": [1, 2]}
    assert key({"a": shared, "b": shared}) == key({"a": {"x": [1, 2]}, "b": {"x": [1, 2]}})
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(CanonicalError):
        key(loop)


def test_subclasses_are_not_silently_coerced() -> None:
    class Name(str):
        pass

    with pytest.raises(CanonicalError):
        key(Name("a"))


def test_absent_member_hashes_differently_from_null() -> None:
    assert key({"a": 1}) != key({"a": 1, "b": None})


def test_bool_and_int_are_distinct() -> None:
    assert key(True) != key(1)


def test_key_shape_and_key_digest() -> None:
    k = key({"a": 1})
    assert is_key(k) and k.startswith("key1_")
    d = key_digest(k)
    assert len(d) == 64 and d != k[5:]
    with pytest.raises(CanonicalError):
        key_digest("nope")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53 - 1), max_value=2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@given(json_values)
def test_canonicalisation_is_deterministic_and_round_trips(value: object) -> None:
    first = canonical_bytes(value)
    # A float >= 2**53 prints as an integer literal; read such literals back as floats (their JSON meaning).
    parsed = json.loads(first, parse_int=lambda s: int(s) if abs(int(s)) < 2**53 else float(s))
    assert canonical_bytes(parsed) == first
    assert key(value) == key(parsed)


@given(json_values, json_values)
def test_key_is_injective_on_distinct_canonical_forms(a: object, b: object) -> None:
    if canonical_bytes(a) != canonical_bytes(b):
        assert key(a) != key(b)
    else:
        assert key(a) == key(b)


def test_concatenation_ambiguity_does_not_collide() -> None:
    assert key(["ab", "c"]) != key(["a", "bc"])
    assert key({"a": "bc"}) != key({"ab": "c"})
