"""The heartbeat thread of an owned run: renews the lease every second and interrupts its owner when it must stop.

Invariants:

- One :class:`Heartbeater` per owned run renews the lease every ``heartbeat_interval_s`` (1 s) through
  ``Ownership.heartbeat`` (a fenced UPDATE that also returns ``cancel_requested_at_ms``, so the heartbeat doubles
  as the cancellation poll: ``on_cancel`` fires once, on the first beat that sees a request).
- It interrupts its owner (sets :attr:`Heartbeater.interrupted`, records :attr:`Heartbeater.interrupt` and calls
  ``on_interrupt``) exactly once, when:
  * a beat is refused with ``FenceLost``: another incarnation owns the run; every further write would be refused
    anyway, so the owner must stop at once;
  * beats keep failing for ``heartbeat_failure_interrupt_s`` (19 s) of clock time since the last success: past
    that point the lease (30 s) is about to lapse and another process may legitimately take the run over;
  * a beat raises something that is not a store error (a bug): reported, never swallowed.
  Transient failures before the deadline are logged and retried on the next tick.
- Time is the injected clock's, so a test drives 19 s of failures with a ``ManualClock`` and counts beats.

Prior art: the reference's heartbeat fiber ("an owner whose heartbeat writes keep failing for 19 s interrupts
itself"), lease renewal in Chubby.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..._clock import Clock
from ...errors import FenceLost, StoreError
from .arbiter import Heartbeat, Ownership

__all__ = ["Heartbeater", "Interrupt"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Interrupt:
    """Why a heartbeater told its owner to stop."""

    run_id: str
    reason: Literal["fence_lost", "heartbeat_failing", "heartbeat_crashed"]
    cause: BaseException


class Heartbeater:
    """Background lease renewal for one owned run. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        ownership: Ownership,
        run_id: str,
        *,
        on_interrupt: Callable[[Interrupt], None] | None = None,
        on_cancel: Callable[[int], None] | None = None,
        interval_s: float | None = None,
        interrupt_after_s: float | None = None,
        clock: Clock | None = None,
        first_beat_after_s: float = 0.0,
    ) -> None:
        self.ownership = ownership
        self.run_id = run_id
        self.clock = clock or ownership.clock
        self.interval_s = interval_s if interval_s is not None else ownership.settings.heartbeat_interval_s
        self.interrupt_after_s = (
            interrupt_after_s
            if interrupt_after_s is not None
            else ownership.settings.heartbeat_failure_interrupt_s
        )
        #: How long the first beat waits (0: at once). A lease that was just activated has just been renewed: its
        #: first beat can wait one interval like every other, instead of writing again at once.
        self.first_beat_after_s = first_beat_after_s
        self._on_interrupt = on_interrupt
        self._on_cancel = on_cancel
        self._stop = threading.Event()
        self.interrupted = threading.Event()
        self.interrupt: Interrupt | None = None
        self.beats = 0  #: committed heartbeats
        self.failures = 0  #: failed heartbeat attempts
        self.last: Heartbeat | None = None
        self._cancel_seen = False
        self._thread = threading.Thread(target=self._loop, name=f"smthrs-heartbeat-{run_id}", daemon=True)

    def start(self) -> Heartbeater:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop beating (does not release the run) and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> Heartbeater:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        last_ok = self.clock.monotonic()
        if self.first_beat_after_s > 0:
            self.clock.wait(self._stop, self.first_beat_after_s)
        while not self._stop.is_set():
            try:
                hb = self.ownership.heartbeat(self.run_id)
            except FenceLost as exc:
                self._interrupt("fence_lost", exc)
                return
            except StoreError as exc:
                self.failures += 1
                failing_for = self.clock.monotonic() - last_ok
                if failing_for >= self.interrupt_after_s:
                    self._interrupt("heartbeat_failing", exc)
                    return
                log.warning(
                    "heartbeat of run %r failed (failing for %.1fs of %.1fs allowed): %s",
                    self.run_id, failing_for, self.interrupt_after_s, exc,
                )  # fmt: skip
            except Exception as exc:
                log.exception("heartbeat of run %r crashed", self.run_id)
                self._interrupt("heartbeat_crashed", exc)
                return
            else:
                self.beats += 1
                self.last = hb
                last_ok = self.clock.monotonic()
                if hb.cancel_requested_at_ms is not None and not self._cancel_seen:
                    self._cancel_seen = True
                    if self._on_cancel is not None:
                        self._on_cancel(hb.cancel_requested_at_ms)
            self.clock.wait(self._stop, self.interval_s)

    def _interrupt(
        self, reason: Literal["fence_lost", "heartbeat_failing", "heartbeat_crashed"], cause: BaseException
    ) -> None:
        self.interrupt = Interrupt(self.run_id, reason, cause)
        self.interrupted.set()
        log.warning("interrupting the owner of run %r: %s (%s)", self.run_id, reason, cause)
        if self._on_interrupt is not None:
            self._on_interrupt(self.interrupt)
