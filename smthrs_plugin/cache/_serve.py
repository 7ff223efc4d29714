"""Serving one stored entry: confine → re-admit → re-measure the read set → replay (hydrate a missing blob,
retry once).

Invariants
- **A hit touches only what the current request declares** (:func:`check_confined`): every output and removal
  must be covered by the REQUESTING declaration, none may lie in a reserved directory (``.smthrs/``, ``.git/``,
  ``.venv/``) or delete a declared read; otherwise ``ReplayFailed(reserved_path | undeclared_output |
  undeclared_removal)`` naming the path, and the work executes instead.
- An entry is served only after ALL of: admission again, its read set equals the one the key folded, every read
  re-measures to its digest, every output replayed. A glob or tree read is expanded again NOW and must match the
  recorded expansion exactly (``StaleReadSet`` naming the file otherwise). Nothing is served half-verified.
- ``MissingArtifact`` hydrates from the shared store and retries once; a corrupt blob is deleted where found and
  the local entry invalidated. A replay stages and verifies before touching the workspace.
- **Re-checking by stat alone** (:func:`served_state`, :func:`still_served`) proves the same facts as a full
  verification (stat cache, racy-timestamp rule, no link swapped in, same expansion) or answers False.
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..boundary.boundary import Declaration, ReadSetChanged, check_read_set
from ..boundary.evidence import Evidence, normal_mode, referenced_digests
from ..boundary.measure import ABSENT, Measurer
from ..boundary.replay import check_replayable, replay_outputs
from ..errors import ArtifactError, BoundaryError, ReplayError
from ..plan.fileset import PathEntry, TreeArtifact, entry_matches
from ..stores.artifacts import ArtifactStore, Corrupt
from .admission import NotAdmissible, admit_entry
from .entry import CacheEntry
from .model import ReplayFailed, StaleReadSet, Unmeasurable, UnverifiableEvidence
from .shared import SharedTier, same_store

__all__ = [
    "Verified",
    "Refused",
    "verify_entry",
    "check_confined",
    "replay_entry",
    "outputs_present",
    "ServedState",
    "served_state",
    "still_served",
    "same_expansion",
]

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
    declaration: Declaration,
) -> VerifyOutcome:
    """Confine the entry to the requesting ``declaration``, re-admit it and re-measure its read set on
    ``workspace``."""
    confined = check_confined(entry.evidence, declaration, workspace)
    if confined is not None:
        return Refused(
            ReplayFailed(confined.code, f"{tier} entry: {confined.message}"),
            invalidate=tier == "local",
            reason=confined.code.replace("_", "-"),
        )
    adm = admit_entry(entry.admission, entry.evidence)
    if isinstance(adm, NotAdmissible):
        return Refused(UnverifiableEvidence(f"{tier} entry fails {adm.conjunct}: {adm.reason}"))
    if entry.evidence.read_set != tuple(sorted(key_reads)):
        return Refused(
            UnverifiableEvidence(
                f"the {tier} entry's recorded read set is not the one its key was computed from"
            )
        )
    # Globs and trees are re-expanded here, whatever the request's read set says (see the module invariants).
    expand = () if declaration.all_reads_exact else declaration.reads
    try:
        check = check_read_set(workspace, entry.evidence.read_set, measurer=measurer, expand=expand)
    except BoundaryError as exc:
        return Refused(Unmeasurable(f"{exc.code}: {exc.message}"))
    if isinstance(check, ReadSetChanged):
        recorded = dict(entry.evidence.read_set)
        try:
            now = measurer.measure_paths(list(check.paths))
        except BoundaryError as exc:
            return Refused(Unmeasurable(f"{exc.code}: {exc.message}"))
        changed = tuple(
            (p, recorded.get(p, ABSENT), None if (s := now.get(p)) is None else s.digest) for p in check.paths
        )
        return Refused(StaleReadSet(changed), invalidate=True, reason="stale-read-set")
    return Verified()


def check_confined(
    evidence: Evidence, declaration: Declaration, workspace: Path | None = None
) -> ReplayError | None:
    """The first way ``evidence`` reaches beyond ``declaration`` (see the module invariants), as the
    ``ReplayError`` a replay would be refused with; None when every output and removal is confined. Nothing is
    written. ``workspace``: where the entry would be replayed — an exact removal that only a file write covers
    (not a declared removal, not a written tree) must not be a directory there, since removing it would delete
    everything below it."""
    writes, removes = declaration.writes, declaration.removes
    for o in evidence.outputs:
        try:
            check_replayable(o.path, "output")
        except ReplayError as exc:
            return exc
        if not any(entry_matches(w, o.path) for w in writes):
            return ReplayError(
                "undeclared_output",
                f"output {o.path!r} is not in the requesting step's declared writes; the entry is not served",
                path=o.path,
            )
    for r in evidence.removals:
        try:
            check_replayable(r, "removal")
        except ReplayError as exc:
            return exc
        tree = r.endswith("/")
        path = r[:-1] if tree else r
        cover = _removal_cover(path, tree, writes, removes)
        if cover is None:
            return ReplayError(
                "undeclared_removal",
                f"removal {r!r} is not in the requesting step's declared removes or writes; the entry is not"
                " served",
                path=r,
            )
        if cover == "file" and workspace is not None:
            target = workspace / path
            if target.is_dir() and not target.is_symlink():
                return ReplayError(
                    "undeclared_removal",
                    f"removal {r!r} would delete the directory {path + '/'!r}, but the requesting step declares"
                    " only files there; the entry is not served",
                    path=r,
                )
        # ``remove_path`` deletes a whole directory even for an exact removal: protect reads below it too.
        for read in declaration.reads:
            if not isinstance(read, str) or not (read == path or read.startswith(path + "/")):
                continue
            if any(entry_matches(e, read) for e in (*writes, *removes)):
                continue  # the request itself declares that read changed or removed
            return ReplayError(
                "undeclared_removal",
                f"removal {r!r} would delete the requesting step's declared read {read!r}; the entry is not"
                " served",
                path=r,
                read=read,
            )
    return None


def _removal_cover(
    path: str, tree: bool, writes: Sequence[PathEntry], removes: Sequence[PathEntry]
) -> str | None:
    """What declares a removal: ``"declared"`` (a declared removal or a written tree at or above it),
    ``"file"`` (an exact or glob write covering an exact removal: an honest settle records a file deleted
    inside the write set), or None. A tree removal deletes everything below it: only a tree covers it."""
    for e in (*removes, *writes):
        if isinstance(e, TreeArtifact) and (path == e.path or path.startswith(e.path + "/")):
            return "declared"
    if tree:
        return None
    if any(entry_matches(e, path) for e in removes):
        return "declared"
    if any(entry_matches(e, path) for e in writes):
        return "file"
    return None


def outputs_present(workspace: Path, evidence: Evidence, measurer: Measurer) -> bool:
    """Whether the workspace already holds every output (digest and mode) and none of the removals: then a
    replay would rewrite identical bytes, and skipping it keeps mtimes for make-like tools."""
    try:
        states = measurer.measure_paths([o.path for o in evidence.outputs])
    except BoundaryError:
        return False
    for o in evidence.outputs:
        st = states.get(o.path)
        if st is None or st.digest != o.digest or st.mode != normal_mode(o.mode):
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


@dataclass(frozen=True)
class ServedState:
    """What a fully verified serve established about the workspace, in the form :func:`still_served` re-checks:
    ``files`` (path, digest or ``"absent"``, mode or None for a read), ``absent`` (removals) and ``dirs`` (every
    directory above those paths with its (device, inode))."""

    files: tuple[tuple[str, str, int | None], ...]
    absent: tuple[str, ...]
    dirs: tuple[tuple[str, int, int], ...]


def served_state(entry: CacheEntry, workspace: Path) -> ServedState | None:
    """The state to re-check ``entry``'s serve by (call right after it was verified and replayed); None when a
    directory above one of its paths is not a plain directory now (nothing is remembered then)."""
    ev = entry.evidence
    files: list[tuple[str, str, int | None]] = [(p, d, None) for p, d in ev.read_set]
    files += [(o.path, o.digest, normal_mode(o.mode)) for o in ev.outputs]
    absent = tuple(r.rstrip("/") for r in ev.removals)
    parents: set[str] = set()
    for path in [f[0] for f in files] + list(absent):
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parents.add("/".join(parts[:i]))
    dirs: list[tuple[str, int, int]] = []
    root = str(workspace)
    for d in sorted(parents):
        try:
            st = os.lstat(f"{root}/{d}")
        except OSError:
            continue  # an absent directory above an absent read or a removal: its absence is re-checked below
        if not stat_mod.S_ISDIR(st.st_mode):
            return None
        dirs.append((d, st.st_dev, st.st_ino))
    return ServedState(tuple(files), absent, tuple(dirs))


def still_served(state: ServedState, workspace: Path, measurer: Measurer) -> bool:
    """Whether the workspace still holds exactly what ``state`` recorded (see the module invariants); False
    means "verify in full", never "refuse"."""
    cache = measurer.stat_cache
    if cache is None:
        return False
    root = str(workspace)
    for d, dev, ino in state.dirs:
        try:
            st = os.lstat(f"{root}/{d}")
        except OSError:
            return False
        if st.st_ino != ino or st.st_dev != dev or not stat_mod.S_ISDIR(st.st_mode):
            return False
    for path, digest, mode in state.files:
        try:
            st = os.lstat(f"{root}/{path}")
        except (FileNotFoundError, NotADirectoryError):
            if digest == ABSENT:
                continue
            return False
        except OSError:
            return False
        if digest == ABSENT or not stat_mod.S_ISREG(st.st_mode):
            return False
        if mode is not None and stat_mod.S_IMODE(st.st_mode) != mode:
            return False
        if cache.lookup(path, st) != digest:
            return False
    for path in state.absent:
        if os.path.lexists(f"{root}/{path}"):
            return False
    try:
        measurer.check_root()
    except BoundaryError:
        return False  # the full verification reports the lost root
    return True


def same_expansion(declaration: Declaration, read_set: Sequence[tuple[str, str]], measurer: Measurer) -> bool:
    """Whether ``declaration``'s reads still name exactly the paths of ``read_set`` (True at once when every read
    is exact). Enumeration only: the digests are :func:`still_served`'s to re-check. False, never an error, when
    the workspace cannot be enumerated: the caller then verifies in full."""
    if declaration.all_reads_exact:
        return True
    try:
        listed, _ = measurer.expand(declaration.reads)
    except BoundaryError:
        return False
    return listed == sorted(p for p, _ in read_set)
