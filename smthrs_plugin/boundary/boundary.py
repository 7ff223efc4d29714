"""The step boundary: ``prepare`` (measure the declared reads) → run → ``settle`` (measure the writes, classify,
record evidence). ``replay_outputs`` lives in :mod:`.replay`, the sandboxed variant in :mod:`.sandbox`.

Invariants
- The same observation is a refusal in ``hard`` mode (``BoundaryRefusal`` undeclared_write /
  missing_declared_output / surviving_declared_removal, naming the paths) and a recorded deviation in
  ``expected`` mode (``ExpectedSetDeviation`` / ``MissingDeclaredOutput`` / ``SurvivingDeclaredRemoval``).
- The plain boundary measures only what is declared: the write and removal scopes (against their pre-images
  taken at prepare) and the read set (a declared read that changed and is not declared written is an
  undeclared write). It cannot see a write elsewhere, so it never claims ``whole_tree_writes_verified`` or
  ``hermetic_reads_verified``: its evidence stays run-local. Only :mod:`.sandbox` sets those flags.
- Output modes are recorded normalised (0o644/0o755: only the owner-execute bit travels), whatever the step
  left on disk; a declaration may not write or remove under ``.smthrs/``, ``.git/`` or ``.venv/``.
- Inline or spilled outputs are decided in sorted path order against the settle's inline budget; spilled
  bytes are stored by digest and re-verified against the measurement (a change in between refuses the settle).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

from ..errors import ArtifactError, BoundaryError, BoundaryRefusal, PlanError
from ..plan.fileset import (
    EntryInput,
    Glob,
    PathEntry,
    TreeArtifact,
    check_not_reserved,
    entries_overlap,
    entry_json,
    entry_matches,
    flatten,
    is_exact,
)
from ..stores.artifacts import ArtifactStore
from .evidence import (
    Deviation,
    Evidence,
    ExpectedSetDeviation,
    InlineLimits,
    MissingDeclaredOutput,
    Output,
    SurvivingDeclaredRemoval,
    diff_identity,
)
from .fsops import normal_mode
from .measure import ABSENT, FileState, Measurer

__all__ = [
    "BoundaryMode",
    "Declaration",
    "Prepared",
    "prepare",
    "settle",
    "check_read_set",
    "ReadSetMatches",
    "ReadSetChanged",
    "ReadSetCheck",
]

BoundaryMode = Literal["hard", "expected"]
RemoveEntry = Union[str, TreeArtifact]


def _refuse(msg: str) -> PlanError:
    return PlanError("invalid_effects", msg)


@dataclass(frozen=True)
class Declaration:
    """What a step declares: ``reads``/``writes`` (exact paths, ``"dir/"`` trees, globs, filegroups),
    ``removes`` (exact paths or ``"dir/"`` trees) and the boundary ``mode`` (``hard`` | ``expected``).

    Entries are normalised on construction (``PlanError(invalid_effects)`` for a bad path, a glob removal, a
    path both written and removed, or a write/removal under a reserved top-level directory — ``.smthrs/``,
    ``.git/``, ``.venv/``; reading them is allowed).
    """

    reads: tuple[PathEntry, ...] = ()
    writes: tuple[PathEntry, ...] = ()
    removes: tuple[RemoveEntry, ...] = ()
    mode: BoundaryMode = "hard"

    def __post_init__(self) -> None:
        for name in ("reads", "writes", "removes"):
            value = getattr(self, name)
            if isinstance(value, (str, Glob, TreeArtifact)):
                value = (value,)
            object.__setattr__(self, name, flatten(value))
        for r in self.removes:
            if isinstance(r, Glob):
                raise _refuse(
                    f"removal {entry_json(r)} is a glob; declare removals as exact paths or trees ('build/')"
                )
        if self.mode not in ("hard", "expected"):
            raise _refuse(f"boundary mode {self.mode!r} is neither 'hard' nor 'expected'")
        check_not_reserved(self.writes, self.removes)
        for w in self.writes:
            for r in self.removes:
                # glob×tree overlap is only conservative; every other pair is decided exactly
                if entries_overlap(w, r) and not isinstance(w, Glob):
                    raise _refuse(
                        f"{entry_json(w)} is both written and removed ({entry_json(r)}); declare one"
                    )
                if isinstance(w, Glob) and isinstance(r, str) and entry_matches(w, r):
                    raise _refuse(f"{r!r} is both written ({entry_json(w)}) and removed; declare one")

    @classmethod
    def of(
        cls,
        reads: Iterable[EntryInput] = (),
        writes: Iterable[EntryInput] = (),
        removes: Iterable[EntryInput] = (),
        mode: BoundaryMode = "hard",
    ) -> Declaration:
        """Build from any iterables of entries (lists, strings like ``"dist/"`` or ``"src/**/*.py"``)."""
        return cls(flatten(reads), flatten(writes), flatten(removes), mode)  # type: ignore[arg-type]

    @property
    def all_reads_exact(self) -> bool:
        return all(is_exact(e) for e in self.reads)

    def removal_strings(self) -> list[str]:
        """Sorted unique removals: ``"a/b"`` for a path, ``"dir/"`` for a tree."""
        return sorted({_removal_str(r) for r in self.removes})

    def to_json(self) -> dict[str, Any]:
        """Plain JSON of the declaration (entries normalised, write set sorted)."""
        return {
            "reads": [entry_json(e) for e in self.reads],
            "writeSet": sorted((entry_json(e) for e in self.writes), key=_entry_sort_key),
            "removes": self.removal_strings(),
            "boundaryMode": self.mode,
        }


def _entry_sort_key(e: Mapping[str, Any]) -> str:
    import json

    return json.dumps(e, sort_keys=True)


def _removal_str(r: RemoveEntry) -> str:
    return r.path + "/" if isinstance(r, TreeArtifact) else r


@dataclass(frozen=True)
class Prepared:
    """A measured read snapshot plus the pre-images of the declared write/removal scopes.

    ``read_set``: sorted ``(path, sha256 hex | "absent")`` of every file the reads name (globs and trees
    expanded: this list IS their expansion, which the key folds and a hit re-expands and compares);
    ``all_reads_exact``: every declared read was an exact path (else the cache admits the result only by its
    expansion, see ``cache._admission`` conjunct 3);
    ``pre_scope``: sorted ``(path, FileState)`` of the files under ``writes ∪ removes`` before the step.
    """

    root: str
    declaration: Declaration
    read_set: tuple[tuple[str, str], ...]
    all_reads_exact: bool
    pre_scope: tuple[tuple[str, FileState], ...]

    def read_set_json(self) -> list[dict[str, str]]:
        return [{"path": p, "digest": d} for p, d in self.read_set]

    def key_material(self) -> dict[str, Any]:
        """The ``hermetic`` member of a dispatch key (SEMANTICS §1): read set, sorted write set, removals,
        boundary mode."""
        d = self.declaration.to_json()
        return {
            "readSet": self.read_set_json(),
            "writeSet": d["writeSet"],
            "removes": d["removes"],
            "boundaryMode": d["boundaryMode"],
        }


def _scope(decl: Declaration) -> tuple[PathEntry, ...]:
    return decl.writes + tuple(decl.removes)


def prepare(
    root: str | os.PathLike[str], declaration: Declaration, *, measurer: Measurer | None = None
) -> Prepared:
    """Measure the declared reads (SHA-256, stat cache) and the pre-images of the write/removal scopes."""
    m = measurer or Measurer(root)
    _same_root(m, root)
    scope_entries = _scope(declaration)
    # An empty list measures nothing; only its closing root check (the workspace is still the same directory)
    # is kept, once.
    reads = m.measure_entries(declaration.reads) if declaration.reads else {}
    scope = m.measure_entries(scope_entries) if scope_entries else {}
    if not declaration.reads and not scope_entries:
        m.check_root()
    return Prepared(
        root=str(m.root),
        declaration=declaration,
        read_set=tuple((p, s.digest if s is not None else ABSENT) for p, s in reads.items()),
        all_reads_exact=declaration.all_reads_exact,
        pre_scope=tuple((p, s) for p, s in scope.items() if s is not None),
    )


def _same_root(m: Measurer, root: str | os.PathLike[str]) -> None:
    if root is m.root or root == m.root:
        return  # the caller passed the measurer's own root (the dispatcher does, every node): nothing to resolve
    if m.root != Path(os.path.abspath(os.fspath(root))):
        raise BoundaryError(
            "unsupported_boundary",
            f"the measurer measures {m.root}, not {root}; pass the workspace's measurer",
        )


# -- classification (shared with the sandbox) ------------------------------------------------------------------


@dataclass(frozen=True)
class Classified:
    outputs: tuple[str, ...]
    removals: tuple[str, ...]
    deviations: tuple[Deviation, ...]


def classify(
    decl: Declaration, present: Iterable[str], changed: Iterable[str], deleted: Iterable[str]
) -> Classified:
    """Sort observed facts into outputs, removals and deviations.

    ``present``: every path that exists afterwards within what was observed; ``changed``: created or modified
    paths; ``deleted``: paths that existed before and are gone.
    """
    here = sorted(set(present))
    gone = set(deleted)

    def written(p: str) -> bool:
        return any(entry_matches(w, p) for w in decl.writes)

    def removed(p: str) -> bool:
        return any(entry_matches(r, p) for r in decl.removes)

    undeclared = sorted(p for p in set(changed) | gone if not written(p) and not removed(p))
    here_set = set(here)
    missing: list[str] = []
    for w in decl.writes:
        if isinstance(w, str) and w not in here_set:
            missing.append(w)
        elif isinstance(w, TreeArtifact) and not any(entry_matches(w, p) for p in here):
            missing.append(w.path + "/")
    surviving_entries = [r for r in decl.removes if any(entry_matches(r, p) for p in here)]
    surviving = sorted({p for p in here if any(entry_matches(r, p) for r in surviving_entries)})
    removals = {_removal_str(r) for r in decl.removes if r not in surviving_entries}
    removals |= {p for p in gone if written(p) and not removed(p)}
    deviations: list[Deviation] = []
    if undeclared:
        deviations.append(ExpectedSetDeviation(tuple(undeclared)))
    if missing:
        deviations.append(MissingDeclaredOutput(tuple(sorted(missing))))
    if surviving:
        deviations.append(SurvivingDeclaredRemoval(tuple(surviving)))
    return Classified(
        outputs=tuple(p for p in here if written(p)),
        removals=tuple(sorted(removals)),
        deviations=tuple(deviations),
    )


_REFUSAL = {
    ExpectedSetDeviation: (
        "undeclared_write",
        "wrote outside its declared write set",
        "declare these writes",
    ),
    MissingDeclaredOutput: (
        "missing_declared_output",
        "did not produce declared outputs",
        "produce them, or declare them in removes",
    ),
    SurvivingDeclaredRemoval: (
        "surviving_declared_removal",
        "left declared removals in place",
        "delete them, or stop declaring them removed",
    ),
}


def refuse_hard(decl: Declaration, deviations: Sequence[Deviation]) -> None:
    """Hard mode: the first deviation (write, then missing, then surviving) becomes a ``BoundaryRefusal``."""
    if decl.mode != "hard" or not deviations:
        return
    d = deviations[0]
    code, what, todo = _REFUSAL[type(d)]
    shown = ", ".join(d.paths[:20]) + (f" (+{len(d.paths) - 20} more)" if len(d.paths) > 20 else "")
    raise BoundaryRefusal(
        code,
        f"the step {what}: {shown}; {todo}, or use boundary mode 'expected' to record it as a deviation",
        paths=list(d.paths),
        deviations=[{"kind": x.kind, "paths": list(x.paths)} for x in deviations],
    )


def build_evidence(
    prepared: Prepared,
    classified: Classified,
    states: Mapping[str, FileState],
    source_root: str | os.PathLike[str],
    *,
    artifacts: ArtifactStore | None,
    limits: InlineLimits,
    whole_tree_writes_verified: bool,
    hermetic_reads_verified: bool,
) -> Evidence:
    """Outputs inline or spilled (sorted path order), read back from ``source_root`` and re-verified."""
    src = os.fspath(source_root)
    outs: list[Output] = []
    spill: list[tuple[str, str]] = []
    total = 0
    for p in classified.outputs:
        st = states.get(p)
        if st is None:
            raise BoundaryError(
                "unsupported_boundary",
                f"output {p!r} is not a regular file (a symlink?); outputs must be files — write the file itself",
                path=p,
            )
        if st.size <= limits.max_inline_bytes and total + st.size <= limits.max_total_inline_bytes:
            with open(os.path.join(src, p), "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != st.digest:
                raise _changed(p)
            total += st.size
            outs.append(Output(p, st.digest, st.size, normal_mode(st.mode), data))
        else:
            spill.append((os.path.join(src, p), st.digest))
            outs.append(Output(p, st.digest, st.size, normal_mode(st.mode), None))
    if spill:
        if artifacts is None:
            raise BoundaryError(
                "unsupported_boundary",
                f"{len(spill)} outputs exceed the inline limits and no artifact store was given; pass artifacts=",
            )
        try:
            artifacts.put_files(spill)
        except ArtifactError as exc:
            if exc.code == "digest_mismatch":
                raise BoundaryError(
                    "changed_during_measurement",
                    "an output changed between its measurement and its upload; re-run the step",
                    cause=exc,
                ) from exc
            raise BoundaryError(
                "unsupported_boundary", f"could not store spilled outputs: {exc}", cause=exc
            ) from exc
    return Evidence(
        outputs=tuple(outs),
        removals=classified.removals,
        diff_identity=diff_identity(outs, classified.removals),
        deviations=classified.deviations,
        whole_tree_writes_verified=whole_tree_writes_verified,
        hermetic_reads_verified=hermetic_reads_verified,
        read_set=prepared.read_set,
        boundary_mode=prepared.declaration.mode,
    )


def _changed(p: str) -> BoundaryError:
    return BoundaryError(
        "changed_during_measurement",
        f"{p!r} changed between its measurement and reading its bytes; re-run when nothing else writes to it",
        path=p,
    )


def settle(
    prepared: Prepared,
    *,
    artifacts: ArtifactStore | None,
    measurer: Measurer | None = None,
    limits: InlineLimits = InlineLimits(),
) -> Evidence:
    """Measure the declared scopes after the step ran in place, classify, and record evidence.

    Hard mode raises ``BoundaryRefusal``; expected mode returns evidence carrying the deviations. The plain
    boundary never sets the two ``*_verified`` flags (see the module docstring).
    """
    decl = prepared.declaration
    m = measurer or Measurer(prepared.root)
    _same_root(m, prepared.root)
    scope_entries = _scope(decl)
    post = (
        {p: s for p, s in m.measure_entries(scope_entries).items() if s is not None} if scope_entries else {}
    )
    pre = dict(prepared.pre_scope)
    changed = {p for p, s in post.items() if pre.get(p) != s}
    deleted = set(pre) - set(post)
    # A declared read that changed and is not declared written was written by the step (or underneath it).
    before_reads = dict(prepared.read_set)
    after_reads = (
        {p: (s.digest if s is not None else ABSENT) for p, s in m.measure_entries(decl.reads).items()}
        if decl.reads
        else {}
    )
    if not decl.reads and not scope_entries:
        m.check_root()  # the one root check the skipped (empty) measurements would have made
    for p in set(before_reads) | set(after_reads):
        if before_reads.get(p, ABSENT) != after_reads.get(p, ABSENT):
            (changed if after_reads.get(p, ABSENT) != ABSENT else deleted).add(p)
    classified = classify(decl, post, changed, deleted)
    refuse_hard(decl, classified.deviations)
    return build_evidence(
        prepared,
        classified,
        post,
        prepared.root,
        artifacts=artifacts,
        limits=limits,
        whole_tree_writes_verified=False,
        hermetic_reads_verified=False,
    )


# -- serving a hit: is the recorded read set still true? -------------------------------------------------------


@dataclass(frozen=True)
class ReadSetMatches:
    """Every recorded read still has its recorded digest."""


@dataclass(frozen=True)
class ReadSetChanged:
    """These recorded reads changed (→ ``StaleReadSet``)."""

    paths: tuple[str, ...]


ReadSetCheck = Union[ReadSetMatches, ReadSetChanged]


def check_read_set(
    root: str | os.PathLike[str],
    read_set: Iterable[tuple[str, str]],
    *,
    measurer: Measurer | None = None,
    expand: Iterable[PathEntry] = (),
) -> ReadSetCheck:
    """Re-measure a recorded read set. Without ``expand`` only the recorded paths are re-measured, which proves
    nothing about a file that newly matches a glob. ``expand``: the declared reads whose expansion the set
    records; when one is a glob or a tree they are expanded again now and the recorded set must be exactly that
    expansion: a path matching now but not recorded, recorded but no longer matching, or with another digest,
    is changed."""
    m = measurer or Measurer(root)
    _same_root(m, root)
    recorded = dict(read_set)
    entries = tuple(expand)
    if any(not is_exact(e) for e in entries):
        expanded = {p: _digest_or_absent(s) for p, s in m.measure_entries(entries).items()}
        changed = tuple(
            p for p in sorted(set(recorded) | set(expanded)) if recorded.get(p) != expanded.get(p)
        )
        return ReadSetChanged(changed) if changed else ReadSetMatches()
    if not recorded:
        m.check_root()  # nothing to re-measure; the workspace must still be the one the entry was keyed on
        return ReadSetMatches()
    now = m.measure_paths(list(recorded))
    stale = tuple(p for p in sorted(recorded) if _digest_or_absent(now[p]) != recorded[p])
    return ReadSetChanged(stale) if stale else ReadSetMatches()


def _digest_or_absent(s: FileState | None) -> str:
    return s.digest if s is not None else ABSENT
