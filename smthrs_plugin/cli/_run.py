"""``smthrs run PLAN.yaml [--run-id R] [--steps N] [--agents N] [--prefect] [--json]`` — run a plan file on the local
host, or (``--prefect``) inside a Prefect flow run, one task run per node dispatch (``prefect/host.py``).

Invariant: one library entry point (``open_runtime(...).scheduler(run_id).run(plan, executor)``), one printed
result: a line per node, or ONE JSON object with ``--json``, the same keys on every path (completed, failed,
parked, cancelled, held), null when they do not apply: ``run_id``, ``plan_id``, ``key`` (the plan's ``key1_``
digest), ``status`` (``_common.CLI_STATUSES``), ``waiting_reason`` (``_common.CLI_WAITING_REASONS``, while
parked), ``wait`` (``{reason, wake_at_ms}`` while parked), ``node`` (the node it parked on), ``settlements``,
``merges`` and ``error`` (why a held run is not finished). With ``--key`` the control plane's answer instead
(``cli/control_support.answer``). Exit codes (the one table, ``cli/exits.py``): 0 the
run completed (every node built or clean), 1 a node failed (its body raised, its command exited non-zero; or it
was skipped) or the run was cancelled, 2 a refused input (any typed ``SmthrsError``: a malformed plan file names
its line and field), 75 the run parked on a timer node (``wait:``) beyond the in-process budget — run again with
``--run-id`` (or let ``smthrs worker --plan`` resume it) once its stored deadline has passed — or ``--run-id``
names a run another live process owns, or a passing fault of the environment stopped it.

**A passing fault never fails a run.** The database unreachable, a full disk, a lock held past the wait, a
read-only store or the artifact store gone (``errors.passing_fault``) leave the run resumable (released, or still
pending), never settled ``failed``: the command prints the fault (its code names it, its message says what to
do) and exits 75, every time while the fault lasts; once it is gone, the same command continues the run (with
``--key``: the same key; without: ``--run-id`` of the run printed) and its settled nodes replay. A node's own
failure stays exit 1, final.

With ``--key K`` the run goes through the control plane (``cli/_control.py``: ``smthrs plan`` card, plan approval,
receipts): the same key again is the retry — it finishes the run or follows it to its end, and exits 0 only once
the run completed (``--no-wait``: 75 naming the owner while another live process holds it).

The run id defaults to ``<plan id>-<random>``: every invocation is a new run (built work is still served from
the cache). Pass ``--run-id`` to resume a run that was interrupted (its settled nodes replay ``clean``).

Absolute imports on purpose (see ``cli/_cache.py``); heavy imports stay inside the command.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from smthrs_plugin.cli._common import (
    DbOption,
    JsonOption,
    WorkspaceOption,
    check_workspace,
    db_url,
)
from smthrs_plugin.cli._common import refuse as _refuse
from smthrs_plugin.cli.exits import exit_code
from smthrs_plugin.engine.context import RunCancelled, RunParked
from smthrs_plugin.errors import FenceLost, SmthrsError, passing_fault
from smthrs_plugin.vocabulary import cli_state

__all__ = ["register", "run_plan_file"]


def register(app: typer.Typer) -> None:
    """Add ``smthrs run`` to the root app."""
    app.command("run")(run_plan_file)


def _answer(run_id: str | None, plan: Any, status: str, **fields: Any) -> dict[str, Any]:
    """The one shape of ``smthrs run --json`` (without ``--key``): every key present, null when it does not apply."""
    out: dict[str, Any] = {
        "run_id": run_id,
        "plan_id": None if plan is None else plan.plan_id,
        "key": None if plan is None else plan.digest,
        "status": status,
        "waiting_reason": None,
        "wait": None,
        "node": None,
        "settlements": [],
        "merges": [],
        "error": None,
    }
    out.update(fields)
    return out


def _held(as_json: bool, run_id: str | None, plan: Any, exc: FenceLost) -> NoReturn:
    """``--run-id`` names a run another live process owns: not done, try again later (75)."""
    if as_json:
        typer.echo(json.dumps(_answer(run_id, plan, "running", error=exc.to_dict()), sort_keys=True))
    else:
        typer.echo(f"smthrs: {exc}", err=True)
    raise typer.Exit(exit_code("run", None, "running"))


def _faulted(run_id: str, exc: SmthrsError, fault: SmthrsError) -> SmthrsError:
    """What a run stopped by passing ``fault`` answers: the fault's family and code (exit 75), what to do."""
    return type(fault)(
        fault.code,
        f"run {run_id} was stopped by a passing fault of the environment, not by its own work: {fault.message}. "
        f"The run is left resumable, not failed: once the fault is gone, resume it with --run-id {run_id} (its "
        "settled nodes replay), or run the plan again (a new run: built work is served from the cache)",
        cause=exc,
        run_id=run_id,
    )


