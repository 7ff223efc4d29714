"""Optional-extras codecs: numpy ``ndarray`` and scalars, pyarrow ``Table``, pandas ``DataFrame`` / ``Series``.

What is and is not part of a key is in docs/rules.md ("Typed values"; pinned by tests/codecs/test_frames.py).
A caller relies on:

- Registering these codecs imports no library (:func:`frame_codecs` finds, never imports); a library is imported
  only when a value of its type is keyed or stored, or a stored document of its tag is decoded.
- Decoding never executes code (``np.frombuffer`` of verified bytes, a validated Arrow IPC stream); values that
  would need pickle (object dtypes, mixed object columns) are refused with ``CodecError(invalid_value)``.
- Payloads over :data:`INLINE_LIMIT` live in the content-addressed store through the injected sink and are
  checked against their size and SHA-256 before they are parsed.
- A DECODED value remembers its digest while it provably cannot have changed (read-only arrays, Tables,
  frames under Copy-on-Write), so keying it again costs no hashing; anything else hashes again. Values a step
  returns are never registered.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import json
import math
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..errors import CodecError
from ._identity import _IDENTITIES, carry, forget_identities
from .registry import JSON, BlobSink, BlobSource, CodecRegistry, ValueCodec, type_name

__all__ = ["INLINE_LIMIT", "ARROW_FORMAT", "frame_codecs", "scalar_codecs", "forget_identities"]

#: Payloads up to this many bytes are stored inline (base64) in the document; larger ones go to the sink.
INLINE_LIMIT = 64 * 1024
#: The format marker of the canonical Arrow IPC stream (bump it if the canonicalisation ever changes).
ARROW_FORMAT = "arrow-ipc-stream/v1"
#: The pandas schema-metadata fields that name the writing library versions (not part of the value).
_VERSION_FIELDS = ("creator", "pandas_version", "attributes")
_SERIES_COLUMN = "__smthrs_series__"
_HEX64 = re.compile(r"[0-9a-f]{64}")
# What a numpy scalar's stored dtype may look like: checked before np.dtype() parses it, so a forged document
# can never reach numpy's richer dtype grammar (structured "i4,f8", object "O", ...).
_SCALAR_DTYPE = re.compile(r"[<>|][biufcmMUS][0-9]{1,4}(\[[0-9]{0,4}[A-Za-z]{1,2}\])?")


# --------------------------------------------------------------------------------------------------- payloads


def _sha256(buf: Any) -> str:
    """SHA-256 over any C-contiguous buffer (bytes, ndarray, pyarrow Buffer) without copying it."""
    return hashlib.sha256(memoryview(buf)).hexdigest()


def _nbytes(buf: Any) -> int:
    return memoryview(buf).nbytes


def _digest_form(buf: Any) -> JSON:
    return {"sha256": _sha256(buf), "size": _nbytes(buf)}


def _store(buf: Any, sink: BlobSink | None, what: str) -> JSON:
    """The stored form of a payload: inline base64 when small (or when no sink is given, as the built-in ``bytes``
    codec does), else a digest reference after ``sink.put`` — whose answer must be the payload's own digest."""
    size = _nbytes(buf)
    if sink is None or size <= INLINE_LIMIT:
        return {"b64": base64.b64encode(memoryview(buf)).decode("ascii")}
    digest = _sha256(buf)
    stored = sink.put(buf if isinstance(buf, bytes) else bytes(memoryview(buf)))
    if stored != digest:
        raise CodecError(
            "invalid_value", f"the blob sink stored a {size}-byte {what} as {stored}, not its digest {digest}"
        )
    return {"sha256": digest, "size": size}


