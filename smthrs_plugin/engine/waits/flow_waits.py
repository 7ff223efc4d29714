"""Durable waits as flow code calls them: ``sp.sleep``, ``sp.sleep_until``, ``sp.wait_for``, ``sp.complete``.

Invariants:

- A sleep is a durable clock of the current run (``waits.WaitStore``): the FIRST call schedules it (fenced on the
  run's owner) with an absolute deadline; every re-execution of the same flow (after a park, a crash or a steal)
  gets ``Existing`` with the ORIGINAL deadline, so a restart never extends nor shortens a sleep. A sleep returns
  only once ``clock.now_ms() >= due_at_ms`` (or the clock was already fired, which happens only at or after its
  deadline).
- ``wait_for(name)`` subscribes to the wake bus FIRST, then checks the store, then waits (the lost-wakeup rule of
  ``engine/wakebus.py``): an in-process completion wakes it at once, a completion from another process is seen at the
  next poll (``poll_s``). The completion is marked consumed (fenced) BEFORE its value is returned.
- Waiting longer than the run's remaining in-process budget parks the run instead: the wait raises
  :class:`~.context.RunParked` (a ``BaseException``), the driver parks the run (``timer`` with the stored
  deadline, or ``event`` with the deferred's token) and the process may exit. Any driver that later claims the
  run re-executes the flow; settled work replays (``@step``/plan attempts, completed clocks and deferreds).
- Every wait is a cancellation point: an interrupt of the run (cancellation, shutdown, lost fence) raises its
  control-flow exception from inside the wait.
- Unnamed waits are named ``sleep:<n>`` / by order of call within one drive, so a flow must call its unnamed
  waits in the same order on every re-execution (as in Temporal); name them when that does not hold (threads).
- **Telling the run's host.** A run parked inside a host that continues it on its own (a Prefect deployment's
  flow run, ``prefect/_deployment.py``) must hear that its wait was answered. Whoever answers it (``complete``
  here, the control plane's approve/deny/signal/cancel) calls a :data:`HostWaker` AFTER its commit, through
  :func:`tell_host`: the answer is durable whatever the host says, a host that cannot be reached is a
  :class:`HostWakeFailed` logged with its cause (the run stays woken for any ``smthrs worker``), never an
  exception that would read as "the answer was not recorded". Core code never picks the waker: the composition
  root injects it (``Control(waker=...)``; :func:`set_default_host_waker` for ``complete`` called without one).

Prior art: Temporal's ``workflow.sleep`` / signals, the reference driver's deferreds and clocks.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ...errors import WaitError
from ...records.journal import Journal
from ...records.wait_rows import ClockRecord, Completed, DeferredRecord, Existing, NotFound, deferred_token
from ...records.waits import WaitStore
from ...settings import load_settings
from ...stores.database import Database, open_database
from ..context import DEFAULT_BUS, RunContext, RunParked, check_wait_allowed, current_run, maybe_current_run
from ..wakebus import WakeBus, Woken

__all__ = [
    "sleep",
    "sleep_until",
    "wait_for",
    "complete",
    "deadline_ms",
    "HostWoken",
    "HostNotParked",
    "HostWakeFailed",
    "HostWake",
    "HostWaker",
    "host_wake_json",
    "tell_host",
    "set_default_host_waker",
    "default_host_waker",
]

log = logging.getLogger(__name__)


def deadline_ms(when: datetime | str) -> int:
    """Epoch milliseconds of an aware ``datetime`` or an ISO-8601 string with an offset (``Z`` accepted);
    ``WaitError(invalid_wait)`` for a naive or malformed time (refused before anything is written)."""
    if isinstance(when, str):
        text = when.strip()
        try:
            parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        except ValueError as exc:
            raise WaitError(
                "invalid_wait",
                f"{when!r} is not an ISO-8601 time; write e.g. 2030-01-01T00:00:00Z",
                cause=exc,
            ) from exc
        when = parsed
    if not isinstance(when, datetime):
        raise WaitError(
            "invalid_wait", f"a deadline is a datetime or an ISO-8601 string, not {type(when).__name__}"
        )
    if when.tzinfo is None or when.utcoffset() is None:
        raise WaitError(
            "invalid_wait",
            f"{when.isoformat()} has no time zone; give an offset (…Z or …+02:00) so every process reads the same "
            "instant",
        )
    ms = math.floor(when.timestamp() * 1000)
    if ms < 0:
        raise WaitError("invalid_wait", f"{when.isoformat()} is before 1970")
    return ms


def _check_seconds(seconds: Any) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise WaitError("invalid_wait", f"sleep takes a number of seconds, not {seconds!r}")
    s = float(seconds)
    if not math.isfinite(s) or s < 0:
        raise WaitError(
            "invalid_wait", f"sleep takes a finite, non-negative number of seconds, not {seconds!r}"
        )
    return s


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 1024 or "\x00" in name:
        raise WaitError(
            "invalid_wait", f"a wait name must be a non-empty string (at most 1024 chars), not {name!r}"
        )
    return name


def sleep(seconds: float, *, name: str | None = None) -> None:
    """Sleep ``seconds`` on a durable clock of the current run (the deadline is fixed at the first call)."""
    s = _check_seconds(seconds)
    check_wait_allowed("sp.sleep")
    ctx = current_run()
    label = _check_name(name) if name is not None else ctx.next_name("sleep")
    sleep_to(ctx, label, ctx.clock.now_ms() + math.ceil(s * 1000))


def sleep_until(when: datetime | str, *, name: str | None = None) -> None:
    """Sleep until ``when`` (aware datetime or ISO-8601 with offset) on a durable clock of the current run."""
    due = deadline_ms(when)
    check_wait_allowed("sp.sleep_until")
    ctx = current_run()
    label = _check_name(name) if name is not None else ctx.next_name("sleep")
    sleep_to(ctx, label, due)


def sleep_to(
    ctx: RunContext, name: str, due_at_ms: int, stop: Callable[[], None] | None = None
) -> ClockRecord:
    """Schedule (or find) the clock ``name`` at ``due_at_ms`` and wait for it in-process or park; returns the clock
    as scheduled (its ``due_at_ms`` is the stored one). The seam plan timer nodes use.

    ``stop``: called before each wait and at least every ``ctx.poll_s``; it raises to end the wait early (a plan
    timer node's pass cancelled). The run's own interrupt always wakes the wait at once."""
    outcome = ctx.waits.schedule_clock(ctx.run_id, name, due_at_ms, ctx.owner)
    record = outcome.record
    while record.pending:
        ctx.raise_if_interrupted()
        if stop is not None:
            stop()
        remaining = (record.due_at_ms - ctx.clock.now_ms()) / 1000
        if remaining <= 0:
            # Completed, or AlreadyCompleted by a driver's fire: either way the deadline has passed.
            ctx.waits.complete_clock(record.flow, record.execution_id, record.name)
            break
        if remaining > ctx.budget_left_s:
            raise ctx.parked(RunParked(ctx.run_id, "timer", name, due_at_ms=record.due_at_ms))
        started = ctx.clock.monotonic()
        # A clock waits on one event (the interrupt): a stop check is looked at every poll.
        ctx.clock.wait(ctx.interrupt, remaining if stop is None else min(remaining, ctx.poll_s))
        ctx.spend(ctx.clock.monotonic() - started)
    return record


def wait_for(name: str) -> Any:
    """The value another party completes the deferred ``name`` of the current run with (``sp.complete``)."""
    label = _check_name(name)
    check_wait_allowed("sp.wait_for")
    ctx = current_run()
    with ctx.bus.subscribe(ctx.run_id) as sub:  # subscribe BEFORE checking: no wake can fall in between
        while True:
            ctx.stats.checks += 1
            found = ctx.waits.deferred(ctx.flow, ctx.run_id, label)
            if found is not None:
                consumed = ctx.waits.consume_deferred(ctx.run_id, label, ctx.owner)
                assert not isinstance(consumed, NotFound)  # a completion is never removed
                return consumed.value
            ctx.raise_if_interrupted()
            left = ctx.budget_left_s
            if left <= 0:
                raise ctx.parked(RunParked(ctx.run_id, "event", label, token=deferred_token(label)))
            started = ctx.clock.monotonic()
            outcome = sub.wait(min(ctx.poll_s, left))
            ctx.spend(ctx.clock.monotonic() - started)
            if isinstance(outcome, Woken):
                ctx.stats.woken += 1
            else:
                ctx.stats.timed_out += 1


def complete(
    run_id: str,
    name: str,
    value: Any,
    *,
    db: Database | str | None = None,
    bus: WakeBus | None = None,
    waker: HostWaker | None = None,
) -> Completed[DeferredRecord] | Existing[DeferredRecord]:
    """Complete the deferred ``name`` of run ``run_id`` with ``value`` (plain JSON). First writer wins: the
    second caller gets ``Existing`` with the first value. A run parked on it is woken in the same transaction;
    after the commit, in-process waiters are woken on ``bus`` (default: the process-wide bus) and the run's host
    is told through ``waker`` (default: :func:`default_host_waker`, the installed plugins' — so a parked flow run
    of a Prefect deployment is resumed through the Prefect API). A host that cannot be reached is logged with its
    cause (:func:`tell_host`); the completion stands and any ``smthrs worker`` still continues the run.

    ``db``: a :class:`Database` or URL; default: the current run's database inside a run, else ``SMTHRS_DB_URL``
    (``<workspace>/.smthrs/state.db``)."""
    if isinstance(db, Database):
        store = WaitStore(db)
    elif isinstance(db, str):
        store = WaitStore(open_database(db))
    else:
        ctx = maybe_current_run()
        store = ctx.waits if ctx is not None else WaitStore(open_database(load_settings().resolved_db_url))
    outcome = store.complete_deferred(run_id, name, value, wake=True)
    if isinstance(outcome, Completed):
        (bus or DEFAULT_BUS).wake(run_id)
        # Told whether or not this transaction woke the run: a flow run that parks right after this commit finds
        # the completion on its own re-check, one already parked is resumed here — the host ignores a second ask.
        tell_host(waker if waker is not None else default_host_waker(), run_id, store.journal)
    return outcome


# -- telling a run's host that its wait was answered ----------------------------------------------------------
@dataclass(frozen=True)
class HostWoken:
    """The run's host was told and will execute the run again (``detail``: e.g. the flow run scheduled now)."""

    run_id: str
    host: str
    detail: str


@dataclass(frozen=True)
class HostNotParked:
    """Nothing to tell: no host continues this run on its own (``host`` None — a ``smthrs worker`` or a resume
    drives it), or the host's execution is not parked (already running again, or about to)."""

    run_id: str
    host: str | None
    detail: str


@dataclass(frozen=True)
class HostWakeFailed:
    """The host could not be told (``detail`` says why and what to do). The answer is durable regardless."""

    run_id: str
    host: str
    detail: str
    cause: BaseException | None = field(default=None, compare=False, repr=False)


HostWake = HostWoken | HostNotParked | HostWakeFailed


def host_wake_json(wake: HostWake | None) -> dict[str, Any] | None:
    """The plain-JSON form of a wake outcome for answers (CLI ``--json``, ``smthrs serve``): ``{"type", "run_id",
    "host", "detail"}`` (the cause is in ``detail``; the exception object itself is never serialised)."""
    if wake is None:
        return None
    return {"type": type(wake).__name__, "run_id": wake.run_id, "host": wake.host, "detail": wake.detail}


#: ``waker(run_id, journal) -> HostWake``: tell the host of ``run_id`` that the run's durable state changed (a wait
#: answered, a cancellation) so it executes the run again. Called after the commit, never inside a transaction;
#: ``journal`` is the run's database journal (where a host finds which of its executions the run is).
HostWaker = Callable[[str, Journal], HostWake]

_DEFAULT_WAKER: Callable[[], HostWaker | None] | None = None
_DEFAULT_LOCK = threading.Lock()


def set_default_host_waker(factory: Callable[[], HostWaker | None] | None) -> None:
    """Install what :func:`default_host_waker` answers (the composition root, ``runtime.py``, installs the
    plugins' waker at import). ``None`` removes it."""
    global _DEFAULT_WAKER
    with _DEFAULT_LOCK:
        _DEFAULT_WAKER = factory


def default_host_waker() -> HostWaker | None:
    """The process-wide waker used by :func:`complete` called without ``waker`` (``None``: none installed)."""
    with _DEFAULT_LOCK:
        factory = _DEFAULT_WAKER
    return None if factory is None else factory()


def tell_host(waker: HostWaker | None, run_id: str, journal: Journal) -> HostWake | None:
    """Call ``waker`` for ``run_id`` after a commit (``None`` when there is no waker). A waker that raises is
    answered :class:`HostWakeFailed` carrying the exception; every failure is logged at WARNING with its cause —
    the committed answer stands, and the caller reports the failure rather than raising it."""
    if waker is None:
        return None
    try:
        outcome = waker(run_id, journal)
    except Exception as exc:  # reported below and answered: the durable decision must not read as refused
        outcome = HostWakeFailed(
            run_id,
            getattr(waker, "host", None) or type(waker).__name__,
            f"the host waker raised {type(exc).__name__}: {exc}",
            exc,
        )
    if not isinstance(outcome, (HostWoken, HostNotParked, HostWakeFailed)):
        outcome = HostWakeFailed(
            run_id,
            getattr(waker, "host", None) or type(waker).__name__,
            f"the host waker answered {outcome!r}, not HostWoken | HostNotParked | HostWakeFailed",
        )
    if isinstance(outcome, HostWakeFailed):
        log.warning(
            "run %s: its wait was answered (durably), but its %s host could not be told: %s. A `smthrs worker "
            "--flow MODULE:FLOW` registering its flow continues it meanwhile",
            run_id,
            outcome.host,
            outcome.detail,
            exc_info=outcome.cause,
        )
    return outcome
