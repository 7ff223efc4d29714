"""Fixtures of the ``smthrs serve`` suites: the REAL server as a subprocess (``python -m smthrs_plugin serve --port 0``
with ``SMTHRS_WORKSPACE`` = a fresh workspace), its announcement lines parsed from stderr, an in-process runtime on
the same workspace to set up runs and to read the database, and a full-content snapshot of that database (the
"nothing written" assertion).

Waits poll for a state under a deadline far above any command's duration; nothing asserts elapsed time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from _procs import die_with_parent

import smthrs_plugin as sp
from smthrs_plugin.runtime import Runtime
from smthrs_plugin.stores.database import Database

LISTENING = "smthrs serve: listening on "
TOKEN = "smthrs serve: approval token: "
DEADLINE_S = 120.0


class ServerProcess:
    """One ``smthrs serve`` process: its URL, its session token (loopback), its stderr lines and exit code."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smthrs_plugin", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=die_with_parent,
        )
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        self._threads = [
            threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr), daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stdout, self.stdout), daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.url: str | None = None
        self.token: str | None = None

    @staticmethod
    def _drain(pipe: Any, into: list[str]) -> None:
        for line in pipe:
            into.append(line.rstrip("\n"))

    def wait_listening(self) -> ServerProcess:
        """Block until the listening line (or the process exits: then ``url`` stays None)."""
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            for line in list(self.stderr):
                if line.startswith(TOKEN):
                    self.token = line[len(TOKEN) :]
                if line.startswith(LISTENING):
                    self.url = line[len(LISTENING) :].rstrip("/")
            if self.url is not None:
                return self
            if self.proc.poll() is not None:
                self.join()
                return self
            time.sleep(0.02)
        raise AssertionError(f"smthrs serve did not announce itself; stderr: {self.stderr}")

    @property
    def port(self) -> int:
        assert self.url is not None
        return int(self.url.rsplit(":", 1)[1])

    def local_url(self) -> str:
        """A URL on 127.0.0.1 (a wildcard bind announces 0.0.0.0, which is not a destination)."""
        return f"http://127.0.0.1:{self.port}"

    def join(self, timeout: float = DEADLINE_S) -> int:
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(timeout)
        return code

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.join()

    # -- calls -------------------------------------------------------------------------------------------------------
    def rpc(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        token: str | None = "session",
        rid: Any = 1,
    ) -> httpx.Response:
        """``POST /rpc``; ``token="session"`` sends the session token, None no header, anything else that value."""
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            body["params"] = params
        return self.post(body, token=token)

    def post(self, body: Any, *, token: str | None = "session", **kw: Any) -> httpx.Response:
        headers = self.auth(token)
        with httpx.Client(base_url=self.local_url(), timeout=DEADLINE_S) as c:
            if isinstance(body, (bytes, str)):
                return c.post("/rpc", content=body, headers=headers, **kw)
            return c.post("/rpc", json=body, headers=headers, **kw)

    def auth(self, token: str | None) -> dict[str, str]:
        if token is None:
            return {}
        value = self.token if token == "session" else token
        assert value is not None
        return {"Authorization": f"Bearer {value}"}

    def result(self, method: str, params: dict[str, Any] | None = None, **kw: Any) -> Any:
        r = self.rpc(method, params, **kw)
        assert r.status_code == 200, r.text
        body = r.json()
        assert "result" in body, body
        return body["result"]


