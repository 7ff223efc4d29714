"""The JSON objects ``smthrs serve`` answers, shared with the CLI. PURE of any web framework.

Invariants
- **One shape per verb, whichever door it came through.** A JSON-RPC result is the object the CLI prints for the
  same verb with ``--json``, in the one vocabulary (docs/rules.md "JSON vocabulary", ``smthrs_plugin/vocabulary.py``):
  our own fields snake_case and always present (null when they do not apply), a run's ``status``
  pending|running|parked|completed|failed|cancelled with its ``waiting_reason`` approval|timer|signal|released|
  quarantine, a node request's ``key1_`` node key as ``key``, times as ``*_at_ms``; the nested ``receipt`` in the
  receipts' wire spelling (``_tag``, ``receiptId``, ``runId``, ``planId``) with no ``type`` copy. The CLI builds
  its answers here too (``cli`` may import ``serve``, never the reverse), so the two doors cannot drift apart.
- **A parked answer always says so**: a ``Parked`` receipt names only the plan, so the answer to a call that named
  a run (``resume``, ``cancel``) still names that run with its state and pending requests; a plan awaiting its
  approval (no run yet) answers ``status: "parked"``, ``waiting_reason: "approval"``, ``run_id: null``.
- **Caller JSON text is parsed by the one bounded decoder** (``_untrusted.decode_json``): strict UTF-8, one meaning
  per document (a duplicate member name is refused: ``{"ident": A, "ident": B}`` must not approve B here and mean
  A to another parser), no ``NaN``/``Infinity``, no integer of thousands of digits, bounded nesting; every refusal
  is a typed ``InvalidInput``, never a ``ValueError``/``RecursionError``. What it admits then crosses the identity
  boundary (``control/identity.py``) like any other input.
"""

from __future__ import annotations

from typing import Any

from .._untrusted import decode_json
from ..control.facade import Control
from ..control.identity import MAX_CANONICAL_BYTES, MAX_DEPTH
from ..control.views import RunView
from ..engine.waits.flow_waits import host_wake_json
from ..observe.catalog import ANY, RunFilters, list_runs
from ..observe.snapshot import Missing, read
from ..observe.watch import ControlEvent
from ..stores.database import Database
from ..vocabulary import (
    cli_event,
    cli_receipt,
    cli_request,
    cli_run,
    cli_state,
    status_filter,
    waiting_filter,
)

__all__ = [
    "MAX_BODY_BYTES",
    "PARSE_DEPTH",
    "loads_json",
    "receipt_payload",
    "receipt_answer",
    "in_vocabulary",
    "plan_payload",
    "show_payload",
    "runs_payload",
    "event_payload",
]

#: The largest request body the server reads: the identity boundary's 4 MiB of canonical JSON plus room for the
#: JSON-RPC envelope and whitespace. A larger body is refused before it is read (``413``).
MAX_BODY_BYTES = MAX_CANONICAL_BYTES + 64 * 1024
#: The parser's nesting bound: the identity boundary's :data:`MAX_DEPTH` for values plus room for the JSON-RPC
#: envelope (request, params) and then some, so a value one level too deep still reaches the identity boundary,
#: whose ``depth`` refusal names where. Deeper still is refused by the parser, also typed ``depth``.
PARSE_DEPTH = 2 * MAX_DEPTH


def loads_json(text: str | bytes, what: str) -> Any:
    """Parse caller JSON ``text`` (``what`` names it in refusals) with the one bounded decoder
    (:func:`~smthrs_plugin._untrusted.decode_json`); ``InvalidInput`` for anything it refuses (not JSON, not UTF-8,
    over :data:`MAX_BODY_BYTES`, duplicate member names, an integer of more than 100 digits, NaN/Infinity, nesting
    deeper than :data:`PARSE_DEPTH`)."""
    return decode_json(text, what, max_bytes=MAX_BODY_BYTES, max_depth=PARSE_DEPTH)


def receipt_payload(
    control: Control, receipt: Any, *, operation: str, card: Any = None, run_id: str | None = None
) -> dict[str, Any]:
    """What ``smthrs approve|deny|cancel|resume|signal --json`` prints for ``receipt``, in the vocabulary: the
    receipt, the state of the run it names (``status``, ``waiting_reason``, pending node ``requests``) and the plan
    it belongs to. ``run_id`` is the run the call named: a ``Parked`` receipt names only the plan, and the answer
    still names the run. ``resume`` adds ``settlements`` and ``owner`` (empty and null: the server records a
    resume, it does not drive the run); the verbs that tell a run's host (approve, deny, cancel, signal) add
    ``host_wake``: what the host answered (``{"type": "HostWoken" | "HostNotParked" | "HostWakeFailed", "run_id",
    "host", "detail"}``), null when no host was told."""
    payload, _ = receipt_answer(control, receipt, operation=operation, card=card, run_id=run_id)
    return in_vocabulary(payload, parked_plan=receipt.type == "Parked" and payload["run_id"] is None)