def _fetch(data_doc: JSON, source: BlobSource | None, what: str) -> tuple[bytes, str | None]:
    """The verified bytes of a stored payload, and its digest when it was a blob reference."""
    if isinstance(data_doc, dict) and set(data_doc) == {"b64"} and isinstance(data_doc["b64"], str):
        try:
            return base64.b64decode(data_doc["b64"], validate=True), None
        except (binascii.Error, ValueError) as exc:
            raise CodecError("undecodable", f"stored {what} holds malformed base64", cause=exc) from exc
    if not (
        isinstance(data_doc, dict)
        and set(data_doc) == {"sha256", "size"}
        and isinstance(data_doc["sha256"], str)
        and _HEX64.fullmatch(data_doc["sha256"])
        and type(data_doc["size"]) is int
        and data_doc["size"] >= 0
    ):
        raise CodecError("undecodable", f"stored {what} payload must be {{'b64'}} or {{'sha256', 'size'}}")
    digest, size = data_doc["sha256"], data_doc["size"]
    if source is None:
        raise CodecError(
            "undecodable", f"stored {what} references blob {digest[:12]}… but no blob source was given"
        )
    data = source.get(digest)
    # The codec does not trust the source: a payload is parsed only once it is exactly the recorded bytes.
    if len(data) != size or _sha256(data) != digest:
        raise CodecError(
            "undecodable",
            f"blob {digest[:12]}… of a stored {what} does not match its recorded digest/size: the store is "
            "corrupt or was tampered with; run `smthrs cache verify`",
        )
    return data, digest


def _blob_digests(doc: JSON) -> list[str]:
    data = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(data, dict) and isinstance(data.get("sha256"), str):
        return [data["sha256"]]
    return []


def _check_format(doc: JSON, what: str, extra: frozenset[str] = frozenset()) -> JSON:
    if not (
        isinstance(doc, dict) and set(doc) == {"format", "data"} | extra and doc["format"] == ARROW_FORMAT
    ):
        raise CodecError("undecodable", f"stored {what} must be {{'format': {ARROW_FORMAT!r}, 'data', ...}}")
    return doc


# ------------------------------------------------------------------------------------------------- numpy


class NumpyArrayCodec:
    """``numpy.ndarray`` (exact type): dtype.str, shape, C-order bytes."""

    tag = "numpy.ndarray"

    def __init__(self, np: Any) -> None:
        self._np = np

    def handles(self, value: Any) -> bool:
        return type(value) is self._np.ndarray

    def _parts(self, arr: Any) -> tuple[str, list[int], Any]:
        dt = arr.dtype
        if dt.hasobject:
            raise CodecError(
                "invalid_value",
                f"a numpy array of dtype {dt} holds Python objects and could only be stored by pickle: convert it "
                "to a fixed-size dtype (numbers, 'U'/'S' strings) first",
            )
        if dt.fields is not None or dt.subdtype is not None:
            raise CodecError(
                "invalid_value",
                f"numpy structured/sub-array dtype {dt} is not supported: use one plain array per field",
            )
        # C-order bytes without a copy when already C-contiguous (a view or Fortran array is copied once).
        flat = self._np.ascontiguousarray(arr).reshape(-1).view(self._np.uint8)
        return dt.str, [int(n) for n in arr.shape], flat

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        known = _IDENTITIES.lookup(value)
        if known is not None:
            return known
        dtype, shape, flat = self._parts(value)
        return {"dtype": dtype, "shape": shape, "data": _digest_form(flat)}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        dtype, shape, flat = self._parts(value)
        return {"dtype": dtype, "shape": shape, "data": _store(flat, sink, "numpy array")}

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        np = self._np
        if not (
            isinstance(doc, dict)
            and set(doc) == {"dtype", "shape", "data"}
            and isinstance(doc["dtype"], str)
            and isinstance(doc["shape"], list)
            and all(type(n) is int and n >= 0 for n in doc["shape"])
        ):
            raise CodecError(
                "undecodable", "stored numpy array must be {'dtype': str, 'shape': [int], 'data'}"
            )
        try:
            dt = np.dtype(doc["dtype"])
        except (TypeError, ValueError) as exc:
            raise CodecError(
                "undecodable", f"stored numpy dtype {doc['dtype']!r} is not a dtype", cause=exc
            ) from exc
        if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.str != doc["dtype"]:
            raise CodecError(
                "undecodable", f"stored numpy dtype {doc['dtype']!r} is not a plain fixed-size dtype"
            )
        data, digest = _fetch(doc["data"], source, "numpy array")
        count = 1
        for n in doc["shape"]:
            count *= n
        if count * dt.itemsize != len(data):
            raise CodecError(
                "undecodable",
                f"stored numpy array of shape {doc['shape']} and dtype {dt.str} needs {count * dt.itemsize} bytes, "
                f"got {len(data)}",
            )
        arr = np.frombuffer(data, dtype=dt, count=count).reshape(doc["shape"])
        # Over immutable ``bytes``: the flag can never be set back to True, so the digest stays the content's.
        arr.flags.writeable = False
        key = {
            "dtype": dt.str,
            "shape": list(doc["shape"]),
            "data": {"sha256": digest or _sha256(data), "size": len(data)},
        }
        _IDENTITIES.remember(arr, key, lambda a: not a.flags.writeable)
        return arr

    def blob_digests(self, doc: JSON) -> list[str]:
        return _blob_digests(doc)


