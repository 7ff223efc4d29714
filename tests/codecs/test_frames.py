"""The optional-extras codecs (numpy, pyarrow, pandas): round trips, the documented key-stability rule, refusals,
poisoned payloads, large values through the blob sink, and digest reuse for decoded values."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")

from smthrs_plugin.canonical import key  # noqa: E402
from smthrs_plugin.codecs import frames  # noqa: E402
from smthrs_plugin.codecs.frames import INLINE_LIMIT, forget_identities, frame_codecs  # noqa: E402
from smthrs_plugin.codecs.registry import CodecRegistry  # noqa: E402
from smthrs_plugin.errors import CodecError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class MemoryCAS:
    """A real content-addressed byte store in memory (the artifact store's contract: put → sha256 hex)."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.puts = 0

    def put(self, data: bytes) -> str:
        self.puts += 1
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = bytes(data)
        return digest

    def get(self, digest: str) -> bytes:
        return self.blobs[digest]


@pytest.fixture
def reg() -> CodecRegistry:
    forget_identities()
    return CodecRegistry(frame_codecs())


def k(reg: CodecRegistry, value: Any) -> str:
    return key(reg.key_form(value))


def sample_frame(n: int = 6) -> Any:
    return pd.DataFrame(
        {
            "i": np.arange(n, dtype="int64"),
            "f": np.linspace(0.0, 1.0, n),
            "s": [f"s{i}" if i % 3 else None for i in range(n)],
            "o": np.array([f"o{i}" if i != 2 else None for i in range(n)], dtype=object),
            "b": [bool(i % 2) for i in range(n)],
            "t": pd.date_range("2024-01-01", periods=n, freq="h", tz="Europe/Paris"),
            "c": pd.Categorical([("x", "y", "z")[i % 3] for i in range(n)]),
        },
        index=pd.Index([f"r{i}" for i in range(n)], name="row"),
    )


def big_frame(rows: int = 20_000) -> Any:
    rng = np.random.default_rng(7)
    return pd.DataFrame(
        {"a": rng.integers(0, 1 << 40, rows), "b": rng.random(rows), "s": [f"v{i}" for i in range(rows)]}
    )


# ------------------------------------------------------------------------------------------------ round trips


def test_opening_a_runtime_and_keying_plain_values_never_imports_numpy_pandas_or_pyarrow(
    tmp_path: Path,
) -> None:
    # Every CLI command opens a runtime (and so builds the codec registry): pandas + pyarrow would cost it ~100 MB
    # of RSS and a second of start-up, and break the bounded-memory promise of the plan-file refusals.
    code = (
        "import sys, datetime, smthrs_plugin as sp\n"
        f"rt = sp.open_runtime({str(tmp_path)!r})\n"
        "rt.codecs.key_form({'day': datetime.date(2026, 1, 2), 'n': [1, 2.5, 'x']})\n"
        "rt.close()\n"
        "print(sorted({'numpy', 'pandas', 'pyarrow'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=240
    )
    assert out.stdout.strip() == "[]"


def test_frame_codecs_are_the_four_optional_tags() -> None:
    assert sorted(c.tag for c in frame_codecs()) == [
        "numpy.ndarray",
        "pandas.DataFrame",
        "pandas.Series",
        "pyarrow.Table",
    ]
    assert INLINE_LIMIT == 64 * 1024


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype="<i8").reshape(3, 4),
        np.arange(12, dtype=">i4").reshape(2, 2, 3),
        np.array([1.5, np.nan, -0.0]),
        np.array([True, False]),
        np.array(["a", "bé"]),
        np.array(["2024-01-01", "NaT"], dtype="datetime64[ns]"),
        np.zeros((0, 3)),
        np.array(3.25),
    ],
)
def test_a_numpy_array_round_trips_with_its_dtype_and_shape(reg: CodecRegistry, arr: Any) -> None:
    out = reg.decode(json.loads(json.dumps(reg.encode(arr, MemoryCAS()))))
    assert type(out) is np.ndarray and out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def test_a_decoded_numpy_array_is_read_only_for_good(reg: CodecRegistry) -> None:
    out = reg.decode(reg.encode(np.arange(4)))
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out.flags.writeable = True


