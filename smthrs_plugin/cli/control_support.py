"""What the control-plane commands share: the launcher a CLI run uses, the follower that finishes a retried run (or
says why it cannot), and the one answer a command prints (a receipt and the run it names) with its exit code from
the one table of :mod:`._exits`.

Invariants
- **Exit 0 means exactly "the run completed"** for ``run --key``/``resume``: a run still ``pending``/``running``
  after this process is done with it never exits 0 (:func:`follow` first finishes it or follows it to its end).
- **A retry finishes the job or says why it cannot** (:func:`follow`): when the run a receipt names is still live
  and not driven here, a provably gone owner is taken over — at its lease expiry (``stale_after``, 30 s of
  heartbeat age), waited for with a progress line on stderr — and the run is driven to its end in this process;
  a live owner is followed until the run settles or parks; with ``--no-wait`` the command exits 75 naming the
  owner instead of waiting. Waiting is driven by the control plane's clock and ``wait_poll_s``, never by wall
  time measured here. A takeover refused by the liveness check (a live owner past its lease) is re-tried with
  the stale sweep's backoff (2 polls, doubling per refusal of the same lease, capped at the stale window); the
  arbiter journals that refusal once per (run, owner, lease, evidence).
- JSON: our own fields are snake_case (``run_id``, ``plan_id``, ``waiting_reason``, ``request_id`` ...); the
  nested ``receipt`` keeps the seed's wire spelling (``_tag``, ``receiptId``, ``runId``, ``planId``).

The CLI is a trusted host capability: it opens the database itself, so anyone who can run it with the database's
credentials can do what the control plane can. ``--as ID/KIND`` names the deciding principal; the approval
authority (default: only ``local/operator``) decides whether that principal may decide.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from smthrs_plugin.cli._common import print_refusal
from smthrs_plugin.cli.exits import exit_code
from smthrs_plugin.errors import ControlError, InvalidInput, SmthrsError

if TYPE_CHECKING:  # pragma: no cover
    from smthrs_plugin.control.facade import AdmittedRun, Control
    from smthrs_plugin.control.identity import Principal
    from smthrs_plugin.records.runs import OwnerId
    from smthrs_plugin.runtime import Runtime
    from smthrs_plugin.scheduler.model import Report

__all__ = [
    "PlanLauncher",
    "parse_principal",
    "parse_inputs",
    "concurrency_caps",
    "fail",
    "answer",
    "follow",
    "Held",
]


def parse_principal(text: str | None) -> Principal:
    """``--as ID/KIND`` (default the local operator)."""
    from smthrs_plugin.control.identity import LOCAL_OPERATOR, Principal

    return LOCAL_OPERATOR if text is None else Principal.parse(text)


def parse_inputs(pairs: list[str] | None) -> dict[str, str]:
    """``--input k=v`` (repeatable) → ``{k: v}`` (values are strings); a malformed or repeated key is refused."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise ControlError("invalid_options", f"--input {pair!r}: write KEY=VALUE", option="input")
        if k in out:
            raise ControlError(
                "invalid_options", f"--input {k!r} is given twice; give each key once", option="input"
            )
        out[k] = v
    return out


def concurrency_caps(steps: int | None, agents: int | None) -> dict[str, int | None]:
    """``--steps``/``--agents`` checked as the scheduler checks them (``GraphError(invalid_concurrency)`` unless a
    positive int or unbounded), before anything is admitted: a cap of 0 is refused input (exit 2), not a run that
    is admitted and then fails on it."""
    from smthrs_plugin.plan import Concurrency

    Concurrency(steps=steps, agents=agents)
    return {"steps": steps, "agents": agents}


def fail(as_json: bool, exc: SmthrsError) -> typer.Exit:
    """Print a refusal (one JSON object with ``--json``) and return the Exit to raise."""
    return typer.Exit(print_refusal(as_json, exc))


