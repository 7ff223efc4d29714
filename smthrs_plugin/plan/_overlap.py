"""An index of produced path entries answering "which earlier nodes overlap these entries?". PURE.

Invariant: ``candidates(entries)`` returns exactly the positions ``p`` added so far for which
``sets_overlap(entries, produced[p])`` holds under fileset's conservative rule (glob×glob and tree×glob always
overlap; exact×exact, exact×tree, tree×tree and exact×glob decided precisely) — the index only avoids the
all-pairs scan. Exact and tree paths are looked up through their ancestors and a per-directory "strictly under"
table; globs are scanned (they are rare and conservative anyway). Differentially tested against
``fileset.sets_overlap``.

Cost: only a tree or glob query needs the "exact paths strictly under a directory" table, so exact paths are
logged in order and that table is brought up to date from the log when such a query arrives (every logged path
is in it before the query reads it: same answers). A plan that writes only exact files never builds it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._fileset import Glob, PathEntry, TreeArtifact, entry_matches, static_prefix

__all__ = ["ProducerIndex"]


def _strict_ancestors(path: str) -> list[str]:
    # prefixes ending before each "/": the same strings as joining the first i segments, without the joins
    out: list[str] = []
    i = path.find("/")
    while i != -1:
        out.append(path[:i])
        i = path.find("/", i + 1)
    return out


class ProducerIndex:
    """Positions of earlier nodes by the entries they produce."""

    __slots__ = (
        "_exact",
        "_tree",
        "_under_exact",
        "_under_tree",
        "_globs",
        "_all_trees",
        "_all_exact",
        "_indexed",
    )

    def __init__(self) -> None:
        # a path's one producer as a bare int (no list per path: a list is never untracked by the cyclic GC,
        # and 100,000 of them cost a full collection), a list once a second producer shares the path
        self._exact: dict[str, int | list[int]] = {}
        self._tree: dict[str, list[int]] = {}
        self._under_exact: dict[str, list[tuple[str, int]]] = {}
        self._under_tree: dict[str, list[int]] = {}
        self._globs: list[tuple[int, Glob]] = []
        self._all_trees: list[int] = []
        self._all_exact: list[tuple[str, int]] = []  # every exact (path, position), in the order added
        self._indexed = 0  # how much of _all_exact is in _under_exact

    def add(self, pos: int, entries: Iterable[PathEntry]) -> None:
        exact = self._exact
        for e in entries:
            if isinstance(e, str):
                at = exact.get(e)
                if at is None:
                    exact[e] = pos
                elif isinstance(at, int):
                    exact[e] = [at, pos]
                else:
                    at.append(pos)
                self._all_exact.append((e, pos))
            elif isinstance(e, TreeArtifact):
                self._tree.setdefault(e.path, []).append(pos)
                self._all_trees.append(pos)
                for a in _strict_ancestors(e.path):
                    self._under_tree.setdefault(a, []).append(pos)
            else:
                self._globs.append((pos, e))

    def _exact_at(self, path: str) -> Iterable[int]:
        at = self._exact.get(path)
        if at is None:
            return ()
        return (at,) if isinstance(at, int) else at

    def _under(self) -> dict[str, list[tuple[str, int]]]:
        # the "strictly under" table for exact paths, caught up with everything added so far
        log, under = self._all_exact, self._under_exact
        for k in range(self._indexed, len(log)):
            item = log[k]
            for a in _strict_ancestors(item[0]):
                at = under.get(a)
                if at is None:
                    under[a] = [item]
                else:
                    at.append(item)
        self._indexed = len(log)
        return under

    def candidates(self, entries: Iterable[PathEntry]) -> set[int]:
        out: set[int] = set()
        for e in entries:
            if isinstance(e, str):
                at = self._exact.get(e)
                if at is not None:
                    out.update((at,) if isinstance(at, int) else at)
                tree = self._tree
                if tree:  # _under_tree only has entries when some tree was added
                    for a in [*_strict_ancestors(e), e]:
                        out.update(tree.get(a, ()))
                    out.update(self._under_tree.get(e, ()))
                if self._globs:
                    out.update(p for p, g in self._globs if p not in out and entry_matches(g, e))
            elif isinstance(e, TreeArtifact):
                for a in [*_strict_ancestors(e.path), e.path]:
                    out.update(self._exact_at(a))
                    out.update(self._tree.get(a, ()))
                out.update(p for _, p in self._under().get(e.path, ()))
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
                        pool = [(prefix, p) for p in self._exact_at(prefix)]
                        pool += self._under().get(prefix, [])
                    out.update(p for path, p in pool if p not in out and entry_matches(e, path))
        return out
