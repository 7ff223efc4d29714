"""Prefect's *Resume* on a flow run parked on an smthrs approval: what it says, and what it may decide.

Invariants
- A parked approval's state message and flow-run log name the run, the request, where to decide (the exact
  ``smthrs approve``/``smthrs deny`` lines, the review page when one is configured) and what Prefect's Resume
  does there. Every such Paused state carries a Resume form (flow-run inputs stored BEFORE the state is set, so
  Prefect never shows a form it cannot load); its description says the same.
- The form decides only where ``SMTHRS_PREFECT_UI_PRINCIPAL`` is set AND the flow run belongs to a deployment:
  Prefect runs that flow run again after Resume (``Paused(reschedule=True)``), and that execution, before its
  body reaches the gate, records the submitted decision through ``Control.approve``/``deny`` as that principal —
  the approval authority judges it exactly as ``smthrs approve --as``. Refused (the principal, a stale digest, a
  malformed input): logged on the flow run as the typed error, nothing recorded, the flow run parks again.
- Elsewhere the form accepts only an empty submission: on a deployment Prefect runs the flow run again and it
  parks again, logging that nothing was decided and where to decide. A direct flow run (a script, a test, a
  ``smthrs worker`` drive) has no process left to act on a Resume, so its form refuses every submission and the
  flow run stays Paused.
- A submitted decision binds the request and digest the form was offered for, and is applied once: its
  idempotency key names the pause, so a repeat (a crash before the input was deleted) is a replay.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from ..control.identity import Principal, refuse
from ..engine.context import RunParked
from ..errors import ControlError, SmthrsError
from ..runtime import Runtime
from ..settings import Settings
from . import _events

__all__ = [
    "PAUSE_PREFIX",
    "MAX_NOTE",
    "Offer",
    "ui_principal",
    "approval_message",
    "approval_offer",
    "publish",
    "decide_from_resume",
]

log = logging.getLogger(__name__)

#: Every pause key smthrs gives a parked approval starts with it (the Resume form's inputs are named after it).
PAUSE_PREFIX = "smthrs-"
#: A note longer than this is refused by the form (and cut in the log line).
MAX_NOTE = 1000
#: The property a refusing form requires and can never accept: its name is what Prefect's refusal shows.
_REFUSED_FIELD = "resuming_from_prefect_decides_nothing"

Mode = Literal["form", "nothing", "refused"]


def ui_principal(settings: Settings) -> Principal | None:
    """The principal Prefect-UI decisions are recorded as (``SMTHRS_PREFECT_UI_PRINCIPAL``), or None."""
    text = settings.prefect_ui_principal
    return None if text is None else Principal.parse(text.strip())


def approval_message(run_id: str, request: str, mode: Mode, *, principal: Principal | None, then: str) -> str:
    """The state message (and flow-run log line) of a flow run parked on approval ``request`` of ``run_id``."""
    c = _events.commands(run_id, request=request)
    parts = [f"smthrs run {run_id} waits for approval {request!r}", f"decide: {c['approve']} | {c['deny']}"]
    url = _events.review_url()
    if url:
        parts.append(f"review: {url}")
    parts.append(_resume_says(mode, principal))
    parts.append(f"then {then}")
    return "; ".join(parts)


def _resume_says(mode: Mode, principal: Principal | None) -> str:
    if mode == "form":
        return f"or Resume here with a decision (recorded as {principal})"
    if mode == "nothing":
        return "Prefect's Resume decides nothing here (the flow run parks again)"
    return "Prefect's Resume is refused here (it would decide nothing)"


@dataclass(frozen=True)
class Offer:
    """A parked approval's Paused state and the flow-run inputs its Resume form reads (stored first)."""

    state: Any
    inputs: dict[str, str]
    message: str


def approval_offer(
    signal: RunParked,
    *,
    deployment: bool,
    principal: Principal | None,
    digest: str | None,
    then: str,
    state_name: str,
) -> Offer:
    """The Paused state of a flow run parked on ``signal`` (an approval) and its form (see the module invariants).
    ``digest``: the digest of the pending request the form decides (None: the form decides nothing)."""
    from prefect.input.run_input import keyset_from_paused_state
    from prefect.states import Paused

    mode: Mode = "refused" if not deployment else "form" if principal and digest else "nothing"
    message = approval_message(signal.run_id, signal.name, mode, principal=principal, then=then)
    state: Any = Paused(
        reschedule=deployment, name=state_name, message=message, pause_key=f"{PAUSE_PREFIX}{uuid.uuid4().hex}"
    )
    keyset: dict[str, str] = {str(k): v for k, v in keyset_from_paused_state(state).items()}
    state.state_details.run_input_keyset = keyset
    inputs = {
        keyset["schema"]: json.dumps(_schema(mode)),
        keyset["description"]: json.dumps(_description(signal, mode, principal)),
    }
    if deployment:  # the execution after a Resume reads what this pause was about
        target = {"run_id": signal.run_id, "request_id": signal.name, "digest": digest}
        inputs[_target_key(keyset)] = json.dumps(target)
    return Offer(state, inputs, message)


