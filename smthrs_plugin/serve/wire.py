"""The JSON objects ``smthrs serve`` answers, shared with the ``smthrs signal`` command. PURE of any web framework.

Invariants
- **One shape per verb, whichever door it came through.** A JSON-RPC result is the object the CLI prints for the
  same verb with ``--json`` (README "JSON output"): our own fields snake_case and always present (null when they do
  not apply), the nested ``receipt`` in the receipts' wire spelling (``_tag``, ``receiptId``, ``runId``, ``planId``)
  plus ``type``. The CLI prints the very objects built here (``cli/control_support.answer``: ``cli`` may import
  ``serve``, never the reverse), so the two doors cannot drift apart.
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
from ..stores.database import Database

__all__ = [
    "MAX_BODY_BYTES",
    "PARSE_DEPTH",
    "loads_json",
    "receipt_payload",
    "receipt_answer",
    "plan_payload",
    "show_payload",
    "runs_payload",
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


def receipt_payload(control: Control, receipt: Any, *, operation: str, card: Any = None) -> dict[str, Any]:
    """What ``smthrs approve|deny|cancel|resume|signal --json`` prints for ``receipt``: the receipt, the state of the
    run it names (status, waiting reason, pending node requests) and the plan it belongs to. ``resume`` adds
    ``settlements`` and ``owner`` (empty and null: the server records a resume, it does not drive the run); the
    verbs that tell a run's host (approve, deny, cancel, signal) add ``host_wake``: what the host answered
    (``{"type": "HostWoken" | "HostNotParked" | "HostWakeFailed", "run_id", "host", "detail"}``), null when no host
    was told."""
    return receipt_answer(control, receipt, operation=operation, card=card)[0]


def receipt_answer(
    control: Control, receipt: Any, *, operation: str, card: Any = None
) -> tuple[dict[str, Any], RunView | None]:
    """:func:`receipt_payload` and the run view it was built from (the CLI prints more of it), read once."""
    payload: dict[str, Any] = {
        "receipt": {"type": receipt.type, **receipt.to_dict()},
        "run_id": None,
        "status": None,
        "waiting_reason": None,
        "requests": [],
        "plan_id": getattr(receipt, "plan_id", None),
        "digest": None,
    }
    if card is not None:
        payload.update(plan_id=card.plan_id, digest=card.digest)
    run_id = getattr(receipt, "run_id", None)
    view = None
    if run_id is not None:
        view = control.show(run_id)
        payload.update(run_id=run_id, status=view.status, waiting_reason=view.waiting_reason)
        payload["requests"] = [r.to_json() for r in view.requests if r.state == "pending"]
        if view.admission is not None and card is None:
            payload.update(plan_id=view.admission.plan_id, digest=view.admission.card_digest)
    if operation in ("run", "resume"):
        payload["settlements"] = []
        payload["owner"] = None
    if operation in _TELLS_HOST:
        payload["host_wake"] = host_wake_json(control.last_host_wake())
    return payload, view


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
    return {"run": obs.to_json(), "source": batch.source, "revision": batch.revision}, not isinstance(
        obs, Missing
    )


def runs_payload(
    db: Database, *, status: str | None, flow: str | None, limit: int, cursor: str | None
) -> dict[str, Any]:
    """What ``smthrs runs --json`` prints for these filters (a page in creation order and the next cursor)."""
    filters = RunFilters(status=status, flow=flow, parent_run_id=ANY, waiting_reason=ANY)
    page = list_runs(db, filters, cursor=cursor, limit=limit)
    return {
        "runs": [r.to_json() for r in page.runs],
        "cursor": page.cursor,
        "source": page.source,
        "revision": page.revision,
    }
