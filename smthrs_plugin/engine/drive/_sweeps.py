"""What a run driver's periodic sweeps look for, and the clock-fire retry policy.

Invariants:

- Every sweep reads a bounded batch (default 64) of actionable rows, oldest first, so a mass event (an owner
  death, a burst of cancellations) drains over several ticks instead of every driver touching every row on every
  tick. Each candidate then re-enters the ordinary claim → activate path: a sweep decides nothing by itself, the
  serialized claim arbitrates between drivers (of two sweepers exactly one activates).
- **Cancellation candidates**: parked runs with a cancellation request (``WaitStore.waiting_runs``), plus pending
  runs with one (admitted, never started) — of ANY flow: cancelling needs no flow code.
- **Runnable candidates**: runs of the flows this process registered that any driver may claim now: parked
  ``released`` (a shutdown or lapsed lease gave them back) and ``pending`` (created, or woken by a timer or a
  deferred). Stale ``running`` rows are the stale sweep's (``ownership/stale_sweep.py``).
- **Clock fires** retry with capped exponential backoff, forever by default (100 ms doubling to 30 s): a fire
  that fails transiently is never lost until a restart.

Prior art: a driver's three sweeps on the heartbeat cadence with a clock-fire retry policy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ...records.runs import pending_runs
from ...records.wait_rows import WaitingFilter
from ...records.waits import WaitStore
from ...stores.database import Database

__all__ = ["RetryPolicy", "Candidate", "cancel_candidates", "runnable_candidates", "SWEEP_BATCH"]

SWEEP_BATCH = 64


@dataclass(frozen=True)
class RetryPolicy:
    """Delay before retry number ``failures`` (1-based): ``initial_s * factor ** (failures - 1)`` capped at
    ``max_s``; ``limit`` retries at most (None: forever)."""

    initial_s: float = 0.1
    factor: float = 2.0
    max_s: float = 30.0
    limit: int | None = None

    def __post_init__(self) -> None:
        for name in ("initial_s", "factor", "max_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"RetryPolicy.{name} must be a positive number, got {v!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 0):
            raise ValueError(f"RetryPolicy.limit must be a non-negative int or None, got {self.limit!r}")

    def delay(self, failures: int) -> float | None:
        """Seconds to wait after the ``failures``-th consecutive failure, or None once the limit is spent."""
        if self.limit is not None and failures > self.limit:
            return None
        exponent = min(max(failures - 1, 0), 64)  # 2**64 s is past any cap; avoids float overflow
        return float(min(self.initial_s * self.factor**exponent, self.max_s))


@dataclass(frozen=True)
class Candidate:
    """A run a sweep wants claimed."""

    run_id: str
    flow: str
    status: str


def cancel_candidates(waits: WaitStore, *, limit: int = SWEEP_BATCH) -> list[Candidate]:
    """Parked runs with a cancellation request, then pending ones; undecodable waiting rows are skipped (with a
    warning) by the waiting listing."""
    parked = waits.waiting_runs(WaitingFilter(cancel_requested=True), limit=limit)
    out = [Candidate(w.run_id, w.flow, "suspended") for w in parked]
    if len(out) < limit:
        out += _pending(waits.db, None, limit - len(out), cancel_requested=True)
    return out


def runnable_candidates(
    waits: WaitStore, flows: Iterable[str], *, limit: int = SWEEP_BATCH
) -> list[Candidate]:
    """Runs of ``flows`` claimable now: parked ``released``, then ``pending`` (oldest first)."""
    names = tuple(sorted(set(flows)))
    if not names:
        return []
    released = waits.waiting_runs(WaitingFilter(reason="released", flows=names), limit=limit)
    out = [Candidate(w.run_id, w.flow, "suspended") for w in released]
    if len(out) < limit:
        out += _pending(waits.db, names, limit - len(out), cancel_requested=None)
    return out


def _pending(
    db: Database, flows: tuple[str, ...] | None, limit: int, *, cancel_requested: bool | None
) -> list[Candidate]:
    rows = pending_runs(db, flows, limit, cancel_requested=cancel_requested)
    return [Candidate(row.run_id, row.flow, "pending") for row in rows]