def test_an_arrow_table_round_trips_with_schema_and_metadata(reg: CodecRegistry) -> None:
    table = pa.table({"x": [1, None, 3], "y": ["a", "b", None]}).replace_schema_metadata({"owner": "team"})
    out = reg.decode(reg.encode(table, MemoryCAS()))
    assert type(out) is pa.Table and out.equals(table, check_metadata=True)


def test_a_dataframe_round_trips_with_common_dtypes(reg: CodecRegistry) -> None:
    df = sample_frame()
    out = reg.decode(json.loads(json.dumps(reg.encode(df, MemoryCAS()))))
    pd.testing.assert_frame_equal(out, df)
    assert out.dtypes.to_dict() == df.dtypes.to_dict()


def test_a_dataframe_with_a_default_range_index_and_int_labels_round_trips(reg: CodecRegistry) -> None:
    df = pd.DataFrame(np.arange(6).reshape(3, 2))
    pd.testing.assert_frame_equal(reg.decode(reg.encode(df)), df)


@pytest.mark.parametrize("name", ["price", 3, None])
def test_a_series_round_trips_with_its_name_and_index(reg: CodecRegistry, name: Any) -> None:
    s = pd.Series([1.0, 2.5, None], index=pd.Index(["a", "b", "c"], name="k"), name=name)
    out = reg.decode(reg.encode(s))
    pd.testing.assert_series_equal(out, s)


# ------------------------------------------------------------------------------------------ key stability


_KEYS_SCRIPT = textwrap.dedent(
    """
    import json, numpy as np, pandas as pd, pyarrow as pa
    from smthrs_plugin.canonical import key
    from smthrs_plugin.codecs.frames import frame_codecs
    from smthrs_plugin.codecs.registry import CodecRegistry
    import sys
    sys.path.insert(0, {tests!r})
    from test_frames import sample_frame
    reg = CodecRegistry(frame_codecs())
    values = {{
        "array": np.arange(24, dtype="<f8").reshape(4, 6),
        "table": pa.table({{"x": [1, 2, None], "y": ["a", "b", "c"]}}),
        "frame": sample_frame(),
        "series": sample_frame()["f"],
    }}
    print(json.dumps({{name: key(reg.key_form(v)) for name, v in values.items()}}, sort_keys=True))
    """
)


def _keys_in_subprocess(seed: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    script = _KEYS_SCRIPT.format(tests=str(Path(__file__).resolve().parent))
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=240,
    )
    return json.loads(out.stdout)


def test_keys_are_the_same_across_processes_and_hash_seeds(reg: CodecRegistry) -> None:
    here = {
        "array": k(reg, np.arange(24, dtype="<f8").reshape(4, 6)),
        "table": k(reg, pa.table({"x": [1, 2, None], "y": ["a", "b", "c"]})),
        "frame": k(reg, sample_frame()),
        "series": k(reg, sample_frame()["f"]),
    }
    assert _keys_in_subprocess("0") == here
    assert _keys_in_subprocess("12345") == here


def test_a_changed_cell_gives_a_new_key(reg: CodecRegistry) -> None:
    arr = np.arange(10)
    arr2 = arr.copy()
    arr2[3] = -1
    assert k(reg, arr) != k(reg, arr2)

    t = pa.table({"x": [1, 2, 3]})
    assert k(reg, t) != k(reg, pa.table({"x": [1, 2, 4]}))

    df = sample_frame()
    df2 = df.copy()
    df2.iloc[2, 1] = 99.0
    assert k(reg, df) != k(reg, df2)
    s2 = df["s"].copy()
    s2.iloc[1] = "changed"
    assert k(reg, df["s"]) != k(reg, s2)


def test_index_column_order_dtype_and_names_are_part_of_a_frame_key(reg: CodecRegistry) -> None:
    df = sample_frame()
    base = k(reg, df)
    assert k(reg, df[list(reversed(df.columns))]) != base  # column order
    assert k(reg, df.set_axis([f"q{i}" for i in range(len(df))], axis=0)) != base  # index values
    assert k(reg, df.rename_axis("other")) != base  # index name
    assert k(reg, df.astype({"i": "int32"})) != base  # dtype
    assert k(reg, df.rename(columns={"f": "g"})) != base  # column label
    s = df["f"]
    assert k(reg, s.rename("other")) != k(reg, s)  # series name
    assert k(reg, np.arange(4, dtype="<i8")) != k(reg, np.arange(4, dtype=">i8"))  # byte order
    assert k(reg, np.arange(4).reshape(2, 2)) != k(reg, np.arange(4).reshape(4, 1))  # shape


