"""The control records' owner: plan cards, approval tokens, decisions, grants, receipts, admitted runs and resume
delegations — every statement on the ``control_*`` tables, and the decoder of their rows.

Invariants:

- **One owner.** Every statement on ``control_plans``, ``control_tokens``, ``control_decisions``,
  ``control_grants``, ``control_receipts``, ``control_runs`` and ``control_resumes`` is in this module, and rows
  decode here straight into the control plane's value types (:class:`~smthrs_plugin._control_cards.PlanCard`,
  ``Envelope``, ``Principal``, ``Accepted``: pure modules below this floor); nothing above imports a table. Every
  ``*_in`` function works on the caller's connection, so the control plane composes several of them into ONE
  transaction (a decision, its grant, its journal record, its receipt and its resume delegation commit together
  or not at all).
- **A row that does not decode is corruption**: JSON columns are parsed by :func:`loads` (the inverse of
  :func:`canonical_text`), enumerated columns (token kind, decision) checked, and the value types rebuilt; point
  reads raise ``StoreError(decode_failed)`` naming the row (:func:`decode_failed`; a control plane that treated an
  unreadable decision as "no decision" would let a denied request run). Nothing is repaired silently.
- **A token is decided at most once**: :func:`insert_decision_in` refuses a second decision with
  ``ControlError(already_resolved)``, and the decision table's primary key is the token, so the first writer wins
  under concurrency too.
- **Only ``Accepted`` receipts are stored**; replays are computed from the stored row (``control.receipts``).
- **Admission state of a run** (:func:`admission_state_in`): whether the control plane admitted it (a
  ``control_runs`` row, committed with the run row and gone only with it, so immutable once known) and whether its
  ``control.run.accepted`` sits at the fixed journal address ``(run, ACCEPTED_SOURCE, 0)`` — one round trip.

Prior art: DBOS's ``SystemDatabase`` (one owner of the system tables).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .._control_cards import CardNode, Envelope, PlanCard
from .._control_identity import JSON, Principal
from .._control_receipts import Accepted, receipt_from_dict
from ..canonical import canonical_bytes
from ..errors import ControlError, SmthrsError, StoreError
from ..stores.control_tables import (
    control_decisions,
    control_grants,
    control_plans,
    control_receipts,
    control_resumes,
    control_runs,
    control_tokens,
)
from ..stores.statements import DriverStatement
from .journal import addressed_seq

__all__ = [
    "ACCEPTED_SOURCE",
    "CardRow",
    "TokenRow",
    "DecisionRow",
    "GrantRow",
    "ReceiptRow",
    "AdmissionRow",
    "new_id",
    "canonical_text",
    "loads",
    "decode_failed",
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
    "admission_state_in",
    "admitted_clause",
]

#: The source id of a run's ``control.run.accepted`` (source sequence 0): its presence is what makes the run's
#: control lifecycle facts ``created``; one address per run, so a run is accepted at most once.
ACCEPTED_SOURCE = "control/run-accepted"


def new_id(prefix: str) -> str:
    """A fresh random id ``<prefix>_<32 hex>`` (minted OUTSIDE a transaction callback, which may be re-run)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def canonical_text(value: Any) -> str:
    """RFC 8785 JSON text of plain data (what JSON columns hold)."""
    return canonical_bytes(value).decode("utf-8")


_SAFE_INT = 2**53 - 1


def _number(text: str) -> int | float:
    # Canonical JSON writes an integral float such as 2.0**53 as "9007199254740992"; the identity boundary admits
    # the float but refuses the int, so an integer literal beyond the JSON-safe range is read back as the float it
    # was (ECMAScript formatting is the shortest round-trip form: the same double, the same canonical bytes).
    n = int(text)
    return n if -_SAFE_INT <= n <= _SAFE_INT else float(text)


def loads(text: str) -> Any:
    """Parse a stored JSON column written by :func:`canonical_text`, so it decodes at the identity boundary again."""
    return json.loads(text, parse_int=_number)


