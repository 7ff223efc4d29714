"""Values Prefect flows commonly pass to and return from steps: sets, pathlib paths, numpy scalars, and frames whose
columns hold lists, dicts, structs or maps. Each keys on a canonical form and round-trips to an equal value of the
same type; forged documents and values with no exact form are refused with a typed CodecError."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smthrs_plugin.canonical import canonical_bytes, key
from smthrs_plugin.codecs import INLINE_LIMIT, MARKER, CodecRegistry, default_registry, path_arguments
from smthrs_plugin.codecs.frames import forget_identities
from smthrs_plugin.errors import CodecError

try:
    import numpy as np
    import pandas as pd
    import pyarrow as pa
except ImportError:  # the [frames] extra is not installed: only the core codecs are tested
    np = pd = pa = None  # type: ignore[assignment]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
frames = pytest.mark.skipif(
    pa is None, reason="numpy, pandas and pyarrow (the [frames] extra) are not installed"
)
DETERMINISTIC = settings(derandomize=True, deadline=None, max_examples=60, database=None)
FUZZ = settings(derandomize=True, deadline=None, max_examples=300, database=None)


class Blobs:
    """An in-memory content-addressed BlobSink/BlobSource."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = bytes(data)
        return digest

    def get(self, digest: str) -> bytes:
        return self.blobs[digest]


@pytest.fixture
def reg() -> CodecRegistry:
    forget_identities()  # frames decoded by an earlier test must be hashed, not recognised
    return default_registry()


def k(reg: CodecRegistry, value: Any) -> str:
    return key(reg.key_form(value))


def stored(reg: CodecRegistry, value: Any, blobs: Blobs | None = None) -> Any:
    """Encode, go through JSON text (what a store keeps), decode."""
    doc = json.loads(json.dumps(reg.encode(value, blobs)))
    return reg.decode(doc, blobs)


def refused(op: Callable[[], Any], code: str) -> CodecError:
    with pytest.raises(CodecError) as err:
        op()
    assert err.value.code == code, err.value.message
    return err.value


# ---------------------------------------------------------------------------------------------- sets, tuples

# Members whose equal values are also the same value (no 1 / True / 1.0, no case-insensitive Windows paths), so
# the set built from any insertion order holds the very same objects.
_members = st.one_of(
    st.integers(-(2**53) + 1, 2**53 - 1),
    st.text(max_size=6),
    st.tuples(st.integers(-5, 5), st.text(max_size=3)),
    st.frozensets(st.integers(0, 9), max_size=3),
    st.builds(PurePosixPath, st.sampled_from(["a", "b/c", "/abs", "x.csv"])),
)


@DETERMINISTIC
@given(
    st.lists(_members, unique=True, max_size=8).flatmap(lambda m: st.tuples(st.just(m), st.permutations(m)))
)
def test_a_set_keys_the_same_whatever_its_insertion_order(members: tuple[list[Any], list[Any]]) -> None:
    reg = default_registry()
    forward, shuffled = members
    a, b = set(forward), set(shuffled)
    assert reg.key_form(a) == reg.key_form(b) and k(reg, a) == k(reg, b)
    # the order is the canonical bytes of each member's key form, not the iteration order of this process
    forms = [reg.key_form(m) for m in forward]
    assert reg.key_form(a)["v"] == sorted(forms, key=canonical_bytes)
    assert k(reg, frozenset(forward)) == k(reg, frozenset(shuffled))


@DETERMINISTIC
@given(st.sets(_members, max_size=8), st.booleans())
def test_a_set_or_frozenset_round_trips_to_the_same_type_with_typed_members(
    members: set[Any], frozen: bool
) -> None:
    reg = default_registry()
    value = frozenset(members) if frozen else members
    back = stored(reg, value)
    assert type(back) is type(value) and back == value
    for m in back:
        assert any(type(m) is type(o) and m == o for o in value)


def test_a_set_a_frozenset_a_tuple_and_a_list_of_the_same_items_key_differently(reg: CodecRegistry) -> None:
    keys = {k(reg, v) for v in ({1, 2}, frozenset({1, 2}), (1, 2), [1, 2])}
    assert len(keys) == 4
    assert k(reg, {1, 2}) != k(reg, {1, 3}) and k(reg, set()) != k(reg, frozenset())