@dataclass
class PlanLauncher:
    """Drives an admitted plan run in this process: the runtime's scheduler (its run driver claims, heartbeats,
    parks or settles the run; the runtime wires the control plane's node gate) and plan-file actions. The card's input is folded into
    the scheduler environment (so it keys the cached work) and exported to ``run:`` commands as
    ``SMTHRS_PLAN_INPUT`` (JSON)."""

    rt: Runtime
    concurrency: Mapping[str, Any]
    prefect: bool = False
    progress: bool = False
    report: Report | None = None
    stopped: BaseException | None = None

    def launch(self, run: AdmittedRun) -> None:
        from smthrs_plugin.engine.context import RunCancelled, RunParked
        from smthrs_plugin.errors import FenceLost
        from smthrs_plugin.plan import ABSENT
        from smthrs_plugin.scheduler.planfile import PlanFileExecutor

        rt = self.rt
        executor = PlanFileExecutor(rt.actions, isolation=rt.settings.isolation)
        environment: Any = ABSENT
        if run.card.input:
            base = rt.plugins.runtime_defaults(rt.settings).get("environment", ABSENT)
            environment = (
                {"input": run.card.input} if base is ABSENT else {"input": run.card.input, "runtime": base}
            )
            os.environ["SMTHRS_PLAN_INPUT"] = json.dumps(run.card.input, sort_keys=True)
        sub = rt.journal.subscribe(_progress, partition=run.run_id) if self.progress else None
        try:
            if self.prefect:
                from smthrs_plugin.prefect.host import run_plan_in_flow

                self.report = run_plan_in_flow(
                    rt, run.run_id, run.plan, executor, concurrency=self.concurrency
                )
            else:
                sched = rt.scheduler(run.run_id, concurrency=self.concurrency, environment=environment)
                self.report = sched.run(run.plan, executor)
        except (RunParked, RunCancelled, FenceLost) as exc:
            # Parked (75), cancelled (1), or held by another live owner: the run's state says which; the durable
            # transition was written by the run driver.
            self.stopped = exc
        finally:
            if sub is not None:
                sub.close()


def _progress(event: Any) -> None:
    if event.type == "node-settled" and isinstance(event.payload, dict):
        p = event.payload
        print(f"  {p.get('outcome', '?'):<8} {p.get('node_id', '?')}", file=sys.stderr, flush=True)
    elif event.type == "control.approval.requested" and isinstance(event.payload, dict):
        target = event.payload.get("approvalTarget") or {}
        print(f"  asking   approval {target.get('requestId')!r}", file=sys.stderr, flush=True)


def _settlements(report: Report | None) -> list[dict[str, Any]]:
    return [] if report is None else [s.to_json() for s in report.settlements]


@dataclass(frozen=True)
class Held:
    """The run is still ``pending``/``running`` under another owner this process could not (yet) take it from."""

    run_id: str
    status: str
    owner: OwnerId
    age_ms: int  #: heartbeat age (claim age for a pending run) when last read
    expires_in_ms: int  #: until its lease expires (0: expired, and the liveness check vouched for the owner)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.owner.host_id,
            "pid": self.owner.pid,
            "nonce": self.owner.nonce,
            "lease_age_ms": self.age_ms,
            "lease_expires_in_ms": self.expires_in_ms,
        }

    def describe(self) -> str:
        who = f"host {self.owner.host_id!r} pid {self.owner.pid}"
        if self.expires_in_ms > 0:
            lease = f"its lease ({self.age_ms / 1000:.1f} s old) expires in {self.expires_in_ms / 1000:.1f} s"
        else:
            lease = "its lease expired but the liveness check vouches for it (alive)"
        return f"run {self.run_id} is {self.status}, owned by {who}; {lease}"


def follow(control: Control, run_id: str, relaunch: Any, *, wait: bool = True) -> Held | None:
    """Finish ``run_id`` from this process, or follow it to its end (see the module invariants).

    ``relaunch()`` repeats the command's own idempotent call (the same key: ``AlreadyApplied`` re-launches the run
    when nobody drives it). Returns None once the run is settled or parked; with ``wait=False`` a :class:`Held`
    as soon as another owner holds it."""
    from smthrs_plugin.control import launch as ln
    from smthrs_plugin.records.runs import TERMINAL_STATUSES

    clock = control.clock
    stale_ms = int(control.settings.stale_after_s * 1000)
    poll_ms = max(1, int(control.settings.wait_poll_s * 1000))
    refused: tuple[Any, int] | None = None  # (owner, lease) the liveness check last vouched for
    refusals, retry_at = 0, 0
    said: tuple[Any, ...] | None = None
    said_at = 0
    while True:
        row = control.db.read(lambda c: ln.run_row_in(c, run_id))
        if row is None:
            raise ControlError("run_not_found", f"run {run_id!r} does not exist", run_id=run_id)
        now = clock.now_ms()
        if row.status in TERMINAL_STATUSES:
            return None
        if row.status == "suspended":
            due = row.waiting_reason == "timer" and row.wake_at_ms is not None and row.wake_at_ms <= now
            if row.waiting_reason != "released" and not due:
                return None  # parked: an approval, an event, or a timer not yet due (exit 75)
            holder, since = None, None
        elif row.status == "running":
            holder, since = row.owner, row.heartbeat_at_ms
        else:  # pending: admitted, perhaps under another process's claim
            holder, since = row.claim, row.claimed_at_ms
        if holder is None or holder == control.owner or since is None:
            relaunch()  # nobody holds it: drive it here
            if control.db.read(lambda c: ln.run_row_in(c, run_id)) == row:
                # Nothing moved (another process raced us to it): look again later.
                clock.sleep(poll_ms / 1000)
            continue
        age = now - since
        expires_in = max(0, stale_ms + 1 - age)  # exactly stale_after of age is still a fresh lease
        if expires_in == 0 and ((holder, since) != refused or now >= retry_at):
            relaunch()  # the lease expired: the arbiter steals on Dead evidence, refuses (journaled once) on Alive
            after = control.db.read(lambda c: ln.run_row_in(c, run_id))
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
        if phase != said or now - said_at >= 10_000:
            what = (
                "waiting for the lease to expire to take it over"
                if expires_in > 0
                else "following it until it settles"
            )
            note = f"smthrs: {held.describe()} — {what} (Ctrl-C stops; --no-wait exits 75)"
            print(note, file=sys.stderr, flush=True)
            said, said_at = phase, now
        pause = poll_ms if expires_in == 0 else min(poll_ms, expires_in)
        try:
            clock.sleep(max(pause, 1) / 1000)
        except KeyboardInterrupt:
            return held  # Ctrl-C while following: stop as --no-wait would (exit 75, naming the owner)


