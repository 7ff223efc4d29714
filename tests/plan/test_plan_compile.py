"""compile.py: plan order, every refusal code, conflict annotation, reader-after-writer edges, append, verify."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import smthrs_plugin as sp
from smthrs_plugin.errors import PlanError
from smthrs_plugin.plan import Plan, PlanNode
from smthrs_plugin.plan.compile import plan_digest, priority_json
from smthrs_plugin.plan.fileset import flatten, sets_overlap
from smthrs_plugin.plan.overlap import ProducerIndex


def _code(fn: object, *args: object, **kw: object) -> PlanError:
    with pytest.raises(PlanError) as err:
        fn(*args, **kw)  # type: ignore[operator]
    return err.value


def _deps(plan: Plan) -> dict[str, tuple[str, ...]]:
    return {n.id: n.depends_on for n in plan.nodes}


# ---------------------------------------------------------------------------------------------- order


def test_readme_example() -> None:
    import smthrs_plugin as sp

    plan = sp.plan.compile_plan(
        plan_id="release-1.4",
        flow="ci/release",
        nodes=[
            sp.plan.node(
                "test", body={"run": "pytest -q"}, inputs=[sp.plan.Pending("build")], reads=["src/**"]
            ),
            sp.plan.node("build", body={"run": "python -m build"}, reads=["src/**"], writes=["dist/"]),
            sp.plan.node(
                "deploy",
                body={"run": "./deploy.sh"},
                tier="irreversible",
                inputs=[sp.plan.Pending("test")],
                reads=["dist/"],
            ),
        ],
    )
    assert [n.id for n in plan.nodes] == ["build", "test", "deploy"]  # plan order: dependencies first
    assert plan.node("deploy").depends_on == ("test",)  # reads dist/ but build is already an ancestor
    assert plan.generation == 0 and plan.digest == plan.base_digest

    graph = sp.plan.RuntimeGraph(plan)
    assert graph.ready() == ("build",)
    graph.start("build")
    assert graph.settle("build", "failed").settled[-1].outcome == "skipped"  # the failed cone is skipped
    assert graph.outcomes() == {"build": "failed", "test": "skipped", "deploy": "skipped"}

    grown = sp.plan.append_plan(plan, [sp.plan.node("notify", inputs=[sp.plan.Pending("deploy")])])
    assert grown.generation == 1 and grown.base_digest == plan.digest
    sp.plan.verify_plan(grown)


def _dag_drafts() -> list[sp.plan.NodeDraft]:
    return [
        sp.plan.node("a"),
        sp.plan.node("b", inputs=[sp.plan.Ref("a")]),
        sp.plan.node("c", inputs=[sp.plan.Ref("a"), sp.plan.Pending("b")]),
        sp.plan.node("d", inputs=[sp.plan.Pending("c")]),
        sp.plan.node("e"),
        sp.plan.node("f", inputs=[sp.plan.Ref("e"), sp.plan.Ref("d", path=["x"])]),
    ]


def test_plan_order_is_dfs_post_order_in_declaration_order() -> None:
    drafts = _dag_drafts()
    order = [drafts[i] for i in (5, 3, 0, 1, 2, 4)]  # f, d, a, b, c, e
    plan = sp.plan.compile_plan("p", "f", order)
    assert [n.id for n in plan.nodes] == ["e", "a", "b", "c", "d", "f"]
    assert [n.position for n in plan.nodes] == list(range(6))


@pytest.mark.parametrize("seed", range(8))
def test_shuffled_declarations_give_a_topological_order_and_identical_keys(seed: int) -> None:
    reference = sp.plan.compile_plan("p", "f", _dag_drafts())
    drafts = _dag_drafts()
    random.Random(seed).shuffle(drafts)
    plan = sp.plan.compile_plan("p", "f", drafts)
    pos = {n.id: n.position for n in plan.nodes}
    assert all(pos[d] < pos[n.id] for n in plan.nodes for d in n.depends_on)
    assert {n.id: n.key for n in plan.nodes} == {n.id: n.key for n in reference.nodes}


# ---------------------------------------------------------------------------------------------- refusals


def test_duplicate_node() -> None:
    err = _code(sp.plan.compile_plan, "p", "f", [sp.plan.node("a"), sp.plan.node("a")])
    assert err.code == "duplicate_node" and "'a'" in err.message


def test_unknown_dependency() -> None:
    err = _code(sp.plan.compile_plan, "p", "f", [sp.plan.node("a", inputs=[sp.plan.Ref("ghost")])])
    assert err.code == "unknown_dependency" and "'ghost'" in err.message and "'a'" in err.message


def test_cycle_names_the_cycle() -> None:
    err = _code(
        sp.plan.compile_plan,
        "p",
        "f",
        [
            sp.plan.node("a", inputs=[sp.plan.Pending("c")]),
            sp.plan.node("b", inputs=[sp.plan.Ref("a")]),
            sp.plan.node("c", inputs=[sp.plan.Ref("b")]),
        ],
    )
    assert err.code == "cycle"
    assert "a -> c -> b -> a" in err.message


def test_self_dependency_is_a_cycle() -> None:
    assert (
        _code(sp.plan.compile_plan, "p", "f", [sp.plan.node("a", inputs=[sp.plan.Ref("a")])]).code == "cycle"
    )


def test_invalid_effects_even_when_a_draft_bypassed_validation() -> None:
    good = sp.plan.node("a", writes=["out/x"])
    smuggled = good.model_copy(update={"effects": good.effects.model_copy(update={"writes": ("../escape",)})})
    err = _code(sp.plan.compile_plan, "p", "f", [smuggled])
    assert err.code == "invalid_effects" and "'a'" in err.message
    both = good.model_copy(update={"effects": good.effects.model_copy(update={"removes": ("out/x",)})})
    assert _code(sp.plan.compile_plan, "p", "f", [both]).code == "invalid_effects"


def test_overlap_forbidden_when_either_side_says_fail() -> None:
    err = _code(
        sp.plan.compile_plan,
        "p",
        "f",
        [sp.plan.node("a", writes=["out/"]), sp.plan.node("b", writes=["out/x"], conflict="fail")],
    )
    assert err.code == "overlap_forbidden"
    assert "'a'" in err.message and "'b'" in err.message and "Pending('a')" in err.message


def test_fail_strategy_is_fine_when_the_pair_is_already_ordered() -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("a", writes=["out/"], conflict="fail"),
            sp.plan.node("b", writes=["out/x"], inputs=[sp.plan.Pending("a")]),
        ],
    )
    assert plan.node("b").conflicts == ()


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("", "f", []), {}),
        (("p", "", []), {}),
        (("p", "f", []), {"maximum_plan_nodes": 0}),
        (("p", "f", []), {"maximum_plan_nodes": True}),
        (("p", "f", "abc"), {}),
    ],
)
def test_invalid_plan_identity(args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    assert _code(sp.plan.compile_plan, *args, **kwargs).code == "invalid_plan"


def test_invalid_node_for_a_non_draft() -> None:
    err = _code(sp.plan.compile_plan, "p", "f", [sp.plan.node("a"), {"id": "b"}])
    assert err.code == "invalid_node" and "#1" in err.message


def test_over_maximum_plan_nodes_is_elaboration_failed() -> None:
    err = _code(
        sp.plan.compile_plan,
        "p",
        "f",
        [sp.plan.node("a"), sp.plan.node("b"), sp.plan.node("c")],
        maximum_plan_nodes=2,
    )
    assert err.code == "elaboration_failed" and "maximum_plan_nodes=2" in err.message
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a"), sp.plan.node("b")], maximum_plan_nodes=2)
    assert (
        _code(sp.plan.append_plan, plan, [sp.plan.node("merge", kind="merge")]).code == "elaboration_failed"
    )


# ---------------------------------------------------------------------------------------------- annotation


def test_serialize_adds_an_edge_from_the_later_writer_to_the_earlier_and_annotates_both() -> None:
    plan = sp.plan.compile_plan(
        "p", "f", [sp.plan.node("a", writes=["out/x"]), sp.plan.node("b", writes=["out/"])]
    )
    assert plan.node("b").depends_on == ("a",)
    [c] = plan.node("b").conflicts
    assert (c.with_, c.paths, c.strategy, c.runtime) == ("a", ("out/x",), "serialize", "delay-rebase")
    [c] = plan.node("a").conflicts  # the same annotation, naming the other side: the earlier node's paths
    assert (c.with_, c.paths, c.strategy, c.runtime) == ("b", ("out/x",), "serialize", "delay-rebase")


def test_lane_annotates_without_an_edge_and_stop_merge_wins_the_runtime() -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("a", writes=["out/x"], runtime="stop-merge"),
            sp.plan.node("b", writes=["out/x"], conflict="lane"),
        ],
    )
    assert plan.node("b").depends_on == ()
    [c] = plan.node("b").conflicts
    assert (c.with_, c.strategy, c.runtime) == ("a", "lane", "stop-merge")
    [c] = plan.node("a").conflicts
    assert (c.with_, c.strategy, c.runtime) == ("b", "lane", "stop-merge")


def test_serialized_writers_of_one_path_are_each_ordered_after_every_earlier_one() -> None:
    # A serialize edge does not make a later pair "already ordered": every pair is annotated and edged.
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node(f"w{i}", writes=["out/x"]) for i in range(4)])
    assert _deps(plan) == {"w0": (), "w1": ("w0",), "w2": ("w0", "w1"), "w3": ("w0", "w1", "w2")}
    assert [len(n.conflicts) for n in plan.nodes] == [3, 3, 3, 3]


def test_a_reader_follows_the_writers_of_what_it_reads_declared_before_or_after_it() -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("gen", writes=["src/gen.py"]),
            sp.plan.node("lint", reads=["src/**"]),  # later than gen: must observe gen's output
            sp.plan.node("late", writes=["docs/x"], inputs=[sp.plan.Pending("lint")]),
            sp.plan.node("early", reads=["docs/x"]),  # declared before nothing orders it after 'late'...
        ],
    )
    assert plan.node("lint").depends_on == ("gen",)
    assert plan.node("early").depends_on == ("late",)
    before = sp.plan.compile_plan(
        "p", "f", [sp.plan.node("early", reads=["docs/x"]), sp.plan.node("late", writes=["docs/x"])]
    )
    # declared before its writer, a reader still follows it (the edge points to a later plan position)
    assert before.node("early").depends_on == ("late",)
    assert [n.id for n in before.nodes] == ["early", "late"]
    source = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("early", reads=["docs/x"]),
            sp.plan.node("late", writes=["docs/x"], inputs=[sp.plan.Pending("early")]),
        ],
    )
    # a writer that itself depends on the reader keeps that order: the reader reads the source
    assert source.node("early").depends_on == () and source.node("late").depends_on == ("early",)


def test_a_node_reading_its_own_output_gets_no_self_edge() -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", reads=["out/x"], writes=["out/x"])])
    assert plan.node("a").depends_on == ()


# ---------------------------------------------------------------------------------------------- append


def _base() -> Plan:
    return sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("a", writes=["out/x"]),
            sp.plan.node("b", inputs=[sp.plan.Ref("a")], writes=["out/y"], runtime="stop-merge"),
        ],
    )


def test_append_freezes_earlier_nodes_keeps_base_digest_and_bumps_generation() -> None:
    base = _base()
    grown = sp.plan.append_plan(
        base,
        [
            sp.plan.node("b+merge", kind="merge", inputs=[sp.plan.Pending("b")], writes=["out/y"]),
            sp.plan.node("c", writes=["out/x"]),  # a new writer of what 'a' wrote
        ],
    )
    assert grown.nodes[: len(base.nodes)] == base.nodes
    assert [n.model_dump_json() for n in grown.nodes[:2]] == [n.model_dump_json() for n in base.nodes]
    assert grown.base_digest == base.digest and grown.digest != base.digest
    assert grown.generation == 1 and [n.generation for n in grown.nodes] == [0, 0, 1, 1]
    assert grown.node("c").depends_on == ("a",)  # the serialize edge lands on the new node...
    assert [c.with_ for c in grown.node("c").conflicts] == ["a"]
    assert grown.node("a") == base.node("a")  # ...and 'a' is not re-annotated
    again = sp.plan.append_plan(grown, [sp.plan.node("d", inputs=[sp.plan.Pending("c")])])
    assert again.generation == 2 and again.base_digest == base.digest
    assert sp.plan.verify_plan(again) is again


def test_append_refuses_duplicates_cycles_and_empty_generations() -> None:
    base = _base()
    assert _code(sp.plan.append_plan, base, [sp.plan.node("a")]).code == "duplicate_node"
    cyc = [sp.plan.node("x", inputs=[sp.plan.Ref("y")]), sp.plan.node("y", inputs=[sp.plan.Ref("x")])]
    assert _code(sp.plan.append_plan, base, cyc).code == "cycle"
    assert _code(sp.plan.append_plan, base, []).code == "invalid_plan"
    assert (
        _code(sp.plan.append_plan, base, [sp.plan.node("z", inputs=[sp.plan.Ref("nope")])]).code
        == "unknown_dependency"
    )


# ---------------------------------------------------------------------------------------------- verify


def _replace_node(plan: Plan, i: int, **update: object) -> Plan:
    nodes = list(plan.nodes)
    nodes[i] = nodes[i].model_copy(update=update)
    return plan.model_copy(update={"nodes": tuple(nodes)})


def test_verify_refuses_a_tampered_key_digest_edge_or_annotation() -> None:
    grown = sp.plan.append_plan(_base(), [sp.plan.node("c", writes=["out/x"])])
    other_key = grown.nodes[0].key
    tampered = [
        _replace_node(grown, 1, key=other_key),
        grown.model_copy(update={"digest": "key1_" + "0" * 64}),
        grown.model_copy(update={"base_digest": grown.digest}),
        _replace_node(grown, 2, depends_on=()),  # drop the serialize edge c -> a
        _replace_node(grown, 1, depends_on=("a", "c")),  # invent an edge
        _replace_node(grown, 2, conflicts=()),
        _replace_node(grown, 2, generation=0),
        _replace_node(grown, 0, position=5),
        grown.model_copy(update={"generation": 3}),
        grown.model_copy(update={"nodes": grown.nodes[::-1]}),
    ]
    for plan in tampered:
        err = _code(sp.plan.verify_plan, plan)
        assert err.code == "invalid_plan"


def test_verify_refuses_a_body_mutated_in_place_after_compile() -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body={"cmd": "make"})])
    plan.nodes[0].draft.material.body["cmd"] = "rm -rf /"
    err = _code(sp.plan.verify_plan, plan)
    assert err.code == "invalid_plan" and "'a'" in err.message and "key" in err.message


def test_priority_enters_the_digest_exactly_even_beyond_the_safe_range() -> None:
    assert priority_json(2**53 - 1) == 2**53 - 1 and priority_json(2**53) == str(2**53)
    digests = {
        sp.plan.compile_plan("p", "f", [sp.plan.node("a", priority=p)]).digest
        for p in (2**53, 2**53 + 1, -(2**53), 0)
    }
    assert len(digests) == 4


def test_digest_covers_identity_order_and_scheduling_fields() -> None:
    d = [sp.plan.node("a"), sp.plan.node("b")]
    base = sp.plan.compile_plan("p", "f", d).digest
    assert base != sp.plan.compile_plan("q", "f", d).digest
    assert base != sp.plan.compile_plan("p", "g", d).digest
    assert base != sp.plan.compile_plan("p", "f", d[::-1]).digest
    assert base != sp.plan.compile_plan("p", "f", [sp.plan.node("a", priority=1), sp.plan.node("b")]).digest
    nodes: tuple[PlanNode, ...] = sp.plan.compile_plan("p", "f", d).nodes
    assert plan_digest("p", "f", nodes) == base


# ---------------------------------------------------------------------------------------------- overlap index

_entries = st.lists(
    st.sampled_from(
        [
            "a",
            "a/b",
            "a/b/c",
            "b",
            "a/.h",
            "dist/",
            "a/",
            "a/b/",
            "a/*",
            "a/**",
            "**/c",
            "b/*.py",
            "*",
            "a/b/*",
        ]
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_entries, min_size=1, max_size=6), _entries)
def test_producer_index_equals_the_all_pairs_overlap_rule(
    produced: list[list[str]], query: list[str]
) -> None:
    index = ProducerIndex()
    flat = [flatten(p) for p in produced]
    for pos, entries in enumerate(flat):
        index.add(pos, entries)
    q = flatten(query)
    assert index.candidates(q) == {pos for pos, entries in enumerate(flat) if sets_overlap(q, entries)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_entries, _entries), min_size=1, max_size=8))
def test_producer_index_answers_every_query_between_additions_like_the_all_pairs_rule(
    steps: list[tuple[list[str], list[str]]],
) -> None:
    # queries interleaved with additions: the "strictly under" table is caught up lazily, at the first tree or
    # glob query after exact paths were added, and a path's producers go from one int to a list
    index = ProducerIndex()
    added: list[tuple[Any, ...]] = []
    for produced, query in steps:
        q = flatten(query)
        assert index.candidates(q) == {pos for pos, entries in enumerate(added) if sets_overlap(q, entries)}
        index.add(len(added), flatten(produced))
        added.append(flatten(produced))


def test_a_compiled_node_is_what_model_construct_builds_from_the_same_fields() -> None:
    drafts = [
        sp.plan.node("a", writes=["out/a.txt"]),
        sp.plan.node("b", inputs=[sp.plan.Pending("a")], reads=["out/a.txt"], writes=["out/b.txt"]),
        sp.plan.node("c", writes=["out/a.txt"], conflict="lane"),
        sp.plan.node("d", reads=["out/b.txt", "out/a.txt"]),
    ]
    for n in sp.plan.compile_plan("p", "f", drafts).nodes:
        built = PlanNode.model_construct(set(PlanNode.model_fields), **dict(n.__dict__))
        assert n == built
        assert n.__dict__ == built.__dict__ and list(n.__dict__) == list(built.__dict__)
        assert (n.model_fields_set, n.__pydantic_extra__, n.__pydantic_private__) == (
            built.model_fields_set,
            built.__pydantic_extra__,
            built.__pydantic_private__,
        )
        assert n.model_dump(mode="json") == built.model_dump(mode="json")
        assert PlanNode.model_validate(n.model_dump(mode="json", by_alias=True)) == n


def test_depends_on_is_material_dependencies_then_compile_edges_each_once() -> None:
    drafts = [
        sp.plan.node("a", writes=["x"]),
        sp.plan.node("b", writes=["y"]),
        sp.plan.node("c", inputs=[sp.plan.Ref("b"), sp.plan.Pending("b"), sp.plan.Ref("a")], reads=["x"]),
        sp.plan.node("d", inputs=[sp.plan.Pending("b")], reads=["x", "y"]),
        sp.plan.node("e", reads=[f"p/{i}" for i in range(12)]),
        *[sp.plan.node(f"w{i}", writes=[f"p/{i}"]) for i in range(12)],
        sp.plan.node("f", reads=[f"p/{i}" for i in range(12)]),
    ]
    nodes = {n.id: n for n in sp.plan.compile_plan("p", "f", drafts).nodes}
    assert nodes["c"].depends_on == ("b", "a")
    assert nodes["d"].depends_on == ("b", "a")
    # a reader follows every producer of what it reads, declared before or after it, in plan order
    assert nodes["e"].depends_on == tuple(f"w{i}" for i in range(12))
    assert nodes["f"].depends_on == tuple(f"w{i}" for i in range(12))


def test_an_input_that_bypassed_validation_is_refused_as_invalid_node() -> None:
    draft = sp.plan.node("a")
    bad = draft.model_copy(update={"material": draft.material.model_copy(update={"inputs": ("a-string",)})})
    with pytest.raises(PlanError) as exc:
        sp.plan.compile_plan("p", "f", [sp.plan.node("z"), bad])
    assert exc.value.code == "invalid_node" and "input #0 is a str" in exc.value.message
