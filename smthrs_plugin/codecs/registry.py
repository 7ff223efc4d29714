"""The codec registry: one place that turns a Python value into plain JSON for keys and for stored results, and
back.

Invariants
- **One wrapper, never ambiguous.** A typed value is the JSON object ``{"$smthrs": <tag>, "v": <codec doc>}``; a
  plain dict carrying the key ``"$smthrs"`` is refused (``CodecError(reserved_key)``), so a user's data can never be
  read back as a typed value.
- **Plain JSON passes through by exact type** (``dict`` with ``str`` keys, ``list``, ``str``, ``int``, ``float``,
  ``bool``, ``None``): a subclass (an ``IntEnum``, a ``str`` subclass) is NOT plain and needs a codec, so a value
  is never silently narrowed to its base type. Containers recurse; anything else goes to the codec that handles
  it, or is ``CodecError(no_codec)`` naming the type and the ``smthrs_value_codecs`` hook — never a weaker form.
- **Later registrations are asked first** (plugins are registered after the built-ins), so a plugin's codec for a
  specific class wins over a generic built-in (the dataclass codec) for that class.
- **Too deep is typed.** A value nested past :data:`MAX_DEPTH` plain levels, or so deep through codecs (tuples
  of sets of tuples...) that the interpreter's stack runs out, is ``CodecError(invalid_value)`` when keyed or
  stored and ``CodecError(undecodable)`` when decoded — never a raw ``RecursionError``.
- **Decoding never runs code named by the document.** Only a registered codec's ``decode`` reads a typed document
  (an unknown tag is ``CodecError(undecodable)``); built-in codecs that resolve a class by its import path only
  look it up among modules already imported in this process (:mod:`._imports`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from ..canonical import MAX_DEPTH
from ..errors import CodecError, SmthrsError

__all__ = [
    "JSON",
    "MARKER",
    "HOOK_NAME",
    "BlobSink",
    "BlobSource",
    "ValueCodec",
    "CodecRegistry",
    "type_name",
]

JSON = Any
#: The reserved key of a typed value's wrapper object.
MARKER = "$smthrs"
#: The pluggy hook a third party implements to add codecs (named in every ``no_codec`` refusal).
HOOK_NAME = "smthrs_value_codecs"

_PLAIN_SCALARS = (str, int, float, bool, type(None))


@runtime_checkable
class BlobSink(Protocol):
    """Where an encoder puts large byte payloads: ``put(data)`` stores them content-addressed, returns the hex
    SHA-256."""

    def put(self, data: bytes) -> str: ...


@runtime_checkable
class BlobSource(Protocol):
    """Where a decoder reads payloads referenced by digest; raises the store's typed error when missing/corrupt."""

    def get(self, digest: str) -> bytes: ...


@runtime_checkable
class ValueCodec(Protocol):
    """One type's codec (see the package docstring for the contract of each method)."""

    tag: str

    def handles(self, value: Any) -> bool: ...

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON: ...

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON: ...

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any: ...

    def blob_digests(self, doc: JSON) -> list[str]: ...


def _too_deep(code: str, what: str, exc: RecursionError) -> CodecError:
    # A codec re-enters the registry for its members (a tuple's items, a set's members), which starts a fresh
    # depth count: the interpreter's stack is then the bound, and running out of it must still be a typed refusal.
    return CodecError(
        code, f"{what} nested too deeply to walk (or a cycle through a tuple or set)", cause=exc
    )


def type_name(value_or_type: Any) -> str:
    """``module.qualname`` of a value's type (or of a type), for messages."""
    t = value_or_type if isinstance(value_or_type, type) else type(value_or_type)
    return f"{t.__module__}.{t.__qualname__}"


