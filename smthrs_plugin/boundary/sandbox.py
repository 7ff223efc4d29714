"""The workspace transaction: run a step's body in a temporary tree, diff the whole tree, copy declared outputs
back as a compare-and-set.

- ``hermetic`` seeds the tree with the declared reads only (an undeclared read finds no file); ``whole-tree`` seeds
  the workspace minus the reserved ``.smthrs/``, ``.git/``, ``.venv/`` (``plan.fileset.RESERVED_TOP``). Every seeded
  read is hashed as copied and must equal the prepared snapshot.
- After the body the whole tree is compared with its pre-manifest: undeclared writes and removals are facts, and
  rewriting identical bytes is not a change.
- Only this module sets ``whole_tree_writes_verified`` (the whole tree was diffed) and ``hermetic_reads_verified``
  (hermetic mode: only declared reads existed).
- Copy-back is a compare-and-set: the workspace's write/removal scopes must still equal their pre-images from
  ``prepare``, else ``MaterializationConflict`` and nothing is copied. Undeclared writes never leave the sandbox;
  seeded and copied-back files get a normalised mode (0o644/0o755).
- The temporary tree is always removed (an effect-free root is reused only while provably untouched); a body
  exception propagates after cleanup.
- Every copy-back attempt is one timed materialization on the injected metrics port (``Success``, ``Failure``,
  ``Interrupt``).
- A correctness tool, not a security boundary: a body that opens absolute paths can reach the real workspace.

How the diff stays exact and the effect-free pool: ARCHITECTURE.md ("boundary").
"""

from __future__ import annotations

import logging
import os
import stat as stat_mod
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

from .._metrics import NULL_METRICS, MetricsPort
from ..errors import BoundaryError, MaterializationConflict
from ..plan.fileset import RESERVED_TOP
from ..stores.artifacts import ArtifactStore
from ._litter import (
    EmptyRoot,
    discard,
    give_back,
    is_untouched,
    owned_temp_dir,
    release,
    staging_dir,
    take_empty_root,
)
from .boundary import Declaration, Prepared, build_evidence, classify, prepare, refuse_hard
from .evidence import Evidence, InlineLimits, diff_identity
from .fsops import check_dest, copy_with_hash, inside, normal_mode, remove_path, rmtree_force
from .measure import ABSENT, DEFAULT_ENTRY_BUDGET, FileState, Measurer, scan_tree, sha256_file

__all__ = ["SandboxMode", "SandboxResult", "run_in_sandbox", "EXCLUDED_FROM_COPY"]

log = logging.getLogger(__name__)
T = TypeVar("T")
SandboxMode = Literal["hermetic", "whole-tree"]
#: Never seeded into a whole-tree sandbox: the workspace's reserved top-level directories (one definition).
EXCLUDED_FROM_COPY = RESERVED_TOP
#: Seeded trees up to this many file bytes are compared by content after the body instead of waiting for the
#: filesystem clock to tick (hashing 1 MiB costs about what the shortest tick does).
_REHASH_ALL_BYTES = 1 << 20


@dataclass(frozen=True)
class SandboxResult(Generic[T]):
    """The body's return ``value``, the settled ``evidence`` and the ``prepared`` read snapshot."""

    value: T
    evidence: Evidence
    prepared: Prepared


@dataclass(frozen=True)
class _Snap:
    kind: Literal["file", "link"]
    ident: tuple[int, int, int, int, int]
    content: str  # file: sha256 hex; link: its target
    mode: int


def _ident(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode)