def test_nested_tuples_and_sets_inside_lists_and_dicts_key_and_round_trip(reg: CodecRegistry) -> None:
    value = {
        "pairs": [(1, "a"), ((2, 3), (4,)), ()],
        "tags": {"groups": [{"x", "y"}, frozenset({(1, 2), (3, 4)})]},
        "mixed": ({frozenset({"a"}), 7}, [PurePosixPath("data/in.csv")]),
    }
    back = stored(reg, value)
    assert back == value
    assert type(back["pairs"][1]) is tuple and type(back["pairs"][1][0]) is tuple
    assert type(back["tags"]["groups"][0]) is set and type(back["tags"]["groups"][1]) is frozenset
    assert type(back["mixed"]) is tuple and frozenset({"a"}) in back["mixed"][0]
    assert k(reg, back) == k(reg, value)


def test_large_members_of_a_set_go_through_the_blob_sink(reg: CodecRegistry) -> None:
    big = os.urandom(INLINE_LIMIT + 1)
    blobs = Blobs()
    doc = reg.encode({big, b"small"}, blobs)
    digest = hashlib.sha256(big).hexdigest()
    assert reg.blob_digests(doc) == [digest] and digest in blobs.blobs
    assert reg.decode(doc, blobs) == {big, b"small"}


def test_a_set_member_with_no_codec_or_no_canonical_form_is_refused_typed(reg: CodecRegistry) -> None:
    for walk in (reg.key_form, reg.encode):
        err = refused(lambda w=walk: w({1, object()}), "no_codec")  # type: ignore[misc]
        assert "builtins.object" in err.message and "smthrs_value_codecs" in err.message
        refused(lambda w=walk: w({1, complex(1, 2)}), "no_codec")  # type: ignore[misc]
        refused(lambda w=walk: w({float("nan")}), "invalid_value")  # type: ignore[misc]
        refused(lambda w=walk: w(frozenset({2**60})), "invalid_value")  # type: ignore[misc]


@pytest.mark.parametrize(
    "members",
    [
        [[1, 2]],  # a list: unhashable
        [{"a": 1}],  # a plain dict: unhashable
        [{MARKER: "set", "v": [1]}],  # a set inside a set: unhashable once decoded
        [1, {MARKER: "tuple", "v": [[1]]}],  # a tuple holding a list: unhashable
    ],
    ids=["list", "dict", "set", "tuple-of-list"],
)
def test_a_stored_set_whose_member_decodes_unhashable_is_refused(
    reg: CodecRegistry, members: list[Any]
) -> None:
    for tag in ("set", "frozenset"):
        err = refused(lambda t=tag: reg.decode({MARKER: t, "v": members}), "undecodable")  # type: ignore[misc]
        assert "unhashable" in err.message or "could not decode" in err.message


def test_a_forged_set_document_is_refused_typed(reg: CodecRegistry) -> None:
    for doc in (
        {MARKER: "set", "v": {"members": [1]}},
        {MARKER: "frozenset", "v": "1,2"},
        {MARKER: "set", "v": [1, 1]},  # a member listed twice: not what encode writes
        {MARKER: "set", "v": [{MARKER: "pickle", "v": "gASV"}]},
        {MARKER: "set", "v": [1], "extra": 1},
    ):
        refused(lambda d=doc: reg.decode(d), "undecodable")  # type: ignore[misc]


def test_a_value_nested_too_deeply_through_tuples_or_sets_is_refused_typed(reg: CodecRegistry) -> None:
    deep_tuple: Any = ()
    deep_set: Any = frozenset()
    for _ in range(5000):
        deep_tuple, deep_set = (deep_tuple,), frozenset({deep_set})
    cycle: tuple[list[Any]] = ([],)
    cycle[0].append(cycle)
    for value in (deep_tuple, deep_set, cycle):
        for walk in (reg.key_form, reg.encode):
            refused(lambda w=walk, v=value: w(v), "invalid_value")  # type: ignore[misc]
    forged: Any = []
    for _ in range(5000):
        forged = {MARKER: "set", "v": [{MARKER: "tuple", "v": [forged]}]}
    refused(lambda: reg.decode(forged), "undecodable")


