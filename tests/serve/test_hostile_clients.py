"""A REAL ``smthrs serve`` process against hostile clients: requests sent too slowly are closed at their deadline,
open connections are capped per client address and in total (the extra one refused at once while other clients are
served), hostile JSON is a typed JSON-RPC error and never a 500, and a token file that is not a small regular file is
refused before anything listens.

Deadlines are driven with small ``--header-timeout``/``--body-timeout`` values; the tests wait for the close under a
generous deadline and never assert how long anything took. Other addresses of the loopback network (127.0.0.2,
127.0.0.3) stand for other client machines."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from smthrs_plugin.records.journal import Journal
from smthrs_plugin.runtime import Runtime
from smthrs_plugin.serve._auth import MAX_TOKEN_FILE_BYTES
from smthrs_plugin.serve.rpc import INVALID_REQUEST, PARSE_ERROR

State = Callable[[], dict[str, list[tuple[Any, ...]]]]
Poll = Callable[..., Any]
DEADLINE_S = 120.0
LISTENING = "smthrs serve: listening on "
#: Far above any test's duration: a cap test must not see its held connections closed by a deadline.
NO_DEADLINE = "600"


def _open(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(DEADLINE_S)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _half_open(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that sent part of a request's headers and then nothing more (slowloris)."""
    s = _open(port, source)
    s.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _runs_from(port: int, source: str) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as c:
        # ``Connection: close``: the server closes (and uncounts) it before it looks at another connection.
        return c.post(
            "/rpc",
            json={"jsonrpc": "2.0", "id": 1, "method": "runs", "params": {}},
            headers={"Connection": "close"},
        )


def _answers(port: int, source: str) -> bool:
    try:
        return _runs_from(port, source).status_code == 200
    except httpx.TransportError:
        return False  # refused and closed while the server still counts a released connection: not yet


def _refused_503(s: socket.socket) -> dict[str, Any]:
    head, _, body = _read_until_closed(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), head
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == "too_many_connections"
    return error


# -- deadlines ---------------------------------------------------------------------------------------------------------


