"""What the review page shows: the pending plan cards and node requests, and one card drawn for a reviewer.

``pending_items(control)`` and ``card_view(control, ident)`` are the results of the read-only RPC methods
``review.pending`` and ``review.card``. They are plain JSON built from the control
plane's own reads; nothing here writes.

Invariants
- **Read-only.** Every fact comes from :class:`~smthrs_plugin.control.facade.Control`'s read methods (cards,
  their compiled plans, approval states, parked runs and their node requests); a row that does not decode raises
  as it does for the CLI (a reviewer must never be shown a guessed card).
- **The reviewer sees what the approval pins.** A card's digest, envelope and node graph are the stored card's
  and the stored compiled plan's (the one the card's persisted-plan digest names), never a re-read plan file.
- **"What changed" compares like with like**: the last APPROVED card of the same plan (same plan name, another
  card digest), node by node. A change the visible fields do not show (e.g. an upstream key) still appears as the
  node's ``key`` changing, so no difference is hidden from the reviewer.
- Values are data for the page: every string here may be attacker-controlled (plan ids, commands); the page
  inserts them as text only.

Cards are enumerated by indexed reads (``Control.undecided_cards``, ``Control.last_approved_card``), so
``pending_items`` costs what is pending, not what was ever planned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..control.approvals import Approved, Denied, PendingApproval, gate_spec
from ..control.facade import Control
from ..control.identity import JSON
from ..errors import ControlError
from ..plan import Glob, PlanNode, TreeArtifact
from ..plan.model import Pending
from ..records.control import CardRow

__all__ = ["pending_items", "card_view"]

#: The most cards ``review.pending`` lists (oldest first).
_MAX_PENDING = 500
_RUN_PAGE = 200
# Node fields compared for "what changed" (in the order the page lists them).
_COMPARED = (
    "run",
    "call",
    "with",
    "wait",
    "tier",
    "reads",
    "writes",
    "removes",
    "needs",
    "inputs",
    "approval",
)


def pending_items(control: Control) -> dict[str, Any]:
    """``{"plans": [CARD_SUMMARY...], "requests": [REQUEST...]}``: every plan card whose approval is required and
    undecided, and every undecided node request of a run parked ``waiting-approval`` (oldest first)."""
    plans: list[dict[str, Any]] = []
    for row in _undecided_cards(control):
        state = _plan_state(control, row)
        if isinstance(state, PendingApproval):
            plans.append(
                {
                    "plan_id": row.plan_id,
                    "flow": row.card.flow_id,
                    "digest": row.card.digest,
                    "envelope": row.card.envelope.to_json(),
                    "approval": _approval_json(row, state),
                    "nodes": len(row.card.nodes),
                }
            )
    return {"plans": plans, "requests": _pending_requests(control)}


def card_view(control: Control, ident: str) -> dict[str, Any]:
    """The card ``ident`` (a plan id) with its node graph and, when there is one, what changed since the last
    approved card of the same plan. ``ControlError(plan_not_found)`` for an unknown id."""
    if type(ident) is not str or not ident:
        raise ControlError("plan_not_found", "review.card needs the plan id of a card (ident)")
    row, plan = control.review_card(ident)
    nodes = [_node_json(n) for n in plan.nodes]
    return {
        "plan_id": row.plan_id,
        "flow": row.card.flow_id,
        "digest": row.card.digest,
        "persisted_plan": row.plan_digest,
        "plan_name": row.plan_name,
        "input": row.card.input,
        "envelope": row.card.envelope.to_json(),
        "approval": _approval_json(row, _plan_state(control, row)),
        "nodes": nodes,
        "edges": [[dep, n.id] for n in plan.nodes for dep in n.depends_on],
        "previous": _previous(control, row, nodes),
    }


# -- cards ------------------------------------------------------------------------------------------------------


def _undecided_cards(control: Control) -> Sequence[CardRow]:
    """The cards waiting for a plan approval, oldest first (an indexed store read; at most :data:`_MAX_PENDING`:
    a page that lists more than a person can review stays bounded in memory)."""
    return control.undecided_cards(_MAX_PENDING)


def _plan_state(control: Control, row: CardRow) -> PendingApproval | Approved | Denied | None:
    state: PendingApproval | Approved | Denied | None = control.plan_state(row.plan_id)
    return state


def _approval_json(row: CardRow, state: PendingApproval | Approved | Denied | None) -> dict[str, Any]:
    """``{required, state: pending|approved|denied|not-required, principal?, scope?, decided_at?}``."""
    if state is None:
        return {"required": row.gated, "state": "not-required"}
    out: dict[str, Any] = {"required": True, "state": state.tag.lower()}
    if isinstance(state, (Approved, Denied)):
        out["principal"] = str(state.principal)
        out["decided_at"] = state.decided_at_ms
    if isinstance(state, Approved):
        out["scope"] = state.scope
    return out


# -- nodes -------------------------------------------------------------------------------------------------------


def _entry(e: Any) -> str:
    if isinstance(e, TreeArtifact):
        return e.path.rstrip("/") + "/"
    if isinstance(e, Glob):
        text = " | ".join(e.include)
        return text + (" (except " + " | ".join(e.exclude) + ")" if e.exclude else "")
    return str(e)


def _node_json(n: PlanNode) -> dict[str, Any]:
    draft = n.draft
    body = draft.material.body if isinstance(draft.material.body, dict) else {}
    out: dict[str, Any] = {"id": n.id, "kind": n.kind, "key": n.key}
    if "run" in body:
        out["run"] = body["run"]
    if "call" in body:
        out["call"] = body["call"]
        if body.get("with"):
            out["with"] = body["with"]
    if draft.wait is not None:
        out["wait"] = draft.wait
    out.update(
        tier=draft.material.tier,
        reads=[_entry(e) for e in draft.effects.reads],
        writes=[_entry(e) for e in draft.effects.writes],
        removes=[_entry(e) for e in draft.effects.removes],
        needs=list(n.depends_on),
        inputs=[
            i.model_dump(mode="json", by_alias=True)
            for i in draft.material.inputs
            if not isinstance(i, Pending)
        ],
        approval=draft.approval,
    )
    return out


# -- what changed ------------------------------------------------------------------------------------------------


def _previous(control: Control, row: CardRow, nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last approved card of the same plan name with another digest, and the differences from it."""
    prev = control.last_approved_card(row.plan_name, row.card.digest)
    if prev is None:
        return None
    _, prev_plan = control.review_card(prev.plan_id)
    before = {n["id"]: n for n in (_node_json(p) for p in prev_plan.nodes)}
    after = {n["id"]: n for n in nodes}
    changed: list[dict[str, JSON]] = []
    for nid, now in after.items():
        was = before.get(nid)
        if was is None:
            continue
        fields: list[JSON] = [f for f in _COMPARED if was.get(f) != now.get(f)]
        if not fields and was["key"] != now["key"]:
            fields = ["key"]  # e.g. an upstream node changed: same declaration, another key
        if fields:
            changed.append({"id": nid, "fields": fields})
    return {
        "plan_id": prev.plan_id,
        "digest": prev.card.digest,
        "changes": {
            "added": [nid for nid in after if nid not in before],
            "removed": [nid for nid in before if nid not in after],
            "changed": changed,
            "envelope": prev.card.envelope.canonical() != row.card.envelope.canonical(),
        },
    }


