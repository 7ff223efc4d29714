"""The shared cache tier: signed, per-publisher entries ``ac/<key digest>.<publisher key id>.json``.

- Blobs before entry: an entry is created (atomic create-if-absent) only after every blob it references
  (``entry_digests``) exists in the shared store, so a reader never sees a torn entry.
- Signed: a reader looks up only the names of publishers it trusts, in :attr:`Trust.publishers` order; an entry is a
  :class:`Candidate` only when it decodes, verifies (:mod:`.signing`), names the key it is stored under and is signed
  by the key id its name carries. Anything else is a :class:`Refusal` with a reason, treated as absent.
- Bounded before parsed: at most :data:`~smthrs_plugin.stores.artifacts.MAX_ENTRY_BYTES`, regular files only, then
  :func:`~smthrs_plugin._untrusted.decode_json`. The publisher holds its own bytes to the same bounds.
- Each publisher writes only its own name; a non-servable document at our name is replaced (:class:`Replaced`), a
  valid entry is never overwritten.
- Revocations (:mod:`.revocation`) are checked fresh on every shared lookup that found a verified entry.
- ``lookup``/``candidates`` raise ``ArtifactError`` when the store cannot be read (the seam makes it a miss);
  a publication failure keeps its stage (:class:`PublicationFailed`: ``bounds``, ``blobs``, ``entry``) and never
  fails the run.
- ``gc`` reads every decodable entry whatever its signature (:meth:`SharedTier.iter_entries`).
- A shared tier on S3 whose bucket does not exist is a configuration error, not a passing fault:
  :func:`missing_bucket` tells it apart from an endpoint that does not answer, :func:`bucket_missing_error` names
  the fix.

Quarantine, races and gc: ARCHITECTURE.md ("cache").
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from .._clock import SYSTEM_CLOCK, Clock
from .._untrusted import decode_json
from ..canonical import key_digest, sha256_hex
from ..errors import ArtifactError, CacheError, InvalidInput
from ..stores.artifacts import MAX_ENTRY_BYTES, UNREADABLE_ENTRY, ArtifactStore, Created
from ..stores.database import Database
from .entry import CacheEntry, Decoded, Undecodable, canonical_entry_bytes, decode_entry, entry_digests
from .revocation import DEFAULT_REFRESH_MS, Revocations, revocation_store
from .signing import KEY_ID_HEX, Trust

__all__ = [
    "SharedTier",
    "Candidate",
    "Refusal",
    "RefusalReason",
    "Published",
    "Replaced",
    "AlreadyPublished",
    "bucket_missing_error",
    "bucket_of",
    "create_bucket_command",
    "missing_bucket",
    "PublishOutcome",
    "PublicationFailed",
    "SIGNATURE_CONTEXT",
    "copy_blobs",
    "entry_name",
    "parse_document",
    "read_document",
    "same_store",
]

log = logging.getLogger(__name__)

#: Domain separation of entry signatures (a signature made for anything else never verifies as an entry's).
SIGNATURE_CONTEXT = b"smthrs-cache-entry-signature/1"
RefusalReason = Literal[
    "unsigned",
    "untrusted_key",
    "bad_signature",
    "undecodable",
    "too_large",
    "not_a_file",
    "revoked",
    "missing_blob",
    "corrupt_blob",
]


def entry_name(key_digest_hex: str, key_id: str) -> str:
    """The shared entry name of one publisher's entry for a key digest."""
    return f"{key_digest_hex}.{key_id}"


def _split_name(name: str) -> tuple[str, str | None]:
    digest, _, kid = name.partition(".")
    return digest, (kid if len(kid) == KEY_ID_HEX else None)


@dataclass(frozen=True)
class Candidate:
    """A verified entry by a trusted publisher (``entry_id``: the SHA-256 of its signed canonical bytes)."""

    name: str
    publisher: str
    entry: CacheEntry
    entry_id: str


@dataclass(frozen=True)
class Refusal:
    """A document in the shared tier that must be treated as absent; ``reason`` is its class, ``detail`` why."""

    name: str
    publisher: str | None
    reason: RefusalReason
    detail: str

    def to_json(self) -> dict[str, str | None]:
        return {"name": self.name, "publisher": self.publisher, "reason": self.reason, "detail": self.detail}


@dataclass(frozen=True)
class Published:
    """This writer created the entry."""


@dataclass(frozen=True)
class Replaced:
    """This writer replaced a non-servable document at its own name (``reason``: why it was refused)."""

    reason: str


@dataclass(frozen=True)
class AlreadyPublished:
    """A servable entry by the same publisher was there first; ``winner`` is it (the caller compares results)."""

    winner: CacheEntry