def decode_failed(what: str, key: Any, exc: BaseException) -> StoreError:
    """The refusal of a control row (``what`` named by ``key``) that is stored but does not decode."""
    return StoreError(
        "decode_failed",
        f"control {what} {key!r} is stored but does not decode ({exc}); the row is corrupt: restore the database "
        "from a backup, or plan/approve anew",
        cause=exc,
        key=repr(key),
    )


def _principal(pid: Any, kind: Any, what: str, key: Any) -> Principal:
    try:
        return Principal(id=pid, kind=kind)
    except SmthrsError as exc:
        raise decode_failed(what, key, exc) from exc


def _envelope(data: Any, what: str, key: Any) -> Envelope:
    try:
        return Envelope.from_json(data)
    except (ValueError, SmthrsError) as exc:
        raise decode_failed(what, key, exc) from exc


def _json(text: str, what: str, key: Any) -> Any:
    try:
        return loads(text)
    except ValueError as exc:
        raise decode_failed(what, key, exc) from exc


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


_P = control_plans.c


def insert_card_in(conn: Connection, card: PlanCard, seq: int, plan_name: str, now_ms: int) -> None:
    """Store a card (its JSON stored canonically, its digest and persisted-plan digest beside it)."""
    assert card.plan_digest is not None
    conn.execute(
        sa.insert(control_plans).values(
            plan_id=card.plan_id,
            digest=card.digest,
            seq=seq,
            flow_id=card.flow_id,
            plan_name=plan_name,
            plan_digest=card.plan_digest,
            deploy_class=1 if card.deploy_class else 0,
            card_json=canonical_text(card.to_json()),
            created_at_ms=now_ms,
        )
    )


def _card(row: Any) -> CardRow:
    data = _json(row.card_json, "plan card", row.plan_id)
    # Decoded part by part, not through ``PlanCard.from_json``: that decodes the card as ONE input, one level
    # deeper than its ``input`` member, so an input accepted at the depth (or size) bound would not read back.
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
        raise decode_failed("plan card", row.plan_id, exc) from exc
    if card.plan_id != row.plan_id or card.digest != row.digest or card.digest != data.get("digest"):
        raise decode_failed("plan card", row.plan_id, ValueError("its id or digest differs from its columns"))
    return CardRow(card, int(row.seq), row.plan_name, row.plan_digest, int(row.created_at_ms))


def card_in(conn: Connection, plan_id: str) -> CardRow | None:
    row = conn.execute(sa.select(control_plans).where(_P.plan_id == plan_id)).first()
    return None if row is None else _card(row)


def current_card_in(conn: Connection, digest: str) -> CardRow | None:
    """The newest card of a card digest (the one a launch of that content is governed by)."""
    row = conn.execute(
        sa.select(control_plans).where(_P.digest == digest).order_by(_P.seq.desc()).limit(1)
    ).first()
    return None if row is None else _card(row)


_T = control_tokens.c
_D = control_decisions.c


def undecided_plan_cards_in(conn: Connection, limit: int) -> list[CardRow]:
    """Up to ``limit`` cards whose plan approval is required and not decided yet, oldest first (what a reviewer
    has to look at): a plan token with no decision row."""
    q = (
        sa.select(control_plans)
        .join(control_tokens, _T.plan_id == _P.plan_id)
        .outerjoin(control_decisions, _D.token_id == _T.token_id)
        .where(_T.kind == "Plan", _D.token_id.is_(None))
        .order_by(_P.created_at_ms, _P.seq, _P.plan_id)
        .limit(limit)
    )
    return [_card(row) for row in conn.execute(q)]


