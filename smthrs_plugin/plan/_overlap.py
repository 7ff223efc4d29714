"""An index of produced path entries answering "which earlier nodes overlap these entries?". PURE.

Invariant: ``candidates(entries)`` returns exactly the positions ``p`` added so far for which
``sets_overlap(entries, produced[p])`` holds under fileset's conservative rule (glob×glob and tree×glob always
overlap; exact×exact, exact×tree, tree×tree and exact×glob decided precisely) — the index only avoids the
all-pairs scan. Exact and tree paths are looked up through their ancestors and a per-directory "strictly under"
table; globs are scanned (they are rare and conservative anyway). Differentially tested against
``fileset.sets_overlap``.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._fileset import Glob, PathEntry, TreeArtifact, entry_matches, static_prefix

__all__ = ["ProducerIndex"]


def _strict_ancestors(path: str) -> list[str]:
    segs = path.split("/")
    return ["/".join(segs[:i]) for i in range(1, len(segs))]


class ProducerIndex:
    """Positions of earlier nodes by the entries they produce."""

    __slots__ = ("_exact", "_tree", "_under_exact", "_under_tree", "_globs", "_all_trees", "_all_exact")

    def __init__(self) -> None:
        self._exact: dict[str, list[int]] = {}
        self._tree: dict[str, list[int]] = {}
        self._under_exact: dict[str, list[tuple[str, int]]] = {}
        self._under_tree: dict[str, list[int]] = {}
        self._globs: list[tuple[int, Glob]] = []
        self._all_trees: list[int] = []
        self._all_exact: list[tuple[str, int]] = []

    def add(self, pos: int, entries: Iterable[PathEntry]) -> None:
        for e in entries:
            if isinstance(e, str):
                self._exact.setdefault(e, []).append(pos)
                self._all_exact.append((e, pos))
                for a in _strict_ancestors(e):
                    self._under_exact.setdefault(a, []).append((e, pos))
            elif isinstance(e, TreeArtifact):
                self._tree.setdefault(e.path, []).append(pos)
                self._all_trees.append(pos)
                for a in _strict_ancestors(e.path):
                    self._under_tree.setdefault(a, []).append(pos)
            else:
                self._globs.append((pos, e))

    def candidates(self, entries: Iterable[PathEntry]) -> set[int]:
        out: set[int] = set()
        for e in entries:
            if isinstance(e, str):
                out.update(self._exact.get(e, ()))
                for a in [*_strict_ancestors(e), e]:
                    out.update(self._tree.get(a, ()))
                out.update(self._under_tree.get(e, ()))
                out.update(p for p, g in self._globs if p not in out and entry_matches(g, e))
            elif isinstance(e, TreeArtifact):
                for a in [*_strict_ancestors(e.path), e.path]:
                    out.update(self._exact.get(a, ()))
                    out.update(self._tree.get(a, ()))
                out.update(p for _, p in self._under_exact.get(e.path, ()))
                out.update(self._under_tree.get(e.path, ()))
                out.update(p for p, _ in self._globs)
            else:
                out.update(p for p, _ in self._globs)
                out.update(self._all_trees)
                for pattern in e.include:
                    prefix = static_prefix(pattern)
                    if prefix == "":
                        pool: Iterable[tuple[str, int]] = self._all_exact
                    else:
                        pool = [(prefix, p) for p in self._exact.get(prefix, ())]
                        pool += self._under_exact.get(prefix, [])
                    out.update(p for path, p in pool if p not in out and entry_matches(e, path))
        return out
