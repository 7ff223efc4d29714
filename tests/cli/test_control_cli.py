"""The CI story end to end through the REAL ``smthrs`` command line, one subprocess per command (SQLite workspace):
plan → run parks (75) → approve as another principal (3) → approve → run (0) → again (0, AlreadyApplied) → same
key, other input (Conflict) → a deploy node's approval parks the run (75) → approve the node → resume (0) with
build and test served clean, not re-executed. Every command's node executions are counted in a log file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ci_gate"

NODES = """
  - id: build
    run: "echo build >> $CTL_LOG && mkdir -p dist && cp src/app.txt dist/app.txt"
    reads: ["src/app.txt"]
    writes: ["dist/"]
  - id: test
    run: "echo test >> $CTL_LOG && grep -q release dist/app.txt"
    reads: ["dist/app.txt"]
    needs: [build]
"""
DEPLOY = """
  - id: deploy
    run: "echo deploy >> $CTL_LOG && mkdir -p deployed && cp dist/app.txt deployed/app.txt"
    reads: ["dist/app.txt"]
    writes: ["deployed/"]
    tier: irreversible
    needs: [test]
    approval: {request: ship, envelope: {capabilities: ["deploy:prod"]}}
"""


class Cli:
    """``smthrs`` in a subprocess, in one workspace; ``log`` counts node executions."""

    def __init__(self, ws: Path) -> None:
        self.ws = ws
        self.log = ws.parent / "executions.log"
        self.env = {
            **os.environ,
            "SMTHRS_WORKSPACE": str(ws),
            "SMTHRS_HOST_ID": "ci-runner",
            "CTL_LOG": str(self.log),
        }
        self.env.pop("SMTHRS_DB_URL", None)

    def __call__(self, *args: str) -> tuple[int, Any]:
        proc = subprocess.run(
            [sys.executable, "-m", "smthrs_plugin", *args, "--json"],
            cwd=self.ws,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        try:
            out = json.loads(proc.stdout)
        except ValueError as exc:
            raise AssertionError(f"not one JSON object: {proc.stdout!r} / {proc.stderr!r}") from exc
        return proc.returncode, out

    def executions(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "app.txt").write_text("release 1.4.0\n")
    (ws / "build.yaml").write_text(f"plan: app\nflow: ci/app\napproval: required\nnodes:{NODES}")
    (ws / "pipeline.yaml").write_text(
        "plan: release\nflow: ci/release\napproval: required\n"
        f'envelope: {{capabilities: ["deploy:prod"]}}\nnodes:{NODES}{DEPLOY}'
    )
    return Cli(ws)


@pytest.mark.slow
def test_the_ci_story_through_the_real_cli(cli: Cli) -> None:
    code, card = cli("plan", "build.yaml")
    assert code == 0 and card["approval_state"] == "pending"
    plan_id = card["plan_id"]

    code, out = cli("run", "build.yaml", "--key", "build:v1.4.0")
    assert (code, out["receipt"]) == (
        75,
        {"_tag": "Parked", "planId": plan_id, "status": "waiting-approval"},
    )
    assert (out["status"], out["waiting_reason"], out["run_id"]) == ("parked", "approval", None)

    code, out = cli("approve", plan_id, "--as", "mallory/human")
    assert code == 3 and out["error"]["code"] == "unauthorized"

    code, out = cli("approve", plan_id)
    assert code == 0 and out["receipt"]["_tag"] == "Accepted"

    code, out = cli("run", "build.yaml", "--key", "build:v1.4.0")
    assert code == 0 and out["receipt"]["_tag"] == "Accepted" and out["status"] == "completed"
    run_id = out["run_id"]
    assert [s["outcome"] for s in out["settlements"]] == ["built", "built"]

    code, out = cli("run", "build.yaml", "--key", "build:v1.4.0")
    assert code == 0 and out["receipt"]["_tag"] == "AlreadyApplied" and out["receipt"]["runId"] == run_id

    code, out = cli("run", "build.yaml", "--key", "build:v1.4.0", "--input", "version=1.5.0")
    assert code == 2 and out["receipt"]["_tag"] == "Conflict"
    assert cli.executions() == ["build", "test"]

    # The release pipeline: build and test as above, then a deploy gated by its own node approval.
    code, card = cli("plan", "pipeline.yaml")
    assert code == 0
    assert cli("approve", card["plan_id"])[0] == 0
    code, out = cli("run", "pipeline.yaml", "--key", "release:v1.4.0")
    assert code == 75 and out["status"] == "parked" and out["waiting_reason"] == "approval"
    release = out["run_id"]
    assert [r["request_id"] for r in out["requests"]] == ["ship"]
    assert cli.executions() == ["build", "test"]  # served from the cache: clean, not re-executed

    code, out = cli("approve", release, "--request", "ship", "--as", "mallory/human")
    assert code == 3
    code, out = cli("approve", release, "--request", "ship")
    assert code == 0 and out["status"] == "pending"

    code, out = cli("resume", release, "--key", "resume:release:v1.4.0")
    assert code == 0 and out["status"] == "completed"
    assert {s["node"]: s["outcome"] for s in out["settlements"]} == {
        "build": "clean",
        "test": "clean",
        "deploy": "built",
    }
    assert cli.executions() == ["build", "test", "deploy"]
    assert (cli.ws / "deployed" / "app.txt").read_text() == "release 1.4.0\n"

    code, out = cli("run", "pipeline.yaml", "--key", "release:v1.4.0")
    assert code == 0 and out["receipt"]["_tag"] == "AlreadyApplied" and out["status"] == "completed"
    code, out = cli("resume", release, "--key", "resume:release:v1.4.0")
    assert code == 0 and out["receipt"] == {
        "_tag": "Terminal",
        "runId": release,
        "status": "completed",
    }


@pytest.mark.slow
def test_a_plan_edited_after_its_approval_parks_again_and_runs_nothing(cli: Cli) -> None:
    code, card = cli("plan", "build.yaml")
    assert cli("approve", card["plan_id"])[0] == 0
    text = (cli.ws / "build.yaml").read_text()
    (cli.ws / "build.yaml").write_text(text.replace("grep -q release", "grep -q -i release"))
    code, out = cli("run", "build.yaml", "--key", "build:v1.4.0")
    assert code == 75 and out["receipt"]["_tag"] == "Parked" and out["receipt"]["planId"] != card["plan_id"]
    code, out = cli(
        "run", card["plan_id"], "--key", "build:v1.4.0"
    )  # the approved card still runs what it pinned
    assert code == 0 and out["status"] == "completed"
    assert cli.executions() == ["build", "test"]


@pytest.mark.slow
def test_the_ci_gate_example_script_plays_the_whole_job(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SMTHRS": f"{sys.executable} -m smthrs_plugin",
        "CI_GATE_WORKSPACE": str(tmp_path / "ci"),
    }
    env.pop("SMTHRS_DB_URL", None)
    env.pop("SMTHRS_WORKSPACE", None)
    proc = subprocess.run(
        ["bash", str(EXAMPLE / "ci_job.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "run exited 75 (parked: plan approval)" in proc.stdout
    assert "run exited 75 (parked: deploy approval)" in proc.stdout
    assert (tmp_path / "ci" / "deployed" / "app.txt").is_file()
    assert shutil.which("bash") is not None


@pytest.mark.slow
def test_deny_and_cancel_through_the_cli(cli: Cli) -> None:
    code, card = cli("plan", "build.yaml")
    # A deny exits 3 ("denied") every time — the first call and each identical retry alike.
    for _ in range(3):
        code, denied = cli("deny", card["plan_id"])
        assert code == 3 and denied["receipt"]["_tag"] in ("Accepted", "AlreadyApplied")
    for _ in range(2):
        code, out = cli("run", "build.yaml", "--key", "k")
        assert code == 3 and out["error"]["code"] == "plan_denied"
    # The release pipeline parks on its deploy gate; cancelling the parked run settles it at once.
    _, release = cli("plan", "pipeline.yaml")
    cli("approve", release["plan_id"])
    code, out = cli("run", "pipeline.yaml", "--key", "release")
    assert code == 75
    code, cancelled = cli("cancel", out["run_id"], "--reason", "wrong tag")
    assert code == 0 and cancelled["status"] == "cancelled"
    code, again = cli("cancel", out["run_id"])
    assert code == 0 and again["receipt"]["_tag"] == "Terminal"
    code, late = cli("approve", out["run_id"], "--request", "ship")
    assert code == 2 and late["receipt"]["_tag"] == "Terminal"
