"""``smthrs_plugin/vocabulary.py``: the one translation of stored run states into the words every ``--json`` answer and
every ``smthrs serve`` answer uses, pinned name by name, closed over the stored taxonomy, and reversible for the
``status``/``waiting`` filters."""

from __future__ import annotations

from typing import Any

import pytest

from smthrs_plugin.errors import ControlError
from smthrs_plugin.records.runs import RUN_STATUSES
from smthrs_plugin.records.wait_rows import WAITING_REASONS
from smthrs_plugin.vocabulary import (
    CLI_STATUSES,
    CLI_WAITING_REASONS,
    cli_event,
    cli_receipt,
    cli_request,
    cli_run,
    cli_state,
    status_filter,
    waiting_filter,
)

STATUS_WORDS = {
    "pending": "pending",
    "running": "running",
    "suspended": "parked",
    "completed": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
}
REASON_WORDS = {
    "waiting-approval": "approval",
    "timer": "timer",
    "event": "signal",
    "released": "released",
    "quarantine": "quarantine",
}


def test_every_stored_status_and_reason_has_exactly_one_word() -> None:
    assert set(STATUS_WORDS) == set(RUN_STATUSES) and set(REASON_WORDS) == set(WAITING_REASONS)
    assert sorted(STATUS_WORDS.values()) == sorted(CLI_STATUSES)
    assert sorted(REASON_WORDS.values()) == sorted(CLI_WAITING_REASONS)
    for stored, word in STATUS_WORDS.items():
        assert cli_state(stored, None) == (word, None)
    for stored, word in REASON_WORDS.items():
        assert cli_state("suspended", stored) == ("parked", word)


@pytest.mark.parametrize("status", ["pending", "running", "completed", "failed", "cancelled"])
def test_a_waiting_reason_is_null_unless_the_run_is_parked(status: str) -> None:
    assert cli_state(status, "waiting-approval") == (status, None)
    assert cli_state(None, "timer") == (None, None)


def test_the_filters_take_the_words_and_answer_the_stored_names() -> None:
    for stored, word in STATUS_WORDS.items():
        assert status_filter(word) == stored
    for stored, word in REASON_WORDS.items():
        assert waiting_filter(word) == stored
    assert status_filter(None) is None and waiting_filter(None) is None


@pytest.mark.parametrize(
    ("refused", "word"), [("suspended", "status"), ("waiting-approval", "waiting"), ("event", "waiting")]
)
def test_a_stored_name_is_refused_as_a_filter_naming_the_words(refused: str, word: str) -> None:
    check = status_filter if word == "status" else waiting_filter
    with pytest.raises(ControlError) as exc:
        check(refused)
    assert exc.value.code == "invalid_options" and exc.value.details["option"] == word
    assert ("parked" if word == "status" else "approval") in exc.value.message


def _observed(status: str, wait: dict[str, Any] | None) -> dict[str, Any]:
    return {"tag": "observed", "run_id": "r", "status": status, "wait": wait, "created_at_ms": 1}


def test_a_run_observation_speaks_the_words_and_its_wait_has_no_second_name() -> None:
    wait = {
        "kind": "waiting-approval",
        "reason": "waiting-approval",
        "wake_at_ms": None,
        "token_digest": "ab",
    }
    assert cli_run(_observed("suspended", wait)) == {
        "tag": "observed",
        "run_id": "r",
        "status": "parked",
        "waiting_reason": "approval",
        "wait": {"reason": "approval", "wake_at_ms": None, "token_digest": "ab"},
        "created_at_ms": 1,
    }
    assert cli_run(_observed("completed", None))["waiting_reason"] is None
    missing = {"tag": "missing", "run_id": "gone", "deleted": False, "revision": 3}
    assert cli_run(missing) == missing


def test_a_receipt_keeps_its_wire_names_and_drops_the_type_copy() -> None:
    parked = {"_tag": "Parked", "type": "Parked", "planId": "p", "status": "waiting-approval"}
    assert cli_receipt(parked) == {"_tag": "Parked", "planId": "p", "status": "waiting-approval"}


def test_a_requests_key1_node_key_is_called_key_and_an_events_time_occurred_at_ms() -> None:
    request = {"request_id": "ship", "token_id": "t", "digest": "key1_00", "envelope": {}, "state": "pending"}
    assert cli_request(request) == {
        "request_id": "ship",
        "token_id": "t",
        "key": "key1_00",
        "envelope": {},
        "state": "pending",
    }
    event = {"sequence": 1, "kind": "k", "run_id": "r", "occurred_at": 5, "payload": {"occurred_at": 5}}
    assert cli_event(event) == {
        "sequence": 1,
        "kind": "k",
        "run_id": "r",
        "occurred_at_ms": 5,
        "payload": {"occurred_at": 5},  # the journal record as written
    }
