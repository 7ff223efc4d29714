"""``@sp.step`` on ``async def`` inside real Prefect flow runs (the session's server): an async task whose body runs
in its sandbox on the task run's own event loop, served from the cache on the next run, retried by Prefect."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import poll, step_outcomes, task_runs_of
from prefect import flow

import smthrs_plugin as sp
from smthrs_plugin.errors import CacheError, WaitError
from smthrs_plugin.prefect.steprun import current_spec


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


pytestmark = pytest.mark.prefect

#: Body executions, appended by the bodies (they run in this process: direct awaits on the flow's loop,
#: submitted ones on the thread pool's loops).
CALLS: list[str] = []
#: The event loop each body ran on, by step name (a direct await's body must run on the flow's loop).
LOOPS: dict[str, int] = {}
#: Rendezvous of two concurrently awaited steps (only possible if both bodies run at once on one loop).
EVENTS: dict[str, asyncio.Event] = {}


@sp.step(reads=["data/raw.txt"], writes=["data/loud.txt"])
async def shout(ws: sp.Workspace, times: int) -> dict:
    CALLS.append("shout")
    LOOPS["shout"] = id(asyncio.get_running_loop())
    await asyncio.sleep(0)
    text = (ws / "data/raw.txt").read_text()
    (ws / "data/loud.txt").write_text(text.upper() * times)
    return {"chars": len(text) * times}


@sp.step
async def double(x: int) -> int:
    CALLS.append("double")
    await asyncio.sleep(0)
    return 2 * x


@sp.step(retries=1, retry_delay_seconds=0)
async def flaky(x: int) -> int:
    CALLS.append("flaky")
    if CALLS.count("flaky") == 1:
        raise RuntimeError("first attempt fails")
    return x + 1


class Boom(Exception):
    """A step's own error type: it must reach the flow untouched."""


@sp.step
async def explode(x: int) -> int:
    CALLS.append("explode")
    raise Boom(f"no {x}")


@sp.step
async def ping(n: int) -> str:
    EVENTS.setdefault("pong", asyncio.Event())
    EVENTS.setdefault("ping", asyncio.Event()).set()
    # A deadline far above any run's duration: it only turns a deadlock (serialised bodies) into a failure.
    await asyncio.wait_for(EVENTS["pong"].wait(), timeout=120)
    return f"ping {n}"


@sp.step
async def pong(n: int) -> str:
    EVENTS.setdefault("ping", asyncio.Event())
    EVENTS.setdefault("pong", asyncio.Event()).set()
    await asyncio.wait_for(EVENTS["ping"].wait(), timeout=120)
    return f"pong {n}"


@sp.step
async def gated() -> int:
    sp.sleep(1)  # a durable wait inside a cached body: refused, as for a sync step
    return 1


@sp.step(timeout_seconds=1)
async def stuck(x: int) -> int:
    CALLS.append("stuck")
    try:
        await asyncio.Event().wait()  # never set: only the task run's timeout ends this body
    except asyncio.CancelledError:
        CALLS.append("stuck cancelled")
        raise
    return x


@flow(persist_result=False)
async def pipeline(times: int) -> dict:
    from prefect.runtime import flow_run

    loop = id(asyncio.get_running_loop())
    direct = await shout(times)
    submitted = double.submit(5)
    mapped = double.map([1, 2, 3])
    return {
        "flow_run_id": str(flow_run.id),
        "direct_on_flow_loop": LOOPS["shout"] == loop,
        "direct": direct,
        "submitted": submitted.result(),
        "mapped": [f.result() for f in mapped],
    }


def _settled(flow_run_id: str) -> list[dict[str, Any]]:
    rt = current_spec().open()
    return [e.payload for e in rt.journal.read(f"prefect-{flow_run_id}") if e.type == "step-settled"]


def _final_state_names(api: str, flow_run_id: str, count: int) -> list[str]:
    # Prefect persists task-run states asynchronously: poll until every run reached its final state.
    names: list[str] = poll(
        lambda: sorted(t["state"]["name"] for t in task_runs_of(api, flow_run_id)),
        lambda v: len(v) == count and not {"Running", "Pending", "Scheduled"} & set(v),
    )
    return names


@pytest.fixture
def ws(tmp_path: Path) -> Any:
    (tmp_path / "data").mkdir()
    (tmp_path / "data/raw.txt").write_text("abc")
    CALLS.clear()
    LOOPS.clear()
    EVENTS.clear()
    with sp.step_settings(workspace=tmp_path):
        yield tmp_path


def test_an_async_step_awaited_submitted_and_mapped_builds_once_and_the_second_flow_run_is_all_cached(
    ws: Path, prefect_api: str
) -> None:
    first = asyncio.run(pipeline(2))
    assert first["direct"] == {"chars": 6}  # an awaited direct call returns the value, never a State
    assert first["submitted"] == 10 and first["mapped"] == [2, 4, 6]
    assert first["direct_on_flow_loop"]  # the body ran on the flow's own loop, the dispatch in a thread
    assert (ws / "data/loud.txt").read_text() == "ABCABC"  # the declared write was copied back
    assert sorted(CALLS) == ["double"] * 4 + ["shout"]
    assert sorted(r["outcome"] for r in _settled(first["flow_run_id"])) == ["built"] * 5

    (ws / "data/loud.txt").unlink()  # a hit must replay the declared output
    second = asyncio.run(pipeline(2))
    assert {k: v for k, v in second.items() if k not in ("flow_run_id", "direct_on_flow_loop")} == {
        k: v for k, v in first.items() if k not in ("flow_run_id", "direct_on_flow_loop")
    }
    assert sorted(CALLS) == ["double"] * 4 + ["shout"]  # no body ran again: executed once in total
    assert (ws / "data/loud.txt").read_text() == "ABCABC"
    hits = _settled(second["flow_run_id"])
    assert [(r["outcome"], r["decision"]) for r in hits] == [("clean", "VerifiedHit")] * 5
    # Every hit is a Cached task run in Prefect, the awaited direct call included.
    assert _final_state_names(prefect_api, second["flow_run_id"], 5) == ["Cached"] * 5


