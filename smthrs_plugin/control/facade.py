"""The control plane facade: ``plan``, ``run``, ``approve``, ``deny``, ``cancel``, ``resume``, ``signal``, ``list``,
``show``.

- Every mutation crosses the identity boundary first (``identity.Mutation``) and answers a receipt (``receipts.py``);
  ``plan`` answers a :class:`~smthrs_plugin._control_cards.PlanCard`. The statements on the control records are
  :mod:`smthrs_plugin.records.control`'s (their one owner).
- Other packages read the control plane only through the read methods here (ARCHITECTURE.md, "Control-plane
  records"), never through ``Control.db``.
- Only ``Accepted`` is recorded, with the mutation, in its one transaction; a same-key retry answers
  ``AlreadyApplied`` (same fingerprint) or ``Conflict`` (another); ``Parked`` is never recorded.
- Run admission commits BEFORE the launcher is called; a decision or a signal commits in ONE transaction with its
  receipt.
- The run's host is told (the injected ``waker``) only after the commit, and its failure never becomes a refusal:
  :meth:`Control.last_host_wake` says what the host answered.

Transactions in detail (receipts, plans, admission, decisions, signals): ARCHITECTURE.md ("The facade's
transactions").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from .._control_cards import (
    DEFAULT_SCOPE,
    Envelope,
    PlanApproval,
    PlanCard,
    check_envelope,
    check_plan_digest,
)
from ..canonical import canonical_bytes, sha256_hex
from ..engine.cancellation import cancel_run
from ..engine.context import DEFAULT_BUS
from ..engine.facts import append_control_lifecycle_in
from ..engine.ownership.liveness import LeaseLiveness, LivenessCheck
from ..engine.waits.flow_waits import HostWake, HostWaker, tell_host
from ..errors import ControlError, StoreError, passing_fault
from ..observe.catalog import RunFilters, RunPage, list_runs
from ..plan import Plan
from ..records import control as rc
from ..records.journal import Journal
from ..records.runs import (
    BASELINE_CREATED,
    TERMINAL_STATUSES,
    OwnerId,
    RunRow,
    RunStore,
    bump_run,
    current_owner,
)
from ..records.wait_rows import Existing
from ..records.waits import WaitStore
from ..scheduler.plans import PlanStore
from ..settings import Settings, load_settings
from ..stores.database import Database
from . import _planning as planning
from . import history
from . import launch as ln
from .approvals import WAITING_APPROVAL_REASON, Approvals, check_scope, state_of
from .authority import AuthorityRequest, NodeTarget, PlanTarget, Target, target_from_json
from .identity import JSON, LOCAL_OPERATOR, Mutation, Principal
from .receipts import Accepted, AlreadyApplied, Parked, Receipt, Terminal, decide_replay
from .views import RunView, view_in

__all__ = ["Control", "Launch", "AdmittedRun", "Launcher"]

Launch = ln.Launch
AdmittedRun = ln.AdmittedRun
Launcher = ln.Launcher

_AWAITING_APPROVAL = RunFilters(status="suspended", waiting_reason=WAITING_APPROVAL_REASON)


@dataclass(frozen=True)
class _Replay:
    row: rc.ReceiptRow


class Control:
    """The control plane over one database. ``owner`` is this process incarnation (it must be the owner the launcher's
    runtime claims with); ``authority`` decides who may approve (default: only ``local/operator``); ``liveness``
    judges an orphaned admission's claimant (default: the lease); ``waker`` tells a run's host that a decision,
    signal or cancellation changed the run (default: none — ``Runtime.control()`` passes the plugins');
    ``on_decided(**fact)`` observes each approval/denial after its commit (the ``smthrs_approval_decided`` hook's
    keywords; ``Runtime.control()`` passes the plugins' observers)."""

    def __init__(
        self,
        db: Database,
        *,
        owner: OwnerId | None = None,
        authority: Any = None,
        liveness: LivenessCheck | None = None,
        settings: Settings | None = None,
        journal: Journal | None = None,
        clock: Clock = SYSTEM_CLOCK,
        waker: HostWaker | None = None,
        on_decided: Callable[..., None] | None = None,
    ) -> None:
        self.db = db
        self.waker = waker
        self.on_decided = on_decided
        # Per calling thread: one Control serves all of `smthrs serve`'s request threads.
        self._woke = threading.local()
        self.settings = settings or load_settings()
        self.clock = clock
        self.owner = owner or current_owner(self.settings)
        self.journal = journal or Journal(db, clock=clock)
        self.runs = RunStore(db, journal=self.journal, clock=clock)
        self.waits = WaitStore(db, journal=self.journal, runs_store=self.runs, clock=clock)
        self.approvals = Approvals(
            db, journal=self.journal, waits=self.waits, authority=authority, clock=clock
        )
        self.plans = PlanStore(db, journal=self.journal, clock=clock)
        self.liveness: LivenessCheck = liveness or LeaseLiveness()

    # -- plan -----------------------------------------------------------------------------------------------------
    def plan(
        self,
        plan: Plan,
        *,
        input: Any = None,
        envelope: Envelope | Mapping[str, Any] | None = None,
        approval: bool = False,
        principal: Principal = LOCAL_OPERATOR,
        renew: bool = True,
    ) -> PlanCard:
        """The reviewable card of ``plan`` with ``input`` and ``envelope``; ``approval=True`` gates its launch.

        A retired current card (denied, or its ``once`` grant spent) is succeeded by a new card to review; with
        ``renew=False`` it is answered as is — the launch path (``smthrs run PLAN.yaml``), so a CI retry of a denied
        plan refuses (``plan_denied``) instead of quietly asking again."""
        plan, probe = planning.probe_card(plan, input, envelope, approval)
        token_id = rc.new_id("tok")

        def fn(conn: Connection) -> PlanCard:
            self.plans.record_in(conn, plan)
            current = rc.current_card_in(conn, probe.digest)
            if current is not None and (not renew or not planning.retired_in(conn, current)):
                return current.card
            seq = 0 if current is None else current.seq + 1
            return self._mint_in(conn, probe, plan.plan_id, seq, token_id, principal)

        return self.db.write(fn)

    def _mint_in(
        self, conn: Connection, probe: PlanCard, name: str, seq: int, token_id: str, principal: Principal
    ) -> PlanCard:
        return planning.mint_card_in(
            conn, self.journal, self.clock.now_ms(), probe, name, seq, token_id, principal
        )

    def card(self, plan_id: str) -> PlanCard:
        """The stored card ``plan_id`` (``plan_not_found`` otherwise)."""
        row = self.db.read(lambda c: rc.card_in(c, plan_id))
        if row is None:
            raise ControlError(
                "plan_not_found",
                f"no plan card {plan_id!r}; run `smthrs plan PLAN.yaml` first",
                plan_id=plan_id,
            )
        return row.card

    # -- run ---------------------------------------------------------------------------------------------------
    def run(
        self,
        launch: Launch | PlanCard,
        *,
        idempotency_key: str,
        principal: Principal = LOCAL_OPERATOR,
        launcher: Launcher | None = None,
    ) -> Receipt:
        """Admit and launch a run of a plan card (see the module invariants). Without ``launcher`` the run is only
        admitted (``pending``): a later same-key call with a launcher drives it."""
        target = Launch.of(launch) if isinstance(launch, PlanCard) else launch
        m = Mutation("run", idempotency_key, target.fingerprint_body(), principal)
        replay = self.db.read(lambda c: rc.receipt_in(c, m.durable_key))
        if replay is not None:
            return self._replayed(m, replay, launcher)
        card = self.db.read(lambda c: rc.card_in(c, target.plan_id))
        if card is None:
            raise ControlError(
                "plan_not_found",
                f"no plan card {target.plan_id!r}; run `smthrs plan PLAN.yaml` and launch the card it prints",
                plan_id=target.plan_id,
            )
        check_plan_digest(card.card.digest, target.digest)
        check_envelope(card.card.envelope, target.envelope)
        run_id = f"{card.plan_name[:64]}-{rc.new_id('r')[2:14]}"
        ids = (rc.new_id("rcpt"), rc.new_id("claim"))

        def fn(conn: Connection) -> Receipt | _Replay:
            again = rc.receipt_in(conn, m.durable_key)
            if again is not None:
                return _Replay(again)  # a concurrent same-key call admitted it first
            gate = self._gate_in(conn, card)
            if not isinstance(gate, tuple):
                return gate
            return self._admit_in(conn, m, card, run_id, ids, gate, handed_off=launcher is not None)

        out = self.db.write(fn)
        if isinstance(out, _Replay):
            return self._replayed(m, out.row, launcher)
        if isinstance(out, Accepted) and launcher is not None:
            self._launch(run_id, launcher)
        return out

    def _gate_in(self, conn: Connection, card: rc.CardRow) -> tuple[str | None, str | None] | Parked:
        """``(token id, grant id)`` when the card may launch now; ``Parked`` while its approval is undecided (or
        its ``once`` grant is spent: a fresh card is minted to review); ``plan_denied`` after a denial."""
        if not card.gated:
            return (None, None)
        token = rc.plan_token_in(conn, card.plan_id)
        if token is None:
            raise ControlError(
                "plan_not_found", f"plan card {card.plan_id!r} lost its approval token; plan again"
            )
        decision = rc.decision_in(conn, token.token_id)
        if decision is None:
            return Parked(card.plan_id)
        if decision.decision == "denied":
            raise ControlError(
                "plan_denied",
                f"plan {card.plan_id!r} was denied by {decision.principal}; a denied plan never launches — change "
                "the plan (or its input) and plan it again for a new review",
                plan_id=card.plan_id,
            )
        grant_id = decision.via_grant_id or decision.grant_id
        grant = rc.grant_in(conn, grant_id) if grant_id else None
        if grant is not None and grant.scope == "once" and grant.used_at_ms is not None:
            # Spent: the content needs a new review. Mint the successor card unless one exists already.
            current = rc.current_card_in(conn, card.card.digest)
            assert current is not None
            if current.seq > card.seq:
                return Parked(current.plan_id)
            fresh = self._mint_in(
                conn, card.card, card.plan_name, card.seq + 1, rc.new_id("tok"), LOCAL_OPERATOR
            )
            return Parked(fresh.plan_id)
        return (token.token_id, grant_id)

    def _admit_in(
        self,
        conn: Connection,
        m: Mutation,
        card: rc.CardRow,
        run_id: str,
        ids: tuple[str, str],
        gate: tuple[str | None, str | None],
        *,
        handed_off: bool,
    ) -> Accepted:
        receipt_id, claim_token = ids
        token_id, grant_id = gate
        now = self.clock.now_ms()
        if grant_id is not None:
            grant = rc.grant_in(conn, grant_id)
            # _gate_in read the grant unused in this same serialized transaction: the compare-and-set cannot lose.
            if (
                grant is not None
                and grant.scope == "once"
                and not rc.use_grant_in(conn, grant_id, run_id, now)
            ):
                raise StoreError(
                    "store_failed", f"internal: the once-grant {grant_id!r} changed inside its transaction"
                )
        self.runs.create(run_id, card.card.flow_id)
        bump_run(conn, self.db, run_id, ln.claim_holder(self.owner, claim_token, now))
        assert m.principal is not None
        rc.insert_admission_in(
            conn,
            rc.AdmissionRow(run_id, card.plan_id, card.card.digest, m.durable_key, m.principal, now, token_id,
                            grant_id),
        )  # fmt: skip
        receipt = Accepted(receipt_id, run_id)
        rc.insert_receipt_in(conn, m.durable_key, m.operation, m.fingerprint, receipt, now)
        append_control_lifecycle_in(
            conn,
            self.journal,
            run_id,
            "control.run.accepted",
            {"planId": card.plan_id, "digest": card.card.digest, "principal": dict(m.principal.to_json()),
             "receiptId": receipt_id},
            baseline=BASELINE_CREATED,
        )  # fmt: skip
        if not handed_off:
            # No executor takes this launch: the run waits ``pending`` for a later same-key call with a launcher.
            append_control_lifecycle_in(
                conn, self.journal, run_id, "control.run.pending", {"receiptId": receipt_id},
                baseline=BASELINE_CREATED,
            )  # fmt: skip
        return receipt

    def _replayed(self, m: Mutation, row: rc.ReceiptRow, launcher: Launcher | None) -> Receipt:
        answer = decide_replay(row.fingerprint, m.fingerprint, row.receipt, operation=m.operation)
        if isinstance(answer, AlreadyApplied) and answer.run_id is not None and launcher is not None:
            self._relaunch(answer.run_id, launcher)
        return answer

    # -- launching ----------------------------------------------------------------------------------------------
    def admitted(self, run_id: str) -> AdmittedRun:
        """The admitted run ``run_id`` with its card and compiled plan (``run_not_found`` for a run this plane did
        not admit)."""

        def fn(conn: Connection) -> AdmittedRun:
            adm = rc.admission_in(conn, run_id)
            card = None if adm is None else rc.card_in(conn, adm.plan_id)
            if adm is None or card is None:
                raise ControlError(
                    "run_not_found", f"run {run_id!r} was not admitted by the control plane", run_id=run_id
                )
            plan = self.plans.load_in(conn, card.plan_name, card.plan_digest)
            if plan is None:
                raise ControlError(
                    "run_not_found",
                    f"the plan of run {run_id!r} ({card.plan_name} {card.plan_digest}) is not stored; the stores are "
                    "inconsistent — restore them from a backup",
                    run_id=run_id,
                )
            return AdmittedRun(run_id, card.card, plan, adm)

        return self.db.read(fn)

    def _launch(self, run_id: str, launcher: Launcher) -> None:
        run = self.admitted(run_id)
        try:
            launcher.launch(run)
        except Exception as exc:
            fault = passing_fault(exc)
            if fault is not None:  # never the run's failure: the same key drives it again (launch.py)
                stopped = ln.leave_resumable(self.waits, run_id, self.owner, exc, fault, self.clock.now_ms())
                raise stopped from exc
            error = {"error": type(exc).__name__, "message": getattr(exc, "message", str(exc))}
            refused = self.db.write(
                lambda c: ln.fail_refused_in(c, self.waits, run_id, self.owner, error, self.clock.now_ms())
            )
            if refused:
                return
            row = self.run_row(run_id)
            if row is not None and row.status == "cancelled":
                return  # cancelled between admission and activation: nothing was refused, nothing to report
            raise  # the run was activated: its failure belongs to its own lifecycle, which recorded it

    def _relaunch(self, run_id: str, launcher: Launcher) -> None:
        """Drive an admitted run again when nobody does (see the module invariants); otherwise leave it."""
        row = self.run_row(run_id)
        if row is None or row.status in TERMINAL_STATUSES:
            return
        if row.status == "suspended":
            due = (
                row.waiting_reason == "timer"
                and row.wake_at_ms is not None
                and row.wake_at_ms <= self.clock.now_ms()
            )
            if row.waiting_reason != "released" and not due:
                return  # parked on an approval or an event: a decision or a completion wakes it
        evidence = ln.judge_claim(
            row,
            self.owner,
            self.liveness,
            now_ms=self.clock.now_ms(),
            stale_after_ms=int(self.settings.stale_after_s * 1000),
            skew_allowance_ms=int(self.settings.skew_allowance_s * 1000),
        )
        if row.status == "pending" and row.claim is not None and row.claim != self.owner:
            if evidence is None:
                return  # a live admitter keeps its run
            if not self.db.write(
                lambda c: ln.reclaim_in(c, self.db, self.journal, row, evidence, self.clock.now_ms())
            ):
                return  # the claim moved while we judged it: someone else has the run
        self._launch(run_id, launcher)

    # -- decisions ------------------------------------------------------------------------------------------------
    def approve(
        self,
        target: Target | PlanApproval | Mapping[str, Any],
        *,
        scope: str | None = None,
        idempotency_key: str | None = None,
        principal: Principal = LOCAL_OPERATOR,
    ) -> Receipt:
        """Approve a plan card or a node request (see the module invariants); ``scope`` once|run|remembered."""
        if isinstance(target, PlanApproval):
            scope = target.scope if scope is None else scope
            idempotency_key = target.idempotency_key if idempotency_key is None else idempotency_key
            target = PlanTarget(target.plan_id, target.digest, target.envelope)
        return self._decide(
            "approve", target, DEFAULT_SCOPE if scope is None else scope, idempotency_key, principal
        )

    def deny(
        self,
        target: Target | PlanApproval | Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        principal: Principal = LOCAL_OPERATOR,
    ) -> Receipt:
        """Deny a plan card (it never launches) or a node request (the node fails with ``ApprovalDenied``)."""
        if isinstance(target, PlanApproval):
            target = PlanTarget(target.plan_id, target.digest, target.envelope)
        return self._decide("deny", target, None, idempotency_key, principal)

    def approval_target(
        self, ident: str, request: str | None = None, digest: str | None = None
    ) -> PlanTarget | NodeTarget:
        """The approval target an operator names (``smthrs approve IDENT [--request R] [--digest D]``, the ``approve``
        method of ``smthrs serve``): the plan card ``ident``, or the node request ``request`` of run ``ident``
        (without ``request``: the run's single pending one). ``digest`` defaults to the one on record.
        ``plan_not_found`` for an unknown ident or request, ``invalid_options`` when several requests are pending."""
        if request is None:
            try:
                card = self.card(ident)
            except ControlError as exc:
                if exc.code != "plan_not_found":
                    raise
            else:
                return PlanTarget(card.plan_id, digest or card.digest, card.envelope)
            try:
                view = self.show(ident)
            except ControlError as exc:
                if exc.code != "run_not_found":
                    raise
                raise ControlError(
                    "plan_not_found",
                    f"{ident!r} is neither a plan card nor a run; `smthrs plan PLAN.yaml` (or the `plan` method of "
                    "smthrs serve) prints the plan id",
                    plan_id=ident,
                ) from None
            names = [r.request_id for r in view.pending]
            if len(names) != 1:
                raise ControlError(
                    "plan_not_found" if not names else "invalid_options",
                    f"run {ident!r} has {len(names)} pending approval requests {names}; name one with --request "
                    "(the request param)",
                    run_id=ident,
                )
            request = names[0]
        for r in self.show(ident).requests:
            if r.request_id == request:
                return NodeTarget(ident, request, digest or r.digest, Envelope.from_json(r.envelope))
        raise ControlError(
            "plan_not_found",
            f"run {ident!r} has not asked for approval {request!r}; `smthrs show {ident}` lists its requests",
            run_id=ident,
            request_id=request,
        )

    def last_host_wake(self) -> HostWake | None:
        """What the run's host answered when this thread's last approve/deny/signal/cancel on this plane told it
        (``HostWoken | HostNotParked | HostWakeFailed``); ``None`` when no host was told (no waker, a plan target,
        a refusal, a settled run)."""
        return getattr(self._woke, "outcome", None)

    def _tell_host(self, run_id: str) -> None:
        self._woke.outcome = tell_host(self.waker, run_id, self.journal)

    def _decide(
        self,
        action: Literal["approve", "deny"],
        target: Any,
        scope: str | None,
        idempotency_key: str | None,
        principal: Principal,
    ) -> Receipt:
        self._woke.outcome = None
        tgt: Target = target if isinstance(target, (PlanTarget, NodeTarget)) else target_from_json(target)
        body: dict[str, JSON] = {"target": tgt.to_json()}
        if scope is not None:
            body["scope"] = scope
        # A derived key names the intent; an explicit one (even an empty, refused one) is the caller's.
        key = _derived_key(action, tgt) if idempotency_key is None else idempotency_key
        m = Mutation(action, key, body, principal)
        if scope is not None:
            # A malformed scope is refused input (invalid_input/grant_scope, exit 2) BEFORE the authority judges
            # it: an authority asked about a scope that does not exist would answer "unauthorized".
            check_scope(scope)
        self.approvals.authorize(AuthorityRequest(principal, action, tgt.kind, tgt.name, scope))
        if isinstance(tgt, NodeTarget):
            settled = self._terminal(tgt.run_id)
            if settled is not None:
                return settled
        replay = self.db.read(lambda c: rc.receipt_in(c, m.durable_key))
        if replay is not None:
            return self._told(
                tgt, decide_replay(replay.fingerprint, m.fingerprint, replay.receipt, operation=action)
            )
        receipt_id = rc.new_id("rcpt")

        def fn(conn: Connection) -> Receipt | _Replay:
            again = rc.receipt_in(conn, m.durable_key)
            if again is not None:
                return _Replay(again)
            if isinstance(tgt, NodeTarget):
                row = ln.run_row_in(conn, tgt.run_id)
                if row is not None and row.status in TERMINAL_STATUSES:
                    return Terminal(tgt.run_id, row.status)
            token, decision = self.approvals.decide_in(conn, action, tgt, principal, scope)
            decided.append((token, decision))
            receipt = Accepted(receipt_id, token.run_id)
            rc.insert_receipt_in(conn, m.durable_key, action, m.fingerprint, receipt, self.clock.now_ms())
            return receipt

        decided: list[tuple[rc.TokenRow, rc.DecisionRow]] = []
        out = self.db.write(fn)
        if isinstance(out, _Replay):
            return self._told(
                tgt, decide_replay(out.row.fingerprint, m.fingerprint, out.row.receipt, operation=action)
            )
        if isinstance(out, Accepted) and decided and self.on_decided is not None:
            token, decision = decided[-1]  # the committed attempt (a serialization retry re-ran fn)
            # After the commit, once: observers (Prefect events) report a durable fact and never change it.
            self.on_decided(
                run_id=token.run_id, plan_id=token.plan_id, flow=token.flow_id, request_id=token.request_id,
                token_id=token.token_id, digest=token.digest, envelope=dict(token.envelope.to_json()),
                decision=decision.decision, principal=str(decision.principal), scope=decision.scope,
            )  # fmt: skip
        return self._told(tgt, out)

    def _told(self, target: Target, receipt: Receipt) -> Receipt:
        """After the commit: a node decision applied (or replayed: a retry re-asks a host it could not reach)
        tells the run's host; a plan decision has no run yet."""
        if isinstance(target, NodeTarget) and isinstance(receipt, (Accepted, AlreadyApplied)):
            self._tell_host(target.run_id)
        return receipt

    def _terminal(self, run_id: str) -> Terminal | None:
        row = self.run_row(run_id)
        if row is None:
            raise ControlError("run_not_found", f"run {run_id!r} does not exist", run_id=run_id)
        if row.status == "suspended" and self._host_ended(run_id):
            row = self.run_row(run_id) or row
        return Terminal(run_id, row.status) if row.status in TERMINAL_STATUSES else None

    def _host_ended(self, run_id: str) -> bool:
        """Before deciding on a parked run: its host may have ended it where no process could tell us (a Prefect
        deployment flow run cancelled in the UI). The waker's optional ``ended(run_id, journal)`` settles the run
        and says why (``last_host_wake``); True when it did."""
        ended = getattr(self.waker, "ended", None)
        outcome = None if ended is None else ended(run_id, self.journal)
        if outcome is not None:
            self._woke.outcome = outcome
        return outcome is not None

    def pending_requests(self, run_id: str) -> list[NodeTarget]:
        """The node requests of ``run_id`` still waiting for a decision, in registration order."""
        tokens = self.node_requests(run_id)
        return [NodeTarget(run_id, str(t.request_id), t.digest, t.envelope) for t, d in tokens if d is None]

    # -- cancel / resume ---------------------------------------------------------------------------------------------
    def cancel(
        self, run_id: str, *, principal: Principal = LOCAL_OPERATOR, reason: str | None = None
    ) -> Receipt:
        """Cancel a run and its live descendants. Never replays: a second ask reads the run again (``Terminal`` once
        it settled). A parked or pending run settles ``cancelled`` at once; a running one at its owner's next
        heartbeat."""
        self._woke.outcome = None
        body: dict[str, JSON] = {"runId": run_id}
        if reason is not None:
            body["reason"] = reason
        m = Mutation("cancel", f"cancel:{run_id}", body, principal)  # the boundary (bounds), not a replay key
        settled = self._terminal(run_id)
        if settled is not None:
            return settled
        assert m.principal is not None
        actor = m.principal

        def fn(conn: Connection) -> Receipt:
            row = ln.run_row_in(conn, run_id)
            if row is None:
                raise ControlError("run_not_found", f"run {run_id!r} does not exist", run_id=run_id)
            if row.status in TERMINAL_STATUSES:
                return Terminal(run_id, row.status)
            report = cancel_run(self.runs, run_id)
            now = self.clock.now_ms()
            payload: dict[str, Any] = {"principal": dict(actor.to_json())}
            if reason is not None:
                payload["reason"] = reason
            append_control_lifecycle_in(conn, self.journal, run_id, "control.run.cancel-requested", payload)
            for rid in (run_id, *(o.run_id for o in report.descendants)):
                ln.cancel_unowned_in(conn, self.waits, rid, now, now)
            requested = getattr(report.root, "requested_at_ms", now)
            return Accepted(f"cancel:{run_id}:{requested}", run_id)

        out = self.db.write(fn)
        if isinstance(out, Accepted):
            self._tell_host(run_id)  # a host holding the parked run executes it again, and finds it cancelled
        return out

    def resume(
        self,
        run_id: str,
        *,
        idempotency_key: str,
        principal: Principal = LOCAL_OPERATOR,
        reason: str | None = None,
        launcher: Launcher | None = None,
    ) -> Receipt:
        """Drive a run again now: ``Terminal`` for a settled run (read before the replay), ``Parked`` while it waits
        for a node approval, else ``Accepted`` (recorded, ``control.run.resume``) / ``AlreadyApplied``, and the run
        is re-launched when nobody drives it."""
        body: dict[str, JSON] = {"runId": run_id}
        if reason is not None:
            body["reason"] = reason
        m = Mutation("resume", idempotency_key, body, principal)
        settled = self._terminal(run_id)
        if settled is not None:
            return settled
        replay = self.db.read(lambda c: rc.receipt_in(c, m.durable_key))
        if replay is not None:
            return self._replayed(m, replay, launcher)
        receipt_id = rc.new_id("rcpt")
        assert m.principal is not None
        actor = m.principal

        def fn(conn: Connection) -> Receipt | _Replay:
            again = rc.receipt_in(conn, m.durable_key)
            if again is not None:
                return _Replay(again)
            row = ln.run_row_in(conn, run_id)
            assert row is not None
            if row.status in TERMINAL_STATUSES:
                return Terminal(run_id, row.status)
            adm = rc.admission_in(conn, run_id)
            if adm is None and launcher is not None:
                # Refused before anything is written: this plane cannot drive what it did not launch.
                raise ControlError(
                    "run_not_found",
                    f"run {run_id!r} (flow {row.flow!r}) was not launched by the control plane, so a plan resume "
                    f"cannot drive it: give the flow's code — `smthrs resume {run_id} --key K --flow MODULE:FLOW` "
                    f"or `smthrs worker --flow MODULE:FLOW --run {run_id}` (a Prefect @flow, or "
                    "NAME=MODULE:FUNCTION)",
                    run_id=run_id,
                )
            if row.status == "suspended" and row.waiting_reason == WAITING_APPROVAL_REASON:
                return Parked(adm.plan_id if adm is not None else run_id)
            receipt = Accepted(receipt_id, run_id)
            rc.insert_receipt_in(conn, m.durable_key, "resume", m.fingerprint, receipt, self.clock.now_ms())
            payload: dict[str, Any] = {"principal": dict(actor.to_json()), "receiptId": receipt_id}
            if reason is not None:
                payload["reason"] = reason
            append_control_lifecycle_in(conn, self.journal, run_id, "control.run.resume", payload)
            return receipt

        out = self.db.write(fn)
        if isinstance(out, _Replay):
            return self._replayed(m, out.row, launcher)
        if isinstance(out, Accepted) and launcher is not None:
            self._relaunch(run_id, launcher)
        return out

    # -- signal --------------------------------------------------------------------------------------------------------
    def signal(
        self,
        run_id: str,
        name: str,
        value: Any,
        *,
        idempotency_key: str | None = None,
        principal: Principal = LOCAL_OPERATOR,
    ) -> Receipt:
        """Deliver ``value`` (plain JSON) to the deferred ``name`` of run ``run_id`` — what ``sp.wait_for(name)``
        returns there — waking the run when it is parked on it (see the module invariants).

        ``Accepted`` (recorded) / ``AlreadyApplied`` for a same-key retry of the same signal / ``Conflict`` for the
        same key with another run, name or value / ``Terminal`` for a settled run. Without ``idempotency_key`` the
        key is ``signal:<run>:<name>``: a deferred completes once, so that key means one value. Refusals, before
        anything is written: over-bound input (``invalid_input``), an unknown run (``run_not_found``), a deferred
        already completed by another call (``already_resolved``)."""
        self._woke.outcome = None
        _check_wait_name("run_id", run_id)
        _check_wait_name("name", name)
        key = _hashed_key(f"signal:{run_id}:{name}") if idempotency_key is None else idempotency_key
        m = Mutation("signal", key, {"runId": run_id, "name": name, "value": value}, principal)
        assert m.principal is not None and type(m.input) is dict
        actor = m.principal
        decoded = m.input["value"]  # the bounded copy: the caller's object is never read again
        if (row := self.run_row(run_id)) is not None and row.status == "suspended":
            self._host_ended(run_id)  # a run its host ended answers Terminal below
        replay = self.db.read(lambda c: rc.receipt_in(c, m.durable_key))
        if replay is not None:
            return self._signalled(
                run_id, decide_replay(replay.fingerprint, m.fingerprint, replay.receipt, operation="signal")
            )
        receipt_id = rc.new_id("rcpt")

        def fn(conn: Connection) -> Receipt | _Replay:
            again = rc.receipt_in(conn, m.durable_key)
            if again is not None:
                return _Replay(again)
            row = ln.run_row_in(conn, run_id)
            if row is None:
                raise ControlError(
                    "run_not_found",
                    f"run {run_id!r} does not exist; a signal answers a wait of an existing run (smthrs runs lists "
                    "them)",
                    run_id=run_id,
                )
            if row.status in TERMINAL_STATUSES:
                return Terminal(run_id, row.status)
            done = self.waits.complete_deferred(run_id, name, decoded, wake=False)
            if isinstance(done, Existing):
                # First writer wins: this call delivered nothing, so it records nothing (the raise rolls back).
                raise ControlError(
                    "already_resolved",
                    f"the wait {name!r} of run {run_id!r} was already answered (at {done.record.completed_at_ms} "
                    "epoch ms) by another signal or sp.complete; a wait is answered once — repeat the original "
                    "signal unchanged to read its receipt",
                    run_id=run_id,
                    name=name,
                )
            self.journal.append_in(
                conn,
                run_id,
                "control.signal.delivered",
                {"name": name, "principal": dict(actor.to_json()), "receiptId": receipt_id,
                 "valueDigest": "sha256:" + sha256_hex(canonical_bytes(decoded))},
            )  # fmt: skip
            # After the delivery record, in the same transaction: a parked run cannot miss its answer.
            self.waits.wake_for_deferred(run_id, name)
            receipt = Accepted(receipt_id, run_id)
            rc.insert_receipt_in(conn, m.durable_key, "signal", m.fingerprint, receipt, self.clock.now_ms())
            return receipt

        out = self.db.write(fn)
        if isinstance(out, _Replay):
            return self._signalled(
                run_id, decide_replay(out.row.fingerprint, m.fingerprint, out.row.receipt, operation="signal")
            )
        if isinstance(out, Accepted):
            DEFAULT_BUS.wake(run_id)  # after the commit: an in-process sp.wait_for returns at once
        return self._signalled(run_id, out)

    def _signalled(self, run_id: str, receipt: Receipt) -> Receipt:
        if isinstance(receipt, (Accepted, AlreadyApplied)):
            self._tell_host(run_id)  # after the commit; a retry re-asks a host it could not reach
        return receipt

    # -- reads -----------------------------------------------------------------------------------------------------
    def show(self, run_id: str) -> RunView:
        """One run with its approval facts and node requests (``run_not_found`` when absent)."""
        view = self.db.read(lambda c: view_in(c, run_id))
        if view is None:
            raise ControlError("run_not_found", f"run {run_id!r} does not exist", run_id=run_id)
        return view

    def list(
        self,
        *,
        status: str | None = None,
        flow: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> RunPage:
        """A page of runs in creation order (the run catalog, ``observe.catalog.list_runs``)."""
        return list_runs(self.db, RunFilters(status=status, flow=flow), cursor=cursor, limit=limit)

    def run_row(self, run_id: str) -> RunRow | None:
        """The row of run ``run_id`` as stored now (status, waiting reason, owner and lease, claim), or None."""
        return self.db.read(lambda c: ln.run_row_in(c, run_id))

    def node_requests(self, run_id: str) -> Sequence[tuple[rc.TokenRow, rc.DecisionRow | None]]:
        """Every node approval request of ``run_id`` with its decision (None while undecided), in registration
        order."""
        return self.db.read(lambda c: rc.run_tokens_in(c, run_id))

    def runs_awaiting_approval(self, *, cursor: str | None = None, limit: int = 100) -> RunPage:
        """A page of the runs parked ``waiting-approval`` (suspended until a node request is decided), in creation
        order."""
        return list_runs(self.db, _AWAITING_APPROVAL, cursor=cursor, limit=limit)

    def undecided_cards(self, limit: int) -> Sequence[rc.CardRow]:
        """Up to ``limit`` stored cards whose plan approval is required and not decided yet, oldest first."""
        return self.db.read(lambda c: rc.undecided_plan_cards_in(c, limit))

    def last_approved_card(self, plan_name: str, other_than_digest: str) -> rc.CardRow | None:
        """The most recently approved card of the plan ``plan_name`` whose card digest is not
        ``other_than_digest`` (what a reviewer compares a new card with), or None."""
        return self.db.read(lambda c: rc.last_approved_card_in(c, plan_name, other_than_digest))

    def review_card(self, plan_id: str) -> tuple[rc.CardRow, Plan]:
        """The stored card ``plan_id`` and the compiled plan it pins, read together (what a reviewer is shown).
        ``plan_not_found`` for an unknown card, or when its compiled plan is not stored."""

        def fn(conn: Connection) -> tuple[rc.CardRow, Plan]:
            row = rc.card_in(conn, plan_id)
            if row is None:
                raise ControlError(
                    "plan_not_found",
                    f"no plan card {plan_id!r}; run `smthrs plan PLAN.yaml` first",
                    plan_id=plan_id,
                )
            plan = self.plans.load_in(conn, row.plan_name, row.plan_digest)
            if plan is None:
                raise ControlError(
                    "plan_not_found",
                    f"the compiled plan of card {plan_id!r} ({row.plan_name} {row.plan_digest}) is not stored; the "
                    "stores are inconsistent — restore them from a backup",
                    plan_id=plan_id,
                )
            return row, plan

        return self.db.read(fn)

    def plan_state(self, plan_id: str) -> Any:
        """The approval state of a card: ``None`` (no approval needed), ``PendingApproval``, ``Approved`` or ``Denied``."""

        def fn(conn: Connection) -> Any:
            if rc.card_in(conn, plan_id) is None:
                raise ControlError("plan_not_found", f"no plan card {plan_id!r}", plan_id=plan_id)
            token = rc.plan_token_in(conn, plan_id)
            return None if token is None else state_of(token, rc.decision_in(conn, token.token_id))

        return self.db.read(fn)

    def card_decision(self, plan_id: str) -> history.Decision | None:
        """Who decided card ``plan_id``'s approval, when, with which scope and receipt (``control/history.py``);
        None when its launch needs no approval."""
        return self.db.read(lambda c: history.card_decision_in(c, plan_id, _derived_key))

    def run_history(self, run_id: str, limit: int = history.MAX_RUN_DECISIONS) -> history.RunHistory:
        """Run ``run_id`` with its admission, the decisions that let it go on (newest ``limit`` node decisions)
        and its Prefect flow run (``run_not_found`` when absent)."""
        found = self.db.read(lambda c: history.run_history_in(c, run_id, _derived_key, limit))
        if found is None:
            raise ControlError("run_not_found", f"run {run_id!r} does not exist", run_id=run_id)
        return found

    def approvers(self, kind: Literal["Plan", "Node"]) -> tuple[str, ...] | None:
        """Who this plane's approval authority lets decide ``kind`` targets (None: a plugin's authority, which
        decides per request and cannot be listed)."""
        return history.approvers_of(self.approvals.authority, kind)


def _derived_key(action: str, target: Target) -> str:
    """``<action>:<target>:<digest>``, hashed when it would exceed the 1,024-character key bound."""
    return _hashed_key(f"{action}:{target.name}:{target.digest}")


def _check_wait_name(option: str, value: object) -> None:
    """A run id or wait name has the shape of a wait name (engine/waits/flow_waits.py): refused here as caller input
    (exit 2), not later as a store argument."""
    if type(value) is not str or not 1 <= len(value) <= 1024 or "\x00" in value:
        shown = f"a str of {len(value):,} characters" if type(value) is str else f"a {type(value).__name__}"
        raise ControlError(
            "invalid_options",
            f"{option} must be a str of 1 to 1,024 characters without NUL, got {shown}; name the run and the wait "
            "exactly as the flow does (sp.wait_for(NAME))",
            option=option,
        )


def _hashed_key(key: str) -> str:
    """``key``, or ``<operation>:sha256-<hex>`` of it when it would exceed the 1,024-character key bound."""
    action = key.partition(":")[0]
    return key if len(key) <= 1024 else f"{action}:sha256-{sha256_hex(key.encode('utf-8'))}"