class CodecRegistry:
    """Codecs by tag; see the module invariants. Not thread-safe while registering; read-only use (keying,
    encoding, decoding) from many threads is safe once built."""

    def __init__(self, codecs: Iterable[ValueCodec] = ()) -> None:
        self._by_tag: dict[str, ValueCodec] = {}
        self._order: list[ValueCodec] = []  # most recently registered first
        for c in codecs:
            self.register(c)

    def register(self, codec: ValueCodec) -> None:
        """Add ``codec``; a tag already registered is ``CodecError(duplicate_codec)``."""
        tag = getattr(codec, "tag", None)
        if not isinstance(tag, str) or not tag:
            raise CodecError(
                "invalid_value", f"codec {codec!r} has no tag; give it a stable, non-empty `tag: str`"
            )
        for method in ("handles", "key_form", "encode", "decode", "blob_digests"):
            if not callable(getattr(codec, method, None)):
                raise CodecError(
                    "invalid_value", f"codec {tag!r} ({type_name(codec)}) has no {method}() method", tag=tag
                )
        if tag in self._by_tag:
            raise CodecError(
                "duplicate_codec",
                f"two codecs claim the tag {tag!r}: {type_name(self._by_tag[tag])} and {type_name(codec)};"
                " uninstall one of the plugins providing them or rename one tag",
                tag=tag,
            )
        self._by_tag[tag] = codec
        self._order.insert(0, codec)

    def tags(self) -> list[str]:
        """Every registered tag, sorted."""
        return sorted(self._by_tag)

    def codec_for(self, value: Any) -> ValueCodec | None:
        """The codec that handles ``value`` (most recently registered first), or None."""
        for c in self._order:
            if c.handles(value):
                return c
        return None

    # -- the three walks -------------------------------------------------------------------------------------

    def key_form(self, value: Any) -> JSON:
        """Plain JSON folded into keys (canonicalise it with ``canonical_bytes``)."""
        try:
            return self._walk(value, 0, lambda c, v: c.key_form(v, self))
        except RecursionError as exc:
            raise _too_deep("invalid_value", "value", exc) from exc

    def encode(self, value: Any, sink: BlobSink | None = None) -> JSON:
        """Plain JSON stored for ``value``; payloads over a codec's inline limit go to ``sink``."""
        try:
            return self._walk(value, 0, lambda c, v: c.encode(v, self, sink))
        except RecursionError as exc:
            raise _too_deep("invalid_value", "value", exc) from exc

    def decode(self, doc: JSON, source: BlobSource | None = None) -> Any:
        """The value :meth:`encode` stored as ``doc``; ``CodecError`` on anything unexpected."""
        try:
            return self._decode(doc, source, 0)
        except RecursionError as exc:
            raise _too_deep("undecodable", "stored value", exc) from exc

    def blob_digests(self, doc: JSON) -> list[str]:
        """Every digest an encoded ``doc`` references (sorted, unique): what must be published with it."""
        out: set[str] = set()
        stack: list[Any] = [doc]
        while stack:
            d = stack.pop()
            if type(d) is dict:
                if MARKER in d:
                    codec = self._tagged(d)
                    out.update(codec.blob_digests(d["v"]))
                    # A codec's doc may itself hold wrapped values (a dataclass field of bytes): walk it too.
                    stack.append(d["v"])
                else:
                    stack.extend(d.values())
            elif type(d) is list:
                stack.extend(d)
        return sorted(out)

    def _walk(self, value: Any, depth: int, typed: Any) -> JSON:
        if depth > MAX_DEPTH:
            raise CodecError("invalid_value", f"value nested deeper than {MAX_DEPTH} levels (or a cycle)")
        t = type(value)
        if t in _PLAIN_SCALARS:
            return value
        if t is list:
            return [self._walk(v, depth + 1, typed) for v in value]
        if t is dict:
            out: dict[str, Any] = {}
            for k, v in value.items():
                if type(k) is not str:
                    raise CodecError(
                        "invalid_value",
                        f"dict key {k!r} is a {type_name(k)}; keys of plain data must be str (convert them, or"
                        " use a dataclass)",
                    )
                if k == MARKER:
                    raise CodecError(
                        "reserved_key",
                        f"a dict uses the reserved key {MARKER!r}, which marks typed values; rename that key",
                    )
                out[k] = self._walk(v, depth + 1, typed)
            return out
        codec = self.codec_for(value)
        if codec is None:
            raise CodecError(
                "no_codec",
                f"no value codec handles a {type_name(value)} (known tags: {', '.join(self.tags())}); convert it"
                f" to plain data, or register a codec for it through the `{HOOK_NAME}` plugin hook",
                type=type_name(value),
            )
        return {MARKER: codec.tag, "v": typed(codec, value)}

    def _tagged(self, d: dict[str, Any]) -> ValueCodec:
        tag = d.get(MARKER)
        if set(d) != {MARKER, "v"} or not isinstance(tag, str):
            raise CodecError(
                "undecodable",
                f"a typed value must be exactly {{{MARKER!r}: tag, 'v': doc}}, got keys {sorted(d)}",
            )
        codec = self._by_tag.get(tag)
        if codec is None:
            raise CodecError(
                "undecodable",
                f"the stored value names codec tag {tag!r}, which this process has no codec for (known:"
                f" {', '.join(self.tags())}); install the plugin providing it (hook `{HOOK_NAME}`)",
                tag=tag,
            )
        return codec

    def _decode(self, doc: JSON, source: BlobSource | None, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError("undecodable", f"stored value nested deeper than {MAX_DEPTH} levels")
        t = type(doc)
        if t in _PLAIN_SCALARS:
            return doc
        if t is list:
            return [self._decode(v, source, depth + 1) for v in doc]
        if t is dict:
            if MARKER in doc:
                codec = self._tagged(doc)
                try:
                    return codec.decode(doc["v"], self, source)
                except SmthrsError:
                    raise  # typed already (a store's missing/corrupt blob keeps its own family)
                except Exception as exc:  # a codec's own failure on a foreign document: typed, with its cause
                    raise CodecError(
                        "undecodable",
                        f"codec {codec.tag!r} could not decode the stored value: {type(exc).__name__}: {exc}",
                        cause=exc,
                        tag=codec.tag,
                    ) from exc
            return {k: self._decode(v, source, depth + 1) for k, v in doc.items()}
        raise CodecError("undecodable", f"a stored value holds a {type_name(doc)}, which is not JSON data")

    def __repr__(self) -> str:
        return f"CodecRegistry({self.tags()})"
