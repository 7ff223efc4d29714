"""Compile pauses the cyclic garbage collector (``plan/_gcpause.py``): it must hand the collector back exactly as it
found it — after a refusal too, and when several threads compile at once — and pause it while it works."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from _threads import run_threads

import smthrs_plugin as sp
from smthrs_plugin.errors import PlanError


@pytest.fixture(autouse=True)
def _gc_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def _drafts(n: int) -> list[sp.plan.NodeDraft]:
    return [
        sp.plan.node(f"n{i}", body=i, inputs=[sp.plan.Pending(f"n{i - 1}")] if i else []) for i in range(n)
    ]


def test_no_collection_runs_while_a_compile_works_and_the_collector_is_enabled_after_it() -> None:
    drafts = _drafts(5_000)  # tens of thousands of allocations: many collections, were the collector running
    collections: list[str] = []

    def count(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(phase)

    gc.enable()
    gc.collect()  # the allocation counters start at zero: nothing before the compile makes a collection due
    gc.callbacks.append(count)
    try:
        plan = sp.plan.compile_plan("p", "f", drafts, 10_000)
        during = len(collections)
    finally:
        gc.callbacks.remove(count)

    # At most the one collection that was due when the pause ended, run by the first allocation after it (without
    # the pause this compile runs about 28).
    assert during <= 1
    assert gc.isenabled()
    assert len(plan.nodes) == 5_000


def test_a_refused_compile_still_enables_the_collector_again() -> None:
    gc.enable()
    with pytest.raises(PlanError):
        sp.plan.compile_plan("p", "f", [sp.plan.node("a", inputs=[sp.plan.Pending("missing")])])
    assert gc.isenabled()


def test_a_process_that_disabled_the_collector_keeps_it_disabled() -> None:
    gc.disable()
    sp.plan.compile_plan("p", "f", _drafts(3))
    assert not gc.isenabled()


def test_concurrent_compiles_leave_the_collector_enabled_once_the_last_ends() -> None:
    gc.enable()

    def compile_many(_i: int) -> None:
        for _ in range(20):
            sp.plan.verify_plan(sp.plan.compile_plan("p", "f", _drafts(30)))

    errors = run_threads(compile_many, 4)

    assert errors == [] and gc.isenabled()
