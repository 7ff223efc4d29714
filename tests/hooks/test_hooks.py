"""Plugins (pluggy project ``smthrs``): built-ins, overrides through ``open_runtime``, observers, plan actions,
loud loading failures, and ``smthrs plugins``. Real plans on a real SQLite runtime; no Prefect server needed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin.control.authority import DEFAULT_AUTHORITY
from smthrs_plugin.engine.ownership.liveness import LeaseLiveness, SameHostPidProbe
from smthrs_plugin.engine.waits.flow_waits import HostNotParked, HostWakeFailed, HostWoken, host_wake_json
from smthrs_plugin.errors import PlanError, PluginError
from smthrs_plugin.hooks import (
    Authorized,
    Principal,
    Unauthorized,
    hookimpl,
    new_plugins,
)
from smthrs_plugin.records.wait_rows import Completed
from smthrs_plugin.scheduler.host import ThreadHost
from smthrs_plugin.scheduler.planfile import read_plan_file
from smthrs_plugin.scheduler.reconcile import DefaultReconciler, Fail
from smthrs_plugin.settings import load_settings


def upper(ni: sp.NodeInput) -> dict:
    text = (ni.root / "in.txt").read_text()
    (ni.root / f"{ni.id}.txt").write_text(text.upper())
    return {"n": len(text)}


def two_nodes() -> sp.plan.Plan:
    return sp.plan.compile_plan(
        "p",
        "tests/hooks",
        [
            sp.plan.node("a", body={"x": 1}, reads=["in.txt"], writes=["a.txt"]),
            sp.plan.node("b", body={"x": 2}, reads=["in.txt"], writes=["b.txt"]),
        ],
    )


class Recorder:
    """A plugin observing everything and overriding the firstresult hooks."""

    def __init__(self) -> None:
        self.settled: list[tuple[str, str | None, str, str]] = []
        self.decisions: list[str] = []
        self.reports: list[tuple[str, dict[str, str]]] = []

    @hookimpl
    def smthrs_node_settled(self, run_id: str, plan_id: str | None, settlement: Any) -> None:
        self.settled.append((run_id, plan_id, settlement.node, settlement.outcome))

    @hookimpl
    def smthrs_cache_decision(self, decision: str) -> None:
        self.decisions.append(decision)

    @hookimpl
    def smthrs_run_settled(self, run_id: str, report: Any) -> None:
        self.reports.append((run_id, dict(report.outcomes)))

    @hookimpl
    def smthrs_liveness_check(self, settings: Any) -> Any:
        return SameHostPidProbe()


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "in.txt").write_text("abc")
    return tmp_path


def test_builtins_answer_when_no_plugin_does() -> None:
    plugins = new_plugins(entry_points=False)
    s = load_settings()
    assert isinstance(plugins.reconciler(s), DefaultReconciler)
    assert isinstance(plugins.liveness(s), LeaseLiveness)
    assert plugins.approval_authority(s) is DEFAULT_AUTHORITY
    assert plugins.actions() == {} and plugins.runtime_defaults(s) == {} and plugins.host_providers(s) == []
    assert [i.name for i in plugins.describe()] == ["smthrs-builtin"]


def test_the_default_authority_lets_only_the_local_operator_decide() -> None:
    auth = new_plugins(entry_points=False).approval_authority(load_settings())
    assert auth is DEFAULT_AUTHORITY  # the control plane's own default, not a second copy of the policy
    assert auth.authorize(Principal("local", "operator"), "approve", "plan-1") == Authorized(
        Principal("local", "operator")
    )
    refused = auth.authorize(Principal("alice", "user"), "deny", "plan-1")
    assert isinstance(refused, Unauthorized) and refused.reason


def test_a_registered_plugin_overrides_liveness_and_hears_every_settlement_and_decision(ws: Path) -> None:
    rec = Recorder()
    plugins = new_plugins(entry_points=False, extra=[rec])
    with sp.open_runtime(ws, plugins=plugins) as rt:
        assert isinstance(rt.ownership.liveness, SameHostPidProbe)  # the plugin's answer was wired in
        first = rt.scheduler("r1").run(two_nodes(), upper)
        second = rt.scheduler("r2").run(two_nodes(), upper)
    assert set(first.outcomes.values()) == {"built"} and set(second.outcomes.values()) == {"clean"}
    assert rec.settled == [
        ("r1", "p", "a", "built"),
        ("r1", "p", "b", "built"),
        ("r2", "p", "a", "clean"),
        ("r2", "p", "b", "clean"),
    ]
    assert rec.decisions == ["Miss", "Miss", "VerifiedHit", "VerifiedHit"]
    assert rec.reports == [("r1", {"a": "built", "b": "built"}), ("r2", {"a": "clean", "b": "clean"})]


def test_an_observer_that_raises_never_changes_the_outcome(
    ws: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        @hookimpl
        def smthrs_node_settled(self, run_id: str, plan_id: str | None, settlement: Any) -> None:
            raise RuntimeError("observer bug")

    caplog.set_level(logging.ERROR, logger="smthrs_plugin.hooks.manager")  # whatever Prefect did to the root
    rec = Recorder()
    plugins = new_plugins(entry_points=False, extra=[Broken(), rec])
    with sp.open_runtime(ws, plugins=plugins) as rt:
        report = rt.scheduler("r1").run(two_nodes(), upper)
        assert rt.runs.get("r1").status == "completed"  # type: ignore[union-attr]
    assert set(report.outcomes.values()) == {"built"}
    assert len(rec.settled) == 2  # the other observer still heard everything
    assert "observer bug" in caplog.text


def test_a_plugin_reconciler_judges_deviations(ws: Path) -> None:
    class Strict:
        @hookimpl
        def smthrs_reconciler(self, settings: Any) -> Any:
            class FailAll:
                def judge(self, case: Any, context: Any) -> Any:
                    return Fail(
                        case.node if hasattr(case, "node") else "?", "strict plugin refuses deviations"
                    )

            return FailAll()

    def sloppy(ni: sp.NodeInput) -> dict:
        (ni.root / "a.txt").write_text("x")  # declared write missing: b.txt (expected mode records it)
        return {}

    plan = sp.plan.compile_plan(
        "dev", "tests/hooks", [sp.plan.node("a", body={}, writes=["a.txt", "extra.txt"], boundary="expected")]
    )
    with sp.open_runtime(ws, plugins=new_plugins(entry_points=False, extra=[Strict()])) as rt:
        report = rt.scheduler("r1").run(plan, sloppy)
    assert report.outcomes == {"a": "failed"}
    assert [(v.tag, getattr(v, "reason", None)) for v in report.verdicts] == [
        ("Fail", "strict plugin refuses deviations")
    ]


def test_runtime_defaults_fold_a_plugin_environment_into_dispatch_keys(ws: Path) -> None:
    class Env:
        def __init__(self, version: str) -> None:
            self.version = version

        @hookimpl
        def smthrs_runtime_defaults(self, settings: Any) -> dict:
            return {"environment": {"toolchain": self.version}}

    keys = []
    for version in ("1", "2", "1"):
        with sp.open_runtime(ws, plugins=new_plugins(entry_points=False, extra=[Env(version)])) as rt:
            report = rt.scheduler(f"env-{len(keys)}").run(two_nodes(), upper)
        keys.append(report.settlement("a").dispatch_key)
        if len(keys) == 3:
            assert report.settlement("a").outcome == "clean"  # environment 1 again: served
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_an_unknown_runtime_default_is_refused() -> None:
    class Bad:
        @hookimpl
        def smthrs_runtime_defaults(self, settings: Any) -> dict:
            return {"colour": "blue"}

    with pytest.raises(PluginError) as err:
        new_plugins(entry_points=False, extra=[Bad()]).runtime_defaults(load_settings())
    assert err.value.code == "invalid_default" and "colour" in err.value.message


def test_two_plugins_claiming_one_action_name_is_refused_naming_both() -> None:
    class One:
        @hookimpl
        def smthrs_plan_actions(self) -> dict:
            return {"ship": upper}

    class Two:
        @hookimpl
        def smthrs_plan_actions(self) -> dict:
            return {"ship": upper}

    plugins = new_plugins(entry_points=False)
    plugins.register(One(), "one")
    plugins.register(Two(), "two")
    with pytest.raises(PluginError) as err:
        plugins.actions()
    assert (
        err.value.code == "duplicate_action" and "'one'" in err.value.message and "'two'" in err.value.message
    )


def test_a_hookimpl_that_does_not_match_its_spec_is_invalid_plugin() -> None:
    class Wrong:
        @hookimpl
        def smthrs_node_settled(self, run_id: str, nonsense: int) -> None: ...

    with pytest.raises(PluginError) as err:
        new_plugins(entry_points=False, extra=[Wrong()])
    assert err.value.code == "invalid_plugin"


def test_a_broken_installed_entry_point_fails_loudly_naming_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "brokenplug-0.1.dist-info"  # what an installer leaves behind
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[smthrs]\nbroken = smthrs_no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as err:
        new_plugins()
    assert err.value.code == "load_failed"
    assert err.value.details["distribution"] == "brokenplug" and "broken" in err.value.message
    assert [i.name for i in new_plugins(block=["broken"]).describe()][:1] == ["smthrs-builtin"]


def test_plan_files_call_plugin_actions_by_name_and_refuse_unknown_names_at_their_line(ws: Path) -> None:
    def shout(ni: sp.NodeInput, text: str = "") -> dict:
        (ni.root / "out.txt").write_text(text.upper())
        return {"n": len(text)}

    class Actions:
        @hookimpl
        def smthrs_plan_actions(self) -> dict:
            return {"shout": shout}

    (ws / "plan.yaml").write_text(
        "plan: acts\nflow: tests/acts\nnodes:\n  - id: s\n    call: shout\n    with: {text: hi}\n    writes: [out.txt]\n"
    )
    with sp.open_runtime(ws, plugins=new_plugins(entry_points=False, extra=[Actions()])) as rt:
        pf = read_plan_file(ws / "plan.yaml", actions=rt.actions)
        report = rt.scheduler("a1").run(pf.plan, pf.executor)
    assert report.outcomes == {"s": "built"} and (ws / "out.txt").read_text() == "HI"
    with pytest.raises(PlanError) as err:
        read_plan_file(ws / "plan.yaml", actions={})
    assert err.value.code == "invalid_plan_file" and err.value.details["line"] == 5
    assert "no plan action named 'shout'" in err.value.message


def test_outside_a_flow_run_the_runtime_keeps_the_local_thread_pool(ws: Path) -> None:
    with sp.open_runtime(ws) as rt:  # the process-wide plugins: built-ins + this distribution's Prefect host
        assert [p.name for p in rt.plugins.host_providers(rt.settings)] == ["prefect"]
        sched = rt.scheduler("local-1")
        assert isinstance(sched.host, ThreadHost)


def test_smthrs_plugins_lists_what_loaded_and_from_where() -> None:
    from smthrs_plugin.cli import app

    out = CliRunner().invoke(app, ["plugins", "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    by_name = {p["name"]: p for p in info["plugins"]}
    assert by_name["smthrs-builtin"]["source"] == "builtin"
    assert by_name["prefect"]["distribution"] == "smthrs-plugin"
    assert set(by_name["prefect"]["hooks"]) == {
        "smthrs_hosts",
        "smthrs_run_settled",
        "smthrs_run_waker",
        "smthrs_approval_decided",
    }
    assert info["hosts"] == ["prefect"]
    text = CliRunner().invoke(app, ["plugins"])
    assert text.exit_code == 0 and "local (default)" in text.output


# -- run wakers (smthrs_run_waker): a host that continues parked runs on its own is told after each commit -----


class WakeRecorder:
    """A host plugin that continues parked runs itself: records each run it is told about, with the run's journal
    record types AS IT READ THEM (what had committed when it was called)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.told: list[tuple[str, list[str]]] = []
        self.fail = fail

    @hookimpl
    def smthrs_run_waker(self, settings: Any) -> Any:
        return self.wake

    def wake(self, run_id: str, journal: Any) -> Any:
        self.told.append((run_id, [e.type for e in journal.read(run_id, limit=500)]))
        if self.fail is not None:
            raise self.fail
        return HostWoken(run_id, "test-host", f"told {run_id}")


