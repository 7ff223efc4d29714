"""An injectable clock, so that every timing rule (leases, stale windows, backoffs) is testable without sleeping.

Invariant: code that makes a decision from time reads it from a :class:`Clock` it was given, never from
``time`` directly. Production uses :class:`SystemClock`; tests use :class:`ManualClock`, whose time moves only
when the test advances it (or, with ``auto_advance=True``, by exactly the amount a caller sleeps), so a test of a
30 s stale window runs in microseconds and asserts states, never elapsed wall time.

Prior art: Temporal's test server time skipping, Go's ``clockwork.FakeClock``.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock", "ManualClock", "SYSTEM_CLOCK"]


@runtime_checkable
class Clock(Protocol):
    """Wall time in epoch milliseconds, a monotonic reading in seconds, and sleeping on that clock."""

    def now_ms(self) -> int:
        """Epoch milliseconds (durable timestamps: heartbeats, deadlines)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (intervals measured inside one process)."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds`` of this clock's time."""
        ...

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Block until ``event`` is set or ``seconds`` of this clock's time pass; True when the event is set.

        Background loops (heartbeats, sweeps) wait this way so that stopping them is immediate."""
        ...


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(0.0, seconds))


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that moves only when told to. Thread-safe.

    ``auto_advance=False`` (default): :meth:`sleep`/:meth:`wait` block until another thread :meth:`advance`\\ s the
    clock past the deadline (or the event is set). ``auto_advance=True``: sleeping advances the clock by the slept
    amount at once, which turns a periodic loop into a deterministic sequence of ticks.
    """

    def __init__(self, start_ms: int = 1_700_000_000_000, *, auto_advance: bool = False) -> None:
        self._now_ns = int(start_ms) * 1_000_000
        self._auto = auto_advance
        self._cond = threading.Condition()
        self.sleeps: int = 0  #: how many times something slept or waited on this clock (tests count ticks)

    def now_ms(self) -> int:
        with self._cond:
            return self._now_ns // 1_000_000

    def monotonic(self) -> float:
        with self._cond:
            return self._now_ns / 1e9

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (never backwards) and wake sleepers whose deadline passed."""
        if seconds < 0:
            raise ValueError("a ManualClock never goes backwards")
        with self._cond:
            self._now_ns += int(round(seconds * 1e9))
            self._cond.notify_all()

    def set_ms(self, epoch_ms: int) -> None:
        """Jump to ``epoch_ms`` (must not be in the past)."""
        with self._cond:
            target = int(epoch_ms) * 1_000_000
            if target < self._now_ns:
                raise ValueError("a ManualClock never goes backwards")
            self._now_ns = target
            self._cond.notify_all()

    def sleep(self, seconds: float) -> None:
        self.wait(threading.Event(), seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        with self._cond:
            self.sleeps += 1
            if event.is_set():
                return True
            if self._auto:
                self._now_ns += int(round(max(0.0, seconds) * 1e9))
                self._cond.notify_all()
                return event.is_set()
            deadline = self._now_ns + int(round(max(0.0, seconds) * 1e9))
            # The event is a threading.Event we cannot hook, so poll it briefly in real time; time itself only
            # moves through advance(), which notifies.
            while self._now_ns < deadline:
                if event.is_set():
                    return True
                self._cond.wait(0.005)
            return event.is_set()
