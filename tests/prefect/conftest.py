"""The Prefect integration suite's one server.

ONE real ``prefect server start`` (in-memory SQLite, so no "database is locked" back-offs) for the
whole test session, shared by this process (``temporary_settings``) and every subprocess and worker it starts
(``PREFECT_API_URL`` in the environment). Measured on 2 cores: ~8-12 s to become healthy, the same as the
in-process ephemeral server — but the ephemeral server would be started AGAIN by every subprocess, process-pool
worker and Dask worker (10-15 s each), so one real server is the cheaper choice as soon as one test leaves the
process. Each flow run here also switches Prefect's per-flow-run heartbeat thread off (~0.5 s floor per run).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import die_with_parent

from smthrs_plugin.prefect.environment import DEFAULT_STARTUP_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """The session's Prefect API URL (a real server on 127.0.0.1, stopped at the end of the session)."""
    home = tempfile.mkdtemp(prefix="smthrs-prefect-server-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": home,
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    }
    env.pop("PREFECT_API_URL", None)
    log = open(Path(home) / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: teardown stops the server and its children only
        preexec_fn=die_with_parent,
    )
    # As long as the ephemeral server's budget (prefect/environment.py): a first start on a busy machine is slow.
    deadline = time.monotonic() + DEFAULT_STARTUP_TIMEOUT_S
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(
                f"the Prefect server did not start within {DEFAULT_STARTUP_TIMEOUT_S} s; see {home}/server.log"
            )
        time.sleep(0.25)
    # Process-wide, not a contextvar: the process pool's event-forwarding thread and every worker must see it.
    # Logs stay local: the API log worker would otherwise flush into a stopped server at interpreter exit.
    overrides = {
        "PREFECT_API_URL": url,
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    }
    previous = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()
    try:
        yield url
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        refresh_global_settings_context()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(autouse=True)
def _quiet_flow_runs(prefect_api: str) -> Iterator[None]:
    """Every test here talks to the session server, with Prefect's flow heartbeat thread off."""
    from smthrs_plugin.prefect.host import quiet_flow_settings

    with quiet_flow_settings():
        yield
