"""``POST /rpc`` of a REAL ``smthrs serve`` process: every verb with and without the token, the operator principal,
idempotent retries, the CLI's JSON objects, and hostile bodies refused with nothing written. A few pure cases of the
JSON-RPC parser run in-process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from smthrs_plugin.control.identity import MAX_CANONICAL_BYTES
from smthrs_plugin.runtime import Runtime
from smthrs_plugin.serve._app import STATIC_DIR
from smthrs_plugin.serve.rpc import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    MUTATIONS,
    PARSE_ERROR,
    READS,
    RpcFailure,
    parse_call,
)
from smthrs_plugin.serve.wire import MAX_BODY_BYTES

State = Callable[[], dict[str, list[tuple[Any, ...]]]]


def _cli(workspace: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SMTHRS_DB_URL"}
    env["SMTHRS_WORKSPACE"] = str(workspace)
    return subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _mutation_params(
    name: str, card: Any, parked_run: str, waiting_run: str, plan_text: str
) -> dict[str, Any]:
    return {
        "plan": {"text": plan_text.replace("plan: release", "plan: other")},
        "approve": {"ident": card.plan_id},
        "deny": {"ident": parked_run},
        "cancel": {"run_id": parked_run},
        "resume": {"run_id": waiting_run, "key": "resume:1"},
        "signal": {"run_id": waiting_run, "name": "approval", "value": {"ok": True}},
    }[name]


@pytest.fixture
def setup(card: Any, parked_run: str, waiting_run: str, plan_text: str) -> Callable[[str], dict[str, Any]]:
    """Valid params for every mutation against one workspace holding a plan card (its approval decided by the
    parked run's admission), a run parked on its node request and a run parked on a wait."""
    return lambda name: _mutation_params(name, card, parked_run, waiting_run, plan_text)


# -- the credential -------------------------------------------------------------------------------------------------


def test_every_read_answers_without_a_token(server: Any, parked_run: str, card: Any) -> None:
    assert {r["run_id"] for r in server.result("runs", {}, token=None)["runs"]} == {parked_run}
    assert server.result("show", {"run_id": parked_run}, token=None)["run"]["status"] == "parked"
    pending = server.result("review.pending", {}, token=None)
    assert [r["run_id"] for r in pending["requests"]] == [parked_run]
    assert server.result("review.card", {"ident": card.plan_id}, token=None)["plan_id"] == card.plan_id
    assert {"show", "runs", "review.pending", "review.card", "review.history"} == READS
    # ... and with it, or with a wrong one: a read never looks at the credential.
    for token in ("session", "wrong-token-wrong-token"):
        assert server.result("show", {"run_id": parked_run}, token=token)["run"]["run_id"] == parked_run


#: (how the credential is wrong, the status it gets); ``almost``/``with-suffix`` are derived from the real token.
_WRONG_TOKENS = [
    ("missing", None, 401),
    ("wrong", "not-the-token-at-all", 403),
    ("one-char-off", "almost", 403),
    ("token-plus-suffix", "with-suffix", 403),
]


def test_every_mutation_is_refused_without_the_token_and_writes_nothing(
    server: Any, setup: Callable[[str], dict[str, Any]], state: State
) -> None:
    # Every mutation with every wrong credential against one server and one workspace: a refusal writes nothing,
    # so each call sees the same state (one server start in all, not one per method: each costs ~2 s under load).
    for method in sorted(MUTATIONS):
        for how, token, status in _WRONG_TOKENS:
            if token == "almost":
                token = server.token[:-1] + ("A" if server.token[-1] != "A" else "B")
            elif token == "with-suffix":
                token = server.token + "x"
            case = (method, how)
            before = state()
            r = server.rpc(method, setup(method), token=token)
            # the server's own log goes with the failure, should it answer 500
            assert r.status_code == status, (case, r.text, server.stderr[-30:])
            assert r.json()["error"]["data"]["code"] == "unauthorized", case
            assert status == 403 or r.headers["www-authenticate"].startswith("Bearer"), case
            assert server.token not in r.text, case
            assert state() == before, case


def test_another_auth_scheme_is_a_wrong_credential(server: Any, state: State) -> None:
    before = state()
    with httpx.Client(base_url=server.local_url()) as c:
        r = c.post(
            "/rpc",
            json={"jsonrpc": "2.0", "id": 1, "method": "cancel", "params": {"run_id": "x"}},
            headers={"Authorization": f"Basic {server.token}"},
        )
    assert r.status_code == 403 and state() == before


@pytest.mark.parametrize("method", sorted(MUTATIONS))
def test_every_mutation_answers_with_the_token(
    server: Any, setup: Callable[[str], dict[str, Any]], method: str, plan_text: str
) -> None:
    params = setup(method)
    if method == "approve":  # the fixture's card was approved to admit the parked run: approve a fresh one
        fresh = server.result("plan", {"text": plan_text.replace("plan: release", "plan: fresh")})
        params = {"ident": fresh["plan_id"]}
    body = server.rpc(method, params).json()
    assert "result" in body, body
    result = body["result"]
    if method == "plan":
        assert result["approval_state"] == "pending" and result["card"]["planId"] == result["plan_id"]
    else:
        assert result["receipt"]["_tag"] == "Accepted" and "type" not in result["receipt"], result


# -- the operator principal --------------------------------------------------------------------------------------------


def test_a_principal_in_the_request_is_ignored_and_the_decision_is_the_operators(
    server: Any, card: Any, rt: Runtime
) -> None:
    params = {
        "ident": card.plan_id,
        "principal": {"id": "mallory", "kind": "operator"},
        "as": "mallory/operator",
        "as_": "mallory/operator",
    }
    result = server.result("approve", params)
    assert result["receipt"]["_tag"] == "Accepted" and result["plan_id"] == card.plan_id
    who = rt.db.read(
        lambda c: c.execute(sa.text("SELECT principal_id, principal_kind FROM control_decisions")).all()
    )
    assert [tuple(w) for w in who] == [("local", "operator")]


def test_the_configured_operator_principal_is_who_acts(
    start: Callable[..., Any], waiting_run: str, rt: Runtime
) -> None:
    server = start("--as", "release-desk/operator")
    params = {"run_id": waiting_run, "name": "approval", "value": 1, "principal": {"id": "x", "kind": "y"}}
    assert server.result("signal", params)["receipt"]["_tag"] == "Accepted"
    payload = rt.db.read(
        lambda c: c.execute(
            sa.text("SELECT payload_json FROM journal_events WHERE type = 'control.signal.delivered'")
        ).scalar_one()
    )
    assert json.loads(payload)["principal"] == {"id": "release-desk", "kind": "operator"}


# -- idempotent retries ------------------------------------------------------------------------------------------------


def test_a_retried_approve_is_already_applied_and_writes_nothing(
    server: Any, card: Any, state: State
) -> None:
    first = server.result("approve", {"ident": card.plan_id, "key": "approve:release"})
    assert first["receipt"]["_tag"] == "Accepted"
    before = state()
    again = server.result("approve", {"ident": card.plan_id, "key": "approve:release"})
    assert again["receipt"]["_tag"] == "AlreadyApplied"
    assert again["receipt"]["receiptId"] == first["receipt"]["receiptId"]
    assert state() == before


def test_a_retried_signal_is_already_applied_and_another_value_under_its_key_conflicts(
    server: Any, waiting_run: str, state: State, rt: Runtime
) -> None:
    params = {"run_id": waiting_run, "name": "approval", "value": {"ok": True}, "key": "answer:1"}
    first = server.result("signal", params)
    assert first["receipt"]["_tag"] == "Accepted" and first["status"] == "pending"  # woken
    before = state()
    assert server.result("signal", params)["receipt"]["_tag"] == "AlreadyApplied"
    conflict = server.result("signal", {**params, "value": {"ok": False}})
    assert conflict["receipt"]["_tag"] == "Conflict"
    assert state() == before


def test_a_node_approval_over_rpc_wakes_the_parked_run(server: Any, parked_run: str, rt: Runtime) -> None:
    result = server.result("approve", {"ident": parked_run})
    assert result["receipt"]["_tag"] == "Accepted" and result["run_id"] == parked_run
    assert result["status"] == "pending" and result["requests"] == []
    assert rt.control().show(parked_run).status == "pending"


def test_deny_and_cancel_answer_their_receipts(server: Any, parked_run: str, card: Any) -> None:
    denied = server.result("deny", {"ident": parked_run, "request": "ship"})
    assert denied["receipt"]["_tag"] == "Accepted" and denied["plan_id"] == card.plan_id
    cancelled = server.result("cancel", {"run_id": parked_run, "reason": "changed my mind"})
    assert cancelled["receipt"]["_tag"] in ("Accepted", "Terminal")


def test_resume_records_the_resume_and_leaves_driving_to_a_driver(
    server: Any, waiting_run: str, rt: Runtime, driver: Any
) -> None:
    result = server.result("resume", {"run_id": waiting_run, "key": "resume:1"})
    assert result["receipt"]["_tag"] == "Accepted"
    assert result["settlements"] == [] and result["owner"] is None
    types = rt.db.read(
        lambda c: (
            c.execute(
                sa.text("SELECT type FROM journal_events WHERE partition = :p ORDER BY seq"),
                {"p": waiting_run},
            )
            .scalars()
            .all()
        )
    )
    assert types[-1] == "control.run.resume"
    assert rt.control().show(waiting_run).status == "suspended"  # the server did not drive it
    assert (
        server.result("resume", {"run_id": waiting_run, "key": "resume:1"})["receipt"]["_tag"]
        == "AlreadyApplied"
    )


def test_a_refusal_is_a_json_rpc_error_with_the_typed_code(server: Any, state: State) -> None:
    before = state()
    r = server.rpc("signal", {"run_id": "no-such-run", "name": "approval", "value": 1})
    assert r.status_code == 200
    error = r.json()["error"]
    assert (
        error["code"] == -32000 and error["data"]["code"] == "run_not_found" and "cause" not in error["data"]
    )
    assert r.json()["id"] == 1
    missing = server.rpc("show", {"run_id": "no-such-run"}, token=None).json()["error"]
    assert missing["data"]["code"] == "run_not_found"
    assert state() == before


# -- the CLI's JSON objects ----------------------------------------------------------------------------------------------


def test_plan_show_and_runs_answer_what_the_cli_prints(
    server: Any, workspace: Path, plan_text: str, parked_run: str
) -> None:
    (workspace / "other.yaml").write_text(plan_text.replace("plan: release", "plan: other"))
    over_rpc = server.result("plan", {"path": "other.yaml"})
    cli = _cli(workspace, "plan", str(workspace / "other.yaml"), "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == over_rpc  # idempotent per content: the same card both ways

    shown = _cli(workspace, "show", parked_run, "--json")
    assert json.loads(shown.stdout) == server.result("show", {"run_id": parked_run}, token=None)
    listed = _cli(workspace, "runs", "--json")
    assert json.loads(listed.stdout) == server.result("runs", {}, token=None)


def test_a_parked_resume_names_its_run_as_smthrs_resume_does(
    server: Any, workspace: Path, parked_run: str, card: Any
) -> None:
    over_rpc = server.result("resume", {"run_id": parked_run, "key": "resume:rpc"})
    cli = _cli(workspace, "resume", parked_run, "--key", "resume:cli", "--json", "--no-wait")
    assert cli.returncode == 75, cli.stderr  # parked
    from_cli = json.loads(cli.stdout)
    assert set(from_cli) == set(over_rpc) and set(from_cli["receipt"]) == set(over_rpc["receipt"])
    # The Parked receipt names only the plan; the answer still names the run, in the CLI's words.
    assert over_rpc["receipt"]["_tag"] == "Parked" and "runId" not in over_rpc["receipt"]
    for answer in (over_rpc, from_cli):
        assert (answer["run_id"], answer["status"], answer["waiting_reason"]) == (
            parked_run,
            "parked",
            "approval",
        )
        assert (answer["plan_id"], answer["digest"]) == (card.plan_id, card.digest)
        [request] = answer["requests"]
        assert (
            request["request_id"] == "ship" and request["key"].startswith("key1_") and "digest" not in request
        )
    assert from_cli["requests"] == over_rpc["requests"]


def test_show_and_runs_speak_the_cli_vocabulary_and_refuse_a_stored_name(
    server: Any, parked_run: str, waiting_run: str
) -> None:
    parked = server.result("show", {"run_id": parked_run}, token=None)["run"]
    assert (parked["status"], parked["waiting_reason"], parked["wait"]["reason"]) == (
        "parked",
        "approval",
        "approval",
    )
    assert "kind" not in parked["wait"] and type(parked["created_at_ms"]) is int
    signal = server.result("show", {"run_id": waiting_run}, token=None)["run"]
    assert (signal["status"], signal["waiting_reason"]) == ("parked", "signal")
    listed = server.result("runs", {"status": "parked", "waiting": "approval"}, token=None)["runs"]
    assert [r["run_id"] for r in listed] == [parked_run]
    for params in ({"status": "suspended"}, {"waiting": "waiting-approval"}, {"waiting": "event"}):
        error = server.rpc("runs", params, token=None).json()["error"]
        assert error["code"] == INVALID_PARAMS and error["data"]["code"] == "invalid_options", error


def test_signal_answers_the_object_smthrs_signal_prints(server: Any, workspace: Path, driver: Any) -> None:
    from smthrs_plugin.engine.drive.active_run import DriveParked

    for rid in ("w-cli", "w-rpc"):
        driver.submit(rid, "gate")
        assert isinstance(driver.drive(rid), DriveParked)
    cli = _cli(workspace, "signal", "w-cli", "approval", "--value", "[1]", "--json")
    assert cli.returncode == 0, cli.stderr
    over_rpc = server.result("signal", {"run_id": "w-rpc", "name": "approval", "value": [1]})
    from_cli = json.loads(cli.stdout)
    assert set(from_cli) == set(over_rpc) and set(from_cli["receipt"]) == set(over_rpc["receipt"])
    assert (
        (from_cli["status"], from_cli["name"])
        == (over_rpc["status"], over_rpc["name"])
        == ("pending", "approval")
    )


def test_plan_refuses_a_path_outside_the_workspace(
    server: Any, tmp_path: Path, plan_text: str, state: State
) -> None:
    outside = tmp_path / "outside.yaml"
    outside.write_text(plan_text)
    before = state()
    for path in (str(outside), "../outside.yaml"):
        error = server.rpc("plan", {"path": path}).json()["error"]
        assert error["code"] == INVALID_PARAMS and "outside the server's workspace" in error["message"]
    assert state() == before


# -- hostile bodies ------------------------------------------------------------------------------------------------------


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v


def _signal(value: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": "signal", "params": {"run_id": "waiting-1", "name": "approval",
                                                                      "value": value}}  # fmt: skip


HOSTILE: list[tuple[str, Any, int, int, str | None]] = [
    # (id, body, HTTP status, JSON-RPC code, data.bound or data.code)
    ("malformed-json", b'{"jsonrpc": "2.0", "id": 1, "method": ', 400, PARSE_ERROR, "plain_data"),
    ("not-utf8", b'{"jsonrpc": "2.0", "id": 1, "method": "\xff"}', 400, PARSE_ERROR, "well_formed_text"),
    (
        "nan",
        b'{"jsonrpc": "2.0", "id": 1, "method": "signal", "params": {"value": NaN}}',
        400,
        PARSE_ERROR,
        "number",
    ),
    ("parser-deep", ("[" * 100_000 + "]" * 100_000).encode(), 400, PARSE_ERROR, "depth"),
    ("batch", [{"jsonrpc": "2.0", "id": 1, "method": "runs"}], 400, INVALID_REQUEST, "invalid_options"),
    ("not-an-object", "17", 400, INVALID_REQUEST, "invalid_options"),
    ("no-version", {"id": 1, "method": "runs"}, 400, INVALID_REQUEST, "invalid_options"),
    (
        "notification",
        {"jsonrpc": "2.0", "method": "cancel", "params": {"run_id": "waiting-1"}},
        400,
        INVALID_REQUEST,
        "invalid_options",
    ),  # fmt: skip
    (
        "unknown-method",
        {"jsonrpc": "2.0", "id": 1, "method": "drop_tables"},
        200,
        METHOD_NOT_FOUND,
        "invalid_options",
    ),
    (
        "params-array",
        {"jsonrpc": "2.0", "id": 1, "method": "cancel", "params": ["waiting-1"]},
        200,
        INVALID_PARAMS,
        "invalid_options",
    ),  # fmt: skip
    (
        "wrong-type",
        {"jsonrpc": "2.0", "id": 1, "method": "cancel", "params": {"run_id": 42}},
        200,
        INVALID_PARAMS,
        "plain_data",
    ),  # fmt: skip
    (
        "unknown-param",
        {"jsonrpc": "2.0", "id": 1, "method": "resume", "params": {"run_id": "waiting-1", "kee": "k"}},
        200,
        INVALID_PARAMS,
        "invalid_options",
    ),  # fmt: skip
    (
        "missing-param",
        {"jsonrpc": "2.0", "id": 1, "method": "signal", "params": {"run_id": "waiting-1"}},
        200,
        INVALID_PARAMS,
        "invalid_options",
    ),  # fmt: skip
    ("too-deep", _signal(_deep(129)), 200, INVALID_PARAMS, "depth"),
    ("too-many-values", _signal(list(range(99_997))), 200, INVALID_PARAMS, "values"),
    ("too-many-entries", _signal(list(range(100_001))), 200, INVALID_PARAMS, "entries"),
    ("huge-int", _signal(2**60), 200, INVALID_PARAMS, "number"),
    (
        "empty-key",
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "signal",
            "params": {"run_id": "waiting-1", "name": "a", "value": 1, "key": ""},
        },
        200,
        INVALID_PARAMS,
        "idempotency_key",
    ),  # fmt: skip
]