def test_memory_layout_is_not_part_of_a_numpy_key(reg: CodecRegistry) -> None:
    base = np.arange(200, dtype="float64").reshape(10, 20)
    view = base[::2, 3:17]
    assert not view.flags.c_contiguous
    assert k(reg, view) == k(reg, np.ascontiguousarray(view))
    fortran = np.asfortranarray(base)
    assert k(reg, fortran) == k(reg, base)
    assert k(reg, base.T) == k(reg, base.T.copy())
    np.testing.assert_array_equal(reg.decode(reg.encode(view)), view)


def test_chunking_is_not_part_of_an_arrow_key(reg: CodecRegistry) -> None:
    whole = pa.table({"x": list(range(10)), "y": [str(i) for i in range(10)]})
    chunked = pa.concat_tables([whole.slice(0, 3), whole.slice(3, 4), whole.slice(7)])
    assert chunked.column("x").num_chunks == 3
    assert k(reg, chunked) == k(reg, whole)
    empty = whole.slice(0, 0)
    assert k(reg, pa.concat_tables([empty, empty])) == k(reg, empty)
    assert reg.decode(reg.encode(chunked)).equals(whole)


def test_memory_layout_and_attrs_are_not_part_of_a_frame_key(reg: CodecRegistry) -> None:
    df = sample_frame()
    built_column_by_column = pd.DataFrame(index=df.index)
    for col in df.columns:
        built_column_by_column[col] = df[col]
    assert k(reg, built_column_by_column) == k(reg, df)
    with_attrs = df.copy()
    with_attrs.attrs["source"] = "somewhere"
    assert k(reg, with_attrs) == k(reg, df)
    numeric = pd.DataFrame(np.asfortranarray(np.arange(20.0).reshape(4, 5)))
    assert k(reg, numeric) == k(reg, pd.DataFrame(np.ascontiguousarray(numeric.to_numpy())))


# ------------------------------------------------------------------------------------------------ refusals


def test_an_object_numpy_array_is_refused_not_pickled(reg: CodecRegistry) -> None:
    arr = np.array([{"a": 1}, None], dtype=object)
    for op in (reg.key_form, reg.encode):
        with pytest.raises(CodecError) as err:
            op(arr)
        assert err.value.code == "invalid_value" and "pickle" in err.value.message


def test_a_structured_numpy_dtype_is_refused(reg: CodecRegistry) -> None:
    with pytest.raises(CodecError) as err:
        reg.key_form(np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]))
    assert err.value.code == "invalid_value"


@pytest.mark.parametrize(
    "column",
    [[{"a": 1}, {"b": 2}], [b"x", b"y"], [object(), object()], ["a", 1]],
    ids=["dict", "bytes", "obj", "mixed"],
)
def test_an_object_column_of_non_strings_is_refused(reg: CodecRegistry, column: list[Any]) -> None:
    df = pd.DataFrame({"ok": [1, 2], "bad": pd.Series(column, dtype=object)})
    for op in (reg.key_form, reg.encode):
        with pytest.raises(CodecError) as err:
            op(df)
        assert err.value.code == "invalid_value" and "'bad'" in err.value.message


def test_an_object_index_of_non_strings_and_an_odd_series_name_are_refused(reg: CodecRegistry) -> None:
    with pytest.raises(CodecError) as err:
        reg.key_form(pd.DataFrame({"a": [1, 2]}, index=pd.Index([("t", 1), ("t", 2)], tupleize_cols=False)))
    assert err.value.code == "invalid_value"
    with pytest.raises(CodecError) as err:
        reg.key_form(pd.Series([1], name=("a", "b")))
    assert err.value.code == "invalid_value"


# --------------------------------------------------------------------------------------- poisoned payloads


