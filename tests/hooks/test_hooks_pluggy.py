"""Hooks are called through pluggy's own caller: a plugin written as pluggy documents it —
hook wrappers (``wrapper=True`` and old-style ``hookwrapper=True``), ``tryfirst``, ``firstresult``, hook-call
monitoring and tracing — behaves as documented, while an invalid answer is still a typed ``PluginError`` naming
its plugin and a raising observer never silences the others. Real plugin managers, real SQLite runtimes."""

from __future__ import annotations

import logging
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pluggy
import pytest

import smthrs_plugin as sp
from smthrs_plugin.engine.ownership.liveness import LeaseLiveness, SameHostPidProbe
from smthrs_plugin.errors import PluginError
from smthrs_plugin.hooks import hookimpl, new_plugins
from smthrs_plugin.scheduler.planfile import read_plan_file
from smthrs_plugin.settings import load_settings


def upper(ni: sp.NodeInput) -> dict:
    text = (ni.root / "in.txt").read_text()
    (ni.root / f"{ni.id}.txt").write_text(text.upper())
    return {"n": len(text)}


def two_nodes() -> Any:
    return sp.plan.compile_plan(
        "p",
        "tests/hooks-pluggy",
        [
            sp.plan.node("a", body={"x": 1}, reads=["in.txt"], writes=["a.txt"]),
            sp.plan.node("b", body={"x": 2}, reads=["in.txt"], writes=["b.txt"]),
        ],
    )


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "in.txt").write_text("abc")
    return tmp_path