def _run_with_request(rt: Any, run_id: str, request: str) -> Any:
    rt.runs.create(run_id, "tests/waker")
    control = rt.control()
    control.approvals.register(run_id, request)
    return control


def test_a_run_waker_is_told_after_each_applied_decision_signal_and_cancellation_commits(ws: Path) -> None:
    rec = WakeRecorder()
    plugins = new_plugins(entry_points=False, extra=[rec])
    with sp.open_runtime(ws, plugins=plugins) as rt:
        control = _run_with_request(rt, "w1", "deploy")
        assert control.last_host_wake() is None
        assert isinstance(control.approve(control.pending_requests("w1")[0]), sp.control.Accepted)
        assert rec.told[-1][0] == "w1" and "control.approval.approved" in rec.told[-1][1]  # after the commit
        assert control.last_host_wake() == HostWoken("w1", "test-host", "told w1")
        assert isinstance(control.signal("w1", "go", {"n": 1}), sp.control.Accepted)
        assert "control.signal.delivered" in rec.told[-1][1]
        # A retry of the same signal replays its receipt and asks the host again (it may have been unreachable).
        assert isinstance(control.signal("w1", "go", {"n": 1}), sp.control.AlreadyApplied)
        assert len(rec.told) == 3
        done = sp.complete("w1", "other", 2, db=rt.db, waker=plugins.host_waker(rt.settings))
        assert isinstance(done, Completed) and "deferred-completed" in rec.told[-1][1]
        assert isinstance(control.cancel("w1"), sp.control.Accepted)
        assert "control.run.cancel-requested" in rec.told[-1][1]
        assert len(rec.told) == 5
        # Refused or settled: nothing changed, nobody is told.
        assert (
            isinstance(control.signal("w1", "late", 1), sp.control.Terminal)
            and control.last_host_wake() is None
        )
        assert len(rec.told) == 5


