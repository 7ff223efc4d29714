"""The shared cache tier: signed, per-publisher entries ``ac/<key digest>.<publisher key id>.json``.

Invariants (Bazel's remote cache: CAS before AC — plus publisher trust, issue 13)
- An entry is published only AFTER every blob it references (``entry_digests``: spilled outputs and the blobs of its
  encoded value) exists in the shared store:
  blobs are copied there first (streamed through a temporary file, verified on both sides), then the entry is
  created with the store's atomic create-if-absent. A reader therefore never sees a torn entry; a blob can still
  go missing later (a gc race, an operator, an attacker) and the seam then re-executes.
- **Signed.** Every entry carries ``signature: {alg: "ed25519", key_id, sig}`` over its canonical bytes
  (:func:`~.entry.canonical_entry_bytes`) by the publisher's key (:mod:`.signing`). A reader looks up only the
  names of publishers it trusts, in :attr:`Trust.publishers` order (its own key first), and an entry there is a
  :class:`Candidate` only when it decodes, verifies, names the key it is stored under, and its signature is by
  the key id its name carries. Anything else is a :class:`Refusal` with a reason — treated as absent: never
  served, never compared against.
- **Quarantine, never blocking.** Each publisher writes only its own name, first writer wins within a publisher
  (machines sharing one key race for one name; the race yields exactly one complete entry). A document at OUR
  name that is not servable — it does not verify (planted, damaged, foreign), its blobs are missing, or it is
  revoked — is replaced by our honest entry: re-read, deleted only if it is still the bytes judged, then created
  again (:class:`Replaced`). A valid entry is never overwritten. Residual race: two writers with one key that
  both judged the same bad document may delete each other's fresh entry once; the survivor is still one complete,
  signed entry, and a reader in between sees a miss, never a wrong entry.
- Revocations (:mod:`.revocation`) are checked fresh on every shared lookup that found a verified entry.
- ``lookup``/``candidates`` never fail a dispatch by themselves: they raise ``ArtifactError`` when the store
  cannot be read, which the seam turns into a miss with a journal record. Failures of a publication keep their
  stage (:class:`PublicationFailed`: ``blobs``, ``entry``), so the seam journals ``cache-provenance {action:
  "unpublished", stage}`` and carries on — a failed shared publication never fails the run.
- Maintenance (``gc``) reads every DECODABLE entry whatever its signature (:meth:`SharedTier.iter_entries`):
  trust is per reader, and another machine may trust a key this one does not, so gc keeps their blobs.
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
from typing import Literal, Union

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import key_digest, sha256_hex
from ..errors import ArtifactError
from ..stores._artifacts import ArtifactStore, Created
from ._entry import CacheEntry, Decoded, Undecodable, canonical_entry_bytes, decode_entry, entry_digests
from ._revocation import DEFAULT_REFRESH_MS, Revocations, revocation_store
from ._signing import KEY_ID_HEX, Trust

__all__ = [
    "SharedTier",
    "Candidate",
    "Refusal",
    "RefusalReason",
    "Published",
    "Replaced",
    "AlreadyPublished",
    "PublishOutcome",
    "PublicationFailed",
    "SIGNATURE_CONTEXT",
    "copy_blobs",
    "entry_name",
    "same_store",
]

log = logging.getLogger(__name__)

#: Domain separation of entry signatures (a signature made for anything else never verifies as an entry's).
SIGNATURE_CONTEXT = b"smthrs-cache-entry-signature/1"
RefusalReason = Literal[
    "unsigned", "untrusted_key", "bad_signature", "undecodable", "revoked", "missing_blob", "corrupt_blob"
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
    """Publishing to the shared tier failed at ``stage``; ``cause`` is the storage error."""

    def __init__(self, stage: Literal["blobs", "entry"], cause: ArtifactError) -> None:
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


def check_document(name: str, data: bytes, trust: Trust | None) -> Candidate | Refusal:
    """Judge the document stored as ``name``. ``trust`` None: integrity only (decode, name, envelope shape) —
    for maintenance; a lookup always passes a trust."""
    digest, kid = _split_name(name)
    if kid is None:
        return Refusal(
            name, None, "unsigned", "the name carries no publisher key id (an unsigned, older entry)"
        )
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        return Refusal(name, kid, "undecodable", f"the entry is not JSON ({exc})")
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
    ) -> None:
        self.store = store
        self.trust = trust
        self.revocations = Revocations(revocation_store(store), clock=clock, refresh_ms=revocation_refresh_ms)

    # -- reading ---------------------------------------------------------------------------------------------

    def read(self, name: str) -> Candidate | Refusal | None:
        """The judged document at ``name`` (None: absent). Raises ``ArtifactError``."""
        data = self.store.get_entry(name)
        return None if data is None else check_document(name, data, self.trust)

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
        data = sign_document(entry, self.trust)
        name = entry_name(entry.name, self.trust.signer.key_id)
        replaced: str | None = None
        try:
            for _ in range(3):
                outcome = self.store.put_entry(name, data)
                if isinstance(outcome, Created):
                    return Published() if replaced is None else Replaced(replaced)
                why = self._unservable(name, outcome.data, condemned or {})
                if why is None:
                    judged = check_document(name, outcome.data, self.trust)
                    assert isinstance(judged, Candidate)
                    return AlreadyPublished(judged.entry)
                log.warning("replacing the shared entry %s in %s: %s", name, self.store.url, why)
                replaced = why
                if self.store.get_entry(name) == outcome.data:  # still the document judged: ours to replace
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
        listing and reading. For gc and ls: trust is per reader."""
        for name in self.store.list_entries():
            data = self.store.get_entry(name)
            yield name, None if data is None else decode_entry(data, name=_split_name(name)[0])

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