def last_approved_card_in(conn: Connection, plan_name: str, other_than_digest: str) -> CardRow | None:
    """The most recently approved card of the plan ``plan_name`` whose card digest is not ``other_than_digest``
    (what a reviewer compares a new card with), or None."""
    q = (
        sa.select(control_plans)
        .join(control_tokens, _T.plan_id == _P.plan_id)
        .join(control_decisions, _D.token_id == _T.token_id)
        .where(_P.plan_name == plan_name, _P.digest != other_than_digest, _D.decision == "approved")
        .order_by(_D.decided_at_ms.desc(), _P.seq.desc())
        .limit(1)
    )
    row = conn.execute(q).first()
    return None if row is None else _card(row)


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
    """Store an approval request (its envelope stored canonically) and answer it as read back."""
    conn.execute(
        sa.insert(control_tokens).values(
            token_id=token_id,
            kind=kind,
            plan_id=plan_id,
            run_id=run_id,
            request_id=request_id,
            flow_id=flow_id,
            digest=digest,
            envelope_json=canonical_text(envelope.to_json()),
            created_at_ms=now_ms,
        )
    )
    return TokenRow(token_id, kind, flow_id, digest, envelope, now_ms, plan_id, run_id, request_id)


def _token(row: Any) -> TokenRow:
    envelope = _json(row.envelope_json, "approval token", row.token_id)
    if row.kind not in ("Plan", "Node"):
        raise decode_failed("approval token", row.token_id, ValueError(f"unknown kind {row.kind!r}"))
    return TokenRow(
        row.token_id,
        row.kind,
        row.flow_id,
        row.digest,
        _envelope(envelope, "approval token", row.token_id),
        int(row.created_at_ms),
        row.plan_id,
        row.run_id,
        row.request_id,
    )


def token_in(conn: Connection, token_id: str) -> TokenRow | None:
    row = conn.execute(sa.select(control_tokens).where(_T.token_id == token_id)).first()
    return None if row is None else _token(row)


def plan_token_in(conn: Connection, plan_id: str) -> TokenRow | None:
    row = conn.execute(sa.select(control_tokens).where(_T.plan_id == plan_id)).first()
    return None if row is None else _token(row)


def node_token_in(conn: Connection, run_id: str, request_id: str) -> TokenRow | None:
    row = conn.execute(
        sa.select(control_tokens).where(_T.run_id == run_id, _T.request_id == request_id)
    ).first()
    return None if row is None else _token(row)


def run_tokens_in(conn: Connection, run_id: str) -> list[tuple[TokenRow, DecisionRow | None]]:
    """Every node token of a run with its decision, in registration order."""
    rows = conn.execute(
        sa.select(control_tokens).where(_T.run_id == run_id).order_by(_T.created_at_ms, _T.token_id)
    ).all()
    out = []
    for r in rows:
        token = _token(r)
        out.append((token, decision_in(conn, token.token_id)))
    return out


def decision_in(conn: Connection, token_id: str) -> DecisionRow | None:
    row = conn.execute(sa.select(control_decisions).where(_D.token_id == token_id)).first()
    if row is None:
        return None
    if row.decision not in ("approved", "denied"):
        raise decode_failed("decision", token_id, ValueError(f"unknown decision {row.decision!r}"))
    return DecisionRow(
        row.token_id,
        row.decision,
        _principal(row.principal_id, row.principal_kind, "decision", row.token_id),
        int(row.decided_at_ms),
        row.scope,
        row.grant_id,
        row.via_grant_id,
    )


def insert_decision_in(conn: Connection, d: DecisionRow) -> DecisionRow:
    """Record the one decision of a token; ``already_resolved`` when it already has one."""
    existing = decision_in(conn, d.token_id)
    if existing is not None:
        raise ControlError(
            "already_resolved",
            f"approval token {d.token_id!r} was already {existing.decision} by {existing.principal}; a "
            "decision is final — plan again (or ask again in a new run) to review anew",
            token_id=d.token_id,
            decision=existing.decision,
        )
    conn.execute(
        sa.insert(control_decisions).values(
            token_id=d.token_id,
            decision=d.decision,
            principal_id=d.principal.id,
            principal_kind=d.principal.kind,
            scope=d.scope,
            grant_id=d.grant_id,
            via_grant_id=d.via_grant_id,
            decided_at_ms=d.decided_at_ms,
        )
    )
    return d


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


_G = control_grants.c


