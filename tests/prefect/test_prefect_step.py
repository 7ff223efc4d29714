"""``@sp.step`` inside real Prefect flow runs (the session's server): values, keys, runs, retries, typed refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import poll, task_runs_of
from prefect import flow

import smthrs_plugin as sp
from smthrs_plugin.errors import BoundaryRefusal, CacheError
from smthrs_plugin.prefect.steprun import current_spec


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


pytestmark = pytest.mark.prefect

CALLS: dict[str, int] = {}


@sp.step(reads=["data/raw.txt"], writes=["data/clean.txt"])
def clean(ws: sp.Workspace, factor: int) -> dict:
    CALLS["clean"] = CALLS.get("clean", 0) + 1
    text = (ws / "data/raw.txt").read_text()
    (ws / "data/clean.txt").write_text(text.upper() * factor)
    return {"chars": len(text) * factor}


@sp.step
def add(a: int, b: int = 10) -> int:
    CALLS["add"] = CALLS.get("add", 0) + 1
    return a + b


@sp.step(retries=1, retry_delay_seconds=0)
def flaky(x: int) -> int:
    CALLS["flaky"] = CALLS.get("flaky", 0) + 1
    if CALLS["flaky"] == 1:
        raise RuntimeError("first attempt fails")
    return x * 2


@sp.step(writes=["declared.txt"])
def sneaky(ws: sp.Workspace) -> int:
    (ws / "declared.txt").write_text("ok")
    (ws / "undeclared.txt").write_text("not declared")
    return 1


@flow(persist_result=False)
def pipeline(factor: int) -> dict:
    from prefect.runtime import flow_run

    direct = clean(factor)
    submitted = add.submit(1, 2)
    mapped = add.map([1, 2, 3])
    return {
        "flow_run_id": str(flow_run.id),
        "direct": direct,
        "submitted": submitted.result(),
        "mapped": [f.result() for f in mapped],
    }


def _settled(ws: Path, flow_run_id: str) -> list[dict[str, Any]]:
    rt = current_spec().open()
    assert rt.workspace == ws
    return [e.payload for e in rt.journal.read(f"prefect-{flow_run_id}") if e.type == "step-settled"]


@pytest.fixture
def ws(tmp_path: Path) -> Any:
    (tmp_path / "data").mkdir()
    (tmp_path / "data/raw.txt").write_text("abc")
    CALLS.clear()
    with sp.step_settings(workspace=tmp_path):
        yield tmp_path


def test_step_direct_call_submit_and_map_return_values_and_the_second_flow_run_is_all_clean(
    ws: Path, prefect_api: str
) -> None:
    first = pipeline(2)
    assert first["direct"] == {"chars": 6}  # a direct call returns the value, never a State
    assert first["submitted"] == 3 and first["mapped"] == [11, 12, 13]
    assert (ws / "data/clean.txt").read_text() == "ABCABC"
    assert CALLS == {"clean": 1, "add": 4}
    built = _settled(ws, first["flow_run_id"])
    assert sorted(r["outcome"] for r in built) == ["built"] * 5

    (ws / "data/clean.txt").unlink()  # a hit must replay the declared output
    second = pipeline(2)
    assert {k: v for k, v in second.items() if k != "flow_run_id"} == {
        k: v for k, v in first.items() if k != "flow_run_id"
    }
    assert CALLS == {"clean": 1, "add": 4}  # no body ran again
    assert (ws / "data/clean.txt").read_text() == "ABCABC"
    hits = _settled(ws, second["flow_run_id"])
    assert [(r["outcome"], r["decision"], r["tier"]) for r in hits] == [("clean", "VerifiedHit", "local")] * 5
    # Each flow run is one smthrs run, claimed by this process and settled by the flow's state hook.
    runs = {r.run_id: r.status for r in current_spec().open().runs.list()}
    assert runs[f"prefect-{first['flow_run_id']}"] == "completed"
    assert runs[f"prefect-{second['flow_run_id']}"] == "completed"
    # Every hit ends "Cached" in Prefect, the direct call's included (it still returned the value).
    names = poll(
        lambda: sorted(t["state"]["name"] for t in task_runs_of(prefect_api, second["flow_run_id"])),
        lambda v: len(v) == 5 and "Running" not in v and "Pending" not in v,
    )
    assert names == ["Cached"] * 5


def test_the_key_follows_the_bytes_of_declared_reads_not_the_arguments_alone(ws: Path) -> None:
    @flow(persist_result=False)
    def once() -> dict:
        return clean(1)

    assert once() == {"chars": 3}
    (ws / "data/raw.txt").write_text("abcd")  # same argument, different bytes: a new key
    assert once() == {"chars": 4}
    (ws / "data/raw.txt").write_text("abc")  # the original bytes again: served, not rebuilt
    assert once() == {"chars": 3}
    assert CALLS["clean"] == 2
    assert (ws / "data/clean.txt").read_text() == "ABC"


def test_an_argument_without_a_key_is_key_uncomputable_naming_it_before_anything_is_written(ws: Path) -> None:
    @flow(persist_result=False)
    def bad() -> int:
        return add(complex(1, 2), 3)  # no codec keys a complex number: no key can be computed

    with pytest.raises(CacheError) as err:
        bad()
    assert err.value.code == "key_uncomputable"
    assert err.value.details["argument"] == "a"
    assert "'a'" in err.value.message
    assert CALLS == {}  # the body never ran
    rt = current_spec().open()
    assert all(e.type != "step-settled" for r in rt.runs.list() for e in rt.journal.read(r.run_id))


def test_prefect_retries_run_the_step_again_as_a_new_attempt(ws: Path) -> None:
    @flow(persist_result=False)
    def retried() -> dict:
        from prefect.runtime import flow_run

        return {"value": flaky(21), "flow_run_id": str(flow_run.id)}

    out = retried()
    assert out["value"] == 42 and CALLS["flaky"] == 2
    records = _settled(ws, out["flow_run_id"])
    assert [(r["attempt"], r["outcome"]) for r in records] == [(1, "failed"), (2, "built")]
    assert "first attempt fails" in records[0]["error"]


def test_an_undeclared_write_fails_the_step_and_nothing_leaks_into_the_workspace(ws: Path) -> None:
    @flow(persist_result=False)
    def leak() -> int:
        return sneaky()

    with pytest.raises(BoundaryRefusal):
        leak()
    assert not (ws / "undeclared.txt").exists()
    assert not (ws / "declared.txt").exists()  # a refused step copies nothing back


def test_a_step_called_outside_any_flow_is_its_own_settled_run(ws: Path) -> None:
    assert add(5) == 15
    assert add(5) == 15
    assert CALLS["add"] == 1
    rt = current_spec().open()
    standalone = [r for r in rt.runs.list() if r.run_id.startswith("step-")]
    assert len(standalone) == 2 and {r.status for r in standalone} == {"completed"}
    outcomes = [
        e.payload["outcome"]
        for r in standalone
        for e in rt.journal.read(r.run_id)
        if e.type == "step-settled"
    ]
    assert sorted(outcomes) == ["built", "clean"]


def test_prefect_caching_options_are_refused_when_decorating() -> None:
    with pytest.raises(CacheError) as err:

        @sp.step(persist_result=True)
        def nope() -> int:
            return 1

    assert err.value.code == "invalid_declaration"
    with pytest.raises(CacheError) as bad:

        @sp.step(writes=["../outside.txt"])
        def escape() -> int:
            return 1

    assert bad.value.code == "invalid_declaration"


def test_step_settled_records_are_plain_json(ws: Path) -> None:
    @flow(persist_result=False)
    def one() -> str:
        from prefect.runtime import flow_run

        add(1)
        return str(flow_run.id)

    rid = one()
    (record,) = _settled(ws, rid)
    assert json.loads(json.dumps(record)) == record
    assert record["step"].endswith(":add") and record["dispatch_key"].startswith("key1_")


def test_with_options_keeps_a_step_and_refuses_caching_options() -> None:
    patient = add.with_options(retries=2, name="add-patiently")
    assert isinstance(patient, sp.Step) and patient.retries == 2
    assert patient.name == "add-patiently" and patient.step_spec.identity == add.step_spec.identity
    with pytest.raises(CacheError) as err:
        add.with_options(cache_policy=None)
    assert err.value.code == "invalid_declaration"


def test_the_declared_environment_is_part_of_the_key(ws: Path) -> None:
    def triple(x: int) -> int:
        CALLS["triple"] = CALLS.get("triple", 0) + 1
        return 3 * x

    on_a = sp.step(triple, environment={"gpu": "a100"})
    on_b = sp.step(triple, environment={"gpu": "h100"})
    assert on_a(2) == on_b(2) == 6
    assert on_a(2) == 6
    assert CALLS["triple"] == 2  # two environments, two builds; the repeat was a hit
