"""A hit looks like a hit in Prefect however a step is called: a direct call's hit ends its task run ``Cached`` (as
``.submit()`` / ``.map()`` hits do) while the call still returns the value, and failures reach the caller exactly
as before (the step's own exception type, retried by ``retries=``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _prefect_support import poll, run_py, task_runs_of
from prefect import flow
from prefect.client.schemas.objects import State

import smthrs_plugin as sp


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


pytestmark = pytest.mark.prefect

CALLS: list[str] = []


@sp.step
def square(x: int) -> dict:
    CALLS.append("square")
    return {"square": x * x}


class Refused(Exception):
    """The step's own error type."""


@sp.step
def refuse(x: int) -> int:
    CALLS.append("refuse")
    raise Refused(f"refused {x}")


@sp.step(retries=1, retry_delay_seconds=0)
def once_flaky(x: int) -> int:
    CALLS.append("once_flaky")
    if CALLS.count("once_flaky") == 1:
        raise Refused("first attempt")
    return x


@flow(persist_result=False)
def direct(x: int) -> dict:
    from prefect.runtime import flow_run

    return {"flow_run_id": str(flow_run.id), "value": square(x)}


def _state_names(api: str, flow_run_id: str, count: int) -> list[str]:
    names: list[str] = poll(
        lambda: sorted(t["state"]["name"] for t in task_runs_of(api, flow_run_id)),
        lambda v: len(v) == count and not {"Running", "Pending", "Scheduled"} & set(v),
    )
    return names


@pytest.fixture
def ws(tmp_path: Path) -> Any:
    CALLS.clear()
    with sp.step_settings(workspace=tmp_path):
        yield tmp_path


def test_a_direct_call_hit_ends_its_task_run_cached_and_still_returns_the_value(
    ws: Path, prefect_api: str
) -> None:
    first = direct(3)
    assert first["value"] == {"square": 9}
    # A build is a plain completion.
    assert _state_names(prefect_api, first["flow_run_id"], 1) == ["Completed"]
    second = direct(3)
    assert second["value"] == {"square": 9}  # the value, not the Cached state Prefect hands back
    assert CALLS == ["square"]
    assert _state_names(prefect_api, second["flow_run_id"], 1) == ["Cached"]


def test_a_direct_call_with_return_state_gets_the_cached_state_whose_result_is_the_value(ws: Path) -> None:
    @flow(persist_result=False)
    def stateful() -> list[Any]:
        return [square(4, return_state=True), square(4, return_state=True)]

    built, hit = stateful()
    assert isinstance(built, State) and isinstance(hit, State)
    assert built.name == "Completed" and hit.name == "Cached"
    assert built.result() == hit.result() == {"square": 16}
    assert CALLS == ["square"]


def test_a_failing_direct_call_raises_the_steps_own_exception_and_its_task_run_fails(
    ws: Path, prefect_api: str
) -> None:
    @flow(persist_result=False)
    def failing() -> int:
        return refuse(2)

    with pytest.raises(Refused, match="refused 2"):
        failing()
    state = failing(return_state=True)
    assert state.is_failed()
    runs = poll(
        lambda: task_runs_of(prefect_api, str(state.state_details.flow_run_id)),
        lambda v: len(v) == 1 and v[0]["state"]["type"] == "FAILED",
    )
    assert [r["state"]["type"] for r in runs] == ["FAILED"]
    assert CALLS == ["refuse", "refuse"]  # a failure is never cached


def test_a_failing_direct_call_outside_any_flow_raises_the_steps_own_exception(ws: Path) -> None:
    with pytest.raises(Refused, match="refused 5"):
        refuse(5)


def test_retries_still_retry_a_direct_call_and_its_value_is_then_served_as_a_hit(
    ws: Path, prefect_api: str
) -> None:
    @flow(persist_result=False)
    def retried() -> dict:
        from prefect.runtime import flow_run

        return {"flow_run_id": str(flow_run.id), "value": once_flaky(8)}

    assert retried()["value"] == 8
    again = retried()
    assert again["value"] == 8
    assert CALLS == ["once_flaky", "once_flaky"]  # one failed attempt, one build, then a hit
    assert _state_names(prefect_api, again["flow_run_id"], 1) == ["Cached"]


