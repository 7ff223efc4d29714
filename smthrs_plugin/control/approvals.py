"""Approvals: approval tokens, durable decisions and grants, and the node gates that ask for them.

Two gates carry an approval: a **plan approval** decides whether a run
starts (its token is minted with the plan card, ``facade.py``); a **node approval** is registered by a running
step — ``sp.require_approval(request_id, envelope=...)`` in a ``@step`` flow, or a plan node declaring
``approval: {request, envelope}`` (:class:`NodeGate`) — and decides something inside a run that already started.

Invariants
- **Authority** (``authority.py``): asked before any read or replay and again inside the resolving transaction.
- **Registration is idempotent.** ``register(run, request)`` creates the token once and answers its current state
  (``PendingApproval | Approved | Denied``) afterwards; a changed digest or envelope for the same request is refused
  (``plan_digest_mismatch`` / ``envelope_mismatch``), never re-aimed. A new request already covered by an earlier
  grant (``run`` scope: same run, digest and envelope; ``remembered``: same flow, digest and envelope) is decided
  at registration, in the same transaction, naming that grant.
- **A decision is one transaction** (:meth:`Approvals.decide_in`, called inside the facade's write): token lookup
  (unknown → ``plan_not_found``, decided → ``already_resolved``), digest and envelope checks, authority recheck,
  the decision row, the grant (approvals only), the journal record ``control.approval.approved|denied`` (on the
  plan's partition or the run's) and, for a node target, a resume delegation + ``control.run.resumed`` and the
  wake of a run parked on that token. The facade adds the receipt to the same transaction.
- **Only approval opens a gate.** A node whose token is pending parks the run (``RunParked`` kind ``approval``: the
  driver suspends it with waiting reason ``waiting-approval``); denied fails the node with
  :class:`~smthrs_plugin.errors.ApprovalDenied`; the resumed run re-registers and reads the durable decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from .._control_cards import GRANT_SCOPES, Envelope, check_envelope, check_plan_digest
from ..canonical import sha256_hex
from ..engine.context import RunContext, RunParked, check_wait_allowed, current_run
from ..errors import ApprovalDenied, ControlError, PlanError, SmthrsError
from ..records import control as rc
from ..records.journal import Journal, plan_partition
from ..records.runs import TERMINAL_STATUSES, OwnerId, assert_owner, run_row_in
from ..records.waits import WaitStore
from ..stores.database import Database, open_database
from .authority import (
    DEFAULT_AUTHORITY,
    AuthorityRequest,
    Authorized,
    NodeTarget,
    PlanTarget,
    Target,
    authorize,
)
from .identity import Principal, check_text, refuse

__all__ = [
    "PendingApproval",
    "Approved",
    "Denied",
    "TokenState",
    "state_of",
    "Approvals",
    "require_approval",
    "NodeGate",
    "gate_spec",
    "WAITING_APPROVAL_REASON",
    "check_scope",
]

#: The waiting reason of a run parked on a node approval (``runs.waiting_reason``).
WAITING_APPROVAL_REASON = "waiting-approval"


# -- token states ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PendingApproval:
    """Registered, not decided."""

    token_id: str
    target: str
    tag: ClassVar[str] = "Pending"


@dataclass(frozen=True)
class Approved:
    """Approved by ``principal``; ``grant_id`` is the grant installed (or the earlier grant that decided it)."""

    token_id: str
    principal: Principal
    decided_at_ms: int
    scope: str
    grant_id: str
    tag: ClassVar[str] = "Approved"


@dataclass(frozen=True)
class Denied:
    """Denied by ``principal``: final for this token."""

    token_id: str
    principal: Principal
    decided_at_ms: int
    tag: ClassVar[str] = "Denied"


TokenState = Union[PendingApproval, Approved, Denied]


def state_of(token: rc.TokenRow, decision: rc.DecisionRow | None) -> TokenState:
    """The state a token's decision row (or its absence) stands for."""
    if decision is None:
        return PendingApproval(token.token_id, token.target)
    if decision.decision == "denied":
        return Denied(token.token_id, decision.principal, decision.decided_at_ms)
    grant = decision.via_grant_id or decision.grant_id
    return Approved(
        token.token_id, decision.principal, decision.decided_at_ms, decision.scope or "run", grant or ""
    )