class _Boom:
    def __reduce__(self) -> Any:
        return (os.system, ("touch " + str(_Boom.marker),))

    marker = Path("/nonexistent")


def test_a_poisoned_payload_is_refused_and_never_executed(reg: CodecRegistry, tmp_path: Path) -> None:
    _Boom.marker = tmp_path / "executed"
    poison = pickle.dumps(_Boom())
    cas = MemoryCAS()
    digest = cas.put(poison)
    blob = {"sha256": digest, "size": len(poison)}
    inline = {"b64": base64.b64encode(poison).decode()}
    docs = [
        {"$smthrs": "pyarrow.Table", "v": {"format": "arrow-ipc-stream/v1", "data": blob}},
        {"$smthrs": "pandas.DataFrame", "v": {"format": "arrow-ipc-stream/v1", "data": inline}},
        {"$smthrs": "pandas.Series", "v": {"format": "arrow-ipc-stream/v1", "name": None, "data": blob}},
        {"$smthrs": "numpy.ndarray", "v": {"dtype": "|O", "shape": [1], "data": inline}},
        {"$smthrs": "numpy.ndarray", "v": {"dtype": "<i8", "shape": [1000], "data": inline}},
    ]
    for doc in docs:
        with pytest.raises(CodecError) as err:
            reg.decode(doc, cas)
        assert err.value.code == "undecodable"
    assert not _Boom.marker.exists()


def test_a_blob_that_does_not_match_its_digest_is_refused(reg: CodecRegistry) -> None:
    cas = MemoryCAS()
    doc = reg.encode(big_frame(), cas)
    digest = doc["v"]["data"]["sha256"]
    good = cas.blobs[digest]
    # a well-formed stream of ANOTHER frame served under this digest (a tampered or corrupt store)
    other = MemoryCAS()
    reg.encode(big_frame().iloc[::-1], other)
    cas.blobs[digest] = next(iter(other.blobs.values()))
    with pytest.raises(CodecError) as err:
        reg.decode(doc, cas)
    assert err.value.code == "undecodable"
    cas.blobs[digest] = good[:-1] + bytes([good[-1] ^ 1])
    with pytest.raises(CodecError):
        reg.decode(doc, cas)
    cas.blobs[digest] = good
    pd.testing.assert_frame_equal(reg.decode(doc, cas), big_frame())