def test_submit_and_map_hits_stay_cached_and_resolve_to_values(ws: Path, prefect_api: str) -> None:
    @flow(persist_result=False)
    def fanned() -> dict:
        from prefect.runtime import flow_run

        return {
            "flow_run_id": str(flow_run.id),
            "values": [square.submit(2).result()] + [f.result() for f in square.map([2, 3])],
        }

    assert fanned()["values"] == [{"square": 4}, {"square": 4}, {"square": 9}]
    again = fanned()
    assert again["values"] == [{"square": 4}, {"square": 4}, {"square": 9}]
    assert _state_names(prefect_api, again["flow_run_id"], 3) == ["Cached"] * 3


def _cached_messages(api: str, flow_run_id: str) -> list[str]:
    runs = poll(
        lambda: task_runs_of(api, flow_run_id),
        lambda v: len(v) == 1 and v[0]["state"]["name"] == "Cached",
    )
    return [str(r["state"]["message"]) for r in runs]


def _built_execute_ms(workspace: Path) -> float:
    with sp.open_runtime(workspace) as rt:
        runs = rt.runs.list(limit=50)
        built = [
            e.payload
            for r in runs
            for e in rt.journal.read(r.run_id, limit=500)
            if e.type == "step-settled" and e.payload["outcome"] == "built"
        ]
    assert len(built) == 1 and isinstance(built[0]["execute_ms"], float)
    return float(built[0]["execute_ms"])


def test_a_cached_state_names_the_local_tier_and_the_time_the_original_execution_took(
    ws: Path, prefect_api: str
) -> None:
    direct(5)
    second = direct(5)
    (message,) = _cached_messages(prefect_api, second["flow_run_id"])
    execute_ms = _built_execute_ms(ws)  # recorded with the build, folded into no key
    assert message.startswith("smthrs: verified cache hit key1_") and "; local tier; " in message
    assert message.endswith(f"saved {execute_ms / 1000:.3f} s of execution")


def test_a_cached_state_served_by_the_shared_tier_names_that_tier_and_the_time_its_publisher_recorded(
    tmp_path: Path, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from smthrs_plugin.cache import generate_key_pair

    CALLS.clear()
    key, _, _ = generate_key_pair(tmp_path / "keys")
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(key))  # both workspaces publish and trust one key
    shared = (tmp_path / "shared").as_uri()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with sp.step_settings(workspace=tmp_path / "a", artifacts=shared):
        direct(6)
    with sp.step_settings(workspace=tmp_path / "b", artifacts=shared):
        other = direct(6)
    assert CALLS == ["square"]
    (message,) = _cached_messages(prefect_api, other["flow_run_id"])
    execute_ms = _built_execute_ms(tmp_path / "a")  # the publisher's build, seen by this process
    assert "; shared tier; " in message and message.endswith(f"saved {execute_ms / 1000:.3f} s of execution")


HIT_SCRIPT = """\
import sys
from prefect import flow
import smthrs_plugin as sp

@sp.step
def cube(x: int) -> int:
    return x ** 3

@flow(persist_result=False)
def cubed(x: int) -> int:
    return cube(x, return_state=True).message or "built"

with sp.step_settings(workspace=sys.argv[1]):
    print("MESSAGE", cubed(2))
"""


def test_a_later_process_reads_the_time_saved_from_the_build_record_of_the_entrys_run(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "hit.py").write_text(HIT_SCRIPT)
    env = {"SMTHRS_ISOLATION": "thread"}
    first = run_py([str(tmp_path / "hit.py"), str(tmp_path / "ws")], cwd=tmp_path, env=env)
    assert first.returncode == 0 and "MESSAGE built" in first.stdout, first.stderr[-3000:]
    second = run_py([str(tmp_path / "hit.py"), str(tmp_path / "ws")], cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    execute_ms = _built_execute_ms(tmp_path / "ws")
    assert f"; local tier; saved {execute_ms / 1000:.3f} s of execution" in second.stdout
