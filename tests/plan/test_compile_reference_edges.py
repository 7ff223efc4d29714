"""Compile's edges, plan order, conflict annotations and cycle handling, pinned against the reference engine.

Each vector is the reference's own (its plan compile suite, its reader-after-writer suite, its append suite,
and its file-set overlap and pattern suites), rewritten as Python data; a few more follow the reference's code
where its tests are silent. ``TALLY`` counts them and ``test_the_vector_tally_is_as_reported`` keeps the count
honest:

- taken: 21 plan vectors (every test of the compile, reader-after-writer and append suites but the compile
  suite's two keying tests) and 29 file-set vectors (every overlap, separator and pattern assertion); not
  taken: those two keying tests, the plan-diff and effects-validation suites, and the file-set suite's schema,
  grouping and spelling tests — they pin keys, diffs and declaration refusals, not edges.
- identical: 47. Deliberately different: 3 — a ``[...]`` class in a path or pattern is literal text to the
  reference and refused here (``invalid_effects``), because this implementation does not support classes and
  will not guess; and a tree and a glob whose static prefixes are disjoint do not overlap here (two vectors,
  both directions), where the reference calls every tree×glob pair overlapping — see
  ``DISJOINT_BY_PREFIX``.
- from the reference's code (no test of its own there): 3 — two nodes that each read what the other writes
  (not refused: the first in plan order is ordered after the other), every pair of writers of one path is
  annotated (serialize edges do not count as "already ordered"), and a conflict's ``paths`` are the EARLIER
  node's entries. Deliberately different from its code: 1 — on append, "already ordered" follows every edge of
  the recorded generations; the reference's closure stops at an edge that points to a later plan position (its
  own comment calls that case unreachable, but its reader-after-writer edges create it), so it would annotate
  a pair a dependency path already orders.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

import smthrs_plugin as sp
from smthrs_plugin.errors import GraphError, PlanError
from smthrs_plugin.plan import Plan, overlap
from smthrs_plugin.plan.fileset import Glob, TreeArtifact, entries_overlap, entry_matches, normalize_path
from smthrs_plugin.plan.overlap import produced_reads

TALLY = {
    "plan vectors taken": 21,
    "file-set vectors taken": 29,
    "identical": 47,
    "deliberately different": 3,
    "from the reference's code": 3,
    "deliberately different from the reference's code": 1,
}
#: What the tests below declare about themselves (``vector``), counted when this module is imported.
COUNTED: Counter[str] = Counter()
F = TypeVar("F", bound=Callable[..., Any])


def vector(*kinds: str, cases: int = 1) -> Callable[[F], F]:
    """Count a test (``cases`` vectors when it is parametrized) under each of ``kinds``."""

    def mark(fn: F) -> F:
        for k in kinds:
            COUNTED[k] += cases
        return fn

    return mark


def node(
    nid: str,
    *,
    reads: Any = (),
    writes: Any = (),
    removes: Any = (),
    refs: tuple[str, ...] = (),
    body: Any = None,
    **kw: Any,
) -> sp.plan.NodeDraft:
    """The reference suite's draft: body ``{action: id}`` unless given, ``Ref`` inputs by id."""
    return sp.plan.node(
        nid,
        body={"action": nid} if body is None else body,
        inputs=[sp.plan.Ref(r) for r in refs],
        reads=reads,
        writes=writes,
        removes=removes,
        **kw,
    )


def compile_(*drafts: sp.plan.NodeDraft, plan_id: str = "plan-1") -> Plan:
    plan = sp.plan.compile_plan(plan_id, "example/Build", list(drafts))
    assert sp.plan.verify_plan(Plan.from_json(plan.to_json())) is not None  # the plan is its own proof
    return plan


def deps(plan: Plan, nid: str) -> list[str]:
    return list(plan.node(nid).depends_on)


def conflicts(plan: Plan, nid: str) -> list[dict[str, Any]]:
    return [c.model_dump(by_alias=True, mode="json") for c in plan.node(nid).conflicts]