# ---------------------------------------------------------------------------------------------- paths

_CONCRETE = type(Path())


@pytest.mark.parametrize(
    "path",
    [
        Path("data/in.csv"),
        Path("/abs/dir/"),
        Path("."),
        _CONCRETE("rel/../x"),
        PurePosixPath("//host/share"),
        PurePosixPath("a b/é.txt"),
        PureWindowsPath("C:/Users/x/file.txt"),
        PureWindowsPath(r"\\server\share\dir"),
        PureWindowsPath("rel\\y"),
    ],
    ids=str,
)
def test_a_path_round_trips_to_the_same_class_and_text(reg: CodecRegistry, path: pathlib.PurePath) -> None:
    back = stored(reg, path)
    assert type(back) is type(path) and str(back) == str(path) and back == path
    assert reg.key_form(path)["v"]["path"] == str(path)


def test_a_path_keys_on_its_text_as_given_never_resolved(
    reg: CodecRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rel = Path("data/in.csv")
    before = k(reg, rel)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.csv").write_text("changed")
    monkeypatch.chdir(tmp_path)  # what the relative path resolves to changed; its key did not
    assert k(reg, rel) == before
    assert k(reg, Path("a/../b")) != k(reg, Path("b"))  # never normalised beyond pathlib's own form
    assert k(reg, Path("b")) != k(reg, Path.cwd() / "b")  # never made absolute

    def no_file_system(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a path codec touched the file system")

    for name in ("stat", "lstat", "resolve", "absolute", "exists"):
        monkeypatch.setattr(_CONCRETE, name, no_file_system)
    assert stored(reg, tmp_path / "missing.csv") == tmp_path / "missing.csv"


def test_pure_and_concrete_paths_and_their_flavours_key_differently(reg: CodecRegistry) -> None:
    text = "a/b"
    keys = {k(reg, p) for p in (Path(text), PurePosixPath(text), PureWindowsPath(text))}
    assert len(keys) == 3
    assert reg.key_form(PureWindowsPath(text))["v"] == {"flavour": "windows", "pure": True, "path": "a\\b"}
    assert k(reg, Path("a")) != k(reg, "a")


def test_a_path_subclass_is_refused_typed(reg: CodecRegistry) -> None:
    class Custom(PurePosixPath):
        pass

    refused(lambda: reg.key_form(Custom("x")), "no_codec")


@pytest.mark.parametrize(
    "doc",
    [
        {"flavour": "posix", "pure": True},
        {"flavour": "dos", "pure": True, "path": "a"},
        {"flavour": "posix", "pure": 1, "path": "a"},
        {"flavour": "posix", "pure": True, "path": ["a"]},
        {"flavour": "posix", "pure": True, "path": "a//b"},  # not pathlib's own text
        {"flavour": "posix", "pure": True, "path": "a/"},
        {"flavour": "posix", "pure": True, "path": "a", "resolve": True},
        "a/b",
        ["posix", "a"],
    ],
    ids=[
        "no-path",
        "flavour",
        "pure-int",
        "path-list",
        "double-slash",
        "trailing-slash",
        "extra-key",
        "str",
        "list",
    ],
)
def test_a_forged_path_document_is_refused_typed(reg: CodecRegistry, doc: Any) -> None:
    refused(lambda: reg.decode({MARKER: "path", "v": doc}), "undecodable")


@pytest.mark.skipif(os.name == "nt", reason="a WindowsPath can be built on Windows")
def test_a_stored_windows_concrete_path_is_refused_on_posix(reg: CodecRegistry) -> None:
    err = refused(
        lambda: reg.decode({MARKER: "path", "v": {"flavour": "windows", "pure": False, "path": "C:\\x"}}),
        "undecodable",
    )
    assert "WindowsPath" in err.message


def test_path_arguments_finds_paths_at_the_top_and_inside_containers() -> None:
    a, b, c, d = Path("a.csv"), PurePosixPath("b/c"), PureWindowsPath("C:/d"), Path("/e")
    assert path_arguments(a) == [a]
    assert path_arguments("a.csv") == [] and path_arguments(None) == [] and path_arguments(42) == []
    assert path_arguments([a, (b, [c]), {"k": d}]) == [a, b, c, d]
    assert path_arguments({a: 1}) == [a]  # dict keys too
    assert path_arguments({"ok": 1, "nested": {"deeper": [(d,)]}}) == [d]
    assert path_arguments([a, a]) == [a, a]


def test_path_arguments_orders_the_paths_found_in_a_set_by_class_and_text() -> None:
    found = path_arguments({Path("z"), PurePosixPath("m"), Path("c"), (Path("y"), 1)})
    assert found == [Path("c"), Path("y"), Path("z"), PurePosixPath("m")]
    assert [type(p) for p in found] == [_CONCRETE, _CONCRETE, _CONCRETE, PurePosixPath]
    assert path_arguments(frozenset({Path("b"), Path("a")})) == [Path("a"), Path("b")]


def test_path_arguments_refuses_a_cyclic_argument_typed() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    refused(lambda: path_arguments(cycle), "invalid_value")


# ---------------------------------------------------------------------------------------------- numpy scalars


def _scalars() -> list[Any]:
    return [
        pytest.param(lambda: np.int64(-(2**63)), id="int64-min"),
        pytest.param(lambda: np.int8(-5), id="int8"),
        pytest.param(lambda: np.uint64(2**64 - 1), id="uint64-max"),
        pytest.param(lambda: np.float64(0.1), id="float64"),
        pytest.param(lambda: np.float32(0.1), id="float32"),
        pytest.param(lambda: np.float16(1.5), id="float16"),
        pytest.param(lambda: np.float64(-0.0), id="negative-zero"),
        pytest.param(lambda: np.float64("inf"), id="inf"),
        pytest.param(lambda: np.complex128(1.5 - 2j), id="complex128"),
        pytest.param(lambda: np.complex64(complex("nan+1j")), id="complex64-nan"),
        pytest.param(lambda: np.bool_(True), id="bool"),
        pytest.param(lambda: np.datetime64("2024-05-01T12:30:00.123456789", "ns"), id="datetime64-ns"),
        pytest.param(lambda: np.datetime64("2024-05-01", "D"), id="datetime64-D"),
        pytest.param(lambda: np.datetime64("NaT"), id="NaT-generic"),
        pytest.param(lambda: np.datetime64("NaT", "ms"), id="NaT-ms"),
        pytest.param(lambda: np.timedelta64(-90, "m"), id="timedelta64"),
        pytest.param(lambda: np.str_("héllo ✓"), id="str_"),
        pytest.param(lambda: np.str_(""), id="str_-empty"),
        pytest.param(lambda: np.bytes_(b"\x00bin\xff"), id="bytes_"),
    ]


def _same_scalar(a: Any, b: Any) -> bool:
    if type(a) is not type(b) or a.dtype.str != b.dtype.str:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array(a).tobytes() == np.array(b).tobytes() or (np.isnan(a) and np.isnan(b)))
    if a.dtype.kind in "Mm":
        return bool((np.isnat(a) and np.isnat(b)) or a == b)
    return bool(a == b)


@frames
@pytest.mark.parametrize("make", _scalars())
def test_a_numpy_scalar_round_trips_to_the_same_type_and_value(
    reg: CodecRegistry, make: Callable[[], Any]
) -> None:
    value = make()
    doc = reg.encode(value)
    assert doc[MARKER] == "numpy.scalar" and doc == reg.key_form(value)
    back = stored(reg, value)
    assert _same_scalar(back, value), (back, value)
    assert k(reg, back) == k(reg, value)


@frames
@DETERMINISTIC
@given(st.sampled_from([16, 32, 64]).flatmap(lambda w: st.tuples(st.just(w), st.floats(width=w))))
def test_a_numpy_float_round_trips_bit_for_bit_and_every_nan_keys_alike(drawn: tuple[int, float]) -> None:
    width, x = drawn
    reg = default_registry()
    value = np.dtype(f"<f{width // 8}").type(x)
    back = stored(reg, value)
    assert type(back) is type(value)
    if np.isnan(value):
        assert np.isnan(back) and k(reg, value) == k(reg, np.dtype(f"<f{width // 8}").type("nan"))
    else:
        assert np.array(back).tobytes() == np.array(value).tobytes()


@frames
def test_every_nan_of_a_dtype_keys_the_same_and_other_values_do_not(reg: CodecRegistry) -> None:
    quiet = np.float64("nan")
    # a negative NaN with payload 1: other bits, the same "not a number"
    other_payload = np.frombuffer(b"\x01\x00\x00\x00\x00\x00\xf8\xff", dtype="<f8")[0]
    assert np.isnan(other_payload) and np.array(other_payload).tobytes() != np.array(quiet).tobytes()
    assert k(reg, other_payload) == k(reg, quiet)
    assert k(reg, np.float32("nan")) != k(reg, quiet)  # the dtype is part of the key
    assert k(reg, np.float64(0.0)) != k(reg, np.float64(-0.0))
    assert (
        len({k(reg, v) for v in (np.int64(1), np.int32(1), np.uint64(1), np.float64(1), np.bool_(True), 1)})
        == 6
    )
    assert k(reg, np.datetime64(1, "s")) != k(reg, np.datetime64(1000, "ms"))  # the unit is part of the key
    assert k(reg, {"n": [np.int64(3)]}) == k(reg, {"n": [np.int64(3)]})


@frames
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.longdouble(1.5), id="longdouble"),
        pytest.param(lambda: np.clongdouble(1 + 1j), id="clongdouble"),
        pytest.param(lambda: np.void(b"ab"), id="void"),
        pytest.param(lambda: np.longlong(3), id="longlong-alias"),
    ],
)
def test_a_numpy_scalar_with_no_exact_form_is_refused_typed(
    reg: CodecRegistry, make: Callable[[], Any]
) -> None:
    value = make()
    if type(value) is np.dtype(value.dtype.str).type and value.dtype.kind in "iu":
        pytest.skip("np.longlong is np.int64 on this platform")
    for walk in (reg.key_form, reg.encode):
        refused(lambda w=walk: w(value), "invalid_value")  # type: ignore[misc]


