"""One JSON vocabulary across every ``smthrs`` command's ``--json``, pinned on real runs (SQLite workspace, the real
typer app in-process): each command's top-level keys, the value vocabulary of ``status`` (pending | running |
parked | completed | failed | cancelled) and ``waiting_reason`` (approval | timer | signal | released | quarantine,
only while parked), times as ``*_at_ms`` integers, ``key`` for a ``key1_`` key and ``digest`` for a plain SHA-256,
the receipt in its wire form only (``_tag``, no ``type`` copy) — on the completed, parked (plan approval, node
approval, timer), cancelled, held and refused paths alike. Nested documents whose names the reference fixes (the
``receipt``, the plan ``card``) and the journal records ``watch`` relays (``payload``) keep their own spelling."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from smthrs_plugin.cli import app
from smthrs_plugin.cli._run import _stopped
from smthrs_plugin.engine.context import RunCancelled
from smthrs_plugin.engine.lease import NAMED, RunLease, acquire
from smthrs_plugin.engine.ownership.arbiter import Ownership
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.scheduler.planfile import read_plan_file
from smthrs_plugin.settings import load_settings
from smthrs_plugin.stores.database import open_database
from smthrs_plugin.vocabulary import CLI_STATUSES, CLI_WAITING_REASONS

GATED = """\
plan: gated
flow: ci/gated
approval: required
nodes:
  - id: build
    run: "true"
  - id: deploy
    run: "true"
    needs: [build]
    approval: {request: ship, envelope: {capabilities: ["deploy:prod"]}}
envelope: {capabilities: ["deploy:prod"]}
"""
PLAIN = """\
plan: plain
flow: ci/plain
nodes:
  - id: build
    run: "echo built > out.txt"
    writes: ["out.txt"]
"""
NODE_GATE = """\
plan: nodegate
flow: ci/nodegate
nodes:
  - id: build
    run: "true"
  - id: deploy
    run: "true"
    needs: [build]
    approval: {request: ship}
"""
TIMER = """\
plan: timer
flow: ci/timer
nodes:
  - id: build
    run: "true"
  - id: cool-down
    wait: {seconds: 3600}
    needs: [build]
"""

RECEIPT_ANSWER = {"receipt", "run_id", "status", "waiting_reason", "requests", "plan_id", "digest"}
SHAPES: dict[str, set[str]] = {
    "plan": {"plan_id", "flow_id", "digest", "approval_state", "card"},
    "decision": RECEIPT_ANSWER | {"host_wake"},  # approve, deny, cancel
    "run --key": RECEIPT_ANSWER | {"settlements", "owner"},  # and resume
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
    "cache ls": {"entries"},
    "cache explain": {
        "subject",
        "key",
        "previous_key",
        "comparison",
        "changes",
        "run_local",
        "renewed",
        "isolation",
    },
    "cache verify": {"entries", "blobs", "ok", "problems"},
    "recover backup": {"action", "directory", "manifest"},
    "recover verify": {"action", "manifest"},
    "recover fence": {"action", "released", "claims_cleared"},
    "error": {"error"},
}
RUN_KEYS = {
    "tag",
    "run_id",
    "revision",
    "status",
    "waiting_reason",
    "flow",
    "created_at_ms",
    "started_at_ms",
    "finished_at_ms",
    "updated_at_ms",
    "parent_run_id",
    "lineage_id",
    "round_ordinal",
    "wait",
    "cancellation",
}
EVENT_KEYS = {"sequence", "kind", "run_id", "occurred_at_ms", "payload", "cursor", "partition"}
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")
ISO_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}")
#: Documents in someone else's spelling: the receipt and card (the reference's wire form) and journal records.
FOREIGN = {"receipt", "card", "payload", "envelope", "manifest"}
TIME_WORD = re.compile(r"(^|_)(at|time|timestamp|when|date)$|_at_")


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """Every (path, key, value) of our own JSON, not descending into foreign documents."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path, k, v
            if k not in FOREIGN:
                yield from _walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")


