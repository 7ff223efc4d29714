"""Read views of the control plane: one run with its approval facts and node requests (``Control.show``).

Invariant: a view is read in ONE read transaction (the caller's ``Database.read``), so the run row, its admission
and its requests describe the same database state. The waiting reason ``waiting-approval`` is reported with the
pending requests a decision would resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ..records import control as rc
from ..records.runs import record_in
from .identity import JSON

__all__ = ["RunView", "RequestView", "view_in"]


@dataclass(frozen=True)
class RequestView:
    """One node approval request of a run and its decision (``pending`` | ``approved`` | ``denied``)."""

    request_id: str
    token_id: str
    digest: str
    envelope: dict[str, JSON]
    state: str
    principal: str | None = None
    scope: str | None = None
    via_grant: str | None = None

    def to_json(self) -> dict[str, JSON]:
        # Our own view, so our own JSON vocabulary: snake_case (the CLI's --json prints it as is).
        out: dict[str, JSON] = {
            "request_id": self.request_id,
            "token_id": self.token_id,
            "digest": self.digest,
            "envelope": self.envelope,
            "state": self.state,
        }
        for k, v in (("principal", self.principal), ("scope", self.scope), ("via_grant", self.via_grant)):
            if v is not None:
                out[k] = v
        return out


@dataclass(frozen=True)
class RunView:
    """A run as the control plane shows it."""

    run_id: str
    flow: str
    status: str
    waiting_reason: str | None
    admission: rc.AdmissionRow | None
    requests: tuple[RequestView, ...]
    error: Any = None

    @property
    def waiting_approval(self) -> bool:
        return self.status == "suspended" and self.waiting_reason == "waiting-approval"

    @property
    def pending(self) -> tuple[RequestView, ...]:
        return tuple(r for r in self.requests if r.state == "pending")

    def to_json(self) -> dict[str, JSON]:
        out: dict[str, JSON] = {
            "run_id": self.run_id,
            "flow": self.flow,
            "status": self.status,
            "waiting_reason": self.waiting_reason,
            "requests": [r.to_json() for r in self.requests],
        }
        if self.admission is not None:
            out["admission"] = self.admission.to_json()
        if self.error is not None:
            out["error"] = self.error
        return out


def view_in(conn: Connection, run_id: str) -> RunView | None:
    rec = record_in(conn, run_id)
    if rec is None:
        return None
    requests = []
    for token, decision in rc.run_tokens_in(conn, run_id):
        requests.append(
            RequestView(
                request_id=str(token.request_id),
                token_id=token.token_id,
                digest=token.digest,
                envelope=token.envelope.to_json(),
                state="pending" if decision is None else decision.decision,
                principal=None if decision is None else str(decision.principal),
                scope=None if decision is None else decision.scope,
                via_grant=None if decision is None else decision.via_grant_id,
            )
        )
    return RunView(
        run_id=rec.run_id,
        flow=rec.flow,
        status=rec.status,
        waiting_reason=None if rec.waiting is None else rec.waiting.reason,
        admission=rc.admission_in(conn, run_id),
        requests=tuple(requests),
        error=rec.error,
    )
