"""Serving one stored entry: re-admit → re-measure the read set → replay (hydrate a missing blob, retry once).

Invariants (SEMANTICS.md §4, seed step-boundaries "Replay refusals a caller can act on")
- An entry is served only after ALL of: its claims pass the seven admission conjuncts again, its recorded read
  set is the one the key folded, every recorded read re-measures to its recorded digest on this workspace, and
  every output was replayed (or is already present with its digest and mode). Anything else is a decision that
  falls through to a real execution; nothing is ever served half-verified.
- ``MissingArtifact``: the missing blobs are hydrated from the shared store into the local one and the replay is
  retried exactly once; then ``ReplayFailed(missing_artifact)``. ``BoundaryCorruption``: the corrupt blob is
  deleted where it was found (so re-execution can store it again — a content-addressed put skips existing names)
  and the local entry invalidated. ``UnsupportedBoundary`` over an unavailable local store is a storage failure
  and propagates.
- A replay stages and verifies everything before touching the workspace (``replay_outputs``), so a failed replay
  leaves the workspace as it was.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..boundary.boundary import ReadSetChanged, check_read_set
from ..boundary.evidence import Evidence, referenced_digests
from ..boundary.measure import Measurer
from ..boundary.replay import replay_outputs
from ..errors import ArtifactError, BoundaryError, ReplayError
from ..stores.artifacts import ArtifactStore, Corrupt
from .admission import NotAdmissible, admit_entry
from .entry import CacheEntry
from .model import ReplayFailed, StaleReadSet, Unmeasurable, UnverifiableEvidence
from .shared import SharedTier, same_store

__all__ = ["Verified", "Refused", "verify_entry", "replay_entry", "outputs_present"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    """The entry may be replayed."""


@dataclass(frozen=True)
class Refused:
    """The entry must not be served: ``decision`` says why; ``invalidate`` when the local row should go."""

    decision: UnverifiableEvidence | Unmeasurable | StaleReadSet | ReplayFailed
    invalidate: bool = False
    reason: str = ""


VerifyOutcome = Union[Verified, Refused]


def verify_entry(
    entry: CacheEntry,
    tier: str,
    key_reads: tuple[tuple[str, str], ...],
    workspace: Path,
    measurer: Measurer,
) -> VerifyOutcome:
    """Re-admit the entry and re-measure its read set on ``workspace``."""
    adm = admit_entry(entry.admission, entry.evidence)
    if isinstance(adm, NotAdmissible):
        return Refused(UnverifiableEvidence(f"{tier} entry fails {adm.conjunct}: {adm.reason}"))
    if entry.evidence.read_set != tuple(sorted(key_reads)):
        return Refused(
            UnverifiableEvidence(
                f"the {tier} entry's recorded read set is not the one its key was computed from"
            )
        )
    try:
        check = check_read_set(workspace, entry.evidence.read_set, measurer=measurer)
    except BoundaryError as exc:
        return Refused(Unmeasurable(f"{exc.code}: {exc.message}"))
    if isinstance(check, ReadSetChanged):
        recorded = dict(entry.evidence.read_set)
        try:
            now = measurer.measure_paths(list(check.paths))
        except BoundaryError as exc:
            return Refused(Unmeasurable(f"{exc.code}: {exc.message}"))
        changed = tuple(
            (p, recorded[p], None if (s := now.get(p)) is None else s.digest) for p in check.paths
        )
        return Refused(StaleReadSet(changed), invalidate=True, reason="stale-read-set")
    return Verified()


def outputs_present(workspace: Path, evidence: Evidence, measurer: Measurer) -> bool:
    """Whether the workspace already holds every output (digest and mode) and none of the removals: then a
    replay would rewrite identical bytes, and skipping it keeps mtimes for make-like tools."""
    try:
        states = measurer.measure_paths([o.path for o in evidence.outputs])
    except BoundaryError:
        return False
    for o in evidence.outputs:
        st = states.get(o.path)
        if st is None or st.digest != o.digest or st.mode != o.mode:
            return False
    return not any(os.path.lexists(workspace / r.rstrip("/")) for r in evidence.removals)


def replay_entry(
    entry: CacheEntry,
    workspace: Path,
    artifacts: ArtifactStore,
    shared: SharedTier,
    measurer: Measurer,
) -> Refused | None:
    """Replay ``entry``'s outputs into ``workspace``; None on success."""
    evidence = entry.evidence
    if outputs_present(workspace, evidence, measurer):
        return None
    try:
        replay_outputs(workspace, evidence, artifacts)
        return None
    except ReplayError as exc:
        failure = exc
    if failure.code == "missing_artifact" and not same_store(artifacts, shared.store):
        try:
            copied = shared.hydrate(referenced_digests(evidence), artifacts)
        except ArtifactError as hx:
            return _hydrate_failed(hx, shared.store)
        log.info("hydrated %d blobs of %s from %s", copied, entry.name, shared.store.url)
        try:
            replay_outputs(workspace, evidence, artifacts)
            return None
        except ReplayError as exc:
            failure = exc
    return _replay_failed(failure, artifacts)


def _hydrate_failed(exc: ArtifactError, store: ArtifactStore) -> Refused:
    if exc.code == "corrupt":
        digest = str(exc.details.get("digest", ""))
        _drop_corrupt(store, digest)
        return Refused(
            ReplayFailed(
                "boundary_corruption", f"shared blob {digest} no longer hashes to its name; not served"
            ),
            invalidate=True,
            reason="boundary-corruption",
        )
    if exc.code == "not_found":
        return Refused(
            ReplayFailed("missing_artifact", f"a blob is missing here and in the shared tier: {exc}")
        )
    # The shared store is unreachable: the shared tier never fails a run, it only stops serving.
    log.warning("could not hydrate from %s: %s", store.url, exc)
    return Refused(
        ReplayFailed("missing_artifact", f"a blob is missing and the shared tier is unavailable: {exc}")
    )


def _replay_failed(exc: ReplayError, artifacts: ArtifactStore) -> Refused:
    if exc.code == "boundary_corruption":
        digest = exc.details.get("digest")
        if isinstance(digest, str):
            _drop_corrupt(artifacts, digest)
        return Refused(
            ReplayFailed("boundary_corruption", exc.message), invalidate=True, reason="boundary-corruption"
        )
    if (
        exc.code == "unsupported_boundary"
        and isinstance(exc.cause, ArtifactError)
        and exc.cause.code == "unavailable"
    ):
        raise exc.cause  # the local store failed: a storage failure, not a cache decision
    return Refused(ReplayFailed(exc.code, exc.message))


def _drop_corrupt(store: ArtifactStore, digest: str) -> None:
    """Delete a blob proven corrupt (re-read and re-hashed now): a content-addressed put never overwrites an
    existing name, so leaving it would poison every re-execution's entry too."""
    if not digest:
        return
    check = store.check_blob(digest)
    if isinstance(check, Corrupt):
        store.delete_blob(digest)
        log.warning("deleted corrupt blob %s from %s (it hashed to %s)", digest, store.url, check.actual)
