"""The wake bus: an in-process, edge-triggered signal that lets a parked waiter re-check durable state now
instead of at its next poll: the wake bus makes the common case fast; polling stays the fallback.

Polling the store is the correctness path; the bus only shortens it. Nothing here is durable: a wake with no
subscriber is dropped (``Dropped``), and cross-process delivery stays store-driven. Threads, not asyncio
(the core is synchronous): a waiter blocks on a condition variable.

The lost-wakeup rule. An edge-triggered signal is lost if it fires between a waiter's check of durable state and
its wait. So a waiter **subscribes first, then checks the store, then waits** on the subscription; the waker
**commits its durable write first, then wakes**. A subscription latches every wake that arrives after it was
created, so a wake that lands between the check and ``wait()`` makes ``wait()`` return ``Woken`` at once (the
classic condition-variable discipline; Linux futexes and Go's ``sync.Cond`` make the same demand)::

    with bus.subscribe(run_id) as sub:
        while not store.is_ready(run_id):          # durable check, AFTER subscribing
            sub.wait(timeout=poll_interval_s)      # Woken or TimedOut: either way, check again

Invariants
- ``wait`` consumes the latch: several wakes before one ``wait`` coalesce into one ``Woken`` (the waiter re-reads
  durable state, which already reflects all of them).
- ``wake(id)`` latches and signals every live subscription on ``id`` and reports how many (``Delivered``).
- Leaving a subscription — normally, on timeout, or by any exception including ``KeyboardInterrupt`` —
  unregisters it; the last one out removes the id's entry, so an abandoned wait leaks nothing.
- One lock guards all registrations and latches; every subscription's condition shares it, so a wake and a
  wait's check-then-block can never interleave.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Union

__all__ = [
    "Woken",
    "TimedOut",
    "WakeOutcome",
    "Delivered",
    "Dropped",
    "WakeDelivery",
    "Subscription",
    "WakeBus",
    "NoopWakeBus",
]


@dataclass(frozen=True)
class Woken:
    """A wake for ``execution_id`` arrived after the subscription was created (or after its last ``Woken``)."""

    execution_id: str


@dataclass(frozen=True)
class TimedOut:
    """No wake arrived within ``timeout_s``: fall back to polling the store."""

    execution_id: str
    timeout_s: float


WakeOutcome = Union[Woken, TimedOut]


@dataclass(frozen=True)
class Delivered:
    """``wake`` latched and signalled ``waiters`` live subscriptions."""

    execution_id: str
    waiters: int


@dataclass(frozen=True)
class Dropped:
    """``wake`` found no subscription (or the bus drops every wake): nothing was signalled or remembered."""

    execution_id: str


WakeDelivery = Union[Delivered, Dropped]


def _check_execution_id(execution_id: object) -> str:
    if not isinstance(execution_id, str) or not execution_id:
        raise ValueError(f"execution_id must be a non-empty string, got {execution_id!r}")
    return execution_id


def _check_timeout(timeout: object) -> float:
    # No "wait forever": an edge-triggered bus may miss a cross-process change, so every wait must end in a poll.
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout must be a number of seconds, got {timeout!r}")
    t = float(timeout)
    if not math.isfinite(t) or t < 0 or t > threading.TIMEOUT_MAX:
        raise ValueError(
            f"timeout must be finite, >= 0 and <= {threading.TIMEOUT_MAX} seconds, got {timeout!r}; "
            "the bus only shortens a poll, so every wait needs a bounded poll interval"
        )
    return t


class Subscription:
    """One waiter's registration on one execution id; a context manager that unregisters on exit.

    Owned by one thread: that thread waits on it. Any thread may ``wake`` the id."""

    __slots__ = ("_bus", "_execution_id", "_cond", "_latched", "_closed")

    def __init__(self, bus: WakeBus, execution_id: str) -> None:
        self._bus = bus
        self._execution_id = execution_id
        # Shares the bus lock: the latch is set and read under the same lock the waiter blocks on.
        self._cond = threading.Condition(bus._lock)
        self._latched = False
        self._closed = False

    @property
    def execution_id(self) -> str:
        """The execution this subscription listens to."""
        return self._execution_id

    @property
    def closed(self) -> bool:
        """True once the subscription has been unregistered."""
        return self._closed

    def wait(self, timeout: float) -> WakeOutcome:
        """Block until a wake arrives (``Woken``) or ``timeout`` seconds pass (``TimedOut``).

        Returns ``Woken`` at once when a wake arrived since the subscription was created or since the last
        ``Woken``, even if no thread was blocked at that moment; consumes that latch."""
        t = _check_timeout(timeout)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"subscription to {self._execution_id!r} is closed; subscribe again")
            if not self._latched:
                deadline = time.monotonic() + t
                while not self._latched:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return TimedOut(self._execution_id, t)
                    # Spurious returns and notify-before-latch races are absorbed by the loop re-checking.
                    self._cond.wait(remaining)
            self._latched = False
            return Woken(self._execution_id)

    def close(self) -> None:
        """Unregister (idempotent). A latched but unconsumed wake is discarded with the subscription."""
        self._bus._unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class WakeBus:
    """Edge-triggered, in-process wake signals keyed by execution id; thread-safe. See the module docstring for
    the subscribe → check → wait discipline that makes it lossless."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscriptions: dict[str, set[Subscription]] = {}

    def subscribe(self, execution_id: str) -> Subscription:
        """Register a waiter on ``execution_id`` *before* checking durable state; use it as a context manager."""
        _check_execution_id(execution_id)
        sub = Subscription(self, execution_id)
        with self._lock:
            self._subscriptions.setdefault(execution_id, set()).add(sub)
        return sub

    def wake(self, execution_id: str) -> WakeDelivery:
        """Signal every live subscription on ``execution_id``. Call it after the durable write commits."""
        _check_execution_id(execution_id)
        with self._lock:
            subs = self._subscriptions.get(execution_id)
            if not subs:
                return Dropped(execution_id)
            for sub in subs:
                sub._latched = True
                sub._cond.notify()
            return Delivered(execution_id, len(subs))

    def await_wake(self, execution_id: str, timeout: float) -> WakeOutcome:
        """Subscribe, wait up to ``timeout`` seconds for the *next* wake, unsubscribe.

        Only wakes that arrive after this call starts count; a caller that must not miss one between its own
        store check and this call uses :meth:`subscribe` instead."""
        _check_timeout(timeout)  # refuse before registering anything
        with self.subscribe(execution_id) as sub:
            return sub.wait(timeout)

    def waiters(self, execution_id: str) -> int:
        """How many live subscriptions ``execution_id`` has (for tests and diagnostics)."""
        _check_execution_id(execution_id)
        with self._lock:
            return len(self._subscriptions.get(execution_id, ()))

    def watched(self) -> int:
        """How many execution ids have at least one live subscription (0 when every wait has been abandoned)."""
        with self._lock:
            return len(self._subscriptions)

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub._closed:
                return
            sub._closed = True
            sub._latched = False
            subs = self._subscriptions.get(sub._execution_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subscriptions[sub._execution_id]


class NoopWakeBus(WakeBus):
    """A bus that drops every wake: waits always run to their timeout. For tests that pin the polling fallback.

    Registrations are still tracked, so ``waiters`` and the no-leak guarantee hold as on the real bus."""

    def wake(self, execution_id: str) -> WakeDelivery:
        """Drop the wake (``Dropped``), whatever is subscribed."""
        _check_execution_id(execution_id)
        return Dropped(execution_id)