def acyclic(plan: Plan) -> bool:
    edges = {n.id: n.depends_on for n in plan.nodes}
    state: dict[str, int] = {}

    def visit(x: str) -> bool:
        if state.get(x) == 2:
            return True
        if state.get(x) == 1:
            return False
        state[x] = 1
        ok = all(visit(y) for y in edges[x])
        state[x] = 2
        return ok

    return all(visit(x) for x in edges)


def key_of(plan: Plan, nid: str) -> str:
    return plan.node(nid).key


def refusal(fn: Any, *args: Any) -> PlanError:
    with pytest.raises(PlanError) as err:
        fn(*args)
    return err.value


# ------------------------------------------------------------------------------ the reference's compile suite


@vector("plan vectors taken", "identical")
def test_compile_orders_topologically_keys_every_node_and_defaults_its_annotations() -> None:
    plan = compile_(node("late", refs=("early",)), node("early"))
    assert [n.id for n in plan.nodes] == ["early", "late"]
    assert all(n.key.startswith("key1_") for n in plan.nodes)
    first = plan.nodes[0].draft
    assert (first.kind, first.priority, first.conflict_strategy, first.runtime_strategy) == (
        "step",
        0,
        "serialize",
        "delay-rebase",
    )
    assert plan.digest == plan.base_digest and plan.generation == 0


@vector("plan vectors taken", "identical")
def test_overlapping_writers_are_serialized_in_declaration_order_both_annotated_and_not_rekeyed() -> None:
    disjoint = compile_(node("first", writes=["out"]), node("second"))
    plan = compile_(node("first", writes=["out", "log"]), node("second", writes=["out"]))
    assert deps(plan, "second") == ["first"]
    assert conflicts(plan, "second") == [
        {"with": "first", "paths": ["out"], "strategy": "serialize", "runtime": "delay-rebase"}
    ]
    assert conflicts(plan, "first") == [
        {"with": "second", "paths": ["out"], "strategy": "serialize", "runtime": "delay-rebase"}
    ]
    assert key_of(plan, "second") == key_of(disjoint, "second")  # an ordering edge is not key material


@vector("plan vectors taken", "identical")
def test_a_glob_reader_depends_on_a_tree_writer_and_a_glob_writer_of_what_it_reads() -> None:
    plan = compile_(
        node("a-tree-writer", writes=[TreeArtifact(path="dist")]),
        node("z-glob-writer", writes=[Glob(include=["dist/**/*.js"])]),
        node("reader", reads=[Glob(include=["dist/**"])]),
    )
    assert deps(plan, "z-glob-writer") == ["a-tree-writer"]
    assert deps(plan, "reader") == ["a-tree-writer", "z-glob-writer"]


@vector("plan vectors taken", "identical")
def test_a_serialized_glob_conflict_names_the_glob() -> None:
    pattern = Glob(include=["dist/**"])
    plan = compile_(node("a-pattern", writes=[pattern]), node("b-pattern", writes=[pattern]))
    assert plan.nodes[0].conflicts[0].paths == ("dist/**",)


@vector("plan vectors taken", "identical")
def test_both_writers_get_lane_annotations_when_either_asks_for_a_lane_and_no_edge() -> None:
    plan = compile_(
        node("first", writes=["out"]),
        node("second", writes=["out"], conflict="lane", runtime="stop-merge"),
    )
    assert [n.conflicts[0].strategy for n in plan.nodes] == ["lane", "lane"]
    assert [n.conflicts[0].runtime for n in plan.nodes] == ["stop-merge", "stop-merge"]
    assert deps(plan, "second") == []


@vector("plan vectors taken", "identical")
def test_an_overlap_a_declaration_promised_could_not_happen_is_refused() -> None:
    err = refusal(compile_, node("first", writes=["out"], conflict="fail"), node("second", writes=["out"]))
    assert err.code == "overlap_forbidden"


@vector("plan vectors taken", "identical")
def test_writers_a_dependency_path_already_orders_are_not_a_conflict() -> None:
    plan = compile_(
        node("first", writes=["out"]),
        node("middle", refs=("first",)),
        node("second", writes=["out"], refs=("middle",)),
    )
    assert [c for n in plan.nodes for c in n.conflicts] == []


