"""The control plane's records as control-plane types: cards, approval tokens, decisions, grants, receipts,
admitted runs, resumes.

The rows themselves are owned by :mod:`smthrs_plugin.records.control` (all of their SQL, the decoding of their
columns); this module turns those records into the control plane's own types (``PlanCard``, ``Envelope``,
``Principal``, ``Accepted``) and back. Every ``*_in`` function reads or writes on the caller's connection, so the
facade (``_control.py``) and the approvals (``approvals.py``) compose several of them into ONE transaction (a
decision, its grant, its journal record, its receipt and its resume delegation commit together or not at all).

Invariants
- A record that does not decode into its control-plane type is corruption: point reads raise
  ``StoreError(decode_failed)`` naming the row (a control plane that treated an unreadable decision as "no
  decision" would let a denied request run); nothing is repaired silently.
- A token is decided at most once: :func:`insert_decision_in` refuses a second decision with
  ``ControlError(already_resolved)`` (the primary key makes the first writer win under concurrency too).
- Only ``Accepted`` receipts are stored (``receipts.py``); replays are computed from the stored row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ..errors import ControlError, SmthrsError
from ..records import control as rc
from ..records.control import canonical_text, loads, new_id
from ._cards import CardNode, Envelope, PlanCard
from .identity import JSON, Principal
from .receipts import Accepted, receipt_from_dict

__all__ = [
    "CardRow",
    "TokenRow",
    "DecisionRow",
    "GrantRow",
    "ReceiptRow",
    "AdmissionRow",
    "new_id",
    "canonical_text",
    "loads",
    "insert_card_in",
    "card_in",
    "current_card_in",
    "undecided_plan_cards_in",
    "last_approved_card_in",
    "insert_token_in",
    "token_in",
    "plan_token_in",
    "node_token_in",
    "run_tokens_in",
    "decision_in",
    "insert_decision_in",
    "insert_grant_in",
    "grant_in",
    "matching_grant_in",
    "use_grant_in",
    "receipt_in",
    "insert_receipt_in",
    "insert_admission_in",
    "admission_in",
    "insert_resume_in",
]

_decode_failed = rc.decode_failed


def _principal(pid: Any, kind: Any, what: str, key: Any) -> Principal:
    try:
        return Principal(id=pid, kind=kind)
    except SmthrsError as exc:
        raise _decode_failed(what, key, exc) from exc


# -- cards ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CardRow:
    """A stored plan card; ``plan_name``/``plan_digest`` locate the compiled plan in the scheduler's plan store."""

    card: PlanCard
    seq: int
    plan_name: str
    plan_digest: str
    created_at_ms: int

    @property
    def plan_id(self) -> str:
        return self.card.plan_id

    @property
    def gated(self) -> bool:
        """Whether a plan approval gates the launch (the card's deploy-class flag)."""
        return self.card.deploy_class


def insert_card_in(conn: Connection, card: PlanCard, seq: int, plan_name: str, now_ms: int) -> None:
    assert card.plan_digest is not None
    rc.insert_card_in(
        conn,
        plan_id=card.plan_id,
        digest=card.digest,
        seq=seq,
        flow_id=card.flow_id,
        plan_name=plan_name,
        plan_digest=card.plan_digest,
        deploy_class=card.deploy_class,
        card=card.to_json(),
        now_ms=now_ms,
    )


def _card(rec: rc.CardRecord) -> CardRow:
    # Decoded part by part, not through ``PlanCard.from_json``: that decodes the card as ONE input, one level
    # deeper than its ``input`` member, so an input accepted at the depth (or size) bound would not read back.
    data = rec.card
    try:
        card = PlanCard(
            plan_id=data["planId"],
            flow_id=data["flowId"],
            input=data["input"],
            envelope=Envelope.from_json(data["envelope"]),
            deploy_class=data["deployClass"],
            plan_digest=data["persistedPlan"],
            nodes=tuple(CardNode.from_json(n) for n in data["nodes"]),
            scope=data["scope"],
        )
    except (ValueError, KeyError, TypeError, SmthrsError) as exc:
        raise _decode_failed("plan card", rec.plan_id, exc) from exc
    if card.plan_id != rec.plan_id or card.digest != rec.digest or card.digest != data.get("digest"):
        raise _decode_failed(
            "plan card", rec.plan_id, ValueError("its id or digest differs from its columns")
        )
    return CardRow(card, rec.seq, rec.plan_name, rec.plan_digest, rec.created_at_ms)


