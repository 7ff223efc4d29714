"""The ``@step`` hit path inside real Prefect flow runs: a request reused from an earlier call never hides a changed
read, every call still journals its ``step-settled`` record, and a hit whose task run ends ``Cached`` sends no
second Prefect event saying the same thing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _prefect_support import events_of, poll
from prefect import flow

import smthrs_plugin as sp
from smthrs_plugin.prefect.steprun import current_spec


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


pytestmark = pytest.mark.prefect

#: Deadline for Prefect's asynchronous event pipeline (far above anything a busy 2-core machine needs).
DEADLINE_S = 120.0
CALLS: list[int] = []


@sp.step(reads=["in.txt"], writes=["out.txt"])
def shout(ws: sp.Workspace, times: int) -> dict:
    CALLS.append(times)
    text = (ws / "in.txt").read_text()
    (ws / "out.txt").write_text(text.upper() * times)
    return {"chars": len(text) * times}


@flow(persist_result=False)
def calls(times: list[int]) -> dict:
    from prefect.runtime import flow_run

    return {"flow_run_id": str(flow_run.id), "values": [shout(t) for t in times]}


@flow(persist_result=False)
def calls_around_an_edit(ws: str) -> dict:
    from prefect.runtime import flow_run

    values = [shout(1), shout(1)]
    Path(ws, "in.txt").write_text("other")  # a different read between two identical calls
    values += [shout(1), shout(1)]
    return {"flow_run_id": str(flow_run.id), "values": values}


@pytest.fixture
def ws(tmp_path: Path) -> Any:
    (tmp_path / "in.txt").write_text("abc")
    CALLS.clear()
    with sp.step_settings(workspace=tmp_path):
        yield tmp_path


def _settled(flow_run_id: str) -> list[dict[str, Any]]:
    from smthrs_plugin.prefect._stepjournal import flush_hits

    flush_hits()
    rt = current_spec().open()
    return [e.payload for e in rt.journal.read(f"prefect-{flow_run_id}") if e.type == "step-settled"]


def test_a_read_changed_between_two_identical_calls_is_keyed_again_and_built(ws: Path) -> None:
    out = calls_around_an_edit(str(ws))
    assert out["values"] == [{"chars": 3}, {"chars": 3}, {"chars": 5}, {"chars": 5}]
    assert CALLS == [1, 1]
    assert (ws / "out.txt").read_text() == "OTHER"
    # (hit records are journaled in batches, after the builds: compare per key, not in call order)
    settled = _settled(out["flow_run_id"])
    by_key: dict[str, list[str]] = {}
    for p in settled:
        by_key.setdefault(p["dispatch_key"], []).append(p["outcome"])
    assert sorted(sorted(v) for v in by_key.values()) == [["built", "clean"], ["built", "clean"]]


def test_every_hit_of_a_flow_run_is_journaled_once(ws: Path) -> None:
    first = calls([2])
    second = calls([2] * 5 + [3])
    assert second["values"] == [{"chars": 6}] * 5 + [{"chars": 9}]
    assert CALLS == [2, 3]
    assert [p["outcome"] for p in _settled(first["flow_run_id"])] == ["built"]
    settled = _settled(second["flow_run_id"])
    assert sorted(p["outcome"] for p in settled) == ["built"] + ["clean"] * 5
    hits = [p for p in settled if p["outcome"] == "clean"]
    assert all(p["tier"] == "local" and p["decision"] == "VerifiedHit" for p in hits)
    assert len({p["task_run_id"] for p in settled}) == 6


def test_a_hit_in_a_task_run_sends_no_step_clean_event_its_cached_state_says_it(
    ws: Path, prefect_api: str
) -> None:
    calls([4])
    second = calls([4, 5])  # a hit, then a build whose event is sent after the hit's would have been
    events = poll(
        lambda: events_of(prefect_api, "smthrs.step.", second["flow_run_id"]),
        lambda e: any(x["event"] == "smthrs.step.built" for x in e),
        timeout_s=DEADLINE_S,
    )
    assert [e["event"] for e in events] == ["smthrs.step.built"]
    assert sorted(p["outcome"] for p in _settled(second["flow_run_id"])) == ["built", "clean"]