def _float_text(x: float) -> str:
    # Exact and canonical: every NaN is one text (NaN keys like NaN), and float.hex keeps -0.0 apart from 0.0.
    if x != x:
        return "nan"
    if x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    return x.hex()


def _text_float(doc: Any) -> float:
    if type(doc) is not str:
        raise CodecError("undecodable", "a stored numpy float must be a string")
    if doc in ("nan", "inf", "-inf"):
        return float(doc)
    return float.fromhex(doc)


class NumpyScalarCodec:
    """numpy scalars (``np.generic``): ``{"dtype": dtype.str, "value": exact text}`` (module docstring)."""

    tag = "numpy.scalar"

    def __init__(self, np: Any) -> None:
        self._np = np

    def handles(self, value: Any) -> bool:
        return isinstance(value, self._np.generic)

    @staticmethod
    def _refuse(value: Any, why: str) -> CodecError:
        return CodecError(
            "invalid_value",
            f"numpy scalar {type_name(value)} has no exact stored form: {why}",
            type=type_name(value),
        )

    def _form(self, value: Any) -> JSON:
        np = self._np
        dt = value.dtype
        named = np.dtype(dt.str).type
        if named is not type(value):
            raise self._refuse(
                value, f"its dtype string {dt.str!r} names {type_name(named)}; convert it to that"
            )
        kind = dt.kind
        text: JSON
        if kind == "b":
            text = bool(value)
        elif kind in "iu":
            text = str(int(value))
        elif kind == "f" and dt.itemsize <= 8:
            text = _float_text(float(value))
        elif kind == "c" and dt.itemsize <= 16:
            text = [_float_text(float(value.real)), _float_text(float(value.imag))]
        elif kind in "Mm":
            text = "NaT" if np.isnat(value) else str(int(value.view(np.int64)))
        elif kind == "U":
            text = str.__str__(value)  # np.str_.__str__ drops trailing NULs, which are part of the value
        elif kind == "S":
            text = base64.b64encode(bytes(value)).decode("ascii")
        else:
            raise self._refuse(value, f"dtype {dt.str!r} (long double, void or object) is not supported")
        return {"dtype": dt.str, "value": text}

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return self._form(value)

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        doc = self._form(value)
        try:
            rebuilt = self.decode(doc, registry, None)
        except CodecError as exc:
            raise self._refuse(value, f"it does not read back ({exc.message})") from exc
        if type(rebuilt) is not type(value):
            raise self._refuse(value, f"it reads back as {type_name(rebuilt)}")
        return doc

    def _build(self, dt: Any, text: Any) -> Any:
        np = self._np
        kind = dt.kind
        if kind == "b":
            if type(text) is not bool:
                raise CodecError("undecodable", "a stored numpy bool must be true or false")
            return dt.type(text)
        if kind == "c":
            if type(text) is not list or len(text) != 2:
                raise CodecError("undecodable", "a stored numpy complex must be [real, imag]")
            return dt.type(complex(_text_float(text[0]), _text_float(text[1])))
        if kind == "f":
            return dt.type(_text_float(text))
        if type(text) is not str:
            raise CodecError("undecodable", f"a stored numpy {dt.str} value must be a string")
        if kind in "iu":
            return dt.type(int(text))
        if kind in "Mm":
            count = int(np.iinfo(np.int64).min) if text == "NaT" else int(text)
            return np.array(count, dtype=np.int64).view(dt)[()]
        if kind == "U":
            return dt.type(text)
        if kind == "S":
            return dt.type(base64.b64decode(text, validate=True))
        raise CodecError("undecodable", f"a stored numpy scalar of dtype {dt.str!r} is not supported")

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        if not (
            isinstance(doc, dict)
            and set(doc) == {"dtype", "value"}
            and isinstance(doc["dtype"], str)
            and _SCALAR_DTYPE.fullmatch(doc["dtype"])
        ):
            raise CodecError("undecodable", "a stored numpy scalar must be {'dtype': dtype.str, 'value'}")
        try:
            dt = self._np.dtype(doc["dtype"])
            value = self._build(dt, doc["value"])
            form = self._form(value)
        except CodecError as exc:
            if exc.code == "undecodable":
                raise
            raise CodecError(
                "undecodable", f"a stored numpy scalar is not supported: {exc.message}", cause=exc
            ) from exc
        except (TypeError, ValueError, OverflowError, binascii.Error) as exc:
            raise CodecError(
                "undecodable", f"a stored numpy {doc['dtype']} value is malformed: {exc}", cause=exc
            ) from exc
        # Only a canonical document is accepted: the value must write back exactly what was read (a float16 that
        # would round, an out-of-range count, a byte order numpy normalises away are all refused).
        if form != doc:
            raise CodecError(
                "undecodable", f"a stored numpy {doc['dtype']} value is not in its canonical form"
            )
        return value

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