@frames
@pytest.mark.parametrize(
    "doc",
    [
        {"dtype": "|O8", "value": "1"},
        {"dtype": "i4,f8", "value": "1"},
        {"dtype": "<i8", "value": 5},
        {"dtype": "<i8", "value": " 5"},
        {"dtype": "|i1", "value": "300"},
        {"dtype": "<i8", "value": "9" * 5000},
        {"dtype": "<f2", "value": "0x1.0000000000001p+0"},  # not a float16
        {"dtype": "<f8", "value": "NaN"},
        {"dtype": "<f8", "value": "1e3"},
        {"dtype": "<f8", "value": 1.5},
        {"dtype": "<f16", "value": "0x1.0p+0"},
        {"dtype": ">f8", "value": "0x1.0p+0"},
        {"dtype": "<c16", "value": ["0x1.0p+0"]},
        {"dtype": "|b1", "value": "true"},
        {"dtype": "<M8[ns]", "value": "-9223372036854775808"},  # NaT written as a count
        {"dtype": "<M8[ns]", "value": "99999999999999999999"},
        {"dtype": "<M8[xx]", "value": "1"},
        {"dtype": "<U3", "value": "ab"},
        {"dtype": "|S2", "value": "not base64!"},
        {"dtype": "|V2", "value": "AAA="},
        {"dtype": "<i8"},
        {"dtype": "<i8", "value": "1", "shape": []},
        ["<i8", "1"],
    ],
    ids=lambda d: json.dumps(d)[:40],
)
def test_a_forged_numpy_scalar_document_is_refused_typed(reg: CodecRegistry, doc: Any) -> None:
    refused(lambda: reg.decode({MARKER: "numpy.scalar", "v": doc}), "undecodable")


