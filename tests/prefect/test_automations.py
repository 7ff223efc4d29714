"""An automation created through Prefect's API (``examples/automation_notify.py``) fires on the
``smthrs.approval.requested`` event of a real parked run: Prefect's server sends the notification to a webhook
(a local HTTP server here), and its text names the run, the digest, the exact ``smthrs approve`` command and the
review page of a running ``smthrs serve``."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import REPO, api_post, poll, run_py
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin.prefect import _events

pytestmark = pytest.mark.prefect

DEADLINE_S = 120.0
EXAMPLE = REPO / "examples" / "automation_notify.py"


class _Webhook:
    """A local HTTP endpoint recording every JSON body POSTed to it (what a chat webhook would receive)."""

    def __init__(self) -> None:
        received: list[dict[str, Any]] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                received.append(json.loads(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook() -> Iterator[_Webhook]:
    hook = _Webhook()
    yield hook
    hook.close()


@pytest.fixture
def serve_url(tmp_path: Path) -> Iterator[str]:
    """A real ``smthrs serve`` on the workspace, on a free loopback port (stopped by its pid at the end)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SMTHRS_SERVE_TOKEN", "SMTHRS_DB_URL")}
    env["SMTHRS_WORKSPACE"] = str(tmp_path)
    err = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [sys.executable, "-m", "smthrs_plugin", "serve", "--host", "127.0.0.1", "--port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    try:
        deadline = time.monotonic() + DEADLINE_S
        url = None
        while url is None:
            m = re.search(r"smthrs serve: listening on (http\S+)", (tmp_path / "serve.log").read_text())
            if m:
                url = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("smthrs serve did not start; see " + str(tmp_path / "serve.log"))
            else:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()


def test_an_automation_created_through_prefects_api_notifies_when_a_run_asks_for_an_approval(
    tmp_path: Path, prefect_api: str, webhook: _Webhook, serve_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = run_py(
        [str(EXAMPLE), "--webhook", webhook.url, "--name", "smthrs-test-approvals", "--json"], cwd=REPO
    )
    assert created.returncode == 0, created.stdout + created.stderr
    automation_id = json.loads(created.stdout.strip().splitlines()[-1])["automation_id"]
    try:
        (auto,) = api_post(
            prefect_api, "/automations/filter", {"automations": {"id": {"any_": [automation_id]}}}
        )
        assert auto["enabled"] and auto["trigger"]["expect"] == ["smthrs.approval.requested"]

        # A CI plan whose deploy node needs approval `ship`, run as a Prefect flow run: it parks.
        (tmp_path / "plan.yaml").write_text(
            "plan: release\nflow: ci/release\nnodes:\n"
            '  - id: build\n    run: "true"\n'
            '  - id: deploy\n    run: "true"\n    needs: [build]\n    approval: {request: ship}\n'
        )
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("SMTHRS_WORKSPACE", str(tmp_path))
        monkeypatch.setenv(_events.SERVE_URL_ENV, serve_url)
        from smthrs_plugin.cli import app

        runner = CliRunner()
        parked = runner.invoke(app, ["run", "plan.yaml", "--prefect", "--json", "--key", "release:1"])
        assert parked.exit_code == 75, parked.output
        run_id = json.loads(parked.output.strip().splitlines()[-1])["run_id"]
        with sp.open_runtime(tmp_path) as rt:
            (pending,) = rt.control().show(run_id).pending

        # Prefect's server ran the automation: the notification arrived with the run, digest, command and page.
        got = poll(lambda: list(webhook.received), lambda r: len(r) >= 1, timeout_s=DEADLINE_S)
        assert len(got) == 1, got
        note = got[0]
        assert note["subject"] == f"smthrs run {run_id} asks for approval ship"
        lines = note["text"].splitlines()
        assert lines[0] == (
            f"Run {run_id} (flow ci/release) waits for approval 'ship' of digest {pending.digest}."
        )
        approve = f"smthrs approve {run_id} --request ship"
        assert f"Approve: {approve}" in lines and f"Review page: {serve_url.rstrip('/')}/" in lines

        # ... and recorded it as its own events, about this automation, triggered by our event.
        fired = poll(
            lambda: _automation_events(prefect_api, automation_id),
            lambda e: {"prefect.automation.triggered", "prefect.automation.action.executed"} <= set(e),
            timeout_s=DEADLINE_S,
        )
        assert {"prefect.automation.triggered", "prefect.automation.action.executed"} <= set(fired)

        # The review page the notification names is a live `smthrs serve` page.
        with urllib.request.urlopen(f"{serve_url.rstrip('/')}/", timeout=DEADLINE_S) as r:
            assert r.status == 200 and "text/html" in r.headers["content-type"]

        # The command it names is exact: run as written, it approves the request the run waits for.
        done = runner.invoke(app, shlex.split(approve)[1:])
        assert done.exit_code == 0, done.output
        with sp.open_runtime(tmp_path) as rt:
            assert rt.control().show(run_id).pending == ()
    finally:
        with urllib.request.urlopen(
            urllib.request.Request(f"{prefect_api}/automations/{automation_id}", method="DELETE"), timeout=30
        ) as r:
            assert r.status == 204


def _automation_events(api: str, automation_id: str) -> list[str]:
    body = {
        "filter": {
            "event": {"prefix": ["prefect.automation."]},
            "any_resource": {"id": [f"prefect.automation.{automation_id}"]},
            "occurred": {"since": "2000-01-01T00:00:00Z"},
        },
        "limit": 50,
    }
    return [e["event"] for e in api_post(api, "/events/filter", body)["events"]]