def check_scope(scope: object) -> str:
    """``scope`` when it is one of :data:`GRANT_SCOPES`; ``InvalidInput`` (bound ``grant_scope``) otherwise."""
    if type(scope) is not str or scope not in GRANT_SCOPES:
        raise refuse("grant_scope", f"a grant scope is one of {list(GRANT_SCOPES)}")
    return scope


# -- the durable part -------------------------------------------------------------------------------------------------


class Approvals:
    """Tokens, decisions and grants of one database (see the module invariants)."""

    def __init__(
        self,
        db: Database,
        *,
        journal: Journal | None = None,
        waits: WaitStore | None = None,
        authority: Any = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.db = db
        self.clock = clock
        self.journal = journal or Journal(db, clock=clock)
        self.waits = waits or WaitStore(db, journal=self.journal, clock=clock)
        self.authority = DEFAULT_AUTHORITY if authority is None else authority
        if not callable(getattr(self.authority, "authorize", None)) and not callable(
            getattr(self.authority, "authorize_request", None)
        ):
            raise ControlError(
                "invalid_options", f"{self.authority!r} is not an approval authority (it has no authorize())"
            )

    # -- node registration ----------------------------------------------------------------------------------
    def register(
        self,
        run_id: str,
        request_id: str,
        *,
        digest: str | None = None,
        envelope: Envelope | Mapping[str, Any] | None = None,
        owner: OwnerId | None = None,
    ) -> TokenState:
        """Register (idempotently) the node approval ``request_id`` of run ``run_id`` and answer its state.

        ``digest`` names what is asked (default ``<flow>:<request id>``); ``envelope`` the authority it needs.
        With ``owner`` the registration is fenced on the run's owner (``FenceLost`` for a process that lost it).
        Refuses an unknown run (``run_not_found``) and a changed digest/envelope for the same request."""
        check_text(run_id, "plan_card", "the run id")
        check_text(request_id, "plan_card", "the request id")
        env = envelope if type(envelope) is Envelope else Envelope.from_json(envelope or {})
        assert isinstance(env, Envelope)
        if digest is not None:
            check_text(digest, "plan_card", "the request digest")
        token_id = rc.new_id("tok")  # minted outside the callback: a retried transaction reuses it

        def fn(conn: Connection) -> TokenState:
            row = run_row_in(conn, run_id)
            if row is None:
                raise ControlError(
                    "run_not_found",
                    f"run {run_id!r} does not exist; a node approval belongs to a run",
                    run_id=run_id,
                )
            if owner is not None:
                assert_owner(conn, run_id, owner)
            want = digest if digest is not None else f"{row.flow}:{request_id}"
            existing = rc.node_token_in(conn, run_id, request_id)
            if existing is not None:
                check_plan_digest(existing.digest, want)
                check_envelope(existing.envelope, env)
                return state_of(existing, rc.decision_in(conn, existing.token_id))
            now = self.clock.now_ms()
            token = rc.insert_token_in(
                conn, token_id, "Node", flow_id=row.flow, digest=want, envelope=env, now_ms=now,
                run_id=run_id, request_id=request_id,
            )  # fmt: skip
            self.journal.append_in(
                conn,
                run_id,
                "control.approval.requested",
                {
                    "factVersion": 1,
                    "tokenId": token.token_id,
                    "approvalTarget": _node_target(token).to_json(),
                },
            )
            grant = rc.matching_grant_in(
                conn, "Node", flow_id=row.flow, digest=want, envelope=env, run_id=run_id
            )
            if grant is None:
                return PendingApproval(token.token_id, token.target)
            decision = rc.insert_decision_in(
                conn,
                rc.DecisionRow(
                    token.token_id, "approved", grant.principal, now, grant.scope, None, grant.grant_id
                ),
            )
            self.journal.append_in(
                conn,
                run_id,
                "control.approval.approved",
                {
                    "factVersion": 1,
                    "tokenId": token.token_id,
                    "approvalTarget": _node_target(token).to_json(),
                    "principal": dict(grant.principal.to_json()),
                    "scope": grant.scope,
                    "viaGrant": grant.grant_id,
                },
            )
            return state_of(token, decision)

        return self.db.write(fn)

    def node_state(self, run_id: str, request_id: str) -> TokenState | None:
        """The state of a registered node approval, or None when the run never asked for it."""

        def fn(conn: Connection) -> TokenState | None:
            token = rc.node_token_in(conn, run_id, request_id)
            return None if token is None else state_of(token, rc.decision_in(conn, token.token_id))

        return self.db.read(fn)

    # -- decisions ------------------------------------------------------------------------------------------
    def authorize(self, request: AuthorityRequest) -> Authorized:
        """:func:`authorize` with this plane's authority."""
        return authorize(self.authority, request)

    def decide_in(
        self,
        conn: Connection,
        action: Literal["approve", "deny"],
        target: Target,
        principal: Principal,
        scope: str | None,
    ) -> tuple[rc.TokenRow, rc.DecisionRow]:
        """Resolve ``target``'s token once, inside the caller's write (see the module invariants)."""
        if action == "approve":
            scope = check_scope(scope)
        token = self._token_for(conn, target)
        decision = rc.decision_in(conn, token.token_id)
        if decision is not None:
            raise ControlError(
                "already_resolved",
                f"{target.kind.lower()} target {target.name!r} was already {decision.decision} by "
                f"{decision.principal}; a decision is final — plan again (or ask again in a new run)",
                token_id=token.token_id,
                decision=decision.decision,
            )
        check_plan_digest(token.digest, target.digest)
        check_envelope(token.envelope, target.envelope)
        # The recheck inside the resolving transaction: a policy change between the first check and now counts.
        self.authorize(AuthorityRequest(principal, action, target.kind, target.name, scope))
        now = self.clock.now_ms()
        grant_id: str | None = None
        if action == "approve":
            assert scope is not None
            grant_id = rc.new_id("grant")
            rc.insert_grant_in(
                conn,
                rc.GrantRow(
                    grant_id, token.token_id, token.kind, scope, token.flow_id, token.digest, token.envelope,
                    principal, now, run_id=token.run_id,
                ),
            )  # fmt: skip
        decision = rc.insert_decision_in(
            conn,
            rc.DecisionRow(token.token_id, "approved" if action == "approve" else "denied", principal, now, scope,
                           grant_id),
        )  # fmt: skip
        payload: dict[str, Any] = {
            "factVersion": 1,
            "tokenId": token.token_id,
            "approvalTarget": target.to_json(),
            "principal": dict(principal.to_json()),
        }
        if scope is not None:
            payload["scope"] = scope
        if grant_id is not None:
            payload["grantId"] = grant_id
        partition = plan_partition(str(token.plan_id)) if token.kind == "Plan" else str(token.run_id)
        self.journal.append_in(conn, partition, f"control.approval.{decision.decision}", payload)
        if token.kind == "Node":
            self._resume_in(conn, token, decision)
        return token, decision

    def _token_for(self, conn: Connection, target: Target) -> rc.TokenRow:
        if isinstance(target, PlanTarget):
            token = rc.plan_token_in(conn, target.plan_id)
            if token is None:
                card = rc.card_in(conn, target.plan_id)
                raise ControlError(
                    "plan_not_found",
                    f"plan {target.plan_id!r} "
                    + ("does not exist; run `smthrs plan PLAN.yaml` and approve the card it prints"
                       if card is None else "does not require an approval (its file has no `approval: required`)"),
                    plan_id=target.plan_id,
                )  # fmt: skip
            return token
        token = rc.node_token_in(conn, target.run_id, target.request_id)
        if token is None:
            raise ControlError(
                "plan_not_found",
                f"run {target.run_id!r} has not asked for approval {target.request_id!r}; a node approval can only "
                "decide a request a step made (see `smthrs show RUN_ID` for its pending requests)",
                run_id=target.run_id,
                request_id=target.request_id,
            )
        return token

    def _resume_in(self, conn: Connection, token: rc.TokenRow, decision: rc.DecisionRow) -> None:
        run_id = str(token.run_id)
        row = run_row_in(conn, run_id)
        if row is None or row.status in TERMINAL_STATUSES:
            return
        rc.insert_resume_in(conn, run_id, decision)
        woken = False
        parked_here = row.wait_token_digest in (None, sha256_hex(token.token_id.encode("utf-8")))
        if row.status == "suspended" and row.waiting_reason == WAITING_APPROVAL_REASON and parked_here:
            self.waits.wake(run_id)  # joins this transaction (a savepoint)
            woken = True
        self.journal.append_in(
            conn,
            run_id,
            "control.run.resumed",
            {
                "delegation": {"tokenId": token.token_id, "decision": decision.decision},
                "principal": dict(decision.principal.to_json()),
                "woken": woken,
            },
        )


def _node_target(token: rc.TokenRow) -> NodeTarget:
    return NodeTarget(str(token.run_id), str(token.request_id), token.digest, token.envelope)


# -- gates: what flow code and plan nodes call ------------------------------------------------------------------------


def _gate(state: TokenState, run_id: str, request_id: str, ctx: RunContext | None = None) -> Approved:
    if isinstance(state, Approved):
        return state
    if isinstance(state, Denied):
        raise ApprovalDenied(
            "approval_denied",
            f"approval {request_id!r} of run {run_id!r} was denied by {state.principal}; the step fails — start a "
            "new run to ask again",
            run_id=run_id,
            request_id=request_id,
            principal=str(state.principal),
        )
    signal = RunParked(run_id, "approval", request_id, token=state.token_id)  # type: ignore[arg-type]
    raise signal if ctx is None else ctx.parked(signal)


def require_approval(
    request_id: str,
    *,
    envelope: Envelope | Mapping[str, Any] | None = None,
    digest: str | None = None,
) -> Approved:
    """Inside a run (a Prefect ``@flow`` body, a flow a run driver drives, a plan node): ask for the node approval
    ``request_id`` and continue only once it is approved. A pending request parks the run ``waiting-approval`` (the process may exit; ``smthrs approve RUN_ID
    --request R`` then resumes it); denied raises :class:`~smthrs_plugin.errors.ApprovalDenied`. Refused inside a
    ``@step`` body (a cache hit would skip it): ask in the flow body, before the step."""
    check_wait_allowed("sp.require_approval")
    ctx = current_run()
    approvals = Approvals(ctx.waits.db, journal=ctx.waits.journal, waits=ctx.waits, clock=ctx.clock)
    state = approvals.register(ctx.run_id, request_id, digest=digest, envelope=envelope, owner=ctx.owner)
    return _gate(state, ctx.run_id, request_id, ctx)


def gate_spec(node_id: str, spec: object) -> tuple[str, Envelope]:
    """``(request id, envelope)`` of a plan node's ``approval: {request, envelope}`` (request defaults to the node
    id); ``PlanError(invalid_plan)`` for anything else, so a malformed gate is refused before anything runs."""
    if not isinstance(spec, Mapping) or not set(spec) <= {"request", "envelope"}:
        raise PlanError(
            "invalid_plan",
            f"node {node_id!r}: approval must be a mapping {{request: NAME, envelope: {{capabilities: [...]}}}}",
            node=node_id,
        )
    request = spec.get("request", node_id)
    try:
        return check_text(request, "plan_card", "the approval request"), Envelope.from_json(
            spec.get("envelope", {})
        )
    except SmthrsError as exc:
        raise PlanError(
            "invalid_plan", f"node {node_id!r}: approval: {exc.message}", cause=exc, node=node_id
        ) from exc


@dataclass(frozen=True)
class NodeGate:
    """The gate a plan run puts in front of nodes that declare ``approval:`` (``PlanScheduler(gate=...)``, wired by
    the runtime): asked before the node's attempt begins, it returns when the request is approved, raises
    ``RunParked`` (kind ``approval``) while it is pending and ``ApprovalDenied`` once denied (the node fails).

    Plain data (a database URL, the run id, the owner). The request's digest is the node's plan key: approving
    "deploy" approves THIS deploy, and re-keying the node asks again."""

    db_url: str
    run_id: str
    owner: OwnerId | None = None

    def __call__(self, node: Any) -> None:
        request, envelope = gate_spec(node.id, node.draft.approval)
        approvals = Approvals(open_database(self.db_url))
        state = approvals.register(self.run_id, request, digest=node.key, envelope=envelope, owner=self.owner)
        _gate(state, self.run_id, request)
