"""Cache maintenance: list entries, verify their blobs, collect garbage — what ``smthrs cache ls|verify|gc`` run.

Invariants
- ``gc`` never deletes a blob an entry references. "Referenced" is the union over BOTH tiers — every local row
  (any scope, invalidated rows included until they are themselves collected) and every decodable shared entry —
  and it is computed twice: candidates are chosen from the first pass and deleted only if the second pass (taken
  after listing the blobs) still does not reference them.
- ``gc`` honours a grace period: a blob younger than ``grace_s`` is kept even when unreferenced, because a writer
  publishes blobs BEFORE the entry that references them (CAS before AC); the grace period is the window a
  publication may take. Rows are collected under the same grace: invalidated rows invalidated longer ago than it,
  and run-local rows whose run is terminal (or unknown to this database) and older than it.
  Residual race (as in any mark-and-sweep over a CAS with dedupe, e.g. git's ``gc.pruneExpire``): a writer that
  re-references an OLD blob without re-uploading it after gc's second pass can lose it; the reader then gets
  ``ReplayFailed(missing_artifact)`` and re-executes — a wasted run, never a wrong result.
- ``revoke`` writes one revocation marker per key in the shared tier (create-if-absent, :mod:`.revocation`)
  naming every copy it can see, and invalidates this machine's local rows of the key at once; other machines
  drop their local copies within their revocation refresh interval.
- ``verify`` re-reads and re-hashes every blob a served entry references (local rows in the local store, shared
  entries in the shared store) and reports ``corrupt``/``missing``/``undecodable``; it changes nothing. With a
  shared tier that carries a :class:`~.signing.Trust`, every shared document is also judged as a reader would
  (:meth:`SharedTier.audit`): ``unsigned``, ``untrusted_key``, ``bad_signature`` and ``revoked`` documents are
  reported as refused (never served by this machine), and their blobs are not re-hashed. So are documents no
  reader parses — ``too_large`` (over the entry cap), ``not_a_file`` (a FIFO, device or directory at the name),
  ``undecodable`` (too deep, duplicate member names, a huge integer, ...): listed, never a crash or a hang.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import is_key, key_digest
from ..errors import CacheError
from ..records import cache_index as cache_index
from ..records.runs import TERMINAL_STATUSES, statuses_in
from ..stores.artifacts import ArtifactStore, Corrupt, NotFound
from .entry import CacheEntry, Undecodable, entry_digests, entry_id
from .local import LocalTier
from .shared import Candidate, Refusal, RefusalReason, SharedTier, read_document, same_store

__all__ = [
    "EntryInfo",
    "list_entries",
    "Problem",
    "VerifyReport",
    "verify",
    "GcReport",
    "gc",
    "RevokeReport",
    "revoke",
]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``smthrs cache ls`` shows it."""

    tier: Literal["local", "shared"]
    name: str
    key: str | None
    subject: str | None
    scope: str | None
    run_id: str | None
    node_id: str | None
    host: str | None
    created_at_ms: int | None
    last_used_at_ms: int | None = None
    invalidated_at_ms: int | None = None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def list_entries(local: LocalTier, shared: SharedTier | None = None) -> list[EntryInfo]:
    """Local rows (newest first), then shared entries (by name) when ``shared`` is given."""
    out: list[EntryInfo] = []
    for r in local.rows():
        p = r.provenance or {}
        out.append(
            EntryInfo(
                "local",
                r.key_digest,
                r.key,
                r.subject,
                r.scope,
                r.run_id,
                p.get("node_id"),
                p.get("host"),
                r.created_at_ms,
                r.last_used_at_ms,
                r.invalidated_at_ms,
            )  # fmt: skip
        )
    if shared is not None:
        for name, decoded in shared.iter_entries():
            if isinstance(decoded, CacheEntry):
                p = decoded.provenance
                out.append(
                    EntryInfo(
                        "shared",
                        name,
                        decoded.key,
                        decoded.subject,
                        decoded.scope,
                        p.get("run_id"),
                        p.get("node_id"),
                        p.get("host"),
                        p.get("created_at_ms"),
                    )  # fmt: skip
                )
            elif isinstance(decoded, Undecodable):
                out.append(
                    EntryInfo(
                        "shared", name, None, None, None, None, None, None, None, problem=decoded.reason
                    )
                )
    return out


