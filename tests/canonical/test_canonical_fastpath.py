"""canonical.py's stdlib fast path: byte-identical to ``rfc8785`` on every value it takes, and never taken for the
values where the two encoders differ (integral and exponent-form floats, object keys outside the BMP)."""

from __future__ import annotations

import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from smthrs_plugin import canonical
from smthrs_plugin.canonical import canonical_bytes

# Characters where JSON encoders are known to disagree: C0 controls (short and \u00xx escapes), quote, backslash,
# DEL, the JS line separators, the top of the BMP (E000..FFFF sorts after surrogates in UTF-16) and non-BMP.
_EDGES = '\x00\x01\x08\x09\x0a\x0b\x0c\x0d\x1f\x20"\\/\x7f\x80\u00e9\u2028\u2029\ud7ff\ue000\ufb33\uffff'
_ANY = st.characters(blacklist_categories=("Cs",))  # every code point except lone surrogates
_BMP = st.characters(blacklist_categories=("Cs",), max_codepoint=0xFFFF)


def _text(chars: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.text(st.one_of(st.sampled_from(_EDGES), chars), max_size=8)


_ints = st.integers(-(2**53 - 1), 2**53 - 1)
_values_text = _text(st.one_of(_ANY, st.sampled_from("\U00010000\U0001f600\U0010ffff")))
_plain_scalars = st.one_of(st.none(), st.booleans(), _ints, _values_text)


def _json(scalars: st.SearchStrategy[object], keys: st.SearchStrategy[str]) -> st.SearchStrategy[object]:
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=5),
            st.lists(inner, max_size=5).map(tuple),
            st.dictionaries(keys, inner, max_size=6),
        ),
        max_leaves=30,
    )


plain_values = _json(_plain_scalars, _text(_BMP))
any_values = _json(
    st.one_of(_plain_scalars, st.floats(allow_nan=False, allow_infinity=False)),
    _text(st.one_of(_ANY, st.sampled_from("\U00010000\U0001f600\U0010ffff"))),
)


# The suite's profile derandomizes: these are fixed examples. 600 each reach every edge character and container
# shape many times over; 1,500 cost ~19 s of a loaded suite for no new case.
@settings(max_examples=600)
@given(plain_values)
def test_plain_values_take_the_fast_path_and_match_rfc8785_byte_for_byte(value: object) -> None:
    assert canonical._check(value) is True
    assert canonical_bytes(value) == rfc8785.dumps(value)


@settings(max_examples=600)
@given(any_values)
def test_every_value_matches_rfc8785_byte_for_byte_whichever_path_it_takes(value: object) -> None:
    assert canonical_bytes(value) == rfc8785.dumps(value)


def test_integral_and_exponent_floats_and_non_bmp_keys_are_never_on_the_fast_path() -> None:
    assert canonical._check([1.0]) is False
    assert canonical._check([0.0]) is False and canonical._check([-0.0]) is False
    assert canonical._check({"a": [1, 2.5, 1e16]}) is False
    assert canonical._check([0.00001]) is False and canonical._check([1e-7]) is False
    assert canonical._check({"\U0001f600": 1}) is False
    assert canonical._check({"x": {"\ufb33": "\U0001f600"}}) is True  # non-BMP VALUES are fine
    # The two cases where the stdlib encoder would be wrong, served right:
    assert canonical_bytes([1.0, 1e21]) == b"[1,1e+21]"
    assert canonical_bytes({"\ufb33": 1, "\U0001f600": 2}) == '{"\U0001f600":2,"\ufb33":1}'.encode()
    assert canonical_bytes([-0.0, 1e16, 0.00001]) == b"[0,10000000000000000,0.00001]"


_exact_floats = st.floats(allow_nan=False, allow_infinity=False).filter(
    lambda f: "e" not in repr(f) and not repr(f).endswith(".0")
)


@settings(max_examples=600)
@given(_json(st.one_of(_plain_scalars, _exact_floats), _text(_BMP)))
def test_floats_printed_alike_by_repr_and_ecmascript_take_the_fast_path_byte_for_byte(value: object) -> None:
    assert canonical._check(value) is True
    assert canonical_bytes(value) == rfc8785.dumps(value)


def test_a_rounded_duration_takes_the_fast_path() -> None:
    payload = {"ms": 12.345, "execute_ms": 0.125, "neg": -3.5, "tiny": 0.0001}
    assert canonical._check(payload) is True
    assert canonical_bytes(payload) == rfc8785.dumps(payload)