def run_decision(view: Any) -> str | None:
    """``"denied"`` when a node request of the run was denied (a failed run is then a denied one), else None."""
    return "denied" if any(r.state == "denied" for r in view.requests) else None


def answer(
    control: Control,
    receipt: Any,
    *,
    as_json: bool,
    card: Any = None,
    report: Report | None = None,
    operation: str = "run",
    decision: str | None = None,
    held: Held | None = None,
) -> int:
    """Print ``receipt`` with the state of the run it names (and the card, when given); return the exit code
    (:func:`._exits.exit_code`). ``decision`` is the recorded decision on an approve/deny target; ``held`` the
    owner a ``--no-wait`` retry found holding the run."""
    from rich.console import Console
    from rich.table import Table

    from smthrs_plugin.serve.wire import receipt_answer

    # Our JSON names the receipt's kind ``type``; the reference's wire form (``receipts.py``) names it ``_tag``.
    # One stable shape per command (README "JSON output"): every key is present, null when it does not apply; the
    # same object `smthrs serve` answers for the verb.
    payload, view = receipt_answer(control, receipt, operation=operation, card=card)
    run_id = payload["run_id"]
    status: str | None = payload["status"]
    waiting: str | None = payload["waiting_reason"]
    if view is not None and operation in ("run", "resume"):
        decision = run_decision(view)
    if operation in ("run", "resume"):
        payload["settlements"] = _settlements(report)
        payload["owner"] = None if held is None else held.to_json()
    code = exit_code(operation, receipt.type, status, waiting, decision)
    if as_json:
        typer.echo(json.dumps(payload, sort_keys=True, default=str))
        return code
    console = Console(highlight=False, soft_wrap=True)
    if report is not None and report.settlements:
        table = Table("node", "outcome", "cache", "attempts", "error", title=f"run {run_id}")
        for s in report.settlements:
            table.add_row(s.node, s.outcome, s.cache_decision or "-", str(s.attempts), s.error or "")
        console.print(table)
    console.print(_headline(receipt, payload, operation))
    if held is not None:
        console.print(
            f"  {held.describe()}; not waiting (--no-wait): run the same command again later, or without "
            "--no-wait to wait for it"
        )
    if view is not None and view.error is not None and status in ("failed", "cancelled") and report is None:
        # A retry replays the settled run: say why it ended, not only that it did.
        console.print(f"  why: {view.error}")
    wake = payload.get("host_wake")
    if wake is not None and wake["type"] == "HostWoken":
        console.print(f"  {wake['detail']}")
    elif wake is not None and wake["type"] == "HostWakeFailed":
        # A warning, never a refusal: the decision above is durable, and repeating the command asks the host again.
        typer.echo(f"warning: {wake['detail']}", err=True)
    if view is not None and view.pending:
        for r in view.pending:
            console.print(
                f"  waiting for approval {r.request_id!r}: smthrs approve {run_id} --request {r.request_id}"
            )
    return code


def _headline(receipt: Any, payload: Mapping[str, Any], operation: str) -> str:
    tag = receipt.type
    if tag == "Parked":
        return (
            f"{operation}: Parked — plan {payload['receipt']['planId']} is waiting for approval "
            f"(smthrs approve {payload['receipt']['planId']}); rerun with the same --key afterwards"
        )
    if tag == "Conflict":
        return f"{operation}: Conflict — {receipt.message}"
    if tag == "Terminal":
        return f"{operation}: Terminal — run {receipt.run_id} already settled {receipt.status}"
    status = payload.get("status")
    where = f" run {payload['run_id']}: {status}" if payload.get("run_id") else ""
    if payload.get("waiting_reason"):
        where += f" ({payload['waiting_reason']})"
    return f"{operation}: {tag}{where}"


def invalid_input(message: str) -> InvalidInput:
    """A usage refusal in the identity family (so it maps to exit 2)."""
    return InvalidInput("invalid_input", message, bound="plain_data")