def test_a_truncated_or_bit_flipped_arrow_stream_is_refused(reg: CodecRegistry) -> None:
    stream = base64.b64decode(reg.encode(pa.table({"x": list(range(50))}))["v"]["data"]["b64"])
    for bad in (stream[: len(stream) // 2], stream[:100] + b"\xff" * 16 + stream[116:]):
        doc = {
            "$smthrs": "pyarrow.Table",
            "v": {"format": "arrow-ipc-stream/v1", "data": {"b64": base64.b64encode(bad).decode()}},
        }
        with pytest.raises(CodecError) as err:
            reg.decode(doc)
        assert err.value.code == "undecodable"


def test_a_malformed_document_is_refused(reg: CodecRegistry) -> None:
    for doc in (
        {"$smthrs": "numpy.ndarray", "v": {"dtype": "<i8", "shape": [-1], "data": {"b64": ""}}},
        {"$smthrs": "numpy.ndarray", "v": {"dtype": "not a dtype", "shape": [0], "data": {"b64": ""}}},
        {"$smthrs": "pyarrow.Table", "v": {"format": "parquet", "data": {"b64": ""}}},
        {
            "$smthrs": "pyarrow.Table",
            "v": {"format": "arrow-ipc-stream/v1", "data": {"sha256": "zz", "size": 1}},
        },
        {
            "$smthrs": "pandas.Series",
            "v": {"format": "arrow-ipc-stream/v1", "name": [1], "data": {"b64": ""}},
        },
    ):
        with pytest.raises(CodecError) as err:
            reg.decode(doc, MemoryCAS())
        assert err.value.code == "undecodable"


# ---------------------------------------------------------------------------------------- large values


def test_large_values_go_through_the_sink_and_small_ones_stay_inline(reg: CodecRegistry) -> None:
    cas = MemoryCAS()
    small = reg.encode(np.arange(10), cas)
    assert "b64" in small["v"]["data"] and cas.puts == 0 and reg.blob_digests(small) == []
    for value in (np.arange(100_000), big_frame(), big_frame()["b"], pa.Table.from_pandas(big_frame())):
        doc = reg.encode(value, cas)
        ref = doc["v"]["data"]
        assert set(ref) == {"sha256", "size"} and ref["size"] > INLINE_LIMIT
        assert reg.blob_digests(doc) == [ref["sha256"]] and ref["sha256"] in cas.blobs
        assert len(json.dumps(doc)) < 1000  # the entry holds the digest, not the bytes
        # the key names the same stored digest
        assert reg.key_form(value)["v"]["data"] == ref


# ------------------------------------------------------------------------------------ results by reference


@pytest.fixture
def hash_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = frames._sha256

    def counting(buf: Any) -> str:
        sizes.append(memoryview(buf).nbytes)
        return real(buf)

    real_write = frames._HashingStream.write

    def counting_write(self: Any, data: Any) -> int:
        sizes.append(memoryview(data).nbytes)
        return real_write(self, data)

    monkeypatch.setattr(frames, "_sha256", counting)
    monkeypatch.setattr(frames._HashingStream, "write", counting_write)
    return sizes


@pytest.mark.parametrize(
    "make",
    [
        big_frame,
        lambda: big_frame()["s"],
        lambda: np.arange(100_000),
        lambda: pa.Table.from_pandas(big_frame()),
    ],
)
def test_a_decoded_result_is_keyed_on_its_stored_digest_without_rehashing(
    reg: CodecRegistry, hash_counter: list[int], make: Any
) -> None:
    cas = MemoryCAS()
    doc = reg.encode(make(), cas)
    decoded = reg.decode(doc, cas)
    hash_counter.clear()
    by_reference = reg.key_form(decoded)
    assert hash_counter == []
    assert by_reference["v"]["data"] == doc["v"]["data"]
    forget_identities()
    assert reg.key_form(decoded) == by_reference  # the same key as hashing it afresh
    assert hash_counter != []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda df: df.iloc.__setitem__((0, 0), -5),
        lambda df: df.__setitem__("a", df["a"] + 1),
        lambda df: df.__setitem__("new", 1),
        lambda df: df.loc.__setitem__((df.index[3], "s"), "changed"),
        lambda df: setattr(df.index, "name", "renamed"),
        lambda df: setattr(df.columns, "name", "cols"),
        lambda df: setattr(df, "columns", ["a", "B", "s"]),
        lambda df: setattr(df, "index", df.index[::-1]),
        lambda df: df.pop("s"),
        lambda df: df.replace({"b": {df["b"].iloc[1]: 7.0}}, inplace=True),
    ],
    ids=[
        "iloc",
        "column",
        "add",
        "loc-str",
        "index-name",
        "columns-name",
        "relabel",
        "reindex",
        "pop",
        "replace",
    ],
)
def test_a_decoded_frame_changed_in_place_is_hashed_again(reg: CodecRegistry, mutate: Any) -> None:
    cas = MemoryCAS()
    decoded = reg.decode(reg.encode(big_frame(), cas), cas)
    before = reg.key_form(decoded)
    mutate(decoded)
    after = reg.key_form(decoded)
    forget_identities()
    assert after == reg.key_form(
        decoded
    )  # never the stale digest: the same as keying the changed frame afresh
    assert after != before


def test_a_decoded_series_renamed_in_place_is_keyed_with_its_new_name(reg: CodecRegistry) -> None:
    cas = MemoryCAS()
    decoded = reg.decode(reg.encode(big_frame()["b"], cas), cas)
    decoded.name = "other"
    assert reg.key_form(decoded)["v"]["name"] == "other"
    decoded.iloc[0] = -1.0
    after = reg.key_form(decoded)
    forget_identities()
    assert after == reg.key_form(decoded)


def test_a_values_own_frame_is_never_keyed_by_reference(reg: CodecRegistry, hash_counter: list[int]) -> None:
    df = big_frame()
    reg.encode(df, MemoryCAS())
    hash_counter.clear()
    reg.key_form(df)
    assert hash_counter != []  # the author's object may be aliased by writeable arrays: always hashed