def insert_grant_in(conn: Connection, g: GrantRow) -> GrantRow:
    """Store a grant, indexed by its envelope's digest."""
    conn.execute(
        sa.insert(control_grants).values(
            grant_id=g.grant_id,
            token_id=g.token_id,
            kind=g.kind,
            scope=g.scope,
            flow_id=g.flow_id,
            digest=g.digest,
            envelope_digest=g.envelope.digest,
            envelope_json=canonical_text(g.envelope.to_json()),
            run_id=g.run_id,
            principal_id=g.principal.id,
            principal_kind=g.principal.kind,
            created_at_ms=g.created_at_ms,
            used_at_ms=g.used_at_ms,
            used_by_run=g.used_by_run,
        )
    )
    return g


def _grant(row: Any) -> GrantRow:
    return _grant_of(row, _json(row.envelope_json, "grant", row.grant_id))


def _grant_of(row: Any, envelope: Any) -> GrantRow:
    """A grant row whose envelope JSON (``envelope``) is already parsed."""
    return GrantRow(
        row.grant_id,
        row.token_id,
        row.kind,
        row.scope,
        row.flow_id,
        row.digest,
        _envelope(envelope, "grant", row.grant_id),
        _principal(row.principal_id, row.principal_kind, "grant", row.grant_id),
        int(row.created_at_ms),
        row.run_id,
        None if row.used_at_ms is None else int(row.used_at_ms),
        row.used_by_run,
    )


def grant_in(conn: Connection, grant_id: str) -> GrantRow | None:
    row = conn.execute(sa.select(control_grants).where(_G.grant_id == grant_id)).first()
    return None if row is None else _grant(row)


def matching_grant_in(
    conn: Connection,
    kind: str,
    *,
    flow_id: str,
    digest: str,
    envelope: Envelope,
    run_id: str | None,
) -> GrantRow | None:
    """An earlier grant that already covers a new request, oldest first: a ``remembered`` grant of the same flow,
    digest and envelope, or (with ``run_id``) a ``run`` grant of that run with the same digest and envelope.
    Envelopes match by canonical bytes (the stored digest is only the index; the decoded envelope is compared)."""
    conds = [
        sa.and_(_G.scope == "remembered", _G.flow_id == flow_id),
    ]
    if run_id is not None:
        conds.append(sa.and_(_G.scope == "run", _G.run_id == run_id))
    rows = conn.execute(
        sa.select(control_grants)
        .where(_G.kind == kind, _G.digest == digest, _G.envelope_digest == envelope.digest, sa.or_(*conds))
        .order_by(_G.created_at_ms, _G.grant_id)
    ).all()
    # Every candidate's JSON parses before one is chosen: an unparsable candidate refuses, never skipped silently.
    parsed = [(row, _json(row.envelope_json, "grant", row.grant_id)) for row in rows]
    for row, data in parsed:
        grant = _grant_of(row, data)
        if grant.envelope.canonical() == envelope.canonical():
            return grant
    return None


def use_grant_in(conn: Connection, grant_id: str, run_id: str, now_ms: int) -> bool:
    """Mark a ``once`` grant used by ``run_id``; False when another run already used it (compare-and-set)."""
    n = conn.execute(
        sa.update(control_grants)
        .where(_G.grant_id == grant_id, _G.used_at_ms.is_(None))
        .values(used_at_ms=now_ms, used_by_run=run_id)
    ).rowcount
    return bool(n)


# -- receipts ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiptRow:
    """A stored receipt (always ``Accepted``) under its durable key, with the fingerprint a replay compares."""

    durable_key: str
    operation: str
    fingerprint: str
    receipt: Accepted
    run_id: str | None
    created_at_ms: int


_R = control_receipts.c


def receipt_in(conn: Connection, durable_key: str) -> ReceiptRow | None:
    row = conn.execute(sa.select(control_receipts).where(_R.durable_key == durable_key)).first()
    if row is None:
        return None
    try:
        receipt = receipt_from_dict(json.loads(row.receipt_json))
    except (ValueError, SmthrsError) as exc:
        raise decode_failed("receipt", durable_key, exc) from exc
    if not isinstance(receipt, Accepted):
        raise decode_failed("receipt", durable_key, ValueError(f"a stored receipt is {receipt.type}"))
    return ReceiptRow(
        row.durable_key, row.operation, row.fingerprint, receipt, row.run_id, int(row.created_at_ms)
    )


