"""The durable journal, as the engine names it: re-exported from its owner, :mod:`smthrs_plugin.records.journal`.

Invariant: this module holds no SQL and no decoder; every journal statement and the one entry decoder live in the
owner, so the engine, the scheduler and the projections read the same records the same way.
"""

from __future__ import annotations

from ..records.journal import (
    MAX_READ_LIMIT,
    Appended,
    AppendOutcome,
    Duplicate,
    Journal,
    JournalEvent,
    PendingRecord,
    Subscription,
    _hub_for,
    plan_partition,
    record_cte,
)

__all__ = [
    "Journal",
    "PendingRecord",
    "record_cte",
    "JournalEvent",
    "Appended",
    "Duplicate",
    "AppendOutcome",
    "Subscription",
    "plan_partition",
    "MAX_READ_LIMIT",
    "_hub_for",
]