@vector("plan vectors taken", "identical")
def test_a_cycle_an_unknown_dependency_and_a_duplicate_id_are_refused() -> None:
    assert refusal(compile_, node("a", refs=("b",)), node("b", refs=("a",))).code == "cycle"
    pending_ghost = sp.plan.node("a", body={"action": "a"}, inputs=[sp.plan.Pending("ghost")])
    assert refusal(compile_, pending_ghost).code == "unknown_dependency"
    assert refusal(compile_, node("a"), node("a")).code == "duplicate_node"


@vector("plan vectors taken", "identical")
def test_proto_is_an_ordinary_node_id_and_dependency() -> None:
    plan = compile_(node("__proto__"), node("consumer", refs=("__proto__",)))
    assert [n.id for n in plan.nodes] == ["__proto__", "consumer"]
    assert deps(plan, "consumer") == ["__proto__"]


# --------------------------------------------------------------------- the reference's reader-after-writer suite


@vector("plan vectors taken", "identical")
def test_a_removal_is_a_write_for_ordering_and_for_conflicts() -> None:
    ordered = compile_(
        node("remover", writes=["remover.out"], removes=["stale"]), node("reader", reads=["stale"])
    )
    assert deps(ordered, "reader") == ["remover"]
    conflicting = compile_(
        node("writer", writes=["shared"]), node("remover", writes=["remover.out"], removes=["shared"])
    )
    [annotation] = conflicts(conflicting, "remover")
    assert (annotation["with"], annotation["paths"]) == ("writer", ["shared"])


@vector("plan vectors taken", "identical")
def test_a_reader_is_ordered_behind_the_writer_of_what_it_reads_without_a_conflict_or_a_new_key() -> None:
    unrelated = compile_(node("writer", writes=["out"]), node("reader", reads=["other"]))
    plan = compile_(node("writer", writes=["out"]), node("reader", reads=["out"]))
    assert deps(plan, "reader") == ["writer"]
    assert [c for n in plan.nodes for c in n.conflicts] == []
    assert key_of(plan, "reader") == key_of(unrelated, "reader")
    assert key_of(plan, "writer") == key_of(unrelated, "writer")


@vector("plan vectors taken", "identical")
def test_the_writer_runs_first_even_when_the_reader_was_declared_first() -> None:
    plan = compile_(node("reader", reads=["out"]), node("writer", writes=["out"]))
    assert deps(plan, "reader") == ["writer"]
    assert acyclic(plan)
    # the plan keeps the reference's order (material dependencies only); the edge points forward
    assert [n.id for n in plan.nodes] == ["reader", "writer"]


@vector("plan vectors taken", "identical")
def test_no_edge_is_added_when_a_dependency_path_already_orders_the_pair() -> None:
    plan = compile_(
        node("writer", writes=["out"]),
        node("middle", refs=("writer",)),
        node("reader", reads=["out"], refs=("middle",)),
    )
    assert deps(plan, "reader") == ["middle"]


@vector("plan vectors taken", "identical")
def test_a_writer_that_depends_on_its_reader_keeps_the_declared_order_instead_of_closing_a_cycle() -> None:
    plan = compile_(node("reader", reads=["out"]), node("writer", writes=["out"], refs=("reader",)))
    assert deps(plan, "reader") == []
    assert deps(plan, "writer") == ["reader"]
    assert acyclic(plan)


@vector("plan vectors taken", "identical")
def test_a_node_reading_its_own_write_gets_no_self_edge() -> None:
    plan = compile_(node("both", reads=["out"], writes=["out"]))
    assert deps(plan, "both") == []


@vector("plan vectors taken", "identical")
def test_a_diamond_of_existing_edges_keeps_material_dependencies_first() -> None:
    plan = compile_(
        node("base"),
        node("left", refs=("base",)),
        node("right", refs=("base",)),
        node("writer", writes=["out"]),
        node("reader", reads=["out"], refs=("left", "right")),
    )
    assert deps(plan, "reader") == ["left", "right", "writer"]
    assert acyclic(plan)


