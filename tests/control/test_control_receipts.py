"""control/receipts.py: the five receipts, their wire form, and the replay rule."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from smthrs_plugin.control import (
    LOCAL_OPERATOR,
    Accepted,
    AlreadyApplied,
    Conflict,
    Mutation,
    Parked,
    Terminal,
    decide_replay,
    receipt_from_dict,
)
from smthrs_plugin.control.receipts import RECEIPT_TYPES
from smthrs_plugin.errors import ControlError

RECEIPTS = [
    Accepted("rcpt-1"),
    Accepted("rcpt-1", run_id="run-17"),
    AlreadyApplied("rcpt-1"),
    AlreadyApplied("rcpt-1", run_id="run-17"),
    Parked("release-1.4"),
    Conflict("this key already names another intent"),
    Terminal("run-17", "completed"),
]


@pytest.mark.parametrize("receipt", RECEIPTS, ids=lambda r: f"{r.type}")
def test_every_receipt_round_trips_through_its_json_wire_form(receipt: Any) -> None:
    wire = json.loads(json.dumps(receipt.to_dict()))
    assert receipt_from_dict(wire) == receipt
    assert type(receipt).from_dict(wire) == receipt
    assert wire["_tag"] == receipt.type


def test_wire_forms_use_the_seed_spelling_and_omit_an_absent_run() -> None:
    assert Parked("p1").to_dict() == {"_tag": "Parked", "planId": "p1", "status": "waiting-approval"}
    assert Accepted("r").to_dict() == {"_tag": "Accepted", "receiptId": "r"}
    assert AlreadyApplied("r", "run-1").to_dict() == {
        "_tag": "AlreadyApplied",
        "receiptId": "r",
        "runId": "run-1",
    }
    assert Terminal("run-1", "failed").to_dict() == {"_tag": "Terminal", "runId": "run-1", "status": "failed"}
    assert Conflict("m").to_dict() == {"_tag": "Conflict", "message": "m"}
    assert sorted(RECEIPT_TYPES) == ["Accepted", "AlreadyApplied", "Conflict", "Parked", "Terminal"]
    assert [cls.label for cls in RECEIPT_TYPES.values()] == [
        "accepted",
        "already_applied",
        "parked",
        "conflict",
        "terminal",
    ]


def test_only_accepted_is_a_recorded_receipt() -> None:
    assert [cls.type for cls in RECEIPT_TYPES.values() if cls.recorded] == ["Accepted"]


def test_receipts_are_frozen_values() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Accepted("r").run_id = "run-2"  # type: ignore[misc]
    assert Accepted("r", "x") == Accepted("r", "x")
    assert hash(Accepted("r", "x")) == hash(Accepted("r", "x"))


@pytest.mark.parametrize(
    "bad",
    [
        {"_tag": "Accepted"},  # missing receiptId
        {"_tag": "Accepted", "receiptId": "r", "extra": 1},  # unknown member
        {"_tag": "Accepted", "receiptId": 7},  # wrong type
        {"_tag": "Accepted", "receiptId": ""},  # empty id
        {"_tag": "Parked", "planId": "p", "status": "running"},  # Parked is always waiting-approval
        {"_tag": "Terminal", "runId": "r"},  # no status
        {"_tag": "Rejected", "message": "m"},  # unknown tag
        {"receiptId": "r"},  # no tag
        ["Accepted", "r"],  # not an object
    ],
)
def test_malformed_wire_forms_are_refused_with_invalid_receipt(bad: Any) -> None:
    with pytest.raises(ControlError) as exc:
        receipt_from_dict(bad)
    assert exc.value.code == "invalid_receipt"


def test_a_tag_mismatch_is_refused_by_the_class_decoder() -> None:
    with pytest.raises(ControlError) as exc:
        Accepted.from_dict(AlreadyApplied("r").to_dict())
    assert exc.value.code == "invalid_receipt"


def test_parked_status_is_always_waiting_approval() -> None:
    assert Parked("p").status == "waiting-approval"
    with pytest.raises(ControlError):
        Parked("p", status="approved")


def test_replay_with_the_same_fingerprint_answers_already_applied_with_the_same_ids() -> None:
    stored = Accepted("rcpt-9", run_id="run-17")
    replay = decide_replay("f" * 64, "f" * 64, stored)
    assert replay == AlreadyApplied("rcpt-9", run_id="run-17")
    assert decide_replay("f" * 64, "f" * 64, replay) == replay  # a replay of a replay is stable


def test_replay_with_a_different_fingerprint_answers_conflict_saying_what_to_do() -> None:
    answer = decide_replay("a" * 64, "b" * 64, Accepted("rcpt-9"), operation="run")
    assert type(answer) is Conflict
    assert "different run request" in answer.message
    assert "new key" in answer.message


@pytest.mark.parametrize(
    "stored", [Parked("p"), Conflict("m"), Terminal("run-1", "completed")], ids=lambda r: r.type
)
def test_receipts_that_are_never_recorded_cannot_be_replayed(stored: Any) -> None:
    with pytest.raises(ControlError) as exc:
        decide_replay("a" * 64, "a" * 64, stored)
    assert exc.value.code == "invalid_receipt"


def test_retry_differing_only_in_its_stamped_principal_replays_and_a_changed_intent_conflicts() -> None:
    first = Mutation(
        "run",
        "deploy:v1.4.0",
        {"planId": "p1", "principal": {"id": "local", "kind": "operator", "stampedAt": 1_000}},
        LOCAL_OPERATOR,
    )
    stored = Accepted("rcpt-1", run_id="run-1")  # what the first call recorded under first.durable_key
    retry = Mutation(
        "run",
        "deploy:v1.4.0",
        {"planId": "p1", "principal": {"id": "local", "kind": "operator", "stampedAt": 2_000}},
        LOCAL_OPERATOR,
    )
    other_intent = Mutation("run", "deploy:v1.4.0", {"planId": "p2"}, LOCAL_OPERATOR)
    assert retry.durable_key == first.durable_key == other_intent.durable_key
    assert decide_replay(first.fingerprint, retry.fingerprint, stored) == AlreadyApplied("rcpt-1", "run-1")
    assert type(decide_replay(first.fingerprint, other_intent.fingerprint, stored)) is Conflict


README_EXAMPLE = """
from smthrs_plugin.control import LOCAL_OPERATOR, Accepted, Envelope, Mutation, PlanCard, decide_replay
from smthrs_plugin.errors import InvalidInput

