"""The run driver: claim → activate → heartbeat + cancellation poll → drive the registered flow → park or settle;
plus the sweeps and clock fires that re-drive runs nobody is driving.

Invariants:

- **One path.** Every drive — a direct :meth:`RunDriver.drive`, a fired clock, a woken or released run, a stale
  run stolen from a dead owner, a cancellation — holds a run lease (``engine/lease.py``: the ordinary
  claim/steal/activate arbitration of ``ownership/arbiter.py``) and ends in exactly one durable transition. A
  process never drives the same run twice at once.
- **Registry.** ``register(flow, fn)`` maps a flow name to ``fn(ctx) -> value | FlowCompleted | FlowFailed |
  FlowParked`` (or raising). Registration does its own recovery: it re-arms the flow's pending clocks
  (``pending_clocks``) and wakes runs parked on a completion that arrived while nothing was listening
  (``completed_deferreds``); both exclude settled runs, and a corrupt row costs only itself (a warning).
- **Unregistered flows.** A run of a flow this process has not registered is never executed: it is left parked
  (a stolen one is released at once) with ONE warning per run naming the run id and the flow, so a process that
  registers the flow still reclaims it. Cancelling needs no flow code: the cancel sweep settles any flow's runs.
- **Sweeps** run on the heartbeat cadence (``tick``): clock fires (due clocks of registered flows, retried
  100 ms doubling to 30 s, forever, by default), (1) parked and pending runs with a cancellation request,
  (2) runs parked ``released`` and pending runs of registered flows, (3) stale ``running`` rows (64 per tick,
  oldest heartbeat first, refusal backoff: ``ownership/stale_sweep.py``). In between, the loop sleeps until the
  earliest deadline this process knows of, so a clock armed here fires at its deadline rather than at the next
  tick.
- **Shutdown releases, never cancels.** :meth:`RunDriver.stop` interrupts the runs it drives with ``shutdown``
  (their waits raise ``RunReleased``), waits a grace period, then releases whatever is still running; every run
  ends ``suspended``/``released`` (claimable at once by any driver), never ``cancelled``.
- Background drives run on daemon threads (at most ``max_runs`` at once), so a flow stuck in a computation cannot
  keep a stopping process alive; its later writes are fenced off once its run is released.

Prior art: Temporal workers (poll, lease, heartbeat, timers).
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._clock import SYSTEM_CLOCK, Clock
from ..._metrics import NULL_METRICS, MetricsPort
from ...errors import FenceLost, StoreError, WaitError
from ...records.journal import Journal
from ...records.runs import Created, Existing, OwnerId, RunStore
from ...records.wait_rows import ClockRecord, Completed, TimerWait, Woken
from ...records.waits import WaitStore
from ...settings import Settings, load_settings
from ...stores.database import Database
from ..context import DEFAULT_BUS, RunCancelled, RunContext, RunParked, RunReleased
from ..lease import (
    EXISTING,
    DriveLost,
    DriveNotClaimed,
    DriveOutcome,
    DriveParked,
    DriveReleased,
    DriveUnregistered,
    Refused,
    RunLease,
    acquire,
)
from ..ownership.arbiter import Activated, ClaimLost, Ownership
from ..ownership.liveness import LivenessCheck
from ..ownership.stale_sweep import STALE_SWEEP_BATCH, StaleSweep, SweepTick
from ..wakebus import WakeBus
from ._sweeps import SWEEP_BATCH, RetryPolicy, cancel_candidates, runnable_candidates

__all__ = ["RunDriver", "FlowFn", "Registration", "TickReport", "RetryPolicy"]

log = logging.getLogger(__name__)

FlowFn = Callable[[RunContext], Any]
_CONTROL_FLOW = (RunParked, RunCancelled, RunReleased)
_MAX_ARMED = 10_000


@dataclass(frozen=True)
class Registration:
    """What registering a flow recovered: clocks re-armed, runs woken for completions nobody had consumed."""

    flow: str
    clocks_armed: int
    woken: tuple[str, ...]


@dataclass(frozen=True)
class TickReport:
    """One sweep pass: clocks fired, clocks whose fire failed (now retrying), and the drives each sweep started."""

    fired: tuple[tuple[str, str], ...]
    retrying: tuple[tuple[str, str], ...]
    cancelling: tuple[str, ...]
    runnable: tuple[str, ...]
    stale: SweepTick


@dataclass
class _Retry:
    failures: int
    next_ms: int


class RunDriver:
    """Drives registered flows' runs in this process (see the module invariants). Thread-safe."""

    def __init__(
        self,
        db: Database,
        *,
        settings: Settings | None = None,
        owner: OwnerId | None = None,
        clock: Clock = SYSTEM_CLOCK,
        bus: WakeBus | None = None,
        liveness: LivenessCheck | None = None,
        journal: Journal | None = None,
        waits: WaitStore | None = None,
        wait_budget_s: float | None = None,
        wait_poll_s: float | None = None,
        tick_s: float | None = None,
        clock_retry: RetryPolicy = RetryPolicy(),
        max_runs: int = 8,
        batch: int = SWEEP_BATCH,
        stale_batch: int = STALE_SWEEP_BATCH,
        metrics: MetricsPort = NULL_METRICS,
    ) -> None:
        if not isinstance(max_runs, int) or isinstance(max_runs, bool) or max_runs < 1:
            raise WaitError("invalid_wait", f"max_runs must be a positive int, got {max_runs!r}")
        self.db = db
        self.settings = settings or load_settings()
        self.clock = clock
        self.bus = bus or DEFAULT_BUS
        self.journal = journal or Journal(db, clock=clock)
        self.runs = RunStore(db, journal=self.journal, clock=clock)
        self.waits = waits or WaitStore(db, journal=self.journal, runs_store=self.runs, clock=clock)
        self.ownership = Ownership(
            db, owner=owner, journal=self.journal, liveness=liveness, settings=self.settings, clock=clock
        )
        self.owner = self.ownership.owner
        self.stale = StaleSweep(self.ownership, batch=stale_batch)
        self.budget_s = self.settings.wait_budget_s if wait_budget_s is None else wait_budget_s
        self.poll_s = self.settings.wait_poll_s if wait_poll_s is None else wait_poll_s
        self.tick_s = self.settings.heartbeat_interval_s if tick_s is None else tick_s
        self.clock_retry = clock_retry
        self.max_runs = max_runs
        self.batch = batch
        self.metrics = metrics
        self.outcomes: list[DriveOutcome] = []  #: outcomes of background drives, in completion order
        self._registry: dict[str, FlowFn] = {}
        self._lock = threading.RLock()
        self._claimed: set[str] = set()  # runs this process is driving (or about to)
        self._active: dict[str, RunLease] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._warned: set[str] = set()
        self._skip: set[str] = set()  # runs this process gave back as undrivable: its sweeps leave them alone
        self._retries: dict[tuple[str, str, str], _Retry] = {}
        self._given_up: set[tuple[str, str, str]] = set()
        self._wakeups: list[int] = []
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._drained = threading.Condition(self._lock)

    # -- registry ---------------------------------------------------------------------------------------------
    @property
    def flows(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(self._registry))

    def register(self, flow: str, fn: FlowFn) -> Registration:
        """Register ``fn`` for ``flow`` and recover the flow's durable waits (see the module invariants)."""
        if not isinstance(flow, str) or not flow or len(flow) > 1024:
            raise WaitError("invalid_wait", f"a flow name must be a non-empty string, not {flow!r}")
        if not callable(fn):
            raise WaitError(
                "invalid_wait", f"the code registered for flow {flow!r} must be callable, not {fn!r}"
            )
        with self._lock:
            self._registry[flow] = fn
            self._skip.clear()  # what this process could not drive before, it may now
        armed = 0
        after: tuple[int, str, str, str] | None = None
        while True:
            page = self.waits.pending_clocks([flow], limit=500, after=after)
            for c in page:
                armed += self._arm(c.due_at_ms)
            if len(page) < 500:
                break
            after = _clock_key(page[-1])
        woken: list[str] = []
        d_after: tuple[str, str] | None = None
        while True:
            dpage = self.waits.completed_deferreds(flow, limit=500, after=d_after)
            for d in dpage:
                if isinstance(self.waits.wake_for_deferred(d.execution_id, d.name), Woken):
                    woken.append(d.execution_id)
            if len(dpage) < 500:
                break
            d_after = (dpage[-1].execution_id, dpage[-1].name)
        self._kick.set()
        return Registration(flow, armed, tuple(woken))

    def submit(self, run_id: str, flow: str, *, parent_run_id: str | None = None) -> Created | Existing:
        """Create a ``pending`` run of ``flow`` (first writer wins); a running driver picks it up on its next tick."""
        out = self.runs.create(run_id, flow, parent_run_id=parent_run_id)
        self._kick.set()
        return out

    # -- driving ---------------------------------------------------------------------------------------------
    def drive(self, run_id: str) -> DriveOutcome:
        """Claim ``run_id`` and drive it to its next durable transition, on this thread."""
        if not self._reserve(run_id):
            return DriveNotClaimed(
                run_id, ClaimLost(run_id, self.owner, "this process is already driving it")
            )
        try:
            return self._drive_reserved(run_id, None)
        finally:
            self._unreserve(run_id)

    def _drive_reserved(self, run_id: str, activated: Activated | None) -> DriveOutcome:
        if activated is None:
            record = self.runs.get(run_id)
            if record is None:
                raise StoreError(
                    "not_found", f"run {run_id!r} does not exist; submit it first", run_id=run_id
                )
            flow = record.flow
            fn = self._fn(flow)
            if fn is None and record.cancel_requested_at_ms is None:
                self._warn_unregistered(run_id, flow)
                return DriveUnregistered(run_id, flow)
            claimed = acquire(
                run_id,
                flow,
                EXISTING,
                ownership=self.ownership,
                runs=self.runs,
                waits=self.waits,
                metrics=self.metrics,
                budget_s=self.budget_s,
                poll_s=self.poll_s,
                bus=self.bus,
            )
            if isinstance(claimed, Refused):
                return DriveNotClaimed(run_id, claimed.decision)
            lease = claimed
        else:
            record = self.runs.get(run_id)
            if record is None:
                return DriveLost(run_id, "the run was deleted")
            # The stale sweep stole it through the arbiter already: hold what it activated.
            lease = RunLease(
                activated,
                record.flow,
                ownership=self.ownership,
                runs=self.runs,
                waits=self.waits,
                budget_s=self.budget_s,
                poll_s=self.poll_s,
                bus=self.bus,
            )
        with self._lock:
            self._active[run_id] = lease
        try:
            with lease:
                return self._execute(lease)
        finally:
            with self._lock:
                self._active.pop(run_id, None)

    def _execute(self, active: RunLease) -> DriveOutcome:
        run_id, flow = active.run_id, active.flow
        if active.cancel_requested:
            return self._after(
                active.conclude(error=RunCancelled(run_id, active.context.cancel_requested_at_ms))
            )
        fn = self._fn(flow)
        if fn is None:
            self._warn_unregistered(run_id, flow)
            active.conclude(error=RunReleased(run_id, "unregistered-flow"))
            with self._lock:
                self._skip.add(run_id)
            return DriveUnregistered(run_id, flow)
        if self._stop.is_set():  # shutting down: give the run back before any of its code runs
            return self._after(active.conclude(error=RunReleased(run_id, "shutdown")))
        with active.activated() as ctx:
            try:
                result = fn(ctx)
            except BaseException as exc:
                outcome = self._after(active.conclude(error=exc))
                if not isinstance(exc, (Exception, *_CONTROL_FLOW)):
                    raise  # KeyboardInterrupt / SystemExit: the run was released; the process must still stop
                if isinstance(exc, Exception) and not isinstance(exc, FenceLost):
                    log.warning("run %r of flow %r failed: %r", run_id, flow, exc)
                return outcome
        return self._after(active.conclude(result))

    def _after(self, outcome: DriveOutcome) -> DriveOutcome:
        if isinstance(outcome, DriveParked) and isinstance(outcome.wait, TimerWait):
            self._arm(outcome.wait.wake_at_ms)
        if isinstance(outcome, DriveReleased) and outcome.cause == "refused":
            # The flow refused the run (e.g. a plan file that no longer matches the run's recorded plan): re-driving
            # it every tick would spin; leave it released for a process (or an operator) that can drive it.
            with self._lock:
                self._skip.add(outcome.run_id)
            log.warning("run %r was refused by its flow code here; leaving it released", outcome.run_id)
        return outcome

    def _fn(self, flow: str) -> FlowFn | None:
        with self._lock:
            return self._registry.get(flow)

    def _warn_unregistered(self, run_id: str, flow: str) -> None:
        with self._lock:
            if run_id in self._warned:
                return
            self._warned.add(run_id)
        log.warning(
            "run %r belongs to flow %r, which this process has not registered: leaving it parked for a process "
            "that registers the flow (register it with RunDriver.register / smthrs worker --flow)",
            run_id,
            flow,
        )

    def _reserve(self, run_id: str, *, background: bool = False) -> bool:
        with self._lock:
            if run_id in self._claimed:
                return False
            if background and len(self._threads) >= self.max_runs:
                return False
            self._claimed.add(run_id)
            return True

    def _unreserve(self, run_id: str) -> None:
        with self._lock:
            self._claimed.discard(run_id)
            self._threads.pop(run_id, None)
            self._drained.notify_all()

    def _spawn(self, run_id: str, activated: Activated | None = None, *, cancelling: bool = False) -> bool:
        if run_id in self._skip and not cancelling:
            return False
        if self._stop.is_set() or not self._reserve(run_id, background=True):
            return False
        t = threading.Thread(
            target=self._background, args=(run_id, activated), name=f"smthrs-drive-{run_id}", daemon=True
        )
        with self._lock:
            self._threads[run_id] = t
        t.start()
        return True

    def _background(self, run_id: str, activated: Activated | None) -> None:
        try:
            outcome = self._drive_reserved(run_id, activated)
        except StoreError as exc:
            if exc.code == "decode_failed":
                # A corrupt run row costs only itself: reported once, then left alone by this process's sweeps.
                with self._lock:
                    self._skip.add(run_id)
                log.warning("storage integrity: not driving run %r: %s", run_id, exc)
            else:
                log.exception("driving run %r failed; the sweeps will retry it", run_id)
            return
        except Exception:
            log.exception("driving run %r failed; the sweeps will retry it", run_id)
            return
        finally:
            self._unreserve(run_id)
            self._kick.set()
        with self._lock:
            self.outcomes.append(outcome)

    def drain(self, timeout: float | None = 60.0) -> list[DriveOutcome]:
        """Wait until no background drive is running; returns every background outcome so far."""
        with self._lock:
            self._drained.wait_for(lambda: not self._threads, timeout)
            return list(self.outcomes)

    # -- sweeps ------------------------------------------------------------------------------------------------
    def tick(self) -> TickReport:
        """One pass of clock fires and the three sweeps (see the module invariants); drives start in the
        background."""
        flows = self.flows
        fired, retrying = self._fire_due(flows)
        cancelling = tuple(
            c.run_id
            for c in cancel_candidates(self.waits, limit=self.batch)
            if self._spawn(c.run_id, cancelling=True)
        )
        runnable = tuple(
            c.run_id
            for c in runnable_candidates(self.waits, flows, limit=self.batch)
            if self._spawn(c.run_id)
        )
        stale = self.stale.tick()
        for run_id, decision in stale.probed:
            if isinstance(decision, Activated) and not self._spawn(run_id, decision):
                # Stolen but this process is at capacity (or stopping): give it back at once, claimable by anyone.
                try:
                    self.ownership.release(run_id, cause="driver-busy")
                except FenceLost:
                    pass  # already taken over again: nothing of ours to give back
        return TickReport(tuple(fired), tuple(retrying), cancelling, runnable, stale)

    def _fire_due(self, flows: tuple[str, ...]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        fired: list[tuple[str, str]] = []
        retrying: list[tuple[str, str]] = []
        if not flows:
            return fired, retrying
        now = self.clock.now_ms()
        after: tuple[int, str, str, str] | None = None
        while len(fired) + len(retrying) < self.batch:
            page = self.waits.due_clocks(now, flows, limit=self.batch, after=after)
            for rec in page:
                key = (rec.flow, rec.execution_id, rec.name)
                r = self._retries.get(key)
                if key in self._given_up or (r is not None and r.next_ms > now):
                    continue  # read past it: a retrying clock must not starve the ones behind it
                try:
                    out = self.waits.complete_clock(rec.flow, rec.execution_id, rec.name, wake=True)
                except StoreError as exc:
                    failures = 1 if r is None else r.failures + 1
                    delay = self.clock_retry.delay(failures)
                    if delay is None:
                        self._given_up.add(key)
                        log.error("giving up firing clock %r after %d failures: %s", key, failures - 1, exc)
                        continue
                    self._retries[key] = _Retry(failures, now + int(delay * 1000))
                    self._arm(now + int(delay * 1000))
                    log.warning("firing clock %r failed (retry %d in %.3fs): %s", key, failures, delay, exc)
                    retrying.append((rec.execution_id, rec.name))
                    continue
                self._retries.pop(key, None)
                fired.append((rec.execution_id, rec.name))
                if isinstance(out, Completed) and isinstance(out.wake, Woken):
                    self._spawn(rec.execution_id)
            if len(page) < self.batch:
                break
            after = _clock_key(page[-1])
        return fired, retrying

    @property
    def retry_state(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """Clocks whose fire failed: key → (consecutive failures, next attempt at epoch ms)."""
        with self._lock:
            return {k: (r.failures, r.next_ms) for k, r in self._retries.items()}

    def _arm(self, at_ms: int) -> int:
        with self._lock:
            if len(self._wakeups) >= _MAX_ARMED:
                return 0  # the tick's due-clock scan covers the rest; the heap only makes known deadlines precise
            heapq.heappush(self._wakeups, at_ms)
        self._kick.set()
        return 1

    def _next_wait_s(self) -> float:
        now = self.clock.now_ms()
        with self._lock:
            while self._wakeups and self._wakeups[0] <= now:
                heapq.heappop(self._wakeups)
            nearest = self._wakeups[0] if self._wakeups else None
        if nearest is None:
            return self.tick_s
        return max(0.0, min(self.tick_s, (nearest - now) / 1000))

    # -- the loop --------------------------------------------------------------------------------------------
    def start(self) -> RunDriver:
        """Run the sweep loop on a background thread until :meth:`stop`."""
        with self._lock:
            if self._loop is not None:
                return self
            self._loop = threading.Thread(target=self.serve, name="smthrs-driver", daemon=True)
        self._loop.start()
        return self

    def serve(self) -> None:
        """Run the sweep loop on this thread until :meth:`stop` is called (from another thread or a signal)."""
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                # A store outage must not kill the worker: report it and try again next tick.
                log.exception("run driver tick failed; retrying on the next tick")
            if self._stop.is_set():
                break
            self.clock.wait(self._kick, self._next_wait_s())
            self._kick.clear()

    def interrupt(self) -> None:
        """Begin a shutdown without waiting (safe from a signal handler): no new drive starts, a drive about to run
        its flow releases the run instead, and every running flow's next wait raises ``RunReleased("shutdown")``."""
        self._stop.set()
        self._kick.set()
        with self._lock:
            active = list(self._active.values())
        for a in active:
            a.context.interrupt_with("shutdown")

    def stop(self, *, grace_s: float = 10.0) -> list[DriveOutcome]:
        """Shut down: stop sweeping, interrupt the runs being driven (``shutdown``), wait up to ``grace_s`` for
        them, release whatever still runs. Never cancels anything. Returns the background outcomes."""
        self.interrupt()
        loop = self._loop
        if loop is not None and loop is not threading.current_thread():
            loop.join(grace_s)
        self.interrupt()  # drives the loop started while it was finishing its last tick
        self.drain(grace_s)
        with self._lock:
            stragglers = list(self._active.values())
        for a in stragglers:
            a.stop_heartbeat()
            try:
                out: DriveOutcome = a.release("shutdown")
            except FenceLost as exc:
                out = DriveLost(a.run_id, exc.message)
            with self._lock:
                self.outcomes.append(out)
        return list(self.outcomes)

    def __enter__(self) -> RunDriver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _clock_key(c: ClockRecord) -> tuple[int, str, str, str]:
    return (c.due_at_ms, c.flow, c.execution_id, c.name)