def test_async_steps_submitted_from_a_sync_flow_resolve_to_their_values(ws: Path) -> None:
    @flow(persist_result=False)
    def fan_out() -> list[int]:
        return [f.result() for f in double.map([7, 8])] + [double.submit(9).result()]

    assert fan_out() == [14, 16, 18]
    assert fan_out() == [14, 16, 18]
    assert CALLS == ["double"] * 3


def test_concurrently_awaited_async_steps_run_their_bodies_at_the_same_time_on_one_loop(ws: Path) -> None:
    @flow(persist_result=False)
    async def rendezvous() -> list[str]:
        # ping waits for pong and pong for ping: both bodies must be running at once on the flow's loop, so
        # neither the loop nor a capped pool may serialise them.
        return list(await asyncio.gather(ping(1), pong(1)))

    assert asyncio.run(rendezvous()) == ["ping 1", "pong 1"]


def test_prefect_retries_run_a_failing_async_step_again_as_a_new_attempt(ws: Path) -> None:
    @flow(persist_result=False)
    async def retried() -> dict:
        from prefect.runtime import flow_run

        return {"value": await flaky(41), "flow_run_id": str(flow_run.id)}

    out = asyncio.run(retried())
    assert out["value"] == 42 and CALLS == ["flaky", "flaky"]
    records = _settled(out["flow_run_id"])
    assert [(r["attempt"], r["outcome"]) for r in records] == [(1, "failed"), (2, "built")]
    assert "first attempt fails" in records[0]["error"]


def test_an_async_step_failure_reaches_the_flow_as_the_steps_own_exception(ws: Path) -> None:
    @flow(persist_result=False)
    async def failing() -> int:
        return await explode(3)

    with pytest.raises(Boom, match="no 3"):
        asyncio.run(failing())
    assert CALLS == ["explode"]


def test_an_async_steps_argument_without_a_key_is_refused_naming_it_before_its_body_runs(ws: Path) -> None:
    @flow(persist_result=False)
    async def bad() -> int:
        return await double(complex(1, 2))  # type: ignore[arg-type]

    with pytest.raises(CacheError) as err:
        asyncio.run(bad())
    assert err.value.code == "key_uncomputable" and err.value.details["argument"] == "x"
    assert CALLS == []


def test_a_timed_out_async_step_cancels_its_body_and_settles_as_failed_before_the_flow_sees_it(
    ws: Path,
) -> None:
    seen: dict[str, Any] = {}

    @flow(persist_result=False)
    async def times_out() -> int:
        from prefect.runtime import flow_run

        seen["flow_run_id"] = str(flow_run.id)
        return await stuck(1)

    with pytest.raises(TimeoutError):
        asyncio.run(times_out())
    # The body never finished on its own; whether the timeout hit it running or before it started, the call
    # settled as a failed build, journaled before the timeout reached the flow, and nothing was cached.
    assert CALLS in (["stuck", "stuck cancelled"], [])
    (record,) = _settled(seen["flow_run_id"])
    assert record["outcome"] == "failed"


def test_a_durable_wait_inside_an_async_step_body_is_refused(ws: Path) -> None:
    @flow(persist_result=False)
    async def waits() -> int:
        return await gated()

    with pytest.raises(WaitError) as err:
        asyncio.run(waits())
    assert err.value.code == "invalid_wait"


def test_an_async_step_awaited_outside_any_flow_is_its_own_run_and_served_the_second_time(ws: Path) -> None:
    assert asyncio.run(double(4)) == 8
    assert asyncio.run(double(4)) == 8
    assert CALLS == ["double"]


def test_generator_functions_are_refused_when_decorated() -> None:
    with pytest.raises(CacheError) as err:

        @sp.step
        async def stream() -> Any:
            yield 1

    assert err.value.code == "invalid_declaration"
    assert "generator" in err.value.message


def test_readme_async_step_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMTHRS_WORKSPACE", raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/raw.csv").write_text("0.2\n0.7\n0.9\n")
    # --- example (keep identical to the async block of "For Prefect flow authors: @step") ---
    import asyncio

    from prefect import flow

    import smthrs_plugin as sp

    @sp.step(reads=["data/raw.csv"], writes=["data/summary.txt"])
    async def summarize(ws: sp.Workspace, title: str) -> dict:
        rows = (ws / "data/raw.csv").read_text().split()
        await asyncio.sleep(0.01)  # an awaited call (HTTP, database): concurrent awaits overlap
        (ws / "data/summary.txt").write_text(f"{title}: {len(rows)} rows\n")
        return {"rows": len(rows)}

    @sp.step
    async def score(x: int) -> int:
        return x * x

    @flow
    async def report() -> list:
        summary = await summarize("raw")  # a direct await returns the value
        squares = await asyncio.gather(*(score(x) for x in (1, 2, 3)))  # concurrent bodies, one loop
        return [summary, list(squares)]

    print(asyncio.run(report()))  # built: each body ran once, in its sandbox
    print(asyncio.run(report()))  # every step a verified hit, Cached in Prefect: no body ran
    # --- end of the example ---
    expected = "[{'rows': 3}, [1, 4, 9]]"
    assert capsys.readouterr().out.splitlines()[-2:] == [expected, expected]
    assert (tmp_path / "data/summary.txt").read_text() == "raw: 3 rows\n"
    assert step_outcomes(tmp_path) == ["built"] * 4 + ["clean"] * 4
