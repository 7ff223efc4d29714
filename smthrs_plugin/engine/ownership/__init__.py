"""Run ownership: who may write a run, and taking it from an owner that died.

Invariant: a run is driven by at most one owner incarnation at a time. ``arbiter`` (:class:`Ownership`) decides
claims, activations and steals inside one write transaction each and fences every write through the runs owner
(``records.runs.assert_owner``); ``liveness`` supplies the evidence a steal needs (a lease older than 30 s, and
optionally a dead same-host pid); ``heartbeat`` renews the lease every second and interrupts its owner when it
must stop; ``stale_sweep`` finds runs whose owner stopped heartbeating. Prior art: Temporal's fencing of
workflow tasks, DBOS's recovery of pending workflows.
"""

from __future__ import annotations

from .arbiter import (
    CLAIMABLE_STATUSES,
    Activated,
    ActivationLost,
    ClaimDecision,
    ClaimLost,
    FenceRow,
    Heartbeat,
    HeartbeatFresh,
    OwnerId,
    Ownership,
    Released,
    StealRefusedOwnerAlive,
    Terminal,
    assert_owner,
    current_owner,
)
from .heartbeat import Heartbeater, Interrupt
from .liveness import (
    Alive,
    Dead,
    LeaseLiveness,
    LivenessCheck,
    LivenessContext,
    SameHostPidProbe,
    Verdict,
    pid_alive,
    process_start_token,
)
from .stale_sweep import STALE_SWEEP_BATCH, StaleSweep, SweepTick

__all__ = [
    "Activated",
    "ActivationLost",
    "Alive",
    "CLAIMABLE_STATUSES",
    "ClaimDecision",
    "ClaimLost",
    "Dead",
    "FenceRow",
    "Heartbeat",
    "HeartbeatFresh",
    "Heartbeater",
    "Interrupt",
    "LeaseLiveness",
    "LivenessCheck",
    "LivenessContext",
    "OwnerId",
    "Ownership",
    "Released",
    "STALE_SWEEP_BATCH",
    "SameHostPidProbe",
    "StaleSweep",
    "StealRefusedOwnerAlive",
    "SweepTick",
    "Terminal",
    "Verdict",
    "assert_owner",
    "current_owner",
    "pid_alive",
    "process_start_token",
]