def check_vocabulary(name: str, out: dict[str, Any]) -> None:
    """The shape of ``name`` and the vocabulary every one of our own members obeys."""
    assert set(out) == SHAPES[name], f"{name}: {sorted(out)}"
    for path, k, v in _walk(out):
        where = f"{name}{path}.{k}"
        assert SNAKE.match(k), f"{where}: not snake_case"
        assert k != "type" or path.endswith("host_wake"), f"{where}: a discriminator is `_tag` (receipt) only"
        if k == "status":  # the receipt's own `status` is the reference's, and not walked
            assert v is None or v in CLI_STATUSES, f"{where}: {v!r}"
        if k == "waiting_reason":
            assert v is None or v in CLI_WAITING_REASONS, f"{where}: {v!r}"
        if k == "reason" and path.endswith(".wait"):
            assert v in CLI_WAITING_REASONS, f"{where}: {v!r}"
        if k.endswith("_at_ms"):
            assert v is None or (type(v) is int and v > 0), f"{where}: {v!r}"
        elif TIME_WORD.search(k):
            raise AssertionError(f"{where}: a time is spelt *_at_ms (epoch ms)")
        if isinstance(v, str):
            assert not ISO_TIME.match(v), f"{where}: an ISO time string {v!r}"
            if v.startswith("key1_"):
                assert k != "digest", f"{where}: a key1_ key is named `key`, a digest is a plain SHA-256"
        if k == "digest" and v is not None:
            assert re.fullmatch(r"[0-9a-f]{64}", v), f"{where}: {v!r}"
    # A parked answer says why; any other status has no waiting reason.
    for run in [out, out.get("run") or {}, *(out.get("runs") or [])]:
        if "waiting_reason" in run:
            assert (run["status"] == "parked") == (run["waiting_reason"] is not None), run
    if "receipt" in out:
        assert "_tag" in out["receipt"] and "type" not in out["receipt"], out["receipt"]


class Cli:
    def __init__(self, ws: Path) -> None:
        self.ws = ws
        self.db = f"sqlite:///{(ws / 'state.db').as_posix()}"

    def __call__(self, *args: str) -> tuple[int, dict[str, Any]]:
        if args[:2] == ("recover", "verify"):
            opts: list[str] = []
        elif args[0] in ("watch", "runs", "show", "recover"):
            opts = ["--db", self.db]
        else:
            opts = ["--db", self.db, "--workspace", str(self.ws)]
        argv = [str(self.ws / a) if a.endswith(".yaml") else a for a in args]
        result = CliRunner().invoke(app, [*argv, *opts, "--json"])
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    ws = tmp_path / "ws"
    ws.mkdir()
    for name, text in (("gated", GATED), ("plain", PLAIN), ("nodegate", NODE_GATE), ("timer", TIMER)):
        (ws / f"{name}.yaml").write_text(text)
    monkeypatch.setenv("SMTHRS_WAIT_BUDGET_S", "0")  # a timer node parks at once instead of sleeping
    monkeypatch.setenv("SMTHRS_STALE_AFTER_S", "3600")  # a held lease never expires during a test
    monkeypatch.delenv("SMTHRS_DB_URL", raising=False)
    return Cli(ws)


def test_a_plan_awaiting_approval_answers_parked_on_approval_with_no_run_yet(cli: Cli) -> None:
    code, card = cli("plan", "gated.yaml")
    assert code == 0 and card["approval_state"] == "pending"
    check_vocabulary("plan", card)
    code, out = cli("run", "gated.yaml", "--key", "k")
    assert code == 75
    check_vocabulary("run --key", out)
    assert (out["status"], out["waiting_reason"], out["run_id"]) == ("parked", "approval", None)
    assert out["receipt"] == {"_tag": "Parked", "planId": card["plan_id"], "status": "waiting-approval"}
    assert out["plan_id"] == card["plan_id"] and out["digest"] == card["digest"]


