"""A cache entry: the self-describing JSON document both tiers store for one dispatch key.

Invariants
- One format for both tiers: the local row's ``entry_json`` and the shared tier's ``ac/<key digest>.json`` hold
  the same document — ``format``, ``key``, ``subject``, ``components`` (what the key was computed from, for
  ``explain``), ``evidence`` (``Evidence.to_json``), ``value``, ``result``, ``admission`` (the claims admission
  re-checks), ``provenance`` (run, node, attempt, host, created_at_ms) and ``scope``.
- ``result`` is ``key({kind: "cache-result/v1", value: sha256(canonical value), diff})`` with the evidence's diff
  identity: "same key, different result" compares it, and decoding recomputes it, so a value or evidence edited
  in place is detected, never served.
- A value is cacheable only when a hit can return exactly what the executor returned. ``value`` holds the value
  as ENCODED by the value codecs (:mod:`smthrs_plugin.codecs`: plain JSON stays itself, a typed value is a
  ``{"$smthrs": tag, "v": doc}`` wrapper), which must be plain JSON (RFC 8785 canonicalisable) with no tuples; a
  value no codec can store exactly is not cached at all. It is stored with ``json.dumps`` rather than as RFC 8785
  bytes so ``1.0`` stays a float on a hit; never a weaker representation. The dispatch seam decodes it on a hit.
- ``value_blobs`` (present only when non-empty) lists the content-addressed blobs the encoded value references
  (large ``bytes``, data frames): like the evidence's spilled outputs they must exist in a tier before its entry
  is published there (:func:`entry_digests`), and gc keeps them.
- The **canonical bytes** of an entry are the RFC 8785 form of :meth:`CacheEntry.to_json`; its **entry id** is their
  SHA-256. A shared entry's publisher signature covers exactly these bytes (:mod:`.signing`), and a revocation
  may name entry ids (:mod:`.revocation`); decoding then re-encoding an entry yields the same bytes, so a reader
  recomputes them from what it decoded, never from the stored text.
- Decoding never raises: a document that is not JSON, has another format, names another key than the one it is
  stored under, or whose evidence/result does not verify is :class:`Undecodable` (``corrupt`` when an integrity
  check failed), which the dispatch seam treats as ``UnverifiableEvidence`` or ``ReplayFailed`` — never served.
- Text given to :func:`decode_entry` is this machine's own (its local database). A document from the shared tier,
  which anyone with write access to the bucket can plant, is parsed within bounds first
  (``_shared.parse_document``) and handed over as the parsed mapping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from ..boundary.evidence import Evidence, referenced_digests
from ..canonical import canonical_bytes, is_key, key, key_digest, sha256_hex
from ..errors import CanonicalError, ReplayError

__all__ = [
    "ENTRY_FORMAT",
    "Scope",
    "CacheEntry",
    "Undecodable",
    "Decoded",
    "Cacheable",
    "NotCacheable",
    "check_cacheable",
    "result_digest",
    "decode_entry",
    "run_local_row_key",
    "canonical_entry_bytes",
    "entry_id",
    "entry_digests",
]

ENTRY_FORMAT = "smthrs-cache-entry/1"
_HEX = frozenset("0123456789abcdef")
Scope = Literal["shared", "run-local"]


@dataclass(frozen=True)
class Cacheable:
    """The value has a canonical form (``canonical`` are its RFC 8785 bytes)."""

    canonical: bytes = field(repr=False)


@dataclass(frozen=True)
class NotCacheable:
    """The value cannot be stored without changing it; ``reason`` says why."""

    reason: str


def check_cacheable(value: Any) -> Cacheable | NotCacheable:
    """Whether a hit could return exactly ``value``: plain JSON data, canonicalisable, and tuple-free."""
    try:
        canonical = canonical_bytes(value)
    except CanonicalError as exc:
        return NotCacheable(exc.message)
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is tuple:
            return NotCacheable(
                "the value contains a tuple, which a cache hit would return as a list; return a list"
            )
        if type(v) is dict:
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
    return Cacheable(canonical)


def result_digest(canonical_value: bytes, diff: str) -> str:
    """``key1_`` identity of a result: the SHA-256 of the canonical value plus the evidence's diff identity."""
    return key({"kind": "cache-result/v1", "value": sha256_hex(canonical_value), "diff": diff})


def run_local_row_key(dispatch_key: str, run_id: str) -> str:
    """Row key of a run-local entry: scoped by the run, so another run's lookup of ``dispatch_key`` never finds it."""
    return key({"kind": "run-local-entry", "key": dispatch_key, "runId": run_id})