def publish(flow_run_id: str, offer: Offer) -> None:
    """Store ``offer``'s form inputs on the flow run (before its state is set; raises what the API raises)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for key, value in offer.inputs.items():
            client.create_flow_run_input(uuid.UUID(flow_run_id), key=key, value=value)


def _target_key(keyset: dict[str, str]) -> str:
    return keyset["response"].removesuffix("response") + "smthrs-target"


def _schema(mode: Mode) -> dict[str, Any]:
    if mode == "form":
        return {
            "title": "smthrs approval",
            "type": "object",
            "properties": {
                "decision": {
                    "title": "Decision",
                    "description": "approve or deny the request (empty: decide nothing, park again)",
                    "anyOf": [{"enum": ["approve", "deny"], "type": "string"}, {"type": "null"}],
                    "default": None,
                },
                "note": {
                    "title": "Note",
                    "description": "logged with the decision on this flow run",
                    "anyOf": [{"type": "string", "maxLength": MAX_NOTE}, {"type": "null"}],
                    "default": None,
                },
            },
            "additionalProperties": False,
        }
    if mode == "nothing":
        return {"title": "smthrs approval", "type": "object", "properties": {}, "additionalProperties": False}
    return {
        "title": "smthrs approval",
        "type": "object",
        "properties": {
            _REFUSED_FIELD: {
                "title": "Resuming from Prefect decides nothing: use smthrs approve / smthrs deny",
                "type": "string",
                "pattern": "$^.",  # matches nothing: no submission is accepted
            }
        },
        "required": [_REFUSED_FIELD],
        "additionalProperties": False,
    }


def _description(signal: RunParked, mode: Mode, principal: Principal | None) -> str:
    c = _events.commands(signal.run_id, request=signal.name)
    lines = [
        f"smthrs run `{signal.run_id}` waits for approval `{signal.name}`.",
        "",
        f"- approve: `{c['approve']}`",
        f"- deny: `{c['deny']}`",
    ]
    url = _events.review_url()
    if url:
        lines.append(f"- review page: {url}")
    lines.append("")
    if mode == "form":
        lines.append(
            f"Or choose a decision here: it is recorded as `{principal}`, if the approval authority allows that "
            "principal; an empty decision records nothing and the flow run parks again."
        )
    elif mode == "nothing":
        lines.append(
            "Resuming here records no decision: Prefect runs the flow run again and it parks again "
            "(SMTHRS_PREFECT_UI_PRINCIPAL is not set where it runs)."
        )
    else:
        lines.append(
            "Resuming here is refused: nothing would continue this flow run (it was not started from a "
            "deployment). Decide with the commands above."
        )
    return "\n".join(lines)


# -- the execution after a Resume ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Resumed:
    """What the last Parked pause of a flow run offered and what Prefect's Resume submitted (None: nothing)."""

    pause_key: str
    response_key: str
    target: dict[str, Any]
    submitted: dict[str, Any] | None


def decide_from_resume(rt: Runtime, flow_run_id: str, run_id: str, state_name: str, logger: Any) -> None:
    """In an execution of a deployment flow run ``flow_run_id`` (bound to smthrs run ``run_id``), before its body
    runs: apply the decision Prefect's Resume form submitted on its last parked approval, or say on the flow run
    that the Resume decided nothing (see the module invariants). Prefect being unreachable is logged with its
    cause, never raised: the run's outcome must not depend on Prefect's display, and the flow run parks again."""
    try:
        resumed = _last_resume(flow_run_id, state_name)
    except Exception as exc:  # noqa: BLE001 - reported on the flow run; the gate parks the run again
        logger.warning(
            "could not read what Prefect's Resume submitted for flow run %s (%r): no decision is taken from it, "
            "and a pending approval parks the flow run again",
            flow_run_id,
            exc,
            exc_info=exc,
        )
        return
    if resumed is None:
        return
    request = str(resumed.target.get("request_id"))
    control = rt.control()
    pending = any(t.request_id == request for t in control.pending_requests(run_id))
    try:
        _apply(rt, run_id, flow_run_id, resumed, pending, logger)
    finally:
        if resumed.submitted is not None:
            _forget(flow_run_id, resumed.response_key, logger)