def _card_or_none(rec: rc.CardRecord | None) -> CardRow | None:
    return None if rec is None else _card(rec)


def card_in(conn: Connection, plan_id: str) -> CardRow | None:
    return _card_or_none(rc.card_in(conn, plan_id))


def current_card_in(conn: Connection, digest: str) -> CardRow | None:
    """The newest card of a card digest (the one a launch of that content is governed by)."""
    return _card_or_none(rc.current_card_in(conn, digest))


def undecided_plan_cards_in(conn: Connection, limit: int) -> list[CardRow]:
    """Up to ``limit`` cards whose plan approval is required and not decided yet, oldest first (what a reviewer
    has to look at): a plan token with no decision row."""
    return [_card(rec) for rec in rc.undecided_plan_cards_in(conn, limit)]


def last_approved_card_in(conn: Connection, plan_name: str, other_than_digest: str) -> CardRow | None:
    """The most recently approved card of the plan ``plan_name`` whose card digest is not ``other_than_digest``
    (what a reviewer compares a new card with), or None."""
    return _card_or_none(rc.last_approved_card_in(conn, plan_name, other_than_digest))


# -- tokens and decisions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenRow:
    """One approval request. ``kind`` is ``Plan`` (``plan_id``) or ``Node`` (``run_id``, ``request_id``)."""

    token_id: str
    kind: str
    flow_id: str
    digest: str
    envelope: Envelope
    created_at_ms: int
    plan_id: str | None = None
    run_id: str | None = None
    request_id: str | None = None

    @property
    def target(self) -> str:
        """What an authority is asked about: the plan id, or ``<run id>/<request id>``."""
        return self.plan_id if self.kind == "Plan" else f"{self.run_id}/{self.request_id}"  # type: ignore[return-value]


@dataclass(frozen=True)
class DecisionRow:
    """The one decision of a token. ``via_grant_id`` is set when an earlier grant decided it at registration."""

    token_id: str
    decision: str
    principal: Principal
    decided_at_ms: int
    scope: str | None = None
    grant_id: str | None = None
    via_grant_id: str | None = None


def insert_token_in(
    conn: Connection,
    token_id: str,
    kind: str,
    *,
    flow_id: str,
    digest: str,
    envelope: Envelope,
    now_ms: int,
    plan_id: str | None = None,
    run_id: str | None = None,
    request_id: str | None = None,
) -> TokenRow:
    rc.insert_token_in(
        conn, token_id, kind, flow_id=flow_id, digest=digest, envelope=envelope.to_json(), now_ms=now_ms,
        plan_id=plan_id, run_id=run_id, request_id=request_id,
    )  # fmt: skip
    return TokenRow(token_id, kind, flow_id, digest, envelope, now_ms, plan_id, run_id, request_id)


def _token(rec: rc.TokenRecord) -> TokenRow:
    try:
        envelope = Envelope.from_json(rec.envelope)
    except (ValueError, SmthrsError) as exc:
        raise _decode_failed("approval token", rec.token_id, exc) from exc
    return TokenRow(
        rec.token_id,
        rec.kind,
        rec.flow_id,
        rec.digest,
        envelope,
        rec.created_at_ms,
        rec.plan_id,
        rec.run_id,
        rec.request_id,
    )


def _token_or_none(rec: rc.TokenRecord | None) -> TokenRow | None:
    return None if rec is None else _token(rec)


def token_in(conn: Connection, token_id: str) -> TokenRow | None:
    return _token_or_none(rc.token_in(conn, token_id))


