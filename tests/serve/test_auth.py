"""The credential and the life of a REAL ``smthrs serve`` process: a fresh token per loopback session (printed even
with ``--quiet``, never echoed anywhere else), a network bind refused without a configured credential and served
with one, the ``Host`` check of a loopback bind, graceful SIGTERM/SIGINT with exit 0, and a CLI that does not load
FastAPI until ``serve`` runs. The pure rules of ``_auth.py`` run in-process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from smthrs_plugin.control.identity import Principal
from smthrs_plugin.errors import ControlError
from smthrs_plugin.serve._auth import MIN_TOKEN_CHARS, ServeAuth, auth_for_bind, is_loopback

DEADLINE_S = 120.0
CONFIGURED = "a-configured-credential-0123456789"


def _serve_env(workspace: Path, **extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("SMTHRS_SERVE_TOKEN", "SMTHRS_DB_URL")}
    env["SMTHRS_WORKSPACE"] = str(workspace)
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- loopback: a fresh token per session ---------------------------------------------------------------------------


def test_a_loopback_server_prints_a_fresh_token_each_session_and_accepts_it(
    start: Callable[..., Any], waiting_run: str
) -> None:
    first, second = start(), start()
    assert first.token and second.token and first.token != second.token
    assert first.url == f"http://127.0.0.1:{first.port}"
    r = first.rpc("signal", {"run_id": waiting_run, "name": "approval", "value": 1})
    assert r.status_code == 200 and r.json()["result"]["receipt"]["_tag"] == "Accepted"
    # One session's token is not another's.
    assert second.rpc("cancel", {"run_id": waiting_run}, token=first.token).status_code == 403


def test_quiet_prints_only_the_token_and_listening_lines_and_the_token_nowhere_else(
    start: Callable[..., Any], waiting_run: str
) -> None:
    server = start("--quiet")
    answers = [
        server.rpc("signal", {"run_id": waiting_run, "name": "approval", "value": 1}).text,
        server.rpc("runs", {}).text,
        server.rpc("show", {"run_id": waiting_run}, token=None).text,
        server.rpc("cancel", {"run_id": waiting_run}, token="wrong-token-wrong-token").text,
    ]
    with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
        answers.append(c.get("/projections", params={"run_id": waiting_run}).text)
    assert server.stop(signal.SIGTERM) == 0
    assert len(server.stderr) == 2, server.stderr
    assert server.stderr[0] == f"smthrs serve: approval token: {server.token}"
    assert server.stderr[1] == f"smthrs serve: listening on http://127.0.0.1:{server.port}/"
    assert server.stdout == []
    assert not any(server.token in a for a in answers)


def test_without_quiet_the_token_appears_once_and_requests_are_logged_without_it(
    start: Callable[..., Any], waiting_run: str
) -> None:
    server = start()
    server.rpc("cancel", {"run_id": waiting_run})
    assert server.stop() == 0
    logged = "\n".join(server.stderr + server.stdout)
    assert logged.count(server.token) == 1
    assert "POST /rpc" in logged


# -- network binds ---------------------------------------------------------------------------------------------------


def test_a_network_bind_without_a_credential_is_refused_with_exit_2_saying_how_to_configure_one(
    start: Callable[..., Any], workspace: Path
) -> None:
    port = _free_port()
    s = start("--host", "0.0.0.0", "--port", str(port), wait=False)
    assert s.join() == 2
    text = "\n".join(s.stderr)
    assert "SMTHRS_SERVE_TOKEN" in text and "--token-file" in text and "invalid_options" in text
    assert not any(line.startswith("smthrs serve: listening") for line in s.stderr)
    with socket.socket() as probe:  # nothing ever listened there
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_network_bind_with_smthrs_serve_token_starts_and_requires_that_credential(
    start: Callable[..., Any], workspace: Path, waiting_run: str, state: Any
) -> None:
    s = start("--host", "0.0.0.0", env=_serve_env(workspace, SMTHRS_SERVE_TOKEN=CONFIGURED))
    assert s.url is not None and s.token is None  # no session token printed on a network bind
    assert not any("approval token" in line for line in s.stderr)
    before = state()
    assert s.rpc("cancel", {"run_id": waiting_run}, token=None).status_code == 401
    assert s.rpc("cancel", {"run_id": waiting_run}, token=CONFIGURED[:-1]).status_code == 403
    assert state() == before
    ok = s.rpc("cancel", {"run_id": waiting_run}, token=CONFIGURED)
    assert ok.status_code == 200 and ok.json()["result"]["receipt"]["_tag"] == "Accepted"
    # Not a loopback bind: any Host may address it.
    with httpx.Client(base_url=s.local_url(), timeout=DEADLINE_S) as c:
        assert c.post("/rpc", json={"jsonrpc": "2.0", "id": 1, "method": "runs"}, headers={"Host": "ci.example"}).status_code == 200  # fmt: skip


def test_a_token_file_gives_the_credential_of_a_network_bind(
    start: Callable[..., Any], workspace: Path, tmp_path: Path, waiting_run: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"  {CONFIGURED}\n")
    s = start("--host", "0.0.0.0", "--token-file", str(token_file))
    assert s.url is not None
    assert (
        s.rpc("signal", {"run_id": waiting_run, "name": "approval", "value": 1}, token=CONFIGURED).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("args", "env_token"),
    [((), "too-short"), (("--token-file", "/nonexistent/token"), None)],
    ids=["short-env-token", "missing-token-file"],
)
def test_an_unusable_credential_is_refused_with_exit_2_and_never_shown(
    start: Callable[..., Any], workspace: Path, args: tuple[str, ...], env_token: str | None
) -> None:
    extra = {} if env_token is None else {"SMTHRS_SERVE_TOKEN": env_token}
    s = start("--host", "0.0.0.0", *args, env=_serve_env(workspace, **extra), wait=False)
    assert s.join() == 2
    text = "\n".join(s.stderr)
    assert "invalid_options" in text and (env_token is None or env_token not in text)


def test_a_port_in_use_is_refused_with_exit_2(start: Callable[..., Any], server: Any) -> None:
    s = start("--port", str(server.port), wait=False)
    assert s.join() == 2 and "choose another --port" in "\n".join(s.stderr)


# -- the Host check of a loopback bind --------------------------------------------------------------------------------


def test_a_loopback_server_answers_only_a_loopback_host(server: Any) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "runs"}
    with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
        assert c.post("/rpc", json=body, headers={"Host": "attacker.example"}).status_code == 421
        assert c.post("/rpc", json=body, headers={"Host": f"localhost:{server.port}"}).status_code == 200
        page = c.get("/")
    assert page.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]


# -- graceful shutdown -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_gracefully_with_exit_0_ending_live_streams(
    server: Any, waiting_run: str, sig: int, poll: Callable[..., Any]
) -> None:
    ended = threading.Event()
    lines: list[str] = []

    def follow_http() -> None:
        with (
            httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c,
            c.stream("GET", "/projections", params={"run_id": waiting_run, "follow": "true"}) as r,
        ):
            for line in r.iter_lines():
                lines.append(line)
        ended.set()

    reader = threading.Thread(target=follow_http, daemon=True)
    reader.start()
    ws = connect(f"ws://127.0.0.1:{server.port}/projections?run_id={waiting_run}", open_timeout=DEADLINE_S)
    ws.recv(timeout=DEADLINE_S)
    poll(lambda: lines)  # the HTTP stream is connected and following
    assert server.stop(sig) == 0
    assert ended.wait(DEADLINE_S)  # the followed HTTP stream ended (cleanly: no exception in the reader)
    with pytest.raises(ConnectionClosed):
        while True:
            ws.recv(timeout=DEADLINE_S)
    ws.close()
    assert all(json.loads(line)["run_id"] == waiting_run for line in lines)


# -- a light CLI -------------------------------------------------------------------------------------------------------


def test_importing_the_package_and_smthrs_help_do_not_load_fastapi_or_uvicorn() -> None:
    probe = (
        "import sys, smthrs_plugin, smthrs_plugin.serve, smthrs_plugin.cli\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(smthrs_plugin.cli.app, ['--help'])\n"
        "assert r.exit_code == 0 and 'serve' in r.output and 'signal' in r.output, r.output\n"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the rules, in-process ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("ci.example", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_verdict_needs_the_exact_bearer_credential() -> None:
    auth = ServeAuth(("s" * 32, CONFIGURED))
    assert auth.verdict(None) == "missing"
    assert auth.verdict(f"Bearer {'s' * 32}") == "ok"
    assert auth.verdict(f"bearer {CONFIGURED}") == "ok"
    for wrong in (
        "Bearer",
        "Bearer ",
        f"Basic {CONFIGURED}",
        f"Bearer {CONFIGURED}x",
        f"Bearer {'s' * 31}",
        "",
        "x",
    ):
        assert auth.verdict(wrong) == "wrong", wrong
    assert CONFIGURED not in repr(auth) and "s" * 32 not in repr(auth)


def test_auth_for_bind_refuses_a_network_bind_without_a_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SMTHRS_SERVE_TOKEN", raising=False)
    with pytest.raises(ControlError) as err:
        auth_for_bind("0.0.0.0", None)
    assert err.value.code == "invalid_options" and "SMTHRS_SERVE_TOKEN" in err.value.message
    monkeypatch.setenv("SMTHRS_SERVE_TOKEN", "x" * (MIN_TOKEN_CHARS - 1))
    with pytest.raises(ControlError):
        auth_for_bind("0.0.0.0", None)
    monkeypatch.setenv("SMTHRS_SERVE_TOKEN", CONFIGURED)
    network = auth_for_bind("0.0.0.0", None, Principal("ops", "operator"))
    assert (
        network.tokens == (CONFIGURED,)
        and network.session_token is None
        and str(network.principal) == "ops/operator"
    )
    local = auth_for_bind("127.0.0.1", None)
    assert local.session_token is not None and local.tokens == (local.session_token, CONFIGURED)
