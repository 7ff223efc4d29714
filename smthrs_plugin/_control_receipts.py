"""Receipts: the control plane's whole answer to "did my request take effect, and what happened to it?". PURE.

It sits at the root, below the stores, because the control records' owner (``records.control``) decodes stored
receipts into :class:`Accepted`; other packages import it through ``smthrs_plugin.control.receipts``.

Invariants
- A control mutation answers exactly one of five frozen receipts, never a bare boolean and never an exception on
  a second ask: ``Accepted`` (this call admitted it), ``AlreadyApplied`` (an earlier call under this key did;
  same ``run_id``), ``Parked`` (the plan waits for an approval), ``Conflict`` (the key already names another
  intent) and ``Terminal`` (the run had already settled). Wire form, e.g.
  ``{"_tag": "Parked", "planId": ..., "status": "waiting-approval"}``.
- Only ``Accepted`` is ever recorded under a durable key. ``Parked`` is never recorded, so the key is not spent
  on a refusal and the same key launches once the plan is approved. ``AlreadyApplied`` is the replayed view of a
  recorded ``Accepted``; ``Conflict`` and ``Terminal`` describe the present, not a stored fact.
- Replay rule (:func:`decide_replay`): equal fingerprints replay the recorded receipt as ``AlreadyApplied``;
  different ones answer ``Conflict`` -- the honest answer to "this key already means something else" (Stripe's
  idempotency keys behave the same). ``cancel`` and ``resume`` read the run's terminality *before* this rule;
  that ordering belongs to the caller.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

from ._control_identity import JSON
from .errors import ControlError

__all__ = [
    "Accepted",
    "AlreadyApplied",
    "Parked",
    "Conflict",
    "Terminal",
    "Receipt",
    "RECEIPT_TYPES",
    "WAITING_APPROVAL",
    "receipt_from_dict",
    "decide_replay",
]

WAITING_APPROVAL = "waiting-approval"


def _invalid(message: str) -> ControlError:
    return ControlError("invalid_receipt", message)


def _text(value: object, what: str) -> str:
    if type(value) is not str or not value:
        raise _invalid(
            f"{what} must be a non-empty str; a receipt is built by the control plane, not by hand"
        )
    return value


def _optional_text(value: object, what: str) -> str | None:
    return None if value is None else _text(value, what)


def _members(
    data: object, tag: str, required: set[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if type(data) is not dict:
        raise _invalid(f"a {tag} receipt is a JSON object, got a {type(data).__name__}")
    if data.get("_tag") != tag:
        raise _invalid(
            f"expected _tag {tag!r}, got {data.get('_tag')!r}; use receipt_from_dict to dispatch on _tag"
        )
    names = set(data) - {"_tag"}
    missing = required - names
    unknown = names - required - optional
    if missing or unknown:
        raise _invalid(
            f"a {tag} receipt has members {sorted(required | optional)}"
            f" (missing {sorted(missing)}, unknown {sorted(unknown)}); it cannot be decoded"
        )
    return data


_R = TypeVar("_R", bound="_ReceiptRef")


@dataclass(frozen=True)
class _ReceiptRef:
    """The shape Accepted and AlreadyApplied share: a receipt id and, when a run exists, its id."""

    receipt_id: str
    run_id: str | None = None

    type: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _text(self.receipt_id, "receipt_id")
        _optional_text(self.run_id, "run_id")

    def to_dict(self) -> dict[str, JSON]:
        """Wire form; ``runId`` is omitted (not ``null``) when there is no run."""
        out: dict[str, JSON] = {"_tag": self.type, "receiptId": self.receipt_id}
        if self.run_id is not None:
            out["runId"] = self.run_id
        return out

    @classmethod
    def from_dict(cls: builtins.type[_R], data: object) -> _R:
        """Inverse of :meth:`to_dict`; :class:`ControlError` ``invalid_receipt`` otherwise."""
        d = _members(data, cls.type, {"receiptId"}, frozenset({"runId"}))
        return cls(receipt_id=d["receiptId"], run_id=d.get("runId"))


@dataclass(frozen=True)
class Accepted(_ReceiptRef):
    """This call admitted the mutation. ``run_id`` is present when a run exists."""

    type: ClassVar[str] = "Accepted"
    label: ClassVar[str] = "accepted"  # metrics/journal label (snake_case)
    recorded: ClassVar[bool] = True

    def replayed(self) -> AlreadyApplied:
        """What a matching retry under the same key answers."""
        return AlreadyApplied(receipt_id=self.receipt_id, run_id=self.run_id)


@dataclass(frozen=True)
class AlreadyApplied(_ReceiptRef):
    """An earlier call under this key admitted the mutation; carries the same ``receipt_id`` and ``run_id``."""

    type: ClassVar[str] = "AlreadyApplied"
    label: ClassVar[str] = "already_applied"
    recorded: ClassVar[bool] = False

    def replayed(self) -> AlreadyApplied:
        """A replay of a replay is itself."""
        return self


@dataclass(frozen=True)
class Parked:
    """The plan is waiting for an approval. Never recorded: the key stays unspent for the launch after approval."""

    plan_id: str
    status: str = WAITING_APPROVAL

    type: ClassVar[str] = "Parked"
    label: ClassVar[str] = "parked"
    recorded: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _text(self.plan_id, "plan_id")
        if self.status != WAITING_APPROVAL:
            raise _invalid(f"a Parked receipt's status is always {WAITING_APPROVAL!r}, got {self.status!r}")

    def to_dict(self) -> dict[str, JSON]:
        """Wire form."""
        return {"_tag": self.type, "planId": self.plan_id, "status": self.status}

    @classmethod
    def from_dict(cls, data: object) -> Parked:
        """Inverse of :meth:`to_dict`."""
        d = _members(data, cls.type, {"planId", "status"})
        return cls(plan_id=d["planId"], status=d["status"])


@dataclass(frozen=True)
class Conflict:
    """The key names a different intent than the one it was first used for. ``message`` says what to do."""

    message: str

    type: ClassVar[str] = "Conflict"
    label: ClassVar[str] = "conflict"
    recorded: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _text(self.message, "message")

    def to_dict(self) -> dict[str, JSON]:
        """Wire form."""
        return {"_tag": self.type, "message": self.message}

    @classmethod
    def from_dict(cls, data: object) -> Conflict:
        """Inverse of :meth:`to_dict`."""
        d = _members(data, cls.type, {"message"})
        return cls(message=d["message"])


@dataclass(frozen=True)
class Terminal:
    """The run had already settled; ``status`` is the status it settled with. Describes the run, not a call."""

    run_id: str
    status: str

    type: ClassVar[str] = "Terminal"
    label: ClassVar[str] = "terminal"
    recorded: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _text(self.run_id, "run_id")
        _text(self.status, "status")

    def to_dict(self) -> dict[str, JSON]:
        """Wire form."""
        return {"_tag": self.type, "runId": self.run_id, "status": self.status}

    @classmethod
    def from_dict(cls, data: object) -> Terminal:
        """Inverse of :meth:`to_dict`."""
        d = _members(data, cls.type, {"runId", "status"})
        return cls(run_id=d["runId"], status=d["status"])


Receipt = Union[Accepted, AlreadyApplied, Parked, Conflict, Terminal]

#: ``_tag`` -> receipt class.
RECEIPT_TYPES: dict[str, type[Accepted | AlreadyApplied | Parked | Conflict | Terminal]] = {
    cls.type: cls for cls in (Accepted, AlreadyApplied, Parked, Conflict, Terminal)
}


def receipt_from_dict(data: object) -> Receipt:
    """Decode any receipt's wire form by its ``_tag``; :class:`ControlError` ``invalid_receipt`` otherwise."""
    tag = data.get("_tag") if type(data) is dict else None
    cls = RECEIPT_TYPES.get(tag) if type(tag) is str else None
    if cls is None:
        raise _invalid(f"unknown receipt _tag {tag!r}; expected one of {sorted(RECEIPT_TYPES)}")
    return cls.from_dict(data)


