"""Decision history: who decided a plan card or a run's node requests, when, with which scope, digest and receipt,
read from the control records (nothing here writes). :class:`~smthrs_plugin.control.facade.Control` exposes it as
``card_decision`` and ``run_history``.

Invariants
- **Only the control plane's own records.** A decision is its token row and its one decision row
  (``records.control``); a run's context is its run row, its admission row and the newest ``prefect-flow-run``
  journal record of its partition. Every read is by primary or unique key (token by plan id, decision by token,
  receipt by durable key, tokens by run id).
- **A receipt is named only when it is provably the decision's**: the receipt stored under the key the facade
  derives for that decision (``derive(action, target)``, the same function the facade decides with) whose
  request fingerprint is the one that decision's mutation has. A decision made under a caller's own idempotency
  key, or decided at registration by an earlier grant, has ``receipt_id`` None — never a guessed receipt.
- **Bounded**: a run's node decisions are the newest :data:`MAX_RUN_DECISIONS` (``omitted`` counts the rest).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ..records import control as rc
from ..records.journal import latest_payload_json_in
from ..records.runs import run_row_in
from .authority import DelegatedAuthority, NodeTarget, PlanTarget, Target
from .identity import JSON, Mutation, Principal

__all__ = [
    "MAX_RUN_DECISIONS",
    "PREFECT_FLOW_RUN_RECORD",
    "Derive",
    "Decision",
    "PrefectFlowRun",
    "RunHistory",
    "card_decision_in",
    "run_history_in",
    "approvers_of",
]

#: The most node decisions one run's history lists (the newest).
MAX_RUN_DECISIONS = 100
#: The journal record the Prefect integration writes on a run's partition each time a flow run binds it
#: (``flow_run_id``, ``deployment_id`` when the flow run belongs to a deployment).
PREFECT_FLOW_RUN_RECORD = "prefect-flow-run"

#: ``derive(action, target)``: the idempotency key a decision made without one is recorded under.
Derive = Callable[[str, Target], str]


@dataclass(frozen=True)
class Decision:
    """One approval request (a plan card's or a node's) and its decision; ``decision`` None while undecided.
    ``via_grant_id``: an earlier grant decided it at registration (no one clicked; no receipt)."""

    kind: str
    token_id: str
    flow_id: str
    digest: str
    envelope: dict[str, JSON]
    requested_at_ms: int
    plan_id: str | None
    run_id: str | None
    request_id: str | None
    decision: str | None = None
    principal: Principal | None = None
    decided_at_ms: int | None = None
    scope: str | None = None
    grant_id: str | None = None
    via_grant_id: str | None = None
    receipt_id: str | None = None

    def to_json(self) -> dict[str, JSON]:
        """``{kind, state: pending|approved|denied, digest, envelope, requested_at, plan_id?, run_id?, request?,
        principal?, decided_at?, scope?, grant?, via_grant?, receipt?}`` (absent members omitted)."""
        out: dict[str, JSON] = {
            "kind": self.kind,
            "state": self.decision or "pending",
            "flow": self.flow_id,
            "digest": self.digest,
            "envelope": self.envelope,
            "requested_at": self.requested_at_ms,
        }
        optional: dict[str, JSON] = {
            "plan_id": self.plan_id,
            "run_id": self.run_id,
            "request": self.request_id,
            "principal": None if self.principal is None else str(self.principal),
            "decided_at": self.decided_at_ms,
            "scope": self.scope,
            "grant": self.grant_id,
            "via_grant": self.via_grant_id,
            "receipt": self.receipt_id,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        return out


@dataclass(frozen=True)
class PrefectFlowRun:
    """The newest Prefect flow run recorded for a run; ``deployment_id`` set when Prefect itself continues it."""

    flow_run_id: str
    deployment_id: str | None


@dataclass(frozen=True)
class RunHistory:
    """A run as a reviewer follows it: its row now, its admission (a plan run) with the card decision that let it
    launch, its node decisions (newest :data:`MAX_RUN_DECISIONS`, oldest first) and its Prefect flow run."""

    run_id: str
    flow: str
    status: str
    waiting_reason: str | None
    admission: rc.AdmissionRow | None
    plan_decision: Decision | None
    decisions: tuple[Decision, ...]
    omitted: int
    prefect: PrefectFlowRun | None


def _decision(conn: Connection, token: rc.TokenRow, d: rc.DecisionRow | None, derive: Derive) -> Decision:
    base = Decision(
        token.kind, token.token_id, token.flow_id, token.digest, dict(token.envelope.to_json()),
        token.created_at_ms, token.plan_id, token.run_id, token.request_id,
    )  # fmt: skip
    if d is None:
        return base
    return Decision(
        **{**base.__dict__, "decision": d.decision, "principal": d.principal, "decided_at_ms": d.decided_at_ms,
           "scope": d.scope, "grant_id": d.grant_id, "via_grant_id": d.via_grant_id,
           "receipt_id": _receipt_id_in(conn, token, d, derive)},
    )  # fmt: skip


def _receipt_id_in(conn: Connection, token: rc.TokenRow, d: rc.DecisionRow, derive: Derive) -> str | None:
    if d.via_grant_id is not None:
        return None  # decided at registration by an earlier grant: no mutation, no receipt
    action = "approve" if d.decision == "approved" else "deny"
    target: Target = (
        PlanTarget(str(token.plan_id), token.digest, token.envelope)
        if token.kind == "Plan"
        else NodeTarget(str(token.run_id), str(token.request_id), token.digest, token.envelope)
    )
    body: dict[str, JSON] = {"target": target.to_json()}
    if action == "approve" and d.scope is not None:
        body["scope"] = d.scope
    m = Mutation(action, derive(action, target), body, d.principal)
    row = rc.receipt_in(conn, m.durable_key)
    if row is None or row.fingerprint != m.fingerprint:
        return None  # decided under the caller's own key: its receipt is not findable by key
    return row.receipt.receipt_id


def card_decision_in(conn: Connection, plan_id: str, derive: Derive) -> Decision | None:
    """The approval of card ``plan_id`` (None when its launch needs none)."""
    token = rc.plan_token_in(conn, plan_id)
    if token is None:
        return None
    return _decision(conn, token, rc.decision_in(conn, token.token_id), derive)


def run_history_in(conn: Connection, run_id: str, derive: Derive, limit: int) -> RunHistory | None:
    """The history of ``run_id`` (None when the run does not exist)."""
    row = run_row_in(conn, run_id)
    if row is None:
        return None
    admission = rc.admission_in(conn, run_id)
    plan_decision = None if admission is None else card_decision_in(conn, admission.plan_id, derive)
    tokens = rc.run_tokens_in(conn, run_id)
    kept = tokens[-limit:] if limit > 0 else []
    return RunHistory(
        run_id, row.flow, row.status, row.waiting_reason, admission, plan_decision,
        tuple(_decision(conn, t, d, derive) for t, d in kept), len(tokens) - len(kept),
        _prefect_flow_run_in(conn, run_id),
    )  # fmt: skip


def _prefect_flow_run_in(conn: Connection, run_id: str) -> PrefectFlowRun | None:
    text = latest_payload_json_in(conn, run_id, PREFECT_FLOW_RUN_RECORD)
    if text is None:
        return None
    try:
        payload: Any = json.loads(text)
        flow_run_id = payload["flow_run_id"]
        deployment = payload.get("deployment_id")
        if type(flow_run_id) is not str or not (deployment is None or type(deployment) is str):
            raise ValueError("flow_run_id / deployment_id are not strings")
    except (ValueError, KeyError, TypeError) as exc:
        raise rc.decode_failed(f"{PREFECT_FLOW_RUN_RECORD} record of run", run_id, exc) from exc
    return PrefectFlowRun(flow_run_id, deployment or None)


def approvers_of(authority: Any, kind: str) -> tuple[str, ...] | None:
    """Who ``authority`` lets decide ``kind`` (``Plan``/``Node``) targets, each as ``ID/KIND (scopes ...)``; None
    for an authority whose rule cannot be listed (a plugin's: it decides per request)."""
    if type(authority) is not DelegatedAuthority:
        return None
    return tuple(
        f"{d.principal} (scopes {', '.join(sorted(d.scopes))})"
        for d in authority.delegations
        if kind in d.targets
    )