def plan_token_in(conn: Connection, plan_id: str) -> TokenRow | None:
    return _token_or_none(rc.plan_token_in(conn, plan_id))


def node_token_in(conn: Connection, run_id: str, request_id: str) -> TokenRow | None:
    return _token_or_none(rc.node_token_in(conn, run_id, request_id))


def run_tokens_in(conn: Connection, run_id: str) -> list[tuple[TokenRow, DecisionRow | None]]:
    """Every node token of a run with its decision, in registration order."""
    return [(_token(t), _decision_or_none(d)) for t, d in rc.run_tokens_in(conn, run_id)]


def _decision_or_none(rec: rc.DecisionRecord | None) -> DecisionRow | None:
    if rec is None:
        return None
    return DecisionRow(
        rec.token_id,
        rec.decision,
        _principal(rec.principal_id, rec.principal_kind, "decision", rec.token_id),
        rec.decided_at_ms,
        rec.scope,
        rec.grant_id,
        rec.via_grant_id,
    )


def decision_in(conn: Connection, token_id: str) -> DecisionRow | None:
    return _decision_or_none(rc.decision_in(conn, token_id))


def insert_decision_in(conn: Connection, decision: DecisionRow) -> DecisionRow:
    """Record the one decision of a token; ``already_resolved`` when it already has one."""
    existing = decision_in(conn, decision.token_id)
    if existing is not None:
        raise ControlError(
            "already_resolved",
            f"approval token {decision.token_id!r} was already {existing.decision} by {existing.principal}; a "
            "decision is final — plan again (or ask again in a new run) to review anew",
            token_id=decision.token_id,
            decision=existing.decision,
        )
    rc.insert_decision_in(
        conn,
        rc.DecisionRecord(
            decision.token_id, decision.decision, decision.principal.id, decision.principal.kind,
            decision.decided_at_ms, decision.scope, decision.grant_id, decision.via_grant_id,
        ),
    )  # fmt: skip
    return decision


# -- grants ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrantRow:
    """What an approval authorised: ``kind`` (Plan|Node), ``scope`` (once|run|remembered), the pinned digest and
    envelope, the run it belongs to (node grants) and, for a used ``once`` grant, the run that used it."""

    grant_id: str
    token_id: str
    kind: str
    scope: str
    flow_id: str
    digest: str
    envelope: Envelope
    principal: Principal
    created_at_ms: int
    run_id: str | None = None
    used_at_ms: int | None = None
    used_by_run: str | None = None


def insert_grant_in(conn: Connection, grant: GrantRow) -> GrantRow:
    rc.insert_grant_in(
        conn,
        rc.GrantRecord(
            grant_id=grant.grant_id,
            token_id=grant.token_id,
            kind=grant.kind,
            scope=grant.scope,
            flow_id=grant.flow_id,
            digest=grant.digest,
            envelope_digest=grant.envelope.digest,
            envelope=grant.envelope.to_json(),
            principal_id=grant.principal.id,
            principal_kind=grant.principal.kind,
            created_at_ms=grant.created_at_ms,
            run_id=grant.run_id,
            used_at_ms=grant.used_at_ms,
            used_by_run=grant.used_by_run,
        ),
    )
    return grant


def _grant(rec: rc.GrantRecord) -> GrantRow:
    try:
        envelope = Envelope.from_json(rec.envelope)
    except (ValueError, SmthrsError) as exc:
        raise _decode_failed("grant", rec.grant_id, exc) from exc
    return GrantRow(
        rec.grant_id,
        rec.token_id,
        rec.kind,
        rec.scope,
        rec.flow_id,
        rec.digest,
        envelope,
        _principal(rec.principal_id, rec.principal_kind, "grant", rec.grant_id),
        rec.created_at_ms,
        rec.run_id,
        rec.used_at_ms,
        rec.used_by_run,
    )


def grant_in(conn: Connection, grant_id: str) -> GrantRow | None:
    rec = rc.grant_in(conn, grant_id)
    return None if rec is None else _grant(rec)


