"""``smthrs plan | approve | deny | resume | cancel`` — the control plane from the command line.

::

    smthrs plan PLAN.yaml [--input k=v]...                       # prints the PlanCard (plan id, digest, nodes)
    smthrs approve PLAN_ID|RUN_ID [--request R] [--digest D] [--scope once|run|remembered] [--as ID/KIND] [--key K]
    smthrs deny    PLAN_ID|RUN_ID [--request R] [--digest D] [--as ID/KIND] [--key K]
    smthrs resume RUN_ID --key K [--as ID/KIND] [--steps N] [--agents N] [--prefect] [--no-wait]
    smthrs resume RUN_ID --key K --flow MODULE:FLOW                 # a flow's run (a Prefect @flow, or NAME=M:F)
    smthrs cancel RUN_ID [--as ID/KIND] [--reason TEXT]

(``smthrs run PLAN.yaml|PLAN_ID --key K`` lives in ``cli/_run.py``.) Invariant: each command opens the runtime named
by its options, calls ONE method of :class:`~smthrs_plugin.control.facade.Control` and prints its answer — a
rich table and a headline, or ONE JSON object with ``--json`` — and exits with the code of
:mod:`.control_support`. The CLI is a trusted host capability (it holds database access); ``--as`` names who
decides and the approval authority (default: only ``local/operator``) judges it.

Refused before the runtime opens (exit 2, nothing created): ``approve``, ``deny``, ``resume``, ``cancel`` and ``run
PLAN_ID --key`` on a SQLite database that does not exist (they act on what it records; an empty one made by a typo
would only answer "not found" after creating it); a workspace that is not a directory; ``--steps``/``--agents``
that are not positive (before a run is admitted, not as its failure); a plan file that is not a regular file (a
FIFO would block the read forever).

Absolute imports on purpose (see ``cli/_cache.py``); heavy imports stay inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from smthrs_plugin.cli._common import (
    DbOption,
    JsonOption,
    WorkspaceOption,
    check_workspace,
    db_url,
    existing_db_url,
)
from smthrs_plugin.cli.control_support import (
    PlanLauncher,
    answer,
    concurrency_caps,
    fail,
    follow,
    parse_inputs,
    parse_principal,
)
from smthrs_plugin.errors import ControlError, SmthrsError

if TYPE_CHECKING:  # pragma: no cover
    from smthrs_plugin.control.facade import Control
    from smthrs_plugin.control.follow import Held
    from smthrs_plugin.runtime import Runtime

__all__ = ["register", "plan_command", "approve_command", "deny_command", "resume_command", "cancel_command"]

JsonOpt = JsonOption
DbOpt = DbOption
WorkspaceOpt = WorkspaceOption
TargetArg = Annotated[str, typer.Argument(help="A plan id, or a run id with --request.", show_default=False)]
RequestOpt = Annotated[str | None, typer.Option("--request", help="The node request of a run.")]
DigestOpt = Annotated[
    str | None, typer.Option("--digest", help="The digest you reviewed (refused if stale).")
]
AsOpt = Annotated[
    str | None, typer.Option("--as", help="The deciding principal ID/KIND (default: local/operator).")
]
KeyOpt = Annotated[
    str | None, typer.Option("--key", help="Idempotency key (default: derived from the target).")
]
InputOpt = Annotated[list[str] | None, typer.Option("--input", help="Plan input KEY=VALUE (repeatable).")]
NoWaitOpt = Annotated[
    bool,
    typer.Option(
        "--no-wait",
        help="When another live process owns the run, exit 75 naming it (host, pid) instead of following the run "
        "(or waiting for its lease to expire to take it over).",
    ),
]


def register(app: typer.Typer) -> None:
    """Add the control-plane commands to the root app."""
    app.command("plan")(plan_command)
    app.command("approve")(approve_command)
    app.command("deny")(deny_command)
    app.command("resume")(resume_command)
    app.command("cancel")(cancel_command)


def plan_command(
    plan_file: Annotated[Path, typer.Argument(help="The plan file (YAML).", show_default=False)],
    inputs: InputOpt = None,
    as_: AsOpt = None,
    workspace: WorkspaceOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Plan a plan file: store it and print its reviewable card (plan id, digest, node graph, approval state)."""
    from smthrs_plugin.runtime import open_runtime

    try:
        check_workspace(workspace)
        with open_runtime(workspace=workspace, db=db_url(db, workspace)) as rt:
            control = rt.control()
            card = card_of_file(control, rt, plan_file, parse_inputs(inputs), parse_principal(as_))
            state = control.plan_state(card.plan_id)
    except SmthrsError as exc:
        raise fail(as_json, exc) from None
    approval = "none" if state is None else state.tag.lower()
    if as_json:
        # Our fields snake_case like every --json; the card itself in the reference's wire form (``card.planId``).
        payload = {
            "plan_id": card.plan_id,
            "flow_id": card.flow_id,
            "digest": card.digest,
            "approval_state": approval,
            "card": card.to_json(),
        }
        typer.echo(json.dumps(payload, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("node", "kind", "key", "needs", title=f"plan {card.plan_id} ({card.flow_id})")
    for n in card.nodes:
        table.add_row(n.id, n.kind, n.key[:21] + "…", ", ".join(n.depends_on) or "-")
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    console.print(f"digest {card.digest}")
    console.print(
        f"approval: {approval}" + (f"  →  smthrs approve {card.plan_id}" if approval == "pending" else "")
    )


def card_of_file(
    control: Control,
    rt: Runtime,
    plan_file: Path,
    inputs: dict[str, str],
    principal: Any,
    *,
    renew: bool = True,
) -> Any:
    """Read, compile and plan a plan file (``approval: required`` gates the card); ``renew`` as in
    :meth:`Control.plan` (``smthrs plan`` renews a retired card, ``smthrs run`` does not)."""
    import stat

    from smthrs_plugin.errors import PlanError
    from smthrs_plugin.scheduler.planfile import read_plan_file

    try:
        mode = plan_file.stat().st_mode
    except OSError:
        mode = None  # missing or unreadable: read_plan_file refuses it with its own message
    if mode is not None and not stat.S_ISREG(mode):
        raise PlanError(
            "invalid_plan_file",
            f"{plan_file} is not a regular file (a directory, FIFO or device); pass the plan file's path",
        )
    pf = read_plan_file(plan_file, actions=rt.actions)
    if pf.approval not in (None, "none", "required"):
        raise ControlError(
            "invalid_options",
            f"{plan_file}: approval: {pf.approval!r} is not understood; write `approval: required` (or leave it out)",
        )
    return control.plan(
        pf.plan,
        input=inputs,
        envelope=pf.envelope,
        approval=pf.approval == "required",
        principal=principal,
        renew=renew,
    )


def _decision(control: Control, target: Any) -> str | None:
    """The recorded decision on ``target`` now (``approved`` | ``denied`` | None): what makes a retried ``deny``
    exit 3 every time, whatever receipt it got (``exits.exit_code``)."""
    from smthrs_plugin.control.authority import NodeTarget

    if isinstance(target, NodeTarget):
        for r in control.show(target.run_id).requests:
            if r.request_id == target.request_id:
                return r.state if r.state in ("approved", "denied") else None
        return None
    state = control.plan_state(target.plan_id)
    tag = None if state is None else state.tag.lower()
    return tag if tag in ("approved", "denied") else None


def _decide(
    action: str,
    ident: str,
    request: str | None,
    digest: str | None,
    scope: str | None,
    as_: str | None,
    key: str | None,
    workspace: Path | None,
    db: str | None,
    as_json: bool,
) -> None:
    from smthrs_plugin.runtime import open_runtime

    try:
        check_workspace(workspace)
        url = existing_db_url(db, action, workspace)
        with open_runtime(workspace=workspace, db=url) as rt:
            control = rt.control()
            principal = parse_principal(as_)
            target = control.approval_target(ident, request, digest)
            if action == "approve":
                receipt = control.approve(target, scope=scope, idempotency_key=key, principal=principal)
            else:
                receipt = control.deny(target, idempotency_key=key, principal=principal)
            from smthrs_plugin.control.authority import PlanTarget

            code = answer(
                control,
                receipt,
                as_json=as_json,
                card=target if isinstance(target, PlanTarget) else None,  # its plan_id and digest
                operation=action,
                decision=_decision(control, target),
            )
    except SmthrsError as exc:
        raise fail(as_json, exc) from None
    raise typer.Exit(code)


def approve_command(
    ident: TargetArg,
    request: RequestOpt = None,
    digest: DigestOpt = None,
    scope: Annotated[
        str | None, typer.Option("--scope", help="once | run | remembered (default run).")
    ] = None,
    as_: AsOpt = None,
    key: KeyOpt = None,
    workspace: WorkspaceOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve a plan card (its launch) or a run's node request (the run resumes)."""
    if scope is not None:
        from smthrs_plugin.control.approvals import check_scope

        try:
            check_scope(scope)  # refused input (exit 2), before the database is opened or the authority asked
        except SmthrsError as exc:
            raise fail(as_json, exc) from None
    _decide("approve", ident, request, digest, scope, as_, key, workspace, db, as_json)


def deny_command(
    ident: TargetArg,
    request: RequestOpt = None,
    digest: DigestOpt = None,
    as_: AsOpt = None,
    key: KeyOpt = None,
    workspace: WorkspaceOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Deny a plan card (it never launches) or a node request (the node fails with ApprovalDenied)."""
    _decide("deny", ident, request, digest, None, as_, key, workspace, db, as_json)


def resume_command(
    run_id: Annotated[str, typer.Argument(help="The run to drive again.", show_default=False)],
    key: Annotated[str, typer.Option("--key", help="Idempotency key of this resume.")],
    as_: AsOpt = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Cap on nodes in flight.")] = None,
    agents: Annotated[int | None, typer.Option("--agents", help="Cap on agent nodes in flight.")] = None,
    prefect: Annotated[bool, typer.Option("--prefect", help="Drive it inside a Prefect flow run.")] = False,
    flow: Annotated[
        str | None,
        typer.Option(
            "--flow",
            help="A flow's run, not a plan's: drive it with MODULE:FLOW (a Prefect @flow) or NAME=MODULE:FUNCTION.",
        ),
    ] = None,
    workspace: WorkspaceOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
    no_wait: NoWaitOpt = False,
) -> None:
    """Drive a run again now (after a node approval, or a crash): settled nodes replay clean. A run another live
    process owns is followed to its end (or, its owner gone, taken over at its lease expiry); exit 0 only once the
    run completed."""
    from smthrs_plugin.runtime import open_runtime

    try:
        caps = concurrency_caps(steps, agents)  # refused input, not a run that fails on its caps
        check_workspace(workspace)
        url = existing_db_url(db, "resume", workspace)
    except SmthrsError as exc:
        raise fail(as_json, exc) from None
    if flow is not None:
        raise typer.Exit(_resume_flow(run_id, key, flow, as_, workspace, url, as_json))
    try:
        with open_runtime(workspace=workspace, db=url) as rt:
            control = rt.control()
            launcher = PlanLauncher(rt, caps, prefect=prefect, progress=not as_json)
            principal = parse_principal(as_)
            receipt = control.resume(run_id, idempotency_key=key, principal=principal, launcher=launcher)
            held = _finish(
                control,
                receipt,
                lambda: control.resume(run_id, idempotency_key=key, principal=principal, launcher=launcher),
                wait=not no_wait,
            )
            code = answer(
                control, receipt, as_json=as_json, report=launcher.report, operation="resume", held=held
            )
    except SmthrsError as exc:
        raise fail(as_json, exc) from None
    raise typer.Exit(code)


def _resume_flow(
    run_id: str, key: str, spec: str, as_: str | None, workspace: Path | None, db: str | None, as_json: bool
) -> int:
    """``resume --flow``: the receipt as for any resume (Terminal / Parked answered before anything runs), then
    ONE drive of the run with the flow's code in this process; the answer reads the run's state after it."""
    from smthrs_plugin.cli.worker import drive_one, parse_flow_spec
    from smthrs_plugin.control.receipts import Accepted, AlreadyApplied
    from smthrs_plugin.prefect.steprun import step_settings
    from smthrs_plugin.runtime import open_runtime

    try:
        with (
            open_runtime(workspace=workspace, db=db) as rt,
            step_settings(workspace=rt.workspace, db=rt.db.url),
        ):
            name, fn = parse_flow_spec(spec)  # refused (exit 2) before the receipt is recorded
            control = rt.control()
            receipt = control.resume(run_id, idempotency_key=key, principal=parse_principal(as_))
            if isinstance(receipt, (Accepted, AlreadyApplied)):
                driver = rt.driver
                driver.register(name, fn)
                drive_one(driver, f"{run_id}={name}", {name: fn})
            return answer(control, receipt, as_json=as_json, operation="resume")
    except SmthrsError as exc:
        raise fail(as_json, exc) from None


def cancel_command(
    run_id: Annotated[
        str, typer.Argument(help="The run to cancel (and its live descendants).", show_default=False)
    ],
    reason: Annotated[str | None, typer.Option("--reason", help="Why (journaled).")] = None,
    as_: AsOpt = None,
    workspace: WorkspaceOpt = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a run: a parked or pending run settles cancelled now, a running one at its owner's next heartbeat."""
    from smthrs_plugin.runtime import open_runtime

    try:
        check_workspace(workspace)
        with open_runtime(workspace=workspace, db=existing_db_url(db, "cancel", workspace)) as rt:
            control = rt.control()
            receipt = control.cancel(run_id, principal=parse_principal(as_), reason=reason)
            code = answer(control, receipt, as_json=as_json, operation="cancel")
    except SmthrsError as exc:
        raise fail(as_json, exc) from None
    raise typer.Exit(code)


def run_with_key(
    target: Path,
    key: str,
    *,
    inputs: list[str] | None,
    as_: str | None,
    concurrency: dict[str, Any],
    prefect: bool,
    workspace: Path | None,
    db: str | None,
    as_json: bool,
    no_wait: bool = False,
) -> int:
    """``smthrs run PLAN.yaml|PLAN_ID --key K``: plan (a file), check the approval, admit under the key, and drive
    the run in this process; the same command again is the retry (``AlreadyApplied``): it finishes a run nobody
    drives (reclaiming an orphaned admission, taking over a dead owner's run at its lease expiry) or follows a
    live owner's run to its end (``--no-wait``: exit 75 naming the owner). Returns the exit code; refusals raise
    ``typer.Exit`` after printing."""
    from smthrs_plugin.runtime import open_runtime

    try:
        caps = concurrency_caps(concurrency.get("steps"), concurrency.get("agents"))
        check_workspace(workspace)
        # A plan id names a card an existing database records; a plan file may start a new database.
        url = db_url(db, workspace) if target.exists() else existing_db_url(db, "run PLAN_ID", workspace)
        with open_runtime(workspace=workspace, db=url) as rt:
            control = rt.control()
            principal = parse_principal(as_)
            if target.exists():
                card = card_of_file(control, rt, target, parse_inputs(inputs), principal, renew=False)
            elif inputs:
                raise ControlError(
                    "invalid_options",
                    f"--input applies to a plan file; {str(target)!r} is a plan id whose input is already pinned",
                    option="input",
                )
            else:
                card = control.card(str(target))
            launcher = PlanLauncher(rt, caps, prefect=prefect, progress=not as_json)
            receipt = control.run(card, idempotency_key=key, principal=principal, launcher=launcher)
            held = _finish(
                control,
                receipt,
                lambda: control.run(card, idempotency_key=key, principal=principal, launcher=launcher),
                wait=not no_wait,
            )
            return answer(
                control,
                receipt,
                as_json=as_json,
                card=card,
                report=launcher.report,
                operation="run",
                held=held,
            )
    except SmthrsError as exc:
        raise fail(as_json, exc) from None


def _finish(control: Control, receipt: Any, relaunch: Any, *, wait: bool) -> Held | None:
    """After a run/resume receipt: finish the run it names or follow it to its end (``control_support.follow``);
    a ``Parked``/``Conflict``/``Terminal`` answer has nothing to finish."""
    from smthrs_plugin.control.receipts import Accepted, AlreadyApplied

    if not isinstance(receipt, (Accepted, AlreadyApplied)) or receipt.run_id is None:
        return None
    return follow(control, receipt.run_id, relaunch, wait=wait)
