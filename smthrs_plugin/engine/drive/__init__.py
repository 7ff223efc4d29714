"""Driving runs: claim -> activate -> run the flow's code -> exactly one durable transition that ends the drive.

Invariant: every drive of a run — direct, a fired clock, a woken, released or stolen run, a cancellation, a
scheduler pass driving its own run — holds a run lease (``engine/lease.py``: claimed through the ownership
arbiter) and ends in one transition (completed, failed, cancelled, parked or released). ``driver``
(:class:`RunDriver`) registers flows and performs the sweeps (``_sweeps``) that re-drive runs nobody is driving;
``pass_lifecycle`` (:class:`PassLifecycle`) is the scheduler's run lifecycle.
"""

from __future__ import annotations

from ._sweeps import SWEEP_BATCH, Candidate, RetryPolicy, cancel_candidates, runnable_candidates
from .active_run import (
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
)
from .driver import FlowFn, Registration, RunDriver, TickReport
from .pass_lifecycle import PassLifecycle

__all__ = [
    "ActiveRun",
    "Candidate",
    "DriveLost",
    "DriveNotClaimed",
    "DriveOutcome",
    "DriveParked",
    "DriveReleased",
    "DriveSettled",
    "DriveUnregistered",
    "FlowCompleted",
    "FlowFailed",
    "FlowFn",
    "FlowOutcome",
    "FlowParked",
    "PassLifecycle",
    "Registration",
    "RetryPolicy",
    "RunDriver",
    "SWEEP_BATCH",
    "TickReport",
    "cancel_candidates",
    "error_json",
    "runnable_candidates",
]
