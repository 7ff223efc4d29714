"""The read methods of ``Control`` that the review page and the CLI show, on SQLite and PostgreSQL: a card with the
compiled plan it pins, the undecided cards, the last approved card of a plan, the runs parked for a node approval
and their requests, a run's row. Each answers the control plane's value types, decoded by the records' owner."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from _control_support import RecordingLauncher, release_plan

from smthrs_plugin.control import Envelope, NodeTarget, PendingApproval, PlanCard
from smthrs_plugin.control.facade import Control
from smthrs_plugin.control.receipts import Accepted
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.errors import ControlError, StoreError
from smthrs_plugin.records.waits import WaitStore
from smthrs_plugin.settings import Settings
from smthrs_plugin.stores.database import Database

ENV = {"capabilities": ["deploy:prod"]}


def _gated(control: Control, version: str) -> PlanCard:
    return control.plan(release_plan(), input={"version": version}, envelope=ENV, approval=True)


def _parked_run(control: Control, db: Database, settings: Settings) -> str:
    """An ungated run, claimed and parked ``waiting-approval`` on its node request ``ship``."""
    card = control.plan(release_plan(), envelope=ENV)
    receipt = control.run(card, idempotency_key="k", launcher=RecordingLauncher())
    assert isinstance(receipt, Accepted) and receipt.run_id is not None
    own = Ownership(db, settings=settings)
    assert isinstance(own.claim(receipt.run_id), Activated)
    state = control.approvals.register(
        receipt.run_id, "ship", digest="ci/release:ship", envelope=ENV, owner=own.owner
    )
    assert isinstance(state, PendingApproval)
    WaitStore(db).park(receipt.run_id, own.owner, reason="waiting-approval", token=state.token_id)
    return receipt.run_id


def test_review_card_answers_the_stored_card_and_the_compiled_plan_it_pins(control: Control) -> None:
    card = _gated(control, "1.4.0")
    row, plan = control.review_card(card.plan_id)
    assert row.card.to_json() == card.to_json() and row.gated
    assert (row.plan_name, row.plan_digest) == ("release", card.plan_digest)
    assert [n.id for n in plan.nodes] == ["build", "test", "deploy"]
    with pytest.raises(ControlError, match="plan_not_found") as unknown:
        control.review_card("no-such-card")
    assert unknown.value.details["plan_id"] == "no-such-card"


def test_review_card_refuses_a_card_whose_compiled_plan_is_not_stored(control: Control, db: Database) -> None:
    card = _gated(control, "1.4.0")
    db.write(lambda c: c.execute(sa.text("UPDATE control_plans SET plan_digest = :d"), {"d": "ff" * 32}))
    with pytest.raises(ControlError, match="plan_not_found") as missing:
        control.review_card(card.plan_id)
    assert "is not stored; the stores are inconsistent" in missing.value.message


def test_a_stored_card_that_does_not_decode_is_refused_not_shown(control: Control, db: Database) -> None:
    card = _gated(control, "1.4.0")
    tampered = card.to_json() | {"input": {"version": "6.6.6"}}  # the recorded digest no longer matches
    db.write(
        lambda c: c.execute(
            sa.text("UPDATE control_plans SET card_json = :j"),
            {"j": json.dumps(tampered)},
        )
    )
    with pytest.raises(StoreError, match="decode_failed"):
        control.review_card(card.plan_id)
    with pytest.raises(StoreError, match="decode_failed"):
        control.undecided_cards(10)


def test_undecided_cards_are_the_gated_undecided_ones_oldest_first(control: Control) -> None:
    first, second = _gated(control, "1.0"), _gated(control, "2.0")
    control.plan(release_plan(), input={"version": "3.0"}, envelope=ENV)  # no approval required
    assert [r.plan_id for r in control.undecided_cards(10)] == [first.plan_id, second.plan_id]
    assert [r.plan_id for r in control.undecided_cards(1)] == [first.plan_id]
    assert isinstance(control.approve(first.approval), Accepted)
    assert [r.plan_id for r in control.undecided_cards(10)] == [second.plan_id]


def test_last_approved_card_is_the_plans_latest_approved_card_with_another_digest(control: Control) -> None:
    old, new = _gated(control, "1.0"), _gated(control, "2.0")
    assert control.last_approved_card("release", new.digest) is None  # nothing approved yet
    control.approve(old.approval)
    prev = control.last_approved_card("release", new.digest)
    assert prev is not None and prev.plan_id == old.plan_id and prev.card.envelope == Envelope.from_json(ENV)
    assert control.last_approved_card("release", old.digest) is None  # its own digest is not "previous"
    assert control.last_approved_card("other-plan", new.digest) is None


def test_a_parked_run_and_its_request_are_listed_until_decided(
    control: Control, db: Database, settings: Settings
) -> None:
    run_id = _parked_run(control, db, settings)
    assert [r.run_id for r in control.runs_awaiting_approval().runs] == [run_id]
    ((token, decision),) = control.node_requests(run_id)
    assert (token.request_id, token.digest, decision) == ("ship", "ci/release:ship", None)
    assert token.envelope == Envelope.from_json(ENV)
    control.approve(NodeTarget(run_id, "ship", "ci/release:ship", Envelope.from_json(ENV)))
    ((_, decision),) = control.node_requests(run_id)
    assert decision is not None and decision.decision == "approved"
    assert list(control.runs_awaiting_approval().runs) == []
    assert list(control.node_requests("no-such-run")) == []


def test_run_row_is_the_run_as_stored_and_none_for_an_unknown_run(
    control: Control, db: Database, settings: Settings
) -> None:
    run_id = _parked_run(control, db, settings)
    row = control.run_row(run_id)
    assert row is not None and (row.status, row.waiting_reason) == ("suspended", "waiting-approval")
    assert control.run_row("no-such-run") is None