@dataclass(frozen=True)
class CacheEntry:
    """One decoded, verified entry. Build new ones with :meth:`build`; read stored ones with :func:`decode_entry`."""

    key: str
    subject: str
    components: Mapping[str, Any]
    evidence: Evidence
    value: Any
    result: str
    admission: Mapping[str, Any]
    provenance: Mapping[str, Any]
    scope: Scope = "shared"
    value_blobs: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The key digest: the local row's primary key (shared scope) and the shared entry's name."""
        return key_digest(self.key)

    @property
    def nondeterministic(self) -> bool:
        return bool(self.admission.get("nondeterministic", False))

    @classmethod
    def build(
        cls,
        *,
        key: str,
        subject: str,
        components: Mapping[str, Any],
        evidence: Evidence,
        value: Any,
        canonical_value: bytes,
        admission: Mapping[str, Any],
        provenance: Mapping[str, Any],
        scope: Scope,
        value_blobs: tuple[str, ...] = (),
    ) -> CacheEntry:
        return cls(
            key=key,
            subject=subject,
            components=components,
            evidence=evidence,
            value=value,
            result=result_digest(canonical_value, evidence.diff_identity),
            admission=dict(admission),
            provenance=dict(provenance),
            scope=scope,
            value_blobs=tuple(sorted(set(value_blobs))),
        )

    def to_json(self) -> dict[str, Any]:
        doc = {
            "format": ENTRY_FORMAT,
            "key": self.key,
            "subject": self.subject,
            "components": self.components,
            "evidence": self.evidence.to_json(),
            "value": self.value,
            "result": self.result,
            "admission": dict(self.admission),
            "provenance": dict(self.provenance),
            "scope": self.scope,
        }
        if self.value_blobs:
            doc["value_blobs"] = list(self.value_blobs)
        return doc

    def encode(self) -> bytes:
        """The stored bytes (sorted keys, compact; floats keep their Python repr)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode(
            "utf-8"
        )

    def canonical(self) -> bytes:
        """RFC 8785 bytes of :meth:`to_json`: what a publisher signs (see the module invariants)."""
        return canonical_entry_bytes(self)

    def with_scope(self, scope: Scope) -> CacheEntry:
        return CacheEntry(
            self.key,
            self.subject,
            self.components,
            self.evidence,
            self.value,
            self.result,
            self.admission,
            self.provenance,
            scope,
            self.value_blobs,
        )


def entry_digests(entry: CacheEntry) -> frozenset[str]:
    """Every blob ``entry`` needs from an artifact store: its spilled outputs and its encoded value's blobs."""
    return referenced_digests(entry.evidence) | frozenset(entry.value_blobs)


def canonical_entry_bytes(entry: CacheEntry) -> bytes:
    """RFC 8785 bytes of ``entry.to_json()`` (what a shared entry's signature covers)."""
    return canonical_bytes(entry.to_json())


def entry_id(entry: CacheEntry) -> str:
    """Hex SHA-256 of the entry's canonical bytes: names one published document (revocations use it)."""
    return sha256_hex(canonical_entry_bytes(entry))


@dataclass(frozen=True)
class Undecodable:
    """A stored entry that must not be served: ``reason`` names the defect; ``corrupt`` when an integrity check
    (inline bytes, result identity) failed rather than the document merely being malformed or foreign."""

    reason: str
    corrupt: bool = False


Decoded = Union[CacheEntry, Undecodable]


def decode_entry(data: bytes | str | Mapping[str, Any], *, name: str | None = None) -> Decoded:
    """Decode and verify a stored entry. ``name``: the key digest it was stored under (checked against its key).
    ``data`` as text: trusted text (see the module invariants); untrusted documents come parsed and bounded."""
    try:
        doc = json.loads(data) if isinstance(data, (bytes, str)) else data
    except (ValueError, UnicodeDecodeError) as exc:
        return Undecodable(f"the entry is not JSON ({exc})")
    except RecursionError:
        # Decoding never raises (module invariants): a damaged row nested past the parser's stack is undecodable.
        return Undecodable("the entry is nested too deeply to parse")
    if not isinstance(doc, Mapping):
        return Undecodable(f"the entry is a JSON {type(doc).__name__}, not an object")
    if doc.get("format") != ENTRY_FORMAT:
        return Undecodable(
            f"entry format {doc.get('format')!r} is not {ENTRY_FORMAT!r} (written by another version)"
        )
    k = doc.get("key")
    if not isinstance(k, str) or not is_key(k):
        return Undecodable(f"entry key {k!r} is not a key1_ key")
    if name is not None and key_digest(k) != name:
        return Undecodable(
            f"entry stored as {name} names key {k}, whose digest is {key_digest(k)}", corrupt=True
        )
    subject, components, admission, provenance = (
        doc.get("subject"),
        doc.get("components"),
        doc.get("admission"),
        doc.get("provenance"),
    )
    scope = doc.get("scope")
    if (
        not isinstance(subject, str)
        or not isinstance(components, Mapping)
        or not isinstance(admission, Mapping)
        or not isinstance(provenance, Mapping)
        or scope not in ("shared", "run-local")
        or "value" not in doc
        or not is_key(doc.get("result"))
    ):
        return Undecodable(
            "the entry lacks subject, components, admission, provenance, scope, value or result"
        )
    try:
        evidence = Evidence.from_json(doc.get("evidence"))  # type: ignore[arg-type]
    except ReplayError as exc:
        return Undecodable(
            f"its evidence does not verify: {exc.message}", corrupt=exc.code == "boundary_corruption"
        )
    value = doc["value"]
    cacheable = check_cacheable(value)
    if isinstance(cacheable, NotCacheable):
        return Undecodable(f"its value is not plain JSON: {cacheable.reason}")
    blobs = doc.get("value_blobs", [])
    if (
        type(blobs) is not list
        or not all(type(b) is str and len(b) == 64 and set(b) <= _HEX for b in blobs)
        or blobs != sorted(set(blobs))
    ):
        return Undecodable("its value_blobs is not a sorted list of sha256 hex digests")
    if result_digest(cacheable.canonical, evidence.diff_identity) != doc["result"]:
        return Undecodable(
            "its value or evidence no longer matches its recorded result identity", corrupt=True
        )
    return CacheEntry(
        k, subject, components, evidence, value, doc["result"], admission, provenance, scope, tuple(blobs)
    )