def decide_replay(
    stored_fingerprint: str,
    new_fingerprint: str,
    stored_receipt: Receipt,
    *,
    operation: str | None = None,
) -> AlreadyApplied | Conflict:
    """The replay rule for a key that already has a recorded receipt.

    Same fingerprint: the recorded receipt replays as :class:`AlreadyApplied` (same ``receipt_id``/``run_id``).
    Different fingerprint: :class:`Conflict`. ``stored_receipt`` must be a recorded one (``Accepted``, or its
    replayed view); anything else was never stored and is refused with ``invalid_receipt``.
    """
    if type(stored_fingerprint) is not str or type(new_fingerprint) is not str:
        raise _invalid("fingerprints are hex strings computed by identity.fingerprint")
    if type(stored_receipt) is Accepted or type(stored_receipt) is AlreadyApplied:
        if stored_fingerprint == new_fingerprint:
            return stored_receipt.replayed()
        what = f"{operation} " if operation else ""
        return Conflict(
            message=(
                f"this idempotency key was first used for a different {what}request"
                f" (fingerprint {stored_fingerprint[:12]}, now {new_fingerprint[:12]}); repeat the original"
                " request unchanged to read its receipt, or use a new key for a new intent"
            )
        )
    raise _invalid(
        f"a {type(stored_receipt).__name__} receipt is never recorded, so it cannot be replayed;"
        " only Accepted receipts are stored under a durable key"
    )
