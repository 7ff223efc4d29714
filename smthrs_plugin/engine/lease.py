"""The run lease: the ONE way this package runs a run — claim it through the ownership arbiter, hold it (heartbeat +
cancellation poll), and end it in exactly one durable transition.

Every path that runs a run takes a lease here: the run driver, a scheduler pass that drives its own run
(``drive/pass_lifecycle.py``), a Prefect flow run (direct and deployment) and a standalone ``@step`` call. Nothing
else calls ``Ownership.claim`` or starts a heartbeat.

Invariants:

- **Claim.** :func:`acquire` claims through :meth:`Ownership.claim` (so steals happen on evidence only) and
  answers a held :class:`RunLease` or :class:`Refused` naming the refusing decision; a :class:`LeasePolicy` says
  which run is claimed and what a refusal turns into (``EXISTING``, ``NAMED``, ``FRESH``, ``RETRY_SUFFIX``,
  :func:`chain_on_failure`). With ``metrics``, every claim decision is counted (the run driver's). A run the
  lease creates is created, reserved and activated in ONE transaction: a failed activation leaves no pending row
  behind, and nobody else can claim the new row in between; a run that existed already is claimed after that
  transaction (judging a running row may probe its owner, which must not hold the write lock).
- **Hold.** From activation until it concludes, the lease renews itself every heartbeat interval; the beat is
  also the cancellation poll. The run's context is interrupted — the flow's next wait raises — when a cancel is
  requested (``cancelled``), the fence is lost (``fence_lost``) or the heartbeat keeps failing
  (``heartbeat_failing``); see ``_lease_run.py``.
- **Conclude once.** :meth:`RunLease.conclude` maps what the code did to one transition (settle, park, release, or
  nothing when another owner holds the run) and answers the same outcome if asked again, writing nothing more.
  A caller with its own mapping stops the heartbeat and calls ONE primitive (``settle``/``park``/``release``).
- ``with lease:`` guarantees the heartbeat never outlives the block; leaving it writes nothing.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal, cast

from .._metrics import ClaimDecision as ClaimTag
from .._metrics import MetricsPort
from ..errors import StoreError
from ..records.runs import Created, RunStore
from ..records.waits import WaitStore
from ._lease_run import (
    ActiveRun,
    DriveLost,
    DriveNotClaimed,
    DriveOutcome,
    DriveParked,
    DriveReleased,
    DriveSettled,
    DriveUnregistered,
    FlowCompleted,
    FlowFailed,
    FlowOutcome,
    FlowParked,
    error_json,
    fault_cause,
)
from .context import RunContext
from .ownership.arbiter import Activated, ClaimDecision, Ownership, Terminal

__all__ = [
    "CHAIN_LIMIT",
    "EXISTING",
    "FRESH",
    "NAMED",
    "RETRY_SUFFIX",
    "ActiveRun",
    "DriveLost",
    "DriveNotClaimed",
    "DriveOutcome",
    "DriveParked",
    "DriveReleased",
    "DriveSettled",
    "DriveUnregistered",
    "FlowCompleted",
    "FlowFailed",
    "FlowOutcome",
    "FlowParked",
    "LeasePolicy",
    "Refused",
    "RunLease",
    "acquire",
    "chain_on_failure",
    "error_json",
    "fault_cause",
]

#: How many runs a ``chain_on_failure`` lease tries by default (a bound, not a policy: each is a retry).
CHAIN_LIMIT = 1000


@dataclass(frozen=True)
class LeasePolicy:
    """Which run a lease claims and what a refused claim turns into (use the constants and
    :func:`chain_on_failure`, not this constructor).

    - ``existing``: claim the run as it stands, never creating it; a refusal answers :class:`Refused`.
    - ``named``: create the run if absent (first writer wins), claim it; a refusal answers :class:`Refused`.
    - ``fresh``: create and claim a run id nobody else knows; a refusal is a bug (``RuntimeError``).
    - ``retry_suffix``: as ``named``, but a refused run is replaced by a fresh ``<run id>-<8 hex>``
      (:attr:`RunLease.displaced` says which run refused, and why).
    - ``chain_on_failure``: ``<run id>``, ``<run id>-2``, ... ``-<chain_limit>``: a run settled ``failed`` moves
      to the next one (a deterministic successor, found again by every later claim); any other refusal answers
      :class:`Refused`; all of them failed answers ``Refused(exhausted=True)``.
    """

    kind: Literal["existing", "named", "fresh", "retry_suffix", "chain_on_failure"]
    chain_limit: int = CHAIN_LIMIT

    def __post_init__(self) -> None:
        limit = self.chain_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise StoreError(
                "invalid_argument", f"a lease chain limit must be a positive int (runs to try), not {limit!r}"
            )


EXISTING = LeasePolicy("existing")
NAMED = LeasePolicy("named")
FRESH = LeasePolicy("fresh")
RETRY_SUFFIX = LeasePolicy("retry_suffix")


def chain_on_failure(limit: int = CHAIN_LIMIT) -> LeasePolicy:
    """The ``chain_on_failure`` policy trying at most ``limit`` runs of the chain."""
    return LeasePolicy("chain_on_failure", limit)


@dataclass(frozen=True)
class Refused:
    """No run was activated: ``decision`` is the arbiter's answer for ``run_id`` (terminal, held by a live
    owner, claim lost...). ``exhausted``: a ``chain_on_failure`` lease found every run of its chain ``failed``."""

    run_id: str
    decision: ClaimDecision
    exhausted: bool = False


class RunLease(ActiveRun):
    """One claimed run held by this process (see the module invariants). Built by :func:`acquire`, or directly
    from an :class:`Activated` decision the arbiter answered elsewhere (a stale run the sweep stole). Not
    reusable."""

    def __init__(
        self,
        activated: Activated,
        flow: str,
        *,
        ownership: Ownership,
        runs: RunStore,
        waits: WaitStore,
        context: RunContext | None = None,
        budget_s: float | None = None,
        poll_s: float | None = None,
        bus: Any = None,
        displaced: Refused | None = None,
    ) -> None:
        super().__init__(
            activated,
            flow,
            ownership=ownership,
            runs=runs,
            waits=waits,
            context=context,
            budget_s=budget_s,
            poll_s=poll_s,
            bus=bus,
        )
        #: The run a ``retry_suffix`` lease was asked for and could not claim (None otherwise).
        self.displaced = displaced
        self._once = threading.Lock()
        self._outcome: DriveOutcome | None = None

    @property
    def outcome(self) -> DriveOutcome | None:
        """What :meth:`conclude` answered (None until it did)."""
        return self._outcome

    def conclude(self, outcome: Any = None, error: BaseException | None = None) -> DriveOutcome:
        """Write the one transition that ends this lease; a repeated call answers the first outcome and writes
        nothing (two endings racing — a state hook and an exit handler — must not settle twice)."""
        with self._once:
            if self._outcome is None:
                self._outcome = super().conclude(outcome, error)
            return self._outcome

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_heartbeat()


def acquire(
    run_id: str,
    flow: str,
    policy: LeasePolicy,
    *,
    ownership: Ownership,
    runs: RunStore,
    waits: WaitStore,
    metrics: MetricsPort | None = None,
    budget_s: float | None = None,
    poll_s: float | None = None,
    bus: Any = None,
) -> RunLease | Refused:
    """Claim ``run_id`` (of ``flow``) as ``policy`` says and hold it; :class:`Refused` when no run activated."""

    def created_and_claimed(rid: str) -> ClaimDecision | None:
        # A run this call creates is claimed in the creating transaction: one commit instead of three (create,
        # reserve, activate), and no window in which another claimant sees the new pending row. A row that was
        # there already is claimed after this commits: judging a running row may probe its owner's liveness,
        # which must not hold the write lock.
        if isinstance(runs.create(rid, flow), Created):
            return ownership.claim(rid)
        return None

    def claim(rid: str, *, create: bool) -> ClaimDecision:
        decision = runs.db.write(lambda _conn: created_and_claimed(rid)) if create else None
        if decision is None:
            decision = ownership.claim(rid)
        if metrics is not None:
            metrics.claim_decision(cast(ClaimTag, type(decision).__name__))
        return decision

    def held(activated: Activated, displaced: Refused | None = None) -> RunLease:
        return RunLease(
            activated,
            flow,
            ownership=ownership,
            runs=runs,
            waits=waits,
            budget_s=budget_s,
            poll_s=poll_s,
            bus=bus,
            displaced=displaced,
        )

    def fresh(rid: str, displaced: Refused | None = None) -> RunLease:
        decision = claim(rid, create=True)
        if not isinstance(decision, Activated):  # pragma: no cover - nobody else knows this fresh id
            raise RuntimeError(f"could not claim the fresh run {rid}: {decision}")
        return held(decision, displaced)

    kind = policy.kind
    if kind == "fresh":
        return fresh(run_id)
    if kind == "chain_on_failure":
        rid, n = run_id, 1
        while True:
            decision = claim(rid, create=True)
            if isinstance(decision, Activated):
                return held(decision)
            if not (isinstance(decision, Terminal) and decision.status == "failed"):
                return Refused(rid, decision)
            if n >= policy.chain_limit:
                return Refused(rid, decision, exhausted=True)
            n += 1
            rid = f"{run_id}-{n}"
    decision = claim(run_id, create=kind != "existing")
    if isinstance(decision, Activated):
        return held(decision)
    if kind == "retry_suffix":
        return fresh(f"{run_id}-{uuid.uuid4().hex[:8]}", Refused(run_id, decision))
    return Refused(run_id, decision)
