"""One JSON vocabulary for every ``--json`` output: our own fields are snake_case and every command's
top-level keys are pinned here (docs/rules.md, "JSON vocabulary", states the same shapes). Nested objects whose wire
form the reference fixes keep its spelling: the ``receipt`` (``_tag``, ``receiptId``, ``runId``, ``planId``; no
``type`` copy) and the plan ``card`` (``planId``, ``flowId`` ...). A CI script written against one command works against the others.

In-process through the real typer app, on a SQLite workspace."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from smthrs_plugin.cli import app

PLAN = """\
plan: shapes
flow: ci/shapes
approval: required
nodes:
  - id: build
    run: "true"
  - id: deploy
    run: "true"
    needs: [build]
    approval: {request: ship, envelope: {capabilities: ["deploy:prod"]}}
"""
PLAIN = """\
plan: plain
flow: ci/plain
nodes:
  - id: build
    run: "true"
"""

RECEIPT_ANSWER = {"receipt", "run_id", "status", "waiting_reason", "requests", "plan_id", "digest"}
DECISION_ANSWER = RECEIPT_ANSWER | {"host_wake"}  # the verbs that tell a run's host what changed
RUN_ANSWER = RECEIPT_ANSWER | {"settlements", "owner"}
SHAPES: dict[str, set[str]] = {
    "plan": {"plan_id", "flow_id", "digest", "approval_state", "card"},
    "approve": DECISION_ANSWER,
    "deny": DECISION_ANSWER,
    "cancel": DECISION_ANSWER,
    "run --key": RUN_ANSWER,
    "resume": RUN_ANSWER,
    "run": {
        "run_id",
        "plan_id",
        "key",
        "status",
        "waiting_reason",
        "wait",
        "node",
        "settlements",
        "merges",
        "error",
    },
    "runs": {"runs", "cursor", "source", "revision"},
    "show": {"run", "source", "revision"},
    "watch": {"run_id", "events", "cursor"},
    "error": {"error"},
}
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "shapes.yaml").write_text(PLAN)
    (ws / "plain.yaml").write_text(PLAIN)
    return ws


def smthrs(ws: Path, *args: str) -> tuple[int, dict[str, Any]]:
    db = f"sqlite:///{(ws / 'state.db').as_posix()}"
    opts = ["--db", db] if args[0] in ("watch", "runs", "show") else ["--db", db, "--workspace", str(ws)]
    argv = [str(ws / a) if a.endswith(".yaml") else a for a in args]
    result = CliRunner().invoke(app, [*argv, *opts, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


def _shape(name: str, out: dict[str, Any]) -> None:
    assert set(out) == SHAPES[name], f"{name}: {sorted(out)}"
    assert all(SNAKE.match(k) for k in out), f"{name}: not snake_case: {sorted(out)}"


def test_every_command_prints_its_pinned_snake_case_top_level_keys(ws: Path) -> None:
    code, card = smthrs(ws, "plan", "shapes.yaml")
    assert code == 0
    _shape("plan", card)
    assert card["card"]["planId"] == card["plan_id"]  # the reference's wire form, nested

    code, out = smthrs(ws, "run", "shapes.yaml", "--key", "k")
    assert code == 75 and out["receipt"]["_tag"] == "Parked" and "type" not in out["receipt"]
    assert (out["status"], out["waiting_reason"]) == ("parked", "approval")  # the launch waits for the plan's
    _shape("run --key", out)
    assert out["plan_id"] == card["plan_id"]  # the same name and value as `plan --json`

    code, out = smthrs(ws, "approve", card["plan_id"])
    assert code == 0
    _shape("approve", out)
    assert out["plan_id"] == card["plan_id"]

    code, out = smthrs(ws, "run", "shapes.yaml", "--key", "k")
    assert code == 75 and (out["status"], out["waiting_reason"]) == ("parked", "approval")
    _shape("run --key", out)
    run_id = out["run_id"]
    (request,) = out["requests"]
    assert request["request_id"] == "ship" and all(SNAKE.match(k) for k in request)

    code, out = smthrs(ws, "approve", run_id, "--request", "ship")
    assert code == 0
    _shape("approve", out)

    code, out = smthrs(ws, "resume", run_id, "--key", "resume-1")
    assert code == 0 and out["status"] == "completed"
    _shape("resume", out)
    assert all(SNAKE.match(k) for s in out["settlements"] for k in s)

    code, out = smthrs(ws, "cancel", run_id)
    assert code == 2 and out["receipt"]["_tag"] == "Terminal"  # it completed: nothing to cancel, refused
    _shape("cancel", out)

    code, out = smthrs(ws, "deny", run_id, "--request", "ship")
    assert code == 2  # the run settled otherwise: a late denial is refused
    _shape("deny", out)

    code, out = smthrs(ws, "run", "plain.yaml")
    assert code == 0
    _shape("run", out)

    code, out = smthrs(ws, "runs")
    assert code == 0
    _shape("runs", out)
    assert all(SNAKE.match(k) for r in out["runs"] for k in r)

    code, out = smthrs(ws, "show", run_id)
    assert code == 0
    _shape("show", out)

    code, out = smthrs(ws, "watch", run_id)
    assert code == 0 and out["events"]
    _shape("watch", out)
    assert all(SNAKE.match(k) for e in out["events"] for k in e)

    code, out = smthrs(ws, "show", "NO_SUCH_RUN")
    assert code == 2
    code, out = smthrs(ws, "watch", "NO_SUCH_RUN")
    assert code == 2
    _shape("error", out)
    assert out["error"]["code"] == "run_not_found"
