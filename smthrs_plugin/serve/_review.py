"""What the review page shows: the pending plan cards and node requests, one card drawn for a reviewer, and the
decision history of a card or a run with what happens next.

``pending_items(control)``, ``card_view(control, ident)`` and ``history_view(control, ident)`` are the results of
the read-only RPC methods ``review.pending``, ``review.card`` and ``review.history``. They are plain JSON built
from the control plane's own reads; nothing here writes. Their own keys follow the one JSON vocabulary
(``smthrs_plugin/vocabulary.py``): snake_case, times as ``*_at_ms``, a run's ``status``/``waiting_reason`` in its words
(``parked``/``approval``), a ``key1_`` value as ``key`` (a node request's or node decision's node key; the
card's compiled plan as ``plan_key``) and ``digest`` only for a plain SHA-256 (the card's).

Invariants
- **Read-only.** Every fact comes from :class:`~smthrs_plugin.control.facade.Control`'s read methods (cards,
  their compiled plans, approval states and decisions, parked runs and their node requests, a run's history); a
  row that does not decode raises as it does for the CLI (a reviewer must never be shown a guessed card).
- **The reviewer sees what the approval pins.** A card's digest, envelope and node graph are the stored card's
  and the stored compiled plan's (the one the card's persisted-plan digest names), never a re-read plan file.
- **"What changed" compares like with like**: the last APPROVED card of the same plan (same plan name, another
  card digest), node by node, with the old and new value of every changed declaration. A node whose only change
  is its key names the changed upstream nodes that explain it; a key change nothing visible explains is shown as
  the key change itself, so no difference is hidden from the reviewer.
- **What happens next is the command the CLI accepts** (``smthrs run PLAN_ID --key KEY``, ``smthrs resume RUN
  --key KEY``), its ids shell-quoted: a hostile id copied into a terminal stays one argument.
- Values are data for the page: every string here may be attacker-controlled (plan ids, commands); the page
  inserts them as text only. A Prefect link is built only from an http(s) UI address the operator configured and
  a flow-run id that is a UUID.
- **Bounded**: what a result lists is bounded by the stored plan (its node limit) or by explicit caps
  (:data:`_MAX_PENDING` cards, a run's newest ``MAX_RUN_DECISIONS`` decisions).

Cards are enumerated by indexed reads (``Control.undecided_cards``, ``Control.last_approved_card``), so
``pending_items`` costs what is pending, not what was ever planned.
"""

from __future__ import annotations

import os
import shlex
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from ..control.approvals import Approved, Denied, PendingApproval, gate_spec
from ..control.facade import Control
from ..control.history import Decision, RunHistory
from ..errors import ControlError
from ..plan import Glob, Plan, PlanNode, TreeArtifact
from ..plan.model import Pending, Ref
from ..records.control import CardRow
from ..vocabulary import cli_state

__all__ = ["pending_items", "card_view", "history_view", "prefect_ui_url"]

#: The most cards ``review.pending`` lists (oldest first).
_MAX_PENDING = 500
_RUN_PAGE = 200
_TERMINAL = frozenset({"completed", "failed", "cancelled"})
# Node fields compared for "what changed" (in the order the page lists them).
_COMPARED = (
    "run",
    "call",
    "with",
    "body",
    "wait",
    "tier",
    "kind",
    "reads",
    "writes",
    "removes",
    "boundary",
    "needs",
    "inputs",
    "layers",
    "capabilities",
    "nondeterministic",
    "approval",
    "priority",
    "conflict",
    "runtime",
)


def pending_items(control: Control) -> dict[str, Any]:
    """``{"plans": [CARD_SUMMARY...], "requests": [REQUEST...]}``: every plan card whose approval is required and
    undecided, and every undecided node request of a run parked on an approval (oldest first)."""
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
    """The card ``ident`` (a plan id) with its node graph, its approval (who decided, when, scope, receipt), who
    may decide it and, when there is one, what changed since the last approved card of the same plan.
    ``ControlError(plan_not_found)`` for an unknown id."""
    if type(ident) is not str or not ident:
        raise ControlError("plan_not_found", "review.card needs the plan id of a card (ident)")
    row, plan = control.review_card(ident)
    nodes = [_node_json(n) for n in plan.nodes]
    return {
        "plan_id": row.plan_id,
        "flow": row.card.flow_id,
        "digest": row.card.digest,
        "plan_key": row.plan_digest,
        "plan_name": row.plan_name,
        "input": row.card.input,
        "envelope": row.card.envelope.to_json(),
        "approval": _approval_json(row, _plan_state(control, row)),
        "decision": _decision_json(control, row.plan_id),
        "approvers": {"plan": _approvers(control, "Plan"), "node": _approvers(control, "Node")},
        "nodes": nodes,
        "edges": [[dep, n.id] for n in plan.nodes for dep in n.depends_on],
        "previous": _previous(control, row, plan, nodes),
    }


