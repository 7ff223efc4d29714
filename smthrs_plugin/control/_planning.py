"""Plan cards: building the reviewable card of a compiled plan, minting a card (with its approval token) and
retiring one.

Invariants
- A card is built from a VERIFIED plan (``verify_plan``) and its inputs decoded at the identity boundary; every
  node gate's spec is checked (``gate_spec``) before anything is written.
- Card ids are ``<plan>-<card digest[:12]>`` and ``.<n>`` for the n-th successor of the same content: one card per
  content is current (the highest ``seq``). A card is retired — the next ``plan`` of that content mints its
  successor — when it was denied, or when the ``once`` grant its approval installed was used by a run.
- Minting is one transaction with its ``control.plan.created`` record and, for a gated card (the deploy-class
  flag, ``approval: required``), its approval token; a ``remembered`` plan grant of the same flow, card digest and
  envelope decides the new token at once (journaled ``control.approval.approved`` naming the grant).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy.engine import Connection

from .._control_cards import CardNode, Envelope, PlanCard
from ..canonical import sha256_hex
from ..errors import ControlError
from ..plan import Plan, verify_plan
from ..records import control as rc
from ..records.journal import Journal, plan_partition
from .approvals import gate_spec
from .identity import Principal, decode_input

__all__ = ["probe_card", "mint_card_in", "retired_in"]


def probe_card(
    plan: Plan, input: Any, envelope: Envelope | Mapping[str, Any] | None, approval: bool
) -> tuple[Plan, PlanCard]:
    """``(verified plan, card)`` — the card under a provisional id (its digest does not depend on the id)."""
    inp = decode_input({} if input is None else input)
    env = envelope if type(envelope) is Envelope else Envelope.from_json(envelope or {})
    assert isinstance(env, Envelope)
    if type(approval) is not bool:
        raise ControlError("invalid_options", "approval is a bool (true when the plan needs an approval)")
    plan = verify_plan(plan)
    for n in plan.nodes:
        if n.draft.approval is not None:
            gate_spec(n.id, n.draft.approval)
    nodes = tuple(CardNode(n.id, n.kind, n.key, tuple(n.depends_on)) for n in plan.nodes)
    return plan, PlanCard(plan.plan_id, plan.flow, inp, env, approval, plan.digest, nodes)


def mint_card_in(
    conn: Connection,
    journal: Journal,
    now: int,
    probe: PlanCard,
    name: str,
    seq: int,
    token_id: str,
    principal: Principal,
) -> PlanCard:
    """Store the ``seq``-th card of ``probe``'s content under its final id (see the module invariants)."""
    base = name if len(name) <= 200 else "plan-" + sha256_hex(name.encode("utf-8"))[:16]
    plan_id = f"{base}-{probe.digest[:12]}" + (f".{seq}" if seq else "")
    card = replace(probe, plan_id=plan_id)
    rc.insert_card_in(conn, card, seq, name, now)
    journal.append_in(
        conn,
        plan_partition(plan_id),
        "control.plan.created",
        {
            "planId": plan_id,
            "digest": card.digest,
            "flowId": card.flow_id,
            "persistedPlan": card.plan_digest,
            "deployClass": card.deploy_class,
            "nodes": len(card.nodes),
            "principal": dict(principal.to_json()),
        },
    )
    if not card.deploy_class:
        return card
    token = rc.insert_token_in(
        conn, token_id, "Plan", flow_id=card.flow_id, digest=card.digest, envelope=card.envelope, now_ms=now,
        plan_id=plan_id,
    )  # fmt: skip
    remembered = rc.matching_grant_in(
        conn, "Plan", flow_id=card.flow_id, digest=card.digest, envelope=card.envelope, run_id=None
    )
    if remembered is not None:
        rc.insert_decision_in(
            conn,
            rc.DecisionRow(token.token_id, "approved", remembered.principal, now, remembered.scope, None,
                           remembered.grant_id),
        )  # fmt: skip
        journal.append_in(
            conn,
            plan_partition(plan_id),
            "control.approval.approved",
            {"factVersion": 1, "tokenId": token.token_id, "viaGrant": remembered.grant_id,
             "principal": dict(remembered.principal.to_json()), "scope": remembered.scope},
        )  # fmt: skip
    return card


def retired_in(conn: Connection, card: rc.CardRow) -> bool:
    """A denied card, or one whose ``once`` grant a run already used: a launch of its content needs a new card."""
    if not card.gated:
        return False
    token = rc.plan_token_in(conn, card.plan_id)
    decision = None if token is None else rc.decision_in(conn, token.token_id)
    if decision is None:
        return False
    if decision.decision == "denied":
        return True
    grant = rc.grant_in(conn, decision.grant_id) if decision.grant_id else None
    return grant is not None and grant.scope == "once" and grant.used_at_ms is not None