def serve_env(workspace: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SMTHRS_SERVE_TOKEN", "SMTHRS_DB_URL")}
    env["SMTHRS_WORKSPACE"] = str(workspace)
    env.update(extra)
    return env


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


@pytest.fixture
def start(workspace: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``start(*args, env=None, wait=True)`` — a ``smthrs serve --port 0`` process on ``workspace`` (stopped after
    the test)."""
    made: list[ServerProcess] = []

    def make(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> ServerProcess:
        s = ServerProcess(["--port", "0", *args], env if env is not None else serve_env(workspace))
        made.append(s)
        return s.wait_listening() if wait else s

    yield make
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
        s.join()


@pytest.fixture
def server(start: Callable[..., ServerProcess]) -> ServerProcess:
    """A loopback server on the workspace."""
    s = start()
    assert s.url is not None and s.token is not None, s.stderr
    return s


@pytest.fixture
def rt(workspace: Path) -> Iterator[Runtime]:
    """This process's runtime over the server's workspace (same SQLite file)."""
    with sp.open_runtime(workspace=workspace) as r:
        yield r


def db_state(db: Database) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table (the migrations' bookkeeping aside): equal snapshots mean nothing was written."""

    def fn(c: Any) -> dict[str, list[tuple[Any, ...]]]:
        names = [
            n
            for n in c.execute(
                sa.text("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            ).scalars()
            if not n.startswith(("sqlite_", "alembic"))
        ]
        return {
            n: sorted(map(tuple, c.execute(sa.text(f'SELECT * FROM "{n}"')).all()), key=repr) for n in names
        }

    return db.read(fn)


@pytest.fixture
def state(rt: Runtime) -> Callable[[], dict[str, list[tuple[Any, ...]]]]:
    return lambda: db_state(rt.db)


def eventually(cond: Callable[[], Any], timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


@pytest.fixture
def poll() -> Callable[..., Any]:
    return eventually


GATED_PLAN = """\
plan: release
flow: ci/release
approval: required
envelope: {capabilities: ["deploy:prod"]}
nodes:
  - id: build
    run: "true"
  - id: deploy
    run: "true"
    needs: [build]
    approval: {request: ship, envelope: {capabilities: ["deploy:prod"]}}
"""


@pytest.fixture
def plan_text() -> str:
    return GATED_PLAN


@pytest.fixture
def card(rt: Runtime, workspace: Path, plan_text: str) -> Any:
    """The gated plan's card, planned in this process from ``workspace/plan.yaml`` (its approval pending)."""
    from smthrs_plugin.scheduler.planfile import read_plan_file

    f = workspace / "plan.yaml"
    f.write_text(plan_text)
    pf = read_plan_file(f, actions=rt.actions)
    return rt.control().plan(pf.plan, input={}, envelope=pf.envelope, approval=True)


@pytest.fixture
def parked_run(rt: Runtime, card: Any) -> str:
    """A run of the approved card, parked ``waiting-approval`` on its node request ``ship``."""
    from smthrs_plugin.cli.control_support import PlanLauncher

    control = rt.control()
    control.approve(card.approval)
    receipt = control.run(card, idempotency_key="deploy:1", launcher=PlanLauncher(rt, {}))
    run_id = receipt.run_id  # type: ignore[union-attr]
    assert control.show(run_id).waiting_approval
    return str(run_id)


def _gate_flow(ctx: Any) -> dict[str, Any]:
    return {"value": sp.wait_for("approval")}


@pytest.fixture
def driver(rt: Runtime) -> Iterator[Any]:
    """A run driver in this process whose flow ``gate`` waits for the deferred ``approval`` (wait budget 0: it parks
    at once)."""
    from smthrs_plugin.engine.drive.driver import RunDriver
    from smthrs_plugin.settings import load_settings

    settings = load_settings(
        heartbeat_interval_s=0.05, stale_after_s=30.0, wait_poll_s=0.05, host_id="serve-host"
    )
    d = RunDriver(rt.db, settings=settings, wait_budget_s=0)
    d.register("gate", _gate_flow)
    yield d
    d.stop(grace_s=5)


@pytest.fixture
def waiting_run(driver: Any) -> str:
    """A run parked ``event`` on its wait ``approval``."""
    from smthrs_plugin.engine.drive.active_run import DriveParked

    driver.submit("waiting-1", "gate")
    assert isinstance(driver.drive("waiting-1"), DriveParked)
    return "waiting-1"
