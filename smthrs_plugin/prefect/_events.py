"""What smthrs tells Prefect about its work: the ``smthrs.*`` events and the commands/links a flow run's page shows.

The catalogue (names, resource ids, labels, payloads) is a contract automations match on; README "Automations"
lists it. Invariants:

- **Stable**: keys may be added (every payload carries ``"version": 1``); none is renamed or removed without a
  new ``version``.
- **One place**: every ``smthrs.*`` event is built here and sent by :func:`emit`; nothing else calls
  ``emit_event``.
- **When Prefect is in use, and only then**: inside a flow or task run, always; outside one, only with
  ``PREFECT_API_URL`` set — never starting the ephemeral server, and without it not even importing Prefect.
- **An event never changes an outcome**: it is sent after the durable fact it reports; a failure is logged.
- **No secrets**: ids, digests, commands and URLs only. A ``@step`` hit inside a task run sends no
  ``smthrs.step.clean`` (its ``Cached`` state is that record).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..canonical import sha256_hex
from ..control.views import RequestView, RunView, view_in
from ..engine.context import RunParked
from ..errors import SettingsError
from ..stores.database import Database

__all__ = [
    "VERSION",
    "NODE_PREFIX",
    "STEP_PREFIX",
    "CACHE_REFUSED",
    "RUN_PARKED",
    "APPROVAL_REQUESTED",
    "APPROVAL_PREFIX",
    "REFUSED_DECISIONS",
    "SERVE_URL_ENV",
    "REVIEW_URL_ENV",
    "SmthrsEvent",
    "run_resource_id",
    "step_resource_id",
    "node_resource_id",
    "cache_resource_id",
    "approval_resource_id",
    "node_settled",
    "step_settled",
    "cache_refused",
    "run_parked",
    "approval_requested",
    "approval_decided",
    "commands",
    "review_url",
    "prefect_in_use",
    "current_flow_run_id",
    "emit",
    "announce_parked",
    "artifact_key",
    "links_markdown",
    "parked_markdown",
    "parked_hint",
    "describe_flow_run",
]

log = logging.getLogger(__name__)

#: The payload schema version every event carries.
VERSION = 1
NODE_PREFIX = "smthrs.node."
STEP_PREFIX = "smthrs.step."
CACHE_REFUSED = "smthrs.cache.refused"
RUN_PARKED = "smthrs.run.parked"
APPROVAL_REQUESTED = "smthrs.approval.requested"
#: ``smthrs.approval.approved`` / ``smthrs.approval.denied`` (the journal's ``control.approval.<decision>``).
APPROVAL_PREFIX = "smthrs.approval."
#: Cache decisions that mean "an entry for this key existed and was not served".
REFUSED_DECISIONS = frozenset({"UnverifiableEvidence", "Unmeasurable", "StaleReadSet", "ReplayFailed"})
#: Where a running ``smthrs serve`` is reachable (its review page is ``/`` of it), e.g. ``http://ci-review:8765``.
SERVE_URL_ENV = "SMTHRS_SERVE_URL"
#: The review page's own address (wins over ``SMTHRS_SERVE_URL``; ``Settings.review_url``).
REVIEW_URL_ENV = "SMTHRS_REVIEW_URL"
#: The runs' waiting reasons (``runs.waiting_reason``, ``smthrs show``) of each parked kind.
_REASONS = {"timer": "timer", "event": "event", "approval": "waiting-approval"}
#: Error lines are one line; a pathological one is cut so an event stays far below Prefect's size limit.
_MAX_TEXT = 2000


@dataclass(frozen=True)
class SmthrsEvent:
    """One catalogued event, ready for ``prefect.events.emit_event``."""

    event: str
    resource: dict[str, str]
    related: list[dict[str, str]] = field(default_factory=list)
    payload: dict[str, Any] = field(default_factory=dict)


# -- resource ids -------------------------------------------------------------------------------------------------


def run_resource_id(run_id: str) -> str:
    return f"smthrs.run.{run_id}"


def step_resource_id(identity: str) -> str:
    return f"smthrs.step.{identity}"


def node_resource_id(plan_id: str, node_id: str) -> str:
    return f"smthrs.node.{plan_id}.{node_id}"


def cache_resource_id(dispatch_key: str) -> str:
    return f"smthrs.cache.{dispatch_key}"


def approval_resource_id(token_id: str) -> str:
    return f"smthrs.approval.{token_id}"


def _related(
    *,
    run_id: str | None = None,
    task_run_id: str | None = None,
    flow_run_id: str | None = None,
    token_id: str | None = None,
    extra: tuple[tuple[str, str], ...] = (),
) -> list[dict[str, str]]:
    out = [{"prefect.resource.id": rid, "prefect.resource.role": role} for rid, role in extra]
    if task_run_id is not None:
        out.append(
            {"prefect.resource.id": f"prefect.task-run.{task_run_id}", "prefect.resource.role": "task-run"}
        )
    if flow_run_id is not None:
        out.append(
            {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}
        )
    if run_id is not None:
        out.append({"prefect.resource.id": run_resource_id(run_id), "prefect.resource.role": "smthrs-run"})
    if token_id is not None:
        out.append(
            {
                "prefect.resource.id": approval_resource_id(token_id),
                "prefect.resource.role": "smthrs-approval",
            }
        )
    return out


def _text(value: str | None) -> str | None:
    if value is None or len(value) <= _MAX_TEXT:
        return value
    return value[: _MAX_TEXT - 1] + "…"


def _labels(**labels: str | None) -> dict[str, str]:
    return {f"smthrs.{k.replace('_', '-')}": v for k, v in labels.items() if v is not None}


# -- builders -----------------------------------------------------------------------------------------------------


def node_settled(
    *,
    run_id: str,
    plan_id: str,
    node: str,
    attempt: int,
    dispatch_key: str,
    outcome: str,
    cache_decision: str | None,
    conflict: bool,
    error: str | None,
    duration_ms: float,
    task_run_id: str | None,
    flow_run_id: str | None,
) -> SmthrsEvent:
    """``smthrs.node.<outcome>``: a plan node dispatch settled in a Prefect task run (the Prefect host)."""
    return SmthrsEvent(
        event=NODE_PREFIX + outcome,
        resource={
            "prefect.resource.id": node_resource_id(plan_id, node),
            "prefect.resource.name": node,
            **_labels(run_id=run_id, plan_id=plan_id, node=node, outcome=outcome),
        },
        related=_related(run_id=run_id, task_run_id=task_run_id, flow_run_id=flow_run_id),
        payload={
            "version": VERSION,
            "run_id": run_id,
            "plan_id": plan_id,
            "node": node,
            "attempt": attempt,
            "dispatch_key": dispatch_key,
            "outcome": outcome,
            "cache_decision": cache_decision,
            "conflict": conflict,
            "error": _text(error),
            "duration_ms": round(duration_ms, 3),
        },
    )


def step_settled(
    *,
    run_id: str,
    step: str,
    node: str,
    attempt: int,
    dispatch_key: str,
    outcome: str,
    cache_decision: str | None,
    tier: str | None,
    error: str | None,
    timings_ms: Mapping[str, float],
    task_run_id: str | None,
    flow_run_id: str | None,
) -> SmthrsEvent:
    """``smthrs.step.<outcome>``: a ``@step`` call settled (``tier``: where a verified hit came from)."""
    return SmthrsEvent(
        event=STEP_PREFIX + outcome,
        resource={
            "prefect.resource.id": step_resource_id(step),
            "prefect.resource.name": node,
            **_labels(run_id=run_id, step=step, outcome=outcome),
        },
        related=_related(run_id=run_id, task_run_id=task_run_id, flow_run_id=flow_run_id),
        payload={
            "version": VERSION,
            "run_id": run_id,
            "step": step,
            "node": node,
            "attempt": attempt,
            "dispatch_key": dispatch_key,
            "outcome": outcome,
            "cache_decision": cache_decision,
            "tier": tier,
            "error": _text(error),
            "timings_ms": {k: round(v, 3) for k, v in timings_ms.items()},
        },
    )


def _refusal_reason(decision: Any) -> str:
    tag = getattr(decision, "tag", None)
    if tag == "StaleReadSet":
        changed = getattr(decision, "changed", ())
        return "the read set changed: " + ", ".join(str(c[0]) for c in changed)
    if tag == "ReplayFailed":
        return f"{decision.code}: {decision.reason}"
    return str(getattr(decision, "reason", tag))


def cache_refused(
    *,
    run_id: str,
    subject: str,
    kind: str,
    dispatch_key: str,
    decision: Any,
    outcome: str,
    task_run_id: str | None,
    flow_run_id: str | None,
    subject_resource: str,
) -> SmthrsEvent | None:
    """``smthrs.cache.refused`` when ``decision`` (a cache decision object) refused an existing entry (one of
    :data:`REFUSED_DECISIONS`), else None. ``kind`` is ``step`` or ``node``; ``subject`` the step identity or
    ``<plan id>/<node id>``; ``outcome`` what the dispatch did instead (``built`` or ``failed``)."""
    tag = getattr(decision, "tag", None)
    if tag not in REFUSED_DECISIONS:
        return None
    return SmthrsEvent(
        event=CACHE_REFUSED,
        resource={
            "prefect.resource.id": cache_resource_id(dispatch_key),
            "prefect.resource.name": subject,
            **_labels(run_id=run_id, subject=subject, decision=str(tag)),
        },
        related=_related(
            run_id=run_id,
            task_run_id=task_run_id,
            flow_run_id=flow_run_id,
            extra=((subject_resource, f"smthrs-{kind}"),),
        ),
        payload={
            "version": VERSION,
            "run_id": run_id,
            "subject": subject,
            "kind": kind,
            "dispatch_key": dispatch_key,
            "decision": tag,
            "reason": _text(_refusal_reason(decision)),
            "outcome": outcome,
        },
    )


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")


def run_parked(
    *,
    run_id: str,
    flow: str | None,
    kind: str,
    wait: str,
    deadline_ms: int | None,
    flow_run_id: str | None,
    token_id: str | None = None,
) -> SmthrsEvent:
    """``smthrs.run.parked``: the run is parked durably on a ``timer`` (with its stored deadline), an ``event`` (a
    deferred ``sp.complete``/``smthrs signal`` completes) or an ``approval`` (reason ``waiting-approval``)."""
    reason = _REASONS.get(kind, kind)
    request = wait if kind == "approval" else None
    return SmthrsEvent(
        event=RUN_PARKED,
        resource={
            "prefect.resource.id": run_resource_id(run_id),
            "prefect.resource.name": run_id,
            **_labels(run_id=run_id, reason=reason, wait=wait),
        },
        related=_related(flow_run_id=flow_run_id, token_id=token_id if kind == "approval" else None),
        payload={
            "version": VERSION,
            "run_id": run_id,
            "flow": flow,
            "reason": reason,
            "kind": kind,
            "wait": wait,
            "deadline": None if deadline_ms is None else _iso(deadline_ms),
            "deadline_ms": deadline_ms,
            "commands": commands(run_id, request=request, event=wait if kind == "event" else None),
            "review_url": review_url(),
        },
    )


def _approval_target(run_id: str | None, plan_id: str | None) -> tuple[str, str]:
    if run_id is not None:
        return run_resource_id(run_id), run_id
    if plan_id is None:
        raise ValueError("an approval event names a run (node request) or a plan (plan card)")
    return f"smthrs.plan.{plan_id}", plan_id


def approval_requested(
    *,
    run_id: str | None,
    plan_id: str | None,
    flow: str | None,
    request: str | None,
    token_id: str,
    digest: str,
    envelope: Mapping[str, Any],
    flow_run_id: str | None,
) -> SmthrsEvent:
    """``smthrs.approval.requested``: a node request of run ``run_id`` (or the plan card ``plan_id``, ``run_id``
    None) waits for a decision. ``digest`` is what an approval pins (``smthrs approve ... --digest``)."""
    rid, name = _approval_target(run_id, plan_id)
    ident = run_id if run_id is not None else plan_id
    assert ident is not None
    return SmthrsEvent(
        event=APPROVAL_REQUESTED,
        resource={
            "prefect.resource.id": rid,
            "prefect.resource.name": name,
            **_labels(run_id=run_id, plan_id=plan_id, request=request),
        },
        related=_related(flow_run_id=flow_run_id, token_id=token_id),
        payload={
            "version": VERSION,
            "run_id": run_id,
            "plan_id": plan_id,
            "flow": flow,
            "request": request,
            "token_id": token_id,
            "digest": digest,
            "envelope": dict(envelope),
            "commands": (
                commands(run_id, request=request)
                if run_id is not None
                else _approval_commands(ident, None, run=False)
            ),
            "review_url": review_url(),
        },
    )


def approval_decided(
    *,
    run_id: str | None,
    plan_id: str | None,
    flow: str | None,
    request: str | None,
    token_id: str,
    digest: str,
    envelope: Mapping[str, Any],
    decision: str,
    principal: str,
    scope: str | None,
    flow_run_id: str | None,
) -> SmthrsEvent:
    """``smthrs.approval.approved`` / ``smthrs.approval.denied``: the request (or plan card) was decided by
    ``principal`` (``ID/KIND``) with grant ``scope`` (approvals only)."""
    if decision not in ("approved", "denied"):
        raise ValueError(f"an approval decision is 'approved' or 'denied', not {decision!r}")
    asked = approval_requested(
        run_id=run_id, plan_id=plan_id, flow=flow, request=request, token_id=token_id, digest=digest,
        envelope=envelope, flow_run_id=flow_run_id,
    )  # fmt: skip
    return SmthrsEvent(
        event=APPROVAL_PREFIX + decision,
        resource={**asked.resource, **_labels(decision=decision)},
        related=asked.related,
        payload={**asked.payload, "decision": decision, "principal": principal, "scope": scope},
    )


# -- commands and links -------------------------------------------------------------------------------------------


def review_url() -> str | None:
    """The review page: ``SMTHRS_REVIEW_URL`` as given, else that of the ``smthrs serve`` named by
    ``SMTHRS_SERVE_URL`` (``<url>/``), else None. ``SettingsError(invalid_setting)`` for a value that is not an
    ``http(s)://`` URL."""
    page = os.environ.get(REVIEW_URL_ENV, "").strip()
    if page:
        return _http(REVIEW_URL_ENV, page, "the address of the review page")
    raw = os.environ.get(SERVE_URL_ENV, "").strip()
    if not raw:
        return None
    serve = _http(SERVE_URL_ENV, raw, "the address `smthrs serve` prints (e.g. http://127.0.0.1:8765)")
    return serve.rstrip("/") + "/"


