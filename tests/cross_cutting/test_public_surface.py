"""The public surface is pinned: ``import smthrs_plugin as sp`` offers these names and no others, the namespaces
``sp.plan`` and ``sp.control`` theirs, every one resolves, none shadows a ``typing`` name or a builtin, one name
never means two things across the three, and importing the package stays free of Prefect.

Adding or removing a public name is a decision: change the list here in the same commit, and docs/reference/api.md.
"""

from __future__ import annotations

import builtins
import inspect
import subprocess
import sys
import types
import typing

import pytest

import smthrs_plugin as sp

TOP_LEVEL = [
    "ApprovalDenied",
    "ArtifactError",
    "BoundaryError",
    "BoundaryRefusal",
    "CacheError",
    "CanonicalError",
    "CodecError",
    "Control",
    "ControlError",
    "DriveLost",
    "DriveNotClaimed",
    "DriveOutcome",
    "DriveParked",
    "DriveReleased",
    "DriveSettled",
    "DriveUnregistered",
    "NodeInput",
    "PlanError",
    "RemoteError",
    "RunContext",
    "RunParked",
    "Runtime",
    "SchedulerError",
    "Settings",
    "SettingsError",
    "SmthrsError",
    "Step",
    "StoreError",
    "WaitError",
    "Workspace",
    "complete",
    "current_run",
    "durable_run",
    "hookimpl",
    "load_plan",
    "load_settings",
    "open_runtime",
    "require_approval",
    "sleep",
    "sleep_until",
    "step",
    "step_settings",
    "wait_for",
]

PLAN = [
    "ABSENT",
    "Concurrency",
    "Filegroup",
    "Glob",
    "Input",
    "NodeDraft",
    "Pending",
    "Plan",
    "PlanNode",
    "Ref",
    "RuntimeGraph",
    "TreeArtifact",
    "Value",
    "WriteConflict",
    "append_plan",
    "compile_plan",
    "node",
    "verify_plan",
]

CONTROL = [
    "Accepted",
    "AlreadyApplied",
    "ApprovalAuthority",
    "Approved",
    "AuthorityRequest",
    "Authorized",
    "CardNode",
    "Conflict",
    "Control",
    "DEFAULT_AUTHORITY",
    "DelegatedAuthority",
    "Delegation",
    "Denied",
    "Envelope",
    "Held",
    "LOCAL_OPERATOR",
    "Mutation",
    "NodeTarget",
    "Parked",
    "PendingApproval",
    "PlanApproval",
    "PlanCard",
    "PlanTarget",
    "Principal",
    "Receipt",
    "Terminal",
    "TokenState",
    "Unauthorized",
    "decide_replay",
    "follow",
    "receipt_from_dict",
]

NAMESPACES = [(sp, TOP_LEVEL), (sp.plan, PLAN), (sp.control, CONTROL)]
IDS = ["sp", "sp.plan", "sp.control"]


@pytest.mark.parametrize(("module", "names"), NAMESPACES, ids=IDS)
def test_each_public_namespace_exports_exactly_the_pinned_names(
    module: types.ModuleType, names: list[str]
) -> None:
    assert sorted(module.__all__) == names
    assert len(set(module.__all__)) == len(module.__all__)  # no name listed twice


@pytest.mark.parametrize(("module", "names"), NAMESPACES, ids=IDS)
def test_every_public_name_resolves_to_an_object_of_the_package(
    module: types.ModuleType, names: list[str]
) -> None:
    for name in names:
        value = getattr(module, name)
        assert value is not None, name
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__.startswith("smthrs_plugin."), (name, value.__module__)


@pytest.mark.parametrize(("module", "names"), NAMESPACES, ids=IDS)
def test_no_public_name_shadows_a_typing_name_or_a_builtin(
    module: types.ModuleType, names: list[str]
) -> None:
    clashes = sorted(n for n in names if hasattr(typing, n) or hasattr(builtins, n))
    assert clashes == []


def test_one_public_name_never_names_two_things_across_the_namespaces() -> None:
    seen: dict[str, object] = {}
    for module, names in NAMESPACES:
        for name in names:
            value = getattr(module, name)
            assert seen.setdefault(name, value) is value, f"{name} means two things"


def test_the_plan_and_control_namespaces_are_attributes_of_the_package() -> None:
    import smthrs_plugin.control
    import smthrs_plugin.plan

    assert sp.plan is smthrs_plugin.plan and sp.control is smthrs_plugin.control
    assert sp.plan.Value(3).value == 3  # the constant input, whatever its defining module calls it


def test_durable_run_and_its_six_results_are_public() -> None:
    results = {
        "DriveSettled",
        "DriveParked",
        "DriveReleased",
        "DriveLost",
        "DriveNotClaimed",
        "DriveUnregistered",
    }
    assert results <= set(sp.__all__) and "durable_run" in sp.__all__
    assert set(typing.get_args(sp.DriveOutcome)) == {getattr(sp, n) for n in results}


def test_importing_the_package_does_not_import_prefect() -> None:
    code = (
        "import sys\n"
        "import smthrs_plugin as sp\n"
        "sp.plan.node('a'); sp.control.PlanCard; sp.DriveParked; sp.sleep\n"
        "loaded = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        "assert loaded == [], loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
