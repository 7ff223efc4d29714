"""PlanScheduler.run on real parts: outcomes, cones, reports, journal records, replay, deferral, refusals."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from sched_support import Env, make_env

import smthrs_plugin as sp
from smthrs_plugin.boundary.measure import Measurer
from smthrs_plugin.errors import GraphError, SchedulerError, SettingsError
from smthrs_plugin.plan import ABSENT
from smthrs_plugin.plan.keys import dispatch_key
from smthrs_plugin.scheduler import InlineHost, NodeInput, ThreadHost


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


def _value(ni: NodeInput) -> Any:
    body = ni.node.draft.material.body
    if isinstance(body, dict) and body.get("fail"):
        raise RuntimeError(f"{ni.id} failed on purpose")
    return {"id": ni.id, "inputs": list(ni.inputs)}


def _diamond() -> sp.plan.Plan:
    return sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("a", body={"n": "a"}),
            sp.plan.node("b", body={"n": "b", "fail": True}, inputs=[sp.plan.Ref("a", path=["id"])]),
            sp.plan.node("c", body={"n": "c"}, inputs=[sp.plan.Ref("a", path=["id"])]),
            sp.plan.node("d", body={"n": "d"}, inputs=[sp.plan.Ref("b"), sp.plan.Ref("c")]),
            sp.plan.node("e", body={"n": "e"}, inputs=[sp.plan.Pending("c")]),
        ],
    )


def test_a_failed_node_skips_only_its_cone_and_siblings_keep_running(env: Env) -> None:
    report = env.scheduler().run(_diamond(), _value)
    assert report.outcomes == {"a": "built", "b": "failed", "c": "built", "d": "skipped", "e": "built"}
    assert report.settlement("b").error == "RuntimeError: b failed on purpose"
    assert report.results == {
        "a": {"id": "a", "inputs": []},
        "c": {"id": "c", "inputs": ["a"]},
        "e": {"id": "e", "inputs": []},
    }
    assert report.failed and not report.passed and report.debt == ()


def test_report_lists_plan_order_with_plan_and_dispatch_keys(env: Env) -> None:
    plan = _diamond()
    report = env.scheduler().run(plan, _value)
    assert [s.node for s in report.settlements] == [n.id for n in plan.nodes]
    assert report.plan_id == "p" and report.digest == plan.digest
    a = report.settlement("a")
    assert a.plan_key == plan.node("a").key
    assert a.dispatch_key == dispatch_key(
        plan.node("a").draft, ref_values={}, read_set=[], environment=ABSENT
    )
    assert (a.attempts, a.rebases, a.cache_decision) == (1, 0, "Miss")
    d = report.settlement("d")
    assert (d.dispatch_key, d.attempts, d.cache_decision) == (None, 0, None)
    assert report.to_json()["settlements"][0] == {
        "node": "a",
        "outcome": "built",
        "plan_key": a.plan_key,
        "dispatch_key": a.dispatch_key,
        "attempts": 1,
        "rebases": 0,
        "cache_decision": "Miss",
    }


def test_every_settlement_is_journaled_once_with_its_attempt_row(env: Env) -> None:
    report = env.scheduler().run(_diamond(), _value)
    settled = [p for t, p in env.records(types=("node-settled",))]
    assert [p["node_id"] for p in settled] == ["a", "b", "c", "d", "e"]
    by_node = {p["node_id"]: p for p in settled}
    for s in report.settlements:
        p = by_node[s.node]
        assert (p["outcome"], p["plan_key"], p.get("dispatch_key"), p["attempts"], p["rebases"]) == (
            s.outcome,
            s.plan_key,
            s.dispatch_key,
            s.attempts,
            s.rebases,
        )
    assert "dispatch_key" not in by_node["d"]  # never dispatched: absent, not null
    rows = {r["node_id"]: r for r in env.attempt_rows()}
    assert set(rows) == {"a", "b", "c", "e"}
    assert rows["a"]["state"] == "completed" and rows["a"]["result"] == {"id": "a", "inputs": []}
    assert rows["b"]["state"] == "failed" and rows["b"]["error"]["message"] == "b failed on purpose"
    # The attempt's settlement records sit right after its node-scheduled record, in one transaction.
    types = [t for t, _ in env.records(types=("node-scheduled", "attempt-finished", "node-settled"))]
    assert types[:3] == ["node-scheduled", "attempt-finished", "node-settled"]


def test_a_second_pass_replays_settled_nodes_clean_without_the_executor(env: Env) -> None:
    calls: list[str] = []

    def executor(ni: NodeInput) -> Any:
        calls.append(ni.id)
        return _value(ni)

    sched = env.scheduler()
    first = sched.run(_diamond(), executor)
    calls.clear()
    again = sched.run(_diamond(), executor)
    assert calls == ["b"]  # only the failed node runs again (a resume is a retry)
    assert again.outcomes == {"a": "clean", "b": "failed", "c": "clean", "d": "skipped", "e": "clean"}
    assert again.results == first.results
    assert [s.dispatch_key for s in again.settlements] == [s.dispatch_key for s in first.settlements]
    assert again.settlement("a").cache_decision == "VerifiedHit"


def test_an_invalid_plan_is_refused_before_anything_is_written(env: Env) -> None:
    plan = _diamond()
    tampered = plan.model_copy(update={"digest": "key1_" + "0" * 64})
    sched = env.scheduler()
    before = env.records()
    with pytest.raises(SchedulerError) as err:
        sched.run(tampered, _value)
    assert err.value.code == "invalid_plan"
    with pytest.raises(SchedulerError) as err2:
        sched.record(tampered)
    assert err2.value.code == "invalid_plan"
    assert env.records() == before and env.attempt_rows() == [] and env.records("plan:p") == []


def test_a_deferred_sink_never_dispatches_writes_no_cache_row_and_is_debt(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("a", body=1),
            sp.plan.node("sink", body=2, inputs=[sp.plan.Ref("a")]),
            sp.plan.node("other", body=3),
        ],
    )
    calls: list[str] = []

    def executor(ni: NodeInput) -> Any:
        calls.append(ni.id)
        return ni.id

    report = env.scheduler().run(plan, executor, defer=["sink"])
    assert report.outcomes == {"a": "built", "sink": "deferred", "other": "built"}
    assert "sink" not in calls and report.debt == ("sink",) and not report.passed and not report.failed
    assert len(env.cache_keys()) == 2
    assert not any(r["node_id"] == "sink" for r in env.attempt_rows())


def test_a_selected_sink_in_a_failed_cone_is_skipped_not_debt(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [sp.plan.node("a", body={"fail": True}), sp.plan.node("s", body=1, inputs=[sp.plan.Ref("a")])],
    )
    report = env.scheduler().run(plan, _value, defer=["s"])
    assert report.outcomes == {"a": "failed", "s": "skipped"} and report.debt == ()


def test_deferring_a_non_sink_or_an_unknown_node_is_refused(env: Env) -> None:
    sched = env.scheduler()
    for bad in (["a"], ["nope"]):
        with pytest.raises(SchedulerError) as err:
            sched.run(_diamond(), _value, defer=bad)
        assert err.value.code == "invalid_plan"


def test_invalid_options_are_refused_at_construction(env: Env) -> None:
    with pytest.raises(GraphError) as err:
        env.scheduler(concurrency={"steps": 0})
    assert err.value.code == "invalid_concurrency"
    with pytest.raises(GraphError):
        env.scheduler(concurrency={"agents": -1})
    with pytest.raises(SettingsError):
        env.scheduler(rebase_limit=-1)


def test_a_value_that_is_not_plain_json_fails_the_node_not_the_run(env: Env) -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1), sp.plan.node("b", body=2)])
    report = env.scheduler().run(plan, lambda ni: {1, 2} if ni.id == "a" else "ok")
    assert report.outcomes == {"a": "failed", "b": "built"}
    assert "not plain JSON" in (report.settlement("a").error or "")


def test_reopening_with_another_environment_plan_or_base_is_refused_before_execution(env: Env) -> None:
    plan = _diamond()
    env.scheduler(environment={"python": "3.11"}).run(plan, _value)
    before = (env.records(), env.attempt_rows())
    calls: list[str] = []

    def executor(ni: NodeInput) -> Any:
        calls.append(ni.id)
        return 1

    other_base = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body={"n": "changed"})])
    other_id = sp.plan.compile_plan("q", "f", [sp.plan.node("a", body={"n": "a"})])
    for sched, p in (
        (env.scheduler(environment={"python": "3.12"}), plan),
        (env.scheduler(), plan),  # omission is its own identity, not a wildcard
        (env.scheduler(environment={"python": "3.11"}), other_base),
        (env.scheduler(environment={"python": "3.11"}), other_id),
    ):
        with pytest.raises(SchedulerError) as err:
            sched.run(p, executor)
        assert err.value.code == "invalid_plan"
    assert calls == [] and (env.records(), env.attempt_rows()) == before


def test_equivalent_capability_sets_recover_but_layer_order_matters(env: Env) -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1)])
    env.scheduler(environment={"capabilities": {"net": ["b", "a"]}, "layers": ["x", "y"]}).run(plan, _value)
    ok = env.scheduler(environment={"capabilities": {"net": ["a", "b", "a"]}, "layers": ["x", "y"]}).run(
        plan, _value
    )
    assert ok.outcomes == {"a": "clean"}
    with pytest.raises(SchedulerError):
        env.scheduler(environment={"capabilities": {"net": ["a", "b"]}, "layers": ["y", "x"]}).run(
            plan, _value
        )


def test_source_pins_are_restored_on_reopen_without_remeasuring_or_reexpanding_globs(env: Env) -> None:
    (env.ws / "src").mkdir()
    (env.ws / "src" / "one.txt").write_text("1")
    (env.ws / "cfg.txt").write_text("v1")
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1, reads=["src/*.txt", "cfg.txt"])])
    hashed: list[str] = []

    def counting(f: Any) -> str:
        hashed.append(os.readlink(f"/proc/self/fd/{f.fileno()}"))
        from smthrs_plugin.boundary.measure import sha256_file

        return sha256_file(f)

    measurer = Measurer(env.ws, stat_cache=None, hash_file=counting)
    first = env.scheduler(measurer=measurer).run(plan, _value)
    assert sorted(Path(h).name for h in hashed) == ["cfg.txt", "one.txt"]
    hashed.clear()
    (env.ws / "src" / "two.txt").write_text("2")  # a new glob member
    (env.ws / "cfg.txt").write_text("v2")  # a changed source
    again = env.scheduler(measurer=Measurer(env.ws, stat_cache=None, hash_file=counting)).run(plan, _value)
    assert hashed == []  # nothing measured, nothing expanded: the pins were restored
    assert again.settlement("a").dispatch_key == first.settlement("a").dispatch_key
    assert again.outcomes == {"a": "clean"}
    # A NEW run observes the current inputs.
    fresh = env.scheduler("r2", measurer=Measurer(env.ws, stat_cache=None)).run(plan, _value)
    assert fresh.settlement("a").dispatch_key != first.settlement("a").dispatch_key


def test_a_source_that_cannot_be_measured_is_boundary_unavailable_before_any_attempt(env: Env) -> None:
    os.mkfifo(env.ws / "fifo")
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1, reads=["fifo"])])
    with pytest.raises(SchedulerError) as err:
        env.scheduler().run(plan, _value)
    assert err.value.code == "boundary_unavailable" and err.value.cause is not None
    assert env.attempt_rows() == [] and env.records(types=("inputs-observed",)) == []


class _Sabotage:
    """An inline host that breaks things around chosen jobs (the scheduler must stay typed and tidy)."""

    def __init__(self, env: Env, *, lose: str = "", after: dict[str, Any] | None = None) -> None:
        self.inline = InlineHost()
        self.lose = lose
        self.after = after or {}

    def submit(self, job: Any) -> Future[Any]:
        node = job.spec.node_id
        if node == self.lose:
            fut: Future[Any] = Future()
            fut.set_exception(RuntimeError("the host lost this job"))
            return fut
        fut = self.inline.submit(job)
        if node in self.after:
            self.after[node]()
        return fut

    def close(self) -> None:
        pass


def test_a_produced_input_that_cannot_be_measured_is_boundary_unavailable_with_its_cause(env: Env) -> None:
    plan = sp.plan.compile_plan(
        "p",
        "f",
        [
            sp.plan.node("w", body=1, writes=["out.txt"]),
            sp.plan.node("r", body=2, reads=["out.txt"]),
        ],
    )

    def escape() -> None:
        os.replace(env.ws / "out.txt", env.root / "outside.txt")
        os.symlink(env.root / "outside.txt", env.ws / "out.txt")

    def executor(ni: NodeInput) -> Any:
        if ni.id == "w":
            (ni.root / "out.txt").write_text("x")
        return ni.id

    with pytest.raises(SchedulerError) as err:
        env.scheduler(host=_Sabotage(env, after={"w": escape})).run(plan, executor)
    assert err.value.code == "boundary_unavailable"
    assert getattr(err.value.cause, "code", None) == "invalid_path"
    assert not any(r["node_id"] == "r" for r in env.attempt_rows())


def test_a_scheduler_failure_marks_its_unsettled_attempts_failed(env: Env) -> None:
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("a", body=1), sp.plan.node("b", body=2)])
    with pytest.raises(RuntimeError, match="lost this job"):
        env.scheduler(host=_Sabotage(env, lose="a")).run(plan, _value)
    rows = {r["node_id"]: r for r in env.attempt_rows()}
    assert rows["a"]["state"] == "failed" and rows["a"]["error"]["type"] == "interrupted"
    assert rows["b"]["state"] == "completed"
    finished = [p for t, p in env.records(types=("attempt-finished",))]
    assert sorted((p["node_id"], p["outcome"]) for p in finished) == [("a", "failed"), ("b", "built")]


def test_record_and_append_persist_generations_and_journal_them(env: Env) -> None:
    sched = env.scheduler()
    base = _diamond()
    first = sched.record(base)
    assert (type(first).__name__, first.generation) == ("Recorded", 0)
    assert type(sched.record(base)).__name__ == "AlreadyRecorded"
    grown = sp.plan.append_plan(base, [sp.plan.node("f", body=1, inputs=[sp.plan.Pending("e")])])
    appended = sched.append(grown)
    assert (type(appended).__name__, appended.digest, appended.generation) == ("Recorded", grown.digest, 1)
    records = env.records("plan:p")
    assert [t for t, _ in records] == ["plan-recorded", "subgraph-appended"]
    assert records[0][1]["graph"] == {"nodes": [{"id": n.id, "tag": "step"} for n in base.nodes]}
    assert records[0][1]["nodes"] == 5 and records[1][1]["graph"] == {"nodes": [{"id": "f", "tag": "step"}]}
    assert sched.plans.load("p", grown.digest) == grown
    orphan = sp.plan.append_plan(
        sp.plan.compile_plan("p2", "f", [sp.plan.node("x", body=1)]), [sp.plan.node("y", body=2)]
    )
    with pytest.raises(SchedulerError) as err:
        sched.append(orphan)
    assert err.value.code == "invalid_plan"


def test_a_thread_host_runs_independent_nodes_concurrently(env: Env) -> None:
    barrier = threading.Barrier(3, timeout=120)
    plan = sp.plan.compile_plan("p", "f", [sp.plan.node(f"n{i}", body=i) for i in range(3)])

    def executor(ni: NodeInput) -> Any:
        barrier.wait()  # all three must be running at once, or this times out
        return ni.id

    sched = env.scheduler(host=ThreadHost(4))
    try:
        report = sched.run(plan, executor)
    finally:
        sched.host.close()
    assert set(report.outcomes.values()) == {"built"}


def test_the_same_run_behaves_identically_on_every_sql_backend(tmp_path: Path, db_url: str) -> None:
    env = make_env(tmp_path, db_url=db_url)
    first = env.scheduler().run(_diamond(), _value)
    assert first.outcomes == {"a": "built", "b": "failed", "c": "built", "d": "skipped", "e": "built"}
    again = env.scheduler().run(_diamond(), _value)
    assert again.outcomes == {"a": "clean", "b": "failed", "c": "clean", "d": "skipped", "e": "clean"}
    settled = [p["node_id"] for t, p in env.records(types=("node-settled",))]
    assert sorted(settled[:5]) == sorted(settled[5:]) == ["a", "b", "c", "d", "e"]
    with pytest.raises(SchedulerError) as err:
        env.scheduler(environment={"changed": True}).run(_diamond(), _value)
    assert err.value.code == "invalid_plan"