# -- cards ------------------------------------------------------------------------------------------------------


def _undecided_cards(control: Control) -> Sequence[CardRow]:
    """The cards waiting for a plan approval, oldest first (an indexed store read; at most :data:`_MAX_PENDING`:
    a page that lists more than a person can review stays bounded in memory)."""
    return control.undecided_cards(_MAX_PENDING)


def _plan_state(control: Control, row: CardRow) -> PendingApproval | Approved | Denied | None:
    state: PendingApproval | Approved | Denied | None = control.plan_state(row.plan_id)
    return state


def _decision_json(control: Control, plan_id: str) -> dict[str, Any] | None:
    return _decision(control.card_decision(plan_id))


def _decision(decision: Decision | None) -> dict[str, Any] | None:
    """``Decision.to_json`` in the vocabulary: ``requested_at_ms``/``decided_at_ms``, and a node decision's
    ``key1_`` node key as ``key`` (a plan decision's ``digest`` is the card's SHA-256 and stays)."""
    if decision is None:
        return None
    out = dict(decision.to_json())
    for old in ("requested_at", "decided_at"):
        if old in out:
            out[old + "_ms"] = out.pop(old)
    if decision.kind == "Node":
        out["key"] = out.pop("digest")
    return out


def _approvers(control: Control, kind: Any) -> list[str] | None:
    found = control.approvers(kind)
    return None if found is None else list(found)


def _approval_json(row: CardRow, state: PendingApproval | Approved | Denied | None) -> dict[str, Any]:
    """``{required, state: pending|approved|denied|not-required, principal?, scope?, decided_at_ms?}``."""
    if state is None:
        return {"required": row.gated, "state": "not-required"}
    out: dict[str, Any] = {"required": True, "state": state.tag.lower()}
    if isinstance(state, (Approved, Denied)):
        out["principal"] = str(state.principal)
        out["decided_at_ms"] = state.decided_at_ms
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
    material = draft.material
    body = material.body if isinstance(material.body, dict) else {}
    out: dict[str, Any] = {"id": n.id, "kind": n.kind, "key": n.key}
    if "run" in body:
        out["run"] = body["run"]
    if "call" in body:
        out["call"] = body["call"]
        if body.get("with"):
            out["with"] = body["with"]
    rest = (
        {k: v for k, v in body.items() if k not in ("run", "call", "with")}
        if isinstance(material.body, dict)
        else material.body
    )
    if rest not in ({}, None):
        out["body"] = rest  # a body written in Python may fold more than run/call/with: never hide it
    if draft.wait is not None:
        out["wait"] = draft.wait
    out.update(
        tier=material.tier,
        reads=[_entry(e) for e in draft.effects.reads],
        writes=[_entry(e) for e in draft.effects.writes],
        removes=[_entry(e) for e in draft.effects.removes],
        needs=list(n.depends_on),
        inputs=[
            i.model_dump(mode="json", by_alias=True) for i in material.inputs if not isinstance(i, Pending)
        ],
        approval=draft.approval,
    )
    # Declarations most plans leave at their default: listed only when set, so they still show (and compare).
    extra: dict[str, Any] = {
        "boundary": draft.effects.boundary_mode if draft.effects.boundary_mode != "hard" else None,
        "layers": list(material.layers) or None,
        "capabilities": {k: list(v) for k, v in material.capabilities.items()} or None,
        "nondeterministic": material.nondeterministic,
        "priority": draft.priority or None,
        "conflict": draft.conflict_strategy if draft.conflict_strategy != "serialize" else None,
        "runtime": draft.runtime_strategy if draft.runtime_strategy != "delay-rebase" else None,
    }
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def _upstream(n: PlanNode) -> list[str]:
    """The nodes whose plan keys ``n``'s key folds (its Ref and Pending inputs), in declaration order."""
    return [i.from_ for i in n.draft.material.inputs if isinstance(i, (Ref, Pending))]


# -- what changed ------------------------------------------------------------------------------------------------


