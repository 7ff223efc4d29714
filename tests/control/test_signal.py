"""``Control.signal`` and ``smthrs signal``: a named value delivered to a waiting run (``sp.wait_for``), on SQLite and
PostgreSQL. Real parts only: the run driver parks a real flow on its wait, the control plane answers it, the driver
drives the woken run to its end; the CLI runs as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _control_support import count, journal_types

import smthrs_plugin as sp
from smthrs_plugin.control.facade import Control
from smthrs_plugin.control.identity import LOCAL_OPERATOR, Principal
from smthrs_plugin.control.receipts import Accepted, AlreadyApplied, Conflict, Terminal
from smthrs_plugin.engine.drive.active_run import DriveParked, DriveSettled
from smthrs_plugin.engine.drive.driver import RunDriver
from smthrs_plugin.errors import ControlError, InvalidInput, SmthrsError
from smthrs_plugin.records.runs import OwnerId
from smthrs_plugin.records.wait_rows import EventWait
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.database import Database

#: Every table a signal may write (receipts, deferreds, journal) and the run row's revision.
_WRITTEN = ("control_receipts", "deferred_completions", "journal_events")


def _approval_flow(ctx: Any) -> dict[str, Any]:
    return {"value": sp.wait_for("approval")}


@pytest.fixture
def fast() -> Settings:
    return load_settings(
        heartbeat_interval_s=0.05,
        stale_after_s=30.0,
        skew_allowance_s=0.1,
        wait_poll_s=0.05,
        host_id="sig-host",
    )


@pytest.fixture
def driver(db: Database, fast: Settings) -> Iterator[RunDriver]:
    # wait_budget_s=0: a wait that is not answered yet parks the run at once (nothing waits in-process).
    d = RunDriver(db, settings=fast, owner=OwnerId("sig-host", 4242, "nonce-sig"), wait_budget_s=0)
    d.register("gate", _approval_flow)
    yield d
    d.stop(grace_s=5)


def _parked(driver: RunDriver, run_id: str = "r1") -> str:
    driver.submit(run_id, "gate")
    outcome = driver.drive(run_id)
    assert isinstance(outcome, DriveParked) and isinstance(outcome.wait, EventWait)
    return run_id


def _state(db: Database) -> tuple[Any, ...]:
    rows = db.read(
        lambda c: c.execute(sa.text("SELECT run_id, status, revision FROM runs ORDER BY run_id")).all()
    )
    return (*(count(db, t) for t in _WRITTEN), tuple(tuple(r) for r in rows))


def test_a_signal_wakes_the_run_parked_on_its_wait_and_the_run_returns_the_value(
    db: Database, control: Control, driver: RunDriver
) -> None:
    run_id = _parked(driver)
    before = journal_types(db, run_id)
    receipt = control.signal(run_id, "approval", {"ok": True, "ticket": "CHG-7"})
    assert isinstance(receipt, Accepted) and receipt.run_id == run_id
    # Completion, delivery record and wake: one transaction, in this order, on the run's partition.
    assert journal_types(db, run_id)[len(before) :] == [
        "deferred-completed",
        "control.signal.delivered",
        "run-woken",
    ]
    assert control.show(run_id).status == "pending"
    outcome = driver.drive(run_id)
    assert isinstance(outcome, DriveSettled) and outcome.status == "completed"
    record = driver.runs.get(run_id)
    assert record is not None and record.result == {"value": {"ok": True, "ticket": "CHG-7"}}


def test_the_delivery_record_names_the_principal_and_the_receipt_but_not_the_value(
    db: Database, control: Control, driver: RunDriver
) -> None:
    run_id = _parked(driver)
    receipt = control.signal(run_id, "approval", "secret-ish", principal=Principal("ops", "operator"))
    assert isinstance(receipt, Accepted)
    payload = db.read(
        lambda c: c.execute(
            sa.text("SELECT payload_json FROM journal_events WHERE partition = :p AND type = :t"),
            {"p": run_id, "t": "control.signal.delivered"},
        ).scalar_one()
    )
    delivered = json.loads(payload)
    assert delivered["name"] == "approval"
    assert delivered["principal"] == {"id": "ops", "kind": "operator"}
    assert delivered["receiptId"] == receipt.receipt_id
    assert delivered["valueDigest"].startswith("sha256:") and "secret-ish" not in payload


def test_a_retried_signal_with_the_same_key_is_already_applied_and_writes_nothing(
    db: Database, control: Control, driver: RunDriver
) -> None:
    run_id = _parked(driver)
    first = control.signal(run_id, "approval", [1, 2], idempotency_key="answer:r1")
    state = _state(db)
    again = control.signal(run_id, "approval", [1, 2], idempotency_key="answer:r1")
    assert again == AlreadyApplied(first.receipt_id, run_id)  # type: ignore[union-attr]
    assert _state(db) == state


def test_the_receipt_stays_the_answer_after_the_woken_run_settled(
    db: Database, control: Control, driver: RunDriver
) -> None:
    run_id = _parked(driver)
    first = control.signal(run_id, "approval", "yes")
    assert isinstance(driver.drive(run_id), DriveSettled)
    assert control.signal(run_id, "approval", "yes") == AlreadyApplied(first.receipt_id, run_id)  # type: ignore[union-attr]


def test_the_same_key_with_another_value_is_a_conflict_and_writes_nothing(
    db: Database, control: Control, driver: RunDriver
) -> None:
    run_id = _parked(driver)
    control.signal(run_id, "approval", {"ok": True}, idempotency_key="k1")
    state = _state(db)
    answer = control.signal(run_id, "approval", {"ok": False}, idempotency_key="k1")
    assert isinstance(answer, Conflict) and "different signal request" in answer.message
    assert _state(db) == state


def test_a_principal_nested_in_the_value_is_part_of_what_was_signalled(
    control: Control, driver: RunDriver
) -> None:
    # Only the server-stamped principal fields leave the fingerprint; one inside the payload is the caller's data.
    run_id = _parked(driver)
    control.signal(run_id, "approval", {"principal": "alice"})
    assert isinstance(control.signal(run_id, "approval", {"principal": "mallory"}), Conflict)


def test_a_second_signal_under_another_key_is_refused_already_resolved_and_writes_nothing(
    db: Database, control: Control, driver: RunDriver
) -> None:
    run_id = _parked(driver)
    control.signal(run_id, "approval", "first", idempotency_key="a")
    state = _state(db)
    with pytest.raises(ControlError) as err:
        control.signal(run_id, "approval", "second", idempotency_key="b")
    assert err.value.code == "already_resolved" and "answered once" in err.value.message
    assert _state(db) == state


def test_a_signal_to_an_unknown_run_is_refused_run_not_found_and_writes_nothing(
    db: Database, control: Control
) -> None:
    state = _state(db)
    with pytest.raises(ControlError) as err:
        control.signal("no-such-run", "approval", 1)
    assert err.value.code == "run_not_found"
    assert _state(db) == state


def test_a_signal_to_a_settled_run_answers_terminal_and_writes_nothing(
    db: Database, control: Control, driver: RunDriver
) -> None:
    run_id = _parked(driver)
    control.cancel(run_id)
    state = _state(db)
    assert control.signal(run_id, "approval", 1) == Terminal(run_id, "cancelled")
    assert _state(db) == state


def test_a_signal_before_the_run_waits_is_kept_and_returned_when_it_asks(
    db: Database, control: Control, driver: RunDriver
) -> None:
    driver.submit("early", "gate")
    assert isinstance(control.signal("early", "approval", "ahead"), Accepted)
    assert control.show("early").status == "pending"  # nothing parked: nothing to wake
    outcome = driver.drive("early")
    assert isinstance(outcome, DriveSettled) and outcome.status == "completed"
    assert driver.runs.get("early").result == {"value": "ahead"}  # type: ignore[union-attr]


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize(
    ("value", "bound"),
    [
        (_deep(200), "depth"),
        (list(range(100_001)), "entries"),
        ("x" * (4 * 1024 * 1024 + 1), "canonical_bytes"),
        (float("nan"), "number"),
        ((1, 2), "plain_data"),
        ("\ud800", "well_formed_text"),
    ],
    ids=["too-deep", "too-many", "over-4MiB", "nan", "tuple", "lone-surrogate"],
)
def test_an_over_bound_value_is_refused_before_anything_is_written(
    db: Database, control: Control, driver: RunDriver, value: Any, bound: str
) -> None:
    run_id = _parked(driver)
    state = _state(db)
    with pytest.raises(InvalidInput) as err:
        control.signal(run_id, "approval", value)
    assert err.value.details["bound"] == bound
    assert _state(db) == state


@pytest.mark.parametrize("name", ["", "x" * 1025, "a\x00b", 7])
def test_a_malformed_wait_name_is_refused_as_invalid_options(
    db: Database, control: Control, name: Any
) -> None:
    state = _state(db)
    with pytest.raises(SmthrsError) as err:
        control.signal("r1", name, 1)
    assert err.value.code == "invalid_options"
    assert _state(db) == state


def test_signal_defaults_to_the_local_operator(control: Control, driver: RunDriver, db: Database) -> None:
    run_id = _parked(driver)
    control.signal(run_id, "approval", 1)
    payload = db.read(
        lambda c: c.execute(
            sa.text("SELECT payload_json FROM journal_events WHERE partition = :p AND type = :t"),
            {"p": run_id, "t": "control.signal.delivered"},
        ).scalar_one()
    )
    assert json.loads(payload)["principal"] == LOCAL_OPERATOR.to_json()


# -- the command line ---------------------------------------------------------------------------------------------


def _smthrs(workspace: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SMTHRS_WORKSPACE": str(workspace)}
    env.pop("SMTHRS_DB_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.fixture
def parked_workspace(tmp_path: Path, fast: Settings) -> Iterator[tuple[Path, RunDriver]]:
    rt = sp.open_runtime(workspace=tmp_path)
    d = RunDriver(rt.db, settings=fast, owner=OwnerId("sig-host", 4242, "nonce-cli"), wait_budget_s=0)
    d.register("gate", _approval_flow)
    _parked(d, "cli-run")
    yield tmp_path, d
    d.stop(grace_s=5)
    rt.close()


def test_smthrs_signal_delivers_and_its_retry_is_already_applied(
    parked_workspace: tuple[Path, RunDriver],
) -> None:
    ws, d = parked_workspace
    first = _smthrs(ws, "signal", "cli-run", "approval", "--value", '{"ok": true}', "--json")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["receipt"]["_tag"] == "Accepted" and out["run_id"] == "cli-run" and out["name"] == "approval"
    assert out["status"] == "pending"  # woken: a driver takes it from here
    again = _smthrs(ws, "signal", "cli-run", "approval", "--value", '{"ok": true}', "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["receipt"]["_tag"] == "AlreadyApplied"
    other = _smthrs(ws, "signal", "cli-run", "approval", "--value", '{"ok": false}', "--json")
    assert other.returncode == 2 and json.loads(other.stdout)["receipt"]["_tag"] == "Conflict"
    assert isinstance(d.drive("cli-run"), DriveSettled)
    assert d.runs.get("cli-run").result == {"value": {"ok": True}}  # type: ignore[union-attr]


def test_smthrs_signal_refuses_malformed_json_and_unknown_runs_with_exit_2(
    parked_workspace: tuple[Path, RunDriver],
) -> None:
    ws, _ = parked_workspace
    bad = _smthrs(ws, "signal", "cli-run", "approval", "--value", "{nope", "--json")
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"]["code"] == "invalid_input"
    deep = _smthrs(ws, "signal", "cli-run", "approval", "--value", "[" * 200 + "]" * 200, "--json")
    assert deep.returncode == 2 and json.loads(deep.stdout)["error"]["bound"] == "depth"
    unknown = _smthrs(ws, "signal", "nope", "approval", "--value", "1")
    assert unknown.returncode == 2 and "run_not_found" in unknown.stderr
    assert "deferred-completed" not in journal_types(ws_db(ws), "cli-run")


def ws_db(ws: Path) -> Database:
    from smthrs_plugin.stores.database import open_database

    return open_database(f"sqlite:///{(ws / '.smthrs' / 'state.db').as_posix()}")