def _apply(rt: Runtime, run_id: str, flow_run_id: str, resumed: _Resumed, pending: bool, logger: Any) -> None:
    request = str(resumed.target.get("request_id"))
    c = _events.commands(run_id, request=request)
    where = f"decide with `{c['approve']}` or `{c['deny']}`"
    submitted = resumed.submitted or {}
    decision = submitted.get("decision")
    if decision is None:
        if pending:
            logger.warning(
                "flow run resumed from Prefect without a decision: nothing is recorded for approval %r of smthrs "
                "run %s, and the flow run parks again; %s",
                request,
                run_id,
                where,
            )
        return
    try:
        action, note = _checked(submitted)
        principal = ui_principal(rt.settings)
        if principal is None:
            raise ControlError(
                "unauthorized",
                f"Prefect's Resume form submitted {action!r} for approval {request!r}, but this process has no "
                "SMTHRS_PREFECT_UI_PRINCIPAL to record it as; set it where the deployment runs, or "
                f"{where.removeprefix('decide with ')}",
                run_id=run_id,
                request_id=request,
            )
        control = rt.control()
        target = control.approval_target(run_id, request, str(resumed.target.get("digest")))
        key = f"prefect-resume/{flow_run_id}/{resumed.pause_key}"
        if action == "approve":
            receipt = control.approve(target, idempotency_key=key, principal=principal)
        else:
            receipt = control.deny(target, idempotency_key=key, principal=principal)
    except SmthrsError as exc:
        logger.error(
            "Prefect's Resume form: the decision on approval %r of smthrs run %s was refused (%s/%s): %s. Nothing "
            "is recorded and the flow run parks again; %s",
            request,
            run_id,
            exc.family,
            exc.code,
            exc.message,
            where,
        )
        return
    logger.info(
        "recorded %s of approval %r of smthrs run %s as %s from Prefect's Resume form (%s)%s",
        action,
        request,
        run_id,
        principal,
        type(receipt).__name__,
        f"; note: {note}" if note else "",
    )


def _checked(submitted: dict[str, Any]) -> tuple[str, str]:
    """``(decision, note)`` of a submitted form, or ``InvalidInput`` (Prefect validated it against the form's
    schema; this guards an input written through the API by other means)."""
    decision, note = submitted.get("decision"), submitted.get("note")
    extra = set(submitted) - {"decision", "note"}
    if decision not in ("approve", "deny") or not (note is None or isinstance(note, str)) or extra:
        raise refuse(
            "operation",
            f"the Resume input {sorted(submitted)} is not {{decision: approve|deny, note?}}; resume again from "
            "the form",
        )
    return str(decision), (note or "")[:MAX_NOTE]


def _last_resume(flow_run_id: str, state_name: str) -> _Resumed | None:
    """The last parked pause of the flow run, when it is the latest parked state and carries an smthrs form with a
    target, with what was submitted; None otherwise."""
    from prefect.client.orchestration import get_client

    fid = uuid.UUID(flow_run_id)
    with get_client(sync_client=True) as client:
        parked = [s for s in client.read_flow_run_states(fid) if s.name == state_name]
        if not parked:
            return None
        last = max(parked, key=lambda s: s.timestamp)
        keyset = last.state_details.run_input_keyset
        pause_key = str(last.state_details.pause_key or "")
        if not last.is_paused() or not keyset or not pause_key.startswith(PAUSE_PREFIX):
            return None
        target_text = _read_input(client, fid, _target_key(keyset))
        raw = _read_input(client, fid, keyset["response"])
    target = json.loads(target_text) if target_text is not None else None
    if not isinstance(target, dict):
        target = {}
    submitted = json.loads(raw) if raw is not None else None
    if submitted is not None and not isinstance(submitted, dict):
        submitted = {"decision": submitted}  # refused by _checked with what was sent
    if not target.get("request_id"):
        return None  # not a deployment's pause: nothing continues it after a Resume
    return _Resumed(pause_key, keyset["response"], target, submitted)


def _read_input(client: Any, flow_run_id: uuid.UUID, key: str) -> str | None:
    """The flow-run input ``key`` as stored (JSON text), None when there is none (the API answers 404)."""
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    try:
        return str(client.read_flow_run_input(flow_run_id, key))
    except ObjectNotFound:
        return None
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code == 404:
            return None
        raise


def _forget(flow_run_id: str, key: str, logger: Any) -> None:
    """Delete a consumed Resume input (a repeat would only replay the same decision: reported, not raised)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            client.delete_flow_run_input(uuid.UUID(flow_run_id), key)
    except Exception as exc:  # noqa: BLE001 - a leftover input is replayed under the same key: reported
        logger.warning(
            "could not delete the consumed Resume input %s of flow run %s: %r", key, flow_run_id, exc
        )
