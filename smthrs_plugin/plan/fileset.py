"""Workspace-relative path entries: exact paths, Bazel-like globs, tree artifacts and filegroups. PURE.

Invariants
- Every pattern is workspace-relative: no absolute path, no ``..``, no empty or ``.`` segment, no NUL.
  Backslashes are normalised to ``/`` *before* checking, so ``a\\..\\b`` is refused like ``a/../b``.
- Glob semantics follow Bazel's ``glob()``: ``*`` matches within one segment, ``**`` (a whole segment) matches
  any number of segments including zero, ``?`` one character.
- Dotfiles are deliberate: a wildcard never matches a segment that starts with ``.`` unless the pattern segment
  itself starts with ``.`` (shell convention). ``src/**`` therefore skips ``src/.cache``; say ``src/.cache/**``
  to read it. This keeps ``.git``, ``.venv`` and ``.smthrs`` out of read sets unless named.
- Overlap is *conservative*: ``True`` may over-order, ``False`` proves no path can belong to both. exact×exact,
  exact×tree, tree×tree and exact×glob are decided precisely; glob×glob and tree×glob overlap unless the globs'
  static prefixes prove them disjoint (a glob matches only paths under its literal leading directories, so
  ``src/**`` never meets the tree ``deployed/`` nor the glob ``dist/*.js``). The reference engine treats every
  glob×glob and tree×glob pair as overlapping; with edges inferred whatever the declaration order, that made a
  reader of ``src/**`` wait for a writer of ``deployed/`` and could order a pipeline backwards, so the prefix
  proof is a deliberate refinement: it only removes edges between entries that share no path. A false overlap
  costs an ordering edge; a missed one would let two writers race.
- ``RESERVED_TOP`` (``.smthrs``, ``.git``, ``.venv``) are the workspace's own top-level directories: the state
  database, the artifact store and staging, the repository (its hooks run code) and the environment. Nothing a
  step declares may write or remove under them (``check_not_reserved``), no cache hit may touch them, and the
  whole-tree sandbox never copies them. Reading them stays allowed (``.git/HEAD`` is a legitimate input).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ..errors import PlanError

__all__ = [
    "Glob",
    "TreeArtifact",
    "Filegroup",
    "PathEntry",
    "EntryInput",
    "normalize_path",
    "normalize_pattern",
    "flatten",
    "glob_match",
    "entry_matches",
    "entries_overlap",
    "sets_overlap",
    "static_prefix",
    "dirs_related",
    "glob_may_touch",
    "globs_may_overlap",
    "entry_json",
    "is_exact",
    "RESERVED_TOP",
    "reserved_top",
    "check_not_reserved",
]

#: Top-level directories of a workspace that belong to smthrs, git and the Python environment: never written or
#: removed by a step or a cache hit (the one definition; the sandbox and replay use it too).
RESERVED_TOP: tuple[str, ...] = (".smthrs", ".git", ".venv")


def _refuse(path: object, why: str) -> PlanError:
    return PlanError(
        "invalid_effects",
        f"path {path!r} {why}; declare workspace-relative paths like 'src/app.py', 'dist/' or 'src/**/*.py'",
        path=str(path),
    )


def _split(path: object, *, allow_wild: bool) -> list[str]:
    if not isinstance(path, str):
        raise _refuse(path, "is not a string")
    if "\x00" in path:
        raise _refuse(path, "contains a NUL character")
    p = path.replace("\\", "/")
    if p == "":
        raise _refuse(path, "is empty")
    if p.startswith("/") or re.match(r"^[A-Za-z]:(/|$)", p):
        raise _refuse(path, "is absolute")
    segs = p.split("/")
    for s in segs:
        if s == "":
            raise _refuse(path, "has an empty segment ('//')")
        if s == ".":
            raise _refuse(path, "has a '.' segment")
        if s == "..":
            raise _refuse(path, "escapes the workspace with '..'")
        if not allow_wild and any(c in s for c in "*?["):
            raise _refuse(path, "contains a wildcard where an exact path is required")
        if allow_wild and "**" in s and s != "**":
            raise _refuse(path, "uses '**' inside a segment; '**' must be a whole segment like 'src/**/x'")
        if allow_wild and "[" in s:
            raise _refuse(path, "uses '[...]' classes, which are not supported; use '*' or '?'")
    return segs


def normalize_path(path: object) -> str:
    """Normalise and check an exact workspace-relative path (no wildcards). Raises ``PlanError(invalid_effects)``."""
    return "/".join(_split(path, allow_wild=False))


def normalize_pattern(pattern: object) -> str:
    """Normalise and check a glob pattern. Raises ``PlanError(invalid_effects)``."""
    return "/".join(_split(pattern, allow_wild=True))


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        # pydantic wraps a validator's ValueError (PlanError is one) in a ValidationError; callers are promised
        # the typed PlanError itself, so unwrap it (any other validation failure becomes invalid_effects).
        try:
            super().__init__(**data)
        except ValidationError as exc:
            for err in exc.errors():
                inner = (err.get("ctx") or {}).get("error")
                if isinstance(inner, PlanError):
                    raise inner from exc
            raise PlanError(
                "invalid_effects", f"{type(self).__name__} refused: {exc}", cause=exc, entry=repr(data)
            ) from exc


class Glob(_Frozen):
    """Bazel-like glob: paths matching any ``include`` pattern and no ``exclude`` pattern."""

    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()

    @field_validator("include", "exclude", mode="before")
    @classmethod
    def _norm(cls, v: Any) -> tuple[str, ...]:
        if isinstance(v, str):
            v = (v,)
        return tuple(normalize_pattern(p) for p in v)

    @field_validator("include")
    @classmethod
    def _non_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise _refuse(v, "is a glob with no include pattern")
        return v


class TreeArtifact(_Frozen):
    """A whole directory tree (written as ``"dist/"`` in string form)."""

    path: str

    @field_validator("path", mode="before")
    @classmethod
    def _norm(cls, v: Any) -> str:
        if isinstance(v, str):
            v = v.rstrip("/").rstrip("\\") if v not in ("/", "\\") else v
        return normalize_path(v)


class Filegroup(_Frozen):
    """A named, ordered group of entries; expands in order where it is used."""

    name: str
    entries: tuple[Union[str, Glob, TreeArtifact, Filegroup], ...]


PathEntry = Union[str, Glob, TreeArtifact]
EntryInput = Union[str, Glob, TreeArtifact, Filegroup]


def _has_wild(s: str) -> bool:
    return any(c in s for c in "*?")


def flatten(entries: Iterable[EntryInput]) -> tuple[PathEntry, ...]:
    """Expand filegroups in order and normalise strings: ``"dist/"`` → ``TreeArtifact``, ``"src/*.py"`` →
    ``Glob``, else an exact path. Order is kept; exact duplicates are dropped after their first occurrence."""
    if type(entries) in (tuple, list) and not entries:
        return ()  # the common case (a node that reads, writes or removes nothing) allocates nothing
    out: list[PathEntry] = []
    seen: set[Any] = set()
    for e in entries:
        _flatten_into(e, 0, out, seen)
    return tuple(out)


def _flatten_into(e: Any, depth: int, out: list[PathEntry], seen: set[Any]) -> None:
    # A module-level recursion, not a closure: a recursive closure is a reference cycle per call, which only
    # the cyclic GC frees (and 100,000 declarations made that garbage a visible share of declaring a plan).
    if depth > 32:
        raise _refuse(e, "nests filegroups more than 32 deep")
    if isinstance(e, Filegroup):
        for x in e.entries:
            _flatten_into(x, depth + 1, out, seen)
        return
    if isinstance(e, str):
        if e.replace("\\", "/").endswith("/") and not _has_wild(e):
            item: PathEntry = TreeArtifact(path=e)
        elif _has_wild(e):
            item = Glob(include=(e,))
        else:
            item = normalize_path(e)
    elif isinstance(e, (Glob, TreeArtifact)):
        item = e
    elif isinstance(e, dict):
        if "include" in e:
            item = Glob(**e)
        elif "tree" in e:
            item = TreeArtifact(path=e["tree"])
        else:
            raise _refuse(e, "is a mapping that is neither a glob ({include, exclude}) nor {tree: path}")
    else:
        raise _refuse(e, "is neither a path string, a Glob, a TreeArtifact nor a Filegroup")
    if item not in seen:
        seen.add(item)
        out.append(item)


def is_exact(entry: PathEntry) -> bool:
    """True for an exact file path (the only kind of read a cache may admit)."""
    return isinstance(entry, str)


@lru_cache(maxsize=4096)
def _segment_regex(seg: str) -> re.Pattern[str]:
    rx = "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in seg)
    return re.compile(rx + r"\Z", re.DOTALL)


def _seg_match(pseg: str, name: str) -> bool:
    if name.startswith(".") and not pseg.startswith("."):
        return False
    if not _has_wild(pseg):
        return pseg == name
    return _segment_regex(pseg).match(name) is not None


def glob_match(pattern: str, path: str) -> bool:
    """Bazel-like match of a normalised ``pattern`` against a normalised relative ``path``."""
    return _match(tuple(pattern.split("/")), tuple(path.split("/")))


@lru_cache(maxsize=65536)
def _match(p: tuple[str, ...], s: tuple[str, ...]) -> bool:
    if not p:
        return not s
    head = p[0]
    if head == "**":
        # zero segments, or consume one non-dot segment and stay on '**'
        if _match(p[1:], s):
            return True
        return bool(s) and not s[0].startswith(".") and _match(p, s[1:])
    return bool(s) and _seg_match(head, s[0]) and _match(p[1:], s[1:])


def entry_matches(entry: PathEntry, path: str) -> bool:
    """Does ``path`` (exact, normalised) fall under ``entry``?"""
    if isinstance(entry, str):
        return entry == path
    if isinstance(entry, TreeArtifact):
        return path == entry.path or path.startswith(entry.path + "/")
    return any(glob_match(i, path) for i in entry.include) and not any(
        glob_match(x, path) for x in entry.exclude
    )


def dirs_related(a: str, b: str) -> bool:
    """Whether directory ``a`` is ``b``, inside it or contains it (``""`` is the workspace root)."""
    return a == "" or b == "" or a == b or a.startswith(b + "/") or b.startswith(a + "/")


def glob_may_touch(g: Glob, directory: str) -> bool:
    """Whether ``g`` may match a path that is ``directory`` or under it (False proves it cannot)."""
    return any(dirs_related(static_prefix(p), directory) for p in g.include)


def globs_may_overlap(a: Glob, b: Glob) -> bool:
    """Whether two globs may match a common path (False proves they cannot: disjoint static prefixes)."""
    return any(glob_may_touch(b, static_prefix(p)) for p in a.include)


def entries_overlap(a: PathEntry, b: PathEntry) -> bool:
    """Conservative overlap of two entries (see the module invariant)."""
    if isinstance(a, Glob) or isinstance(b, Glob):
        if isinstance(a, str):
            return entry_matches(b, a)
        if isinstance(b, str):
            return entry_matches(a, b)
        if isinstance(a, TreeArtifact):
            return glob_may_touch(b, a.path)  # type: ignore[arg-type]
        if isinstance(b, TreeArtifact):
            return glob_may_touch(a, b.path)
        return globs_may_overlap(a, b)  # type: ignore[arg-type]
    pa = a if isinstance(a, str) else a.path
    pb = b if isinstance(b, str) else b.path
    if isinstance(a, str) and isinstance(b, str):
        return pa == pb
    return pa == pb or pa.startswith(pb + "/") or pb.startswith(pa + "/")


def sets_overlap(a: Sequence[PathEntry], b: Sequence[PathEntry]) -> bool:
    """True when any entry of ``a`` overlaps any entry of ``b``."""
    return any(entries_overlap(x, y) for x in a for y in b)


def static_prefix(pattern: str) -> str:
    """The longest leading run of literal segments: the directory to start enumerating a glob from
    (``""`` = the workspace root)."""
    lit: list[str] = []
    for seg in pattern.split("/")[:-1]:
        if _has_wild(seg):
            break
        lit.append(seg)
    return "/".join(lit)


def reserved_top(path: str) -> str | None:
    """The reserved top-level directory a normalised relative ``path`` lies in (or is), else None."""
    head = path.split("/", 1)[0]
    return head if head in RESERVED_TOP else None


def _reserved_pattern(pattern: str) -> str | None:
    # A glob reaches a reserved directory when its first segment that is not '**' can match one ('**' may
    # consume zero segments, so '**/.git/x' matches '.git/x'; '**' itself never matches a dot segment).
    for seg in pattern.split("/"):
        if seg == "**":
            continue
        return next((r for r in RESERVED_TOP if _seg_match(seg, r)), None)
    return None


def _reserved_entry(entry: PathEntry) -> str | None:
    if isinstance(entry, str):
        return reserved_top(entry)
    if isinstance(entry, TreeArtifact):
        return reserved_top(entry.path)
    return next((r for p in entry.include if (r := _reserved_pattern(p)) is not None), None)


def check_not_reserved(writes: Iterable[PathEntry], removes: Iterable[PathEntry]) -> None:
    """Refuse (``PlanError(invalid_effects)``) a declared write or removal that can reach a reserved top-level
    directory (``RESERVED_TOP``): an exact path or tree under it, or a glob whose first non-``**`` segment can
    match it. Reads are not checked: reading ``.git/HEAD`` is legitimate."""
    for what, group in (("writes", writes), ("removes", removes)):
        for e in group:
            r = _reserved_entry(e)
            if r is not None:
                raise PlanError(
                    "invalid_effects",
                    f"{what} entry {entry_json(e)} reaches the reserved directory {r + '/'!r}"
                    f" ({', '.join(x + '/' for x in RESERVED_TOP)} belong to smthrs, git and the Python"
                    " environment); declare an output elsewhere in the workspace",
                    path=_display(e),
                    reserved=r,
                )


def _display(entry: PathEntry) -> str:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, TreeArtifact):
        return entry.path + "/"
    return entry.include[0]


def entry_json(entry: PathEntry) -> dict[str, Any]:
    """Plain-JSON form of an entry, used in keys and digests."""
    if isinstance(entry, str):
        return {"kind": "file", "path": entry}
    if isinstance(entry, TreeArtifact):
        return {"kind": "tree", "path": entry.path}
    out: dict[str, Any] = {"kind": "glob", "include": list(entry.include)}
    if entry.exclude:
        out["exclude"] = list(entry.exclude)
    return out