def run_in_sandbox(
    workspace: str | os.PathLike[str],
    declaration: Declaration,
    body: Callable[[Path], T],
    *,
    mode: SandboxMode = "hermetic",
    artifacts: ArtifactStore | None,
    measurer: Measurer | None = None,
    limits: InlineLimits = InlineLimits(),
    temp_dir: str | os.PathLike[str] | None = None,
    entry_budget: int = DEFAULT_ENTRY_BUDGET,
    max_workers: int = 4,
    metrics: MetricsPort = NULL_METRICS,
) -> SandboxResult[T]:
    """Prepare on ``workspace``, run ``body(sandbox_root)`` in a temporary tree, settle by whole-tree diff,
    copy declared outputs back (compare-and-set). Returns the body's value with the evidence.

    Hard mode raises ``BoundaryRefusal`` (nothing copied back); expected mode records deviations and copies
    back only the declared outputs. ``MaterializationConflict`` when the real workspace changed underneath.
    Each copy-back is one materialization on ``metrics`` (counted by exit outcome, and timed).
    """
    if mode not in ("hermetic", "whole-tree"):
        raise BoundaryError(
            "unsupported_boundary", f"sandbox mode {mode!r} is neither 'hermetic' nor 'whole-tree'", mode=mode
        )
    ws = Path(os.path.abspath(os.fspath(workspace)))
    m = measurer or Measurer(ws)
    if mode == "hermetic" and not (declaration.reads or declaration.writes or declaration.removes):
        return _run_effect_free(ws, declaration, body, m, artifacts, limits, temp_dir, entry_budget, metrics)
    prepared = prepare(ws, declaration, measurer=m)
    parent = owned_temp_dir("smthrs-sandbox", temp_dir)
    try:
        sroot = parent / "root"
        sroot.mkdir()
        box = _Box(ws, sroot, entry_budget, max_workers)
        if mode == "hermetic":
            box.seed_hermetic(prepared)
        else:
            box.seed_whole_tree(prepared)
        pre = box.manifest_after_seed()
        rehash_all = sum(snap.ident[0] for snap in pre.values() if snap.kind == "file") <= _REHASH_ALL_BYTES
        if not rehash_all:
            _wait_for_clock_tick(parent, pre)
        value = body(sroot)
        evidence = _settle_tree(
            box,
            pre,
            prepared,
            rehash_all=rehash_all,
            hermetic=mode == "hermetic",
            artifacts=artifacts,
            limits=limits,
        )
        with metrics.observe_materialization():
            _copy_back(ws, prepared, evidence, sroot, m)
        result = SandboxResult(value, evidence, prepared)
    except BaseException:
        _cleanup(parent, quiet=True)
        raise
    _cleanup(parent, quiet=False)
    return result


def _run_effect_free(
    ws: Path,
    declaration: Declaration,
    body: Callable[[Path], T],
    m: Measurer,
    artifacts: ArtifactStore | None,
    limits: InlineLimits,
    temp_dir: str | os.PathLike[str] | None,
    entry_budget: int,
    metrics: MetricsPort,
) -> SandboxResult[T]:
    """The hermetic sandbox of a declaration without reads, writes or removes (module invariants)."""
    prepared = prepare(ws, declaration, measurer=m)
    root = take_empty_root(temp_dir)
    try:
        value = body(root.path)
        clean = is_untouched(root)
        if clean:
            evidence = _effect_free_evidence(declaration.mode)
        else:
            # Exactly what the full sandbox concludes from a tree seeded with nothing.
            box = _Box(ws, root.path, entry_budget, 1)
            evidence = _settle_tree(
                box, {}, prepared, rehash_all=True, hermetic=True, artifacts=artifacts, limits=limits
            )
        with metrics.observe_materialization():
            pass  # no outputs, no removals, an empty write scope: the copy-back has nothing to compare or copy
        result = SandboxResult(value, evidence, prepared)
    except BaseException:
        _return_root(root, quiet=True)
        raise
    if clean:
        give_back(root)
    else:
        _return_root(root, quiet=False)
    return result


def _settle_tree(
    box: _Box,
    pre: dict[str, _Snap],
    prepared: Prepared,
    *,
    rehash_all: bool,
    hermetic: bool,
    artifacts: ArtifactStore | None,
    limits: InlineLimits,
) -> Evidence:
    """Diff the sandbox tree against its seeded manifest ``pre``, refuse hard-mode deviations, build the evidence."""
    declaration = prepared.declaration
    states, present, changed, deleted = box.diff(pre, rehash_all=rehash_all)
    classified = classify(declaration, present, changed, deleted)
    refuse_hard(declaration, classified.deviations)
    return build_evidence(
        prepared,
        classified,
        states,
        box.sroot,
        artifacts=artifacts,
        limits=limits,
        whole_tree_writes_verified=True,
        hermetic_reads_verified=hermetic,
    )


_EFFECT_FREE: dict[str, Evidence] = {}


def _effect_free_evidence(mode: str) -> Evidence:
    """The evidence of a clean effect-free settle: no outputs, no removals, no deviations, both flags proven.
    Immutable, so one instance per boundary mode serves every such settle."""
    ev = _EFFECT_FREE.get(mode)
    if ev is None:
        ev = Evidence(
            outputs=(),
            removals=(),
            diff_identity=diff_identity((), ()),
            deviations=(),
            whole_tree_writes_verified=True,
            hermetic_reads_verified=True,
            read_set=(),
            boundary_mode=mode,
        )
        _EFFECT_FREE[mode] = ev
    return ev


def _return_root(root: EmptyRoot, *, quiet: bool) -> None:
    _removing(root.path, lambda: release(root) if quiet else discard(root), quiet=quiet)