# ---------------------------------------------------------------------------------- frames of lists and dicts


def _nested_frame() -> Any:
    index = pd.Index(["r1", "r2", "r3"], name="row")

    def column(cells: list[Any]) -> Any:
        return pd.Series(cells, dtype=object, index=index)

    return pd.DataFrame(
        {
            "id": pd.Series([1, 2, 3], index=index),
            "tags": column([["a", "b"], [], None]),
            "scores": column([[1.5, -0.0], [2.0], [3.25]]),
            "meta": column([{"n": 1, "s": "x"}, {"n": 2, "s": None}, None]),
            "deep": column([{"xs": [{"k": 1}]}, {"xs": []}, {"xs": [{"k": 3}, {"k": 4}]}]),
            "raw": column([[b"\x00"], [b""], [b"x", None]]),
        },
    )


@frames
def test_a_dataframe_with_list_and_dict_object_columns_round_trips_with_its_dtypes(
    reg: CodecRegistry,
) -> None:
    df = _nested_frame()
    blobs = Blobs()
    back = stored(reg, df, blobs)
    pd.testing.assert_frame_equal(back, df)
    assert back.dtypes.to_dict() == df.dtypes.to_dict()
    assert type(back["tags"].iloc[0]) is list and type(back["meta"].iloc[0]) is dict
    assert type(back["deep"].iloc[0]["xs"][0]) is dict and back["raw"].iloc[2] == [b"x", None]
    series = df["meta"].rename("meta")
    pd.testing.assert_series_equal(stored(reg, series), series)