ProblemKind = Literal[
    "corrupt",
    "missing",
    "undecodable",
    "too_large",
    "not_a_file",
    "unsigned",
    "untrusted_key",
    "bad_signature",
    "revoked",
]
_REFUSAL_KIND: dict[RefusalReason, ProblemKind] = {
    "unsigned": "unsigned",
    "untrusted_key": "untrusted_key",
    "bad_signature": "bad_signature",
    "undecodable": "undecodable",
    "too_large": "too_large",
    "not_a_file": "not_a_file",
    "revoked": "revoked",
    "missing_blob": "missing",
    "corrupt_blob": "corrupt",
}


@dataclass(frozen=True)
class Problem:
    """``kind``: ``corrupt`` (a blob no longer hashes to its name), ``missing`` (a referenced blob is absent),
    ``undecodable`` (the entry itself does not decode or verify, or is outside the readers' bounds), and for
    shared documents judged with a trust: ``too_large``, ``not_a_file``, ``unsigned``, ``untrusted_key``,
    ``bad_signature``, ``revoked`` (refused: treated as absent by readers)."""

    tier: Literal["local", "shared"]
    entry: str
    kind: ProblemKind
    digest: str | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "entry": self.entry,
            "kind": self.kind,
            "digest": self.digest,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class VerifyReport:
    entries: int
    blobs: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "entries": self.entries,
            "blobs": self.blobs,
            "ok": self.ok,
            "problems": [p.to_json() for p in self.problems],
        }


def verify(
    local: LocalTier,
    artifacts: ArtifactStore,
    shared: SharedTier | None = None,
    *,
    progress: Progress | None = None,
) -> VerifyReport:
    """Re-hash every blob referenced by a servable entry. ``progress(done, total)`` counts blobs."""
    wanted: list[tuple[Literal["local", "shared"], str, str, ArtifactStore]] = []
    problems: list[Problem] = []
    entries = 0
    for row, decoded in local.iter_entries():
        if row.invalidated_at_ms is not None:
            continue  # never served again; gc collects it
        entries += 1
        if isinstance(decoded, Undecodable):
            problems.append(Problem("local", row.key_digest, "undecodable", None, decoded.reason))
            continue
        wanted.extend(("local", row.key_digest, d, artifacts) for d in sorted(entry_digests(decoded)))
    if shared is not None:
        for name, judged in shared.audit():
            entries += 1
            if isinstance(judged, Refusal):
                problems.append(Problem("shared", name, _REFUSAL_KIND[judged.reason], None, judged.detail))
                continue
            wanted.extend(("shared", name, d, shared.store) for d in sorted(entry_digests(judged.entry)))
    checked: dict[tuple[str, str], Any] = {}
    for i, (tier, name, digest, store) in enumerate(wanted):
        ck = (store.url, digest)
        if ck not in checked:
            checked[ck] = store.check_blob(digest)
        result = checked[ck]
        if isinstance(result, Corrupt):
            problems.append(Problem(tier, name, "corrupt", digest, f"hashes to {result.actual}"))
        elif isinstance(result, NotFound):
            problems.append(Problem(tier, name, "missing", digest, f"not in {store.url}"))
        if progress is not None:
            progress(i + 1, len(wanted))
    return VerifyReport(entries, len(checked), tuple(problems))


@dataclass(frozen=True)
class GcReport:
    dry_run: bool
    grace_s: float
    referenced: int
    deleted_blobs: tuple[str, ...]
    kept_young: int
    deleted_rows: tuple[str, ...]
    stores: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "grace_s": self.grace_s,
            "referenced": self.referenced,
            "deleted_blobs": list(self.deleted_blobs),
            "kept_young": self.kept_young,
            "deleted_rows": list(self.deleted_rows),
            "stores": list(self.stores),
        }


def _referenced(local: LocalTier, shared: SharedTier | None) -> set[str]:
    refs: set[str] = set()
    for _, decoded in local.iter_entries():
        if isinstance(decoded, CacheEntry):
            refs |= entry_digests(decoded)
    if shared is not None:
        for _, published in shared.iter_entries():
            if isinstance(published, CacheEntry):
                refs |= entry_digests(published)
    return refs


def _mtime_s(store: ArtifactStore, digest: str) -> float | None:
    """The blob's modification time in epoch seconds, or None when the backend does not say (kept then)."""
    try:
        info = store.fs.info(store.blob_path(digest))
    except FileNotFoundError:
        return None
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, dt.datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _collectable_rows(local: LocalTier, cutoff_ms: int) -> list[str]:
    def read(c: Connection) -> list[str]:
        out = cache_index.invalidated_before_in(c, cutoff_ms)
        old = cache_index.run_local_before_in(c, cutoff_ms)
        runs = statuses_in(c, [r for _, r in old if r is not None])
        for digest, run_id in old:
            status, finished_at_ms = runs.get(run_id, (None, None)) if run_id is not None else (None, None)
            gone = status is None  # a run this database never knew (e.g. a Prefect flow run)
            done = status in TERMINAL_STATUSES and (finished_at_ms is None or finished_at_ms < cutoff_ms)
            if gone or done:
                out.append(digest)
        return sorted(set(out))

    return local.db.read(read)