PublishOutcome = Union[Published, Replaced, AlreadyPublished]


class PublicationFailed(Exception):
    """Publishing to the shared tier failed at ``stage``; ``cause`` is the storage error, or for ``bounds`` the
    ``CacheError(entry_out_of_bounds)`` refusing an entry no reader would accept."""

    def __init__(self, stage: Literal["bounds", "blobs", "entry"], cause: ArtifactError | CacheError) -> None:
        super().__init__(f"shared publication failed at stage {stage!r}: {cause}")
        self.stage = stage
        self.cause = cause


def same_store(a: ArtifactStore, b: ArtifactStore) -> bool:
    """Whether two handles name the same artifact root (then there is nothing to copy or hydrate)."""
    return a is b or (a.url == b.url and a.storage_options == b.storage_options)


def copy_blobs(digests: Iterable[str], src: ArtifactStore, dst: ArtifactStore) -> int:
    """Copy every digest missing from ``dst`` out of ``src`` (streamed, verified on read and on write).

    Raises ``ArtifactError`` (``not_found``/``corrupt`` from ``src``, ``unavailable`` from either). Returns the
    number of blobs copied."""
    wanted = sorted(set(digests))
    if not wanted or same_store(src, dst):
        return 0
    present = dst.has_many(wanted)
    missing = [d for d in wanted if not present[d]]
    if not missing:
        return 0
    tmp = tempfile.mkdtemp(prefix="smthrs-blobcopy-")
    try:
        for d in missing:
            path = os.path.join(tmp, d)
            src.get_to_file(d, path)
            dst.put_file(path, expected_digest=d)
            os.unlink(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return len(missing)


def bucket_of(store: ArtifactStore) -> str | None:
    """The S3 bucket ``store`` lives in (``s3://BUCKET/prefix``), or None for a store that is not on S3."""
    if store.kind != "s3":
        return None
    return store.url.split("://", 1)[1].split("/", 1)[0] or None


def missing_bucket(store: ArtifactStore) -> str | None:
    """The bucket of an S3 ``store`` when it does not exist (one ``HeadBucket``), else None (it exists — or
    exists and refuses this caller, which its reads and writes report — or ``store`` is not on S3). Raises
    ``ArtifactError(unavailable)`` when the endpoint does not answer: that is a passing fault, not a missing
    bucket."""
    bucket = bucket_of(store)
    if bucket is None:
        return None
    fs = store.fs
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        return bucket
    except PermissionError:
        return None  # it exists (HeadBucket answers 404 only for an absent bucket)
    except Exception as exc:
        raise ArtifactError(
            "unavailable",
            f"artifact store {store.url} did not answer whether bucket {bucket!r} exists: {type(exc).__name__}:"
            f" {exc}. Check the endpoint and the credentials, then retry",
            cause=exc,
            url=store.url,
        ) from exc
    return None


def create_bucket_command(store: ArtifactStore, bucket: str) -> str:
    """The AWS CLI command that creates ``bucket`` where ``store`` looks for it (its endpoint, when not AWS)."""
    options = store.storage_options
    client = options.get("client_kwargs")
    endpoint = options.get("endpoint_url") or (
        client.get("endpoint_url") if isinstance(client, dict) else None
    )
    return f"aws s3 mb s3://{bucket}" + (f" --endpoint-url {endpoint}" if endpoint else "")


def bucket_missing_error(store: ArtifactStore, bucket: str) -> CacheError:
    """The refusal of a shared tier whose bucket does not exist: what to create, or what to point elsewhere."""
    return CacheError(
        "bucket_missing",
        f"the shared cache tier {store.url} is in bucket {bucket!r}, which does not exist; nothing was run or"
        f" written. Create the bucket (`{create_bucket_command(store, bucket)}`), or point SMTHRS_ARTIFACTS_URL"
        " (or SMTHRS_ARTIFACTS_BLOCK) at an existing one; `smthrs doctor` checks the setup",
        url=store.url,
        bucket=bucket,
    )


def sign_document(entry: CacheEntry, trust: Trust) -> bytes:
    """The stored bytes of ``entry`` signed by ``trust.signer``."""
    signer = trust.signer
    if signer is None:
        raise ValueError("this machine has no signing key; it never publishes to the shared tier")
    doc = entry.to_json()
    sig = signer.sign(canonical_entry_bytes(entry), context=SIGNATURE_CONTEXT)
    doc["signature"] = {
        "alg": "ed25519",
        "key_id": signer.key_id,
        "sig": base64.b64encode(sig).decode("ascii"),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def parse_document(name: str, data: bytes) -> Any:
    """The JSON document stored as ``name``, parsed within the bounds every reader enforces (at most
    ``MAX_ENTRY_BYTES``, nesting, duplicate member names, number sizes:
    :func:`~smthrs_plugin._untrusted.decode_json`). Raises :class:`~smthrs_plugin.errors.InvalidInput` naming
    the bound."""
    return decode_json(data, f"shared entry {name}", max_bytes=MAX_ENTRY_BYTES)


def _fetch(store: ArtifactStore, name: str) -> bytes | Refusal | None:
    """The bytes at ``name`` (None: absent), or the :class:`Refusal` of a document the store would not read (over
    the cap, not a regular file). Raises ``ArtifactError`` when the store cannot be read."""
    try:
        return store.get_entry(name)
    except ArtifactError as exc:
        if exc.code not in UNREADABLE_ENTRY:
            raise
        reason: RefusalReason = "too_large" if exc.code == "too_large" else "not_a_file"
        return Refusal(name, _split_name(name)[1], reason, exc.message)


def read_document(store: ArtifactStore, name: str, trust: Trust | None) -> Candidate | Refusal | None:
    """Read (bounded) and judge the document stored as ``name`` in ``store`` (None: absent); ``trust`` as for
    :func:`check_document`. Raises ``ArtifactError`` only when the store cannot be read."""
    data = _fetch(store, name)
    return data if not isinstance(data, bytes) else check_document(name, data, trust)


def check_document(name: str, data: bytes, trust: Trust | None) -> Candidate | Refusal:
    """Judge the document stored as ``name``. ``trust`` None: integrity only (decode, name, envelope shape) —
    for maintenance; a lookup always passes a trust."""
    digest, kid = _split_name(name)
    if kid is None:
        return Refusal(
            name, None, "unsigned", "the name carries no publisher key id (an unsigned, older entry)"
        )
    try:
        doc = parse_document(name, data)
    except InvalidInput as exc:
        return Refusal(
            name,
            kid,
            "too_large" if exc.details.get("bound") == "canonical_bytes" else "undecodable",
            exc.message,
        )
    if not isinstance(doc, Mapping):
        return Refusal(name, kid, "undecodable", f"the entry is a JSON {type(doc).__name__}, not an object")
    env = doc.get("signature")
    if not isinstance(env, Mapping) or env.get("alg") != "ed25519" or not isinstance(env.get("sig"), str):
        return Refusal(name, kid, "unsigned", "the entry carries no ed25519 signature envelope")
    if env.get("key_id") != kid:
        return Refusal(
            name,
            kid,
            "bad_signature",
            f"signed by key {env.get('key_id')!r} but stored under publisher {kid}",
        )
    public = None
    if trust is not None:
        public = trust.key(kid)
        if public is None:
            return Refusal(name, kid, "untrusted_key", f"publisher key {kid} is not trusted by this machine")
    decoded = decode_entry(doc, name=digest)
    if isinstance(decoded, Undecodable):
        return Refusal(name, kid, "undecodable", decoded.reason)
    if decoded.scope != "shared":
        return Refusal(name, kid, "undecodable", f"the published entry has scope {decoded.scope!r}")
    canonical = canonical_entry_bytes(decoded)
    if public is not None:
        try:
            sig = base64.b64decode(env["sig"], validate=True)
        except (binascii.Error, ValueError):
            return Refusal(name, kid, "bad_signature", "the signature is not base64")
        if not public.verify(sig, canonical, context=SIGNATURE_CONTEXT):
            return Refusal(name, kid, "bad_signature", f"the signature does not verify with key {kid}")
    return Candidate(name, kid, decoded, sha256_hex(canonical))


def _outside_bounds(entry: CacheEntry, name: str, data: bytes) -> CacheError | None:
    """The refusal of our own signed ``data`` when a reader would refuse it (:func:`parse_document`), else None."""
    try:
        parse_document(name, data)
    except InvalidInput as exc:
        what = (
            f"is {len(data)} bytes, over the {MAX_ENTRY_BYTES}-byte cap"
            if exc.details.get("bound") == "canonical_bytes"
            else f"is outside the bounds ({exc.message})"
        )
        return CacheError(
            "entry_out_of_bounds",
            f"the shared entry {name} of {entry.subject!r} (key {entry.key}) {what} every reader of the shared"
            " tier enforces, so it is not published: it stays in this machine's local tier. Return a smaller,"
            " flatter value (large bytes and data frames are stored as blobs), or declare that the step's value"
            " is not cached (@sp.step(cache_value=False))",
            name=name,
            key=entry.key,
            bound=exc.details.get("bound"),
            size=len(data),
            limit=MAX_ENTRY_BYTES,
        )
    return None


class SharedTier:
    """Entries under ``<store>/ac/``, blobs under ``<store>/cas/``, revocations under ``<store>/revoked/``.

    ``trust``: whose entries :meth:`candidates` returns and which key :meth:`publish` signs with; None → nobody
    is trusted (no lookup finds anything, nothing is published) — maintenance only."""

    def __init__(
        self,
        store: ArtifactStore,
        trust: Trust | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        revocation_refresh_ms: int = DEFAULT_REFRESH_MS,
        revocation_memory: Database | None = None,
    ) -> None:
        self.store = store
        self.trust = trust
        self._bucket_known = bucket_of(store) is None  # nothing to check off S3
        self.revocations = Revocations(
            revocation_store(store), clock=clock, refresh_ms=revocation_refresh_ms, memory=revocation_memory
        )

    def require_bucket(self) -> None:
        """Refuse (``CacheError(bucket_missing)``) a tier whose S3 bucket does not exist, before its first read or
        write; once the bucket is seen, never asked again. An endpoint that does not answer is not refused here:
        the lookup or publication that follows meets the same fault and reports it as a passing one, as always."""
        if self._bucket_known:
            return
        try:
            bucket = missing_bucket(self.store)
        except ArtifactError as exc:
            log.debug(
                "could not check the bucket of %s (the next read or write reports it): %s",
                self.store.url,
                exc,
            )
            return
        if bucket is not None:
            raise bucket_missing_error(self.store, bucket)
        self._bucket_known = True

    # -- reading ---------------------------------------------------------------------------------------------

    def read(self, name: str) -> Candidate | Refusal | None:
        """The judged document at ``name`` (None: absent); an unreadable one is a :class:`Refusal`. Raises
        ``ArtifactError`` when the store cannot be read."""
        return read_document(self.store, name, self.trust)

    def candidates(self, key: str) -> Iterator[Candidate | Refusal]:
        """Every trusted publisher's document for ``key``, in lookup order, lazily (a served first candidate costs
        one GET). A verified entry that is revoked (markers listed fresh) comes out as a :class:`Refusal`.
        Raises ``ArtifactError`` when the store cannot be read."""
        if self.trust is None:
            return
        digest = key_digest(key)
        for kid in self.trust.publishers:
            judged = self.read(entry_name(digest, kid))
            if isinstance(judged, Candidate):
                marker = self.revocations.revoking(judged.entry, fresh=True)
                if marker is not None:
                    judged = Refusal(judged.name, kid, "revoked", f"revoked by marker {marker.name}")
            if judged is not None:
                yield judged

    def lookup(self, key: str) -> Decoded | None:
        """The first servable-looking entry for ``key`` (decoded, verified, trusted, not revoked), or
        ``Undecodable`` naming the first refusal, or None."""
        first: Refusal | None = None
        for judged in self.candidates(key):
            if isinstance(judged, Candidate):
                return judged.entry
            first = first or judged
        return None if first is None else Undecodable(f"{first.reason}: {first.detail}", corrupt=True)

    def blobs_present(self, entry: CacheEntry) -> bool:
        """Whether every blob ``entry`` references exists in the shared store (not re-hashed). Raises
        ``ArtifactError``."""
        wanted = sorted(entry_digests(entry))
        return not wanted or all(self.store.has_many(wanted).values())

    # -- publishing ------------------------------------------------------------------------------------------

    def publish(
        self, entry: CacheEntry, source: ArtifactStore, *, condemned: Mapping[str, str] | None = None
    ) -> PublishOutcome:
        """Blobs first (from ``source``), then our signed entry at our own name (module invariants). ``condemned``:
        entry ids (→ reason) the caller's consult refused for what they are — a signed entry that reaches outside
        its declaration or fails admission is as unservable as a forged one, so it is replaced too. Raises
        :class:`PublicationFailed`; ``ValueError`` when this machine has no signing key or ``entry`` is not
        shared-scope."""
        if entry.scope != "shared":
            raise ValueError("only shared-scope (admissible) entries are published")
        if self.trust is None or self.trust.signer is None:
            raise ValueError("this machine has no signing key; it never publishes to the shared tier")
        data = sign_document(entry, self.trust)
        name = entry_name(entry.name, self.trust.signer.key_id)
        # Readers refuse what is outside their bounds; an honest entry must never be one of those (checked
        # before any blob is copied: nothing of an entry that will not be published is uploaded).
        out_of_bounds = _outside_bounds(entry, name, data)
        if out_of_bounds is not None:
            raise PublicationFailed("bounds", out_of_bounds)
        try:
            wanted = sorted(entry_digests(entry))
            if not same_store(source, self.store):
                copy_blobs(wanted, source, self.store)
            elif wanted:
                # One store: the settle spilled them here already; prove it before the entry becomes visible.
                absent = [d for d, ok in self.store.has_many(wanted).items() if not ok]
                if absent:
                    raise ArtifactError(
                        "not_found",
                        f"blobs {', '.join(absent[:5])} are missing from {self.store.url}; the entry is not"
                        " published",
                    )
        except ArtifactError as exc:
            raise PublicationFailed("blobs", exc) from exc
        replaced: str | None = None
        try:
            for _ in range(3):
                judged_bytes: bytes | None = None
                why: str | None
                try:
                    outcome = self.store.put_entry(name, data)
                except ArtifactError as exc:
                    if exc.code not in UNREADABLE_ENTRY:
                        raise
                    why = f"{exc.code}: {exc.message}"  # no reader reads it: not servable
                else:
                    if isinstance(outcome, Created):
                        return Published() if replaced is None else Replaced(replaced)
                    judged_bytes = outcome.data
                    why = self._unservable(name, outcome.data, condemned or {})
                    if why is None:
                        judged = check_document(name, outcome.data, self.trust)
                        assert isinstance(judged, Candidate)
                        return AlreadyPublished(judged.entry)
                log.warning("replacing the shared entry %s in %s: %s", name, self.store.url, why)
                replaced = why
                if self._still(name, judged_bytes):  # still the document judged: ours to replace
                    self.store.delete_entry(name)
        except ArtifactError as exc:
            raise PublicationFailed("entry", exc) from exc
        raise PublicationFailed(
            "entry",
            ArtifactError(
                "unavailable",
                f"entry {name} kept changing while replacing a refused document; is another writer using this key?",
                name=name,
            ),
        )

    def _still(self, name: str, judged: bytes | None) -> bool:
        """Whether our name still holds the document judged: the same bytes, or (``judged`` None) still a
        document no reader reads — anything else is another writer's and is left alone."""
        now = _fetch(self.store, name)
        return now == judged if judged is not None else isinstance(now, Refusal)

    def _unservable(self, name: str, data: bytes, condemned: Mapping[str, str]) -> str | None:
        """Why the document at our own name must be replaced, or None when it is a servable entry."""
        judged = check_document(name, data, self.trust)
        if isinstance(judged, Refusal):
            return f"{judged.reason}: {judged.detail}"
        if judged.entry_id in condemned:
            return f"refused when served: {condemned[judged.entry_id]}"
        if self.revocations.revoking(judged.entry, fresh=True) is not None:
            return "revoked"
        if not self.blobs_present(judged.entry):
            return "missing_blob: a blob it references is not in the shared tier"
        return None

    def hydrate(self, digests: Iterable[str], into: ArtifactStore) -> int:
        """Copy the blobs a replay found missing from ``into`` out of the shared store; returns how many."""
        return copy_blobs(digests, self.store, into)

    # -- maintenance -----------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return self.store.list_entries()

    def names_of(self, key: str) -> list[str]:
        """Every entry name stored for ``key``, whoever published it (a listing of the whole tier)."""
        prefix = key_digest(key) + "."
        return [n for n in self.store.list_entries() if n.startswith(prefix) or n == prefix[:-1]]

    def iter_entries(self) -> Iterator[tuple[str, Decoded | None]]:
        """Every published entry (name, decoded — signatures NOT checked) — None when it vanished between
        listing and reading; ``Undecodable`` when it is unreadable or outside the readers' bounds. For gc and
        ls: trust is per reader."""
        for name in self.store.list_entries():
            data = _fetch(self.store, name)
            if isinstance(data, Refusal):
                yield name, Undecodable(f"{data.reason}: {data.detail}")
                continue
            if data is None:
                yield name, None
                continue
            try:
                doc = parse_document(name, data)
            except InvalidInput as exc:
                yield name, Undecodable(exc.message)
                continue
            yield name, decode_entry(doc, name=_split_name(name)[0])

    def audit(self) -> Iterator[tuple[str, Candidate | Refusal]]:
        """Every published document judged with this tier's trust (revocations included): what ``smthrs cache
        verify --with-shared`` reports. Raises ``ArtifactError``."""
        self.revocations.refresh()
        for name in self.store.list_entries():
            judged = self.read(name)
            if judged is None:
                continue
            if isinstance(judged, Candidate):
                marker = self.revocations.revoking(judged.entry, fresh=False)
                if marker is not None:
                    judged = Refusal(name, judged.publisher, "revoked", f"revoked by marker {marker.name}")
            yield name, judged