def test_a_client_sending_headers_too_slowly_is_answered_408_and_closed(start: Callable[..., Any]) -> None:
    server = start("--header-timeout", "0.5")
    with _half_open(server.port) as s:
        head, _, body = _read_until_closed(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert _runs_from(server.port, "127.0.0.1").status_code == 200  # the server itself is fine


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(start: Callable[..., Any]) -> None:
    server = start("--header-timeout", "0.5")
    with _open(server.port) as s:
        # Closed without an answer: a response nobody asked for could be read as the answer to a later request.
        assert _read_until_closed(s) == b""


def test_trickling_header_bytes_does_not_extend_the_header_deadline(start: Callable[..., Any]) -> None:
    server = start("--header-timeout", "0.5")
    closed = False
    with _half_open(server.port) as s:
        s.settimeout(0.05)
        # One more header byte whenever the server stayed silent for a moment: an idle timer would never fire.
        for i in range(int(DEADLINE_S / 0.05)):
            try:
                s.recv(65536)  # an answer (the 408) or the close
                closed = True
                break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
            try:
                s.sendall(b"%d" % (i % 10))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
    assert closed


def test_a_client_sending_its_body_too_slowly_is_closed_and_the_server_keeps_serving(
    start: Callable[..., Any],
) -> None:
    server = start("--body-timeout", "0.5")
    with _open(server.port) as s:
        s.sendall(
            b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        assert _read_until_closed(s) == b""  # no answer: the application may have been reading the body
    assert _runs_from(server.port, "127.0.0.1").status_code == 200
    # The request cut short ends quietly: a disconnect while reading the body is not a bug to log.
    assert not any("Traceback" in line for line in server.stderr), server.stderr


def test_an_honest_request_on_a_kept_alive_connection_gets_a_fresh_header_deadline(
    start: Callable[..., Any],
) -> None:
    server = start("--header-timeout", NO_DEADLINE)
    with httpx.Client(base_url=server.local_url(), timeout=DEADLINE_S) as c:
        for i in range(5):
            r = c.post("/rpc", json={"jsonrpc": "2.0", "id": i, "method": "runs", "params": {}})
            assert r.status_code == 200 and r.json()["id"] == i


# -- connection caps ---------------------------------------------------------------------------------------------------


def test_over_the_per_client_cap_a_connection_is_refused_503_while_another_client_is_served(
    start: Callable[..., Any], poll: Poll
) -> None:
    server = start("--max-client-connections", "3", "--header-timeout", NO_DEADLINE)
    held = [_half_open(server.port) for _ in range(3)]
    try:
        with _open(server.port) as extra:
            error = _refused_503(extra)
        assert error["client"] == "127.0.0.1"
        assert _runs_from(server.port, "127.0.0.2").status_code == 200
    finally:
        for s in held:
            s.close()
    # Closing them releases the address's count.
    poll(lambda: _answers(server.port, "127.0.0.1"))


def test_over_the_total_cap_a_connection_is_refused_503_until_one_closes(
    start: Callable[..., Any], poll: Poll
) -> None:
    server = start("--max-connections", "4", "--max-client-connections", "2", "--header-timeout", NO_DEADLINE)
    held = [
        _half_open(server.port, source) for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2")
    ]
    try:
        with _open(server.port, "127.0.0.3") as extra:
            _refused_503(extra)
        held.pop().close()
        poll(lambda: _answers(server.port, "127.0.0.3"))
    finally:
        for s in held:
            s.close()


def _answers_beside_one_held(port: int) -> bool:
    with _half_open(port):
        return _answers(port, "127.0.0.1")


def test_a_websocket_works_and_counts_against_the_cap_until_it_closes(
    start: Callable[..., Any], rt: Runtime, poll: Poll
) -> None:
    rt.runs.create("ticks", "ci/ticks")
    Journal(rt.db).append("ticks", "test.tick", {"i": 0})
    server = start("--max-client-connections", "2", "--header-timeout", NO_DEADLINE)
    url = f"ws://127.0.0.1:{server.port}/projections?run_id=ticks"
    with connect(url, open_timeout=DEADLINE_S) as ws:
        event = json.loads(ws.recv(timeout=DEADLINE_S))  # the projection works through the guarded protocol
        assert "error" not in event, event
        with _half_open(server.port), _open(server.port) as third:
            _refused_503(third)
    # Both released once closed: a request is answered beside a held connection (2 of 2)...
    poll(lambda: _answers_beside_one_held(server.port))
    # ... and released once only: the cap still holds. (The connection held a moment ago may not be uncounted yet,
    # so one or two of three are refused; none would mean the count went below what is open.)
    held = [_half_open(server.port) for _ in range(3)]
    try:
        # A selector, not select(): a busy test process's descriptors may be numbered past select()'s 1024.
        with selectors.DefaultSelector() as sel:
            for s in held:
                sel.register(s, selectors.EVENT_READ)
            readable = [key.fileobj for key, _ in sel.select(DEADLINE_S)]
        assert readable, "no connection over the cap was refused"
        for s in readable:
            _refused_503(s)  # type: ignore[arg-type]
    finally:
        for s in held:
            s.close()


# -- hostile JSON ------------------------------------------------------------------------------------------------------


def _body(params: str | bytes, *, method: str = "approve") -> bytes:
    raw = params if isinstance(params, bytes) else params.encode()
    return b'{"jsonrpc": "2.0", "id": 1, "method": "%s", "params": %s}' % (method.encode(), raw)


HOSTILE_JSON: list[tuple[str, bytes, int, int, str]] = [
    # (id, body, HTTP status, JSON-RPC code, data.bound or data.code)
    ("huge-int-param", _body('{"ident": ' + "1" * 5000 + "}"), 400, PARSE_ERROR, "number"),
    (
        "huge-int-id",
        b'{"jsonrpc": "2.0", "id": ' + b"9" * 5000 + b', "method": "runs"}',
        400,
        PARSE_ERROR,
        "number",
    ),
    ("huge-negative-int", _body('{"ident": -' + "7" * 4301 + "}"), 400, PARSE_ERROR, "number"),
    ("duplicate-param", _body('{"ident": "a", "ident": "b"}'), 400, PARSE_ERROR, "duplicate_member"),
    (
        "duplicate-method",
        b'{"jsonrpc": "2.0", "id": 1, "method": "runs", "method": "cancel"}',
        400,
        PARSE_ERROR,
        "duplicate_member",
    ),  # fmt: skip
    ("deep-nesting", _body('{"ident": ' + "[" * 300 + "]" * 300 + "}"), 400, PARSE_ERROR, "depth"),
    (
        "deep-objects",
        _body('{"ident": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}"),
        400,
        PARSE_ERROR,
        "depth",
    ),
    ("invalid-utf8", _body(b'{"ident": "\xc3("}'), 400, PARSE_ERROR, "well_formed_text"),
    ("lone-surrogate", _body('{"ident": "\\ud800"}'), 400, PARSE_ERROR, "well_formed_text"),
    ("infinity", _body('{"ident": 1e999}'), 400, PARSE_ERROR, "number"),
    ("empty-body", b"", 400, PARSE_ERROR, "plain_data"),
    ("missing-method", b'{"jsonrpc": "2.0", "id": 1, "params": {}}', 400, INVALID_REQUEST, "invalid_options"),
    (
        "method-not-a-string",
        b'{"jsonrpc": "2.0", "id": 1, "method": ["runs"]}',
        400,
        INVALID_REQUEST,
        "invalid_options",
    ),  # fmt: skip
    (
        "id-a-float",
        b'{"jsonrpc": "2.0", "id": 1.5, "method": "runs"}',
        400,
        INVALID_REQUEST,
        "invalid_options",
    ),
    (
        "id-an-object",
        b'{"jsonrpc": "2.0", "id": {}, "method": "runs"}',
        400,
        INVALID_REQUEST,
        "invalid_options",
    ),
    ("batch", b'[{"jsonrpc": "2.0", "id": 1, "method": "runs"}]', 400, INVALID_REQUEST, "invalid_options"),
    ("empty-batch", b"[]", 400, INVALID_REQUEST, "invalid_options"),
    ("string-body", b'"runs"', 400, INVALID_REQUEST, "invalid_options"),
    ("null-body", b"null", 400, INVALID_REQUEST, "invalid_options"),
    (
        "params-null",
        b'{"jsonrpc": "2.0", "id": 1, "method": "runs", "params": null}',
        200,
        -32602,
        "invalid_options",
    ),  # fmt: skip
    ("limit-a-string", _body('{"limit": "10"}', method="runs"), 200, -32602, "invalid_options"),
    ("path-with-nul", _body('{"path": "plan\\u0000.yaml"}', method="plan"), 200, -32602, "invalid_options"),
    ("path-not-a-file", _body('{"path": "."}', method="plan"), 200, -32602, "invalid_options"),
    ("path-too-long", _body('{"path": "%s"}' % ("x" * 5000), method="plan"), 200, -32602, "invalid_options"),
]


def test_hostile_json_is_a_typed_json_rpc_error_never_a_500(server: Any, state: State) -> None:
    # One server for every case (each starts a process otherwise); a failure lists the cases that went wrong.
    before = state()
    wrong: dict[str, Any] = {}
    for case, body, status, code, what in HOSTILE_JSON:
        r = server.post(body)
        try:
            error = r.json()["error"]
            ok = (r.status_code, error["code"]) == (status, code) and what in (
                error["data"].get("bound"),
                error["data"]["code"],
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            wrong[case] = (r.status_code, r.text[:300])
    assert not wrong, wrong
    assert state() == before


def test_duplicate_members_cannot_approve_the_second_ident(server: Any, card: Any, state: State) -> None:
    before = state()
    r = server.post(_body(json.dumps({"ident": "no-such-plan"})[:-1] + f', "ident": "{card.plan_id}"}}'))
    assert r.status_code == 400 and r.json()["error"]["data"]["bound"] == "duplicate_member"
    assert state() == before


def _signal_cli(workspace: Path, value: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "signal", "some-run", "approval", "--value", value],
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if k != "SMTHRS_DB_URL"},
            "SMTHRS_WORKSPACE": str(workspace),
        },
        timeout=DEADLINE_S,
    )


@pytest.mark.parametrize(
    ("value", "bound"),
    [("1" * 5000, "number"), ('{"a": 1, "a": 2}', "duplicate_member"), ("[" * 300 + "]" * 300, "depth")],
    ids=["huge-int", "duplicate-member", "deep"],
)
def test_smthrs_signal_refuses_a_hostile_value_with_exit_2(workspace: Path, value: str, bound: str) -> None:
    done = _signal_cli(workspace, value)
    assert done.returncode == 2, done.stderr
    assert "invalid_input" in done.stderr and f"bound {bound!r}" in done.stderr
    assert "Traceback" not in done.stderr


# -- the token file ----------------------------------------------------------------------------------------------------


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "token.fifo"
    os.mkfifo(path)
    yield path


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory", "oversized"])
def test_a_token_file_that_is_not_a_small_regular_file_is_refused_before_listening(
    start: Callable[..., Any], tmp_path: Path, fifo: Path, kind: str
) -> None:
    big = tmp_path / "big"
    big.write_text("t" * (MAX_TOKEN_FILE_BYTES + 1))
    path = {"dev-zero": "/dev/zero", "fifo": str(fifo), "directory": str(tmp_path), "oversized": str(big)}[
        kind
    ]
    s = start("--host", "0.0.0.0", "--token-file", path)
    assert s.join() == 2 and s.url is None
    assert not any(line.startswith(LISTENING) for line in s.stderr)
    text = "\n".join(s.stderr)
    assert "invalid_options" in text and "--token-file" in text and "Traceback" not in text
    assert ("not a regular file" if kind != "oversized" else f"larger than {MAX_TOKEN_FILE_BYTES}") in text


@pytest.mark.parametrize(
    "args",
    [
        ("--header-timeout", "0"),
        ("--body-timeout", "-1"),
        ("--header-timeout", "nan"),
        ("--max-connections", "0"),
        ("--max-client-connections", "0"),
        ("--max-connections", str(10**9)),
    ],
    ids=[
        "header-zero",
        "body-negative",
        "header-nan",
        "total-zero",
        "client-zero",
        "total-over-the-file-limit",
    ],
)
def test_a_limit_out_of_range_is_refused_before_listening(
    start: Callable[..., Any], args: tuple[str, str]
) -> None:
    s = start(*args)
    assert s.join() == 2 and s.url is None
    assert "invalid_options" in "\n".join(s.stderr)