def test_every_control_verb_speaks_one_vocabulary_through_a_node_approval(cli: Cli) -> None:
    _, card = cli("plan", "gated.yaml")
    code, out = cli("approve", card["plan_id"])
    assert code == 0 and (out["run_id"], out["status"]) == (None, None)  # a plan decision names no run
    check_vocabulary("decision", out)

    code, out = cli("run", "gated.yaml", "--key", "k")
    assert code == 75 and (out["status"], out["waiting_reason"]) == ("parked", "approval")
    check_vocabulary("run --key", out)
    run_id = out["run_id"]
    assert run_id is not None and out["receipt"]["runId"] == run_id
    (request,) = out["requests"]
    assert request["request_id"] == "ship" and request["key"].startswith("key1_") and "digest" not in request

    # A resume of a run parked on its node approval: the receipt names only the plan, the answer names the run.
    code, out = cli("resume", run_id, "--key", "r1")
    assert code == 75 and out["receipt"]["_tag"] == "Parked"
    check_vocabulary("run --key", out)
    assert (out["run_id"], out["status"], out["waiting_reason"]) == (run_id, "parked", "approval")
    assert [r["request_id"] for r in out["requests"]] == ["ship"] and out["digest"] == card["digest"]

    for cmd in (("show", run_id), ("runs", "--status", "parked"), ("runs", "--waiting", "approval")):
        code, seen = cli(*cmd)
        assert code == 0
        check_vocabulary(cmd[0], seen)
        runs = [seen["run"]] if cmd[0] == "show" else seen["runs"]
        assert [r["run_id"] for r in runs] == [run_id]
        assert all(set(r) == RUN_KEYS for r in runs)
        assert [(r["status"], r["waiting_reason"], r["wait"]["reason"]) for r in runs] == [
            ("parked", "approval", "approval")
        ]

    code, out = cli("approve", run_id, "--request", "ship")
    assert code == 0 and (out["status"], out["waiting_reason"]) == ("pending", None)
    check_vocabulary("decision", out)
    code, out = cli("resume", run_id, "--key", "r2")
    assert code == 0 and out["status"] == "completed"
    check_vocabulary("run --key", out)

    code, out = cli("watch", run_id)
    assert code == 0 and out["events"]
    check_vocabulary("watch", out)
    assert all(set(e) == EVENT_KEYS for e in out["events"])

    code, out = cli("cancel", run_id)
    assert code == 2 and out["receipt"] == {"_tag": "Terminal", "runId": run_id, "status": "completed"}
    check_vocabulary("decision", out)
    code, out = cli("deny", run_id, "--request", "ship")
    assert code == 2 and out["status"] == "completed"
    check_vocabulary("decision", out)


def test_a_cancelled_parked_run_answers_cancelled_on_every_path(cli: Cli) -> None:
    _, card = cli("plan", "gated.yaml")
    cli("approve", card["plan_id"])
    _, parked = cli("run", "gated.yaml", "--key", "k")
    run_id = parked["run_id"]
    code, out = cli("cancel", run_id)
    assert code == 0 and (out["run_id"], out["status"], out["waiting_reason"]) == (run_id, "cancelled", None)
    check_vocabulary("decision", out)
    code, out = cli("run", "gated.yaml", "--key", "k")  # the retry of the cancelled run
    assert code == 1 and (out["run_id"], out["status"]) == (run_id, "cancelled")
    check_vocabulary("run --key", out)
    code, out = cli("resume", run_id, "--key", "r1")
    assert code == 1 and out["receipt"]["_tag"] == "Terminal" and out["status"] == "cancelled"
    check_vocabulary("run --key", out)
    code, seen = cli("runs", "--status", "cancelled")
    assert [r["run_id"] for r in seen["runs"]] == [run_id]
    check_vocabulary("runs", seen)


def test_a_plain_run_prints_one_shape_completed_parked_on_approval_or_timer(cli: Cli) -> None:
    code, out = cli("run", "plain.yaml")
    assert code == 0 and out["status"] == "completed" and out["key"].startswith("key1_")
    check_vocabulary("run", out)
    assert (out["wait"], out["node"], out["merges"], out["error"]) == (None, None, [], None)

    code, out = cli("run", "nodegate.yaml", "--run-id", "gate-1")
    assert code == 75 and (out["run_id"], out["status"], out["waiting_reason"]) == (
        "gate-1",
        "parked",
        "approval",
    )
    check_vocabulary("run", out)
    assert out["node"] == "ship" and out["wait"] == {"reason": "approval", "wake_at_ms": None}
    assert out["plan_id"] == "nodegate" and out["key"].startswith("key1_")

    code, out = cli("run", "timer.yaml", "--run-id", "timer-1")
    assert code == 75 and (out["run_id"], out["status"], out["waiting_reason"]) == (
        "timer-1",
        "parked",
        "timer",
    )
    check_vocabulary("run", out)
    assert out["node"] == "cool-down" and type(out["wait"]["wake_at_ms"]) is int

    code, seen = cli("runs", "--waiting", "timer")
    assert [r["run_id"] for r in seen["runs"]] == ["timer-1"]
    check_vocabulary("runs", seen)