@frames
def test_a_dataframe_of_lists_and_dicts_keys_on_its_content_only(reg: CodecRegistry) -> None:
    df = _nested_frame()
    base = k(reg, df)
    assert k(reg, _nested_frame()) == base  # built again: same key
    assert k(reg, stored(reg, df)) == base
    forget_identities()
    assert k(reg, stored(reg, df)) == base  # the decoded frame, hashed again, writes the same stream
    changed = _nested_frame()
    changed.at["r3", "deep"] = {"xs": [{"k": 3}, {"k": 5}]}
    assert k(reg, changed) != base
    as_ints = _nested_frame()
    as_ints["scores"] = pd.Series([[1, 0], [2], [3]], dtype=object, index=as_ints.index)
    assert k(reg, as_ints) != base  # ints are not floats


@frames
@DETERMINISTIC
@given(
    st.lists(
        st.one_of(st.none(), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)),
        min_size=1,
        max_size=6,
    ).filter(lambda col: any(v is not None for v in col)),
    st.lists(st.fixed_dictionaries({"a": st.text(max_size=4), "b": st.booleans()}), min_size=1, max_size=6),
)
def test_object_columns_of_lists_and_dicts_round_trip_exactly(lists: list[Any], dicts: list[Any]) -> None:
    reg = default_registry()
    frame = pd.DataFrame({"l": pd.Series(lists, dtype=object)})
    back = stored(reg, frame)
    pd.testing.assert_frame_equal(back, frame)
    assert k(reg, back) == k(reg, frame)
    records = pd.DataFrame({"d": pd.Series(dicts, dtype=object)})
    pd.testing.assert_frame_equal(stored(reg, records), records)


@frames
@pytest.mark.parametrize(
    "column",
    [
        [1, "a"],  # ints mixed with strings
        [{"a": 1}, {"b": 2}],  # ragged dicts: Arrow would fill missing keys with None
        [[1], [2.5]],  # ints would be widened to floats
        [[1], float("nan")],  # NaN would come back None
        [(1, 2), (3,)],  # tuples would come back lists
        [[1], "a"],
        [{1: "a"}, {2: "b"}],  # non-str keys
        [[object()], [object()]],
        [object(), object()],
        [[pathlib.PurePosixPath("a")], []],
        [[1.5], [np.float64(2.5)] if np is not None else [2.5j]],
    ],
    ids=[
        "int-str",
        "ragged",
        "widened",
        "nan",
        "tuple",
        "list-str",
        "int-keys",
        "obj-in-list",
        "obj",
        "path",
        "npfloat",
    ],
)
def test_a_mixed_or_inexact_object_column_is_still_refused_typed(
    reg: CodecRegistry, column: list[Any]
) -> None:
    df = pd.DataFrame({"ok": [1, 2], "bad": pd.Series(column, dtype=object)})
    for walk in (reg.key_form, reg.encode):
        err = refused(lambda w=walk: w(df), "invalid_value")  # type: ignore[misc]
        assert "'bad'" in err.message