# Every control mutation crosses the identity boundary first: copy, decode, bound, key, fingerprint.
first = Mutation("run", "deploy:v1.4.0", {"planId": "release-1.4"}, LOCAL_OPERATOR)
stored = Accepted(receipt_id="rcpt-1", run_id="run-1")  # what the store recorded under first.durable_key

retry = Mutation("run", "deploy:v1.4.0", {"planId": "release-1.4"}, LOCAL_OPERATOR)
print(decide_replay(first.fingerprint, retry.fingerprint, stored).to_dict())
other = Mutation("run", "deploy:v1.4.0", {"planId": "release-1.5"}, LOCAL_OPERATOR)
print(decide_replay(first.fingerprint, other.fingerprint, stored).type)

try:
    Mutation("run", "deploy:v1.4.0", {"budget": float("nan")})
except InvalidInput as exc:
    print(exc.details["bound"])

card = PlanCard(plan_id="release-1.4", flow_id="ci/release", input={"build": "v1.4.0"},
                envelope=Envelope(capabilities=("deploy:prod",)), deploy_class=True)
print(card.approval.to_json()["target"]["digest"] == card.digest, len(card.digest))
"""


def test_readme_example_runs_and_prints_what_the_readme_says(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(README_EXAMPLE, "docs/tutorials/ci-pipelines.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == [
        "{'_tag': 'AlreadyApplied', 'receiptId': 'rcpt-1', 'runId': 'run-1'}",
        "Conflict",
        "number",
        "True 64",
    ]
