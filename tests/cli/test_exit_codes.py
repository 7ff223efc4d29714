"""The one exit-code table (``smthrs_plugin/cli/exits.py``), walked over EVERY operation × receipt ×
run status × waiting reason × recorded decision, against the rules CI pipelines rely on — and a check that no
command keeps exit codes of its own.

The expected column is written independently of the implementation, as docs/tutorials/ci-pipelines.md states it: 0 done (for a run:
completed, nothing else), 1 failed/cancelled/quarantined, 2 refused, 3 denied, 75 not finished (parked, released,
or held by another live owner; or stopped by a passing fault of the environment, whatever error carries it)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from smthrs_plugin.cli import exits
from smthrs_plugin.cli.exits import (
    DECISIONS,
    OPERATIONS,
    RECEIPTS,
    STATUSES,
    WAITING_REASONS,
    exit_code,
    refusal_exit,
)
from smthrs_plugin.errors import (
    ArtifactError,
    ControlError,
    InvalidInput,
    SchedulerError,
    SmthrsError,
    StoreError,
)

CLI = Path(exits.__file__).resolve().parent


def _expected(
    op: str, receipt: str | None, status: str | None, waiting: str | None, decision: str | None
) -> int:
    if receipt == "Conflict":
        return 2
    if receipt == "Parked":
        return 75
    if op in ("run", "resume", "worker"):
        if status == "completed":
            return 0
        if status == "failed":
            return 3 if decision == "denied" else 1
        if status == "cancelled":
            return 1
        if status == "suspended":
            return 75 if waiting in ("waiting-approval", "timer", "event", "released") else 1
        return 75  # pending / running (another live owner) / no run: not finished
    if op == "deny":
        return 2 if receipt == "Terminal" and decision != "denied" else 3
    if op == "approve":
        return 2 if receipt == "Terminal" and decision != "approved" else 0
    if op == "signal":
        return 2 if receipt == "Terminal" else 0
    assert op == "cancel"
    return 2 if receipt == "Terminal" and status != "cancelled" else 0


TABLE = list(itertools.product(OPERATIONS, RECEIPTS, STATUSES, WAITING_REASONS, DECISIONS))


def test_the_table_covers_every_receipt_status_waiting_reason_and_decision_of_every_operation() -> None:
    assert set(OPERATIONS) == {"run", "resume", "worker", "approve", "deny", "cancel", "signal"}
    assert set(RECEIPTS) == {"Accepted", "AlreadyApplied", "Parked", "Conflict", "Terminal", None}
    assert set(STATUSES) == {"pending", "running", "suspended", "completed", "failed", "cancelled", None}
    assert {"waiting-approval", "timer", "event", "released", "quarantine"} <= set(WAITING_REASONS)
    assert len(TABLE) == 7 * 6 * 7 * 6 * 3


@pytest.mark.parametrize("op", OPERATIONS)
def test_every_row_of_the_exit_code_table(op: str) -> None:
    rows = [row for row in TABLE if row[0] == op]
    wrong = [(row, exit_code(*row), _expected(*row)) for row in rows if exit_code(*row) != _expected(*row)]
    assert rows and wrong == []


def test_exit_0_of_a_run_or_resume_means_exactly_that_the_run_completed() -> None:
    for op, receipt, status, waiting, decision in TABLE:
        if op in ("run", "resume", "worker"):
            code = exit_code(op, receipt, status, waiting, decision)
            assert (code == 0) == (status == "completed" and receipt not in ("Parked", "Conflict")), (
                op,
                receipt,
                status,
                waiting,
            )


def test_a_live_run_never_exits_0_whatever_the_receipt() -> None:
    for op, receipt in itertools.product(("run", "resume"), RECEIPTS):
        for status in ("pending", "running"):
            assert exit_code(op, receipt, status) != 0


def test_a_deny_and_a_denied_run_answer_3_on_every_identical_retry() -> None:
    # deny: recorded now, replayed, or answered Terminal about the run its denial failed
    assert {
        exit_code("deny", r, s, None, "denied") for r in ("Accepted", "AlreadyApplied") for s in STATUSES
    } == {3}
    assert exit_code("deny", "Terminal", "failed", None, "denied") == 3
    # run --key retries of a run failed by a denied node approval: from the stored state, not this call's report
    assert {
        exit_code("run", r, "failed", None, "denied") for r in ("Accepted", "AlreadyApplied", "Terminal")
    } == {3}


def test_an_unknown_operation_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        exit_code("deploy", "Accepted", "completed")


def test_refusals_exit_3_for_the_denial_family_and_2_for_everything_else() -> None:
    assert refusal_exit(ControlError("unauthorized", "no")) == 3
    assert refusal_exit(ControlError("plan_denied", "no")) == 3
    assert refusal_exit(ControlError("run_not_found", "no")) == 2
    assert refusal_exit(ControlError("invalid_cursor", "no")) == 2
    assert refusal_exit(InvalidInput("invalid_input", "no", bound="grant_scope")) == 2
    assert refusal_exit(SchedulerError("invalid_plan", "no")) == 2


#: The passing faults of the environment, as docs/tutorials/ci-pipelines.md states them: exit 75, never 1 or 2.
PASSING = {("store", "unreachable"), ("store", "disk_full"), ("store", "locked"), ("store", "read_only"),
           ("store", "contended"), ("artifacts", "unavailable")}  # fmt: skip


def _families(cls: type[SmthrsError]) -> list[type[SmthrsError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _families(sub))]


def test_refusal_exit_is_total_over_every_code_and_75_exactly_for_a_passing_fault_behind_it() -> None:
    for cls in _families(SmthrsError):
        for code in sorted(cls.codes):
            err = cls(code, "no")
            expected = 75 if (cls.family, code) in PASSING else 3 if code in exits._DENIED_CODES else 2
            assert refusal_exit(err) == expected, (cls.__name__, code)
            # Behind another error (a scheduler pass that failed on it, a launch that reports it): the same.
            wrapped = SchedulerError("store_failed", "a durable write failed", cause=err)
            assert refusal_exit(wrapped) == (75 if (cls.family, code) in PASSING else 2), (cls.__name__, code)
    assert refusal_exit(StoreError("not_a_database", "no")) == 2  # the wrong store: no retry makes it right
    assert refusal_exit(ArtifactError("corrupt", "no")) == 2


def test_no_command_module_keeps_exit_codes_of_its_own() -> None:
    own = re.compile(r"^\s*(EXIT_[A-Z_]+(\s*,\s*EXIT_[A-Z_]+)*)\s*=", re.MULTILINE)
    literal = re.compile(r"typer\.Exit\(\s*(?:[1-9]\d*)\s*\)")
    for path in sorted(CLI.glob("*.py")):
        if path.name == "exits.py":
            continue
        text = path.read_text()
        assert not own.search(text), f"{path.name} defines its own EXIT_* constants; use cli/exits.py"
        assert not literal.search(text), f"{path.name} exits with a literal code; use cli/exits.py"
