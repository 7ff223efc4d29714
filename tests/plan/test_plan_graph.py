"""graph.py: RuntimeGraph against an exhaustive rescan model, transitions, deferral, linear work counters."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_reference import SUCCESS, NaiveAdmission, NaiveGraph

import smthrs_plugin as sp
from smthrs_plugin.errors import GraphError
from smthrs_plugin.plan import Plan, RuntimeGraph
from smthrs_plugin.plan.admission import Admission
from smthrs_plugin.plan.graph import Propagation


def _plan(deps: list[list[int]], maximum: int = 10_000) -> Plan:
    drafts = [
        sp.plan.node(f"n{i}", body={"i": i}, inputs=[sp.plan.Pending(f"n{d}") for d in ds])
        for i, ds in enumerate(deps)
    ]
    return sp.plan.compile_plan("p", "f", drafts, maximum_plan_nodes=maximum)


OUTCOME = st.sampled_from(["built", "clean", "failed", "skipped", "deferred"])
OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "retry", "stage", "settle", "settle_staged", "illegal", "extend"]),
        st.integers(0, 10**6),
        OUTCOME,
    ),
    max_size=40,
)


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(1, 12))
    deps = [draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else [] for i in range(n)]
    extra = draw(st.integers(0, 4))
    extra_deps = [draw(st.lists(st.integers(0, n + j - 1), max_size=3, unique=True)) for j in range(extra)]
    defer = draw(st.sets(st.integers(0, n - 1), max_size=2))
    extra_defer = draw(st.sets(st.integers(n, n + extra - 1), max_size=1)) if extra else set()
    return {"deps": deps, "extra": extra_deps, "defer": defer, "extra_defer": extra_defer, "ops": draw(OPS)}


class _Checker:
    def __init__(self, real: RuntimeGraph, ref: NaiveGraph) -> None:
        self.real, self.ref = real, ref
        self.settled_events: list[str] = []
        self.caller_outcomes: dict[str, str] = {}

    def frontiers_match(self) -> None:
        real, ref = self.real, self.ref
        assert real.ready() == ref.ready()
        assert real.waiting() == ref.waiting()
        assert real.in_flight() == ref.in_flight()
        assert real.remaining == ref.remaining
        assert real.outcomes() == {n: ref.outcome[n] for n in ref.order if n in ref.outcome}
        assert all(real.attempts(n) == ref.attempts[n] for n in ref.order)

    def propagation(
        self, prop: Propagation, ref_auto: list[str], ready_before: set[str], own: str | None
    ) -> None:
        names = [s.node for s in prop.settled]
        expected = ([own] if own else []) + ref_auto
        assert sorted(names) == sorted(expected)
        assert set(prop.ready) == set(self.ref.ready()) - ready_before
        done_before = set(self.settled_events)
        for s in prop.settled:
            if s.node != own:
                assert s.outcome in ("skipped", "deferred")
            if s.cause is not None:  # dependency order: the cause settled before the skip
                assert s.cause in done_before and s.cause in self.real.node(s.node).depends_on
            done_before.add(s.node)
        self.settled_events.extend(names)


@st.composite
def forward_scenarios(draw: Any) -> dict[str, Any]:
    """Like ``scenarios``, but a dependency may sit at a later position (compile orders a reader after a writer
    declared after it): the edges follow a random topological order, not the positions."""
    n = draw(st.integers(1, 12))
    extra = draw(st.integers(0, 4))
    rank = draw(st.permutations(range(n))) + [n + k for k in draw(st.permutations(range(extra)))]
    deps: list[list[int]] = []
    for i in range(n + extra):
        below = [j for j in range(n + extra) if rank[j] < rank[i]]
        deps.append(draw(st.lists(st.sampled_from(below), max_size=3, unique=True)) if below else [])
    defer = draw(st.sets(st.integers(0, n - 1), max_size=2))
    extra_defer = draw(st.sets(st.integers(n, n + extra - 1), max_size=1)) if extra else set()
    return {"deps": deps[:n], "extra": deps[n:], "defer": defer, "extra_defer": extra_defer, "ops": draw(OPS)}


def _forward_plan(deps: list[list[int]]) -> Plan:
    # graph mechanics only: the edges are set on compiled nodes directly (RuntimeGraph takes them as given)
    plan = _plan([[] for _ in deps], maximum=100)
    nodes = tuple(
        n.model_copy(update={"depends_on": tuple(f"n{d}" for d in ds)})
        for n, ds in zip(plan.nodes, deps, strict=True)
    )
    return plan.model_copy(update={"nodes": nodes})


@settings(max_examples=250, deadline=None)
@given(scenarios())
def test_runtime_graph_matches_the_exhaustive_rescan_model(sc: dict[str, Any]) -> None:
    _drive_against_the_rescan_model(sc, _plan(sc["deps"] + sc["extra"], maximum=100))


@settings(max_examples=250, deadline=None)
@given(forward_scenarios())
def test_runtime_graph_matches_the_rescan_model_when_dependencies_sit_at_later_positions(
    sc: dict[str, Any],
) -> None:
    _drive_against_the_rescan_model(sc, _forward_plan(sc["deps"] + sc["extra"]))


def _drive_against_the_rescan_model(sc: dict[str, Any], plan: Plan) -> None:
    n = len(sc["deps"])
    base = plan.model_copy(update={"nodes": plan.nodes[:n]})  # generation-0 prefix (graph mechanics only)
    ids = [f"n{i}" for i in range(len(plan.nodes))]
    defer = {ids[i] for i in sc["defer"]}
    real = RuntimeGraph(base.nodes, defer=defer)
    ref = NaiveGraph([(ids[i], [ids[d] for d in sc["deps"][i]]) for i in range(n)], defer=defer)
    check = _Checker(real, ref)
    check.propagation(real.initial, ref.initial, set(), None)
    check.frontiers_match()
    extended = False

    def settle(node_id: str, outcome: str | None) -> None:
        before = set(ref.ready())
        final = outcome if outcome is not None else ref.staged_outcome[node_id]
        prop = real.settle(node_id, outcome)  # type: ignore[arg-type]
        auto = ref.settle(node_id, final)
        check.caller_outcomes[node_id] = final
        check.propagation(prop, auto, before, node_id)

    for kind, r, outcome in sc["ops"]:
        if kind in ("start", "retry", "stage", "settle", "settle_staged"):
            pool = {
                "start": ref.ready(),
                "retry": ref.in_flight(),
                "stage": ref.in_flight(),
                "settle": ref.ready() + ref.in_flight(),
                "settle_staged": tuple(x for x in ref.in_flight() if ref.state[x] == "staged"),
            }[kind]
            if pool:
                node_id = pool[r % len(pool)]
                if kind in ("start", "retry"):
                    assert real.start(node_id) == ref.start(node_id)
                elif kind == "stage":
                    real.stage(node_id, outcome)  # type: ignore[arg-type]
                    ref.stage(node_id, outcome)
                    assert real.staged(node_id) == outcome
                else:
                    settle(node_id, outcome if kind == "settle" else None)
        elif kind == "illegal":
            node_id = ref.order[r % len(ref.order)]
            if ref.state[node_id] in ("settled", "waiting"):
                with pytest.raises(GraphError) as err:
                    real.settle(node_id, outcome)  # type: ignore[arg-type]
                assert err.value.code == "invalid_transition"
            if ref.state[node_id] in ("settled", "waiting", "ready"):
                with pytest.raises(GraphError):
                    real.stage(node_id, outcome)  # type: ignore[arg-type]
        elif kind == "extend" and not extended and sc["extra"]:
            extended = True
            extra_ids = ids[n:]
            edefer = {ids[i] for i in sc["extra_defer"]}
            before = set(ref.ready())
            prop = real.extend(plan, defer=edefer)
            auto = ref.extend(
                [(ids[n + j], [ids[d] for d in ds]) for j, ds in enumerate(sc["extra"])], defer=edefer
            )
            check.propagation(prop, auto, before, None)
            assert real.waiting() == ref.waiting() and len(real) == n + len(extra_ids)
        check.frontiers_match()

    # Drive whatever is left to completion with successes; the frontiers must agree at every step.
    while ref.remaining:
        node_id = (ref.in_flight() + ref.ready())[0]
        if ref.state[node_id] == "ready":
            assert real.start(node_id) == ref.start(node_id)
        settle(node_id, "built")
        check.frontiers_match()

    # Every node settled exactly once, whatever the retries, stages and rebases.
    assert Counter(check.settled_events) == Counter(list(real.outcomes()))
    assert real.work.settlements == len(real)
    # A failed cone blocks only its descendants: skipped-by-propagation iff a dependency did not succeed.
    outcomes = real.outcomes()
    for node_id in outcomes:
        bad_dep = any(outcomes[d] not in SUCCESS for d in real.node(node_id).depends_on)
        if node_id in check.caller_outcomes:
            assert not bad_dep
        else:
            assert outcomes[node_id] == ("skipped" if bad_dep else "deferred")


# ---------------------------------------------------------------------------------------------- transitions


def test_retries_and_rebases_hold_the_node_and_never_decrement_twice() -> None:
    g = RuntimeGraph(_plan([[], [0]]))
    assert g.start("n0") == 1
    assert g.start("n0") == 2  # retry
    g.stage("n0", "failed")
    assert g.start("n0") == 3  # rebase after staging
    g.stage("n0", "built")
    assert g.ready() == () and g.waiting() == ("n1",)  # a staged outcome does not touch dependents
    prop = g.settle("n0")  # the staged (reconciled) outcome
    assert prop.ready == ("n1",) and g.outcome("n0") == "built" and g.attempts("n0") == 3
    with pytest.raises(GraphError) as err:
        g.settle("n0", "built")
    assert err.value.code == "invalid_transition" and "settled" in err.value.message
    assert g.work.index_updates == 2  # one edge at build time, one decrement at settlement


def test_reconciliation_may_change_the_staged_outcome() -> None:
    g = RuntimeGraph(_plan([[], [0]]))
    g.start("n0")
    g.stage("n0", "built")
    prop = g.settle("n0", "failed")
    assert [(s.node, s.outcome, s.cause) for s in prop.settled] == [
        ("n0", "failed", None),
        ("n1", "skipped", "n0"),
    ]


@pytest.mark.parametrize(
    ("action", "code"),
    [
        (lambda g: g.settle("ghost", "built"), "unknown_node"),
        (lambda g: g.start("n1"), "invalid_transition"),  # still waiting on n0
        (lambda g: g.stage("n0", "built"), "invalid_transition"),  # never started
        (lambda g: g.settle("n0", "passed"), "invalid_outcome"),
        (lambda g: g.settle("n0"), "invalid_outcome"),  # nothing staged
    ],
)
def test_illegal_transitions_are_typed(action: Any, code: str) -> None:
    g = RuntimeGraph(_plan([[], [0]]))
    with pytest.raises(GraphError) as err:
        action(g)
    assert err.value.code == code


def test_selected_sink_defers_only_when_its_dependencies_succeeded() -> None:
    plan = _plan([[], [0], [], [2]])
    g = RuntimeGraph(plan, defer={"n1", "n3"})
    g.start("n0")
    assert [(s.node, s.outcome) for s in g.settle("n0", "built").settled] == [
        ("n0", "built"),
        ("n1", "deferred"),
    ]
    g.start("n2")
    assert [(s.node, s.outcome) for s in g.settle("n2", "failed").settled] == [
        ("n2", "failed"),
        ("n3", "skipped"),
    ]
    assert g.done and g.outcomes() == {"n0": "built", "n1": "deferred", "n2": "failed", "n3": "skipped"}


def test_a_selected_root_defers_at_construction_and_skips_its_dependents() -> None:
    g = RuntimeGraph(_plan([[], [0], []]), defer={"n0"})
    assert [(s.node, s.outcome, s.cause) for s in g.initial.settled] == [
        ("n0", "deferred", None),
        ("n1", "skipped", "n0"),
    ]
    assert g.initial.ready == ("n2",) and g.remaining == 1


def test_extend_keeps_earlier_states_and_wires_new_nodes_to_settled_ones() -> None:
    plan = _plan([[], []])
    g = RuntimeGraph(plan)
    g.start("n0")
    g.settle("n0", "failed")
    g.start("n1")
    grown = sp.plan.append_plan(
        plan,
        [
            sp.plan.node("x", inputs=[sp.plan.Pending("n0")]),
            sp.plan.node("y", inputs=[sp.plan.Pending("n1")]),
            sp.plan.node("z"),
        ],
    )
    prop = g.extend(grown)
    assert [(s.node, s.outcome) for s in prop.settled] == [("x", "skipped")]
    assert prop.ready == ("z",) and g.waiting() == ("y",) and g.in_flight() == ("n1",)
    assert g.settle("n1", "clean").ready == ("y",)
    with pytest.raises(GraphError):
        g.extend(grown.nodes[2:])  # already part of the graph


# ---------------------------------------------------------------------------------------------- linear work


def _run(plan: Plan, steps: int) -> tuple[RuntimeGraph, Admission, list[int], list[str]]:
    g = RuntimeGraph(plan)
    adm = Admission({"steps": steps})
    for node_id in g.initial.ready:
        adm.add_node(g.node(node_id))
    per_settlement: list[int] = []
    order: list[str] = []
    while not g.done:
        batch = adm.admit()
        assert batch, "a pass with free capacity and ready work must admit something"
        for node_id in batch:
            order.append(node_id)
            g.start(node_id)
            before = g.work.index_updates
            prop = g.settle(node_id, "built")
            per_settlement.append(g.work.index_updates - before)
            adm.release(node_id)
            for r in prop.ready:
                adm.add_node(g.node(r))
    return g, adm, per_settlement, order


@pytest.mark.parametrize("n", [200, 2000])
def test_chain_costs_constant_work_per_settlement(n: int) -> None:
    g, adm, per_settlement, _ = _run(_plan([[i - 1] if i else [] for i in range(n)]), steps=4)
    assert max(per_settlement) == 1
    assert g.work.index_updates == 2 * (n - 1)
    assert adm.work.prepared <= 2 * n
    assert g.work.frontier_snapshots == 0  # the hot path never snapshots a frontier


def test_wide_frontier_costs_linear_admission_work_while_rescans_are_quadratic() -> None:
    work: dict[int, tuple[int, int]] = {}
    for n in (300, 1200):
        plan = _plan([[] for _ in range(n)])
        g, adm, _, order = _run(plan, steps=4)
        naive = NaiveAdmission(steps=4)
        for node in plan.nodes:
            naive.add(node.id, priority=node.priority, position=node.position)
        naive_order: list[str] = []
        while naive.ready:
            batch = naive.admit()
            naive_order += batch
            for node_id in batch:
                naive.release(node_id)
        assert order == naive_order  # identical admission order...
        assert g.work.index_updates == 0
        work[n] = (adm.work.prepared, naive.sorted_items)
    ours = work[1200][0] / work[300][0]
    theirs = work[1200][1] / work[300][1]
    assert ours <= 4.1  # ...at linear cost (4x nodes -> ~4x work)
    assert theirs >= 14  # the rescan reference is quadratic (4x nodes -> ~16x work)