def _http(name: str, raw: str, what: str) -> str:
    if not raw.startswith(("http://", "https://")) or any(c.isspace() for c in raw):
        raise SettingsError(
            "invalid_setting", f"{name}={raw!r} is not an http(s) URL; set it to {what} or unset it"
        )
    return raw


def commands(run_id: str, *, request: str | None = None, event: str | None = None) -> dict[str, str]:
    """The command lines that inspect, follow, cancel and (for a pending ``request``) decide run ``run_id``, or
    (for an event wait named ``event``) deliver its value. Shell-quoted where needed."""
    q = shlex.quote
    out = {
        "show": f"smthrs show {q(run_id)}",
        "watch": f"smthrs watch {q(run_id)}",
        "cancel": f"smthrs cancel {q(run_id)}",
    }
    if request is not None:
        out.update(_approval_commands(run_id, request, run=True))
    if event is not None:
        out["signal"] = f"smthrs signal {q(run_id)} {q(event)} --value JSON"
    return out


def _approval_commands(ident: str, request: str | None, *, run: bool) -> dict[str, str]:
    q = shlex.quote
    tail = f" --request {q(request)}" if run and request is not None else ""
    return {"approve": f"smthrs approve {q(ident)}{tail}", "deny": f"smthrs deny {q(ident)}{tail}"}


