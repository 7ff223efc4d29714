"""Which declared effects overlap, and the ordering edges and conflict annotations compile infers from them. PURE.

- :class:`ProducerIndex`: ``candidates(entries)`` returns exactly the positions ``p`` added so far for which
  ``sets_overlap(entries, produced[p])`` holds under fileset's conservative rule; the index only avoids the
  all-pairs scan (differentially tested against ``fileset.sets_overlap``).
- :func:`infer_edges` is compile's edge inference, two passes over plan order whatever order the nodes were declared
  in: conflicts, then reader-after-writer edges (docs/rules.md, "Plan compile"). A frozen node's row is never
  rewritten.
- The graph stays acyclic; reachability is answered without a transitive closure (ARCHITECTURE.md, "plan").
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from ..errors import PlanError
from .fileset import (
    Glob,
    PathEntry,
    TreeArtifact,
    entries_overlap,
    entry_matches,
    glob_may_touch,
    globs_may_overlap,
    static_prefix,
)
from .model import PlanNode

__all__ = ["ProducerIndex", "Conflict", "infer_edges", "topological_ranks", "produced_reads", "entry_label"]


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
                out.update(p for p, g in self._globs if p not in out and glob_may_touch(g, e.path))
            else:
                out.update(p for p, g in self._globs if p not in out and globs_may_overlap(e, g))
                if self._tree:
                    for path, at in self._tree.items():
                        if glob_may_touch(e, path):
                            out.update(at)
                for pattern in e.include:
                    prefix = static_prefix(pattern)
                    if prefix == "":
                        pool: Iterable[tuple[str, int]] = self._all_exact
                    else:
                        pool = [(prefix, p) for p in self._exact_at(prefix)]
                        pool += self._under().get(prefix, [])
                    out.update(p for path, p in pool if p not in out and entry_matches(e, path))
        return out


# ------------------------------------------------------------------------------------------ edge inference

#: One conflict annotation as inference computes it: (the other node's position, the overlapping ``paths``,
#: strategy ``serialize``|``lane``, runtime ``delay-rebase``|``stop-merge``).
Conflict = tuple[int, tuple[str, ...], str, str]


def entry_label(entry: PathEntry) -> str:
    """How an overlapping entry is named in a conflict's ``paths``: an exact path as is, a tree by its directory
    (no trailing ``/``), a glob by its include patterns joined with ``,`` (the reference engine's spelling)."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, TreeArtifact):
        return entry.path
    return ",".join(entry.include)


def _shown(entries: Sequence[PathEntry]) -> str:
    return ", ".join(
        e if isinstance(e, str) else e.path + "/" if isinstance(e, TreeArtifact) else str(list(e.include))
        for e in entries
    )


def topological_ranks(deps: Sequence[Sequence[int]]) -> list[int] | None:
    """A topological rank of the graph ``deps`` (position → positions it depends on): every edge goes from a
    higher rank to a lower one. ``None`` when every edge already points to an earlier position (the position is
    then such a rank). Depth-first post-order in position order; a cycle is ``PlanError(invalid_plan)`` — only a
    plan that bypassed compile can hold one."""
    if all(d < p for p, ds in enumerate(deps) for d in ds):
        return None
    n = len(deps)
    rank = [0] * n
    state = [0] * n  # 0 unvisited, 1 on the stack, 2 ranked
    following = 0
    for s in range(n):
        if state[s]:
            continue
        state[s] = 1
        stack = [(s, iter(deps[s]))]
        while stack:
            x, it = stack[-1]
            for y in it:
                if state[y] == 0:
                    state[y] = 1
                    stack.append((y, iter(deps[y])))
                    break
                if state[y] == 1:
                    raise PlanError(
                        "invalid_plan",
                        f"the plan's dependencies form a cycle through position {y}; recompile it from its "
                        "declarations",
                    )
            else:
                stack.pop()
                state[x] = 2
                rank[x] = following
                following += 1
    return rank


_GAP = 1 << 32  # label spacing: room for 32 halvings of one gap before the labels are respaced


class _Order:
    """A topological order kept valid while edges are added: a linked list of nodes with increasing integer
    labels (``label[x] < label[y]`` when x comes first; every node comes after what it depends on). An edge
    against the order (r → w, w after r) moves w and those of its ancestors that sit after r to just before r,
    keeping their relative order — nothing else moves, r least of all. Labels are respaced when a gap runs out
    (``generation`` counts respacings)."""

    __slots__ = ("label", "_prev", "_next", "_head", "_edges", "generation")

    def __init__(self, rank: Sequence[int], edges: list[Sequence[int]]) -> None:
        n = len(rank)
        at = [0] * n
        for x, k in enumerate(rank):
            at[k] = x
        self.label = [k * _GAP for k in rank]
        self._prev = [-1] * n
        self._next = [-1] * n
        for k in range(1, n):
            self._prev[at[k]] = at[k - 1]
            self._next[at[k - 1]] = at[k]
        self._head = at[0] if n else -1
        self._edges = edges
        self.generation = 0

    def place_before(self, w: int, r: int) -> bool:
        """Before adding r → w where ``label[w] > label[r]``: move w below r and return True, or return False,
        changing nothing, when w already depends (transitively) on r (the edge would close a cycle)."""
        label, edges = self.label, self._edges
        floor = label[r]
        # w and its ancestors above r: a path from w down to r passes only through such nodes
        moving, seen, stack = [w], {w}, [w]
        while stack:
            for y in edges[stack.pop()]:
                if y == r:
                    return False
                if label[y] > floor and y not in seen:
                    seen.add(y)
                    moving.append(y)
                    stack.append(y)
        moving.sort(key=label.__getitem__)
        prev, nxt = self._prev, self._next
        for x in moving:  # unlink
            a, b = prev[x], nxt[x]
            if a >= 0:
                nxt[a] = b
            else:
                self._head = b
            if b >= 0:
                prev[b] = a
        before = prev[r]
        low = label[before] if before >= 0 else floor - (len(moving) + 1) * _GAP
        for x in moving:  # relink, in order, between `before` and r
            prev[x], nxt[x] = before, r
            if before >= 0:
                nxt[before] = x
            else:
                self._head = x
            prev[r] = x
            before = x
        step = (floor - low) // (len(moving) + 1)
        if step == 0:
            self._respace()
        else:
            for j, x in enumerate(moving, 1):
                label[x] = low + j * step
        return True

    def _respace(self) -> None:
        label, nxt = self.label, self._next
        x, k = self._head, 0
        while x >= 0:
            label[x] = k * _GAP
            k += 1
            x = nxt[x]
        self.generation += 1


class _Ancestors:
    """Lazy ancestor search from one node: predecessors are expanded nearest-first (highest label first), each
    at most once, and only as far down as the lowest node asked about. Valid while the ancestors found keep
    their place in the order (adding edges FROM the searched node, as inference does, never moves them)."""

    __slots__ = ("_edges", "_order", "_seen", "_heap", "_generation")

    def __init__(self, edges: list[Sequence[int]], order: _Order, start: Iterable[int]) -> None:
        self._edges = edges
        self._order = order
        self._seen = set(start)
        label = order.label
        self._heap = [(-label[x], x) for x in self._seen]
        heapq.heapify(self._heap)
        self._generation = order.generation

    def _current(self) -> list[tuple[int, int]]:
        # a respacing relabels every node, keeping the order: re-key what is still to be expanded
        if self._generation != self._order.generation:
            label = self._order.label
            self._heap = [(-label[x], x) for _, x in self._heap]
            heapq.heapify(self._heap)
            self._generation = self._order.generation
        return self._heap

    def reaches(self, target: int) -> bool:
        heap, seen, edges, label = self._current(), self._seen, self._edges, self._order.label
        floor = label[target]
        while heap and -heap[0][0] > floor:
            for y in edges[heapq.heappop(heap)[1]]:
                if y not in seen:
                    seen.add(y)
                    heapq.heappush(heap, (-label[y], y))
        return target in seen

    def add(self, target: int) -> None:
        if target not in self._seen:
            self._seen.add(target)
            heapq.heappush(self._current(), (-self._order.label[target], target))


def _append(edges: list[Sequence[int]], p: int, e: int) -> None:
    # A short edge list stays a tuple (the cyclic GC untracks a tuple of ints; a list it scans until it dies,
    # and one per node of a 100,000-node plan costs a full collection); a long one becomes a list so that
    # adding k edges stays linear in k.
    dp = edges[p]
    if type(dp) is list:
        dp.append(e)
    elif len(dp) < 8:
        edges[p] = (*dp, e)
    else:
        edges[p] = [*dp, e]


def infer_edges(
    ids: Sequence[str],
    deps: Sequence[Sequence[int]],
    reads: Sequence[Sequence[PathEntry]],
    produces: Sequence[Sequence[PathEntry]],
    strategies: Sequence[str],
    runtimes: Sequence[str],
    base: int,
) -> tuple[list[Sequence[int]], set[int], dict[int, list[Conflict]]]:
    """Compile's two passes (see the module docstring) over nodes in plan order. ``deps[p]``: the positions
    node ``p`` depends on before inference (its material dependencies; every edge for a frozen node, ``p <
    base``). Returns every node's edges (``deps[p]`` then the added ones, in the order added), the positions that
    gained an edge, and each position's conflict annotations in the order found. Raises
    ``PlanError(overlap_forbidden)`` at the first unordered overlapping pair either side of which says ``fail``."""
    n = len(ids)
    frozen_ranks = topological_ranks(deps[:base])
    rank = list(range(n)) if frozen_ranks is None else frozen_ranks + list(range(base, n))
    edges: list[Sequence[int]] = list(deps)
    order = _Order(rank, edges)
    grown: set[int] = set()
    conflicts: dict[int, list[Conflict]] = {}

    # Pass 1. "Already ordered" is judged on the edges that existed before the pass: the serialize edges it
    # adds land in ``serialized`` and join ``edges`` only afterwards.
    serialized: dict[int, list[int]] = {}
    index = ProducerIndex()
    for p in range(base):
        if produces[p]:
            index.add(p, produces[p])
    for p in range(base, n):
        produced = produces[p]
        if not produced:
            continue
        cands = index.candidates(produced)
        index.add(p, produced)
        if not cands:
            continue
        ancestors = _Ancestors(edges, order, deps[p])
        ordered = {
            e for e in sorted(cands, key=order.label.__getitem__, reverse=True) if ancestors.reaches(e)
        }
        for e in sorted(cands):
            if e in ordered:
                continue
            if "fail" in (strategies[e], strategies[p]):
                blame = ids[e] if strategies[e] == "fail" else ids[p]
                raise PlanError(
                    "overlap_forbidden",
                    f"nodes {ids[e]!r} ({_shown(produces[e])}) and {ids[p]!r} ({_shown(produced)}) produce "
                    f"overlapping paths without an order, and {blame!r} declares conflict='fail'; add "
                    f"Pending({ids[e]!r}) to {ids[p]!r}'s inputs, make the paths disjoint, or choose "
                    "conflict='serialize' or 'lane'",
                    earlier=ids[e],
                    later=ids[p],
                )
            strategy = "lane" if "lane" in (strategies[e], strategies[p]) else "serialize"
            runtime = "stop-merge" if "stop-merge" in (runtimes[e], runtimes[p]) else "delay-rebase"
            paths = tuple(entry_label(x) for x in produces[e] if any(entries_overlap(x, y) for y in produced))
            if e >= base:
                conflicts.setdefault(e, []).append((p, paths, strategy, runtime))
            conflicts.setdefault(p, []).append((e, paths, strategy, runtime))
            if strategy == "serialize":
                serialized.setdefault(p, []).append(e)
    for p, added in serialized.items():
        for e in added:
            _append(edges, p, e)
        grown.add(p)

    # Pass 2: every non-frozen reader against every producer of what it reads, in plan order.
    writers = ProducerIndex()
    for p in range(n):
        if produces[p]:
            writers.add(p, produces[p])
    for r in range(base, n):
        if not reads[r]:
            continue
        cands = writers.candidates(reads[r])
        cands.discard(r)
        if not cands:
            continue
        ancestors = _Ancestors(edges, order, edges[r])
        label = order.label
        for w in sorted(cands):
            if label[w] < label[r]:
                if ancestors.reaches(w):
                    continue  # already ordered: r depends on w
            elif not order.place_before(w, r):
                continue  # w depends on r: the declared order wins, r reads the source
            _append(edges, r, w)
            ancestors.add(w)
            grown.add(r)
    return edges, grown, conflicts


def produced_reads(nodes: Sequence[PlanNode], start: int = 0) -> list[tuple[bool, ...]]:
    """For each node of ``nodes[start:]`` (a verified plan's nodes, in plan order): which of its read entries an
    ANCESTOR (a node it depends on, transitively) produces. Such an entry's bytes exist only once that producer
    settled; any other read entry (nothing produces it, or only the node itself or a node ordered after it does)
    is a source input. Compile ordered every other producer before the reader, so this is "produced by anyone,
    as the plan orders it"."""
    ids = [n.id for n in nodes]
    where = {x: p for p, x in enumerate(ids)}
    try:
        deps: list[Sequence[int]] = [tuple([where[d] for d in n.depends_on]) for n in nodes]
    except KeyError as exc:
        raise PlanError(
            "invalid_plan",
            f"a node depends on {exc.args[0]!r}, which is not a node of the plan; verify it first",
        ) from exc
    reads = [n.effects.reads for n in nodes]
    produces = [n.effects.produces for n in nodes]
    ranks = topological_ranks(deps)
    rank = list(range(len(ids))) if ranks is None else ranks
    edges = list(deps)
    order = _Order(rank, edges)
    index = ProducerIndex()
    for p, produced in enumerate(produces):
        if produced:
            index.add(p, produced)
    out: list[tuple[bool, ...]] = []
    for p in range(start, len(nodes)):
        ancestors: _Ancestors | None = None
        flags: list[bool] = []
        for e in reads[p]:
            cands = [c for c in index.candidates((e,)) if rank[c] < rank[p]]  # an ancestor comes first
            hit = False
            if cands:
                if ancestors is None:
                    ancestors = _Ancestors(edges, order, edges[p])
                cands.sort(key=rank.__getitem__, reverse=True)
                hit = any(ancestors.reaches(c) for c in cands)
            flags.append(hit)
        out.append(tuple(flags))
    return out