@vector("plan vectors taken", "identical")
def test_a_read_write_chain_declared_out_of_order_is_ordered_and_acyclic() -> None:
    plan = compile_(
        node("c", reads=["b.out"], writes=["c.out"]),
        node("a", writes=["a.out"]),
        node("b", reads=["a.out"], writes=["b.out"]),
    )
    assert acyclic(plan)
    assert deps(plan, "b") == ["a"]
    assert deps(plan, "c") == ["b"]


# -------------------------------------------------------------------------------- the reference's append suite


@vector("plan vectors taken", "identical")
def test_an_appended_reader_after_writer_edge_lands_on_the_new_node_only() -> None:
    base = compile_(node("recorded-reader", reads=["out"]))
    grown = sp.plan.append_plan(base, [node("late-writer", writes=["out"])])
    assert grown.nodes[0] == base.nodes[0]
    assert deps(grown, "late-writer") == []
    writer_first = compile_(node("recorded-writer", writes=["out"]))
    with_reader = sp.plan.append_plan(writer_first, [node("late-reader", reads=["out"])])
    assert with_reader.nodes[0] == writer_first.nodes[0]
    assert deps(with_reader, "late-reader") == ["recorded-writer"]


@vector("plan vectors taken", "identical")
def test_append_grows_the_plan_without_rewriting_a_recorded_node() -> None:
    base = compile_(node("root", writes=["out"]))
    grown = sp.plan.append_plan(base, [node("child", refs=("root",))])
    assert grown.nodes[0] == base.nodes[0]
    assert grown.generation == 1 and grown.base_digest == base.base_digest and grown.digest != base.digest
    assert [n.id for n in grown.nodes if n.generation == grown.generation] == ["child"]


@vector("plan vectors taken", "identical")
def test_a_conflict_found_during_elaboration_is_annotated_on_the_new_node_only() -> None:
    base = compile_(node("root", writes=["out"]))
    grown = sp.plan.append_plan(base, [node("late", writes=["out"])])
    assert conflicts(grown, "root") == []
    assert conflicts(grown, "late") == [
        {"with": "root", "paths": ["out"], "strategy": "serialize", "runtime": "delay-rebase"}
    ]
    assert deps(grown, "late") == ["root"]


@vector("plan vectors taken", "identical")
def test_appending_an_id_the_plan_holds_is_refused() -> None:
    base = compile_(node("root"))
    assert refusal(sp.plan.append_plan, base, [node("root")]).code == "duplicate_node"


# ----------------------------------------------------------------------------- the reference's file-set suites

_GLOB = Glob(include=["src/**/*.ts"], exclude=["src/**/skip.ts"])
_TREE = TreeArtifact(path="dist")

#: (left, right, overlaps): the conservative overlap matrix, then the separator-spelling vectors.
OVERLAPS: list[tuple[Any, Any, bool]] = [
    ("a", "a", True),
    ("a", "b", False),
    ("src/a.ts", _GLOB, True),
    (_GLOB, "src/a.ts", True),
    (_GLOB, Glob(include=["**/*.ts"]), True),
    (_TREE, "dist/a.js", True),
    ("dist/a.js", _TREE, True),
    (_TREE, TreeArtifact(path="dist/nested"), True),
    (_TREE, TreeArtifact(path="other"), False),
    ("dist\\same.js", "dist/same.js", True),
    ("dist/same.js", "dist\\same.js", True),
    ("dist\\other.js", "dist/same.js", False),
    (TreeArtifact(path="dist\\nested"), "dist/nested/a.js", True),
    ("dist\\same.js", Glob(include=["dist/*.js"]), True),
    (Glob(include=["dist/*.js"]), "dist\\same.js", True),
    (_TREE, TreeArtifact(path="dist\\nested"), True),
]

