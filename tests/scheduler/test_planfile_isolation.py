"""Plan-file nodes are isolated like step bodies: a ``call:`` function and a ``run:`` command see only their
sandbox, whatever path they use."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

import smthrs_plugin as sp
from smthrs_plugin.boundary import namespace_available

needs_namespace = pytest.mark.skipif(
    not namespace_available() and os.environ.get("CI") != "true",
    reason="this kernel refuses mount namespaces",
)


def _plan(tmp: Path, text: str) -> Path:
    p = tmp / "plan.yaml"
    p.write_text(textwrap.dedent(text))
    return p


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src/a.txt").write_text("hello")
    (ws / "secret.txt").write_text("secret")
    return ws


@needs_namespace
def test_a_run_command_s_absolute_workspace_paths_resolve_to_its_sandbox(tmp_path: Path, ws: Path) -> None:
    path = _plan(
        tmp_path,
        f"""\
        plan: abs
        nodes:
          - id: build
            run: "mkdir -p {ws}/out && cat {ws}/src/a.txt > {ws}/out/built.txt && (cat {ws}/secret.txt || true)"
            reads: ["src/a.txt"]
            writes: ["out/built.txt"]
        """,
    )
    plan, executor = sp.load_plan(path)
    with sp.open_runtime(workspace=ws) as rt:
        report = rt.scheduler("r1").run(plan, executor)
    assert report.outcomes == {"build": "built"}
    assert report.results["build"]["stdout"] == ""  # the undeclared secret is not in the sandbox
    assert (ws / "out/built.txt").read_text() == "hello"  # copied back from the sandbox, compare-and-set


@needs_namespace
def test_a_call_function_reads_and_writes_plain_paths_inside_its_sandbox(tmp_path: Path, ws: Path) -> None:
    path = _plan(
        tmp_path,
        """\
        plan: call
        nodes:
          - id: peek
            call: "sched_calls:peek"
            with: {path: "src/a.txt"}
            reads: ["src/a.txt"]
            writes: ["out/peeked.txt"]
        """,
    )
    plan, executor = sp.load_plan(path)
    with sp.open_runtime(workspace=ws) as rt:
        report = rt.scheduler("r1").run(plan, executor)
    assert report.outcomes == {"peek": "built"}
    assert report.results["peek"] == {"cwd_is_root": True, "text": "hello"}
    assert (ws / "out/peeked.txt").read_text() == "HELLO"


def test_a_call_function_reading_an_undeclared_file_fails_typed(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_ISOLATION", "process")  # the refusal path, where namespaces are not available
    path = _plan(
        tmp_path,
        """\
        plan: sneaky
        nodes:
          - id: peek
            call: "sched_calls:peek"
            with: {path: "secret.txt"}
            writes: ["out/peeked.txt"]
        """,
    )
    plan, executor = sp.load_plan(path)
    with sp.open_runtime(workspace=ws) as rt:
        report = rt.scheduler("r1").run(plan, executor)
    assert report.outcomes == {"peek": "failed"}
    assert "undeclared_read" in (report.settlement("peek").error or "")
    assert not (ws / "out").exists()