# ----------------------------------------------------------------------------------------------- pyarrow


class _HashingStream:
    """A write-only file object for ``pyarrow.ipc.new_stream`` that hashes what it is given instead of keeping it."""

    closed = False

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hash.update(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        """Nothing is buffered."""

    def close(self) -> None:
        self.closed = True


class _Arrow:
    """The canonical IPC stream shared by the Table and pandas codecs."""

    def __init__(self, pa: Any) -> None:
        self.pa = pa

    def _write(self, table: Any, out: Any) -> None:
        pa = self.pa
        table = table.combine_chunks()  # chunking is not part of the value: at most one batch is written
        options = pa.ipc.IpcWriteOptions(compression=None)
        with pa.ipc.new_stream(out, table.schema, options=options) as writer:
            if table.num_rows:
                for batch in table.to_batches():
                    writer.write_batch(batch)

    def stream(self, table: Any) -> Any:
        """The canonical Arrow IPC stream of ``table`` as one ``pyarrow.Buffer`` (sized first, written once)."""
        pa = self.pa
        sizer = pa.MockOutputStream()
        self._write(table, sizer)
        buf = pa.allocate_buffer(sizer.size())
        self._write(table, pa.FixedSizeBufferWriter(buf))
        return buf

    def digest_form(self, table: Any) -> JSON:
        """``{"sha256", "size"}`` of :meth:`stream` without assembling it: Arrow hands the body buffers to the hash
        zero-copy, so keying costs about one SHA-256 pass over the data."""
        out = _HashingStream()
        self._write(table, out)
        return {"sha256": out.hash.hexdigest(), "size": out.size}

    def read(self, data: bytes, what: str) -> Any:
        """Parse a verified stream (no code runs: Arrow IPC is data) and validate every buffer and offset."""
        pa = self.pa
        try:
            with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
                table = reader.read_all()
            table.validate(full=True)
        except (pa.ArrowException, ValueError, TypeError, OSError) as exc:
            raise CodecError(
                "undecodable", f"stored {what} is not a valid Arrow IPC stream: {exc}", cause=exc
            ) from exc
        return table


class ArrowTableCodec:
    """``pyarrow.Table``: its canonical IPC stream (schema incl. metadata + data; chunking ignored)."""

    tag = "pyarrow.Table"

    def __init__(self, arrow: _Arrow) -> None:
        self._arrow = arrow

    def handles(self, value: Any) -> bool:
        return type(value) is self._arrow.pa.Table

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        known = _IDENTITIES.lookup(value)
        if known is not None:
            return known
        return {"format": ARROW_FORMAT, "data": self._arrow.digest_form(value)}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        return {"format": ARROW_FORMAT, "data": _store(self._arrow.stream(value), sink, "Arrow table")}

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        _check_format(doc, "Arrow table")
        data, digest = _fetch(doc["data"], source, "Arrow table")
        table = self._arrow.read(data, "Arrow table")
        key = {"format": ARROW_FORMAT, "data": {"sha256": digest or _sha256(data), "size": len(data)}}
        _remember_table(table, key)
        return table

    def blob_digests(self, doc: JSON) -> list[str]:
        return _blob_digests(doc)


def _remember_table(table: Any, key: JSON) -> None:
    _IDENTITIES.remember(table, key, lambda t: True)  # immutable, zero-copy over the verified bytes
    carry(type(table), _arrive, lambda t: t)


def _pandas_snapshot(obj: Any) -> Any:
    # A Copy-on-Write shallow copy: shares the blocks as they are now, and no write to `obj` can reach it.
    return obj.copy(deep=False)


def _arrive(key: JSON, obj: Any) -> Any:
    """Unpickling hook of a travelling decoded value (``_identity.carry``): remember ``obj`` under the key form
    its sender vouched for, with this process's own guard, so it keys without hashing here and travels on."""
    if type(obj).__module__.split(".", 1)[0] == "pyarrow":
        _remember_table(obj, key)
    else:
        _shared_pandas().remember(obj, key)
    return obj


# ------------------------------------------------------------------------------------------------ pandas


def _is_nested(pa: Any, typ: Any) -> bool:
    t = pa.types
    return bool(
        t.is_list(typ)
        or t.is_large_list(typ)
        or t.is_fixed_size_list(typ)
        or t.is_struct(typ)
        or t.is_map(typ)
    )


_LEAVES = (str, int, float, bool, bytes, type(None))


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same plain data, type for type (``1`` is not ``1.0``, ``[]`` is not ``()``)."""
    t = type(a)
    if t is not type(b):
        return False
    if t is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if t is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if t is float:
        return (a != a and b != b) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    return t in _LEAVES and a == b


class _Pandas:
    """DataFrame ↔ canonical stream, the object-column rule and the Copy-on-Write identity guard."""

    def __init__(self, pd: Any, arrow: _Arrow) -> None:
        self.pd = pd
        self.arrow = arrow

    def _check_objects(self, df: Any) -> dict[int, Any]:
        """Refuse object columns/index levels with no exact Arrow form; return {position: Arrow type} of the
        object columns holding lists/dicts (see the module docstring)."""
        infer = self.pd.api.types.infer_dtype
        nested: dict[int, Any] = {}
        for position, (label, col) in enumerate(df.items()):
            if col.dtype != object:
                continue
            held = infer(col, skipna=True)
            if held in ("string", "empty"):
                continue
            typ = self._nested_type(col) if held == "mixed" else None
            if typ is None:
                raise CodecError(
                    "invalid_value",
                    f"DataFrame column {label!r} has dtype object holding {held} values: only str (or missing) "
                    "values, or lists/dicts of plain data that Arrow stores exactly (same keys in every dict, "
                    "None where missing), have an exact stored form; convert the column (e.g. .astype(...)) — "
                    "Python objects are never pickled",
                )
            nested[position] = typ
        for level in range(df.index.nlevels):
            values = df.index.get_level_values(level)
            if values.dtype == object and infer(values, skipna=True) not in ("string", "empty"):
                raise CodecError(
                    "invalid_value",
                    f"DataFrame index level {level} has dtype object holding {infer(values, skipna=True)} values: "
                    "only str values have an exact stored form; convert the index first",
                )
        return nested

    def _nested_type(self, col: Any) -> Any:
        """The Arrow list/struct type of an object column of lists/dicts, or None when it has no exact one."""
        pa = self.arrow.pa
        values = list(col)
        present = [v for v in values if v is not None]
        if not present or any(type(v) not in (list, dict) for v in present):
            return None
        try:
            arr = pa.array(values, from_pandas=True)  # the inference Table.from_pandas runs on this column
            if not _is_nested(pa, arr.type):
                return None
            back = arr.to_pylist()
            # Exactness is proved value by value: a weaker form (ints widened to floats, ragged dicts filled with
            # None, NaN turned null, tuples turned lists) would key two different frames alike.
            same = all(_same(a, b) for a, b in zip(values, back, strict=True))
        except (pa.ArrowException, ValueError, TypeError, OverflowError, RecursionError):
            return None
        return arr.type if same else None

    def table(self, df: Any) -> Any:
        """The Arrow table whose canonical stream is ``df``'s stored form (the module docstring's key rule)."""
        pa = self.arrow.pa
        nested = self._check_objects(df)
        try:
            # preserve_index=None: a RangeIndex is recorded exactly (start/stop/step/name) in the pandas metadata,
            # any other index is stored as columns; either way the index is part of the key.
            table = pa.Table.from_pandas(df, preserve_index=None)
        except (pa.ArrowException, ValueError, TypeError) as exc:
            raise CodecError(
                "invalid_value", f"the DataFrame has no Arrow form (pyarrow refused it: {exc})", cause=exc
            ) from exc
        for position, typ in nested.items():
            # Data columns come first, in order: the type checked for exactness must be the one written.
            if table.schema.field(position).type != typ:
                raise CodecError(
                    "invalid_value",
                    f"DataFrame column {df.columns[position]!r} of lists/dicts was converted to "
                    f"{table.schema.field(position).type}, not the {typ} checked to read back exactly",
                )
        meta = dict(table.schema.metadata or {})
        if b"pandas" in meta:
            pandas_meta = json.loads(meta[b"pandas"])
            for field in _VERSION_FIELDS:
                pandas_meta.pop(field, None)
            meta[b"pandas"] = json.dumps(pandas_meta, sort_keys=True, separators=(",", ":")).encode()
        return table.replace_schema_metadata(meta)

    def frame(self, data: bytes, what: str) -> Any:
        table = self.arrow.read(data, what)
        if b"pandas" not in (table.schema.metadata or {}):
            raise CodecError("undecodable", f"stored {what} carries no pandas schema metadata")
        pa, pd = self.arrow.pa, self.pd

        def nested_as_arrow(typ: Any) -> Any:
            # pd.ArrowDtype columns of nested types are recorded as e.g. "list<item: int64>[pyarrow]", which
            # pandas cannot parse back; object columns of lists/dicts are turned back into Python values below.
            return pd.ArrowDtype(typ) if _is_nested(pa, typ) else None

        try:
            df = table.to_pandas(types_mapper=nested_as_arrow)
            self._restore_objects(table, df, what)
        except (pa.ArrowException, ValueError, TypeError, KeyError) as exc:
            raise CodecError(
                "undecodable", f"stored {what} does not convert back to pandas: {exc}", cause=exc
            ) from exc
        return df

    def _restore_objects(self, table: Any, df: Any, what: str) -> None:
        """Give the object columns that held lists/dicts their Python values back (not numpy arrays or ArrowDtype)."""
        pa, np = self.arrow.pa, self._np()
        meta = json.loads(table.schema.metadata[b"pandas"])
        columns = meta.get("columns") if isinstance(meta, dict) else None
        indexes = meta.get("index_columns") if isinstance(meta, dict) else None
        if not isinstance(columns, list) or not isinstance(indexes, list):
            raise CodecError("undecodable", f"stored {what} has malformed pandas schema metadata")
        objects = {
            c.get("field_name") for c in columns if isinstance(c, dict) and c.get("numpy_type") == "object"
        }
        data = [f for f in table.schema if f.name not in {i for i in indexes if isinstance(i, str)}]
        wanted = [(pos, f) for pos, f in enumerate(data) if f.name in objects and _is_nested(pa, f.type)]
        if not wanted:
            return
        if len(data) != df.shape[1]:
            raise CodecError("undecodable", f"stored {what} has {len(data)} data columns for {df.shape[1]}")
        for pos, field in wanted:
            cells = np.empty(len(df), dtype=object)
            for i, cell in enumerate(table.column(field.name).to_pylist()):
                cells[i] = cell  # one by one: a slice assignment would broadcast the nested lists
            df.isetitem(pos, cells)

    @staticmethod
    def _np() -> Any:
        import numpy as np  # a dependency of pandas: already imported once a DataFrame is decoded

        return np

    # -- identity guard (see the module docstring) --

    def _cow(self) -> bool:
        pd = self.pd
        if int(pd.__version__.split(".")[0]) >= 3:
            return True
        try:
            return pd.get_option("mode.copy_on_write") is True
        except (KeyError, pd.errors.OptionError):
            return False

    @staticmethod
    def _blocks(obj: Any) -> tuple[tuple[Any, tuple[int, ...]], ...] | None:
        mgr = getattr(obj, "_mgr", None)
        blocks = getattr(mgr, "blocks", None)
        if blocks is None:
            return None
        out = []
        for blk in blocks:
            locs = getattr(getattr(blk, "mgr_locs", None), "as_array", None)
            values = getattr(blk, "values", None)
            if locs is None or values is None:
                return None
            out.append((values, tuple(int(i) for i in locs)))
        return tuple(out)

    def _state(self, obj: Any) -> tuple[Any, ...] | None:
        blocks = self._blocks(obj)
        if blocks is None:
            return None
        axes: tuple[Any, ...] = (obj.index, tuple(obj.index.names))
        if isinstance(obj, self.pd.DataFrame):
            axes += (obj.columns, tuple(obj.columns.names))
        else:
            axes += (None, (type(obj.name), obj.name))
        return (blocks, *axes)

    def remember(self, obj: Any, key: JSON) -> None:
        if not self._cow():
            return  # without Copy-on-Write an in-place write cannot be detected: always hash again
        state = self._state(obj)
        if state is None:
            return
        # A shallow copy shares every block: Copy-on-Write then makes ANY in-place write to `obj` copy the block
        # first, so an unchanged block is the very same values object as at decode time.
        shadow = obj.copy(deep=False)

        def unchanged(o: Any, state: tuple[Any, ...] = state, shadow: Any = shadow) -> bool:
            now = self._state(o)
            if now is None or not self._cow():
                return False
            blocks, index, index_names, columns, column_names = state
            nblocks, nindex, nindex_names, ncolumns, ncolumn_names = now
            return (
                len(blocks) == len(nblocks)
                and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(blocks, nblocks, strict=True))
                and index is nindex
                and columns is ncolumns
                and index_names == nindex_names
                and column_names == ncolumn_names
            )

        _IDENTITIES.remember(obj, key, unchanged)
        carry(type(obj), _arrive, _pandas_snapshot)


class DataFrameCodec:
    """``pandas.DataFrame`` (exact type) through its canonical Arrow stream (see the module docstring)."""

    tag = "pandas.DataFrame"

    def __init__(self, pandas: _Pandas) -> None:
        self._pandas = pandas

    def handles(self, value: Any) -> bool:
        return type(value) is self._pandas.pd.DataFrame

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        known = _IDENTITIES.lookup(value)
        if known is not None:
            return known
        return {"format": ARROW_FORMAT, "data": self._pandas.arrow.digest_form(self._pandas.table(value))}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        stream = self._pandas.arrow.stream(self._pandas.table(value))
        return {"format": ARROW_FORMAT, "data": _store(stream, sink, "DataFrame")}

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        _check_format(doc, "DataFrame")
        data, digest = _fetch(doc["data"], source, "DataFrame")
        df = self._pandas.frame(data, "DataFrame")
        if type(df) is not self._pandas.pd.DataFrame:
            raise CodecError("undecodable", f"stored DataFrame decoded to {type_name(df)}")
        key = {"format": ARROW_FORMAT, "data": {"sha256": digest or _sha256(data), "size": len(data)}}
        self._pandas.remember(df, key)
        return df

    def blob_digests(self, doc: JSON) -> list[str]:
        return _blob_digests(doc)


class SeriesCodec:
    """``pandas.Series`` (exact type): a one-column frame's canonical Arrow stream plus the series name."""

    tag = "pandas.Series"

    def __init__(self, pandas: _Pandas) -> None:
        self._pandas = pandas

    def handles(self, value: Any) -> bool:
        return type(value) is self._pandas.pd.Series

    @staticmethod
    def _name(series: Any) -> JSON:
        name = series.name
        if name is None or type(name) in (str, int):
            return name
        raise CodecError(
            "invalid_value",
            f"a Series name must be a str, an int or None to be stored, got {type_name(name)}",
        )

    def _table(self, series: Any) -> Any:
        return self._pandas.table(series.to_frame(name=_SERIES_COLUMN))

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        known = _IDENTITIES.lookup(value)
        if known is not None:
            return known
        name = self._name(value)
        return {
            "format": ARROW_FORMAT,
            "name": name,
            "data": self._pandas.arrow.digest_form(self._table(value)),
        }

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        name = self._name(value)
        return {
            "format": ARROW_FORMAT,
            "name": name,
            "data": _store(self._pandas.arrow.stream(self._table(value)), sink, "Series"),
        }

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        _check_format(doc, "Series", frozenset({"name"}))
        name = doc["name"]
        if not (name is None or type(name) in (str, int)):
            raise CodecError("undecodable", "stored Series name must be a str, an int or null")
        data, digest = _fetch(doc["data"], source, "Series")
        df = self._pandas.frame(data, "Series")
        if list(df.columns) != [_SERIES_COLUMN]:
            raise CodecError("undecodable", f"stored Series must be one column named {_SERIES_COLUMN!r}")
        series = df[_SERIES_COLUMN].rename(name)
        key = {
            "format": ARROW_FORMAT,
            "name": name,
            "data": {"sha256": digest or _sha256(data), "size": len(data)},
        }
        self._pandas.remember(series, key)
        return series

    def blob_digests(self, doc: JSON) -> list[str]:
        return _blob_digests(doc)