def parked_hint(run_id: str) -> str:
    """The part of a parked flow run's state message that says how to look at it and stop it."""
    c = commands(run_id)
    url = review_url()
    out = f"inspect: {c['show']} · {c['watch']}; cancel: {c['cancel']}"
    return out + (f"; review: {url}" if url else "")


def artifact_key(run_id: str) -> str:
    """A Prefect artifact key for ``run_id``: lowercase letters, digits and dashes only, unique per run id."""
    slug = "".join(c if c.isalnum() and c.isascii() else "-" for c in run_id.lower()).strip("-")
    slug = "-".join(p for p in slug.split("-") if p)[:48] or "run"
    return f"smthrs-{slug}-{sha256_hex(run_id.encode('utf-8'))[:8]}"


def links_markdown(run_id: str, *, settled: bool) -> str:
    """The "inspect it" block of a run's artifact: the run id and its commands (``cancel`` only while it is not
    settled), and the review page when ``SMTHRS_SERVE_URL`` is set."""
    c = commands(run_id)
    rows = [("inspect", c["show"]), ("follow its journal", c["watch"])]
    if not settled:
        rows.append(("cancel", c["cancel"]))
    lines = [f"smthrs run id: `{run_id}`", "", "| to | run |", "|---|---|"]
    lines += [f"| {what} | `{_cell(cmd)}` |" for what, cmd in rows]
    url = review_url()
    if url:
        lines += ["", f"Review page: [{url}]({url})"]
    return "\n".join(lines) + "\n"


