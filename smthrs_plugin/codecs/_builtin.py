"""The built-in value codecs: pydantic models, dataclasses, ``datetime``/``date``/``time``, ``Decimal``, ``UUID``,
``Enum``, ``tuple``, ``set``/``frozenset``, ``bytes`` and ``pathlib`` paths (:mod:`._paths`).

Invariants
- **Exact types.** Each codec handles its type exactly (``type(v) is datetime``, not a subclass such as pandas'
  ``Timestamp``), except the class-carrying codecs (pydantic, dataclass, Enum), which store the concrete class.
- **Stored means exact.** ``encode`` refuses (``CodecError(invalid_value)``) any value it could not hand back
  equal and of the same type: a naive ``datetime``/``time`` (timezone required), a timezone other than a fixed
  offset or an IANA ``zoneinfo`` zone, a dataclass with ``init=False`` fields, a pydantic model whose JSON dump
  does not validate back to an equal model, a class defined inside a function (no import path). A refused value
  is simply not cached by the dispatch seam; it is never stored in a weaker form.
- **Decoding runs no code the document names.** A class is resolved only among modules this process already
  imported (:func:`._imports.resolve_class`), and must be of the codec's kind (a ``BaseModel`` subclass, a
  dataclass, an ``Enum``) before anything of it is called. A pydantic document also carries the SHA-256 of the
  class's canonical JSON schema: a class changed since the value was stored is refused (``undecodable``), so the
  step runs again rather than validating old data into a new shape. Nothing is ever pickled.
- **Sets in canonical order.** A ``set``/``frozenset`` is keyed and stored as the list of its members sorted by
  the RFC 8785 bytes of each member's key form, so equal sets key identically whatever their insertion order or
  the process's hash seed. A member with no canonical key form (a float NaN, an integer past 2**53) is refused
  (``invalid_value``); a stored set whose members decode unhashable or collide is refused (``undecodable``).
- **Bytes by digest.** The key form of ``bytes`` is always ``{"sha256", "size"}``; the stored form carries the
  bytes inline (base64) up to :data:`INLINE_LIMIT`, else only the digest after ``sink.put`` (the dispatch seam's
  sink is the content-addressed artifact store, so the blob is published with the entry). Every read is verified
  against the digest and size.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as _dt
import hashlib
import uuid
import weakref
import zoneinfo
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import Any

import pydantic

from ..canonical import canonical_bytes
from ..errors import CanonicalError, CodecError
from ._imports import class_path, resolve_class
from ._paths import PathCodec
from .registry import JSON, MARKER, BlobSink, BlobSource, CodecRegistry, type_name

__all__ = ["INLINE_LIMIT", "builtin_codecs"]

#: ``bytes`` up to this size are stored inline (base64) in the entry; larger ones go to the blob sink.
INLINE_LIMIT = 64 * 1024
_HEX = frozenset("0123456789abcdef")


def _doc(doc: Any, keys: set[str], tag: str) -> dict[str, Any]:
    if type(doc) is not dict or set(doc) != keys:
        raise CodecError("undecodable", f"a stored {tag} value must be an object with keys {sorted(keys)}")
    return doc


def _str(doc: Any, tag: str) -> str:
    if type(doc) is not str:
        raise CodecError("undecodable", f"a stored {tag} value must be a string, got {type_name(doc)}")
    return doc


def _exact(original: Any, rebuilt: Any, what: str) -> None:
    """Refuse to store ``original`` unless ``rebuilt`` (what a hit would return) is equal and of the same type."""
    if type(rebuilt) is not type(original) or rebuilt != original:
        raise CodecError(
            "invalid_value",
            f"{what} {type_name(original)} does not read back equal to itself from its stored form, so it cannot"
            " be cached exactly; make it round-trip (or return plain data)",
            type=type_name(original),
        )


# -- pydantic ----------------------------------------------------------------------------------------------------

_SCHEMA_DIGESTS: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def schema_digest(cls: type[pydantic.BaseModel]) -> str:
    """SHA-256 of the RFC 8785 form of ``cls.model_json_schema()`` (cached per class)."""
    digest = _SCHEMA_DIGESTS.get(cls)
    if digest is None:
        try:
            digest = hashlib.sha256(canonical_bytes(cls.model_json_schema())).hexdigest()
        except (CanonicalError, pydantic.PydanticUserError, TypeError, ValueError) as exc:
            raise CodecError(
                "invalid_value",
                f"pydantic model {type_name(cls)} has no JSON schema ({exc}), so its stored form could not be"
                " checked against it; give its fields JSON-schema-able types",
                cause=exc,
            ) from exc
        _SCHEMA_DIGESTS[cls] = digest
    return digest


def _no_marker(data: Any, what: str) -> None:
    stack = [data]
    while stack:
        d = stack.pop()
        if type(d) is dict:
            if MARKER in d:
                raise CodecError(
                    "reserved_key", f"{what} dumps a dict with the reserved key {MARKER!r}; rename that key"
                )
            stack.extend(d.values())
        elif type(d) is list:
            stack.extend(d)


class PydanticCodec:
    """``pydantic.BaseModel`` instances: ``{"class": "module:qualname", "schema": sha256, "data":
    model_dump(mode="json")}``."""

    tag = "pydantic"

    def handles(self, value: Any) -> bool:
        return isinstance(value, pydantic.BaseModel)

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        cls = type(value)
        data = value.model_dump(mode="json")
        _no_marker(data, f"pydantic model {type_name(cls)}")
        return {"class": class_path(cls), "schema": schema_digest(cls), "data": data}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        doc = self.key_form(value, registry)
        resolved = resolve_class(doc["class"], pydantic.BaseModel, "pydantic model")
        if resolved is not type(value):
            raise CodecError(
                "invalid_value",
                f"{doc['class']} names another class than the model's own {type_name(value)}; define it once at"
                " module level",
            )
        try:
            rebuilt = resolved.model_validate(doc["data"])
        except pydantic.ValidationError as exc:
            raise CodecError(
                "invalid_value",
                f"pydantic model {type_name(value)} does not validate from its own JSON dump ({exc.error_count()}"
                " errors), so it cannot be cached exactly",
                cause=exc,
            ) from exc
        _exact(value, rebuilt, "pydantic model")
        return doc

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        d = _doc(doc, {"class", "schema", "data"}, self.tag)
        cls: type[pydantic.BaseModel] = resolve_class(d["class"], pydantic.BaseModel, "pydantic model")
        if schema_digest(cls) != d["schema"]:
            raise CodecError(
                "undecodable",
                f"pydantic model {d['class']} changed since the value was stored (its JSON schema differs); the"
                " step runs again",
                path=d["class"],
            )
        return cls.model_validate(d["data"])

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


# -- dataclasses ---------------------------------------------------------------------------------------------------


class DataclassCodec:
    """Dataclass instances: ``{"class": "module:qualname", "fields": {name: value}}``, fields through the registry."""

    tag = "dataclass"

    def handles(self, value: Any) -> bool:
        return dataclasses.is_dataclass(value) and not isinstance(value, type)

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return {
            "class": class_path(type(value)),
            "fields": {f.name: registry.key_form(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        cls = type(value)
        path = class_path(cls)
        fields = dataclasses.fields(value)
        hidden = [f.name for f in fields if not f.init]
        if hidden:
            raise CodecError(
                "invalid_value",
                f"dataclass {type_name(cls)} has fields set outside __init__ ({', '.join(hidden)}), so a stored"
                " value could not be rebuilt exactly",
            )
        if resolve_class(path, object, "dataclass") is not cls:
            raise CodecError(
                "invalid_value", f"{path} names another class than the dataclass {type_name(cls)}"
            )
        _exact(value, cls(**{f.name: getattr(value, f.name) for f in fields}), "dataclass")
        return {
            "class": path,
            "fields": {f.name: registry.encode(getattr(value, f.name), sink) for f in fields},
        }

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        d = _doc(doc, {"class", "fields"}, self.tag)
        cls = resolve_class(d["class"], object, "dataclass")
        if not dataclasses.is_dataclass(cls):
            raise CodecError(
                "unsafe_codec", f"stored dataclass names {d['class']!r}, which is not a dataclass"
            )
        stored = d["fields"]
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        if type(stored) is not dict or set(stored) != names:
            raise CodecError(
                "undecodable",
                f"dataclass {d['class']} has fields {sorted(names)} now, the stored value has"
                f" {sorted(stored) if type(stored) is dict else stored!r}; the step runs again",
            )
        return cls(**{n: registry.decode(v, source) for n, v in stored.items()})

    def blob_digests(self, doc: JSON) -> list[str]:
        return []  # field values are wrapped: the registry walks them


# -- datetime, date, time ------------------------------------------------------------------------------------------


def _zone(tz: Any, value: Any) -> str | None:
    """None for a fixed offset, the IANA key for a ``ZoneInfo``; any other tzinfo is refused."""
    if type(tz) is _dt.timezone:
        return None
    if type(tz) is zoneinfo.ZoneInfo and tz.key:
        return str(tz.key)
    raise CodecError(
        "invalid_value",
        f"{value!r} uses timezone {tz!r} ({type_name(tz)}); only datetime.timezone offsets and zoneinfo.ZoneInfo"
        " zones have an exact stored form",
    )


class DatetimeCodec:
    """Aware ``datetime``: ``{"iso": ISO 8601 with offset, "zone": IANA key | null}``; naive ones are refused."""

    tag = "datetime"

    def handles(self, value: Any) -> bool:
        return type(value) is _dt.datetime

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        if value.tzinfo is None or value.utcoffset() is None:
            raise CodecError(
                "invalid_value",
                f"datetime {value.isoformat()} is naive: a timezone is required (e.g. tzinfo=datetime.timezone.utc),"
                " because a naive time means different instants on different machines",
            )
        return {"iso": value.isoformat(), "zone": _zone(value.tzinfo, value)}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        doc = self.key_form(value, registry)
        rebuilt = self.decode(doc, registry, None)
        if rebuilt.isoformat() != value.isoformat() or rebuilt.fold != value.fold:
            raise CodecError("invalid_value", f"datetime {value!r} does not read back exactly")
        _exact(value, rebuilt, "datetime")
        return doc

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        d = _doc(doc, {"iso", "zone"}, self.tag)
        parsed = _dt.datetime.fromisoformat(_str(d["iso"], self.tag))
        if parsed.tzinfo is None:
            raise CodecError("undecodable", f"stored datetime {d['iso']!r} has no offset")
        zone = d["zone"]
        if zone is None:
            return parsed
        try:
            return parsed.astimezone(zoneinfo.ZoneInfo(_str(zone, self.tag)))
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise CodecError(
                "undecodable", f"stored datetime names unknown zone {zone!r}", cause=exc
            ) from exc

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


class DateCodec:
    """``date``: ISO 8601 ``YYYY-MM-DD``."""

    tag = "date"

    def handles(self, value: Any) -> bool:
        return type(value) is _dt.date

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return value.isoformat()

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        return value.isoformat()

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        return _dt.date.fromisoformat(_str(doc, self.tag))

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


class TimeCodec:
    """Aware ``time`` with a fixed offset: ISO 8601 with offset; naive ones are refused."""

    tag = "time"

    def handles(self, value: Any) -> bool:
        return type(value) is _dt.time

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        if value.tzinfo is None or value.utcoffset() is None:
            raise CodecError(
                "invalid_value",
                f"time {value.isoformat()} is naive: a timezone is required (a fixed offset, e.g."
                " tzinfo=datetime.timezone.utc)",
            )
        if type(value.tzinfo) is not _dt.timezone:
            raise CodecError(
                "invalid_value",
                f"time {value!r}: only a fixed datetime.timezone offset has an exact stored form",
            )
        return value.isoformat()

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        doc = self.key_form(value, registry)
        rebuilt = self.decode(doc, registry, None)
        if rebuilt.isoformat() != doc or rebuilt.fold != value.fold:
            raise CodecError("invalid_value", f"time {value!r} does not read back exactly")
        return doc

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        t = _dt.time.fromisoformat(_str(doc, self.tag))
        if t.tzinfo is None:
            raise CodecError("undecodable", f"stored time {doc!r} has no offset")
        return t

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


# -- Decimal, UUID -------------------------------------------------------------------------------------------------


class DecimalCodec:
    """``Decimal``: its ``str`` (keeps the exponent: ``1.0`` and ``1.00`` are different keys)."""

    tag = "decimal"

    def handles(self, value: Any) -> bool:
        return type(value) is Decimal

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return str(value)

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        return str(value)

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        try:
            return Decimal(_str(doc, self.tag))
        except InvalidOperation as exc:
            raise CodecError("undecodable", f"stored decimal {doc!r} is not a number", cause=exc) from exc

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


class UUIDCodec:
    """``UUID``: its canonical hyphenated lowercase ``str``."""

    tag = "uuid"

    def handles(self, value: Any) -> bool:
        return type(value) is uuid.UUID

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return str(value)

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        return str(value)

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        return uuid.UUID(_str(doc, self.tag))

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


# -- Enum ------------------------------------------------------------------------------------------------------------


class EnumCodec:
    """``Enum`` members: ``{"class": "module:qualname", "value": member value}`` (the value through the registry)."""

    tag = "enum"

    def handles(self, value: Any) -> bool:
        return isinstance(value, Enum)

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return {"class": class_path(type(value)), "value": registry.key_form(value.value)}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        cls = type(value)
        path = class_path(cls)
        if resolve_class(path, Enum, "enum") is not cls:
            raise CodecError("invalid_value", f"{path} names another class than the enum {type_name(cls)}")
        _exact(value, cls(value.value), "enum member")
        return {"class": path, "value": registry.encode(value.value, sink)}

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        d = _doc(doc, {"class", "value"}, self.tag)
        cls = resolve_class(d["class"], Enum, "enum")
        try:
            return cls(registry.decode(d["value"], source))
        except ValueError as exc:
            raise CodecError(
                "undecodable",
                f"enum {d['class']} has no member with the stored value; the step runs again",
                cause=exc,
            ) from exc

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


# -- tuple, bytes ----------------------------------------------------------------------------------------------------


class TupleCodec:
    """``tuple`` (exactly; a namedtuple needs its own codec): the list of its items, read back as a tuple."""

    tag = "tuple"

    def handles(self, value: Any) -> bool:
        return type(value) is tuple

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return [registry.key_form(v) for v in value]

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        return [registry.encode(v, sink) for v in value]

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        if type(doc) is not list:
            raise CodecError("undecodable", f"a stored tuple must be a list, got {type_name(doc)}")
        return tuple(registry.decode(v, source) for v in doc)

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


class SetCodec:
    """``set`` (exactly): its members sorted by the canonical bytes of their key forms, read back as a set."""

    tag = "set"
    kind: type[set[Any]] | type[frozenset[Any]] = set

    def handles(self, value: Any) -> bool:
        return type(value) is self.kind

    def _ordered(self, value: Any, registry: CodecRegistry) -> list[tuple[bytes, JSON, Any]]:
        # Iteration order follows the hash seed (str hashes differ per process): the canonical bytes of each
        # member's key form give an order that does not.
        out = []
        for member in value:
            form = registry.key_form(member)
            try:
                raw = canonical_bytes(form)
            except CanonicalError as exc:
                raise CodecError(
                    "invalid_value",
                    f"a {self.tag} member ({type_name(member)}) has no canonical key form: {exc.message}",
                    cause=exc,
                    type=type_name(member),
                ) from exc
            out.append((raw, form, member))
        out.sort(key=lambda item: item[0])
        return out

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return [form for _, form, _ in self._ordered(value, registry)]

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        ordered = self._ordered(value, registry)
        if len({raw for raw, _, _ in ordered}) != len(ordered):
            raise CodecError(
                "invalid_value",
                f"two members of a {self.tag} have the same key form, so it would read back smaller; make its"
                " members distinct values",
            )
        return [registry.encode(member, sink) for _, _, member in ordered]

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        if type(doc) is not list:
            raise CodecError("undecodable", f"a stored {self.tag} must be a list, got {type_name(doc)}")
        members = [registry.decode(m, source) for m in doc]
        try:
            out = self.kind(members)
        except TypeError as exc:  # a member decoded to a list, dict or set: a forged or foreign document
            raise CodecError(
                "undecodable", f"a stored {self.tag} holds an unhashable member: {exc}", cause=exc
            ) from exc
        if len(out) != len(members):
            raise CodecError("undecodable", f"a stored {self.tag} lists one member more than once")
        return out

    def blob_digests(self, doc: JSON) -> list[str]:
        return []  # members are wrapped: the registry walks them


class FrozensetCodec(SetCodec):
    """``frozenset`` (exactly): as :class:`SetCodec`, read back as a frozenset."""

    tag = "frozenset"
    kind = frozenset


def _digest_doc(doc: Any) -> tuple[str, int]:
    if type(doc) is not dict or not {"sha256", "size"} <= set(doc) <= {"sha256", "size", "b64"}:
        raise CodecError("undecodable", "a stored bytes value must be {sha256, size[, b64]}")
    sha, size = doc["sha256"], doc["size"]
    if type(sha) is not str or len(sha) != 64 or not set(sha) <= _HEX or type(size) is not int or size < 0:
        raise CodecError("undecodable", "a stored bytes value has a malformed sha256 or size")
    return sha, size


class BytesCodec:
    """``bytes``: key ``{"sha256", "size"}``; stored inline (``b64``) up to :data:`INLINE_LIMIT`, else in the sink."""

    tag = "bytes"

    def __init__(self, inline_limit: int = INLINE_LIMIT) -> None:
        self.inline_limit = inline_limit

    def handles(self, value: Any) -> bool:
        return type(value) is bytes

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        return {"sha256": hashlib.sha256(value).hexdigest(), "size": len(value)}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        doc: dict[str, Any] = self.key_form(value, registry)
        if sink is None or len(value) <= self.inline_limit:
            doc["b64"] = base64.b64encode(value).decode("ascii")
            return doc
        stored = sink.put(value)
        if stored != doc["sha256"]:
            raise CodecError(
                "invalid_value", f"the blob sink stored {len(value)} bytes as {stored}, not {doc['sha256']}"
            )
        return doc

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        sha, size = _digest_doc(doc)
        if "b64" in doc:
            try:
                data = base64.b64decode(_str(doc["b64"], self.tag), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise CodecError("undecodable", "a stored bytes value is not base64", cause=exc) from exc
        else:
            if source is None:
                raise CodecError(
                    "undecodable", f"stored bytes {sha} live in the artifact store, and none was given"
                )
            data = source.get(sha)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise CodecError("undecodable", f"stored bytes do not match their recorded digest {sha}")
        return data

    def blob_digests(self, doc: JSON) -> list[str]:
        sha, _ = _digest_doc(doc)
        return [] if "b64" in doc else [sha]


def _core_codecs() -> list[Any]:
    return [
        PydanticCodec(),
        DataclassCodec(),
        DatetimeCodec(),
        DateCodec(),
        TimeCodec(),
        DecimalCodec(),
        UUIDCodec(),
        EnumCodec(),
        TupleCodec(),
        SetCodec(),
        FrozensetCodec(),
        BytesCodec(),
        PathCodec(),
    ]


def builtin_codecs() -> list[Any]:
    """Fresh instances of every built-in codec, plus the numpy-scalar and data-frame codecs whose libraries are
    installed."""
    codecs = _core_codecs()
    try:
        from .frames import frame_codecs, scalar_codecs
    except ModuleNotFoundError as exc:
        # Only the optional module itself being absent is tolerated (a partial checkout); any other import
        # failure inside it propagates.
        if exc.name != __name__.rsplit(".", 1)[0] + "._frames":
            raise
        return codecs
    codecs.extend(scalar_codecs())
    codecs.extend(frame_codecs())
    return codecs