#: The stored waiting reason of a run parked by each kind of in-process wait (``RunParked.kind``), when the wait
#: itself is not attached.
_PARKED_BY = {"timer": "timer", "event": "event", "approval": "waiting-approval"}


def _stopped(as_json: bool, stopped: RunParked | RunCancelled, plan: Any) -> NoReturn:
    """A run stopped by a durable wait: parked (75, resumable with ``--run-id``) or cancelled (1)."""
    run_id = stopped.run_id
    if isinstance(stopped, RunParked):
        wait = stopped.waiting
        stored = wait.reason if wait is not None else _PARKED_BY[stopped.kind]
        reason = cli_state("suspended", stored)[1]
        wake = getattr(wait, "wake_at_ms", None) if wait is not None else stopped.due_at_ms
        payload = _answer(
            run_id,
            plan,
            "parked",
            waiting_reason=reason,
            wait={"reason": reason, "wake_at_ms": wake},
            node=stopped.name.removeprefix("node:"),
        )
        text = f"run {run_id}: parked on {stopped.kind} {stopped.name} (resume with --run-id {run_id})"
        code = exit_code("run", None, "suspended", stored)
    else:
        payload = _answer(run_id, plan, "cancelled")
        text = f"run {run_id}: cancelled"
        code = exit_code("run", None, "cancelled")
    typer.echo(json.dumps(payload, sort_keys=True) if as_json else text)
    raise typer.Exit(code)


