"""The stale-running sweep: re-arbitrate runs whose owner stopped heartbeating, a bounded batch per tick.

Invariants:

- A tick reads ``running`` rows whose lease expired — heartbeat MORE than the stale window old (``stale_after``,
  30 s, no skew added: the arbiter's own rule; exactly 30 s is still fresh) — oldest heartbeat first (ties by run
  id), and arbitrates at most ``batch`` (64) of them through ``Ownership.steal``; a mass owner death drains over
  several ticks instead of every driver waking every stale run every second.
- A refused steal defers that run for 2 ticks, doubling per consecutive refusal against the SAME lease (owner
  nonce + heartbeat), capped at the stale window in ticks (30). The scan reads PAST deferred rows, so the batch
  keeps advancing: without that, the oldest refused rows would fill every batch and a run behind them would
  never be arbitrated.
- A deferral is forgotten as soon as its row leaves the stale window (the owner resumed heartbeating, the run
  was stolen, settled or deleted) or its lease changed: a fresh stall is probed on the first tick that sees it.
- Journal records are the arbiter's business: a refusal is journaled once per (run, owner, lease, evidence)
  however many ticks see it (journal idempotency), not once per tick.

Prior art: the reference driver's stale-running sweep, whose scan also passes over the rows it defers so a
batch of 64 keeps moving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...records.runs import leases, stale_running_page_in
from .arbiter import ClaimDecision, Ownership, StealRefusedOwnerAlive

__all__ = ["StaleSweep", "SweepTick", "STALE_SWEEP_BATCH"]

STALE_SWEEP_BATCH = 64
_FORGET_CHUNK = 500


@dataclass(frozen=True)
class SweepTick:
    """What one tick did: the runs it arbitrated (with decisions, in scan order) and the deferred ones it passed."""

    tick: int
    probed: tuple[tuple[str, ClaimDecision], ...]
    deferred: tuple[str, ...]


@dataclass
class _Deferral:
    lease: int
    owner_nonce: str
    refusals: int
    until_tick: int


class StaleSweep:
    """Stateful across ticks (the deferrals); one instance per driver, ticked on the heartbeat cadence."""

    def __init__(self, ownership: Ownership, *, batch: int = STALE_SWEEP_BATCH) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self.ownership = ownership
        self.db = ownership.db
        self.batch = batch
        s = ownership.settings
        self.cap_ticks = max(1, math.ceil(s.stale_after_s / s.heartbeat_interval_s))
        self._tick = 0
        self._deferred: dict[str, _Deferral] = {}

    @property
    def deferred_runs(self) -> frozenset[str]:
        return frozenset(self._deferred)

    def tick(self) -> SweepTick:
        """One pass (see module invariants)."""
        self._tick += 1
        # The newest expired heartbeat: ``heartbeat_at >= now - stale_after`` is a fresh lease.
        horizon = self.ownership.clock.now_ms() - self.ownership.stale_after_ms - 1
        self._forget_departed(horizon)
        me = self.ownership.owner
        probed: list[tuple[str, ClaimDecision]] = []
        passed: list[str] = []
        after: tuple[int, str] | None = None
        while len(probed) < self.batch:
            page = self._page(horizon, after)
            for row in page:
                after = (int(row.heartbeat_at_ms), row.run_id)
                if (row.owner_host, row.owner_pid, row.owner_nonce) == (me.host_id, me.pid, me.nonce):
                    continue  # our own lagging lease is our heartbeater's business
                d = self._deferred.get(row.run_id)
                same_lease = d is not None and (d.lease, d.owner_nonce) == (after[0], row.owner_nonce)
                if d is not None and same_lease and self._tick <= d.until_tick:
                    passed.append(row.run_id)
                    continue
                decision = self.ownership.steal(row.run_id)
                probed.append((row.run_id, decision))
                self._note(row.run_id, int(row.heartbeat_at_ms), row.owner_nonce, decision)
                if len(probed) >= self.batch:
                    break
            if len(page) < self.batch:
                break
        return SweepTick(self._tick, tuple(probed), tuple(passed))

    def _page(self, horizon: int, after: tuple[int, str] | None) -> list[Any]:
        return self.db.read(lambda c: stale_running_page_in(c, horizon, after, self.batch))

    def _rows(self, run_ids: list[str]) -> list[Any]:
        return leases(self.db, run_ids)

    def _note(self, run_id: str, lease: int, owner_nonce: str, decision: ClaimDecision) -> None:
        if not isinstance(decision, StealRefusedOwnerAlive):
            self._deferred.pop(run_id, None)
            return
        prev = self._deferred.get(run_id)
        refusals = (
            prev.refusals + 1
            if prev is not None and (prev.lease, prev.owner_nonce) == (lease, owner_nonce)
            else 1
        )
        delay = min(2 * 2 ** (refusals - 1), self.cap_ticks)
        self._deferred[run_id] = _Deferral(lease, owner_nonce, refusals, self._tick + delay)

    def _forget_departed(self, horizon: int) -> None:
        ids = list(self._deferred)
        for i in range(0, len(ids), _FORGET_CHUNK):
            chunk = ids[i : i + _FORGET_CHUNK]
            rows = self._rows(chunk)
            current = {r.run_id: r for r in rows}
            for run_id in chunk:
                r = current.get(run_id)
                d = self._deferred[run_id]
                if (
                    r is None
                    or r.status != "running"
                    or r.heartbeat_at_ms is None
                    or int(r.heartbeat_at_ms) > horizon
                    or (int(r.heartbeat_at_ms), r.owner_nonce) != (d.lease, d.owner_nonce)
                ):
                    del self._deferred[run_id]
