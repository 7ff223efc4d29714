"""The run row's shape, as the runs owner (:mod:`smthrs_plugin.records.runs`) reads and writes it.

Invariants:

- An :class:`OwnerId` is one process *incarnation*: ``(host_id, pid, nonce)`` with a fresh uuid4 nonce minted
  once per process (:func:`current_owner`; a forked child mints its own). A restarted process that reuses a pid
  still has a different nonce, so it never inherits the runs of its predecessor.
- A row decodes (:func:`decode_run`) only when it is self-consistent (known status, owner columns all set exactly
  when ``running``, JSON columns parse, waiting details only with a reason); anything else is
  :class:`Undecodable`, which list reads turn into one warning naming the key and point reads into
  ``StoreError(decode_failed)``. This is the only decoder of a run row.
- The execution fact of a lifecycle transition (``{version: 1, baseline: "created", observation}``) observes
  exactly :data:`OBSERVED_COLUMNS` (the semantic fields: never ownership, claims or heartbeats); a row that
  cannot encode one records ``{version: 1, unavailable: "invalid-observation"}`` and never invents the missing
  facts. The baseline is always ``created``: the run's creation fact is journaled in the row's own transaction
  and journal records are never deleted.

Prior art: the reference's native lifecycle observations and its ownership and fencing rules.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from ..canonical import canonical_bytes, sha256_hex
from ..errors import CanonicalError, StoreError
from ..settings import Settings, load_settings
from ..stores.schema import RUN_STATUSES, TERMINAL_STATUSES, runs

__all__ = [
    "OwnerId",
    "current_owner",
    "CLEAR_OWNER",
    "CLEAR_CLAIM",
    "CLEAR_WAIT",
    "FACT_VERSION",
    "BASELINE_CREATED",
    "BASELINE_LEGACY",
    "observed_row_in",
    "OBSERVED_COLUMNS",
    "observation_of",
    "execution_fact",
    "fact_of",
    "RunRecord",
    "Waiting",
    "CancelAck",
    "Undecodable",
    "decode_run",
    "decode_run_or_raise",
    "json_column",
    "json_text",
    "MAX_ID",
    "check_id",
    "waiting_for",
    "suspend_values",
    "suspend_payload",
]

#: Column values that clear a run row's owner, pending claim and waiting payload.
CLEAR_OWNER: dict[str, Any] = {
    "owner_host": None,
    "owner_pid": None,
    "owner_nonce": None,
    "owner_proc_start": None,
}
CLEAR_CLAIM: dict[str, Any] = {
    "claim_host": None,
    "claim_pid": None,
    "claim_nonce": None,
    "claim_token": None,
    "claimed_at_ms": None,
}
CLEAR_WAIT: dict[str, Any] = {"waiting_reason": None, "wake_at_ms": None, "wait_token_digest": None}


@dataclass(frozen=True)
class OwnerId:
    """One process incarnation that may own runs."""

    host_id: str
    pid: int
    nonce: str

    def to_json(self) -> dict[str, Any]:
        return {"host_id": self.host_id, "pid": self.pid, "nonce": self.nonce}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OwnerId:
        return cls(str(data["host_id"]), int(data["pid"]), str(data["nonce"]))

    def __str__(self) -> str:
        return f"{self.host_id}/{self.pid}/{self.nonce}"


_lock = threading.Lock()
_current: dict[tuple[int, str], OwnerId] = {}


def current_owner(settings: Settings | None = None) -> OwnerId:
    """This process incarnation's owner id (host id from settings: ``SMTHRS_HOST_ID``, default the hostname).

    Minted once per (process, host id); a forked child gets a new one because its pid differs."""
    host_id = (settings or load_settings()).host_id
    k = (os.getpid(), host_id)
    with _lock:
        owner = _current.get(k)
        if owner is None:
            owner = _current[k] = OwnerId(host_id, os.getpid(), str(uuid.uuid4()))
        return owner


FACT_VERSION = 1
#: The run's fact stream starts at its creation fact (execution facts) / its ``control.run.accepted`` (control).
BASELINE_CREATED = "created"
#: The run's fact stream starts at this fact: earlier history exists without facts, and is not reconstructed.
BASELINE_LEGACY = "legacy"

_r = runs.c
#: The columns an execution fact observes (also what a transition RETURNs instead of reading back: fence.py).
OBSERVED_COLUMNS = (
    _r.run_id,
    _r.flow,
    _r.status,
    _r.created_at_ms,
    _r.started_at_ms,
    _r.finished_at_ms,
    _r.parent_run_id,
    _r.lineage_id,
    _r.round_ordinal,
    _r.cancel_requested_at_ms,
    _r.waiting_reason,
    _r.wake_at_ms,
    _r.wait_token_digest,
)
_OBSERVE = sa.select(*OBSERVED_COLUMNS).where(_r.run_id == sa.bindparam("b_run_id"))


class _Invalid(Exception):
    pass


def _int_or_none(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Invalid
    return v


def _str_or_none(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise _Invalid
    return v


def observation_of(row: Any) -> dict[str, Any]:
    """The observation of a run row (raises ``ValueError`` when the row cannot encode one)."""
    try:
        if row.status not in RUN_STATUSES or not isinstance(row.run_id, str) or not isinstance(row.flow, str):
            raise _Invalid
        waiting: dict[str, Any] | None = None
        if row.waiting_reason is not None:
            waiting = {
                "reason": _str_or_none(row.waiting_reason),
                "wake_at_ms": _int_or_none(row.wake_at_ms),
                "token_digest": _str_or_none(row.wait_token_digest),
            }
        return {
            "run_id": row.run_id,
            "flow": row.flow,
            "status": row.status,
            "created_at_ms": _int_or_none(row.created_at_ms),
            "started_at_ms": _int_or_none(row.started_at_ms),
            "finished_at_ms": _int_or_none(row.finished_at_ms),
            "parent_run_id": _str_or_none(row.parent_run_id),
            "lineage_id": _str_or_none(row.lineage_id),
            "round_ordinal": _int_or_none(row.round_ordinal),
            "cancel_requested_at_ms": _int_or_none(row.cancel_requested_at_ms),
            "waiting": waiting,
        }
    except _Invalid as exc:
        raise ValueError(f"run row {getattr(row, 'run_id', '?')!r} cannot encode an observation") from exc


def fact_of(row: Any) -> dict[str, Any]:
    """The execution fact of a row holding :data:`OBSERVED_COLUMNS` as the transition left it (e.g. the row a
    transition's RETURNING gave): ``{version: 1, baseline, observation}``, or ``{version: 1, unavailable:
    "invalid-observation"}`` when the row does not encode one."""
    try:
        observation = observation_of(row)
    except ValueError:
        return {"version": FACT_VERSION, "unavailable": "invalid-observation"}
    return {"version": FACT_VERSION, "baseline": BASELINE_CREATED, "observation": observation}


def observed_row_in(conn: Connection, run_id: str) -> Any:
    """The :data:`OBSERVED_COLUMNS` of ``run_id`` as ``conn`` sees them now (None when the row is gone)."""
    return conn.execute(_OBSERVE, {"b_run_id": run_id}).first()


def execution_fact(conn: Connection, run_id: str) -> dict[str, Any]:
    """``{version: 1, baseline, observation}`` of ``run_id`` as ``conn`` sees it now (call after the row change,
    inside the transition's transaction); ``{version: 1, unavailable: ...}`` when the row is gone or does not
    encode."""
    row = observed_row_in(conn, run_id)
    if row is None:
        return {"version": FACT_VERSION, "unavailable": "missing-row"}
    return fact_of(row)


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


#: The longest id (run, flow, reason, ...) a run row takes.
MAX_ID = 1024


def check_id(name: str, value: Any) -> None:
    """Refuse (``StoreError(invalid_argument)``) an id that is not a non-empty string of at most :data:`MAX_ID`
    characters without NUL."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID or "\x00" in value:
        raise StoreError(
            "invalid_argument",
            f"{name} must be a non-empty string of at most {MAX_ID} characters without NUL",
        )


def waiting_for(reason: str, *, wake_at_ms: int | None = None, token: str | None = None) -> Waiting:
    """The :class:`Waiting` a park records (``token`` stored only as its SHA-256); ``StoreError(invalid_argument)``
    for a bad reason, deadline or token, before anything is written."""
    check_id("reason", reason)
    if wake_at_ms is not None and (not isinstance(wake_at_ms, int) or isinstance(wake_at_ms, bool)):
        raise StoreError("invalid_argument", f"wake_at_ms must be an int (epoch ms), got {wake_at_ms!r}")
    if token is not None and (not isinstance(token, str) or not token):
        raise StoreError("invalid_argument", "token must be a non-empty string")
    return Waiting(reason, wake_at_ms, None if token is None else sha256_hex(token.encode("utf-8")))


def suspend_values(waiting: Waiting, now: int) -> dict[str, Any]:
    """The run-row values of a park on ``waiting`` at ``now``."""
    return {
        **CLEAR_OWNER,
        **CLEAR_CLAIM,
        "status": "suspended",
        "waiting_reason": waiting.reason,
        "wake_at_ms": waiting.wake_at_ms,
        "wait_token_digest": waiting.token_digest,
        "updated_at_ms": now,
    }


def suspend_payload(waiting: Waiting, observed: dict[str, Any]) -> dict[str, Any]:
    """The ``run-suspended`` record of a park on ``waiting`` whose row observation is ``observed``."""
    fact: dict[str, Any] = {"reason": waiting.reason}
    if waiting.wake_at_ms is not None:
        fact["wake_at_ms"] = waiting.wake_at_ms
    if waiting.token_digest is not None:
        fact["token_digest"] = waiting.token_digest
    fact["fact"] = observed
    return fact