def test_a_plain_run_stopped_by_a_cancellation_answers_cancelled(
    cli: Cli, capsys: pytest.CaptureFixture[str]
) -> None:
    # The cancellation a run's owner observes mid-run (RunCancelled), answered as `smthrs run` answers it.
    plan = read_plan_file(cli.ws / "plain.yaml").plan
    with pytest.raises(typer.Exit) as stopped:
        _stopped(True, RunCancelled("plain-1"), plan)
    assert stopped.value.exit_code == 1
    out = json.loads(capsys.readouterr().out)
    check_vocabulary("run", out)
    assert (out["run_id"], out["plan_id"], out["status"], out["waiting_reason"]) == (
        "plain-1",
        "plain",
        "cancelled",
        None,
    )


def _lease(cli: Cli, run_id: str, flow: str) -> RunLease:
    """Hold ``run_id`` as another live owner of this database (its heartbeat keeps the lease fresh)."""
    db = open_database(cli.db)
    journal = Journal(db)
    runs = RunStore(db, journal=journal)
    waits = WaitStore(db, journal=journal, runs_store=runs)
    # Another owner incarnation of this very (live) process: same host and pid, its own nonce.
    other = OwnerId(load_settings().host_id, os.getpid(), "vocabulary-test-holder")
    own = Ownership(db, owner=other, journal=journal)
    lease = acquire(run_id, flow, NAMED, ownership=own, runs=runs, waits=waits)
    assert isinstance(lease, RunLease), lease
    return lease


def test_a_held_run_answers_running_with_its_run_id(cli: Cli) -> None:
    code, _ = cli("run", "plain.yaml", "--run-id", "seed")  # creates the database
    assert code == 0
    with _lease(cli, "held-1", "ci/plain"):
        code, out = cli("run", "plain.yaml", "--run-id", "held-1")
    assert code == 75 and (out["run_id"], out["status"], out["waiting_reason"]) == ("held-1", "running", None)
    check_vocabulary("run", out)
    assert out["plan_id"] == "plain" and out["error"]["code"]
    # `run --key --no-wait` on a run another live process holds: tests/control/test_retry_takeover.py (real
    # processes) pins the same answer, status `running` with its run_id and owner.


def test_refusals_and_old_spellings_are_refused_with_the_vocabulary(cli: Cli) -> None:
    cli("run", "plain.yaml")
    for args, named in (
        (("--status", "suspended"), "parked"),
        (("--waiting", "waiting-approval"), "approval"),
    ):
        code, out = cli("runs", *args)
        assert code == 2 and out["error"]["code"] == "invalid_options" and named in out["error"]["message"]
        check_vocabulary("error", out)
    code, out = cli("watch", "NO_SUCH_RUN")
    assert code == 2 and out["error"]["code"] == "run_not_found"
    check_vocabulary("error", out)


def test_cache_and_recover_print_no_status_of_their_own(cli: Cli) -> None:
    cli("run", "plain.yaml")
    for args, name in (
        (("cache", "ls"), "cache ls"),
        (("cache", "explain", "plain/build"), "cache explain"),
        (("cache", "verify"), "cache verify"),
    ):
        code, out = cli(*args)
        assert code == 0, out
        check_vocabulary(name, out)
    code, out = cli("recover", "backup", str(cli.ws.parent / "backup"))
    assert code == 0 and out["action"] == "backed-up"
    check_vocabulary("recover backup", out)
    code, out = cli("recover", "verify", str(cli.ws.parent / "backup"))
    assert code == 0 and out["action"] == "verified"
    check_vocabulary("recover verify", out)
    code, out = cli("recover", "fence")
    assert code == 0 and out["action"] == "fenced"
    check_vocabulary("recover fence", out)
