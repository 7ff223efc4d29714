"""What the control-plane commands share: the launcher a CLI run uses, the one answer a command prints (a receipt and
the run it names), and the mapping of every answer and refusal to an exit code (DESIGN.md §8).

Exit codes: 0 done/accepted (a completed run, a recorded decision, a run another live process drives); 1 a run or
node failed (or was cancelled); 2 usage or refused input (``InvalidInput``, ``Conflict``, a mismatched digest or
envelope, an unknown plan or run, ``AlreadyResolved``, a decision on a settled run); 3 approval refused or denied
(``Unauthorized``, ``PlanDenied``, a run failed by ``ApprovalDenied``); 75 parked waiting for an approval or a
timer (``Parked``, or a run suspended ``waiting-approval``/``timer``/``event``).

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

from smthrs_plugin.cli._common import EXIT_DENIED, EXIT_FAILED, EXIT_OK, EXIT_PARKED, EXIT_REFUSED
from smthrs_plugin.errors import ControlError, InvalidInput, SmthrsError

if TYPE_CHECKING:  # pragma: no cover
    from smthrs_plugin.control.control import AdmittedRun, Control
    from smthrs_plugin.control.identity import Principal
    from smthrs_plugin.runtime import Runtime
    from smthrs_plugin.scheduler.model import Report

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_REFUSED",
    "EXIT_DENIED",
    "EXIT_PARKED",
    "PlanLauncher",
    "parse_principal",
    "parse_inputs",
    "refusal_exit",
    "fail",
    "answer",
]

_DENIED_CODES = frozenset({"unauthorized", "plan_denied", "approval_denied"})
_PARKED_REASONS = frozenset({"waiting-approval", "timer", "event"})


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


def refusal_exit(exc: SmthrsError) -> int:
    """3 for an approval refused or denied, else 2 (a refused input)."""
    return EXIT_DENIED if exc.code in _DENIED_CODES else EXIT_REFUSED


def fail(as_json: bool, exc: SmthrsError) -> typer.Exit:
    """Print a refusal (one JSON object with ``--json``) and return the Exit to raise."""
    if as_json:
        typer.echo(json.dumps({"error": exc.to_dict()}, sort_keys=True))
    else:
        typer.echo(f"smthrs: refused: {exc}", err=True)
    return typer.Exit(refusal_exit(exc))


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
        executor = PlanFileExecutor(rt.actions)
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
                from smthrs_plugin.hosts.prefect import run_plan_in_flow

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


def _run_exit(status: str, waiting: str | None, report: Report | None) -> int:
    if status == "completed":
        return EXIT_OK
    if status == "failed":
        denied = report is not None and any("approval_denied" in (s.error or "") for s in report.settlements)
        return EXIT_DENIED if denied else EXIT_FAILED
    if status == "cancelled":
        return EXIT_FAILED
    if status == "suspended":
        return EXIT_PARKED if waiting in _PARKED_REASONS else EXIT_FAILED
    return EXIT_OK  # pending / running: accepted, driven by another live process


def answer(
    control: Control,
    receipt: Any,
    *,
    as_json: bool,
    card: Any = None,
    report: Report | None = None,
    operation: str = "run",
) -> int:
    """Print ``receipt`` with the state of the run it names (and the card, when given); return the exit code."""
    from rich.console import Console
    from rich.table import Table

    from smthrs_plugin.control.receipts import Conflict, Parked, Terminal

    # DESIGN.md §8 names the receipt's kind ``type``; the seed's wire form (``receipts.py``) names it ``_tag``.
    payload: dict[str, Any] = {"receipt": {"type": receipt.type, **receipt.to_dict()}}
    if card is not None:
        payload.update(plan_id=card.plan_id, digest=card.digest)
    run_id = getattr(receipt, "run_id", None)
    view = None
    if run_id is not None:
        view = control.show(run_id)
        payload.update(run_id=run_id, status=view.status, waiting_reason=view.waiting_reason)
        payload["requests"] = [r.to_json() for r in view.pending]
        if view.admission is not None and card is None:
            payload.update(plan_id=view.admission.plan_id, digest=view.admission.card_digest)
    if operation in ("run", "resume"):
        payload["settlements"] = _settlements(report)
    if isinstance(receipt, Parked):
        code = EXIT_PARKED
    elif isinstance(receipt, Conflict):
        code = EXIT_REFUSED
    elif isinstance(receipt, Terminal):
        if operation in ("approve", "deny"):
            code = EXIT_REFUSED
        elif operation == "cancel":
            code = EXIT_OK
        else:
            code = EXIT_OK if receipt.status == "completed" else EXIT_FAILED
    elif view is not None and operation in ("run", "resume"):
        code = _run_exit(view.status, view.waiting_reason, report)
    else:
        code = EXIT_OK
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
    where = f" run {payload['run_id']}: {status}" if "run_id" in payload else ""
    if payload.get("waiting_reason"):
        where += f" ({payload['waiting_reason']})"
    return f"{operation}: {tag}{where}"


def invalid_input(message: str) -> InvalidInput:
    """A usage refusal in the identity family (so it maps to exit 2)."""
    return InvalidInput("invalid_input", message, bound="plain_data")