def matching_grant_in(
    conn: Connection,
    kind: str,
    *,
    flow_id: str,
    digest: str,
    envelope: Envelope,
    run_id: str | None,
) -> GrantRow | None:
    """An earlier grant that already covers a new request: a ``remembered`` grant of the same flow, digest and
    envelope, or (with ``run_id``) a ``run`` grant of that run with the same digest and envelope. Envelopes match
    by canonical bytes (stored digest, then re-checked on the decoded row)."""
    candidates = rc.grant_candidates_in(
        conn, kind, flow_id=flow_id, digest=digest, envelope_digest=envelope.digest, run_id=run_id
    )
    for rec in candidates:
        grant = _grant(rec)
        if grant.envelope.canonical() == envelope.canonical():
            return grant
    return None


def use_grant_in(conn: Connection, grant_id: str, run_id: str, now_ms: int) -> bool:
    """Mark a ``once`` grant used by ``run_id``; False when another run already used it (compare-and-set)."""
    return rc.use_grant_in(conn, grant_id, run_id, now_ms)


# -- receipts ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiptRow:
    durable_key: str
    operation: str
    fingerprint: str
    receipt: Accepted
    run_id: str | None
    created_at_ms: int


def receipt_in(conn: Connection, durable_key: str) -> ReceiptRow | None:
    rec = rc.receipt_in(conn, durable_key)
    if rec is None:
        return None
    try:
        receipt = receipt_from_dict(rec.receipt)
    except (ValueError, SmthrsError) as exc:
        raise _decode_failed("receipt", durable_key, exc) from exc
    if not isinstance(receipt, Accepted):
        raise _decode_failed("receipt", durable_key, ValueError(f"a stored receipt is {receipt.type}"))
    return ReceiptRow(rec.durable_key, rec.operation, rec.fingerprint, receipt, rec.run_id, rec.created_at_ms)


def insert_receipt_in(
    conn: Connection, durable_key: str, operation: str, fingerprint: str, receipt: Accepted, now_ms: int
) -> None:
    rc.insert_receipt_in(conn, durable_key, operation, fingerprint, receipt.to_dict(), receipt.run_id, now_ms)


# -- admitted runs and resume delegations -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionRow:
    """The approval facts of an admitted run."""

    run_id: str
    plan_id: str
    card_digest: str
    durable_key: str
    admitted_by: Principal
    admitted_at_ms: int
    token_id: str | None = None
    grant_id: str | None = None

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {
            "planId": self.plan_id,
            "digest": self.card_digest,
            "admittedBy": dict(self.admitted_by.to_json()),
            "admittedAt": self.admitted_at_ms,
        }
        if self.token_id is not None:
            out["tokenId"] = self.token_id
        if self.grant_id is not None:
            out["grantId"] = self.grant_id
        return out


def insert_admission_in(conn: Connection, a: AdmissionRow) -> None:
    rc.insert_admission_in(
        conn,
        rc.AdmissionRecord(
            a.run_id, a.plan_id, a.card_digest, a.durable_key, a.admitted_by.id, a.admitted_by.kind,
            a.admitted_at_ms, a.token_id, a.grant_id,
        ),
    )  # fmt: skip


def admission_in(conn: Connection, run_id: str) -> AdmissionRow | None:
    rec = rc.admission_in(conn, run_id)
    if rec is None:
        return None
    return AdmissionRow(
        rec.run_id,
        rec.plan_id,
        rec.card_digest,
        rec.durable_key,
        _principal(rec.admitted_by_id, rec.admitted_by_kind, "admitted run", run_id),
        rec.admitted_at_ms,
        rec.token_id,
        rec.grant_id,
    )


def insert_resume_in(conn: Connection, run_id: str, decision: DecisionRow) -> bool:
    """Record the resume delegation a node decision makes (first writer wins per (run, token))."""
    return rc.insert_resume_in(
        conn, run_id, decision.token_id, decision.decision, decision.principal.id, decision.principal.kind,
        decision.decided_at_ms,
    )  # fmt: skip