class _Box:
    def __init__(self, ws: Path, sroot: Path, budget: int, workers: int) -> None:
        self.ws = ws
        self.ws_real = os.path.realpath(ws)
        self.sroot = sroot
        self.sroot_real = os.path.realpath(sroot)
        self.budget = budget
        self.workers = workers
        self.copied: dict[str, str] = {}

    def _copy_all(self, rels: list[str]) -> None:
        def one(rel: str) -> tuple[str, str]:
            dst = self.sroot / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                digest, _ = copy_with_hash(str(self.ws / rel), str(dst))
            except (FileNotFoundError, NotADirectoryError) as exc:
                raise BoundaryError(
                    "changed_during_measurement",
                    f"{rel!r} vanished while the sandbox was being seeded; re-run when nothing else writes",
                    cause=exc,
                    path=rel,
                ) from exc
            except PermissionError as exc:
                raise BoundaryError("unreadable", f"cannot copy {rel!r}: {exc}", cause=exc, path=rel) from exc
            return rel, digest

        if not rels:
            return
        with ThreadPoolExecutor(max_workers=min(self.workers, len(rels))) as pool:
            self.copied.update(pool.map(one, rels))

    def _verify_reads(self, prepared: Prepared) -> None:
        for rel, want in prepared.read_set:
            got = self._content_digest(rel)
            if got != want:
                raise BoundaryError(
                    "changed_during_measurement",
                    f"declared read {rel!r} changed between prepare and seeding the sandbox ({want} → {got});"
                    " re-run when nothing else writes to the workspace",
                    path=rel,
                )

    def _content_digest(self, rel: str) -> str:
        if rel in self.copied:
            return self.copied[rel]
        path = self.sroot / rel
        try:
            with open(path, "rb") as f:
                return sha256_file(f)
        except (FileNotFoundError, NotADirectoryError):
            return ABSENT

    def seed_hermetic(self, prepared: Prepared) -> None:
        self._copy_all([p for p, d in prepared.read_set if d != ABSENT])
        self._verify_reads(prepared)

    def seed_whole_tree(self, prepared: Prepared) -> None:
        dirs, entries = scan_tree(self.ws, exclude_top=EXCLUDED_FROM_COPY, budget=self.budget)
        for d in dirs:
            (self.sroot / d).mkdir(exist_ok=True)
        files: list[str] = []
        for rel, st in entries.items():
            if stat_mod.S_ISREG(st.st_mode):
                files.append(rel)
            elif stat_mod.S_ISLNK(st.st_mode):
                os.symlink(self._retarget(os.readlink(self.ws / rel)), self.sroot / rel)
            else:
                raise BoundaryError(
                    "unsupported_boundary",
                    f"{rel!r} is a FIFO, socket or device; a whole-tree sandbox copies files and links only",
                    path=rel,
                )
        self._copy_all(files)
        self._verify_reads(prepared)

    def _retarget(self, target: str) -> str:
        # An absolute link into the workspace would let the body write through it into the real tree.
        if os.path.isabs(target):
            norm = os.path.normpath(target)
            for base in {str(self.ws), self.ws_real}:
                if norm == base or norm.startswith(base + os.sep):
                    return self.sroot_real + norm[len(base) :]
        return target

    def manifest_after_seed(self) -> dict[str, _Snap]:
        _, entries = scan_tree(self.sroot, budget=self.budget)
        pre: dict[str, _Snap] = {}
        for rel, st in entries.items():
            if stat_mod.S_ISLNK(st.st_mode):
                pre[rel] = _Snap("link", _ident(st), os.readlink(self.sroot / rel), 0)
            else:
                pre[rel] = _Snap("file", _ident(st), self.copied[rel], stat_mod.S_IMODE(st.st_mode))
        return pre

    def diff(
        self, pre: dict[str, _Snap], *, rehash_all: bool = False
    ) -> tuple[dict[str, FileState], set[str], set[str], set[str]]:
        """``(states of regular files, present paths, changed paths, deleted paths)`` of the whole tree.

        ``rehash_all``: trust no lstat identity (no clock tick was waited for): hash every regular file."""
        if not self.sroot.is_dir():
            raise BoundaryError(
                "unsupported_boundary", "the step removed its own sandbox root; nothing can be settled"
            )
        _, post = scan_tree(self.sroot, budget=self.budget)
        states: dict[str, FileState] = {}
        changed: set[str] = set()
        to_hash: list[str] = []
        for rel, st in post.items():
            old = pre.get(rel)
            if stat_mod.S_ISLNK(st.st_mode):
                if old is None or old.kind != "link" or old.content != os.readlink(self.sroot / rel):
                    changed.add(rel)
            elif stat_mod.S_ISREG(st.st_mode):
                if not rehash_all and old is not None and old.kind == "file" and old.ident == _ident(st):
                    states[rel] = FileState(old.content, st.st_size, old.mode)
                else:
                    to_hash.append(rel)
            else:
                changed.add(rel)  # a FIFO or socket the body left behind: a write, never an output

        def one(rel: str) -> tuple[str, FileState]:
            path = self.sroot / rel
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                return rel, FileState(sha256_file(f), st.st_size, stat_mod.S_IMODE(st.st_mode))

        hashed: list[tuple[str, FileState]] = []
        if len(to_hash) == 1:
            hashed.append(one(to_hash[0]))  # no pool for one small file (the common hermetic step)
        elif to_hash:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(to_hash))) as pool:
                hashed.extend(pool.map(one, to_hash))
        for rel, fs in hashed:
            states[rel] = fs
            old = pre.get(rel)
            if old is None or old.kind != "file" or old.content != fs.digest or old.mode != fs.mode:
                changed.add(rel)
        deleted = set(pre) - set(post)
        return states, set(post), changed, deleted


