"""Following a run to its end: the retry policy of ``smthrs run --key``/``resume``, for any caller.

:func:`follow` finishes a run from this process, or follows it until it settles or parks. A run nobody holds is
driven here by ``relaunch()`` — the caller's own idempotent call repeated under the same key (``AlreadyApplied``
re-launches a run nobody drives). A run another owner holds is taken over at its lease expiry (``stale_after_s``
of heartbeat age, claim age for a pending run; exactly ``stale_after_s`` is still fresh); a takeover the liveness
check refuses (a live owner past its lease) is re-tried with the stale sweep's backoff (2 polls, doubling per
refusal of the same lease, capped at the stale window). Waiting runs on the control plane's clock in steps of
``wait_poll_s``, never on wall time measured here; with ``wait=False`` a held run answers :class:`Held` at once.

The answer is one of :class:`Settled`, :class:`Suspended` (parked: the caller reads why from the run) or
:class:`Held`, told apart by ``type``. From Python::

    from smthrs_plugin.control.follow import Held, follow

    receipt = control.run(card, idempotency_key=key, launcher=launcher)
    out = follow(control, receipt.run_id, lambda: control.run(card, idempotency_key=key, launcher=launcher))
    if isinstance(out, Held):  # only with wait=False, or after a KeyboardInterrupt while waiting
        print(out.describe())

``on_wait(held)`` is told when waiting on a holder starts, when its phase changes (lease running → expired but
vouched for) and every 10 s of clock time otherwise; the CLI prints it as its progress line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from ..errors import ControlError
from ..records.runs import TERMINAL_STATUSES, OwnerId

if TYPE_CHECKING:  # pragma: no cover
    from .facade import Control

__all__ = ["follow", "Followed", "Settled", "Suspended", "Held"]

_SAY_EVERY_MS = 10_000  # a progress note at least this often while the phase stays the same


@dataclass(frozen=True)
class Settled:
    """The run reached a terminal status (``completed``, ``failed``, ``cancelled``)."""

    type: ClassVar[str] = "Settled"

    run_id: str
    status: str


@dataclass(frozen=True)
class Suspended:
    """The run is parked — on an approval, an event, or a timer not yet due — and nobody needs to drive it now."""

    type: ClassVar[str] = "Suspended"

    run_id: str
    waiting_reason: str | None


@dataclass(frozen=True)
class Held:
    """The run is still ``pending``/``running`` under another owner this process could not (yet) take it from."""

    type: ClassVar[str] = "Held"

    run_id: str
    status: str
    owner: OwnerId
    age_ms: int  #: heartbeat age (claim age for a pending run) when last read
    expires_in_ms: int  #: until its lease expires (0: expired, and the liveness check vouched for the owner)

    def to_json(self) -> dict[str, Any]:
        """The owner and its lease, as the ``owner`` member of a run/resume answer."""
        return {
            "host": self.owner.host_id,
            "pid": self.owner.pid,
            "nonce": self.owner.nonce,
            "lease_age_ms": self.age_ms,
            "lease_expires_in_ms": self.expires_in_ms,
        }

    def describe(self) -> str:
        """One line: the run, its owner and where its lease stands."""
        who = f"host {self.owner.host_id!r} pid {self.owner.pid}"
        if self.expires_in_ms > 0:
            lease = f"its lease ({self.age_ms / 1000:.1f} s old) expires in {self.expires_in_ms / 1000:.1f} s"
        else:
            lease = "its lease expired but the liveness check vouches for it (alive)"
        return f"run {self.run_id} is {self.status}, owned by {who}; {lease}"


Followed: TypeAlias = Settled | Suspended | Held  #: what :func:`follow` answers


def follow(
    control: Control,
    run_id: str,
    relaunch: Callable[[], object],
    *,
    wait: bool = True,
    on_wait: Callable[[Held], None] | None = None,
) -> Followed:
    """Finish ``run_id`` from this process, or follow it until it settles or parks (see the module docstring).

    Returns :class:`Held` only with ``wait=False`` (at once, when another owner holds the run) or when a
    ``KeyboardInterrupt`` stops a wait (Ctrl-C stops following as ``--no-wait`` would). Raises
    ``ControlError(run_not_found)`` when the run does not exist."""
    clock = control.clock
    stale_ms = int(control.settings.stale_after_s * 1000)
    poll_ms = max(1, int(control.settings.wait_poll_s * 1000))
    refused: tuple[Any, int] | None = None  # (owner, lease) the liveness check last vouched for
    refusals, retry_at = 0, 0
    said: tuple[Any, ...] | None = None
    said_at = 0
    while True:
        row = control.run_row(run_id)
        if row is None:
            raise ControlError("run_not_found", f"run {run_id!r} does not exist", run_id=run_id)
        now = clock.now_ms()
        if row.status in TERMINAL_STATUSES:
            return Settled(run_id, row.status)
        if row.status == "suspended":
            due = row.waiting_reason == "timer" and row.wake_at_ms is not None and row.wake_at_ms <= now
            if row.waiting_reason != "released" and not due:
                return Suspended(run_id, row.waiting_reason)
            holder, since = None, None
        elif row.status == "running":
            holder, since = row.owner, row.heartbeat_at_ms
        else:  # pending: admitted, perhaps under another process's claim
            holder, since = row.claim, row.claimed_at_ms
        if holder is None or holder == control.owner or since is None:
            relaunch()  # nobody holds it: drive it here
            if control.run_row(run_id) == row:
                # Nothing moved (another process raced us to it): look again later.
                clock.sleep(poll_ms / 1000)
            continue
        age = now - since
        expires_in = max(0, stale_ms + 1 - age)  # exactly stale_after of age is still a fresh lease
        if expires_in == 0 and ((holder, since) != refused or now >= retry_at):
            relaunch()  # the lease expired: the arbiter steals on Dead evidence, refuses (journaled once) on Alive
            after = control.run_row(run_id)
            still = (
                after is not None
                and after.status == row.status
                and (
                    (after.owner, after.heartbeat_at_ms)
                    if row.status == "running"
                    else (after.claim, after.claimed_at_ms)
                )
                == (holder, since)
            )
            if not still:
                continue
            refusals = refusals + 1 if refused == (holder, since) else 1
            refused = (holder, since)
            retry_at = now + min(2 * 2 ** (refusals - 1) * poll_ms, stale_ms)
        held = Held(run_id, row.status, holder, age, expires_in)
        if not wait:
            return held
        phase = (holder, expires_in == 0)
        if phase != said or now - said_at >= _SAY_EVERY_MS:
            if on_wait is not None:
                on_wait(held)
            said, said_at = phase, now
        pause = poll_ms if expires_in == 0 else min(poll_ms, expires_in)
        try:
            clock.sleep(max(pause, 1) / 1000)
        except KeyboardInterrupt:
            return held  # Ctrl-C while following: stop as --no-wait would (the caller names the owner)
