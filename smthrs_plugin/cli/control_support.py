"""What the control-plane commands share: the launcher a CLI run uses, the follower that finishes a retried run (or
says why it cannot), and the one answer a command prints (a receipt and the run it names) with its exit code from
the one table of :mod:`.exits`.

Invariants
- **Exit 0 means exactly "the run completed"** for ``run --key``/``resume``: a run still ``pending``/``running``
  after this process is done with it never exits 0 (:func:`follow` first finishes it or follows it to its end).
- **A retry finishes the job or says why it cannot**: the takeover/follow policy is
  :func:`smthrs_plugin.control.follow.follow` (a provably gone owner is taken over at its lease expiry, a live one
  followed until the run settles or parks); this module adds the command's side — a progress line on stderr while
  it waits, and with ``--no-wait`` (or Ctrl-C) exit 75 naming the owner instead of waiting.
- JSON: our own fields are snake_case (``run_id``, ``plan_id``, ``waiting_reason``, ``request_id`` ...) in the
  CLI's vocabulary (``_common.cli_state``: ``status`` pending|running|parked|completed|failed|cancelled,
  ``waiting_reason`` approval|timer|signal|released|quarantine); the nested ``receipt`` keeps the reference's wire
  spelling (``_tag``, ``receiptId``, ``runId``, ``planId``). **A parked answer always says so**: ``status`` is
  ``parked`` with its reason whenever the run (or, for a plan awaiting approval, the launch) waits, and ``run_id``
  names the run whenever one exists — a resume answered ``Parked`` names the run it was asked about.

The CLI is a trusted host capability: it opens the database itself, so anyone who can run it with the database's
credentials can do what the control plane can. ``--as ID/KIND`` names the deciding principal; the approval
authority (default: only ``local/operator``) decides whether that principal may decide.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from smthrs_plugin.cli._common import print_refusal, safe_text
from smthrs_plugin.cli.exits import exit_code
from smthrs_plugin.errors import ControlError, InvalidInput, SmthrsError

if TYPE_CHECKING:  # pragma: no cover
    from smthrs_plugin.control.facade import AdmittedRun, Control
    from smthrs_plugin.control.follow import Held
    from smthrs_plugin.control.identity import Principal
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


def follow(
    control: Control, run_id: str, relaunch: Callable[[], object], *, wait: bool = True
) -> Held | None:
    """:func:`smthrs_plugin.control.follow.follow` for a command: a progress line on stderr while it waits; None
    once the run is settled or parked (its state gives the exit code), a :class:`Held` to report (exit 75)."""
    from smthrs_plugin.control.follow import Held
    from smthrs_plugin.control.follow import follow as follow_run

    out = follow_run(control, run_id, relaunch, wait=wait, on_wait=_wait_note)
    return out if isinstance(out, Held) else None


def _wait_note(held: Held) -> None:
    what = (
        "waiting for the lease to expire to take it over"
        if held.expires_in_ms > 0
        else "following it until it settles"
    )
    note = f"smthrs: {held.describe()} — {what} (Ctrl-C stops; --no-wait exits 75)"
    print(note, file=sys.stderr, flush=True)


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
    run_id: str | None = None,
) -> int:
    """Print ``receipt`` with the state of the run it names (and the card, when given); return the exit code
    (:func:`.exits.exit_code`). ``decision`` is the recorded decision on an approve/deny target; ``held`` the
    owner a ``--no-wait`` retry found holding the run; ``run_id`` the run the command was asked about (a
    ``Parked`` receipt names only the plan: the answer still names the run and its state)."""
    from rich.console import Console
    from rich.table import Table

    from smthrs_plugin.serve.wire import in_vocabulary, receipt_answer

    # One stable shape per command (docs/rules.md "JSON vocabulary"): every key is present, null when it does not
    # apply; the server's answer for the same verb, built by the same code.
    payload, view = receipt_answer(control, receipt, operation=operation, card=card, run_id=run_id)
    run_id = payload["run_id"]
    status: str | None = payload["status"]
    waiting: str | None = payload["waiting_reason"]
    if view is not None and operation in ("run", "resume"):
        decision = run_decision(view)
    if operation in ("run", "resume"):
        payload["settlements"] = _settlements(report)
        payload["owner"] = None if held is None else held.to_json()
    # The exit code reads the stored names (the one table); the printed answer speaks the CLI's vocabulary.
    code = exit_code(operation, receipt.type, status, waiting, decision)
    payload = in_vocabulary(payload, parked_plan=receipt.type == "Parked" and run_id is None)
    if as_json:
        typer.echo(json.dumps(payload, sort_keys=True, default=str))
        return code
    # markup off: run ids, request ids and errors are someone else's text, and `[...]` in them is not a style.
    console = Console(highlight=False, soft_wrap=True, markup=False)
    if report is not None and report.settlements:
        table = Table("node", "outcome", "cache", "attempts", "error", title=f"run {run_id}")
        for s in report.settlements:
            error = safe_text(s.error, 200) if s.error else ""
            table.add_row(safe_text(s.node), s.outcome, s.cache_decision or "-", str(s.attempts), error)
        console.print(table)
    console.print(_headline(receipt, payload, operation))
    if held is not None:
        console.print(
            f"  {held.describe()}; not waiting (--no-wait): run the same command again later, or without "
            "--no-wait to wait for it"
        )
    if view is not None and view.error is not None and status in ("failed", "cancelled") and report is None:
        # A retry replays the settled run: say why it ended, not only that it did.
        console.print(f"  why: {safe_text(view.error, 400)}")
    wake = payload.get("host_wake")
    if wake is not None and wake["type"] == "HostWoken":
        console.print(f"  {wake['detail']}")
    elif wake is not None and wake["type"] == "HostWakeFailed":
        # A warning, never a refusal: the decision above is durable, and repeating the command asks the host again.
        typer.echo(f"warning: {wake['detail']}", err=True)
    if view is not None and view.pending:
        for r in view.pending:
            console.print(
                f"  waiting for approval {safe_text(r.request_id)!r}: smthrs approve {safe_text(run_id)} --request "
                f"{safe_text(r.request_id)}"
            )
    return code


def _headline(receipt: Any, payload: Mapping[str, Any], operation: str) -> str:
    tag = receipt.type
    if tag == "Parked" and payload.get("run_id"):
        return (
            f"{operation}: Parked — run {payload['run_id']} is parked waiting for a node approval; approve it (below), "
            "then run the same command again"
        )
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
