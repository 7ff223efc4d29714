"""The ``key1_`` primitive's canonical JSON against the reference implementation's canonical-JSON suite.

Every vector below is one of the reference's (its canonical serializer's test suite: schema round trip, arrays,
objects, primitives, non-finite numbers, Unicode, toJSON, boxed primitives, host objects, prototype names,
recursion depth, normalisation, cycles, the RFC 8785 fixtures, numeric, string and collection boundaries,
unsupported values, repeated references), rewritten as Python data. A JavaScript member name is a string, so
``{42: "foo"}`` is ``{"42": "foo"}`` here, and a JavaScript number with no fraction that is not a safe integer
is a Python float.

Tally (``TALLY``, kept honest by ``test_the_vector_tally_is_as_reported``):

- taken: 97 — every row of every test of that suite.
- identical: 73 — the same bytes, or a typed refusal (``CanonicalError(not_canonicalizable)``) where the
  reference refuses.
- deliberately different: 15 — JavaScript's ``toJSON`` door, boxed primitives, ``Date``, typed arrays,
  ``Map``/``Set``, a null-prototype object and a function inside an array are turned into JSON (often lossily: a
  ``Map`` becomes ``{}``) by the reference; here anything that is not exactly a JSON type (dict, list, str, int,
  float, bool, None) is refused, so no two different values can silently share a key
  (``test_non_json_objects_are_refused_where_the_reference_converts_them``).
- not applicable: 9 — ``undefined``, symbols and sparse arrays have no Python value.

The depth at which nesting is refused differs in kind, not in outcome: the reference fails when the host stack
runs out (its own suite calls that depth unspecified); here anything deeper than ``MAX_DEPTH`` (256) is refused.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from datetime import datetime, timezone
from types import MappingProxyType

import pytest

from smthrs_plugin.canonical import MAX_DEPTH, canonical_bytes, key
from smthrs_plugin.errors import CanonicalError

TALLY = {"taken": 97, "identical": 73, "deliberately different": 15, "not applicable": 9}


def _text(value: object) -> str:
    return canonical_bytes(value).decode("utf-8")


def _refused(value: object) -> None:
    with pytest.raises(CanonicalError) as exc:
        key(value)
    assert exc.value.code == "not_canonicalizable"


# --------------------------------------------------------------------------------------- identical bytes

SERIALIZED = [
    # schema round trip
    ("canonicalizes through decoding", {"b": 2, "a": 1}, '{"a":1,"b":2}'),
    # arrays
    ("empty array", [], "[]"),
    ("one element array", [123], "[123]"),
    ("multiple element array", [123, 456, "hello"], '[123,456,"hello"]'),
    ("object in array", [{"b": 123, "a": "string"}], '[{"a":"string","b":123}]'),
    # objects
    ("empty object", {}, "{}"),
    ("null value", {"test": None}, '{"test":null}'),
    ("one property", {"hello": "world"}, '{"hello":"world"}'),
    ("multiple properties", {"hello": "world", "number": 123}, '{"hello":"world","number":123}'),
    ("numeric key", {"42": "foo"}, '{"42":"foo"}'),
    # primitives
    ("null", None, "null"),
    # Unicode
    ("a valid surrogate pair", {"key": "\U0001f600"}, '{"key":"\U0001f600"}'),
    # prototype-pollution member names are ordinary names
    ("__proto__", {"__proto__": 1}, '{"__proto__":1}'),
    (
        "__proto__, constructor and prototype",
        {"__proto__": 1, "constructor": 2, "prototype": 3},
        '{"__proto__":1,"constructor":2,"prototype":3}',
    ),
    # normalisation: none, member order by UTF-16 code unit
    ("NFC and NFD keys in one object", {"\u00e9": 1, "e\u0301": 2}, '{"e\u0301":2,"\u00e9":1}'),
    # the RFC 8785 fixtures
    ("arrays fixture", [56, {"d": True, "10": None, "1": []}], '[56,{"1":[],"10":null,"d":true}]'),
    (
        "French sorting fixture",
        {
            "peach": "This sorting order",
            "péché": "is wrong according to French",
            "pêche": "but canonicalization MUST",
            "sin": "ignore locale",
        },
        '{"peach":"This sorting order","péché":"is wrong according to French",'
        '"pêche":"but canonicalization MUST","sin":"ignore locale"}',
    ),
    (
        "structures fixture",
        {
            "1": {"f": {"f": "hi", "F": 5}, "\n": 56},
            "10": {},
            "": "empty",
            "a": {},
            "111": [{"e": "yes", "E": "no"}],
            "A": {"b": "123"},
        },
        '{"":"empty","1":{"\\n":56,"f":{"F":5,"f":"hi"}},"10":{},"111":[{"E":"no","e":"yes"}],'
        '"A":{"b":"123"},"a":{}}',
    ),
    (
        "values fixture",
        {
            "numbers": [333333333.33333329, 1e30, 4.5, 2e-3, 1e-27],
            "string": '€$\u000f\nA\'B"\\\\"/',
            "literals": [None, True, False],
        },
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}',
    ),
    (
        "weird property names fixture",
        {
            "€": "Euro Sign",
            "1": "One",
            "\u0080": "Control",
            "😂": "Smiley",
            "ö": "Latin Small Letter O With Diaeresis",
            "\ufb33": "Hebrew Letter Dalet With Dagesh",
            "</script>": "Browser Challenge",
        },
        '{"1":"One","</script>":"Browser Challenge","\u0080":"Control",'
        '"ö":"Latin Small Letter O With Diaeresis","€":"Euro Sign","😂":"Smiley",'
        '"\ufb33":"Hebrew Letter Dalet With Dagesh"}',
    ),
    # numeric boundaries
    ("zero", 0, "0"),
    ("negative zero", -0.0, "0"),
    ("smallest positive subnormal", 5e-324, "5e-324"),
    ("largest finite number", sys.float_info.max, "1.7976931348623157e+308"),
    ("largest safe integer", 2**53 - 1, "9007199254740991"),
    ("smallest safe integer", -(2**53 - 1), "-9007199254740991"),
    ("exponential lower boundary", 1e-7, "1e-7"),
    ("decimal lower boundary", 1e-6, "0.000001"),
    ("decimal upper boundary", 1e20, "100000000000000000000"),
    ("exponential upper boundary", 1e21, "1e+21"),
    # string boundaries
    ("empty string", "", '""'),
    ("quotation mark", '"', '"\\""'),
    ("reverse solidus", "\\", '"\\\\"'),
    ("backspace", "\b", '"\\b"'),
    ("form feed", "\f", '"\\f"'),
    ("line feed", "\n", '"\\n"'),
    ("carriage return", "\r", '"\\r"'),
    ("tab", "\t", '"\\t"'),
    ("lowest control character", "\u0000", '"\\u0000"'),
    ("highest control character", "\u001f", '"\\u001f"'),
    ("BMP boundary", "\uffff", '"\uffff"'),
    ("highest Unicode scalar", "\U0010ffff", '"\U0010ffff"'),
    # collection boundaries
    (
        "UTF-16 code-unit member order",
        {"\ue000": 1, "😀": 2, "a": 3, "A": 4},
        '{"A":4,"a":3,"😀":2,"\ue000":1}',
    ),
    ("array order and duplicates kept", [3, 1, 3, 2], "[3,1,3,2]"),
]


@pytest.mark.parametrize(("name", "value", "expected"), SERIALIZED, ids=[c[0] for c in SERIALIZED])
def test_the_references_serializations_are_reproduced_byte_for_byte(
    name: str, value: object, expected: str
) -> None:
    assert _text(value) == expected


def test_a_canonical_document_is_valid_json_that_decodes_back_to_its_value() -> None:
    document = _text({"b": 2, "a": [True, None]})
    assert json.loads(document) == {"a": [True, None], "b": 2}
    assert _text(json.loads(document)) == document  # decoding and re-encoding changes nothing


def test_nfc_and_nfd_spellings_stay_distinct_as_keys_and_as_strings() -> None:
    assert _text({"\u00e9": 1}) != _text({"e\u0301": 1})
    assert _text("\u00e9") != _text("e\u0301")


def test_a_one_megabyte_string_is_written_whole() -> None:
    value = "x" * (1024 * 1024)
    assert _text(value) == f'"{value}"'


def test_large_and_deep_collections_are_written_in_order() -> None:
    many = list(range(10_000))
    assert _text(many) == json.dumps(many, separators=(",", ":"))
    props = {f"key-{10_000 - i}": i for i in range(10_000)}
    assert list(json.loads(_text(props))) == sorted(props)
    deep: object = "leaf"
    for _ in range(200):
        deep = {"child": deep}
    assert json.loads(_text(deep)) == deep


def test_shared_non_circular_values_are_not_cycles() -> None:
    shared = {"z": 1}
    assert _text({"x": shared, "y": shared}) == '{"x":{"z":1},"y":{"z":1}}'
    flag = {"value": True}
    assert json.loads(_text([flag] * 1_000)) == [flag] * 1_000
    fine = {"text": "fine"}
    assert _text({"a": fine, "b": fine}) == '{"a":{"text":"fine"},"b":{"text":"fine"}}'


# ------------------------------------------------------------------------------- identical refusals


def _self_object() -> object:
    x: dict[str, object] = {}
    x["self"] = x
    return x


def _self_array() -> object:
    x: list[object] = []
    x.append(x)
    return x


def _nested_cycle() -> object:
    a: dict[str, object] = {}
    a["b"] = {"a": a}
    return a


def _deep(levels: int) -> object:
    v: object = "leaf"
    for _ in range(levels):
        v = {"child": v}
    return v


_LONE = {"text": "lone \ud800 surrogate"}

REFUSED = [
    ("NaN in an array", lambda: [float("nan")]),
    ("NaN in an object", lambda: {"key": float("nan")}),
    ("top-level NaN", lambda: float("nan")),
    ("Infinity in an array", lambda: [float("inf")]),
    ("Infinity in an object", lambda: {"key": float("inf")}),
    ("top-level -Infinity", lambda: float("-inf")),
    ("lone high surrogate in a value", lambda: {"key": "\ud800"}),
    ("lone low surrogate in a value", lambda: {"key": "\udead"}),
    ("high surrogate before a non-low-surrogate", lambda: {"key": "\ud800a"}),
    ("lone surrogate in an object key", lambda: {"\ud800": "value"}),
    ("nesting deeper than the limit", lambda: _deep(100_000)),
    ("an object referencing itself", _self_object),
    ("an array referencing itself", _self_array),
    ("a nested circular reference", _nested_cycle),
    ("an integer beyond the safe range (the reference's bigint)", lambda: 2**64),
    ("a function at the top level", lambda: lambda: None),
    ("a function-valued object property", lambda: {"kept": True, "omitted": lambda: None}),
    ("a lone surrogate in an object reached through a sibling too", lambda: {"a": _LONE, "b": _LONE}),
    ("a lone surrogate in an object repeated in an array", lambda: [_LONE, _LONE]),
    ("a lone surrogate whose first visit is nested deeper", lambda: {"a": {"nested": _LONE}, "b": _LONE}),
]


@pytest.mark.parametrize(("name", "make"), REFUSED, ids=[c[0] for c in REFUSED])
def test_what_the_reference_refuses_is_refused_with_a_typed_error(name: str, make: object) -> None:
    _refused(make())  # type: ignore[operator]


def test_the_depth_limit_is_an_explicit_bound() -> None:
    canonical_bytes(_deep(MAX_DEPTH - 1))
    _refused(_deep(MAX_DEPTH + 1))


# ----------------------------------------------------------------------------- deliberately different


class _WithToJson:
    def to_json(self) -> dict[str, int]:
        return {"a": 1}


DIFFERENT = [
    # the reference calls toJSON: its five toJSON rows and its two toJSON well-formedness rows
    ("an object with a toJSON method", lambda: _WithToJson()),
    ("a nested object with a toJSON method", lambda: {"x": _WithToJson()}),
    ("toJSON returning NaN", lambda: _WithToJson()),
    ("toJSON throwing", lambda: _WithToJson()),
    ("toJSON returning its own object", lambda: _WithToJson()),
    ("toJSON returning a lone surrogate", lambda: [_WithToJson()]),
    ("toJSON returning a lone surrogate key", lambda: {"k": [_WithToJson()]}),
    # boxed primitives and host objects the reference walks or converts
    ("a boxed number (an int subclass here)", lambda: type("Boxed", (int,), {})(1)),
    ("a boxed string (a str subclass here)", lambda: type("Boxed", (str,), {})("ab")),
    ("a Date (a datetime here)", lambda: datetime(1970, 1, 1, tzinfo=timezone.utc)),
    ("a Uint8Array (bytes here)", lambda: bytes([1, 2, 255])),
    ("a Map (an OrderedDict here)", lambda: OrderedDict(a=1)),
    ("a Set (a set here)", lambda: {1, 2}),
    ("a null-prototype object (a read-only mapping here)", lambda: MappingProxyType({"a": 1})),
    ("a function inside an array", lambda: [lambda: None]),
]


@pytest.mark.parametrize(("name", "make"), DIFFERENT, ids=[c[0] for c in DIFFERENT])
def test_non_json_objects_are_refused_where_the_reference_converts_them(name: str, make: object) -> None:
    # The reference serialises these through toJSON or their enumerable members — a populated Map and an empty
    # one share a document there. Here only exact JSON types have a canonical form; the caller converts.
    _refused(make())  # type: ignore[operator]


#: Reference rows the other identical tests above cover, by test.
_OTHER_IDENTICAL_ROWS = {
    "test_a_canonical_document_is_valid_json_that_decodes_back_to_its_value": 2,
    "test_nfc_and_nfd_spellings_stay_distinct_as_keys_and_as_strings": 2,
    "test_a_one_megabyte_string_is_written_whole": 1,
    "test_large_and_deep_collections_are_written_in_order": 3,
    "test_shared_non_circular_values_are_not_cycles": 2,
}

_NOT_APPLICABLE = [
    "arrays: null and undefined values",
    "objects: undefined value",
    "objects: symbol value",
    "objects: symbol key",
    "primitive values: top-level undefined",
    "primitive values: top-level symbol",
    "collection boundaries: a sparse array",
    "unsupported values: a symbol at the top level",
    "unsupported values: undefined at the top level",
]


def test_the_vector_tally_is_as_reported() -> None:
    # REFUSED has one row more than the reference rows it takes: the first repeated-reference test asserts twice
    identical = len(SERIALIZED) + sum(_OTHER_IDENTICAL_ROWS.values()) + len(REFUSED) - 1
    assert identical == TALLY["identical"]
    assert len(DIFFERENT) == TALLY["deliberately different"]
    assert len(_NOT_APPLICABLE) == TALLY["not applicable"]
    assert TALLY["identical"] + TALLY["deliberately different"] + TALLY["not applicable"] == TALLY["taken"]
