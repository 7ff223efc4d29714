"""Decoded rows and outcome unions of durable waits (``records/waits.py``): deferreds, clocks and the waiting taxonomy.

Invariants:

- Outcomes are small frozen tagged unions, never booleans (the reference's table): ``complete_deferred`` → ``Completed |
  Existing``; ``schedule_clock`` → ``Scheduled | Existing``; ``complete_clock`` → ``Completed | AlreadyCompleted |
  NotFound``; ``park`` → ``Parked | NotFound``; ``wake`` → ``Woken | NotWaiting | NotFound``. ``Completed`` and
  ``Existing`` are generic over the record they carry. (``wakebus.Woken`` is the in-process bus's signal, a
  different thing: import them from their modules.)
- The waiting taxonomy is closed: ``timer`` (``wake_at_ms`` = the earliest pending clock deadline), ``event``,
  ``released`` (with its ``cause`` from the ``interrupt-released`` decision), ``quarantine``, and
  ``waiting-approval`` (a pending node approval gate: only the control plane's decision wakes it).
  A row outside it (unknown reason, a timer without a deadline, values of the wrong type) is
  :class:`Undecodable`: list reads skip it with one warning naming its key, point reads raise
  ``StoreError(decode_failed)``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import StoreError
from ..stores.schema import runs
from .journal import latest_payload_json_in

__all__ = [
    "WAITING_REASONS",
    "DeferredRecord",
    "ClockRecord",
    "TimerWait",
    "EventWait",
    "ReleasedWait",
    "QuarantineWait",
    "ApprovalWait",
    "Wait",
    "WaitingRun",
    "WaitingFilter",
    "Completed",
    "Existing",
    "Scheduled",
    "AlreadyCompleted",
    "NotFound",
    "Parked",
    "Woken",
    "NotWaiting",
    "Undecodable",
    "decode_deferred",
    "decode_clock",
    "decode_wait",
    "point_read_failed",
    "deferred_token",
    "WAITING_COLUMNS",
    "waiting_run",
]

WAITING_REASONS = ("timer", "event", "released", "quarantine", "waiting-approval")
WaitingReason = Literal["timer", "event", "released", "quarantine", "waiting-approval"]

R = TypeVar("R")


def deferred_token(name: str) -> str:
    """The opaque wait token of a run parked on the deferred ``name`` (only its SHA-256 is stored)."""
    return f"deferred/{name}"


@dataclass(frozen=True)
class DeferredRecord:
    """A completed deferred: the value the resumed run receives, and whether a run already consumed it."""

    flow: str
    execution_id: str
    name: str
    value: Any
    completed_at_ms: int
    consumed_at_ms: int | None = None


@dataclass(frozen=True)
class ClockRecord:
    """A durable clock with its absolute deadline; ``completed_at_ms`` is None while it is pending."""

    flow: str
    execution_id: str
    name: str
    due_at_ms: int
    scheduled_at_ms: int
    completed_at_ms: int | None = None

    @property
    def pending(self) -> bool:
        return self.completed_at_ms is None


@dataclass(frozen=True)
class TimerWait:
    """Parked until ``wake_at_ms``, the earliest pending clock deadline of the run."""

    reason: ClassVar[str] = "timer"
    wake_at_ms: int
    token_digest: str | None = None


@dataclass(frozen=True)
class EventWait:
    """Parked until something completes (a deferred: ``token_digest`` names which)."""

    reason: ClassVar[str] = "event"
    token_digest: str | None = None


@dataclass(frozen=True)
class ReleasedWait:
    """Given up by its owner (shutdown, a lapsing lease, recovery fencing); claimable at once. ``cause`` comes from
    the run's latest ``interrupt-released`` decision (None when the journal has none)."""

    reason: ClassVar[str] = "released"
    cause: str | None = None


@dataclass(frozen=True)
class QuarantineWait:
    """Parked on corrupt attempt evidence: an operator must look before it runs again."""

    reason: ClassVar[str] = "quarantine"
    token_digest: str | None = None


@dataclass(frozen=True)
class ApprovalWait:
    """Parked on a node approval (control plane): a decision on that request wakes it. ``token_digest`` names the
    approval token the run waits for."""

    reason: ClassVar[str] = "waiting-approval"
    token_digest: str | None = None


Wait = TimerWait | EventWait | ReleasedWait | QuarantineWait | ApprovalWait


@dataclass(frozen=True)
class WaitingRun:
    """A parked (``suspended``) run with its decoded wait."""

    run_id: str
    flow: str
    wait: Wait
    cancel_requested_at_ms: int | None
    updated_at_ms: int
    revision: int


@dataclass(frozen=True)
class WaitingFilter:
    """Narrows :meth:`WaitStore.waiting_runs` to actionable rows (the reference's ``WaitingRunsFilter``).

    ``reason``: one of the taxonomy; ``due_before_ms``: only waits whose deadline is at or before it (rows without
    a deadline never match); ``cancel_requested``: True → only runs with a cancellation request, False → only runs
    without; ``flows``: only these flow names."""

    reason: WaitingReason | None = None
    due_before_ms: int | None = None
    cancel_requested: bool | None = None
    flows: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Completed(Generic[R]):
    """This call wrote the completion (a deferred's value, or a clock's firing). ``wake`` is the outcome of the
    wake attempted in the same transaction, when one was asked for."""

    record: R
    wake: Woken | NotWaiting | NotFound | None = None


