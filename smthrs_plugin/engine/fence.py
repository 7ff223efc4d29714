"""Owner identity and the fence, as the engine names them: re-exported from the runs owner
(:mod:`smthrs_plugin.records.runs`), which holds every run-row statement and the fence check itself."""

from __future__ import annotations

from ..records.runs import (
    CLEAR_CLAIM,
    CLEAR_OWNER,
    CLEAR_WAIT,
    OBSERVED_COLUMNS,
    OWNED,
    FenceRow,
    OwnerId,
    RunUpdate,
    assert_owner,
    bump_run,
    bump_run_journaled,
    bump_run_observed,
    current_owner,
    fact_of,
    remember_observed,
    update_run,
)

__all__ = [
    "OwnerId",
    "current_owner",
    "assert_owner",
    "update_run",
    "bump_run",
    "bump_run_observed",
    "bump_run_journaled",
    "remember_observed",
    "RunUpdate",
    "OWNED",
    "OBSERVED_COLUMNS",
    "fact_of",
    "FenceRow",
    "CLEAR_OWNER",
    "CLEAR_CLAIM",
    "CLEAR_WAIT",
]