def test_a_hostile_body_is_refused_and_writes_nothing(server: Any, waiting_run: str, state: State) -> None:
    # Every hostile body against one server and one workspace: a refusal writes nothing, so each sees the same
    # state (one server start for all of them).
    for name, body, status, code, what in HOSTILE:
        before = state()
        r = server.post(body if isinstance(body, (bytes, dict, list)) else body.encode())
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert error["code"] == code, name
        if what is not None:
            assert what in (error["data"].get("bound"), error["data"]["code"]), (name, error)
        assert state() == before, name


def test_a_body_over_the_bound_is_refused_413_by_its_content_length_before_it_is_sent(
    server: Any, state: State
) -> None:
    # Only the headers go out: the server answers without waiting for (or buffering) a byte of the body.
    before = state()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(
            b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1073741824\r\n\r\n"
        )
        head = s.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head
    assert state() == before


def test_a_streamed_body_over_the_bound_is_refused_413_once_it_passes_the_bound(
    server: Any, waiting_run: str, state: State
) -> None:
    before = state()
    prefix = b'{"jsonrpc": "2.0", "id": 1, "method": "signal", "params": {"run_id": "waiting-1", "name": "a", "value": "'
    chunk = b"x" * 65536
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(b"POST /rpc HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        s.sendall(b"%x\r\n%s\r\n" % (len(prefix), prefix))
        try:
            while sent <= MAX_BODY_BYTES + 4 * len(chunk):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed while we were still sending: what is being tested
        head = s.recv(65536).decode("latin-1")
    assert head.startswith("HTTP/1.1 413"), head
    assert state() == before


def test_a_body_just_under_the_bound_is_read_and_refused_by_the_identity_boundary(
    server: Any, waiting_run: str, state: State
) -> None:
    before = state()
    body = _signal("x" * (MAX_CANONICAL_BYTES + 1))
    r = server.post(body)
    assert r.status_code == 200 and r.json()["error"]["data"]["bound"] == "canonical_bytes"
    assert state() == before


# -- the parser, in-process ----------------------------------------------------------------------------------------------


def test_parse_call_keeps_the_request_id_of_a_refused_request() -> None:
    with pytest.raises(RpcFailure) as err:
        parse_call(b'{"jsonrpc": "1.0", "id": "abc", "method": "runs"}')
    assert err.value.request_id == "abc" and err.value.response()["id"] == "abc"


def test_parse_call_takes_an_absent_params_as_an_empty_object() -> None:
    call = parse_call(b'{"jsonrpc": "2.0", "id": 3, "method": "review.pending"}')
    assert (call.id, call.method, call.params, call.mutation) == (3, "review.pending", {}, False)


@pytest.fixture(autouse=True)
def _no_leftover_env() -> Iterator[None]:
    # A developer's credential must not change what these tests see (the server fixture drops it too).
    saved = os.environ.pop("SMTHRS_SERVE_TOKEN", None)
    yield
    if saved is not None:
        os.environ["SMTHRS_SERVE_TOKEN"] = saved


# -- the page's files ------------------------------------------------------------------------------------------------


def test_the_review_page_and_its_static_files_are_served_and_nothing_beside_them(server: Any) -> None:
    with httpx.Client(base_url=server.local_url(), timeout=120) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert c.get("/static/app.js").status_code == 200
        for probe in (
            "/static/../_app.py",
            "/static/%2e%2e/_app.py",
            "/static/nope.js",
            "/docs",
            "/openapi.json",
        ):
            assert c.get(probe).status_code == 404, probe


_SCRIPT_TAG = re.compile(r"<script\b([^>]*)>", re.I)
_IMPORT_FROM = re.compile(r'^import\b[^;]*?\bfrom\s+"\./([\w.-]+\.js)";', re.M)
_JS_TYPES = ("text/javascript", "application/javascript")


def test_the_review_page_loads_one_module_script_whose_imports_are_all_served_as_javascript(
    server: Any,
) -> None:
    # A module script (and every module it imports) is refused by the browser unless served with a JavaScript MIME
    # type and allowed by the page's Content-Security-Policy; a module missing from the static files breaks the page.
    with httpx.Client(base_url=server.local_url(), timeout=120) as c:
        page = c.get("/")
        tags = _SCRIPT_TAG.findall(page.text)
        assert tags == [' type="module" src="/static/app.js"'], tags
        csp = page.headers["content-security-policy"]
        script_src = [
            d.split()[1:] for d in csp.split(";") if d.split()[:1] in (["script-src"], ["default-src"])
        ]
        assert all("'self'" in sources for sources in script_src), csp
        reached: set[str] = set()
        todo = ["app.js"]
        while todo:
            name = todo.pop()
            if name in reached:
                continue
            reached.add(name)
            answer = c.get("/static/" + name)
            assert answer.status_code == 200, name
            assert answer.headers["content-type"].split(";")[0].strip() in _JS_TYPES, (name, answer.headers)
            todo.extend(_IMPORT_FROM.findall(answer.text))
    # Every script shipped is reached from the entry: none is dead weight, none loads by another path.
    assert reached == {p.name for p in STATIC_DIR.glob("*.js")}