def gc(
    local: LocalTier,
    artifacts: ArtifactStore,
    shared: SharedTier | None = None,
    *,
    grace_s: float = 3600.0,
    dry_run: bool = False,
    clock: Clock = SYSTEM_CLOCK,
) -> GcReport:
    """Collect expired rows, then every blob no entry references that is older than ``grace_s``."""
    if grace_s < 0:
        raise ValueError("grace_s must be >= 0")
    now_ms = clock.now_ms()
    cutoff_ms = now_ms - int(grace_s * 1000)
    rows = _collectable_rows(local, cutoff_ms)
    if not dry_run and rows:
        local.db.write(lambda c: [local.delete_in(c, k) for k in rows])
    stores: list[ArtifactStore] = [artifacts]
    if shared is not None and not same_store(shared.store, artifacts):
        stores.append(shared.store)
    first = _referenced(local, shared)
    candidates: list[tuple[ArtifactStore, str]] = []
    young = 0
    for store in stores:
        for digest in store.iter_blobs():
            if digest in first:
                continue
            mtime = _mtime_s(store, digest)
            if mtime is None or mtime * 1000 > cutoff_ms:
                young += 1
                continue
            candidates.append((store, digest))
    second = _referenced(local, shared) if candidates else first
    doomed = [(s, d) for s, d in candidates if d not in second]
    if not dry_run:
        for store, digest in doomed:
            store.delete_blob(digest)
        for store in stores:
            store.purge_staging(older_than_s=max(grace_s, 60.0))
    return GcReport(
        dry_run=dry_run,
        grace_s=grace_s,
        referenced=len(second),
        deleted_blobs=tuple(d for _, d in doomed),
        kept_young=young,
        deleted_rows=tuple(rows),
        stores=tuple(s.url for s in stores),
    )


@dataclass(frozen=True)
class RevokeReport:
    """What ``smthrs cache revoke`` did: one marker per key, the local rows it invalidated."""

    keys: tuple[str, ...]
    markers: tuple[str, ...]
    entries: tuple[str, ...]
    invalidated: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "keys": list(self.keys),
            "markers": list(self.markers),
            "entries": list(self.entries),
            "invalidated": list(self.invalidated),
        }


def _keys_of(local: LocalTier, key_or_subject: str) -> list[str]:
    if is_key(key_or_subject):
        return [key_or_subject]
    subjects = [key_or_subject] if local.rows(subject=key_or_subject, limit=1) else []
    subjects = subjects or local.subjects_ending_with(key_or_subject)
    keys = sorted({r.key for s in subjects for r in local.rows(subject=s) if r.scope == "shared"})
    if not keys:
        raise CacheError(
            "not_found",
            f"no cache entry of node {key_or_subject!r} in this database; pass the key1_ key itself (see"
            " `smthrs cache ls --with-shared`)",
            subject=key_or_subject,
        )
    return keys


def revoke(
    local: LocalTier, shared: SharedTier, key_or_subject: str, *, by: str, reason: str = ""
) -> RevokeReport:
    """Revoke a key (or every shared-scope key a node's local rows name): a marker in the shared tier that every
    reader honours (:mod:`.revocation`), naming every copy visible now, and this machine's local rows
    invalidated at once. ``CacheError(not_found)`` when a node has no entry here; ``ArtifactError`` when the
    shared tier cannot be written."""
    keys = _keys_of(local, key_or_subject)
    markers: list[str] = []
    ids: list[str] = []
    invalidated: list[str] = []
    for k in keys:
        seen: list[str] = []
        for name in shared.names_of(k):
            # Bounded: a document planted at one of the key's names is refused here, never a crash or a hang.
            judged = read_document(shared.store, name, None)
            if isinstance(judged, Candidate):
                seen.append(judged.entry_id)
        row = local.load(key_digest(k))
        if isinstance(row, CacheEntry):
            seen.append(entry_id(row))
        markers.append(shared.revocations.revoke(k, seen, by=by, reason=reason).name)
        ids.extend(sorted(set(seen)))
        if local.invalidate(key_digest(k)):
            invalidated.append(key_digest(k))
    return RevokeReport(tuple(keys), tuple(markers), tuple(ids), tuple(invalidated))
