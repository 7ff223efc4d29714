"""``smthrs plan | approve | deny | resume | cancel`` — the control plane from the command line.

::

    smthrs plan PLAN.yaml [--input k=v]...                       # prints the card: per node command, tier, gate
    smthrs approve PLAN_ID|RUN_ID [--request R] [--digest D] [--scope once|run|remembered] [--as ID/KIND] [--key K]
    smthrs deny    PLAN_ID|RUN_ID [--request R] [--digest D] [--as ID/KIND] [--key K]
    smthrs resume RUN_ID --key K [--as ID/KIND] [--steps N] [--agents N] [--prefect] [--no-wait]
    smthrs resume RUN_ID --key K --flow MODULE:FLOW                 # a flow's run (a Prefect @flow, or NAME=M:F)
    smthrs cancel RUN_ID [--as ID/KIND] [--reason TEXT]

(``smthrs run PLAN.yaml|PLAN_ID --key K`` lives in ``cli/_run.py``.) Invariant: each command opens the runtime named
by its options, calls ONE method of :class:`~smthrs_plugin.control.facade.Control` and prints its answer — a
text (values from a plan file, a run or a store through ``_common.safe_text``), or ONE JSON object with ``--json``
in the CLI's vocabulary (``_common``) — and exits with the code of
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
    safe_text,
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
            pf = read_checked(rt, plan_file)
            card = plan_card(control, pf, parse_inputs(inputs), parse_principal(as_))
            state = control.plan_state(card.plan_id)
            authority = control.approvals.authority
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
    typer.echo("\n".join(card_lines(card, pf, approval, authority)))


#: How much of one attacker-controlled value the card prints (a command, a path, an id), and how many names of a
#: node's reads or writes: the card is for review, the full text is in the plan file and ``smthrs plan --json``.
_CARD_TEXT = 100
_CARD_NAMES = 5


def card_lines(card: Any, pf: Any, approval: str, authority: Any) -> list[str]:
    """The text card of ``smthrs plan``: the plan, its digest and approval state, and per node its command
    (``run``/``call``), tier, reads and writes, needs, timer and approval gate (who may approve, the scopes).
    Every value from the plan file goes through :func:`safe_text` (no terminal escapes, bounded length)."""
    head = [
        f"plan {safe_text(card.plan_id)}  flow {safe_text(card.flow_id)}",
        f"digest {card.digest}",
        f"approval: {approval}"
        + (f"  →  smthrs approve {safe_text(card.plan_id)}" if approval == "pending" else ""),
    ]
    if pf.approval == "required":
        head.append(
            f"  plan gate: {_approvers(authority, 'Plan')}; default scope {card.scope}; "
            f"envelope {_envelope(card.envelope.to_json())}"
        )
    keyed = {n.id: n for n in card.nodes}
    head.append(f"{len(pf.plan.nodes)} node(s):")
    for node in pf.plan.nodes:
        head += _node_lines(node, keyed.get(node.id), authority)
    return head


def _node_lines(node: Any, keyed: Any, authority: Any) -> list[str]:
    draft = node.draft
    lines = [f"  {safe_text(node.id)}  ({safe_text(draft.kind)}, {safe_text(draft.material.tier)})"]
    lines.append(f"    {_command(draft.material.body)}")
    lines.append(f"    reads   {_names(draft.effects.reads)}")
    lines.append(f"    writes  {_names(draft.effects.writes)}")
    if draft.effects.removes:
        lines.append(f"    removes {_names(draft.effects.removes)}")
    lines.append(f"    needs   {', '.join(safe_text(d) for d in node.depends_on) or '-'}")
    if draft.wait is not None:
        lines.append(f"    wait    {safe_text(draft.wait, _CARD_TEXT)}")
    if draft.approval is not None:
        spec = draft.approval
        request = safe_text(spec.get("request", node.id))
        envelope = _envelope(spec.get("envelope") or {})
        lines.append(
            f"    gate    approval {request}: {_approvers(authority, 'Node')}; default scope run; "
            f"envelope {envelope}"
        )
    if keyed is not None:
        lines.append(f"    key     {keyed.key[:21]}…")
    return lines


def _command(body: Any) -> str:
    if isinstance(body, dict) and "run" in body:
        return f"run     {safe_text(body['run'], _CARD_TEXT)}"
    if isinstance(body, dict) and "call" in body:
        args = body.get("with") or {}
        return f"call    {safe_text(body['call'], _CARD_TEXT)}" + (
            f" with {safe_text(args, _CARD_TEXT)}" if args else ""
        )
    return f"body    {safe_text(body, _CARD_TEXT)}"


def _label(entry: Any) -> str:
    """A path entry as declared: a file, a tree ``dir/``, or a glob's patterns (``!`` before an exclusion)."""
    from smthrs_plugin.plan.fileset import TreeArtifact

    if isinstance(entry, str):
        return entry
    if isinstance(entry, TreeArtifact):
        return entry.path + "/"
    return " ".join([*entry.include, *(f"!{x}" for x in entry.exclude)])


def _names(entries: Any) -> str:
    labels = [safe_text(_label(e), _CARD_TEXT) for e in entries]
    if not labels:
        return "0"
    more = f", +{len(labels) - _CARD_NAMES} more" if len(labels) > _CARD_NAMES else ""
    return f"{len(labels)}: {', '.join(labels[:_CARD_NAMES])}{more}"


def _envelope(envelope: Any) -> str:
    parts = [f"{safe_text(k)} {safe_text(v, _CARD_TEXT)}" for k, v in sorted(envelope.items()) if v]
    return "; ".join(parts) or "none"


def _approvers(authority: Any, target_kind: str) -> str:
    """Who may approve a gate of ``target_kind`` (``Plan`` | ``Node``) and with which grant scopes, as the
    runtime's approval authority says; a plugin's authority decides by its own rules, named as such."""
    from smthrs_plugin.control.authority import DelegatedAuthority

    if not isinstance(authority, DelegatedAuthority):
        return f"who may approve: decided by {safe_text(type(authority).__name__)} (a plugin's approval authority)"
    who = [
        f"{safe_text(str(d.principal))} (scopes {'|'.join(sorted(d.scopes))})"
        for d in authority.delegations
        if target_kind in d.targets
    ]
    return "who may approve: " + (", ".join(who) or "nobody (no delegation covers it)")


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
    return plan_card(control, read_checked(rt, plan_file), inputs, principal, renew=renew)


def read_checked(rt: Runtime, plan_file: Path) -> Any:
    """Read and compile a plan file (a regular file; ``approval:`` either ``required`` or absent)."""
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
    return pf


def plan_card(
    control: Control, pf: Any, inputs: dict[str, str], principal: Any, *, renew: bool = True
) -> Any:
    """Plan a read plan file: its card (``renew`` as in :meth:`Control.plan`)."""
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
                control,
                receipt,
                as_json=as_json,
                report=launcher.report,
                operation="resume",
                held=held,
                run_id=run_id,
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
            return answer(control, receipt, as_json=as_json, operation="resume", run_id=run_id)
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
            code = answer(control, receipt, as_json=as_json, operation="cancel", run_id=run_id)
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
