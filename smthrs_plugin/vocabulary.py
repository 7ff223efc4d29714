"""The one JSON vocabulary of the control plane's answers (docs/rules.md "JSON vocabulary"): what ``smthrs ... --json``
prints and what ``smthrs serve`` answers for the same verb.

Invariants
- **One word per state.** A run's ``status`` is one of :data:`CLI_STATUSES` and, only while it is ``parked``,
  ``waiting_reason`` one of :data:`CLI_WAITING_REASONS`; :func:`cli_state` is the one translation of the stored
  names (``suspended`` is ``parked``, ``waiting-approval`` is ``approval``, ``event`` is ``signal``). The stored
  taxonomy is closed (``records/wait_rows.py``), so every stored name has exactly one word here.
- **Only our own objects are translated.** The nested ``receipt`` and ``card`` keep the reference's wire names
  (``_tag``, ``receiptId``, ``planId`` ...) and a journal record's ``payload`` is relayed as written: they are what
  is recorded, signed or digested.
- Times are ``*_at_ms`` integers; a ``key1_`` value is called ``key``, a plain SHA-256 hex digest ``digest``.

PURE: plain dicts in, plain dicts out, on the bottom floor (it imports only ``errors``), so ``cli`` and ``serve``
use it without loading the control plane.
"""

from __future__ import annotations

from typing import Any

from .errors import ControlError

__all__ = [
    "CLI_STATUSES",
    "CLI_WAITING_REASONS",
    "cli_state",
    "cli_run",
    "cli_receipt",
    "cli_request",
    "cli_event",
    "status_filter",
    "waiting_filter",
]

#: A run's ``status`` as every answer spells it.
CLI_STATUSES = ("pending", "running", "parked", "completed", "failed", "cancelled")
#: Why a ``parked`` run waits (``waiting_reason``; null for every other status).
CLI_WAITING_REASONS = ("approval", "timer", "signal", "released", "quarantine")
_STATUS_OF = {"suspended": "parked"}
_REASON_OF = {"waiting-approval": "approval", "event": "signal"}
_STORED_STATUS = {v: k for k, v in _STATUS_OF.items()}
_STORED_REASON = {v: k for k, v in _REASON_OF.items()}


def cli_state(status: str | None, waiting_reason: str | None) -> tuple[str | None, str | None]:
    """The stored ``(status, waiting reason)`` of a run in the vocabulary; the reason is None unless ``parked``."""
    shown = _STATUS_OF.get(status, status) if status is not None else None
    if shown != "parked" or waiting_reason is None:
        return shown, None
    return shown, _REASON_OF.get(waiting_reason, waiting_reason)


def cli_run(run: dict[str, Any]) -> dict[str, Any]:
    """A run observation (``observe.snapshot`` ``to_json``) in the vocabulary: ``status`` translated,
    ``waiting_reason`` beside it, and ``wait`` as ``{reason, wake_at_ms, token_digest}`` with the same reason (the
    observation's ``kind`` is dropped: it was a second name for the reason). A ``missing`` observation is kept."""
    if run.get("tag") != "observed":
        return run
    status, reason = cli_state(run["status"], None if run["wait"] is None else run["wait"]["reason"])
    out = {**run, "status": status, "waiting_reason": reason}
    if run["wait"] is not None:
        w = run["wait"]
        wait_reason = cli_state("suspended", w["reason"])[1]
        out["wait"] = {
            "reason": wait_reason,
            "wake_at_ms": w["wake_at_ms"],
            "token_digest": w["token_digest"],
        }
    return out


def cli_receipt(receipt: dict[str, Any]) -> dict[str, Any]:
    """A receipt in its wire form only: ``_tag`` is the discriminator, a ``type`` copy is dropped. Its own
    ``status`` member (a ``Parked`` receipt's ``waiting-approval``, a ``Terminal`` receipt's settled status) is the
    reference's and is not renamed: the receipt is what the control plane records."""
    return {k: v for k, v in receipt.items() if k != "type"}


def cli_request(request: dict[str, Any]) -> dict[str, Any]:
    """A node approval request (``RequestView.to_json``) with its ``key1_`` node key named ``key`` instead of
    ``digest`` (a ``digest`` is always a plain SHA-256 hex digest)."""
    out = {k: v for k, v in request.items() if k != "digest"}
    out["key"] = request["digest"]
    return out


def cli_event(event: dict[str, Any]) -> dict[str, Any]:
    """A watch event (``ControlEvent.to_json``) with its time as ``occurred_at_ms`` (the library's ``occurred_at``,
    epoch ms); its ``payload`` is the journal record as written."""
    out = {k: v for k, v in event.items() if k != "occurred_at"}
    out["occurred_at_ms"] = event["occurred_at"]
    return out


def status_filter(status: str | None) -> str | None:
    """A ``status`` filter in the vocabulary → the stored status; anything else is refused
    (``ControlError(invalid_options)``) naming the vocabulary, so ``suspended`` cannot silently match nothing."""
    if status is None:
        return None
    if status not in CLI_STATUSES:
        raise ControlError(
            "invalid_options",
            f"--status {status!r}: give one of {', '.join(CLI_STATUSES)} (a run waiting for approval, a timer or a "
            "signal is `parked`)",
            option="status",
        )
    return _STORED_STATUS.get(status, status)


def waiting_filter(reason: str | None) -> str | None:
    """A ``waiting`` filter in the vocabulary → the stored waiting reason; anything else is refused (typed)."""
    if reason is None:
        return None
    if reason not in CLI_WAITING_REASONS:
        raise ControlError(
            "invalid_options",
            f"--waiting {reason!r}: give one of {', '.join(CLI_WAITING_REASONS)}",
            option="waiting",
        )
    return _STORED_REASON.get(reason, reason)