# ------------------------------------------------------------------------------------------------- entry


class _Lazy:
    """A codec whose library is imported on first real use (module docstring). ``root`` is the top-level module
    a value of this type is defined under; ``build`` imports the library and returns the real codec."""

    def __init__(self, tag: str, root: str, build: Callable[[], ValueCodec]) -> None:
        self.tag = tag
        self._root = root
        self._build = build
        self._real: ValueCodec | None = None
        self._lock = threading.Lock()

    def _codec(self) -> ValueCodec:
        if self._real is None:
            with self._lock:
                if self._real is None:
                    self._real = self._build()
        return self._real

    def handles(self, value: Any) -> bool:
        # A value of the library's type can exist only once the library is imported: never import to answer.
        module = type(value).__module__
        if module.split(".", 1)[0] != self._root or self._root not in sys.modules:
            return False
        return self._codec().handles(value)

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return self._codec().key_form(value, registry)

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        return self._codec().encode(value, registry, sink)

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        return self._codec().decode(doc, registry, source)

    def blob_digests(self, doc: JSON) -> list[str]:
        return self._codec().blob_digests(doc)


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def scalar_codecs() -> list[ValueCodec]:
    """The numpy-scalar codec when numpy is installed, lazily (kept apart from :func:`frame_codecs`, whose tags
    are the array/frame containers)."""
    if not _installed("numpy"):
        return []

    def numpy_scalar_codec() -> ValueCodec:
        import numpy as np

        return NumpyScalarCodec(np)

    return [_Lazy(NumpyScalarCodec.tag, "numpy", numpy_scalar_codec)]