# -- node requests -------------------------------------------------------------------------------------------------


def _pending_requests(control: Control) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page = control.runs_awaiting_approval(cursor=cursor, limit=_RUN_PAGE)
        for run in page.runs:
            out.extend(_run_requests(control, run.run_id))
        cursor = page.cursor
        if cursor is None:
            return out


def _run_requests(control: Control, run_id: str) -> list[dict[str, Any]]:
    tokens = control.node_requests(run_id)
    pending = [t for t, d in tokens if d is None]
    if not pending:
        return []
    plan_id: str | None = None
    gates: dict[str, str] = {}
    try:
        admitted = control.admitted(run_id)
    except ControlError as exc:
        if exc.code != "run_not_found":
            raise
        admitted = None  # a flow's run (sp.require_approval), not a plan's: no card, no plan node
    if admitted is not None:
        plan_id = admitted.card.plan_id
        for n in admitted.plan.nodes:
            if n.draft.approval is not None:
                gates[gate_spec(n.id, n.draft.approval)[0]] = n.id
    return [
        {
            "run_id": run_id,
            "plan_id": plan_id,
            "request": t.request_id,
            "node": gates.get(str(t.request_id)),
            "digest": t.digest,
            "envelope": t.envelope.to_json(),
            "requested_at": t.created_at_ms,
        }
        for t in pending
    ]
