"""The one decoder for JSON this process did not write: every hostile document is a typed refusal, in bounded
memory; every honest one decodes to what ``json`` would give."""

from __future__ import annotations

import json
import resource
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smthrs_plugin._untrusted import MAX_INT_DIGITS, MAX_JSON_DEPTH, decode_json
from smthrs_plugin.errors import InvalidInput


def bound_of(data: Any, **kw: Any) -> str:
    with pytest.raises(InvalidInput) as err:
        decode_json(data, "the document", **kw)
    assert "the document" in err.value.message
    return str(err.value.details["bound"])


@pytest.mark.parametrize(
    ("data", "bound"),
    [
        (b"[" * 200_000 + b"]" * 200_000, "depth"),  # the planted 200 KB array: not a RecursionError
        (b"{" + b'"a":{' * 150 + b"}" * 151, "depth"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "depth"),
        (b'{"ident": "A", "ident": "B"}', "duplicate_member"),
        (b"1" * 5000, "number"),  # past int()'s own digit limit: not a ValueError traceback
        (b"-" + b"9" * (MAX_INT_DIGITS + 1), "number"),
        (b"1e999", "number"),
        (b"[NaN]", "number"),
        (b"-Infinity", "number"),
        (b'"\xff"', "well_formed_text"),
        (b'"\\ud800"', "well_formed_text"),
        (b'{"\\udc00": 1}', "well_formed_text"),
        ("\ud800", "well_formed_text"),
        (b"[1, 2", "plain_data"),
        (b"", "plain_data"),
        (b"{} {}", "plain_data"),
    ],
)
def test_a_hostile_document_is_a_typed_refusal(data: Any, bound: str) -> None:
    assert bound_of(data) == bound


def test_a_document_over_the_cap_is_refused_by_its_length_before_parsing() -> None:
    assert bound_of(b"[" + b"1," * 600 + b"1]", max_bytes=1000) == "canonical_bytes"
    assert bound_of("x" * 1001, max_bytes=1000) == "canonical_bytes"


def test_the_deepest_allowed_document_decodes() -> None:
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert decode_json(deepest, "d") == json.loads(deepest)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_an_honest_document_decodes_as_json_does(value: Any) -> None:
    text = json.dumps(value)
    assert decode_json(text.encode(), "d") == json.loads(text)


hostile_pieces = st.sampled_from(
    [b"[", b"]", b"{", b"}", b'"a":', b",", b"1", b"9" * 200, b"1e999", b"NaN", b'"\\ud800"', b"\xff", b"\xc3",
     b'"x"', b"null", b" ", b"-", b".5", b"\\", b'"']
)  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile_pieces, max_size=60).map(b"".join), st.binary(max_size=64))
def test_random_and_adversarial_bytes_give_a_value_or_a_typed_refusal(pieces: bytes, noise: bytes) -> None:
    for data in (pieces, noise, pieces + noise, b"[" * 500 + pieces):
        try:
            decode_json(data, "d")
        except InvalidInput as exc:
            assert exc.details["bound"] in {
                "depth", "duplicate_member", "number", "well_formed_text", "plain_data", "canonical_bytes", "values"
            }  # fmt: skip


def test_wide_and_deep_documents_stay_within_a_bounded_memory() -> None:
    # The cap bounds what a document can cost: the largest admissible document of tiny containers, parsed.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert bound_of(b"[" + b"[]," * (4 * 1024 * 1024 // 3 - 2) + b"[]]") == "values"  # 1.4 M containers
    wide = b"[" + b"[]," * (4 * 1024 * 1024 // 8 - 2) + b"[]]"
    decode_json(wide, "wide")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 512 * 1024  # far below the 800 MB document that killed a 1.5 GB reader


hostile_documents = st.one_of(
    st.lists(hostile_pieces, max_size=60).map(b"".join),
    st.binary(max_size=64),
    st.integers(min_value=1, max_value=3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(min_value=101, max_value=6000).map(lambda n: b'{"a": ' + b"9" * n + b"}"),
    st.sampled_from([b'{"ident": "A", "ident": "B"}', b'{"x": 1e999}', b'"\\udc00"', b"\xfe\xff"]),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_documents)
def test_every_consumer_of_untrusted_json_answers_typed(data: bytes) -> None:
    """The shared tier's entry check, the revocation marker decoder, the JSON-RPC request parser and the worker's
    ``--param`` all take the one decoder's answer: a value, or a typed refusal — never an exception of Python's."""
    from smthrs_plugin.cache.revocation import _decode
    from smthrs_plugin.cache.shared import Candidate, Refusal, check_document
    from smthrs_plugin.cli.worker import _parse_params
    from smthrs_plugin.errors import SmthrsError
    from smthrs_plugin.serve.rpc import RpcFailure, parse_call

    name = "0" * 64
    assert isinstance(check_document(f"{name}.abcdef0123456789", data, None), (Candidate, Refusal))
    marker = _decode(f"{name}.0123456789abcdef", data)
    assert marker.problem is not None or marker.key is not None
    try:
        parse_call(data)
    except RpcFailure:
        pass
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    try:
        _parse_params([f"p={text}"])
    except SmthrsError:
        pass
