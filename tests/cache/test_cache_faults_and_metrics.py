"""Shared-tier faults never fail a dispatch; exactly one cache decision per consult (OpenTelemetry SDK reader and
a counting port); concurrent same-key consults in one process execute once."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _cache_support import Machine, make_machine, upper, upper_node
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from smthrs_plugin.boundary import Measurer
from smthrs_plugin.cache import CacheDispatcher, Miss, StaleReadSet, VerifiedHit
from smthrs_plugin.cache._support import KEY_LOCKS
from smthrs_plugin.observe.metrics import DISPATCHES, STEP_CACHE_DECISIONS, Metrics
from smthrs_plugin.stores.artifacts import ArtifactStore

Machines = Callable[..., Machine]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_a_shared_tier_behind_a_closed_port_never_fails_the_dispatch(tmp_path: Path) -> None:
    dead = ArtifactStore(
        "s3://nowhere/cache",
        {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": f"http://127.0.0.1:{_closed_port()}",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
        },
    )
    a = make_machine(tmp_path, "a", dead, files={"in.txt": "hello\n"})
    res = a.dispatch(upper_node(), upper)
    assert (res.outcome, res.decision, res.value) == ("built", Miss(), {"length": 6})
    assert res.published == {"local": "published", "shared": "unpublished:blobs"}
    prov = a.provenance()
    assert {"action": "unpublished", "stage": "blobs"}.items() <= prov[-1].items()
    assert any(p["action"] == "unavailable" and p["stage"] == "lookup" for p in prov)
    again = a.dispatch(upper_node(), upper)
    assert (again.outcome, again.decision) == ("clean", VerifiedHit("local")) and a.calls["upper"] == 1


def test_a_shared_tier_that_cannot_take_the_entry_journals_the_entry_stage(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    (root / "ac").write_text("a file where the entry directory should be")  # publishing an entry fails
    shared = ArtifactStore(root.as_uri())
    a = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"})
    res = a.dispatch(upper_node(), upper)
    assert res.outcome == "built" and res.published["shared"] == "unpublished:entry"
    assert [p["stage"] for p in a.provenance() if p["action"] == "unpublished"] == ["entry"]


def test_exactly_one_decision_per_consult_on_the_opentelemetry_sdk(tmp_path: Path) -> None:
    reader = InMemoryMetricReader()
    metrics = Metrics(meter_provider=MeterProvider(metric_readers=[reader]))
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    m = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"})
    d = CacheDispatcher(m.db, m.artifacts, m.ws, shared=shared, metrics=metrics, measurer=m.measurer)
    d.dispatch(m.request(upper_node()), upper)  # Miss
    d.dispatch(m.request(upper_node()), upper)  # VerifiedHit
    keyed = m.request(upper_node())
    m.write("in.txt", "edited\n")
    assert isinstance(d.dispatch(keyed, upper).decision, StaleReadSet)
    d.dispatch(m.request(upper_node(tier="irreversible"), plan_id="p"), upper)  # no consult, no decision

    def boom(root: Path) -> None:
        raise RuntimeError("fails")

    m.write("in.txt", "third\n")
    assert d.dispatch(m.request(upper_node()), boom).outcome == "failed"  # Miss, then the executor fails

    points: dict[tuple[str, str], int] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    if metric.name in (STEP_CACHE_DECISIONS, DISPATCHES):
                        points[(metric.name, str((p.attributes or {})["outcome"]))] = int(p.value)
    assert {k[1]: v for k, v in points.items() if k[0] == STEP_CACHE_DECISIONS} == {
        "miss": 2,
        "verified_hit": 1,
        "stale_read_set": 1,
    }
    assert {k[1]: v for k, v in points.items() if k[0] == DISPATCHES} == {"success": 4, "failure": 1}


@pytest.mark.parametrize("threads", [8])
def test_concurrent_same_key_consults_in_one_process_execute_once(tmp_path: Path, threads: int) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    m = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"})
    start = threading.Barrier(threads)
    results: list[Any] = []
    lock = threading.Lock()

    def one() -> None:
        req = m.request(upper_node())
        start.wait(timeout=120)
        r = m.dispatcher.dispatch(req, lambda root: (m.calls.update(["upper"]), upper(root))[1])
        with lock:
            results.append(r)

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    assert m.calls["upper"] == 1
    assert sorted(r.outcome for r in results) == ["built"] + ["clean"] * (threads - 1)
    assert {r.value["length"] for r in results} == {6}
    assert m.metrics.decisions == {"Miss": 1, "VerifiedHit": threads - 1}
    assert len(KEY_LOCKS) == 0  # every per-key lock was released and dropped


def test_one_dispatcher_per_workspace_is_enforced(tmp_path: Path) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    m = make_machine(tmp_path, "a", shared)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(Exception) as err:
        CacheDispatcher(m.db, m.artifacts, m.ws, measurer=Measurer(other))
    assert getattr(err.value, "code", None) == "invalid_declaration"
