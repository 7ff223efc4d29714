"""Step boundaries: measurement (SHA-256 + stat cache), prepare/settle/replay, and the sandbox transaction."""

from __future__ import annotations

from ._isolate import (
    ISOLATIONS,
    IsolatedCall,
    Isolation,
    IsolationKind,
    UndeclaredPath,
    command_preexec,
    isolation_ran,
    namespace_available,
    record_isolation,
    resolve_isolation,
)
from .boundary import (
    BoundaryMode,
    Declaration,
    Prepared,
    ReadSetChanged,
    ReadSetCheck,
    ReadSetMatches,
    check_read_set,
    prepare,
    settle,
)
from .evidence import (
    Deviation,
    Evidence,
    ExpectedSetDeviation,
    InlineLimits,
    MissingDeclaredOutput,
    Output,
    SurvivingDeclaredRemoval,
    diff_identity,
    referenced_digests,
)
from .measure import ABSENT, FileState, Measurer, MeasureStats, StatCache, sha256_file
from .replay import Replayed, replay_outputs
from .sandbox import SandboxMode, SandboxResult, run_in_sandbox

__all__ = [
    "ISOLATIONS",
    "ABSENT",
    "BoundaryMode",
    "Declaration",
    "Deviation",
    "Evidence",
    "ExpectedSetDeviation",
    "FileState",
    "InlineLimits",
    "Isolation",
    "IsolationKind",
    "IsolatedCall",
    "MeasureStats",
    "Measurer",
    "MissingDeclaredOutput",
    "Output",
    "Prepared",
    "ReadSetChanged",
    "ReadSetCheck",
    "ReadSetMatches",
    "Replayed",
    "SandboxMode",
    "SandboxResult",
    "StatCache",
    "SurvivingDeclaredRemoval",
    "UndeclaredPath",
    "check_read_set",
    "command_preexec",
    "diff_identity",
    "isolation_ran",
    "namespace_available",
    "prepare",
    "record_isolation",
    "referenced_digests",
    "replay_outputs",
    "resolve_isolation",
    "run_in_sandbox",
    "settle",
    "sha256_file",
]
