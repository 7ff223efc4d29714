"""Driving runs: claim -> activate -> run the flow's code -> exactly one durable transition that ends the drive.

Invariant: every drive of a run — direct, a fired clock, a woken, released or stolen run, a cancellation — goes
through the ownership arbiter and ends in one transition (``_active_run``: completed, failed, cancelled, parked
or released). ``_driver`` (:class:`RunDriver`) registers flows and performs the sweeps (``_sweeps``) that re-drive
runs nobody is driving.
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
    "Registration",
    "RetryPolicy",
    "RunDriver",
    "SWEEP_BATCH",
    "TickReport",
    "cancel_candidates",
    "error_json",
    "runnable_candidates",
]