@frames
def test_arrow_tables_with_list_struct_and_map_columns_round_trip(reg: CodecRegistry) -> None:
    table = pa.table(
        {
            "l": pa.array([[1, 2], None, []], type=pa.list_(pa.int64())),
            "ll": pa.array([["a"], ["b", None], None], type=pa.large_list(pa.string())),
            "s": pa.array([{"x": 1, "y": "a"}, None, {"x": None, "y": "c"}]),
            "m": pa.array([[("k", 1.5)], None, []], type=pa.map_(pa.string(), pa.float64())),
            "nested": pa.array([[{"q": [1]}], [], None]),
        }
    )
    blobs = Blobs()
    back = stored(reg, table, blobs)
    assert type(back) is pa.Table and back.equals(table, check_metadata=True)
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1)])
    assert k(reg, chunked) == k(reg, table)
    other = table.set_column(
        3, "m", pa.array([[("k", 2.5)], None, []], type=pa.map_(pa.string(), pa.float64()))
    )
    assert k(reg, other) != k(reg, table)


@frames
def test_pandas_arrow_dtype_list_struct_and_map_columns_round_trip_with_their_dtype(
    reg: CodecRegistry,
) -> None:
    df = pd.DataFrame(
        {
            "l": pd.Series([[1], [2, 3], None], dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
            "s": pd.Series([{"a": 1}, None, {"a": 3}], dtype=pd.ArrowDtype(pa.struct([("a", pa.int64())]))),
            "m": pd.Series([[("k", 1)], [], None], dtype=pd.ArrowDtype(pa.map_(pa.string(), pa.int64()))),
            "o": pd.Series([[1], [2], [3]], dtype=object),  # an object column of lists beside them
        }
    )
    back = stored(reg, df)
    pd.testing.assert_frame_equal(back, df)
    assert back.dtypes.to_dict() == df.dtypes.to_dict()
    assert type(back["o"].iloc[0]) is list


@frames
def test_a_forged_frame_whose_pandas_metadata_is_malformed_is_refused_typed(reg: CodecRegistry) -> None:
    table = pa.table({"o": pa.array([[1], [2]])})
    for meta in (b'{"columns": 5, "index_columns": []}', b"[1, 2]", b"not json"):
        sink = pa.BufferOutputStream()
        forged = table.replace_schema_metadata({"pandas": meta})
        with pa.ipc.new_stream(sink, forged.schema) as writer:
            writer.write_table(forged)
        data = {"b64": base64.b64encode(sink.getvalue().to_pybytes()).decode()}
        for tag, extra in (("pandas.DataFrame", {}), ("pandas.Series", {"name": None})):
            doc = {MARKER: tag, "v": {"format": "arrow-ipc-stream/v1", "data": data, **extra}}
            refused(lambda d=doc: reg.decode(d), "undecodable")  # type: ignore[misc]


# ------------------------------------------------------------------------------- forged documents, fuzzed

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_scalar_json = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_member_docs = st.fixed_dictionaries(
    {
        MARKER: st.sampled_from(["set", "frozenset", "tuple", "path", "bytes", "numpy.scalar"]),
        "v": st.one_of(_json, st.lists(_scalar_json, max_size=3)),
    }
)
# Per tag: anything at all, or documents close enough to the real shape to reach the codec's deeper checks.
_path_docs = st.fixed_dictionaries(
    {
        "flavour": st.sampled_from(["posix", "windows", "posix", "mac"]),
        "pure": st.sampled_from([True, False, True, 1, None]),
        "path": st.one_of(
            st.sampled_from(["a/b", "a//b", "C:\\x", "/", "", "a/", "."]), st.text(max_size=12)
        ),
    }
)
_scalar_docs = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(
            ["<i8", "|u1", "<f2", "<f8", "<c8", "|b1", "<M8[s]", "<m8", "<U2", "|S1", "|V1", "<f16", ">i8"]
        ),
        "value": st.one_of(
            st.sampled_from(["nan", "NaT", "0x1.8p+0", "0x1.8000000000000p+0", "-1", "300", "AA==", "ab"]),
            st.lists(st.sampled_from(["nan", "inf", "0x0.0p+0", "x"]), max_size=3),
            _scalar_json,
        ),
    }
)
# Per tag: mostly documents close to the real shape (to reach the codec's deeper checks), sometimes anything.
_forged = {
    "set": st.one_of(st.lists(st.one_of(_scalar_json, _member_docs, _json), max_size=5), _json),
    "path": st.one_of(_path_docs, _path_docs, _json),
    "numpy.scalar": st.one_of(_scalar_docs, _scalar_docs, _json),
}
_forged["frozenset"] = _forged["set"]
_TAGS = ["set", "frozenset", "path"] + (["numpy.scalar"] if np is not None else [])