#: (pattern or glob, path, matches)
MATCHES: list[tuple[Any, str, bool]] = [
    ("src/*.ts", "src/a.ts", True),
    ("src/*.ts", "src/deep/a.ts", False),
    ("src/**/a.ts", "src/a.ts", True),
    ("src/**/a.ts", "src/deep/more/a.ts", True),
    ("src/**", "src/deep/a.ts", True),
    ("src\\*.ts", "src/a.ts", True),
    (_GLOB, "src/a.ts", True),
    (_GLOB, "src/deep/skip.ts", False),
    (Glob(include=["*.ts"]), "a.ts", True),
]


def _entry(x: Any) -> Any:
    return normalize_path(x) if isinstance(x, str) else x


@vector("file-set vectors taken", "identical", cases=len(OVERLAPS))
@pytest.mark.parametrize(("left", "right", "expected"), OVERLAPS)
def test_the_overlap_matrix_decides_the_reader_edge_whatever_the_order(
    left: Any, right: Any, expected: bool
) -> None:
    assert entries_overlap(_entry(left), _entry(right)) is expected
    assert entries_overlap(_entry(right), _entry(left)) is expected
    # the reader is declared first: its edge to the writer must not depend on that
    plan = compile_(node("reader", reads=[right]), node("writer", writes=[left]))
    assert deps(plan, "reader") == (["writer"] if expected else [])


#: The reference's overlap vectors this implementation answers differently, on purpose: a glob and a tree
#: whose static prefixes are disjoint (``src/**/*.ts`` vs the tree ``dist/``) share no path. The reference calls
#: every tree×glob pair overlapping; with reader edges inferred whatever the declaration order, that made a
#: reader of ``src/**`` wait for the writer of any tree, and ordered a build → test → deploy pipeline backwards.
DISJOINT_BY_PREFIX = [(_TREE, _GLOB), (_GLOB, _TREE)]


@vector("file-set vectors taken", "deliberately different", cases=len(DISJOINT_BY_PREFIX))
@pytest.mark.parametrize(("left", "right"), DISJOINT_BY_PREFIX)
def test_a_glob_and_a_tree_with_disjoint_prefixes_get_no_edge_unlike_the_reference(
    left: Any, right: Any
) -> None:
    assert not entries_overlap(left, right) and not entries_overlap(right, left)
    plan = compile_(node("reader", reads=[right]), node("writer", writes=[left]))
    assert deps(plan, "reader") == []


def test_a_pipeline_reading_sources_is_not_ordered_after_an_unrelated_tree_writer() -> None:
    # The case the reference's rule breaks: deploy (writes deployed/) must not become build's dependency only
    # because build reads a glob, which would leave test (reads dist/**) free to run before build.
    plan = compile_(
        node("build", reads=["src/**"], writes=["dist/"]),
        node("test", reads=["dist/**"]),
        node("deploy", reads=["dist/**"], writes=["deployed/"], refs=("test",)),
    )
    assert deps(plan, "build") == [] and deps(plan, "test") == ["build"]
    assert "build" in deps(plan, "deploy") or "test" in deps(plan, "deploy")
    # A glob that may reach into the tree still orders its reader after the tree's writer.
    plan = compile_(node("reader", reads=["**/*.js"]), node("writer", writes=["dist/"]))
    assert deps(plan, "reader") == ["writer"]


@vector("file-set vectors taken", "identical")
def test_a_separator_spelling_names_one_path() -> None:
    assert normalize_path("dist\\same.js") == "dist/same.js"


@vector("file-set vectors taken", "identical", cases=len(MATCHES))
@pytest.mark.parametrize(("pattern", "path", "expected"), MATCHES)
def test_star_doublestar_and_exclusions_decide_which_exact_writes_a_glob_reader_follows(
    pattern: Any, path: str, expected: bool
) -> None:
    glob = Glob(include=[pattern]) if isinstance(pattern, str) else pattern
    assert entry_matches(glob, normalize_path(path)) is expected
    plan = compile_(node("reader", reads=[glob]), node("writer", writes=[path]))
    assert deps(plan, "reader") == (["writer"] if expected else [])


