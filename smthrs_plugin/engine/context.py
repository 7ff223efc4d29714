"""The current run: what ``sp.sleep``/``sp.wait_for`` need to know about the run they are called in.

- Whoever drives a run activates ONE :class:`RunContext` for it with :func:`activate` on the thread that executes
  the run's code (other threads copy the context). An explicit activation wins; otherwise each registered provider
  (:func:`register_provider`) is asked in order. Outside a run, :func:`current_run` refuses
  ``WaitError(no_run_context)``.
- Interrupting is cooperative and sticky: :meth:`RunContext.interrupt_with` records the FIRST reason and wakes the
  run's waiters; waits then raise that reason's control-flow exception (:meth:`raise_if_interrupted`).
- :class:`RunParked`, :class:`RunCancelled` and :class:`RunReleased` derive from ``BaseException``, so
  ``except Exception`` does not swallow them; the driver catches them and parks, cancels or releases the run.
- The in-process wait budget is per drive and cumulative; a wait that cannot finish within what is left parks the run.
- A wait parks by raising ``ctx.parked(RunParked(...))``; whatever the host substitutes is still a :class:`RunParked`.
- Waits inside :func:`waits_forbidden` (a ``@step`` body) are refused ``WaitError(invalid_wait)`` before anything is
  written.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .._clock import SYSTEM_CLOCK, Clock
from ..errors import FenceLost, WaitError
from .wakebus import WakeBus

if TYPE_CHECKING:  # annotations only: the package root imports this module, and must not load the stores
    from ..records.runs import OwnerId
    from ..records.wait_rows import Wait
    from ..records.waits import WaitStore

__all__ = [
    "RunContext",
    "WaitStats",
    "RunParked",
    "RunCancelled",
    "RunReleased",
    "InterruptReason",
    "DEFAULT_BUS",
    "activate",
    "current_run",
    "maybe_current_run",
    "register_provider",
    "ContextProvider",
    "waits_forbidden",
    "check_wait_allowed",
]

InterruptReason = Literal["cancelled", "shutdown", "fence_lost", "heartbeat_failing"]

#: The process-wide wake bus: drivers and ``sp.complete`` default to it, so an in-process completion reaches an
#: in-process waiter at once (cross-process delivery stays store-driven: the waiter's poll).
DEFAULT_BUS = WakeBus()


class RunParked(BaseException):
    """Raised by a wait that will not finish within the in-process budget: the driver parks the run.

    ``kind`` is ``timer`` (a durable clock, ``due_at_ms`` its stored deadline), ``event`` (a deferred) or
    ``approval`` (a node approval of the control plane: parked ``waiting-approval``); ``token`` the opaque wait
    token (``deferred/<name>``, or the approval token id). ``waiting`` is filled in by whoever parked the run."""

    def __init__(
        self,
        run_id: str,
        kind: Literal["timer", "event", "approval"],
        name: str,
        *,
        due_at_ms: int | None = None,
        token: str | None = None,
        waiting: Wait | None = None,
    ) -> None:
        super().__init__(f"run {run_id!r} parked on {kind} {name!r}")
        self.run_id = run_id
        self.kind = kind
        self.name = name
        self.due_at_ms = due_at_ms
        self.token = token
        self.waiting = waiting


class RunCancelled(BaseException):
    """A cancellation was requested for the run: stop; the driver settles it ``cancelled``."""

    def __init__(self, run_id: str, requested_at_ms: int | None = None) -> None:
        super().__init__(f"run {run_id!r} was cancelled")
        self.run_id = run_id
        self.requested_at_ms = requested_at_ms


class RunReleased(BaseException):
    """The driver is giving the run up (shutdown, a lapsing lease): stop; the run is released, not cancelled."""

    def __init__(self, run_id: str, cause: str) -> None:
        super().__init__(f"run {run_id!r} released ({cause})")
        self.run_id = run_id
        self.cause = cause


@dataclass
class WaitStats:
    """Counters of in-process waiting (tests and diagnostics): durable checks, bus wakes, poll time-outs."""

    checks: int = 0
    woken: int = 0
    timed_out: int = 0


@dataclass(eq=False)
class RunContext:
    """One driven run, as its code sees it. Built by a driver; read through :func:`current_run`."""

    run_id: str
    flow: str
    owner: OwnerId
    waits: WaitStore
    bus: WakeBus = field(default_factory=lambda: DEFAULT_BUS)
    clock: Clock = SYSTEM_CLOCK
    budget_s: float = 60.0
    poll_s: float = 1.0
    interrupt: threading.Event = field(default_factory=threading.Event)
    stats: WaitStats = field(default_factory=WaitStats)
    cancel_requested_at_ms: int | None = None
    #: Set by the host that owns the run (see the module invariants); ``None``: raise the signal as it is.
    on_park: Callable[[RunParked], RunParked] | None = None
    _reason: InterruptReason | None = None
    _cause: BaseException | None = None
    _spent_s: float = 0.0
    _names: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def interrupt_reason(self) -> InterruptReason | None:
        return self._reason

    def interrupt_with(
        self, reason: InterruptReason, *, cause: BaseException | None = None, at_ms: int | None = None
    ) -> None:
        """Interrupt the run's waits (the first reason sticks) and wake its bus waiters."""
        with self._lock:
            if self._reason is None:
                self._reason, self._cause = reason, cause
                if reason == "cancelled":
                    self.cancel_requested_at_ms = at_ms
            self.interrupt.set()
        self.bus.wake(self.run_id)

    def raise_if_interrupted(self) -> None:
        """Raise the control-flow exception of the interrupt, if any (a cancellation point for flow code)."""
        reason = self._reason
        if reason is None:
            return
        if reason == "cancelled":
            raise RunCancelled(self.run_id, self.cancel_requested_at_ms)
        if reason == "shutdown":
            raise RunReleased(self.run_id, "shutdown")
        if reason == "heartbeat_failing":
            raise RunReleased(self.run_id, "lease-lapsed")
        raise FenceLost(
            "fence_lost",
            f"this process lost run {self.run_id!r} to another owner; stop working on it",
            run_id=self.run_id,
            cause=self._cause,
        )

    def parked(self, signal: RunParked) -> RunParked:
        """The exception a wait raises to park this run: ``signal``, or what the run's host makes of it."""
        hook = self.on_park
        return signal if hook is None else hook(signal)

    def next_name(self, prefix: str) -> str:
        """``<prefix>:<n>`` for the n-th unnamed wait of this drive: deterministic as long as the flow calls its
        waits in the same order on every re-execution (name them explicitly where that does not hold)."""
        with self._lock:
            return f"{prefix}:{next(self._names)}"

    @property
    def budget_left_s(self) -> float:
        return max(0.0, self.budget_s - self._spent_s)

    def spend(self, seconds: float) -> None:
        """Account ``seconds`` of in-process waiting against the budget."""
        with self._lock:
            self._spent_s += max(0.0, seconds)


