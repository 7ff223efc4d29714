"""Run ownership: claim → activate, heartbeat, release, and stealing from an owner on evidence.

- Exactly one incarnation (:class:`~smthrs_plugin.records.runs.OwnerId`) owns a ``running`` run; every durable write
  of it is fenced inside its transaction (:func:`assert_owner`, or a conditional UPDATE on the owner columns), so a
  process that lost the run gets ``FenceLost``.
- Claiming is two serialized transactions: the claim (:class:`ClaimLost` if another incarnation holds a fresh one),
  then activation (:class:`ActivationLost` unless the row still carries the claim's token). Of two racing claimants
  exactly one activates.
- A ``running`` row is taken over only on a :class:`Dead` verdict of the liveness check, asked only once the lease
  expired (docs/rules.md, "Constants"); :class:`Alive` refuses with :class:`StealRefusedOwnerAlive`, a fresh lease
  with :class:`HeartbeatFresh`. Refusals are journaled once (ARCHITECTURE.md, "engine").
- The liveness check runs OUTSIDE the write transaction; the steal then re-checks that the row is still exactly what
  was judged.
- Time comes from the injected clock; the stale window from Settings.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..._clock import SYSTEM_CLOCK, Clock
from ...errors import FenceLost, StoreError
from ...records.journal import Journal, addressed_seq
from ...records.runs import (
    ACTIVATE,
    ACTIVATE_UNADMITTED,
    CLEAR_CLAIM,
    CLEAR_OWNER,
    CLEAR_WAIT,
    HEARTBEAT,
    RESERVE,
    TERMINAL_STATUSES,
    FenceRow,
    OwnerId,
    assert_owner,
    bump_run,
    bump_run_observed,
    current_owner,
    fact_of,
    remember_observed,
)
from ...records.runs import row_in as _select_row
from ...settings import Settings, load_settings
from ...stores.database import Database
from ..facts import control_running_in
from .liveness import Alive, Dead, LeaseLiveness, LivenessCheck, LivenessContext, process_start_token

__all__ = [
    "OwnerId",
    "current_owner",
    "assert_owner",
    "FenceRow",
    "Ownership",
    "Activated",
    "Terminal",
    "HeartbeatFresh",
    "StealRefusedOwnerAlive",
    "ClaimLost",
    "ActivationLost",
    "ClaimDecision",
    "Heartbeat",
    "Released",
    "CLAIMABLE_STATUSES",
]

CLAIMABLE_STATUSES = frozenset({"pending", "suspended"})
_ARBITRATION_ROUNDS = 3


@dataclass(frozen=True)
class Activated:
    """The claimant now owns the running run. ``evidence``/``stolen_from`` are set when it was stolen."""

    kind: ClassVar[str] = "activated"
    run_id: str
    owner: OwnerId
    revision: int
    evidence: str | None = None
    stolen_from: OwnerId | None = None
    cancel_requested_at_ms: int | None = None


@dataclass(frozen=True)
class Terminal:
    """The run already settled (completed, failed or cancelled): nothing to claim."""

    kind: ClassVar[str] = "terminal"
    run_id: str
    status: str


@dataclass(frozen=True)
class HeartbeatFresh:
    """Another owner drives the run and its heartbeat is inside the stale window."""

    kind: ClassVar[str] = "heartbeat_fresh"
    run_id: str
    owner: OwnerId
    heartbeat_at_ms: int


@dataclass(frozen=True)
class StealRefusedOwnerAlive:
    """The heartbeat is stale but the liveness check vouched for the owner (``evidence``: lease-fresh|probe)."""

    kind: ClassVar[str] = "steal_refused_owner_alive"
    run_id: str
    owner: OwnerId
    lease: int
    evidence: str


@dataclass(frozen=True)
class ClaimLost:
    """Another claimant holds a fresh pending claim, or the row kept changing while being judged."""

    kind: ClassVar[str] = "claim_lost"
    run_id: str
    claimant: OwnerId | None
    reason: str


@dataclass(frozen=True)
class ActivationLost:
    """Our pending claim was gone at activation (fenced by recovery, or taken over after expiring)."""

    kind: ClassVar[str] = "activation_lost"
    run_id: str
    reason: str


ClaimDecision = Activated | Terminal | HeartbeatFresh | StealRefusedOwnerAlive | ClaimLost | ActivationLost


@dataclass(frozen=True)
class Heartbeat:
    """A committed heartbeat; ``cancel_requested_at_ms`` lets the heartbeat double as the cancellation poll."""

    run_id: str
    at_ms: int
    revision: int
    cancel_requested_at_ms: int | None


@dataclass(frozen=True)
class Released:
    """The run is suspended with waiting reason ``released`` and no owner: claimable at once."""

    run_id: str
    revision: int


@dataclass(frozen=True)
class _Reserved:
    token: str
    seen: Any  # the row's observed columns (records.runs.OBSERVED_COLUMNS) when reserved: activation expects them

    @property
    def status(self) -> str:
        return str(self.seen.status)

    @property
    def waiting_reason(self) -> str | None:
        return self.seen.waiting_reason  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Running:
    row: Any


class _Changed:
    """The row changed between judging and writing; judge again."""


_CHANGED = _Changed()


class Ownership:
    """Claims, heartbeats, releases and steals runs as one owner incarnation."""

    def __init__(
        self,
        db: Database,
        *,
        owner: OwnerId | None = None,
        journal: Journal | None = None,
        liveness: LivenessCheck | None = None,
        settings: Settings | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.db = db
        self.settings = settings or load_settings()
        self.owner = owner or current_owner(self.settings)
        self.clock = clock
        self.journal = journal or Journal(db, clock=clock)
        self.liveness: LivenessCheck = liveness or LeaseLiveness()
        self.stale_after_ms = int(self.settings.stale_after_s * 1000)
        self.skew_allowance_ms = int(self.settings.skew_allowance_s * 1000)
        # Recorded so a same-host probe can tell this process from a later one that recycled its pid.
        self._proc_start = process_start_token(self.owner.pid) if self.owner.pid == os.getpid() else None

    # -- claim / steal ---------------------------------------------------------------------------------------
    def claim(self, run_id: str) -> ClaimDecision:
        """Claim and activate ``run_id``; on a running row, arbitrate a takeover (see module invariants).

        Raises ``StoreError(not_found)`` for an unknown run."""
        for _ in range(_ARBITRATION_ROUNDS):
            # The common case (a pending or suspended run) reserves in the same transaction that reads the row;
            # a running row is judged outside any transaction (a liveness probe must not hold the write lock).
            step = self._reserve_write(run_id)
            if isinstance(step, _Reserved):
                return self._activate_write(run_id, step)
            decision = self._arbitrate(step.row) if isinstance(step, _Running) else step
            if not isinstance(decision, _Changed):
                return decision
        return ClaimLost(run_id, None, "the run row kept changing while it was being arbitrated; retry later")

    def steal(self, run_id: str) -> ClaimDecision:
        """Take over ``run_id`` from an owner believed gone (the stale sweep's entry point).

        The same arbitration as :meth:`claim`: a run that is not running is simply claimed."""
        return self.claim(run_id)

    def _arbitrate(self, row: Any) -> ClaimDecision | _Changed:
        recorded = OwnerId(row.owner_host, int(row.owner_pid), row.owner_nonce)
        if recorded == self.owner:
            return Activated(
                row.run_id, self.owner, int(row.revision), cancel_requested_at_ms=row.cancel_requested_at_ms
            )
        lease = int(row.heartbeat_at_ms or 0)
        ctx = LivenessContext(
            claimant=self.owner,
            heartbeat_at_ms=lease,
            now_ms=self.clock.now_ms(),
            stale_after_ms=self.stale_after_ms,
            skew_allowance_ms=self.skew_allowance_ms,
            owner_proc_start=row.owner_proc_start,
        )
        if not ctx.lease_expired:
            # Liveness is consulted only for a run whose lease has expired (no skew added): a fresh lease is the
            # owner's, whatever a probe would say. The refusal is still auditable, once per owner.
            self._journal_lease_fresh(row.run_id, recorded, lease)
            return HeartbeatFresh(row.run_id, recorded, lease)
        verdict = self.liveness.check(recorded, ctx)
        if isinstance(verdict, Dead):
            evidence = verdict.evidence
            return self.db.write(lambda c: self._steal(c, row, recorded, lease, evidence))
        assert isinstance(verdict, Alive)
        self.journal.append(
            row.run_id,
            "steal-refused-owner-alive",
            {"owner": recorded.to_json(), "lease": lease, "evidence": verdict.evidence},
            source_id=f"ownership/steal-refused/{recorded}/{lease}/{verdict.evidence}",
            source_seq=0,
        )
        return StealRefusedOwnerAlive(row.run_id, recorded, lease, verdict.evidence)

    def _journal_lease_fresh(self, run_id: str, recorded: OwnerId, lease: int) -> None:
        """``steal-refused-owner-alive {evidence: lease-fresh}`` for ``run_id`` held by ``recorded``, unless one is
        journaled already (see the module invariants: once per run and owner, not per lease)."""
        source_id = f"ownership/steal-refused/{recorded}/lease-fresh"
        # The address lookup answers NULL or the entry's sequence (a SELECT of a scalar subquery is one row).
        probe = sa.select(addressed_seq(run_id, source_id, 0))
        if self.db.read(lambda c: c.execute(probe).scalar()) is not None:
            return  # the common repeat: a read, no write transaction

        def write(conn: Connection) -> None:
            # Re-checked under the write lock: two claimers racing to the first refusal would otherwise collide on
            # the address with different leases (an idempotency conflict) instead of keeping the first record.
            if conn.execute(probe).scalar() is not None:
                return
            self.journal.append_in(
                conn,
                run_id,
                "steal-refused-owner-alive",
                {"owner": recorded.to_json(), "lease": lease, "evidence": "lease-fresh"},
                source_id=source_id,
                source_seq=0,
            )

        self.db.write(write)

    def _steal(self, conn: Connection, judged: Any, recorded: OwnerId, lease: int, evidence: str) -> Any:
        row = _select_row(conn, judged.run_id)
        if (
            row is None
            or row.status != "running"
            or (row.owner_host, row.owner_pid, row.owner_nonce)
            != (recorded.host_id, recorded.pid, recorded.nonce)
            or int(row.heartbeat_at_ms or 0) != lease
        ):
            return _CHANGED
        now = self.clock.now_ms()
        rev, fact = bump_run_observed(
            conn, self.db, row.run_id, {**self._owner_values(now), **CLEAR_CLAIM, "updated_at_ms": now}
        )
        self.journal.append_in(
            conn,
            row.run_id,
            "stolen-and-activated",
            {
                "from": recorded.to_json(),
                "to": self.owner.to_json(),
                "evidence": evidence,
                "lease": lease,
                "fact": fact,
            },
        )
        control_running_in(conn, self.journal, row.run_id)
        return Activated(row.run_id, self.owner, rev, evidence, recorded, row.cancel_requested_at_ms)

    def _reserve_write(self, run_id: str) -> _Reserved | _Running | ClaimDecision | _Changed:
        # The common case is one conditional UPDATE, a transaction of its own (one round trip on PostgreSQL): a
        # claimable row with no live foreign claim is reserved. Anything else (running, settled, missing, claimed
        # by someone else) matched nothing and wrote nothing, and is judged on the row it is in a new transaction.
        o = self.owner
        token = uuid.uuid4().hex
        now = self.clock.now_ms()
        reserved = RESERVE.write(
            self.db,
            {
                "b_run_id": run_id,
                "b_host": o.host_id,
                "b_pid": o.pid,
                "b_nonce": o.nonce,
                "b_token": token,
                "b_now": now,
                # The statement reclaims a claim at least ``b_stale`` old; a claim exactly ``stale_after`` old is
                # still fresh (the lease rule above), so the first reclaimable age is one millisecond later.
                "b_stale": self.stale_after_ms + 1,
            },
        )
        if reserved is not None:
            remember_observed(self.db, reserved)
            return _Reserved(token, reserved)
        return self.db.write(lambda c: self._reserve(c, run_id))

    def _reserve(self, conn: Connection, run_id: str) -> _Reserved | _Running | ClaimDecision | _Changed:
        row = _select_row(conn, run_id)
        if row is None:
            raise StoreError("not_found", f"run {run_id!r} does not exist; create it before claiming it")
        if row.status in TERMINAL_STATUSES:
            return Terminal(run_id, row.status)
        if row.status == "running":
            return _Running(row)
        if row.status not in CLAIMABLE_STATUSES:
            return _CHANGED
        now = self.clock.now_ms()
        mine = (row.claim_host, row.claim_pid, row.claim_nonce) == (
            self.owner.host_id,
            self.owner.pid,
            self.owner.nonce,
        )
        if row.claim_token is not None and not mine and now - int(row.claimed_at_ms) <= self.stale_after_ms:
            return ClaimLost(run_id, OwnerId(row.claim_host, int(row.claim_pid), row.claim_nonce), "claimed")
        token = uuid.uuid4().hex
        bump_run(
            conn,
            self.db,
            run_id,
            {
                "claim_host": self.owner.host_id,
                "claim_pid": self.owner.pid,
                "claim_nonce": self.owner.nonce,
                "claim_token": token,
                "claimed_at_ms": now,
                "updated_at_ms": now,
            },
        )
        return _Reserved(token, row)

    def _activate_write(self, run_id: str, reserved: _Reserved) -> ClaimDecision:
        # The one-statement path journals only ``run-activated``; a control-admitted run also needs its
        # ``control.run.running`` in the same transaction, so that statement matches only a run the control plane
        # did not admit (asked in the statement itself: no read first) and an admitted one takes the
        # multi-statement path.
        if self.db.dialect == "postgresql":
            done = self._activate_alone(run_id, reserved)
            if done is not None:
                return done
        return self.db.write(lambda c: self._activate(c, run_id, reserved))

    def _activate_alone(self, run_id: str, reserved: _Reserved) -> Activated | None:
        # PostgreSQL: activation, revision and journal record in ONE statement (one round trip). The record's
        # fact is computed from the row as reserved with the activation applied; the statement matches only if
        # the row still is exactly that (token, status, every observed column), so the fact is the true one.
        # None (nothing written) sends the caller down the multi-statement path below.
        now = self.clock.now_ms()
        seen = reserved.seen
        after = seen._replace(
            status="running",
            started_at_ms=now if seen.started_at_ms is None else seen.started_at_ms,
            waiting_reason=None,
            wake_at_ms=None,
            wait_token_digest=None,
        )
        record = self.journal.encode(
            run_id,
            "run-activated",
            self._activation_payload(reserved.status, reserved.waiting_reason, fact_of(after)),
        )
        done = ACTIVATE_UNADMITTED.write_journaled(
            self.db, self._activate_params(run_id, reserved, now), seen, record
        )
        if done is None:
            return None
        remember_observed(self.db, done)
        self.journal.written(record, int(done.seq))
        return Activated(
            run_id, self.owner, int(done.revision), cancel_requested_at_ms=done.cancel_requested_at_ms
        )

    def _activate_params(self, run_id: str, reserved: _Reserved, now: int) -> dict[str, Any]:
        o = self.owner
        return {
            "b_run_id": run_id,
            "b_token": reserved.token,
            "b_from_status": reserved.status,
            "b_from_reason": reserved.waiting_reason,
            "b_host": o.host_id,
            "b_pid": o.pid,
            "b_nonce": o.nonce,
            "b_proc_start": self._proc_start,
            "b_now": now,
        }

    def _activate(self, conn: Connection, run_id: str, reserved: _Reserved) -> ClaimDecision:
        # The common case in one statement: the row still carries our token AND the status and waiting reason
        # it had when reserved, so the journaled ``from_status``/``waiting_reason`` are exactly the reserved ones.
        # Any difference matched nothing, wrote nothing, and is judged below on the row as it is now.
        now = self.clock.now_ms()
        done = ACTIVATE.first(conn, self._activate_params(run_id, reserved, now))
        if done is not None:
            remember_observed(self.db, done)
            return self._activated(
                conn, run_id, reserved.status, reserved.waiting_reason, done, fact_of(done)
            )
        token = reserved.token
        row = _select_row(conn, run_id)
        if row is None:
            return ActivationLost(run_id, "the run was deleted between claim and activation")
        if row.status in TERMINAL_STATUSES:
            return Terminal(run_id, row.status)
        if row.claim_token != token or row.status not in CLAIMABLE_STATUSES:
            return ActivationLost(run_id, "the pending claim was cleared or superseded before activation")
        rev, fact = bump_run_observed(
            conn,
            self.db,
            run_id,
            {
                "status": "running",
                **self._owner_values(now),
                **CLEAR_CLAIM,
                **CLEAR_WAIT,
                "started_at_ms": row.started_at_ms if row.started_at_ms is not None else now,
                "updated_at_ms": now,
            },
        )
        return self._activated(conn, run_id, row.status, row.waiting_reason, row, fact, rev)

    def _activated(
        self,
        conn: Connection,
        run_id: str,
        from_status: str,
        waiting_reason: str | None,
        row: Any,
        fact: dict[str, Any],
        rev: int | None = None,
    ) -> Activated:
        payload = self._activation_payload(from_status, waiting_reason, fact)
        self.journal.append_in(conn, run_id, "run-activated", payload)
        control_running_in(conn, self.journal, run_id)
        revision = int(row.revision) if rev is None else rev
        return Activated(run_id, self.owner, revision, cancel_requested_at_ms=row.cancel_requested_at_ms)

    def _activation_payload(
        self, from_status: str, waiting_reason: str | None, fact: dict[str, Any]
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {"owner": self.owner.to_json(), "from_status": from_status}
        if waiting_reason is not None:
            payload["waiting_reason"] = waiting_reason
        payload["fact"] = fact
        return payload

    def _owner_values(self, now: int) -> dict[str, Any]:
        return {
            "owner_host": self.owner.host_id,
            "owner_pid": self.owner.pid,
            "owner_nonce": self.owner.nonce,
            "owner_proc_start": self._proc_start,
            "heartbeat_at_ms": now,
        }

    # -- while owning ------------------------------------------------------------------------------------------
    def heartbeat(self, run_id: str) -> Heartbeat:
        """Renew the lease of an owned run (fenced); raises ``FenceLost`` when the run was taken over."""
        now = self.clock.now_ms()
        o = self.owner
        args = {"b_run_id": run_id, "b_host": o.host_id, "b_pid": o.pid, "b_nonce": o.nonce, "b_now": now}
        # One fenced statement is the whole transaction (one round trip on PostgreSQL): the fence is the
        # UPDATE's own WHERE clause and the revision bump happens only when it matched.
        row = HEARTBEAT.write(self.db, args)
        if row is None:
            # Nothing was written; say who holds the run now (assert_owner raises FenceLost when it is not us).
            self.db.read(lambda c: assert_owner(c, run_id, self.owner))
            raise FenceLost("fence_lost", f"{self.owner} no longer owns run {run_id!r}", run_id=run_id)
        return Heartbeat(run_id, now, int(row.revision), row.cancel_requested_at_ms)

    def assert_owner(self, conn: Connection, run_id: str, *, terminal: bool = False) -> FenceRow:
        """:func:`assert_owner` for this owner (call inside a write transaction)."""
        return assert_owner(conn, run_id, self.owner, terminal=terminal)

    def release(self, run_id: str, *, cause: str = "shutdown") -> Released:
        """Give an owned run up: suspended, waiting reason ``released``, no owner (claimable at once). Fenced.

        Journals ``interrupt-released {cause}`` in the same transaction."""
        return self.db.write(lambda c: self._release(c, run_id, cause))

    def _release(self, conn: Connection, run_id: str, cause: str) -> Released:
        now = self.clock.now_ms()
        rev, fact = bump_run_observed(
            conn,
            self.db,
            run_id,
            {
                **CLEAR_OWNER,
                **CLEAR_WAIT,
                "waiting_reason": "released",
                "status": "suspended",
                "updated_at_ms": now,
            },
            owner=self.owner,
        )
        self.journal.append_in(
            conn,
            run_id,
            "interrupt-released",
            {"cause": cause, "owner": self.owner.to_json(), "fact": fact},
        )
        return Released(run_id, rev)
