"""Plan cards (smthrs_plugin._control_cards): envelopes compared by canonical bytes, the plan card digest, and the approval payload."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from smthrs_plugin._control_cards import check_envelope, check_plan_digest, envelope_matches
from smthrs_plugin.canonical import canonical_bytes
from smthrs_plugin.control import CardNode, Envelope, PlanApproval, PlanCard
from smthrs_plugin.errors import ControlError, InvalidInput

PLAN_DIGEST = "ab" * 32


def _card(**overrides: Any) -> PlanCard:
    parts: dict[str, Any] = {
        "plan_id": "release-1.4",
        "flow_id": "ops/Deploy",
        "input": {"build": "v1.4.0", "targets": ["eu", "us"]},
        "envelope": Envelope(capabilities=("deploy:prod",), budget={"usd": 5}),
        "deploy_class": True,
        "plan_digest": PLAN_DIGEST,
        "nodes": (
            CardNode("build", "step", "key1_" + "1" * 64),
            CardNode("deploy", "step", "key1_" + "2" * 64, depends_on=("build",)),
        ),
    }
    parts.update(overrides)
    return PlanCard(**parts)


def test_envelope_comparison_ignores_member_order() -> None:
    a = {"capabilities": ["deploy:prod"], "flows": ["ops/Notify"], "budget": {"usd": 5, "tokens": 1000}}
    b = {"budget": {"tokens": 1000, "usd": 5}, "flows": ["ops/Notify"], "capabilities": ["deploy:prod"]}
    assert json.dumps(a) != json.dumps(b)
    assert envelope_matches(a, b)
    assert envelope_matches(Envelope.from_json(a), b)
    assert envelope_matches({}, Envelope())  # absent members default to empty
    assert check_envelope(a, b) == Envelope.from_json(a)


@pytest.mark.parametrize(
    "changed",
    [
        {"capabilities": ["deploy:staging"], "flows": ["ops/Notify"], "budget": {"usd": 5, "tokens": 1000}},
        {"capabilities": ["deploy:prod"], "flows": [], "budget": {"usd": 5, "tokens": 1000}},
        {"capabilities": ["deploy:prod"], "flows": ["ops/Notify"], "budget": {"usd": 6, "tokens": 1000}},
        {"capabilities": ["deploy:prod"], "flows": ["ops/Notify"], "budget": {"usd": 5}},
        {
            "capabilities": ["deploy:prod"],
            "flows": ["ops/Notify"],
            "budget": {"usd": 5, "tokens": 1000},
            "placement": {},
        },
        {"capabilities": ["deploy:prod", "x"], "flows": ["ops/Notify"], "budget": {"usd": 5, "tokens": 1000}},
    ],
)
def test_envelope_comparison_does_not_ignore_values(changed: dict[str, Any]) -> None:
    stored = {"capabilities": ["deploy:prod"], "flows": ["ops/Notify"], "budget": {"usd": 5, "tokens": 1000}}
    assert not envelope_matches(stored, changed)
    with pytest.raises(ControlError) as exc:
        check_envelope(stored, changed)
    assert exc.value.code == "envelope_mismatch"
    assert exc.value.details["expected"] == Envelope.from_json(stored).digest
    assert exc.value.details["actual"] == Envelope.from_json(changed).digest


def test_envelope_list_order_is_part_of_its_identity() -> None:
    assert not envelope_matches({"capabilities": ["a", "b"]}, {"capabilities": ["b", "a"]})


@pytest.mark.parametrize(
    "bad",
    [
        {"capabilities": "deploy:prod"},
        {"capabilities": [1]},
        {"budget": []},
        {"grants": []},
        ["deploy:prod"],
    ],
)
def test_malformed_envelopes_are_refused(bad: Any) -> None:
    with pytest.raises(InvalidInput) as exc:
        Envelope.from_json(bad)
    assert exc.value.details["bound"] == "envelope"


def test_card_digest_is_plain_sha256_of_the_canonical_seed_formula() -> None:
    card = _card()
    expected = hashlib.sha256(
        canonical_bytes(
            {
                "flowId": "ops/Deploy",
                "input": {"build": "v1.4.0", "targets": ["eu", "us"]},
                "envelope": {"capabilities": ["deploy:prod"], "flows": [], "budget": {"usd": 5}},
                "deployClass": True,
                "persistedPlan": PLAN_DIGEST,
            }
        )
    ).hexdigest()
    assert card.digest == expected
    no_plan = _card(plan_digest=None, nodes=(), envelope=Envelope(), deploy_class=False, input={})
    expected_no_plan = (
        b'{"deployClass":false,"envelope":{"budget":{},"capabilities":[],"flows":[]},'
        b'"flowId":"ops/Deploy","input":{},"persistedPlan":null}'
    )
    assert no_plan.digest == hashlib.sha256(expected_no_plan).hexdigest()  # no persisted plan: JSON null


@pytest.mark.parametrize(
    "change",
    [
        {"flow_id": "ops/Deploy2"},
        {"input": {"build": "v1.4.1", "targets": ["eu", "us"]}},
        {"input": {"build": "v1.4.0", "targets": ["us", "eu"]}},
        {"envelope": Envelope(capabilities=("deploy:prod",), budget={"usd": 6})},
        {"envelope": Envelope(capabilities=("deploy:prod", "db:migrate"), budget={"usd": 5})},
        {"deploy_class": False},
        {"plan_digest": "cd" * 32},
    ],
    ids=["flow", "input", "input-order", "budget", "capabilities", "deploy", "plan-digest"],
)
def test_card_digest_changes_when_any_pinned_part_changes(change: dict[str, Any]) -> None:
    assert _card(**change).digest != _card().digest


def test_card_digest_does_not_change_with_member_order_of_the_input() -> None:
    assert _card(input={"targets": ["eu", "us"], "build": "v1.4.0"}).digest == _card().digest


def test_card_holds_a_decoded_copy_of_its_input() -> None:
    caller_input = {"build": "v1.4.0", "targets": ["eu", "us"]}
    card = _card(input=caller_input)
    caller_input["targets"].append("ap")  # type: ignore[attr-defined]
    assert card.input == {"build": "v1.4.0", "targets": ["eu", "us"]}
    with pytest.raises(InvalidInput):
        _card(input={"when": object()})


def test_card_node_graph_must_be_pinned_by_a_plan_digest_and_closed() -> None:
    with pytest.raises(InvalidInput) as exc:
        _card(plan_digest=None)
    assert "persisted plan" in str(exc.value)
    with pytest.raises(InvalidInput):
        _card(nodes=(CardNode("a", "step", "k"), CardNode("a", "step", "k2")))
    with pytest.raises(InvalidInput):
        _card(nodes=(CardNode("a", "step", "k", depends_on=("ghost",)),))
    assert _card(plan_digest=None, nodes=()).nodes == ()  # a host without a graph reports an empty one


def test_card_carries_the_exact_approval_payload() -> None:
    card = _card()
    assert card.approval.to_json() == {
        "target": {
            "_tag": "Plan",
            "planId": "release-1.4",
            "digest": card.digest,
            "envelope": {"capabilities": ["deploy:prod"], "flows": [], "budget": {"usd": 5}},
        },
        "scope": "run",
        "idempotencyKey": f"approve:release-1.4:{card.digest}",
    }
    wire = json.loads(json.dumps(card.approval.to_json()))
    assert PlanApproval.from_json(wire) == card.approval
    with pytest.raises(InvalidInput) as exc:
        PlanApproval(plan_id="p", digest=card.digest, envelope=Envelope(), scope="forever")
    assert exc.value.details["bound"] == "grant_scope"


def test_card_round_trips_and_a_tampered_card_is_refused() -> None:
    card = _card()
    wire = json.loads(json.dumps(card.to_json()))
    assert PlanCard.from_json(wire) == card
    tampered = {**wire, "input": {"build": "v9.9.9", "targets": ["eu", "us"]}}
    with pytest.raises(ControlError) as exc:
        PlanCard.from_json(tampered)
    assert exc.value.code == "plan_digest_mismatch"
    # expected = what the content hashes to now; actual = the digest recorded beside it
    assert exc.value.details == {
        "expected": _card(input={"build": "v9.9.9", "targets": ["eu", "us"]}).digest,
        "actual": card.digest,
    }


def test_submitted_digest_must_equal_the_stored_one() -> None:
    card = _card()
    assert check_plan_digest(card.digest, card.digest) == card.digest
    with pytest.raises(ControlError) as exc:
        check_plan_digest(card.digest, "0" * 64)
    assert exc.value.code == "plan_digest_mismatch"
    assert exc.value.details == {"expected": card.digest, "actual": "0" * 64}