def insert_receipt_in(
    conn: Connection, durable_key: str, operation: str, fingerprint: str, receipt: Accepted, now_ms: int
) -> None:
    """Store an ``Accepted`` receipt (its wire form, canonically) under its durable key."""
    conn.execute(
        sa.insert(control_receipts).values(
            durable_key=durable_key,
            operation=operation,
            fingerprint=fingerprint,
            receipt_json=canonical_text(receipt.to_dict()),
            run_id=receipt.run_id,
            created_at_ms=now_ms,
        )
    )


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


_A = control_runs.c


def insert_admission_in(conn: Connection, a: AdmissionRow) -> None:
    conn.execute(
        sa.insert(control_runs).values(
            run_id=a.run_id,
            plan_id=a.plan_id,
            card_digest=a.card_digest,
            token_id=a.token_id,
            grant_id=a.grant_id,
            durable_key=a.durable_key,
            admitted_by_id=a.admitted_by.id,
            admitted_by_kind=a.admitted_by.kind,
            admitted_at_ms=a.admitted_at_ms,
        )
    )


def admission_in(conn: Connection, run_id: str) -> AdmissionRow | None:
    row = conn.execute(sa.select(control_runs).where(_A.run_id == run_id)).first()
    if row is None:
        return None
    return AdmissionRow(
        row.run_id,
        row.plan_id,
        row.card_digest,
        row.durable_key,
        _principal(row.admitted_by_id, row.admitted_by_kind, "admitted run", run_id),
        int(row.admitted_at_ms),
        row.token_id,
        row.grant_id,
    )


def insert_resume_in(conn: Connection, run_id: str, decision: DecisionRow) -> bool:
    """Record the resume delegation a node decision makes (first writer wins per (run, token))."""
    c = control_resumes.c
    exists = conn.execute(
        sa.select(c.run_id).where(c.run_id == run_id, c.token_id == decision.token_id)
    ).first()
    if exists is not None:
        return False
    conn.execute(
        sa.insert(control_resumes).values(
            run_id=run_id,
            token_id=decision.token_id,
            decision=decision.decision,
            principal_id=decision.principal.id,
            principal_kind=decision.principal.kind,
            created_at_ms=decision.decided_at_ms,
        )
    )
    return True


# -- a run's admission state (the control lifecycle facts' producer asks) ---------------------------------------------

# Asked on every activation and settlement of every run (to learn that most runs are not control-admitted): a
# prepared driver statement, so the probe does not cost the fenced transition it rides on a SQLAlchemy execution.
_ADMISSION_STATE = DriverStatement(
    sa.select(
        sa.select(_A.run_id).where(_A.run_id == sa.bindparam("b_run_id")).scalar_subquery(),
        addressed_seq(sa.bindparam("b_run_id"), ACCEPTED_SOURCE, 0),
    )
)


def admitted_clause(run_id: Any) -> sa.ColumnElement[bool]:
    """``EXISTS`` a ``control_runs`` row for ``run_id`` (a value or bind parameter): the admission probe as a
    condition, for a statement of another owner that must match only runs the control plane did not admit (the
    one-statement activation, whose single journal record cannot include ``control.run.running``)."""
    return sa.exists().where(_A.run_id == run_id)


def admission_state_in(conn: Connection, run_id: str) -> tuple[bool, bool]:
    """``(admitted, accepted)`` of ``run_id`` on ``conn``: whether the control plane admitted it (a
    ``control_runs`` row) and whether its ``control.run.accepted`` is journaled at ``(run, ACCEPTED_SOURCE, 0)``.
    One round trip, two primary/unique-key probes."""
    row = _ADMISSION_STATE.first(conn, {"b_run_id": run_id})
    assert row is not None  # a SELECT of two scalar subqueries always answers one row
    admitted, accepted_seq = row
    return admitted is not None, accepted_seq is not None