_CURRENT: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar("smthrs_run", default=None)


@contextmanager
def activate(ctx: RunContext) -> Iterator[RunContext]:
    """Make ``ctx`` the current run for the code inside the ``with`` block (this thread's context)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


_FORBIDDEN: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "smthrs_waits_forbidden", default=None
)


@contextmanager
def waits_forbidden(where: str) -> Iterator[None]:
    """No wait or approval may start inside this block (``where`` names it in the refusal): a host wraps code
    whose result is cached — a ``@step`` body — so a gate inside it cannot be skipped silently by a cache hit."""
    token = _FORBIDDEN.set(where)
    try:
        yield
    finally:
        _FORBIDDEN.reset(token)


def check_wait_allowed(what: str) -> None:
    """``WaitError(invalid_wait)`` when ``what`` (``sp.sleep``, ``sp.require_approval``...) is called where waits
    are forbidden; called by every public wait before it touches the store."""
    where = _FORBIDDEN.get()
    if where is not None:
        raise WaitError(
            "invalid_wait",
            f"{what} inside {where}: a step's result is cached by its inputs, so a wait or an approval inside it "
            "would be skipped by a cache hit; call it in the flow body, before or after the step",
        )


ContextProvider = Callable[[], "RunContext | None"]
_PROVIDERS: list[ContextProvider] = []


def register_provider(provider: ContextProvider) -> None:
    """Ask ``provider`` for the current run when nothing was activated on this thread (idempotent). A provider
    must be cheap when it has nothing to say: it is asked on every wait outside an explicit activation."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)


def maybe_current_run() -> RunContext | None:
    """The current run, or None outside a driven run (see the module invariants for where it comes from)."""
    ctx = _CURRENT.get()
    if ctx is not None:
        return ctx
    for provider in _PROVIDERS:
        ctx = provider()
        if ctx is not None:
            return ctx
    return None


def current_run() -> RunContext:
    """The current run; ``WaitError(no_run_context)`` outside one."""
    ctx = maybe_current_run()
    if ctx is None:
        raise WaitError(
            "no_run_context",
            "durable waits need a run: call sp.sleep/sp.wait_for/sp.require_approval inside a Prefect @flow body, "
            "a flow registered with a RunDriver (smthrs worker) or a plan node — not at module level or in a plain "
            "function outside any of them",
        )
    return ctx
