"""admission.py: priority + aging under step/agent caps, exact arithmetic, heap ≡ re-sorting reference."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_reference import NaiveAdmission

import smthrs_plugin as sp
from smthrs_plugin.errors import GraphError
from smthrs_plugin.plan import Concurrency, RuntimeGraph
from smthrs_plugin.plan.admission import Admission


def test_aging_lets_a_low_priority_node_overtake_an_urgent_chain() -> None:
    drafts = [sp.plan.node("waiting", body="w", priority=0)]
    drafts += [
        sp.plan.node(
            f"urgent-{i}", body=i, priority=2, inputs=[sp.plan.Pending(f"urgent-{i - 1}")] if i else []
        )
        for i in range(5)
    ]
    plan = sp.plan.compile_plan("p", "f", drafts)
    graph = RuntimeGraph(plan)
    admission = Admission({"steps": 1})
    for node_id in graph.initial.ready:
        admission.add_node(graph.node(node_id))
    order: list[str] = []
    while not graph.done:
        [node_id] = admission.admit()
        order.append(node_id)
        graph.start(node_id)
        prop = graph.settle(node_id, "built")
        admission.release(node_id)
        for ready in prop.ready:
            admission.add_node(graph.node(ready))
        if node_id == "urgent-1":
            assert admission.waited("waiting") == 2 and admission.score("waiting") == 2
    assert order == ["urgent-0", "urgent-1", "waiting", "urgent-2", "urgent-3", "urgent-4"]


def test_an_agent_counts_against_both_caps() -> None:
    adm = Admission(Concurrency(steps=2, agents=1))
    adm.add("a1", priority=5, position=0, agent=True)
    adm.add("a2", priority=5, position=1, agent=True)
    adm.add("s1", priority=0, position=2)
    adm.add("s2", priority=0, position=3)
    assert adm.admit() == ("a1", "s1")  # a2 skipped (agent cap), s1 takes the second step permit
    assert adm.admit() == ()  # both step permits held; the agent held one of them
    adm.release("s1")
    assert adm.admit() == ("s2",)  # a2 outranks s2 but is still blocked by the agent cap
    adm.release("a1")
    assert adm.admit() == ("a2",)


def test_retake_gives_a_released_node_its_permit_back_only_when_the_caps_have_room() -> None:
    plan = sp.plan.compile_plan(
        "p", "f", [sp.plan.node("ag", body=0, kind="agent"), sp.plan.node("s", body=1), sp.plan.node("t", body=2)]
    )
    adm = Admission({"steps": 2, "agents": 1})
    for node_id in ("ag", "s", "t"):
        adm.add_node(plan.node(node_id))
    assert adm.admit() == ("ag", "s")
    adm.release("ag")  # its body returned
    assert adm.admit() == ("t",)
    assert adm.retake(plan.node("ag")) is False  # both step permits are held: nothing changes
    assert adm.in_flight_count() == 2
    adm.release("s")
    assert adm.retake(plan.node("ag")) is True
    assert adm.in_flight_count() == 2
    with pytest.raises(GraphError):
        adm.retake(plan.node("ag"))  # it holds one already
    adm.release("t")
    assert adm.admit() == ()  # the agent cap is held by ag again


def test_a_blocked_agent_does_not_block_a_later_step() -> None:
    adm = Admission({"steps": 3, "agents": 1})
    adm.add("busy", priority=0, position=0, agent=True)
    assert adm.admit() == ("busy",)
    adm.add("agent", priority=100, position=1, agent=True)
    adm.add("step", priority=-100, position=2)
    assert adm.admit() == ("step",)
    assert adm.waited("agent") == 1


def test_a_full_step_cap_stops_agents_too() -> None:
    adm = Admission({"steps": 1, "agents": 5})
    adm.add("s", priority=9, position=0)
    adm.add("a", priority=0, position=1, agent=True)
    assert adm.admit() == ("s",)
    assert adm.admit() == ()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
@pytest.mark.parametrize("cap", ["steps", "agents"])
def test_zero_negative_and_non_int_caps_are_refused_at_construction(cap: str, bad: object) -> None:
    with pytest.raises(GraphError) as err:
        Admission({cap: bad})
    assert err.value.code == "invalid_concurrency" and cap in err.value.message
    with pytest.raises(GraphError):
        Concurrency(**{cap: bad})  # type: ignore[arg-type]


def test_unknown_concurrency_keys_are_refused() -> None:
    with pytest.raises(GraphError) as err:
        Admission({"step": 2})
    assert err.value.code == "invalid_concurrency"


def test_priority_arithmetic_is_exact_beyond_the_safe_integer_range() -> None:
    adm = Admission({"steps": 1})
    big = 2**53
    adm.add("a", priority=big, position=1)
    adm.add("b", priority=big + 1, position=2)  # equal as floats, not as ints
    adm.add("c", priority=big - 1, position=0)
    assert adm.admit() == ("b",)
    adm.release("b")
    assert adm.score("c") == big and adm.score("a") == big + 1


def test_discarded_and_duplicate_nodes() -> None:
    adm = Admission()
    adm.add("a", priority=0, position=0)
    with pytest.raises(GraphError):
        adm.add("a", priority=0, position=0)
    adm.discard("a")
    assert adm.admit() == ()
    with pytest.raises(GraphError):
        adm.release("a")


_ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "admit", "release"]),
        st.integers(-(2**60), 2**60) | st.integers(-3, 3),
        st.booleans(),
        st.integers(0, 10**6),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.none(), st.integers(1, 4)),
    st.one_of(st.none(), st.integers(1, 3)),
    _ops,
)
def test_heap_admission_equals_the_re_sorting_reference(steps: Any, agents: Any, ops: Any) -> None:
    real = Admission({"steps": steps, "agents": agents})
    ref = NaiveAdmission(steps, agents)
    position = 0
    for kind, priority, agent, r in ops:
        if kind == "add":
            node_id = f"n{position}"
            real.add(node_id, priority=priority, position=position, agent=agent)
            ref.add(node_id, priority=priority, position=position, agent=agent)
            position += 1
        elif kind == "admit":
            assert real.admit() == ref.admit()
        elif ref.in_flight:
            node_id = sorted(ref.in_flight)[r % len(ref.in_flight)]
            real.release(node_id)
            ref.release(node_id)
        for node_id in ref.ready:
            assert real.waited(node_id) == ref.waited[node_id]
    assert real.ready_count() == len(ref.ready) and real.in_flight_count() == len(ref.in_flight)