def test_a_failing_run_waker_is_reported_and_logged_while_the_decision_stands(
    ws: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="smthrs_plugin.engine.waits.flow_waits")
    rec = WakeRecorder(fail=ConnectionError("prefect is down"))
    plugins = new_plugins(entry_points=False, extra=[rec])
    with sp.open_runtime(ws, plugins=plugins) as rt:
        control = _run_with_request(rt, "w2", "deploy")
        assert isinstance(control.approve(control.pending_requests("w2")[0]), sp.control.Accepted)
        wake = control.last_host_wake()
        assert isinstance(wake, HostWakeFailed) and isinstance(wake.cause, ConnectionError)
        assert "prefect is down" in wake.detail and wake.host.startswith("WakeRecorder")
        assert control.pending_requests("w2") == []  # the decision is durable whatever the host said
    assert "could not be told" in caplog.text and "prefect is down" in caplog.text


def test_a_run_waker_that_is_not_callable_is_invalid_plugin() -> None:
    class Bad:
        @hookimpl
        def smthrs_run_waker(self, settings: Any) -> Any:
            return "not a waker"

    with pytest.raises(PluginError) as err:
        new_plugins(entry_points=False, extra=[Bad()]).host_waker(load_settings())
    assert err.value.code == "invalid_plugin" and "smthrs_run_waker" in err.value.message
    assert new_plugins(entry_points=False).host_waker(load_settings()) is None  # no host: nobody to tell


def test_the_prefect_waker_leaves_a_run_without_a_deployment_flow_run_to_a_worker(ws: Path) -> None:
    with sp.open_runtime(ws) as rt:  # the process-wide plugins: the Prefect host's waker
        rt.runs.create("w3", "tests/waker")
        wake = rt.plugins.host_waker(rt.settings)(  # type: ignore[misc]
            "w3", rt.journal
        )
    assert isinstance(wake, HostNotParked) and wake.host is None and "smthrs worker" in wake.detail


def test_a_host_wake_answers_plain_json_without_its_cause() -> None:
    failed = HostWakeFailed("r", "prefect", "server down", ConnectionError("refused"))
    assert host_wake_json(failed) == {
        "type": "HostWakeFailed",
        "run_id": "r",
        "host": "prefect",
        "detail": "server down",
    }
    assert host_wake_json(HostNotParked("r", None, "no host"))["host"] is None  # type: ignore[index]
    assert host_wake_json(None) is None