def frame_codecs() -> list[ValueCodec]:
    """The optional-extras codecs whose libraries are installed (numpy; pyarrow; pandas + pyarrow), lazily."""
    codecs: list[ValueCodec] = []
    if _installed("numpy"):

        def numpy_codec() -> ValueCodec:
            import numpy as np

            return NumpyArrayCodec(np)

        codecs.append(_Lazy(NumpyArrayCodec.tag, "numpy", numpy_codec))
    if not _installed("pyarrow"):
        # pandas values are stored through Arrow: without pyarrow there is no pandas codec either
        return codecs
    codecs.append(_Lazy(ArrowTableCodec.tag, "pyarrow", lambda: ArrowTableCodec(_shared_arrow())))
    if not _installed("pandas"):
        return codecs
    codecs.append(_Lazy(DataFrameCodec.tag, "pandas", lambda: DataFrameCodec(_shared_pandas())))
    codecs.append(_Lazy(SeriesCodec.tag, "pandas", lambda: SeriesCodec(_shared_pandas())))
    return codecs


# One helper per library and process: the codecs of every registry and the unpickling hook share them.
_ARROW: list[_Arrow] = []
_PANDAS: list[_Pandas] = []


def _shared_arrow() -> _Arrow:
    with _ARROW_LOCK:
        if not _ARROW:
            import pyarrow as pa
            import pyarrow.ipc  # noqa: F401  (the submodule is not always imported by `import pyarrow`)

            _ARROW.append(_Arrow(pa))
    return _ARROW[0]


def _shared_pandas() -> _Pandas:
    with _ARROW_LOCK:
        if not _PANDAS:
            import pandas as pd

            _PANDAS.append(_Pandas(pd, _shared_arrow()))  # an RLock: re-entered here
    return _PANDAS[0]


_ARROW_LOCK = threading.RLock()
