"""Hostile and mistaken command-line input is refused with the right exit code: a forged cursor whose
integers overflow is ``invalid_cursor`` (exit 2), never a traceback; an unknown run is exit 2 for every command; a
bogus ``--scope`` is refused input (exit 2), not "unauthorized"; a ``deny`` — and a retried run it failed — exits 3
on every identical retry. In-process through the real typer app, on SQLite workspaces."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from smthrs_plugin.canonical import sha256_hex
from smthrs_plugin.cli import app
from smthrs_plugin.control.authority import NodeTarget
from smthrs_plugin.control.facade import Control
from smthrs_plugin.control.identity import Principal
from smthrs_plugin.errors import ControlError, InvalidInput
from smthrs_plugin.observe.catalog import RunFilters, list_runs
from smthrs_plugin.observe.snapshot import related
from smthrs_plugin.observe.watch import watch
from smthrs_plugin.stores.database import Database, open_database

GATED = """\
plan: gate
flow: ci/gate
nodes:
  - id: build
    run: "true"
  - id: deploy
    run: "true"
    needs: [build]
    approval: {request: ship, envelope: {capabilities: ["deploy:prod"]}}
"""


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "gate.yaml").write_text(GATED)
    return ws


def smthrs(ws: Path, *args: str) -> tuple[int, Any]:
    db = f"sqlite:///{(ws / 'state.db').as_posix()}"
    opts = ["--db", db] if args[0] in ("watch", "runs", "show") else ["--db", db, "--workspace", str(ws)]
    argv = [str(ws / a) if a.endswith(".yaml") else a for a in args]  # plan files by absolute path
    result = CliRunner().invoke(app, [*argv, *opts, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    out = result.stdout.strip()
    return result.exit_code, json.loads(out.splitlines()[-1]) if out else None


def forge(kind: str, source: str, body: dict[str, Any]) -> str:
    """A cursor built by hand, as an attacker would: the check is a public hash, not a signature."""
    payload = json.dumps({"v": 1, "kind": kind, "src": source, **body}, sort_keys=True).encode()
    text = base64.urlsafe_b64encode(payload).decode("ascii").rstrip("=")
    return f"smc1.{text}.{sha256_hex(payload)[:16]}"


def _db(ws: Path) -> Database:
    return open_database(f"sqlite:///{(ws / 'state.db').as_posix()}")


# -- cursors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("at", [2**70, 2**63, -1, 1.5, 1e400])
def test_a_forged_runs_cursor_with_an_out_of_range_integer_is_invalid_cursor_exit_2(
    ws: Path, at: Any
) -> None:
    db = _db(ws)
    forged = forge("runs", db.source_id, {"f": "x", "at": at, "id": "r"})
    with pytest.raises(ControlError) as err:
        list_runs(db, RunFilters(), cursor=forged)
    assert err.value.code == "invalid_cursor"
    code, out = smthrs(ws, "runs", "--cursor", forged)
    assert code == 2 and out["error"]["code"] == "invalid_cursor"


def test_forged_watch_and_related_cursors_are_range_checked_too(ws: Path) -> None:
    db = _db(ws)
    with pytest.raises(ControlError) as err:
        watch(db, "r", after_cursor=forge("watch", db.source_id, {"p": "r", "s": 2**64}))
    assert err.value.code == "invalid_cursor"
    forged_related = forge("related", db.source_id, {"anchor": "r", "rel": "children", "key": [2**70, "x"]})
    with pytest.raises(ControlError) as err:
        related(db, "r", "children", cursor=forged_related)
    assert err.value.code == "invalid_cursor"
    code, out = smthrs(ws, "watch", "r", "--after-cursor", forge("watch", db.source_id, {"p": "r", "s": -5}))
    assert code == 2 and out["error"]["code"] == "invalid_cursor"


def test_a_forged_cursor_nested_past_the_parser_stack_is_invalid_cursor_not_a_traceback(ws: Path) -> None:
    _db(ws)  # `runs` reads an existing database (it never creates one)
    payload = b"[" * 40_000 + b"]" * 40_000
    body = base64.urlsafe_b64encode(payload).decode("ascii").rstrip("=")
    code, out = smthrs(ws, "runs", "--cursor", f"smc1.{body}.{sha256_hex(payload)[:16]}")
    assert code == 2 and out["error"]["code"] == "invalid_cursor"


# -- unknown runs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("watch", "NO_SUCH_RUN"),
        ("watch", "NO_SUCH_RUN", "--follow", "--max-events", "1"),
        ("show", "NO_SUCH_RUN"),
        ("cancel", "NO_SUCH_RUN"),
        ("resume", "NO_SUCH_RUN", "--key", "k"),
        ("approve", "NO_SUCH_RUN"),
        ("approve", "NO_SUCH_RUN", "--request", "ship"),
        ("deny", "NO_SUCH_RUN"),
        ("deny", "NO_SUCH_RUN", "--request", "ship"),
        ("run", "NO_SUCH_PLAN", "--key", "k"),
    ],
)
def test_an_unknown_run_exits_2_for_every_command(ws: Path, argv: tuple[str, ...]) -> None:
    assert smthrs(ws, "plan", "gate.yaml")[0] == 0  # a database with something in it
    code, out = smthrs(ws, *argv)
    assert code == 2, out


# -- --scope --------------------------------------------------------------------------------------------------


def test_a_bogus_scope_is_refused_input_exit_2_not_unauthorized(ws: Path) -> None:
    code, card = smthrs(ws, "plan", "gate.yaml")
    assert code == 0
    for who in ([], ["--as", "mallory/human"]):
        code, out = smthrs(ws, "approve", card["plan_id"], "--scope", "bogus", *who)
        assert code == 2 and out["error"]["code"] == "invalid_input", out
    code, out = smthrs(ws, "approve", "NO_SUCH_PLAN", "--scope", "bogus")
    assert code == 2 and out["error"]["code"] == "invalid_input"  # before anything is looked up


def test_the_control_plane_refuses_a_bogus_scope_before_asking_the_authority(ws: Path) -> None:
    control = Control(_db(ws))
    target = NodeTarget("r", "ship", "0" * 64)
    with pytest.raises(InvalidInput) as err:
        control.approve(target, scope="bogus", principal=Principal.parse("mallory/human"))
    assert err.value.code == "invalid_input"


# -- deny ----------------------------------------------------------------------------------------------------


def test_a_denied_node_approval_exits_3_on_every_identical_retry(ws: Path) -> None:
    code, out = smthrs(ws, "run", "gate.yaml", "--key", "release:v1")
    assert code == 75 and out["waiting_reason"] == "approval"
    run_id = out["run_id"]
    assert [r["request_id"] for r in out["requests"]] == ["ship"]
    codes = [smthrs(ws, "deny", run_id, "--request", "ship")[0] for _ in range(3)]
    assert codes == [3, 3, 3]
    for _ in range(3):  # the CI retry of the run the denial failed: 3 every time, not 3 then 1
        code, out = smthrs(ws, "run", "gate.yaml", "--key", "release:v1")
        assert code == 3 and out["status"] == "failed", out
    assert smthrs(ws, "deny", run_id, "--request", "ship")[0] == 3
    assert (
        smthrs(ws, "approve", run_id, "--request", "ship")[0] == 2
    )  # an approval of a denied request: refused