def receipt_answer(
    control: Control, receipt: Any, *, operation: str, card: Any = None, run_id: str | None = None
) -> tuple[dict[str, Any], RunView | None]:
    """:func:`receipt_payload` BEFORE its translation (stored status and waiting reason, requests with their
    ``digest``: exit codes are computed from the stored names) and the run view it was built from, read once.
    Finish it with :func:`in_vocabulary` before printing or answering it."""
    payload: dict[str, Any] = {
        "receipt": receipt.to_dict(),
        "run_id": None,
        "status": None,
        "waiting_reason": None,
        "requests": [],
        "plan_id": getattr(receipt, "plan_id", None),
        "digest": None,
    }
    if card is not None:
        payload.update(plan_id=card.plan_id, digest=card.digest)
    named = getattr(receipt, "run_id", None) or run_id
    view = None
    if named is not None:
        view = control.show(named)
        payload.update(run_id=named, status=view.status, waiting_reason=view.waiting_reason)
        payload["requests"] = [r.to_json() for r in view.pending]
        if view.admission is not None and card is None:
            payload.update(plan_id=view.admission.plan_id, digest=view.admission.card_digest)
    if operation in ("run", "resume"):
        payload["settlements"] = []
        payload["owner"] = None
    if operation in _TELLS_HOST:
        payload["host_wake"] = host_wake_json(control.last_host_wake())
    return payload, view


def in_vocabulary(payload: dict[str, Any], *, parked_plan: bool = False) -> dict[str, Any]:
    """A :func:`receipt_answer` payload in the vocabulary (a new dict): ``status``/``waiting_reason`` translated,
    the receipt without a ``type`` copy, each request's ``key1_`` node key as ``key``. ``parked_plan``: the receipt
    is a plan awaiting its approval — no run yet, but the launch is parked on an approval, and the answer says so."""
    out = dict(payload)
    if parked_plan:
        out.update(status="parked", waiting_reason="approval")
    else:
        out["status"], out["waiting_reason"] = cli_state(payload["status"], payload["waiting_reason"])
    out["receipt"] = cli_receipt(payload["receipt"])
    out["requests"] = [cli_request(r) for r in payload["requests"]]
    return out


#: The verbs after which the control plane tells the run's host (``Control.last_host_wake``).
_TELLS_HOST = frozenset({"approve", "deny", "cancel", "signal"})


def plan_payload(control: Control, card: Any) -> dict[str, Any]:
    """What ``smthrs plan --json`` prints: the card in its wire form and its approval state."""
    state = control.plan_state(card.plan_id)
    return {
        "plan_id": card.plan_id,
        "flow_id": card.flow_id,
        "digest": card.digest,
        "approval_state": "none" if state is None else state.tag.lower(),
        "card": card.to_json(),
    }


def show_payload(db: Database, run_id: str) -> tuple[dict[str, Any], bool]:
    """What ``smthrs show RUN --json`` prints, and whether the run exists (the CLI exits 2 when it does not)."""
    batch = read(db, [run_id])
    obs = batch.items[0]
    run = cli_run(obs.to_json())
    return {"run": run, "source": batch.source, "revision": batch.revision}, not isinstance(obs, Missing)


def runs_payload(
    db: Database,
    *,
    status: str | None,
    flow: str | None,
    limit: int,
    cursor: str | None,
    waiting: str | None = None,
) -> dict[str, Any]:
    """What ``smthrs runs --json`` prints for these filters (a page in creation order and the next cursor).
    ``status`` and ``waiting`` take the vocabulary's words (a stored name such as ``suspended`` is refused,
    ``ControlError(invalid_options)``, naming the word to use)."""
    filters = RunFilters(
        status=status_filter(status),
        flow=flow,
        parent_run_id=ANY,
        waiting_reason=ANY if waiting is None else waiting_filter(waiting),
    )
    page = list_runs(db, filters, cursor=cursor, limit=limit)
    return {
        "runs": [cli_run(r.to_json()) for r in page.runs],
        "cursor": page.cursor,
        "source": page.source,
        "revision": page.revision,
    }


def event_payload(event: ControlEvent) -> dict[str, Any]:
    """One event as ``smthrs watch --json`` prints it: ``{sequence, kind, run_id, occurred_at_ms, payload, cursor,
    partition}``, the ``payload`` being the journal record exactly as written."""
    return cli_event(event.to_json())