@vector("file-set vectors taken", "deliberately different")
def test_a_bracket_class_is_refused_where_the_reference_reads_it_literally() -> None:
    for declared in ("a+[x].ts", {"include": ["a+[x].ts"]}):
        with pytest.raises(PlanError) as err:
            sp.plan.node("n", reads=[declared])
        assert err.value.code == "invalid_effects"


# ------------------------------------------------------------------------- from the reference's code, not its tests


@vector("from the reference's code")
def test_two_nodes_that_each_read_what_the_other_writes_are_ordered_not_refused() -> None:
    plan = compile_(
        node("x", reads=["y.out"], writes=["x.out"]),
        node("y", reads=["x.out"], writes=["y.out"]),
    )
    # the first reader in plan order is ordered after the other; the other reads x.out as a source
    assert deps(plan, "x") == ["y"] and deps(plan, "y") == []
    assert acyclic(plan)
    swapped = compile_(
        node("y", reads=["x.out"], writes=["y.out"]),
        node("x", reads=["y.out"], writes=["x.out"]),
    )
    assert deps(swapped, "y") == ["x"] and deps(swapped, "x") == []
    assert produced_reads(plan.nodes) == [(True,), (False,)]


@vector("from the reference's code")
def test_every_writer_of_one_path_is_annotated_with_every_other_and_ordered_after_every_earlier_one() -> None:
    plan = compile_(*[node(f"w{i}", writes=["out"]) for i in range(3)])
    assert [deps(plan, f"w{i}") for i in range(3)] == [[], ["w0"], ["w0", "w1"]]
    assert [[c.with_ for c in n.conflicts] for n in plan.nodes] == [["w1", "w2"], ["w0", "w2"], ["w0", "w1"]]


@vector("from the reference's code")
def test_a_conflicts_paths_are_the_earlier_nodes_overlapping_entries() -> None:
    plan = compile_(
        node("early", writes=[TreeArtifact(path="dist"), "log"]),
        node("late", writes=["dist/app.js", Glob(include=["dist/*.map"])]),
    )
    assert [c.paths for c in plan.node("late").conflicts] == [("dist",)]
    assert [c.paths for c in plan.node("early").conflicts] == [("dist",)]


@vector("deliberately different from the reference's code")
def test_an_append_treats_a_pair_a_forward_edge_already_orders_as_ordered() -> None:
    base = compile_(
        node("r", reads=["out"]),
        node("w", writes=["out"], refs=("v",)),
        node("v", writes=["x"]),
    )
    assert [n.id for n in base.nodes] == ["r", "v", "w"] and deps(base, "r") == ["w"]
    grown = sp.plan.append_plan(base, [sp.plan.node("late", inputs=[sp.plan.Pending("r")], writes=["x"])])
    # late → r → w → v already orders late after v: no annotation, no extra edge (the reference adds both)
    assert deps(grown, "late") == ["r"] and conflicts(grown, "late") == []


# ------------------------------------------------------------------------------------------ order independence


def test_readme_example_of_a_reader_declared_before_its_writers() -> None:
    import smthrs_plugin as sp

    plan = sp.plan.compile_plan(
        "site",
        "ci/site",
        [
            sp.plan.node("publish", body={"run": "./publish.sh"}, reads=["dist/**"]),  # declared first
            sp.plan.node("bundle", body={"run": "./bundle.sh"}, writes=["dist/"]),
            sp.plan.node("maps", body={"run": "./maps.sh"}, writes=["dist/**/*.map"]),
        ],
    )
    assert [n.id for n in plan.nodes] == ["publish", "bundle", "maps"]  # as declared: no declared inputs
    assert plan.node("publish").depends_on == ("bundle", "maps")  # waits for every writer of what it reads
    assert plan.node("maps").depends_on == ("bundle",)  # overlapping writers: serialized in plan order
    [conflict] = plan.node("bundle").conflicts  # both writers are annotated, naming the overlapping paths
    assert (conflict.with_, conflict.paths, conflict.strategy) == ("maps", ("dist",), "serialize")
    graph = sp.plan.RuntimeGraph(plan)
    assert graph.ready() == ("bundle",)  # the reader listed first runs last