@dataclass(frozen=True)
class Existing(Generic[R]):
    """The row already existed (first writer wins): ``record`` is the stored one (a clock keeps its ORIGINAL
    deadline, a deferred its first value)."""

    record: R


@dataclass(frozen=True)
class Scheduled:
    """This call armed the clock."""

    record: ClockRecord


@dataclass(frozen=True)
class AlreadyCompleted:
    record: ClockRecord


@dataclass(frozen=True)
class NotFound:
    """No such run (or, for a clock, no such clock of that run)."""

    run_id: str
    name: str | None = None


@dataclass(frozen=True)
class Parked:
    """The owned run is now ``suspended`` with ``wait``; its owner is cleared."""

    run_id: str
    wait: Wait
    revision: int


@dataclass(frozen=True)
class Woken:
    """The parked run is runnable again (``pending``, waiting cleared); ``was`` is the wait it left."""

    run_id: str
    was: Wait
    revision: int


@dataclass(frozen=True)
class NotWaiting:
    """The run exists but is not parked (``status`` says what it is)."""

    run_id: str
    status: str


class Undecodable(Exception):
    """A stored wait row is not self-consistent."""


def _int(v: Any, what: str, *, optional: bool = False) -> Any:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise Undecodable(f"{what} is {v!r}, not a non-negative integer")
    return v


def _text(v: Any, what: str, *, optional: bool = False) -> Any:
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v:
        raise Undecodable(f"{what} is {v!r}, not a non-empty string")
    return v


def decode_deferred(row: Any) -> DeferredRecord:
    try:
        value = json.loads(row.value_json)
    except (TypeError, ValueError) as exc:
        raise Undecodable("value_json is not valid JSON") from exc
    return DeferredRecord(
        flow=_text(row.flow, "flow"),
        execution_id=_text(row.execution_id, "execution_id"),
        name=_text(row.name, "name"),
        value=value,
        completed_at_ms=_int(row.completed_at_ms, "completed_at_ms"),
        consumed_at_ms=_int(row.consumed_at_ms, "consumed_at_ms", optional=True),
    )


def decode_clock(row: Any) -> ClockRecord:
    return ClockRecord(
        flow=_text(row.flow, "flow"),
        execution_id=_text(row.execution_id, "execution_id"),
        name=_text(row.name, "name"),
        due_at_ms=_int(row.due_at_ms, "due_at_ms"),
        scheduled_at_ms=_int(row.scheduled_at_ms, "scheduled_at_ms"),
        completed_at_ms=_int(row.completed_at_ms, "completed_at_ms", optional=True),
    )


def decode_wait(reason: Any, wake_at_ms: Any, token_digest: Any, cause: str | None = None) -> Wait:
    """The taxonomy member of a run row's waiting columns (see module invariants)."""
    token = _text(token_digest, "wait_token_digest", optional=True)
    if reason == "timer":
        return TimerWait(_int(wake_at_ms, "wake_at_ms of a timer wait"), token)
    if wake_at_ms is not None:
        raise Undecodable(f"a {reason!r} wait carries a deadline ({wake_at_ms!r})")
    if reason == "event":
        return EventWait(token)
    if reason == "released":
        return ReleasedWait(cause)
    if reason == "quarantine":
        return QuarantineWait(token)
    if reason == "waiting-approval":
        return ApprovalWait(token)
    raise Undecodable(f"unknown waiting reason {reason!r}; known: {', '.join(WAITING_REASONS)}")


def point_read_failed(what: str, key: Any, exc: Undecodable) -> StoreError:
    """The error of a point read on an undecodable row: reporting "no row" for a completion or deadline that is
    durably recorded but unreadable would re-run work whose side effects already ran."""
    return StoreError(
        "decode_failed",
        f"{what} {key!r} is stored but does not decode ({exc}); the row is corrupt: restore it from a backup or "
        "delete it explicitly",
        cause=exc,
        key=repr(key),
    )


_r = runs.c
#: The run columns a waiting row is decoded from.
WAITING_COLUMNS = sa.select(
    _r.run_id,
    _r.flow,
    _r.status,
    _r.waiting_reason,
    _r.wake_at_ms,
    _r.wait_token_digest,
    _r.cancel_requested_at_ms,
    _r.updated_at_ms,
    _r.revision,
)


def _release_cause(conn: Connection, run_id: str) -> str | None:
    # The row says "released"; WHY is recorded by the interrupt-released decision in the run's journal.
    text = latest_payload_json_in(conn, run_id, "interrupt-released")
    if text is None:
        return None
    try:
        cause = json.loads(text).get("cause")
    except (ValueError, AttributeError) as exc:
        raise Undecodable("its interrupt-released record does not decode") from exc
    return cause if isinstance(cause, str) else None


def waiting_run(conn: Connection, row: Any) -> WaitingRun:
    """Decode a :data:`WAITING_COLUMNS` row of a suspended run (``Undecodable`` outside the taxonomy)."""
    cause = _release_cause(conn, row.run_id) if row.waiting_reason == "released" else None
    wait = decode_wait(row.waiting_reason, row.wake_at_ms, row.wait_token_digest, cause)
    if not isinstance(row.flow, str) or not row.flow:
        raise Undecodable(f"flow is {row.flow!r}")
    return WaitingRun(
        run_id=row.run_id,
        flow=row.flow,
        wait=wait,
        cancel_requested_at_ms=row.cancel_requested_at_ms,
        updated_at_ms=int(row.updated_at_ms),
        revision=int(row.revision),
    )