def _previous(
    control: Control, row: CardRow, plan: Plan, nodes: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The last approved card of the same plan name with another digest, who approved it, and the differences."""
    prev = control.last_approved_card(row.plan_name, row.card.digest)
    if prev is None:
        return None
    _, prev_plan = control.review_card(prev.plan_id)
    before = {n["id"]: n for n in (_node_json(p) for p in prev_plan.nodes)}
    after = {n["id"]: n for n in nodes}
    envelope: dict[str, Any] | None = None
    if prev.card.envelope.canonical() != row.card.envelope.canonical():
        envelope = {"old": prev.card.envelope.to_json(), "new": row.card.envelope.to_json()}
    return {
        "plan_id": prev.plan_id,
        "digest": prev.card.digest,
        "approval": _decision_json(control, prev.plan_id),
        "changes": {
            "added": [nid for nid in after if nid not in before],
            "removed": [nid for nid in before if nid not in after],
            "changed": _changed(plan, before, after),
            "envelope": envelope,
        },
    }


def _changed(plan: Plan, before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per node present in both cards that differs: ``{id, fields, values: {FIELD: {old?, new?}},
    key?: {old, new}, because: [upstream ids], cause}``. ``cause`` is ``declaration`` (a field changed),
    ``upstream`` (only the key changed, because the nodes in ``because`` changed) or ``unexplained`` (only the key
    changed and no upstream explains it: the key change itself is the difference shown)."""
    fields: dict[str, list[str]] = {}
    rekeyed: set[str] = set()
    for nid, now in after.items():
        was = before.get(nid)
        if was is None:
            continue
        fields[nid] = [f for f in _COMPARED if was.get(f) != now.get(f)]
        if was["key"] != now["key"]:
            rekeyed.add(nid)
    # Plan order is topological over material inputs, so an upstream's causes are known before its dependents'.
    causes: dict[str, list[str]] = {}
    for n in plan.nodes:
        found: list[str] = []
        for u in _upstream(n):
            if u not in fields:
                named = [u]  # added since the last approved card: a new key
            elif fields[u]:
                # Changed: it explains a key change only if its own key changed too (not e.g. its needs).
                named = [u] if u in rekeyed else []
            elif u in rekeyed:
                named = causes.get(u) or [u]  # re-keyed itself: its own causes, or u when nothing explains it
            else:
                named = []
            found.extend(x for x in named if x not in found)
        causes[n.id] = found

    out: list[dict[str, Any]] = []
    for n in plan.nodes:
        nid = n.id
        if nid not in fields or (not fields[nid] and nid not in rekeyed):
            continue
        was, now = before[nid], after[nid]
        entry: dict[str, Any] = {
            "id": nid,
            "fields": fields[nid],
            "values": {f: _old_new(was, now, f) for f in fields[nid]},
            "because": causes[nid] if nid in rekeyed else [],
        }
        if nid in rekeyed:
            entry["key"] = {"old": was["key"], "new": now["key"]}
        entry["cause"] = "declaration" if fields[nid] else ("upstream" if entry["because"] else "unexplained")
        out.append(entry)
    return out


def _old_new(was: dict[str, Any], now: dict[str, Any], f: str) -> dict[str, Any]:
    """``{old?, new?}``: a member is omitted when the declaration was (or is now) absent, never shown as null."""
    return {k: d[f] for k, d in (("old", was), ("new", now)) if f in d}


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
    approvers = _approvers(control, "Node")
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
            "key": t.digest,
            "envelope": t.envelope.to_json(),
            "requested_at_ms": t.created_at_ms,
            "approvers": approvers,
        }
        for t in pending
    ]


# -- history and what happens next ---------------------------------------------------------------------------------


def history_view(control: Control, ident: str) -> dict[str, Any]:
    """The decision history of ``ident``: a plan card (``kind: "plan"``) or a run (``kind: "run"``), with what
    happens next. ``ControlError(plan_not_found)`` when ``ident`` is neither."""
    if type(ident) is not str or not ident:
        raise ControlError("plan_not_found", "review.history needs a plan id or a run id (ident)")
    try:
        row, _ = control.review_card(ident)
    except ControlError as exc:
        if exc.code != "plan_not_found":
            raise
    else:
        return _plan_history(control, row)
    try:
        run = control.run_history(ident)
    except ControlError as exc:
        if exc.code != "run_not_found":
            raise
        raise ControlError(
            "plan_not_found",
            f"{ident!r} is neither a plan card nor a run; review.pending lists the cards and runs waiting for a "
            "decision, and `runs` the runs",
            plan_id=ident,
        ) from None
    return _run_history(run)


def _plan_history(control: Control, row: CardRow) -> dict[str, Any]:
    decision = control.card_decision(row.plan_id)
    prev = control.last_approved_card(row.plan_name, row.card.digest)
    earlier = None if prev is None else control.card_decision(prev.plan_id)
    return {
        "kind": "plan",
        "plan_id": row.plan_id,
        "flow": row.card.flow_id,
        "digest": row.card.digest,
        "plan_name": row.plan_name,
        "planned_at_ms": row.created_at_ms,
        "decision": _decision(decision),
        "previous": _decision(earlier),
        "next": _plan_next(
            row.plan_id, None if decision is None else decision.decision, decision is not None
        ),
    }