def _naive(drafts: list[sp.plan.NodeDraft], plan_order: list[str]) -> dict[str, tuple[list[str], list[Any]]]:
    """A transliteration of the reference's two passes with whole closure sets and depth-first reachability."""
    by_id = {d.id: d for d in drafts}
    order = [by_id[x] for x in plan_order]
    dep0 = {d.id: list(d.dependencies()) for d in order}
    closure: dict[str, set[str]] = {}
    for d in order:
        s: set[str] = set()
        for x in dep0[d.id]:
            s |= {x} | closure.get(x, set())
        closure[d.id] = s
    added: dict[str, list[str]] = {d.id: [] for d in order}
    notes: dict[str, list[Any]] = {d.id: [] for d in order}
    for i, later in enumerate(order):
        for earlier in order[:i]:
            paths = [
                _label(x)
                for x in earlier.effects.produces
                if any(entries_overlap(x, y) for y in later.effects.produces)
            ]
            if not paths or earlier.id in closure[later.id]:
                continue
            strategies = (earlier.conflict_strategy, later.conflict_strategy)
            strategy = "lane" if "lane" in strategies else "serialize"
            runtime = (
                "stop-merge"
                if "stop-merge" in (earlier.runtime_strategy, later.runtime_strategy)
                else "delay-rebase"
            )
            notes[earlier.id].append((later.id, paths, strategy, runtime))
            notes[later.id].append((earlier.id, paths, strategy, runtime))
            if strategy == "serialize":
                added[later.id].append(earlier.id)
    edges = {d.id: set(dep0[d.id]) | set(added[d.id]) for d in order}

    def reaches(a: str, b: str) -> bool:
        seen, stack = set(), [a]
        while stack:
            x = stack.pop()
            if x == b:
                return True
            if x not in seen:
                seen.add(x)
                stack.extend(edges[x])
        return False

    for reader in order:
        for writer in order:
            if writer.id == reader.id:
                continue
            if not any(entries_overlap(r, w) for r in reader.effects.reads for w in writer.effects.produces):
                continue
            if reaches(reader.id, writer.id) or reaches(writer.id, reader.id):
                continue
            added[reader.id].append(writer.id)
            edges[reader.id].add(writer.id)
    return {d.id: (dep0[d.id] + added[d.id], notes[d.id]) for d in order}


def _label(x: Any) -> str:
    return x if isinstance(x, str) else x.path if isinstance(x, TreeArtifact) else ",".join(x.include)


_POOL_W = ["a", "b", "c", "d/", "d/x", "e/f", Glob(include=["d/**"]), Glob(include=["*.txt"]), "n.txt"]
_POOL_R = ["a", "b", "c", "d/x", "e/f", "n.txt", Glob(include=["d/*"]), Glob(include=["e/**"]), "zz"]


def _random_drafts(rng: random.Random, n: int) -> list[sp.plan.NodeDraft]:
    out = []
    for i in range(n):
        earlier = [f"n{j}" for j in range(i)]
        refs = rng.sample(earlier, k=min(len(earlier), rng.choice([0, 0, 0, 1, 2])))
        out.append(
            sp.plan.node(
                f"n{i}",
                body=i,
                inputs=[sp.plan.Pending(r) for r in refs],
                reads=rng.sample(_POOL_R, k=rng.choice([0, 1, 1, 2])),
                writes=rng.sample(_POOL_W, k=rng.choice([0, 0, 1, 1, 2])),
                conflict=rng.choice(["serialize", "serialize", "serialize", "lane"]),
                runtime=rng.choice(["delay-rebase", "delay-rebase", "stop-merge"]),
            )
        )
    rng.shuffle(out)  # declaration order is not dependency order, readers often before writers
    return out


