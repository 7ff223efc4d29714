"""Compile time of a 100k-node plan (P5: <= 3 s) and RuntimeGraph + Admission settlements (P5: >= 100k/s).

Compile: ``declare s`` is building the n node drafts with ``smthrs_plugin.node`` (pydantic validation of
untrusted declarations, unchanged by compile), ``compile s`` is ``compile_plan`` over them — topological order,
effect re-checks, every plan key, conflict annotation, edges and the plan digest — the figure the P5 goal
bounds. Both run with the cyclic GC on, as in a real process.

Settlements: RuntimeGraph + Admission mechanics vs the naive rescan reference (tests/plan/plan_reference.py).
Measures only graph mechanics with a no-op executor (every admitted node settles ``built`` at once): admission
pass → start → settle → release → newly ready nodes enter admission. Not an end-to-end scheduler throughput
claim. Shapes: ``chain`` (n nodes, each depending on the previous) and ``wide`` (n independent nodes, one in
four an agent) under ``steps=8, agents=2``. Before timing, the indexed and naive admission orders are checked
equal (up to 10k nodes). The reference rescans the whole graph per settlement and re-sorts the whole ready set
per pass; it is skipped above 10k nodes and, at 10k, measured over its first 1,000 settlements (its per-
settlement cost depends on n, not on progress, so that rate is representative; the whole run would take
minutes).

Run: ``.venv/bin/python benchmarks/graph.py [--sizes 1000,10000,100000]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))

from plan_reference import NaiveAdmission, NaiveGraph  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.plan import Plan, RuntimeGraph
from smthrs_plugin.plan._admission import Admission

CAPS = {"steps": 8, "agents": 2}
REFERENCE_MAX = 10_000
REFERENCE_PREFIX = 1_000


COMPILE_GOAL_S = 3.0  # at 100,000 nodes
SETTLE_GOAL = 100_000  # settlements/s


def declare(shape: str, n: int) -> list[sp.plan.NodeDraft]:
    if shape == "chain":
        return [
            sp.plan.node(f"n{i}", body=i, inputs=[sp.plan.Pending(f"n{i - 1}")] if i else [])
            for i in range(n)
        ]
    return [sp.plan.node(f"n{i}", body=i, kind="agent" if i % 4 == 0 else "step") for i in range(n)]


def build(shape: str, n: int) -> tuple[Plan, float, float]:
    """The plan, the seconds spent declaring its drafts and the seconds ``compile_plan`` took."""
    t0 = time.perf_counter()
    drafts = declare(shape, n)
    t1 = time.perf_counter()
    plan = sp.plan.compile_plan(f"bench-{shape}", "bench", drafts, maximum_plan_nodes=n)
    return plan, t1 - t0, time.perf_counter() - t1


def run_indexed(plan: Plan) -> tuple[list[str], float, dict[str, int]]:
    t0 = time.perf_counter()
    graph = RuntimeGraph(plan)
    adm = Admission(CAPS)
    node = graph.node
    for node_id in graph.initial.ready:
        adm.add_node(node(node_id))
    order: list[str] = []
    while not graph.done:
        for node_id in adm.admit():
            order.append(node_id)
            graph.start(node_id)
            prop = graph.settle(node_id, "built")
            adm.release(node_id)
            for ready in prop.ready:
                adm.add_node(node(ready))
    elapsed = time.perf_counter() - t0
    w, a = graph.work, adm.work
    return (
        order,
        elapsed,
        {
            "index_updates": w.index_updates,
            "settlements": w.settlements,
            "frontier_snapshots": w.frontier_snapshots,
            "admission_prepared": a.prepared,
            "admission_passes": a.passes,
        },
    )


def run_naive(plan: Plan, limit: int | None) -> tuple[list[str], float, dict[str, int]]:
    t0 = time.perf_counter()
    graph = NaiveGraph([(n.id, n.depends_on) for n in plan.nodes])
    adm = NaiveAdmission(CAPS["steps"], CAPS["agents"])
    meta = {n.id: n for n in plan.nodes}
    queued: set[str] = set()

    def feed() -> None:  # the reference discovers readiness by scanning the whole frontier
        for node_id in graph.ready():
            if node_id not in queued:
                queued.add(node_id)
                m = meta[node_id]
                adm.add(node_id, priority=m.priority, position=m.position, agent=m.kind == "agent")

    feed()
    order: list[str] = []
    while graph.remaining and (limit is None or len(order) < limit):
        for node_id in adm.admit():
            order.append(node_id)
            graph.start(node_id)
            graph.settle(node_id, "built")
            adm.release(node_id)
        feed()
    elapsed = time.perf_counter() - t0
    return order, elapsed, {"node_scans": graph.scans, "sorted_items": adm.sorted_items}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"caps {CAPS}; no-op executor; rates in settlements/s (one run, same process)")
    print(
        f"goals (P5): compile_plan of 100,000 nodes <= {COMPILE_GOAL_S:.0f} s; >= {SETTLE_GOAL:,} settlements/s "
        "on the wide and chain shapes\n"
    )
    header = (
        f"{'shape':<6} {'n':>7} {'declare s':>9} {'compile s':>9} {'us/node':>7} {'indexed/s':>10} "
        f"{'naive/s':>9} {'ratio':>7}  work counters"
    )
    print(header)
    print("-" * len(header))
    goals: list[str] = []
    for shape in ("chain", "wide"):
        for n in sizes:
            plan, declare_s, compile_s = build(shape, n)
            order, seconds, work = run_indexed(plan)
            rate = len(order) / seconds
            naive_rate_s, ratio_s, naive_work = "-", "-", ""
            if n <= REFERENCE_MAX:
                limit = None if n < REFERENCE_MAX else REFERENCE_PREFIX
                naive_order, naive_seconds, nw = run_naive(plan, limit)
                assert naive_order == order[: len(naive_order)], "admission order differs from the reference"
                naive_rate = len(naive_order) / naive_seconds
                naive_rate_s = f"{naive_rate:,.0f}"
                ratio_s = f"{rate / naive_rate:,.0f}x"
                prefix = f" (first {limit:,})" if limit else ""
                naive_work = f"\n{'':>46}naive{prefix}: " + ", ".join(f"{k}={v:,}" for k, v in nw.items())
            per = work["index_updates"] / max(work["settlements"], 1)
            counters = ", ".join(f"{k}={v:,}" for k, v in work.items())
            print(
                f"{shape:<6} {n:>7,} {declare_s:>9.2f} {compile_s:>9.2f} {compile_s / n * 1e6:>7.1f} "
                f"{rate:>10,.0f} {naive_rate_s:>9} {ratio_s:>7}  "
                f"{counters} (index updates/settlement {per:.2f}){naive_work}"
            )
            if n >= 100_000:
                scaled = compile_s * 100_000 / n
                goals.append(
                    f"{shape:<6} compile {scaled:.2f} s per 100k nodes (goal <= {COMPILE_GOAL_S:.0f} s: "
                    f"{'met' if scaled <= COMPILE_GOAL_S else 'NOT met'}); declare {declare_s * 100_000 / n:.2f} s; "
                    f"settlements {rate:,.0f}/s (goal >= {SETTLE_GOAL:,}/s: "
                    f"{'met' if rate >= SETTLE_GOAL else 'NOT met'})"
                )
    if goals:
        print("\nP5 at 100k nodes:\n  " + "\n  ".join(goals))
    print(
        "\nindexed work is linear: index_updates <= edges x 2, admission_prepared <= 2 x nodes + dead entries;"
        "\nthe reference scans n nodes per settlement and sorts the whole ready set per pass."
    )


if __name__ == "__main__":
    main()
