"""Helpers of the Prefect integration suite: the server's REST API, polling its asynchronous persistence, and
subprocesses that share the session's server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def api_post(api: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        f"{api}{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def poll(fn: Any, done: Any, *, timeout_s: float = 60.0) -> Any:
    """Prefect persists task-run states and events asynchronously (an event pipeline): read until ``done(value)``
    or the deadline, then return the last value (the caller's assertion says what was missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def task_runs_of(api: str, flow_run_id: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = api_post(
        api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200}
    )
    return runs


def events_of(api: str, prefix: str, flow_run_id: str) -> list[dict[str, Any]]:
    body = {
        "filter": {
            "event": {"prefix": [prefix]},
            "any_resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
            "occurred": {"since": "2000-01-01T00:00:00Z"},
        },
        "limit": 50,  # the server's maximum page
    }
    page = api_post(api, "/events/filter", body)
    events: list[dict[str, Any]] = page["events"]
    while page.get("next_page"):
        with urllib.request.urlopen(page["next_page"], timeout=30) as r:
            page = json.loads(r.read())
        events += page["events"]
    return events


def run_py(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 240) -> Any:
    """Run ``python args...`` with the session's environment (PREFECT_API_URL included)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def step_outcomes(workspace: Path) -> list[str]:
    """Every ``step-settled`` outcome journaled in ``workspace``'s runtime, sorted (the documented examples' check that
    each body ran once and every repeat was a hit)."""
    import smthrs_plugin as sp

    with sp.open_runtime(workspace) as rt:
        return sorted(
            e.payload["outcome"]
            for r in rt.runs.list()
            for e in rt.journal.read(r.run_id)
            if e.type == "step-settled"
        )


#: The environment variable naming the file step bodies count their runs in (:func:`ran`): outside the workspace,
#: so it works whatever the body's isolation (a forked child's memory is its own; a file is shared).
RUNS_LOG = "SMTHRS_TEST_RUNS_LOG"


def ran(name: str) -> int:
    """Count one run of ``name`` (call it from a step body); how many runs of it there were, this one included."""
    with open(os.environ[RUNS_LOG], "a") as f:
        f.write(name + "\n")
    return runs(name)


def runs(name: str) -> int:
    """How many times a body counted ``name`` with :func:`ran`."""
    log = Path(os.environ[RUNS_LOG])
    return log.read_text().splitlines().count(name) if log.exists() else 0


def counted_workspace(tmp_path: Path, monkeypatch: Any) -> Iterator[Path]:
    """A workspace ``tmp_path/ws`` holding ``in.txt``, the steps' settings pointing at it, and a runs log beside it."""
    import smthrs_plugin as sp

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "in.txt").write_text("abc")
    monkeypatch.setenv(RUNS_LOG, str(tmp_path / "runs.log"))
    with sp.step_settings(workspace=workspace):
        yield workspace