def _plan_next(plan_id: str, decision: str | None, gated: bool) -> dict[str, Any]:
    launch = f"smthrs run {shlex.quote(plan_id)} --key KEY"
    if gated and decision is None:
        return {"state": "waiting", "text": "Waiting for a decision: the CI job's retries exit 75 (parked)."}
    if decision == "denied":
        return {
            "state": "stopped",
            "text": "Denied: this card never launches; the CI job's retry exits 3 (plan_denied). Change the plan "
            "(or its input) and plan it again for a new review.",
        }
    return {
        "state": "retry",
        "command": launch,
        "text": "The CI job re-runs its command with the SAME key (KEY: the idempotency key it used): `smthrs run "
        "PLAN.yaml --key KEY`, or the plan id as here. The card launches; a retry never runs anything twice.",
    }


def _run_history(run: RunHistory) -> dict[str, Any]:
    adm = run.admission
    status, waiting_reason = cli_state(run.status, run.waiting_reason)
    return {
        "kind": "run",
        "run_id": run.run_id,
        "flow": run.flow,
        "status": status,
        "waiting_reason": waiting_reason,
        "plan_id": None if adm is None else adm.plan_id,
        "admitted_by": None if adm is None else str(adm.admitted_by),
        "admitted_at_ms": None if adm is None else adm.admitted_at_ms,
        "plan_decision": _decision(run.plan_decision),
        "decisions": [_decision(d) for d in run.decisions],
        "omitted": run.omitted,
        "prefect": _prefect_json(run),
        "next": _run_next(run),
    }


def _run_next(run: RunHistory) -> dict[str, Any]:
    rid = shlex.quote(run.run_id)
    if run.status in _TERMINAL:
        return {"state": "done", "text": f"The run {run.status}: nothing to re-run."}
    if run.status == "suspended" and run.waiting_reason == "waiting-approval":
        return {"state": "waiting", "text": "Waiting for a decision on a node request: the run stays parked."}
    last = run.decisions[-1].decision if run.decisions else None
    denied = (
        " The request was denied: the node fails (ApprovalDenied) when the run is driven, and the run fails."
        if last == "denied"
        else ""
    )
    if run.prefect is not None and run.prefect.deployment_id is not None:
        return {
            "state": "woken",
            "text": f"Woken: Prefect runs flow run {run.prefect.flow_run_id} of deployment "
            f"{run.prefect.deployment_id} again (the decision told it); no command to re-run." + denied,
        }
    if run.status == "running":
        return {"state": "running", "text": "The run is being driven now: nothing to re-run." + denied}
    if run.admission is not None:
        return {
            "state": "retry",
            "command": f"smthrs resume {rid} --key KEY",
            "text": "Drive the run again: `smthrs resume RUN --key KEY` (KEY names this resume), or the CI job's "
            f"retry of its own command with its SAME key (`smthrs run {shlex.quote(run.admission.plan_id)} --key "
            "KEY`) continues it." + denied,
        }
    return {
        "state": "retry",
        "command": f"smthrs resume {rid} --key KEY --flow MODULE:FLOW",
        "text": "A flow's run (not a plan's): drive it with its flow's code, `smthrs resume RUN --key KEY --flow "
        f"MODULE:FLOW` or `smthrs worker --flow MODULE:FLOW --run {rid}`." + denied,
    }


def _prefect_json(run: RunHistory) -> dict[str, Any] | None:
    if run.prefect is None:
        return None
    return {
        "flow_run_id": run.prefect.flow_run_id,
        "deployment_id": run.prefect.deployment_id,
        "url": prefect_ui_url(run.prefect.flow_run_id),
    }


def prefect_ui_url(flow_run_id: str, env: Mapping[str, str] | None = None) -> str | None:
    """The Prefect UI page of flow run ``flow_run_id``: ``PREFECT_UI_URL``, else ``PREFECT_API_URL`` without its
    ``/api`` suffix, plus ``/runs/flow-run/<id>``; None when neither is set (or is not http(s)) or the id is not a
    UUID (a link is never built from something that could smuggle a scheme or a path)."""
    env = os.environ if env is None else env
    base = env.get("PREFECT_UI_URL") or ""
    if not base:
        api = (env.get("PREFECT_API_URL") or "").rstrip("/")
        base = api.removesuffix("/api") if api.endswith("/api") else ""
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    try:
        canonical = str(uuid.UUID(flow_run_id))
    except ValueError:
        return None
    if canonical != flow_run_id.lower():
        return None
    return f"{base.rstrip('/')}/runs/flow-run/{canonical}"