class CountingLiveness:
    """A liveness check that wraps another one (what a wrapper plugin hands back)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def check(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.check(*args, **kwargs)


# -- hook wrappers -----------------------------------------------------------------------------------------------


def test_a_wrapper_plugin_sees_the_winning_answer_and_its_replacement_is_wired_into_the_runtime(
    ws: Path,
) -> None:
    seen: list[Any] = []

    class Wrapping:
        @hookimpl(wrapper=True)
        def smthrs_liveness_check(self, settings: Any) -> Generator[None, Any, Any]:
            answer = yield
            seen.append(answer)
            return CountingLiveness(answer)

    with sp.open_runtime(workspace=ws, plugins=new_plugins(entry_points=False, extra=[Wrapping()])) as rt:
        assert isinstance(rt.ownership.liveness, CountingLiveness)
        assert isinstance(
            rt.ownership.liveness.inner, LeaseLiveness
        )  # the built-in's answer, seen and wrapped
        report = rt.scheduler("w1").run(two_nodes(), upper)
    assert [type(a) for a in seen] == [LeaseLiveness] and set(report.outcomes.values()) == {"built"}


def test_a_wrapper_plugin_renames_a_plan_action_and_the_plan_file_runs_the_new_name(ws: Path) -> None:
    def shout(ni: sp.NodeInput, text: str = "") -> dict:
        (ni.root / "out.txt").write_text(text.upper())
        return {"n": len(text)}

    class Actions:
        @hookimpl
        def smthrs_plan_actions(self) -> dict:
            return {"shout": shout}

    class Renamer:
        @hookimpl(wrapper=True)
        def smthrs_plan_actions(self) -> Generator[None, Any, Any]:
            answers = yield
            return [{f"team.{k}": v for k, v in a.items()} for a in answers]

    plugins = new_plugins(entry_points=False)
    plugins.register(Actions(), "actions")
    plugins.register(Renamer(), "renamer")
    assert set(plugins.actions()) == {"team.shout"}
    assert plugins.action_owners() == {
        "team.shout": None
    }  # only the wrapper gives that name: no owner guessed
    (ws / "plan.yaml").write_text(
        "plan: acts\nflow: tests/acts\nnodes:\n  - id: s\n    call: team.shout\n    with: {text: hi}\n"
        "    writes: [out.txt]\n"
    )
    with sp.open_runtime(workspace=ws, plugins=plugins) as rt:
        pf = read_plan_file(ws / "plan.yaml", actions=rt.actions)
        report = rt.scheduler("a1").run(pf.plan, pf.executor)
    assert report.outcomes == {"s": "built"} and (ws / "out.txt").read_text() == "HI"


def test_an_old_style_hookwrapper_can_force_the_merged_runtime_defaults(ws: Path) -> None:
    class Env:
        @hookimpl
        def smthrs_runtime_defaults(self, settings: Any) -> dict:
            return {"environment": {"toolchain": "1"}}

    class Pin:
        @hookimpl(hookwrapper=True)
        def smthrs_runtime_defaults(self, settings: Any) -> Generator[None, Any, None]:
            outcome = yield
            outcome.force_result([*outcome.get_result(), {"environment": {"toolchain": "pinned"}}])

    plugins = new_plugins(entry_points=False, extra=[Env(), Pin()])
    # Appended last = lowest priority: the plugin's own key still wins over the wrapper's addition.
    assert plugins.runtime_defaults(load_settings()) == {"environment": {"toolchain": "1"}}
    with sp.open_runtime(workspace=ws, plugins=plugins) as rt:
        assert rt.scheduler("e1").run(two_nodes(), upper).outcomes == {"a": "built", "b": "built"}


# -- ordering and firstresult ------------------------------------------------------------------------------------


def test_tryfirst_beats_a_plugin_registered_after_it_and_the_builtin_default(ws: Path) -> None:
    class Early:
        @hookimpl(tryfirst=True)
        def smthrs_liveness_check(self, settings: Any) -> Any:
            return SameHostPidProbe()

        @hookimpl(tryfirst=True)
        def smthrs_runtime_defaults(self, settings: Any) -> dict:
            return {"environment": {"who": "early"}}

    class Late:  # registered after Early: without tryfirst it would be asked first and win
        @hookimpl
        def smthrs_liveness_check(self, settings: Any) -> Any:
            return CountingLiveness(LeaseLiveness())

        @hookimpl
        def smthrs_runtime_defaults(self, settings: Any) -> dict:
            return {"environment": {"who": "late"}}

    plugins = new_plugins(entry_points=False)
    plugins.register(Early(), "early")
    plugins.register(Late(), "late")
    assert plugins.runtime_defaults(load_settings()) == {"environment": {"who": "early"}}
    with sp.open_runtime(workspace=ws, plugins=plugins) as rt:
        assert isinstance(rt.ownership.liveness, SameHostPidProbe)
    without = new_plugins(entry_points=False)
    without.register(Late(), "late")
    assert isinstance(
        without.liveness(load_settings()), CountingLiveness
    )  # a plain plugin beats the built-in


def test_a_firstresult_hook_stops_at_the_first_answer_that_is_not_none() -> None:
    asked: list[str] = []

    def answering(name: str, answer: Any) -> object:
        class Plugin:
            @hookimpl
            def smthrs_reconciler(self, settings: Any) -> Any:
                asked.append(name)
                return answer

        return Plugin()

    class Judge:
        def judge(self, case: Any, context: Any) -> Any:
            return None

    judge = Judge()
    plugins = new_plugins(entry_points=False)
    plugins.register(answering("third", Judge()), "third")  # registered first: asked last
    plugins.register(answering("second", judge), "second")
    plugins.register(answering("first", None), "first")  # registered last: asked first, passes
    assert plugins.reconciler(load_settings()) is judge
    assert asked == ["first", "second"]  # "third" and the built-in were never called


# -- pluggy's monitoring and tracing -----------------------------------------------------------------------------


def test_hookcall_monitoring_and_tracing_see_the_runtime_s_hook_calls(ws: Path) -> None:
    settled: list[str] = []

    class Observer:
        @hookimpl
        def smthrs_node_settled(self, run_id: str, plan_id: str | None, settlement: Any) -> None:
            settled.append(settlement.node)

    plugins = new_plugins(entry_points=False, extra=[Observer()])
    monitored: list[tuple[str, list[str]]] = []
    traced: list[str] = []

    def before(hook: str, impls: list[pluggy.HookImpl], kwargs: Any) -> None:
        monitored.append((hook, [i.plugin_name for i in impls]))

    def after(outcome: pluggy.Result[Any], hook: str, impls: list[pluggy.HookImpl], kwargs: Any) -> None:
        assert outcome.exception is None

    undo_monitoring = plugins.pm.add_hookcall_monitoring(before, after)
    plugins.pm.trace.root.setwriter(traced.append)
    undo_tracing = plugins.pm.enable_tracing()
    try:
        with sp.open_runtime(workspace=ws, plugins=plugins) as rt:
            rt.scheduler("m1").run(two_nodes(), upper)
    finally:
        undo_tracing()
        undo_monitoring()
        plugins.pm.trace.root.setwriter(None)
    hooks = [h for h, _ in monitored]
    assert "smthrs_liveness_check" in hooks and "smthrs_reconciler" in hooks
    assert hooks.count("smthrs_node_settled") == 2 and settled == ["a", "b"]
    assert ("smthrs_liveness_check", ["smthrs-builtin"]) in monitored
    assert any("smthrs_node_settled" in line for line in traced)
    assert any("finish smthrs_liveness_check" in line for line in traced)


# -- validation names the plugin ---------------------------------------------------------------------------------


def test_a_hostile_plugin_returning_a_wrong_type_gets_a_plugin_error_naming_it(ws: Path) -> None:
    class Hostile:
        @hookimpl
        def smthrs_liveness_check(self, settings: Any) -> Any:
            return "not a liveness check"

    plugins = new_plugins(entry_points=False)
    plugins.register(Hostile(), "hostile")
    with pytest.raises(PluginError) as err:
        sp.open_runtime(workspace=ws, plugins=plugins)
    assert err.value.code == "invalid_plugin" and err.value.details["plugin"] == "hostile"
    assert "plugin 'hostile'" in err.value.message and "check()" in err.value.message


def test_a_wrong_answer_is_named_even_when_a_wrapper_or_a_silent_plugin_hides_who_answered() -> None:
    class Passthrough:
        @hookimpl(wrapper=True)
        def smthrs_plan_actions(self) -> Generator[None, Any, Any]:
            return (yield)

    class Silent:
        @hookimpl
        def smthrs_run_waker(self, settings: Any) -> Any:
            return None

    class Hostile:
        @hookimpl
        def smthrs_plan_actions(self) -> Any:
            return ["shout"]

        @hookimpl
        def smthrs_run_waker(self, settings: Any) -> Any:
            return 42

    plugins = new_plugins(entry_points=False)
    plugins.register(Hostile(), "hostile")
    plugins.register(Passthrough(), "passthrough")
    plugins.register(Silent(), "silent")
    with pytest.raises(PluginError) as err:
        plugins.actions()
    assert err.value.code == "invalid_plugin" and err.value.details["plugin"] == "hostile"
    with pytest.raises(PluginError) as err:
        plugins.host_waker(load_settings())
    assert err.value.code == "invalid_plugin" and err.value.details["plugin"] == "hostile"


def test_a_duplicate_action_behind_a_wrapper_still_names_both_plugins() -> None:
    class One:
        @hookimpl
        def smthrs_plan_actions(self) -> dict:
            return {"ship": upper}

    class Two:
        @hookimpl
        def smthrs_plan_actions(self) -> dict:
            return {"ship": upper}

    class Passthrough:
        @hookimpl(wrapper=True)
        def smthrs_plan_actions(self) -> Generator[None, Any, Any]:
            return (yield)

    plugins = new_plugins(entry_points=False)
    plugins.register(One(), "one")
    plugins.register(Two(), "two")
    plugins.register(Passthrough(), "passthrough")
    with pytest.raises(PluginError) as err:
        plugins.actions()
    assert err.value.code == "duplicate_action"
    assert "'one'" in err.value.message and "'two'" in err.value.message


def test_a_bad_answer_only_a_wrapper_adds_is_refused_naming_the_wrapper_not_an_innocent_plugin() -> None:
    class Fine:
        @hookimpl
        def smthrs_hosts(self, settings: Any) -> Any:
            return None

    class Injector:
        @hookimpl(wrapper=True)
        def smthrs_hosts(self, settings: Any) -> Generator[None, Any, Any]:
            answers = yield
            return [*answers, "not a provider"]

    plugins = new_plugins(entry_points=False)
    plugins.register(Fine(), "fine")
    plugins.register(Injector(), "injector")
    with pytest.raises(PluginError) as err:
        plugins.host_providers(load_settings())
    # Asked alone, the injecting wrapper's plugin gives the bad answer; the plain plugin does not.
    assert err.value.code == "invalid_plugin" and err.value.details["plugin"] == "injector"


# -- observers ---------------------------------------------------------------------------------------------------


def test_an_observer_raising_first_is_logged_by_name_and_every_other_observer_is_told_once(
    ws: Path, caplog: pytest.LogCaptureFixture
) -> None:
    heard: dict[str, list[str]] = {"early": [], "wrapper": []}

    class Early:  # registered first: told last
        @hookimpl
        def smthrs_node_settled(self, run_id: str, plan_id: str | None, settlement: Any) -> None:
            heard["early"].append(settlement.node)

    class Watching:
        @hookimpl(wrapper=True)
        def smthrs_node_settled(self, run_id: str, plan_id: str | None, settlement: Any) -> Generator:
            heard["wrapper"].append(settlement.node)
            return (yield)

    class Broken:  # registered last: told first, and raises
        @hookimpl
        def smthrs_node_settled(self, run_id: str, plan_id: str | None, settlement: Any) -> None:
            raise RuntimeError("observer bug")

    caplog.set_level(logging.ERROR, logger="smthrs_plugin.hooks.manager")
    plugins = new_plugins(entry_points=False)
    plugins.register(Early(), "early")
    plugins.register(Watching(), "watching")
    plugins.register(Broken(), "broken")
    with sp.open_runtime(workspace=ws, plugins=plugins) as rt:
        report = rt.scheduler("o1").run(two_nodes(), upper)
        assert rt.runs.get("o1").status == "completed"  # type: ignore[union-attr]
    assert set(report.outcomes.values()) == {"built"}
    assert heard["early"] == ["a", "b"]  # told once each, after the failing observer
    failures = [r for r in caplog.records if "observer bug" in (r.exc_text or "") or r.exc_info]
    assert len(failures) == 2 and all("'broken'" in r.getMessage() for r in failures)
