"""Liveness checks: the evidence an arbiter uses before taking a run away from its recorded owner.

Invariant: a check never *acts*; it answers :class:`Alive` or :class:`Dead` with the evidence word that the
journal records (``lease-fresh | probe`` for refusals; ``lease-expired | same-host-pid-dead |
cross-host-unreachable-stale`` for steals). The arbiter (``ownership.Ownership``) decides and fences.

- A lease is fresh while ``heartbeat_at >= now - stale_after`` (30,000 ms): a heartbeat exactly 30,000 ms old is
  still fresh, and the lease has expired from 30,001 ms of age on (the reference engine's comparison, so two
  implementations sharing a database agree on the boundary millisecond). No skew is added: the skew allowance only
  derives the owner's self-interrupt write tolerance (30 − 10 − 1 = 19 s, ``heartbeat.py``). A check is consulted
  only for an expired lease — the arbiter (``Ownership._arbitrate``, ``control.launch.judge_claim``) answers a
  fresh lease itself without asking — and each shipped check also answers ``lease-fresh`` for a fresh lease on its
  own, so no caller can make it steal early.
- :class:`LeaseLiveness` (the default; the only evidence every host has): alive while the persisted heartbeat is at
  most ``stale_after`` old, gone (``lease-expired``) once it is older.
- :class:`SameHostPidProbe`: for an EXPIRED lease only, and only when the owner's host id equals the claimant's
  (a pid names a process only inside its own host), ``kill(pid, 0)`` decides: a dead pid is a steal
  (``same-host-pid-dead``), a live pid refuses for as long as it lives (``probe``). Other hosts fall back to the
  lease (``cross-host-unreachable-stale``). It is a *stricter* check than the lease, never a faster one: a dead
  same-host owner is stolen at 30 s like any other, and a live but stalled one is not stolen at all.

Pid reuse: ``kill(pid, 0)`` cannot tell the owner from a newer process that recycled its pid, and the owner's
nonce lives only in its memory. Mitigation: the owner records ``<boot id>:<start time>`` of its pid (from
``/proc``) when it claims; the probe treats a live pid whose start token differs as dead. Without ``/proc`` (or
for rows recorded by a pinned, non-self owner) the probe can only err on the side of "alive", which delays a
steal but never allows a wrong one. Zombies (``Z``/``X`` in ``/proc/<pid>/stat``) count as dead.

Prior art: the reference's ``Ownership.leaseLiveness`` and ``Ownership.sameHostPidProbe``; Chubby/etcd leases.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

from ...records.runs import OwnerId

__all__ = [
    "Alive",
    "Dead",
    "Verdict",
    "LivenessContext",
    "LivenessCheck",
    "LeaseLiveness",
    "SameHostPidProbe",
    "process_start_token",
    "pid_alive",
]

RefusalEvidence = Literal["lease-fresh", "probe"]
StealEvidence = Literal["lease-expired", "same-host-pid-dead", "cross-host-unreachable-stale"]


@dataclass(frozen=True)
class Alive:
    """The owner is (or may be) alive: refuse the takeover."""

    evidence: RefusalEvidence


@dataclass(frozen=True)
class Dead:
    """The owner is gone: the takeover may proceed."""

    evidence: StealEvidence


Verdict = Alive | Dead


@dataclass(frozen=True)
class LivenessContext:
    """What a check may look at besides the recorded owner."""

    claimant: OwnerId
    heartbeat_at_ms: int
    now_ms: int
    stale_after_ms: int
    skew_allowance_ms: int
    owner_proc_start: str | None = None

    @property
    def lease_age_ms(self) -> int:
        return self.now_ms - self.heartbeat_at_ms

    @property
    def lease_expired(self) -> bool:
        """Whether the heartbeat is MORE than ``stale_after`` old (no skew added): ``heartbeat_at >= now -
        stale_after`` is a fresh lease, so exactly ``stale_after`` of age is still fresh."""
        return self.lease_age_ms > self.stale_after_ms


class LivenessCheck(Protocol):
    """Decides whether the recorded ``owner`` of a running row whose lease EXPIRED still lives (the arbiter never
    asks about a fresh lease)."""

    def check(self, owner: OwnerId, ctx: LivenessContext) -> Verdict: ...


class LeaseLiveness:
    """Alive while ``now - heartbeat <= stale_after``; the lease has expired once the heartbeat is older."""

    def check(self, owner: OwnerId, ctx: LivenessContext) -> Verdict:
        if not ctx.lease_expired:
            return Alive("lease-fresh")
        return Dead("lease-expired")


class SameHostPidProbe:
    """For an expired lease: ``kill(pid, 0)`` (+ start-time token) when host ids match; the lease otherwise. A
    fresh lease is ``lease-fresh`` whatever the pid says (the probe is never consulted before expiry)."""

    def check(self, owner: OwnerId, ctx: LivenessContext) -> Verdict:
        if not ctx.lease_expired:
            return Alive("lease-fresh")
        if owner.host_id != ctx.claimant.host_id:
            return Dead("cross-host-unreachable-stale")
        if not pid_alive(owner.pid):
            return Dead("same-host-pid-dead")
        if ctx.owner_proc_start is not None:
            now_token = process_start_token(owner.pid)
            if now_token is not None and now_token != ctx.owner_proc_start:
                return Dead("same-host-pid-dead")  # the pid was recycled by a newer process
        return Alive("probe")


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    state = _proc_state(pid)
    return state not in ("Z", "X")


def process_start_token(pid: int) -> str | None:
    """``"<boot id>:<start ticks>"`` of ``pid`` from /proc, or None where /proc is unavailable."""
    fields = _proc_stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    # Fields after "pid (comm)": state is [0], starttime is field 22 of stat(5) → index 19 here.
    return f"{_boot_id()}:{fields[19]}"


def _proc_state(pid: int) -> str | None:
    fields = _proc_stat_fields(pid)
    return fields[0] if fields else None


def _proc_stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the LAST ')'.
    return text[text.rfind(")") + 2 :].split()


@lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown-boot"
