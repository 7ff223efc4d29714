"""Plan cards and envelopes: the reviewable value a plan approval pins. PURE (no I/O).

It sits at the root, below the stores, because the control records' owner (``records.control``) decodes stored
cards, tokens and grants into these types; callers import them from ``smthrs_plugin.control``.

Invariants
- ``PlanCard.digest`` is plain hex SHA-256 of canonical ``{flowId, input, envelope, deployClass, persistedPlan}``
  where ``persistedPlan`` is the persisted plan's digest or ``null``. The node
  graph is pinned *through* the persisted plan digest (which covers every node's id, kind, key and
  dependencies), so a card that lists nodes must carry that digest: "approve this flow with this input" and
  "approve this graph of keyed work" are different promises. A card is always
  built from its parts and its digest recomputed; a stored card whose digest no longer matches its content is
  refused (``plan_digest_mismatch``), never trusted.
- An :class:`Envelope` is the authority being granted (capabilities, collaborator flows, budget, placement).
  Two envelopes are the same exactly when their canonical RFC 8785 bytes are equal: member order never matters,
  list order and every value do. Nothing is normalised silently (capabilities are not sorted or deduplicated).
- The card carries the exact approval payload (:class:`PlanApproval`) so a reviewer resubmits it unchanged
  rather than reconstructing authority on the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ._control_identity import JSON, check_text, decode_input, refuse, type_name
from .canonical import canonical_bytes, sha256_hex
from .errors import ControlError

__all__ = [
    "Envelope",
    "CardNode",
    "PlanApproval",
    "PlanCard",
    "GRANT_SCOPES",
    "DEFAULT_SCOPE",
    "envelope_matches",
    "check_envelope",
    "check_plan_digest",
    "card_digest",
]

#: How long a grant lasts. Scopes are not hierarchical.
GRANT_SCOPES = ("once", "run", "remembered")
DEFAULT_SCOPE = "run"
_HEX = frozenset("0123456789abcdef")


def _object(value: object, bound: str, what: str, members: set[str], required: set[str]) -> dict[str, Any]:
    data = decode_input(value)
    if type(data) is not dict:
        raise refuse(bound, f"{what} must be a JSON object with members {sorted(members)}")
    unknown = set(data) - members
    missing = required - set(data)
    if unknown or missing:
        raise refuse(
            bound,
            f"{what} has members {sorted(members)} (required {sorted(required)});"
            f" got unknown {sorted(unknown)}, missing {sorted(missing)}",
        )
    return data


def _names(value: object, bound: str, what: str) -> tuple[str, ...]:
    if type(value) is not list and type(value) is not tuple:
        raise refuse(bound, f"{what} must be a list of strings, got a {type_name(type(value))}")
    return tuple(check_text(v, bound, f"each of {what}") for v in value)


def _digest_text(value: object, what: str) -> str:
    if type(value) is not str or len(value) != 64 or not set(value) <= _HEX:
        raise refuse("plan_card", f"{what} must be 64 lowercase hex characters (a plain SHA-256 digest)")
    return value


@dataclass(frozen=True)
class Envelope:
    """The authority a grant carries. ``budget`` and ``placement`` are decoded JSON copies."""

    capabilities: tuple[str, ...] = ()
    flows: tuple[str, ...] = ()
    budget: dict[str, JSON] = field(default_factory=dict)
    placement: JSON = None  # None = absent (omitted from the wire form), not JSON null

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "capabilities", _names(self.capabilities, "envelope", "envelope.capabilities")
        )
        object.__setattr__(self, "flows", _names(self.flows, "envelope", "envelope.flows"))
        budget = decode_input(self.budget)
        if type(budget) is not dict:
            raise refuse("envelope", 'envelope.budget must be a JSON object, e.g. {} or {"usd": 5}')
        object.__setattr__(self, "budget", budget)
        if self.placement is not None:
            object.__setattr__(self, "placement", decode_input(self.placement))

    __hash__ = None  # type: ignore[assignment]  # holds mutable JSON

    def to_json(self) -> dict[str, JSON]:
        """``{capabilities, flows, budget, placement?}`` (fresh containers)."""
        out: dict[str, JSON] = {
            "capabilities": list(self.capabilities),
            "flows": list(self.flows),
            "budget": decode_input(self.budget),
        }
        if self.placement is not None:
            out["placement"] = decode_input(self.placement)
        return out

    @classmethod
    def from_json(cls, value: object) -> Envelope:
        """Decode an envelope; absent ``capabilities``/``flows``/``budget`` default to empty."""
        d = _object(value, "envelope", "an envelope", {"capabilities", "flows", "budget", "placement"}, set())
        return cls(
            capabilities=d.get("capabilities", []),
            flows=d.get("flows", []),
            budget=d.get("budget", {}),
            placement=d.get("placement"),
        )

    def canonical(self) -> bytes:
        """RFC 8785 bytes of :meth:`to_json`: what envelope comparison compares."""
        return canonical_bytes(self.to_json())

    @property
    def digest(self) -> str:
        """Plain hex SHA-256 of :meth:`canonical` (used in mismatch reports)."""
        return sha256_hex(self.canonical())


def _as_envelope(value: Envelope | JSON) -> Envelope:
    return value if type(value) is Envelope else Envelope.from_json(value)  # type: ignore[return-value]


def envelope_matches(a: Envelope | JSON, b: Envelope | JSON) -> bool:
    """True when both envelopes have the same canonical bytes (member order ignored, values and list order not)."""
    return _as_envelope(a).canonical() == _as_envelope(b).canonical()


def check_envelope(stored: Envelope | JSON, submitted: Envelope | JSON) -> Envelope:
    """Return the stored envelope, or raise ``ControlError("envelope_mismatch")`` with both digests."""
    expected, actual = _as_envelope(stored), _as_envelope(submitted)
    if expected.canonical() != actual.canonical():
        raise ControlError(
            "envelope_mismatch",
            "the submitted envelope is not the one that was reviewed; resubmit the card's approval payload"
            " unchanged, or plan again to review the new envelope",
            expected=expected.digest,
            actual=actual.digest,
        )
    return expected


def check_plan_digest(stored: str, submitted: object) -> str:
    """Return ``stored``, or raise ``ControlError("plan_digest_mismatch", expected=..., actual=...)``."""
    if type(submitted) is not str or submitted != stored:  # type first: never call a hostile __ne__
        actual = submitted if type(submitted) is str else type_name(type(submitted))
        raise ControlError(
            "plan_digest_mismatch",
            "the submitted digest is not the reviewed plan's digest; approve the card you reviewed, or plan again",
            expected=stored,
            actual=actual,
        )
    return stored


@dataclass(frozen=True)
class CardNode:
    """One node of the keyed graph a card shows: ``id``, ``kind``, plan ``key`` and ``depends_on`` ids."""

    id: str
    kind: str
    key: str
    depends_on: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_text(self.id, "plan_card", "a node id")
        check_text(self.kind, "plan_card", f"node {self.id!r}'s kind")
        check_text(self.key, "plan_card", f"node {self.id!r}'s key")
        object.__setattr__(
            self, "depends_on", _names(self.depends_on, "plan_card", f"node {self.id!r}'s depends_on")
        )

    def to_json(self) -> dict[str, JSON]:
        """``{id, kind, key, dependsOn}``."""
        return {"id": self.id, "kind": self.kind, "key": self.key, "dependsOn": list(self.depends_on)}

    @classmethod
    def from_json(cls, value: object) -> CardNode:
        """Inverse of :meth:`to_json`."""
        d = _object(
            value, "plan_card", "a card node", {"id", "kind", "key", "dependsOn"}, {"id", "kind", "key"}
        )
        return cls(id=d["id"], kind=d["kind"], key=d["key"], depends_on=d.get("dependsOn", []))


def _check_scope(scope: object) -> str:
    if type(scope) is not str or scope not in GRANT_SCOPES:
        raise refuse(
            "grant_scope", f"a grant scope is one of {list(GRANT_SCOPES)}; the card's default is 'run'"
        )
    return scope


@dataclass(frozen=True)
class PlanApproval:
    """The exact payload that approves one plan card: target ``{_tag: "Plan", planId, digest, envelope}``."""

    plan_id: str
    digest: str
    envelope: Envelope
    scope: str = DEFAULT_SCOPE
    idempotency_key: str = ""  # empty = derived from plan id and digest

    def __post_init__(self) -> None:
        check_text(self.plan_id, "plan_card", "the plan id")
        _digest_text(self.digest, "the plan card digest")
        if type(self.envelope) is not Envelope:
            object.__setattr__(self, "envelope", Envelope.from_json(self.envelope))
        _check_scope(self.scope)
        if self.idempotency_key == "":
            object.__setattr__(self, "idempotency_key", _approval_key(self.plan_id, self.digest))
        check_text(self.idempotency_key, "idempotency_key", "the approval's idempotency key")

    __hash__ = None  # type: ignore[assignment]

    def to_json(self) -> dict[str, JSON]:
        """``{target: {_tag: "Plan", planId, digest, envelope}, scope, idempotencyKey}``."""
        return {
            "target": {
                "_tag": "Plan",
                "planId": self.plan_id,
                "digest": self.digest,
                "envelope": self.envelope.to_json(),
            },
            "scope": self.scope,
            "idempotencyKey": self.idempotency_key,
        }

    @classmethod
    def from_json(cls, value: object) -> PlanApproval:
        """Inverse of :meth:`to_json`."""
        d = _object(value, "plan_card", "a plan approval", {"target", "scope", "idempotencyKey"}, {"target"})
        target = _object(
            d["target"],
            "plan_card",
            "a plan approval target",
            {"_tag", "planId", "digest", "envelope"},
            {"_tag", "planId", "digest", "envelope"},
        )
        if target["_tag"] != "Plan":
            raise refuse("plan_card", "a plan approval's target has _tag 'Plan'")
        return cls(
            plan_id=target["planId"],
            digest=target["digest"],
            envelope=Envelope.from_json(target["envelope"]),
            scope=d.get("scope", DEFAULT_SCOPE),
            idempotency_key=d.get("idempotencyKey", ""),
        )


def _approval_key(plan_id: str, digest: str) -> str:
    # Names the intent and stays well inside the 1,024-character key bound whatever the plan id's length.
    ident = plan_id if len(plan_id) <= 256 else "sha256-" + sha256_hex(plan_id.encode("utf-8"))
    return f"approve:{ident}:{digest}"


def card_digest(
    flow_id: str, input: JSON, envelope: Envelope, deploy_class: bool, plan_digest: str | None
) -> str:
    """Plain hex SHA-256 of canonical ``{flowId, input, envelope, deployClass, persistedPlan}``."""
    return sha256_hex(
        canonical_bytes(
            {
                "flowId": flow_id,
                "input": input,
                "envelope": envelope.to_json(),
                "deployClass": deploy_class,
                "persistedPlan": plan_digest,
            }
        )
    )


@dataclass(frozen=True)
class PlanCard:
    """The reviewable value ``plan`` returns. ``digest`` and ``approval`` are computed, never supplied."""

    plan_id: str
    flow_id: str
    input: JSON
    envelope: Envelope = field(default_factory=Envelope)
    deploy_class: bool = False
    plan_digest: str | None = None
    nodes: tuple[CardNode, ...] = ()
    scope: str = DEFAULT_SCOPE
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        check_text(self.plan_id, "plan_card", "the plan id")
        check_text(self.flow_id, "plan_card", "the flow id")
        object.__setattr__(self, "input", decode_input(self.input))
        if type(self.envelope) is not Envelope:
            object.__setattr__(self, "envelope", Envelope.from_json(self.envelope))
        if type(self.deploy_class) is not bool:
            raise refuse("plan_card", "deploy_class is a bool (true when the flow deploys)")
        if self.plan_digest is not None:
            check_text(self.plan_digest, "plan_card", "the persisted plan digest")
        nodes = self._check_nodes(self.nodes)
        object.__setattr__(self, "nodes", nodes)
        _check_scope(self.scope)
        object.__setattr__(
            self,
            "digest",
            card_digest(self.flow_id, self.input, self.envelope, self.deploy_class, self.plan_digest),
        )

    def _check_nodes(self, nodes: object) -> tuple[CardNode, ...]:
        if type(nodes) is not list and type(nodes) is not tuple:
            raise refuse("plan_card", f"nodes must be a list of CardNode, got a {type_name(type(nodes))}")
        out = tuple(n if type(n) is CardNode else CardNode.from_json(n) for n in nodes)
        if out and self.plan_digest is None:
            # Without the persisted plan digest the graph would ride along unpinned by the card digest.
            raise refuse(
                "plan_card", "a card that lists nodes must carry the persisted plan's digest (plan_digest)"
            )
        ids = [n.id for n in out]
        if len(set(ids)) != len(ids):
            raise refuse("plan_card", "card node ids must be unique; build the card from a compiled plan")
        known = set(ids)
        for n in out:
            unknown = [d for d in n.depends_on if d not in known]
            if unknown:
                raise refuse(
                    "plan_card",
                    f"node {n.id!r} depends on unknown nodes {unknown}; build the card from a compiled plan",
                )
        return out

    __hash__ = None  # type: ignore[assignment]

    @property
    def approval(self) -> PlanApproval:
        """The exact payload to submit to ``approve`` for this card."""
        return PlanApproval(
            plan_id=self.plan_id, digest=self.digest, envelope=self.envelope, scope=self.scope
        )

    def to_json(self) -> dict[str, JSON]:
        """Wire form (``--json``): the parts, the digest and the approval payload."""
        return {
            "planId": self.plan_id,
            "flowId": self.flow_id,
            "input": decode_input(self.input),
            "envelope": self.envelope.to_json(),
            "deployClass": self.deploy_class,
            "persistedPlan": self.plan_digest,
            "nodes": [n.to_json() for n in self.nodes],
            "scope": self.scope,
            "digest": self.digest,
            "approval": self.approval.to_json(),
        }

    @classmethod
    def from_json(cls, value: object) -> PlanCard:
        """Rebuild a card and verify its recorded digest (``plan_digest_mismatch`` when the content drifted)."""
        members = {
            "planId",
            "flowId",
            "input",
            "envelope",
            "deployClass",
            "persistedPlan",
            "nodes",
            "scope",
            "digest",
            "approval",
        }
        d = _object(value, "plan_card", "a plan card", members, members - {"approval", "nodes", "scope"})
        card = cls(
            plan_id=d["planId"],
            flow_id=d["flowId"],
            input=d["input"],
            envelope=Envelope.from_json(d["envelope"]),
            deploy_class=d["deployClass"],
            plan_digest=d["persistedPlan"],
            nodes=tuple(CardNode.from_json(n) for n in _list(d.get("nodes", []))),
            scope=d.get("scope", DEFAULT_SCOPE),
        )
        # expected = what the content hashes to now; actual = what was recorded beside it.
        check_plan_digest(card.digest, _digest_text(d["digest"], "the recorded card digest"))
        if "approval" in d and PlanApproval.from_json(d["approval"]).to_json() != card.approval.to_json():
            raise refuse("plan_card", "the card's approval payload does not match the card; rebuild the card")
        return card


def _list(value: object) -> Sequence[Any]:
    if type(value) is not list:
        raise refuse("plan_card", "nodes must be a JSON array of card nodes")
    return value  # type: ignore[return-value]