def parked_markdown(signal: RunParked, view: RunView | None, resume: str | None) -> str:
    """The artifact of a parked run: what it waits for and the exact commands that decide, inspect or cancel it."""
    run_id = signal.run_id
    c = commands(
        run_id,
        request=signal.name if signal.kind == "approval" else None,
        event=signal.name if signal.kind == "event" else None,
    )
    if signal.kind == "timer" and signal.due_at_ms is not None:
        what = f"parked until {_iso(signal.due_at_ms)} (timer `{signal.name}`)"
    elif signal.kind == "approval":
        req = _request(view, signal.name)
        digest = f" (digest `{req.digest}`)" if req is not None else ""
        what = f"waits for approval `{signal.name}`{digest}"
    else:
        what = f"waits for `{signal.name}` (sp.complete / smthrs signal)"
    rows = []
    if signal.kind == "approval":
        rows += [("approve", c["approve"]), ("deny", c["deny"])]
    if signal.kind == "event":
        rows.append(("deliver its value", c["signal"]))
    rows += [("inspect", c["show"]), ("follow its journal", c["watch"]), ("cancel", c["cancel"])]
    lines = [f"## smthrs run `{run_id}` is parked", "", what, "", "| to | run |", "|---|---|"]
    lines += [f"| {w} | `{_cell(cmd)}` |" for w, cmd in rows]
    if resume:
        lines += ["", f"Then: {resume}"]
    url = review_url()
    if url:
        lines += ["", f"Review page: [{url}]({url})"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text inside a markdown table cell: a ``|`` in an id must not end the cell."""
    return text.replace("|", "\\|")


def _request(view: RunView | None, request: str) -> RequestView | None:
    if view is None:
        return None
    return next((r for r in view.requests if r.request_id == request), None)


# -- sending ------------------------------------------------------------------------------------------------------


def _run_contexts() -> tuple[Any, Any]:
    ctx = sys.modules.get("prefect.context")
    if ctx is None:
        return None, None
    return ctx.FlowRunContext.get(), ctx.TaskRunContext.get()


def current_flow_run_id() -> str | None:
    """The id of the Prefect flow run active on this thread (None outside one, or when Prefect is not loaded)."""
    frc, trc = _run_contexts()
    if frc is not None and frc.flow_run is not None:
        return str(frc.flow_run.id)
    if trc is not None and trc.task_run is not None and trc.task_run.flow_run_id is not None:
        return str(trc.task_run.flow_run_id)
    return None


def prefect_in_use() -> bool:
    """Are events sent from here (see the module invariants)? Inside a flow or task run: yes. Outside: only with a
    configured API, read without importing Prefect when it was not imported and ``PREFECT_API_URL`` is unset."""
    frc, trc = _run_contexts()
    if frc is not None or trc is not None:
        return True
    if "prefect" not in sys.modules and not os.environ.get("PREFECT_API_URL"):
        return False
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def emit(event: SmthrsEvent | None) -> bool:
    """Send ``event`` when Prefect is in use; True when it was handed to Prefect's events worker. A failure is
    logged with its traceback, never raised: an event reports a fact that is already durable."""
    if event is None or not prefect_in_use():
        return False
    try:
        from prefect.events import emit_event

        sent = emit_event(
            event=event.event, resource=event.resource, related=event.related, payload=event.payload
        )
    except Exception:  # noqa: BLE001 - the fact is durable; its mirror in Prefect is best effort, and loud
        log.warning("could not send the Prefect event %s", event.event, exc_info=True)
        return False
    return sent is not None


_ANNOUNCED = "_smthrs_announced"


def announce_parked(
    signal: RunParked, db: Database, *, flow_run_id: str | None = None, resume: str | None = None
) -> list[SmthrsEvent]:
    """Tell Prefect that run ``signal.run_id`` parked: ``smthrs.run.parked`` and, for a pending node approval,
    ``smthrs.approval.requested`` (its digest and envelope read from ``db``); inside a flow run, also the flow
    run's artifact (key :func:`artifact_key`) naming the commands that decide, inspect or cancel it. Call it once
    the park is durable (or about to be written by the driver that raised ``signal``); once per signal object —
    a second call for the same signal does nothing. Returns the events sent. Never raises (logged)."""
    if getattr(signal, _ANNOUNCED, False):
        return []
    try:
        setattr(signal, _ANNOUNCED, True)
    except AttributeError:  # pragma: no cover - RunParked instances take attributes
        pass
    if not prefect_in_use():
        return []
    try:
        return _announce(signal, db, flow_run_id or current_flow_run_id(), resume)
    except Exception:  # noqa: BLE001 - the park is durable; telling Prefect is best effort, and loud
        log.warning("could not tell Prefect that smthrs run %s parked", signal.run_id, exc_info=True)
        return []


def _announce(
    signal: RunParked, db: Database, flow_run_id: str | None, resume: str | None
) -> list[SmthrsEvent]:
    view = db.read(lambda conn: view_in(conn, signal.run_id))
    flow = None if view is None else view.flow
    request = _request(view, signal.name) if signal.kind == "approval" else None
    token_id = (
        request.token_id if request is not None else signal.token if signal.kind == "approval" else None
    )
    events: list[SmthrsEvent] = []
    if request is not None and request.state == "pending":
        admission = None if view is None else view.admission
        events.append(
            approval_requested(
                run_id=signal.run_id,
                plan_id=None if admission is None else admission.plan_id,
                flow=flow,
                request=request.request_id,
                token_id=request.token_id,
                digest=request.digest,
                envelope=request.envelope,
                flow_run_id=flow_run_id,
            )
        )
    events.append(
        run_parked(
            run_id=signal.run_id,
            flow=flow,
            kind=signal.kind,
            wait=signal.name,
            deadline_ms=signal.due_at_ms,
            flow_run_id=flow_run_id,
            token_id=token_id,
        )
    )
    sent = [e for e in events if emit(e)]
    if flow_run_id is not None:
        _artifact(
            flow_run_id,
            signal.run_id,
            parked_markdown(signal, view, resume),
            f"smthrs run {signal.run_id} is parked ({signal.kind} {signal.name!r})",
        )
    return sent


def _artifact(flow_run_id: str, run_id: str, markdown: str, description: str) -> None:
    """Attach ``markdown`` to the flow run as the run's artifact (a new version of :func:`artifact_key`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    with get_client(sync_client=True) as client:
        client.create_artifact(
            artifact=ArtifactCreate(
                type="markdown",
                key=artifact_key(run_id),
                description=description,
                flow_run_id=uuid.UUID(flow_run_id),
                data=markdown,
            )
        )


_DESCRIBED: set[str] = set()
_DESCRIBED_LOCK = threading.Lock()
#: A long-lived process forgets older flow runs past this many (at worst one more artifact version, never less).
_DESCRIBED_MAX = 4096


def describe_flow_run(run_id: str, flow_run_id: str) -> bool:
    """Once per flow run and process: attach to the flow run the artifact naming its smthrs run and the commands
    that inspect it (a ``@step`` flow has no Report). True when this call attached it. Never raises (logged)."""
    with _DESCRIBED_LOCK:
        if flow_run_id in _DESCRIBED:
            return False
        if len(_DESCRIBED) >= _DESCRIBED_MAX:
            _DESCRIBED.clear()
        _DESCRIBED.add(flow_run_id)
    try:
        _artifact(
            flow_run_id,
            run_id,
            f"## smthrs run `{run_id}`\n\n{links_markdown(run_id, settled=False)}",
            f"smthrs run {run_id} of this flow run",
        )
    except Exception:  # noqa: BLE001 - a display link; the run does not depend on it
        log.warning("could not attach the smthrs run %s to flow run %s", run_id, flow_run_id, exc_info=True)
        return False
    return True