@pytest.mark.parametrize("seed", range(60))
def test_compile_equals_a_transliteration_of_the_reference_passes_on_shuffled_plans(seed: int) -> None:
    rng = random.Random(seed)
    drafts = _random_drafts(rng, rng.randrange(2, 14))
    plan = compile_(*drafts)
    expected = _naive(drafts, [n.id for n in plan.nodes])
    for n in plan.nodes:
        want_deps, want_notes = expected[n.id]
        assert list(n.depends_on) == want_deps, n.id
        assert [(c.with_, list(c.paths), c.strategy, c.runtime) for c in n.conflicts] == want_notes, n.id
    assert acyclic(plan)
    # every reader follows every writer of what it reads, unless that writer already follows the reader
    graph = sp.plan.RuntimeGraph(plan)
    done: list[str] = []
    while not graph.done:
        ready = graph.ready()
        assert ready, "a compiled plan never deadlocks"
        graph.start(ready[0])
        graph.settle(ready[0], "built")
        done.append(ready[0])
    at = {x: i for i, x in enumerate(done)}
    for r in plan.nodes:
        for w in plan.nodes:
            if w.id != r.id and any(
                entries_overlap(x, y) for x in r.effects.reads for y in w.effects.produces
            ):
                assert at[w.id] < at[r.id] or r.id in _ancestors(plan, w.id), (r.id, w.id)


def _ancestors(plan: Plan, nid: str) -> set[str]:
    seen: set[str] = set()
    stack = list(plan.node(nid).depends_on)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(plan.node(x).depends_on)
    return seen


def test_a_chain_declared_backwards_is_ordered_like_the_same_chain_declared_forwards() -> None:
    n = 400
    forwards = [node(f"s{i}", reads=[f"f/{i - 1}"] if i else [], writes=[f"f/{i}"]) for i in range(n)]
    backwards = compile_(*reversed(forwards))
    ahead = compile_(*forwards)
    assert {x.id: x.depends_on for x in backwards.nodes} == {x.id: x.depends_on for x in ahead.nodes}
    assert {x.id: x.key for x in backwards.nodes} == {x.id: x.key for x in ahead.nodes}
    graph = sp.plan.RuntimeGraph(backwards)
    order = []
    while not graph.done:
        [ready] = graph.ready()  # a chain: exactly one node at a time, in dependency order
        graph.start(ready)
        graph.settle(ready, "built")
        order.append(ready)
    assert order == [f"s{i}" for i in range(n)]


def test_a_reader_declared_before_seventy_writers_follows_every_one_of_them(monkeypatch: Any) -> None:
    # Each writer moves to just below the reader, halving one gap of the order's labels: seventy of them run the
    # gap out, so the order is respaced mid-reader and the reader's ancestor search must re-key itself.
    respaced: list[int] = []
    original = overlap._Order._respace

    def counting(self: Any) -> None:
        respaced.append(1)
        original(self)

    monkeypatch.setattr(overlap._Order, "_respace", counting)
    drafts = [node("r", reads=[f"f/{i}" for i in range(70)] + ["g"])]
    drafts += [node(f"a{i}", writes=[f"f/{i}"]) for i in range(69)]
    drafts += [sp.plan.node("a69", writes=["f/69"], inputs=[sp.plan.Pending("b")]), node("b", writes=["g"])]
    plan = compile_(*drafts)
    assert respaced
    assert deps(plan, "r") == [*(f"a{i}" for i in range(69)), "b", "a69"]
    assert acyclic(plan)
    assert produced_reads(plan.nodes)[0] == (True,) * 71


def test_a_runtime_graph_refuses_an_appended_generation_whose_edges_form_a_cycle() -> None:
    plan = compile_(node("a", reads=["x"]), node("b", writes=["x"]))
    graph = sp.plan.RuntimeGraph(plan.nodes[:0])
    a, b = plan.nodes
    looped = b.model_copy(update={"depends_on": ("a",)})
    with pytest.raises(GraphError) as err:
        graph.extend([a, looped])
    assert err.value.code == "invalid_transition" and "cycle" in err.value.message
    assert len(graph) == 0  # nothing partial
    graph.extend([a, b])
    assert graph.ready() == ("b",)


def test_the_vector_tally_is_as_reported() -> None:
    assert dict(COUNTED) == TALLY
    taken = TALLY["plan vectors taken"] + TALLY["file-set vectors taken"]
    assert TALLY["identical"] + TALLY["deliberately different"] == taken
