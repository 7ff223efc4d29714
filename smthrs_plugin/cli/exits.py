"""The ONE exit-code table of the ``smthrs`` commands: CI pipelines branch on these codes,
so every command asks :func:`exit_code` (or :func:`refusal_exit` for a typed refusal) and none keeps its own.

Invariant: **exit 0 means exactly "done"** — for ``run``/``resume``/``worker --run``: the run COMPLETED; for
``approve``/``cancel``/``signal``: the decision, request or value stands (recorded now or by an earlier identical
call); for reads
(``watch``, ``show``, ``runs``, ``plan``): the answer was printed. An identical retry answers the same code as the
first call whenever the run did not move in between (a ``deny`` exits 3 every time, a denied run's retry too).

====  =====================================================================================================
code  meaning
====  =====================================================================================================
0     completed / done (above)
1     the run failed (not by a denial): a node's own failure (its body raised, its command exited non-zero) —
      final, every retry answers 1; or the run was cancelled, or is quarantined
2     refused input: any typed refusal (:class:`~smthrs_plugin.errors.SmthrsError`) but the denial family and the
      passing faults, an unknown run or plan, a ``Conflict`` receipt, a decision on a run that settled otherwise;
      also a store that is the wrong one or damaged (``not_a_database``, ``corrupt``, ``schema_too_new``): the
      same command cannot succeed until someone changes it
3     denied: ``deny`` (its decision stands), a run failed by a denied approval, a denied plan, an unauthorized
      principal
75    not finished, try again later (EX_TEMPFAIL): parked on an approval, a timer or an event (``Parked``, or
      ``suspended`` on ``waiting-approval``/``timer``/``event``); released and not yet re-driven; held by another
      live owner (``pending``/``running`` — with ``--no-wait``); or stopped by a **passing fault of the
      environment** (:func:`refusal_exit` of an error whose :func:`~smthrs_plugin.errors.passing_fault` is a
      store ``unreachable``/``disk_full``/``locked``/``read_only`` or an artifact store ``unavailable``): the run
      is left resumable, never settled failed, and the same command continues it once the fault is gone
====  =====================================================================================================

The table is total over :data:`OPERATIONS` × :data:`RECEIPTS` × :data:`STATUSES` × :data:`WAITING_REASONS` ×
:data:`DECISIONS`, and :func:`refusal_exit` over every family and code of ``errors.py``
(``tests/cli/test_exit_codes.py`` walks all of it).
"""

from __future__ import annotations

from typing import Literal

from smthrs_plugin.errors import SmthrsError, passing_fault

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_REFUSED",
    "EXIT_DENIED",
    "EXIT_PARKED",
    "EXIT_TEMPFAIL",
    "OPERATIONS",
    "RECEIPTS",
    "STATUSES",
    "WAITING_REASONS",
    "DECISIONS",
    "exit_code",
    "refusal_exit",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_DENIED = 3
EXIT_TEMPFAIL = 75  # sysexits.h EX_TEMPFAIL: "try again later"
EXIT_PARKED = EXIT_TEMPFAIL

Operation = Literal["run", "resume", "worker", "approve", "deny", "cancel", "signal"]
OPERATIONS: tuple[str, ...] = ("run", "resume", "worker", "approve", "deny", "cancel", "signal")
#: Receipt tags (control/receipts.py); ``None`` for a command that answers no receipt (``run`` without ``--key``,
#: ``worker --run``).
RECEIPTS: tuple[str | None, ...] = ("Accepted", "AlreadyApplied", "Parked", "Conflict", "Terminal", None)
#: Run statuses (records/runs.py); ``None`` when the answer names no run (``Parked`` plan, ``Conflict``).
STATUSES: tuple[str | None, ...] = (
    "pending",
    "running",
    "suspended",
    "completed",
    "failed",
    "cancelled",
    None,
)
#: Waiting reasons of a suspended run (plus the control plane's ``waiting-approval``).
WAITING_REASONS: tuple[str | None, ...] = (
    None,
    "waiting-approval",
    "timer",
    "event",
    "released",
    "quarantine",
)
#: The recorded decision that concerns the answer: for ``approve``/``deny`` the decision on their target; for a run
#: whether one of its node requests was denied (``"denied"``) — what makes a failed run a denied one.
DECISIONS: tuple[str | None, ...] = (None, "approved", "denied")

_DENIED_CODES = frozenset({"unauthorized", "plan_denied", "approval_denied"})
_PARKED_REASONS = frozenset({"waiting-approval", "timer", "event", "released"})


def refusal_exit(exc: SmthrsError) -> int:
    """A typed error: 75 when a passing fault of the environment is behind it (``errors.passing_fault``, through
    its causes: the same command succeeds once the fault is gone), 3 for the denial family (unauthorized, a denied
    plan or approval), else 2."""
    if passing_fault(exc) is not None:
        return EXIT_TEMPFAIL
    return EXIT_DENIED if exc.code in _DENIED_CODES else EXIT_REFUSED


def _run_status_exit(status: str | None, waiting_reason: str | None, decision: str | None) -> int:
    if status == "completed":
        return EXIT_OK
    if status == "failed":
        return EXIT_DENIED if decision == "denied" else EXIT_FAILED
    if status == "cancelled":
        return EXIT_FAILED
    if status == "suspended":
        return EXIT_PARKED if waiting_reason in _PARKED_REASONS else EXIT_FAILED
    # pending / running: held by another live owner (or not yet driven) — never 0, try again later.
    # None: no run to judge (cannot happen for a receipt naming a run) — not done either.
    return EXIT_TEMPFAIL


def exit_code(
    operation: str,
    receipt: str | None,
    status: str | None,
    waiting_reason: str | None = None,
    decision: str | None = None,
) -> int:
    """The exit code of ``operation`` that answered ``receipt`` about a run now in ``status`` (see the module
    table). ``status`` is the run's state when the command exits (after it drove or followed the run)."""
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; expected one of {OPERATIONS}")
    if receipt == "Conflict":
        return EXIT_REFUSED
    if receipt == "Parked":
        return EXIT_PARKED
    if operation in ("run", "resume", "worker"):
        return _run_status_exit(status, waiting_reason, decision)
    if operation == "deny":
        if receipt == "Terminal":
            # The run settled before this call looked: the denial stands only if its target IS denied.
            return EXIT_DENIED if decision == "denied" else EXIT_REFUSED
        return EXIT_DENIED  # recorded now or by an identical earlier call: the target is denied, every time
    if operation == "approve":
        if receipt == "Terminal":
            return EXIT_OK if decision == "approved" else EXIT_REFUSED
        return EXIT_OK
    if operation == "signal":
        # Delivered now or by an identical earlier call; a settled run got nothing (refused, as for approve).
        return EXIT_REFUSED if receipt == "Terminal" else EXIT_OK
    # cancel: never replays; done once the request is recorded or the run is cancelled.
    if receipt == "Terminal":
        return EXIT_OK if status == "cancelled" else EXIT_REFUSED
    return EXIT_OK