def run_plan_file(
    plan_file: Annotated[Path, typer.Argument(help="The plan file (YAML).", show_default=False)],
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id (default: <plan>-<random>).")] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", help="Cap on nodes in flight (default unbounded).")
    ] = None,
    agents: Annotated[int | None, typer.Option("--agents", help="Cap on agent nodes in flight.")] = None,
    workspace: WorkspaceOption = None,
    db: DbOption = None,
    as_json: JsonOption = False,
    prefect: Annotated[
        bool,
        typer.Option(
            "--prefect",
            help="Run inside a Prefect flow run: one task run per node dispatch, the report as a markdown artifact.",
        ),
    ] = False,
    key: Annotated[
        str | None,
        typer.Option(
            "--key",
            help="Idempotency key: run through the control plane (plan approval, receipts); the same key again is "
            "the retry. PLAN may then also be a plan id printed by `smthrs plan`.",
        ),
    ] = None,
    inputs: Annotated[
        list[str] | None, typer.Option("--input", help="Plan input KEY=VALUE (repeatable; with --key).")
    ] = None,
    as_: Annotated[
        str | None,
        typer.Option("--as", help="The requesting principal ID/KIND (with --key; default local/operator)."),
    ] = None,
    no_wait: Annotated[
        bool,
        typer.Option(
            "--no-wait",
            help="With --key: when another live process owns the run, exit 75 naming it (host, pid) instead of "
            "following the run to its end (or waiting for its lease to expire to take it over).",
        ),
    ] = False,
) -> None:
    """Run a plan file and print its report (on the local host, or as a Prefect flow run with --prefect)."""
    from smthrs_plugin.errors import SchedulerError
    from smthrs_plugin.runtime import open_runtime
    from smthrs_plugin.scheduler.planfile import read_plan_file

    try:
        check_workspace(
            workspace
        )  # a file named as the workspace: refused before a state directory is made in it
        db_url(db, workspace)  # an empty --db is refused, never read as the default database
    except SmthrsError as exc:
        _refuse(as_json, exc)
    if key is not None:
        # The control plane's path (cli/_control.py): plan → approval → admission under the key → drive.
        from smthrs_plugin.cli._control import run_with_key

        if run_id is not None:
            _refuse(
                as_json,
                SchedulerError(
                    "invalid_plan",
                    "--run-id and --key exclude each other: with --key the "
                    "control plane names the run (the same key again is the retry)",
                ),
            )
        caps = {"steps": steps, "agents": agents}
        raise typer.Exit(
            run_with_key(plan_file, key, inputs=inputs, as_=as_, concurrency=caps, prefect=prefect,
                         workspace=workspace, db=db, as_json=as_json, no_wait=no_wait)
        )  # fmt: skip
    if inputs or as_ or no_wait:
        _refuse(
            as_json,
            SchedulerError("invalid_plan", "--input, --as and --no-wait go with --key (a control-plane run)"),
        )
    rid: str | None = run_id
    plan: Any = None  # the compiled plan, once read: every answer names it
    try:
        # --prefect and plugin actions: the runtime opens first so `call: <action>` names are checked
        # against the installed plugins' actions while the file is read.
        with open_runtime(workspace=workspace, db=db) as rt:
            pf = read_plan_file(plan_file, actions=rt.actions)
            plan = pf.plan
            if pf.approval not in (None, "none"):
                raise SchedulerError(
                    "invalid_plan",
                    f"plan {pf.plan.plan_id!r} requires approval ({pf.approval!r}); run it with --key KEY through the "
                    "control plane (smthrs plan / smthrs approve) — this command does not bypass approval gates",
                )
            rid = run_id or f"{pf.plan.plan_id}-{uuid.uuid4().hex[:8]}"
            caps = {"steps": steps, "agents": agents}
            if prefect:
                from smthrs_plugin.prefect.host import run_plan_in_flow

                report = run_plan_in_flow(rt, rid, pf.plan, pf.executor, concurrency=caps)
            else:
                report = rt.scheduler(rid, concurrency=caps).run(pf.plan, pf.executor)
    except FenceLost as exc:
        _held(as_json, rid, plan, exc)
    except SmthrsError as exc:
        # A passing fault (exit 75 by the one table) names the run it left resumable; anything else is refused.
        fault = passing_fault(exc)
        _refuse(as_json, _faulted(rid, exc, fault) if rid is not None and fault is not None else exc)
    except (RunParked, RunCancelled) as stopped:
        # Durable waits: parked on a timer or approval node (exit 75), or cancelled (exit 1).
        _stopped(as_json, stopped, plan)
    status = "failed" if report.failed else "completed"
    if as_json:
        payload = _answer(
            rid,
            plan,
            status,
            plan_id=report.plan_id,
            key=report.digest,  # the plan as run: grown by merge generations, if any
            settlements=[s.to_json() for s in report.settlements],
            merges=list(report.merges),
        )
        typer.echo(json.dumps(payload, sort_keys=True))
    else:
        width = max(len(s.node) for s in report.settlements)
        for s in report.settlements:
            extra = f"  {s.error}" if s.error else ""
            typer.echo(
                f"{s.outcome:<8} {s.node:<{width}}  {s.cache_decision or '-':<20} x{s.attempts}{extra}"
            )
        typer.echo(f"run {rid}: {status} ({report.plan_id} {report.digest})")
    raise typer.Exit(exit_code("run", None, status))