def _wait_for_clock_tick(parent: Path, pre: dict[str, _Snap]) -> None:
    """Return once the filesystem's own clock is past every seeded file's ctime (usually one jiffy)."""
    newest = max((s.ident[2] for s in pre.values()), default=0)
    marker = parent / "clock"
    marker.touch()
    for _ in range(5000):
        os.utime(marker)
        if os.stat(marker).st_ctime_ns > newest:
            return
        time.sleep(0.001)
    raise BoundaryError(
        "unsupported_boundary",
        "the sandbox filesystem's timestamps did not advance within 5 s; writes could not be told apart",
    )


def _copy_back(ws: Path, prepared: Prepared, evidence: Evidence, sroot: Path, m: Measurer) -> None:
    decl = prepared.declaration
    ws_real = os.path.realpath(ws)
    dests = [check_dest(ws_real, o.path) for o in evidence.outputs]
    removal_dests = [inside(ws_real, r.rstrip("/")) for r in evidence.removals]
    before = dict(prepared.pre_scope)
    stage: Path | None = None  # made only when something must be staged (a directory costs metadata writes)
    try:
        staged: list[tuple[str, str]] = []
        for i, (o, dest) in enumerate(zip(evidence.outputs, dests, strict=True)):
            if before.get(o.path) == FileState(o.digest, o.size, o.mode):
                continue  # already there (and the CAS below proves it still is): keep its mtime for make & co
            if stage is None:
                stage = staging_dir(ws, "copyback")
            tmp = str(stage / str(i))
            digest, _ = copy_with_hash(str(sroot / o.path), tmp)
            if digest != o.digest:
                raise BoundaryError(
                    "changed_during_measurement",
                    f"sandbox output {o.path!r} changed after it was settled (a background process?)",
                    path=o.path,
                )
            os.chmod(tmp, normal_mode(o.mode))  # only the owner-execute bit is copied back
            staged.append((tmp, dest))
        scope = decl.writes + tuple(decl.removes)
        # An empty scope has no pre-image to compare (and nothing is copied or removed): no measurement.
        now = {p: s for p, s in m.measure_entries(scope).items() if s is not None} if scope else {}
        conflicts = sorted(p for p in set(now) | set(before) if now.get(p) != before.get(p))
        if conflicts:
            shown = ", ".join(conflicts[:20])
            raise MaterializationConflict(
                "materialization_conflict",
                f"the workspace changed underneath the step at {shown}; nothing was copied back — re-run the step"
                " on the new state",
                paths=conflicts,
            )
        try:
            for tmp, dest in staged:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.replace(tmp, dest)
            for d in removal_dests:
                remove_path(d)
        except OSError as exc:
            raise BoundaryError(
                "unsupported_boundary", f"copying outputs back into {ws} failed: {exc}", cause=exc
            ) from exc
    finally:
        if stage is not None:
            rmtree_force(stage)


def _cleanup(parent: Path, *, quiet: bool) -> None:
    _removing(parent, lambda: rmtree_force(parent), quiet=quiet)


def _removing(path: Path, remove: Callable[[], object], *, quiet: bool) -> None:
    """Run ``remove``; its ``OSError`` is a typed refusal, or (``quiet``: another exception is already
    propagating, the one the caller must see) a warning."""
    try:
        remove()
    except OSError as exc:
        if not quiet:
            raise BoundaryError(
                "unsupported_boundary", f"could not remove the sandbox {path}: {exc}", cause=exc
            ) from exc
        log.warning("could not remove the sandbox %s: %s", path, exc)
