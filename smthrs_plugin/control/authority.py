"""Who may decide what: approval targets (a plan card, a node request) and the approval authority.

Invariants
- An approval payload identifies the request; it is not permission to decide it. Authentication supplies a
  trusted :class:`~.identity.Principal`; an :class:`ApprovalAuthority` supplies the independent host policy. The
  control plane asks it before any target read or receipt replay, and again inside the resolving transaction.
- The default (:data:`DEFAULT_AUTHORITY`) recognises only ``local/operator``. Delegations bind
  ``(principal, scopes, target kinds)`` exactly: scopes are not hierarchical, an unlisted kind or scope is refused,
  an actor's ``kind`` alone never delegates, and a delegation is reusable (``scopes={"once"}`` permits once-scoped
  grants; it is not single-use). A delegated actor may deny its listed target kinds without installing a grant.
- Fail closed: an authority that raises, or answers anything but ``Authorized``, refuses
  (``ControlError(unauthorized)``, the cause kept).
- Pluggable by constructor: a plugin's authority (hook ``smthrs_approval_authority``) implements
  ``authorize(principal, action, target)``; one that also implements ``authorize_request(AuthorityRequest)`` is
  asked with the grant scope and target kind too (what a delegation binds).
- Targets compare by canonical bytes: an envelope is the same exactly when its RFC 8785 bytes are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Union

from .._control_cards import GRANT_SCOPES, Envelope
from ..errors import ControlError, SmthrsError
from .identity import JSON, LOCAL_OPERATOR, Principal, check_text, decode_input, refuse

__all__ = [
    "Principal",
    "TargetKind",
    "PlanTarget",
    "NodeTarget",
    "Target",
    "target_from_json",
    "AuthorityRequest",
    "Authorized",
    "Unauthorized",
    "AuthorityVerdict",
    "ApprovalAuthority",
    "Delegation",
    "DelegatedAuthority",
    "DEFAULT_AUTHORITY",
    "authorize",
]

TargetKind = Literal["Plan", "Node"]


# -- targets -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanTarget:
    """A plan card's approval target: what was reviewed (``digest``) and the authority granted (``envelope``)."""

    plan_id: str
    digest: str
    envelope: Envelope = field(default_factory=Envelope)
    kind: ClassVar[TargetKind] = "Plan"

    def __post_init__(self) -> None:
        check_text(self.plan_id, "plan_card", "the plan id")
        check_text(self.digest, "plan_card", "the digest")
        if type(self.envelope) is not Envelope:
            object.__setattr__(self, "envelope", Envelope.from_json(self.envelope))

    __hash__ = None  # type: ignore[assignment]

    @property
    def name(self) -> str:
        return self.plan_id

    def to_json(self) -> dict[str, JSON]:
        return {
            "_tag": "Plan",
            "planId": self.plan_id,
            "digest": self.digest,
            "envelope": self.envelope.to_json(),
        }


@dataclass(frozen=True)
class NodeTarget:
    """A node approval target: the request a step of ``run_id`` registered, with its digest and envelope."""

    run_id: str
    request_id: str
    digest: str
    envelope: Envelope = field(default_factory=Envelope)
    kind: ClassVar[TargetKind] = "Node"

    def __post_init__(self) -> None:
        check_text(self.run_id, "plan_card", "the run id")
        check_text(self.request_id, "plan_card", "the request id")
        check_text(self.digest, "plan_card", "the digest")
        if type(self.envelope) is not Envelope:
            object.__setattr__(self, "envelope", Envelope.from_json(self.envelope))

    __hash__ = None  # type: ignore[assignment]

    @property
    def name(self) -> str:
        return f"{self.run_id}/{self.request_id}"

    def to_json(self) -> dict[str, JSON]:
        return {
            "_tag": "Node",
            "runId": self.run_id,
            "requestId": self.request_id,
            "digest": self.digest,
            "envelope": self.envelope.to_json(),
        }


Target = Union[PlanTarget, NodeTarget]


def target_from_json(value: object) -> Target:
    """Decode ``{_tag: "Plan", planId, digest, envelope}`` or ``{_tag: "Node", runId, requestId, digest,
    envelope}`` (exactly those members) or refuse with ``InvalidInput``."""
    data = decode_input(value)
    if type(data) is not dict:
        raise refuse("plan_card", "an approval target is a JSON object with a _tag of 'Plan' or 'Node'")
    plan = {"_tag", "planId", "digest", "envelope"}
    node = {"_tag", "runId", "requestId", "digest", "envelope"}
    if data.get("_tag") == "Plan" and set(data) == plan:
        return PlanTarget(data["planId"], data["digest"], Envelope.from_json(data["envelope"]))  # type: ignore[arg-type]
    if data.get("_tag") == "Node" and set(data) == node:
        return NodeTarget(
            data["runId"],  # type: ignore[arg-type]
            data["requestId"],  # type: ignore[arg-type]
            data["digest"],  # type: ignore[arg-type]
            Envelope.from_json(data["envelope"]),
        )
    raise refuse(
        "plan_card",
        f"an approval target has members {sorted(plan)} (_tag Plan) or {sorted(node)} (_tag Node); resubmit the "
        "card's approval payload unchanged",
    )


