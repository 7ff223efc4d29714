"""What a drive ends in: the held run (:class:`ActiveRun`), what a flow may return (``Flow*``) and how a drive
ended (``Drive*``). They belong to the run lease (``engine/lease.py``), which every drive takes; this module
keeps their public address for the drive's callers.
"""

from __future__ import annotations

from ..lease import (
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

__all__ = [
    "ActiveRun",
    "FlowCompleted",
    "FlowFailed",
    "FlowParked",
    "FlowOutcome",
    "DriveSettled",
    "DriveParked",
    "DriveReleased",
    "DriveLost",
    "DriveNotClaimed",
    "DriveUnregistered",
    "DriveOutcome",
    "error_json",
    "fault_cause",
]
