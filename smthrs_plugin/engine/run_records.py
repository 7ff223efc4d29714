"""Decoded run rows: :class:`RunRecord` and its parts, and the decoder that refuses corrupt rows.

Invariant: a row decodes only when it is self-consistent (known status, owner columns all set exactly when
``running``, JSON columns parse, waiting details only with a reason); anything else is :class:`Undecodable`, which
list reads turn into one warning naming the key and point reads into ``StoreError(decode_failed)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Row

from ..canonical import canonical_bytes
from ..errors import CanonicalError, StoreError
from ..stores.schema import RUN_STATUSES, TERMINAL_STATUSES
from .fence import OwnerId

__all__ = [
    "RunRecord",
    "Waiting",
    "CancelAck",
    "Undecodable",
    "decode_run",
    "decode_run_or_raise",
    "json_column",
    "json_text",
]


@dataclass(frozen=True)
class Waiting:
    """Why a suspended run waits: reason (timer|event|released|quarantine|...), deadline, token digest."""

    reason: str
    wake_at_ms: int | None = None
    token_digest: str | None = None


@dataclass(frozen=True)
class CancelAck:
    """The first owner that observed the cancellation request, and when."""

    owner: OwnerId
    at_ms: int


@dataclass(frozen=True)
class RunRecord:
    """A decoded run row."""

    run_id: str
    flow: str
    status: str
    revision: int
    created_at_ms: int
    updated_at_ms: int
    owner: OwnerId | None = None
    heartbeat_at_ms: int | None = None
    claimant: OwnerId | None = None
    parent_run_id: str | None = None
    lineage_id: str | None = None
    round_ordinal: int = 0
    cancel_requested_at_ms: int | None = None
    cancel_ack: CancelAck | None = None
    waiting: Waiting | None = None
    started_at_ms: int | None = None
    finished_at_ms: int | None = None
    result: Any = None
    error: Any = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class Undecodable(Exception):
    """A stored row (run, attempt) is not self-consistent."""


def decode_run_or_raise(row: Row[Any]) -> RunRecord:
    try:
        return decode_run(row)
    except Undecodable as exc:
        raise StoreError(
            "decode_failed",
            f"run {row.run_id!r} is stored but does not decode ({exc}); the row is corrupt: restore it from a "
            "backup or delete it explicitly",
            cause=exc,
            run_id=row.run_id,
        ) from exc


def _owner(host: Any, pid: Any, nonce: Any, what: str) -> OwnerId | None:
    parts = (host, pid, nonce)
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise Undecodable(f"{what} columns are partially set")
    return OwnerId(str(host), int(pid), str(nonce))


def json_text(name: str, value: Any) -> str | None:
    """Canonical JSON text of a nullable column value; ``StoreError(invalid_argument)`` before any write when
    ``value`` is not plain JSON data."""
    if value is None:
        return None
    try:
        return canonical_bytes(value).decode("utf-8")
    except CanonicalError as exc:
        raise StoreError(
            "invalid_argument", f"{name} is not plain JSON data: {exc.message}", cause=exc
        ) from exc


def json_column(text: Any, what: str) -> Any:
    """Decode a nullable JSON text column; ``Undecodable`` names the column when it is not JSON."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise Undecodable(f"{what} is not valid JSON") from exc


def decode_run(row: Row[Any]) -> RunRecord:
    if row.status not in RUN_STATUSES:
        raise Undecodable(f"unknown status {row.status!r}")
    owner = _owner(row.owner_host, row.owner_pid, row.owner_nonce, "owner")
    if (row.status == "running") != (owner is not None):
        raise Undecodable(f"status {row.status} with owner {owner}")
    ack_owner = _owner(
        row.cancel_ack_host, row.cancel_ack_pid, row.cancel_ack_nonce, "cancel acknowledgement"
    )
    ack = None
    if ack_owner is not None:
        if row.cancel_ack_at_ms is None:
            raise Undecodable("cancel acknowledgement without a time")
        ack = CancelAck(ack_owner, int(row.cancel_ack_at_ms))
    waiting = None
    if row.waiting_reason is not None:
        waiting = Waiting(row.waiting_reason, row.wake_at_ms, row.wait_token_digest)
    elif row.wake_at_ms is not None or row.wait_token_digest is not None:
        raise Undecodable("waiting deadline or token without a reason")
    return RunRecord(
        run_id=row.run_id,
        flow=row.flow,
        status=row.status,
        revision=int(row.revision),
        created_at_ms=int(row.created_at_ms),
        updated_at_ms=int(row.updated_at_ms),
        owner=owner,
        heartbeat_at_ms=row.heartbeat_at_ms,
        claimant=_owner(row.claim_host, row.claim_pid, row.claim_nonce, "claim"),
        parent_run_id=row.parent_run_id,
        lineage_id=row.lineage_id,
        round_ordinal=int(row.round_ordinal),
        cancel_requested_at_ms=row.cancel_requested_at_ms,
        cancel_ack=ack,
        waiting=waiting,
        started_at_ms=row.started_at_ms,
        finished_at_ms=row.finished_at_ms,
        result=json_column(row.result_json, "result"),
        error=json_column(row.error_json, "error"),
    )