# -- authority ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuthorityRequest:
    """What an authority is asked: may ``principal`` ``action`` (approve|deny) the ``target_kind`` target
    ``target`` (a plan id, or ``<run id>/<request id>``), installing a grant of ``scope`` (None for a denial)?"""

    principal: Principal
    action: Literal["approve", "deny"]
    target_kind: TargetKind
    target: str
    scope: str | None = None


@dataclass(frozen=True)
class Authorized:
    """The authority allows ``principal`` to decide."""

    principal: Principal
    tag: Literal["Authorized"] = "Authorized"


@dataclass(frozen=True)
class Unauthorized:
    """The authority refuses; ``reason`` says what would be needed."""

    principal: Principal
    reason: str
    tag: Literal["Unauthorized"] = "Unauthorized"


AuthorityVerdict = Union[Authorized, Unauthorized]


class ApprovalAuthority(Protocol):
    """Decides who may approve or deny (the hook ``smthrs_approval_authority`` answers one of these)."""

    def authorize(self, principal: Principal, action: str, target: str) -> Any:
        """``Authorized`` (``tag == "Authorized"``) or ``Unauthorized`` (with a ``reason``)."""
        ...


@dataclass(frozen=True)
class Delegation:
    """``principal`` may decide targets of the listed kinds, installing grants of the listed scopes. Exact, not
    hierarchical: ``scopes={"once"}`` permits once-scoped grants only (reusable, not single-use)."""

    principal: Principal
    scopes: frozenset[str] = frozenset(GRANT_SCOPES)
    targets: frozenset[str] = frozenset({"Plan", "Node"})

    def __post_init__(self) -> None:
        if type(self.principal) is not Principal:
            raise refuse("principal", "a delegation names a Principal (ID/KIND)")
        object.__setattr__(self, "scopes", frozenset(self.scopes))
        object.__setattr__(self, "targets", frozenset(self.targets))
        if not self.scopes <= set(GRANT_SCOPES):
            raise refuse("grant_scope", f"delegated scopes must be among {list(GRANT_SCOPES)}")
        if not self.targets <= {"Plan", "Node"}:
            raise refuse("principal", "delegated target kinds are 'Plan' and/or 'Node'")


class DelegatedAuthority:
    """An authority from an explicit list of delegations (the default: only ``local/operator``, everything)."""

    def __init__(self, delegations: Iterable[Delegation]) -> None:
        self.delegations: tuple[Delegation, ...] = tuple(delegations)

    def authorize_request(self, request: AuthorityRequest) -> AuthorityVerdict:
        for d in self.delegations:
            if d.principal != request.principal or request.target_kind not in d.targets:
                continue
            if request.action == "deny" or request.scope in d.scopes:
                return Authorized(request.principal)
        return Unauthorized(
            request.principal,
            f"{request.principal} has no delegation to {request.action} {request.target_kind.lower()} target "
            f"{request.target!r}"
            + (f" with scope {request.scope!r}" if request.scope else "")
            + "; decide as an authorised principal (default: local/operator) or install an approval authority",
        )

    def authorize(self, principal: Principal, action: str, target: str) -> AuthorityVerdict:
        """The hook's three-argument form: any delegation of ``principal`` for either target kind."""
        if any(d.principal == principal for d in self.delegations):
            return Authorized(principal)
        return Unauthorized(principal, f"{principal} has no approval delegation")

    def __repr__(self) -> str:
        return f"DelegatedAuthority({[str(d.principal) for d in self.delegations]})"


DEFAULT_AUTHORITY = DelegatedAuthority([Delegation(LOCAL_OPERATOR)])


def authorize(authority: Any, request: AuthorityRequest) -> Authorized:
    """Ask ``authority``; raise ``ControlError(unauthorized)`` on anything but ``Authorized`` (fail closed)."""
    try:
        ask = getattr(authority, "authorize_request", None)
        verdict = (
            ask(request)
            if callable(ask)
            else authority.authorize(request.principal, request.action, request.target)
        )
    except SmthrsError:
        raise
    except Exception as exc:
        raise ControlError(
            "unauthorized",
            f"the approval authority failed ({type(exc).__name__}: {exc}); refusing (fail closed) — fix the "
            "authority and decide again",
            cause=exc,
            principal=str(request.principal),
        ) from exc
    if getattr(verdict, "tag", None) == "Authorized":
        return Authorized(request.principal)
    reason = getattr(verdict, "reason", None)
    raise ControlError(
        "unauthorized",
        reason
        if isinstance(reason, str) and reason
        else f"{request.principal} may not {request.action} {request.target!r}",
        principal=str(request.principal),
        action=request.action,
        target=request.target,
    )