@FUZZ
@given(st.sampled_from(_TAGS).flatmap(lambda tag: st.tuples(st.just(tag), _forged[tag])))
def test_a_forged_document_for_a_new_codec_decodes_or_is_refused_typed_never_crashes(
    forged: tuple[str, Any],
) -> None:
    tag, doc = forged
    try:
        out = default_registry().decode({MARKER: tag, "v": doc})
    except CodecError as err:
        assert err.code in ("undecodable", "unsafe_codec")
    else:  # what a forged document may decode to: a value of the tag's own type, nothing else
        if tag == "numpy.scalar":
            assert isinstance(out, np.generic)
        elif tag == "path":
            assert isinstance(out, pathlib.PurePath) and str(out) == doc["path"]
        else:
            assert type(out) is {"set": set, "frozenset": frozenset}[tag] and len(out) == len(doc)


# --------------------------------------------------------------------------------------- across processes

_VALUES_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_prefect_values import cross_process_values
    from smthrs_plugin.canonical import key
    from smthrs_plugin.codecs import default_registry, path_arguments
    reg = default_registry()
    values = cross_process_values()
    out = {{name: key(reg.key_form(v)) for name, v in values.items()}}
    out["path_arguments"] = [str(p) for p in path_arguments(values["paths"])]
    out["stored_set"] = json.dumps(reg.encode(values["strings"]), sort_keys=True)
    print(json.dumps(out, sort_keys=True))
    """
)


def cross_process_values() -> dict[str, Any]:
    """Values whose iteration order depends on the hash seed (str members), keyed in several processes."""
    values: dict[str, Any] = {
        "strings": {f"member-{i}" for i in range(40)},
        "tuples": frozenset((f"k{i}", i) for i in range(20)),
        "nested": {"sets": [{"b", "a", "c"}, frozenset({("x", 1), ("y", 2)})]},
        "paths": {Path(f"data/{c}.csv") for c in "qwertyuiop"},
    }
    if np is not None:
        values["scalars"] = [np.float32("nan"), np.datetime64("2024-01-01", "ns"), np.str_("s"), np.uint16(7)]
        values["frame"] = _nested_frame()
        values["table"] = pa.table({"m": pa.array([[("k", 1)]], type=pa.map_(pa.string(), pa.int64()))})
    return values


def test_keys_of_sets_paths_scalars_and_nested_frames_are_the_same_across_hash_seeds(
    reg: CodecRegistry,
) -> None:
    values = cross_process_values()
    here = {name: k(reg, v) for name, v in values.items()}
    here["path_arguments"] = [str(p) for p in path_arguments(values["paths"])]  # type: ignore[assignment]
    here["stored_set"] = json.dumps(reg.encode(values["strings"]), sort_keys=True)
    script = _VALUES_SCRIPT.format(tests=str(HERE))
    for seed in ("0", "1", "4242"):
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=240,
        )
        assert json.loads(out.stdout) == here, seed


def test_set_members_are_ordered_by_the_canonical_json_bytes_of_their_key_forms(reg: CodecRegistry) -> None:
    assert reg.key_form({2.5, 0.5, 10.0})["v"] == [0.5, 10.0, 2.5]  # b"0.5" < b"10" < b"2.5"
    assert reg.key_form({"b", "a", "B"})["v"] == ["B", "a", "b"]
    assert reg.key_form({1, "1", (1,)})["v"] == ["1", 1, {MARKER: "tuple", "v": [1]}]  # '"' < '1' < '{'
    back = stored(reg, {2.5, 0.5, -0.0})
    assert back == {2.5, 0.5, 0.0} and all(type(m) is float for m in back)
    refused(lambda: reg.key_form({math.inf}), "invalid_value")  # no canonical JSON form, so no order
