"""The ``scheduler dispatch duration`` instrument times each dispatched plan node once, admission through its
settlement (rebase turns included); replays dispatch nothing and are not timed. Read back through the real
OpenTelemetry SDK (``InMemoryMetricReader``), never a mock meter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from sched_support import Env, make_env

from smthrs_plugin.observe.metrics import SCHEDULER_DISPATCH_DURATION, SCHEDULER_NODES, Metrics
from smthrs_plugin.plan import Ref, compile_plan, node
from smthrs_plugin.scheduler import NodeInput


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


@pytest.fixture
def wired() -> Iterator[tuple[Metrics, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield Metrics(provider), reader
    provider.shutdown()


def _points(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
    out: dict[tuple[tuple[str, Any], ...], Any] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    for p in metric.data.data_points:
                        key = tuple(sorted((p.attributes or {}).items()))
                        out[key] = p.value if hasattr(p, "value") else p.count
    return out


def test_each_dispatched_node_is_timed_once_rebases_included_and_replays_not_at_all(
    env: Env, wired: tuple[Metrics, InMemoryMetricReader]
) -> None:
    metrics, reader = wired
    plan = compile_plan(
        "p", "f", [node("x", body=1, writes=["out.txt"]), node("y", body=2, inputs=[Ref("x")])]
    )
    landed = {"n": 0}

    def executor(ni: NodeInput) -> Any:
        if ni.id == "x" and landed["n"] == 0:
            landed["n"] += 1
            (env.ws / "out.txt").write_text("landed by someone else")  # one conflict: one rebase turn
        for w in ni.node.effects.writes:
            (ni.root / w).write_text(ni.id)
        return ni.id

    report = env.scheduler(metrics=metrics).run(plan, executor)
    assert report.outcomes == {"x": "built", "y": "built"} and report.settlement("x").rebases == 1
    assert _points(reader, SCHEDULER_DISPATCH_DURATION) == {(): 2}

    again = env.scheduler(metrics=metrics).run(plan, executor)  # the same run reopened: both replay clean
    assert again.outcomes == {"x": "clean", "y": "clean"}
    assert _points(reader, SCHEDULER_DISPATCH_DURATION) == {(): 2}
    assert _points(reader, SCHEDULER_NODES)[(("outcome", "clean"),)] == 2
