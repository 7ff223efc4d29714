"""``smthrs worker`` — a run driver in the foreground: registered flows (and plan files) are driven, parked runs
are woken at their deadlines, released and stale runs are taken over, cancellations are settled.

::

    smthrs worker --flow nightly=mypkg.flows:nightly [--plan release.yaml] [--budget S] [--max-runs N]
    smthrs worker --flow nightly=mypkg.flows:nightly --run r1 [--json]
    smthrs worker --flow mypkg.flows:prefect_flow [--run r1 [--param day=2026-11-30]...]   # a Prefect @flow

Invariants:

- Without ``--run`` the worker serves until SIGINT/SIGTERM, then shuts down: the runs it drives are RELEASED
  (``suspended``/``released``, claimable at once by any other worker), never cancelled; exit 0.
- With ``--run RUN_ID[=FLOW]`` it creates the run if needed (as a run of FLOW, or of the only ``--flow``), drives
  it once in the foreground and exits with its outcome (the one table, ``cli/exits.py``): 0 completed, 1 failed
  or cancelled, 75 not finished — parked (a timer or an event), released by SIGINT/SIGTERM (the run's next wait
  gives it back, a second signal interrupts at once), or held by another live owner — the process may exit, any
  worker continues the run later — and 2 for a refused input (an unknown flow).
- ``--flow NAME=MODULE:FUNCTION`` registers ``FUNCTION(ctx)``; ``--flow MODULE:FLOW`` registers a Prefect ``@flow``
  under ``prefect/<flow name>`` (``prefect/flows.py``: each drive is a new flow run bound to the run, called with
  the parameters the run started with); ``--plan PLAN.yaml`` registers the plan file's flow
  (its runs are driven by the plan scheduler; settled nodes replay ``clean``, timer nodes keep their deadlines).
  A malformed spec is refused (exit 2) before anything is written.
- ``--param NAME=VALUE``: VALUE is decoded by the bounded decoder for untrusted JSON (``_untrusted.decode_json``);
  text that is not JSON at all is the string itself (as Prefect's own ``--param``), but JSON outside the decoder's
  bounds — an integer of more than 100 digits, ``NaN``, a duplicate member name, deep nesting — is refused (exit 2),
  never silently kept as a string. ``--budget`` and ``--grace`` are finite seconds (``inf``/``nan``/negative
  refused: a shutdown's thread join would overflow on ``inf``).
- The driver comes from the composition root (``open_runtime(...).run_driver(...)``), so it claims and steals
  with the same owner, liveness check and metrics as every other part of the runtime.

Absolute imports on purpose; heavy imports stay inside the command.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from smthrs_plugin._untrusted import decode_json
from smthrs_plugin.cli._common import check_workspace, db_url, seconds
from smthrs_plugin.cli._common import refuse as _refuse
from smthrs_plugin.cli.exits import EXIT_PARKED, EXIT_REFUSED, exit_code
from smthrs_plugin.errors import InvalidInput, SmthrsError, WaitError

__all__ = ["register", "worker", "parse_flow_spec", "outcome_exit_code", "drive_one"]


def register(app: typer.Typer) -> None:
    """Add ``smthrs worker`` to the root app."""
    app.command("worker")(worker)


def parse_flow_spec(spec: str) -> tuple[str, Any]:
    """``NAME=MODULE:FUNCTION`` → (name, callable); a Prefect ``@flow`` as ``[NAME=]MODULE:FLOW`` → its driver code
    under ``prefect/<flow name>`` (NAME, when given, must be that name: it is the flow of the runs a direct call
    of the flow parked). ``WaitError(invalid_wait)`` otherwise. MODULE is imported with the current directory on
    ``sys.path`` (as ``python -m`` would), so a flow file next to you just works."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    name, eq, target = spec.partition("=") if "=" in spec else ("", "", spec)
    module, colon, attr = target.partition(":")
    if not colon or not module or not attr or (eq and not name):
        raise WaitError(
            "invalid_wait",
            f"--flow {spec!r}: write NAME=MODULE:FUNCTION (e.g. nightly=mypkg.flows:nightly), or MODULE:FLOW for a "
            "Prefect @flow",
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise WaitError(
            "invalid_wait", f"--flow {spec!r}: cannot import {target!r} ({exc})", cause=exc
        ) from exc
    if not callable(fn):
        raise WaitError("invalid_wait", f"--flow {spec!r}: {target!r} is not callable")
    from smthrs_plugin.prefect.flows import flow_fn, flow_name, is_prefect_flow

    if is_prefect_flow(fn):
        own = flow_name(fn)
        if name and name != own:
            raise WaitError(
                "invalid_wait",
                f"--flow {spec!r}: a Prefect flow's runs belong to {own!r}; write --flow {target} (or {own}={target})",
            )
        return own, flow_fn(fn)
    if not name:
        raise WaitError(
            "invalid_wait", f"--flow {spec!r}: {target!r} is not a Prefect flow; write NAME=MODULE:FUNCTION"
        )
    return name, fn


def outcome_exit_code(outcome: Any) -> int:
    """The CLI exit code of a drive outcome, from the one table (``cli/exits.py``): the run's status after it."""
    from smthrs_plugin.engine.drive.active_run import (
        DriveLost,
        DriveNotClaimed,
        DriveParked,
        DriveReleased,
        DriveSettled,
    )
    from smthrs_plugin.engine.ownership.arbiter import HeartbeatFresh, StealRefusedOwnerAlive, Terminal

    if isinstance(outcome, DriveSettled):
        return exit_code("worker", None, outcome.status)
    if isinstance(outcome, DriveParked):
        return exit_code("worker", None, "suspended", outcome.wait.reason)
    if isinstance(outcome, DriveReleased):
        return exit_code("worker", None, "suspended", "released")
    if isinstance(outcome, DriveNotClaimed) and isinstance(outcome.decision, Terminal):
        return exit_code("worker", None, outcome.decision.status)
    if isinstance(outcome, DriveLost) or (
        isinstance(outcome, DriveNotClaimed)
        and isinstance(outcome.decision, (HeartbeatFresh, StealRefusedOwnerAlive))
    ):
        return exit_code("worker", None, "running")  # another live owner holds it: not done, try again later
    return EXIT_REFUSED  # unregistered flow, a claim lost to another claimant: refused as asked


def _outcome_json(outcome: Any) -> dict[str, Any]:
    from smthrs_plugin.engine.drive.active_run import DriveParked

    out: dict[str, Any] = {"run_id": outcome.run_id, "outcome": type(outcome).__name__}
    if isinstance(outcome, DriveParked):
        w = outcome.wait
        out["status"] = "parked"
        out["wait"] = {"reason": w.reason, **{k: v for k, v in vars(w).items() if v is not None}}
    for field in ("status", "requested_status", "cause", "reason", "flow"):
        if hasattr(outcome, field) and field not in out:
            out[field] = getattr(outcome, field)
    if hasattr(outcome, "decision"):
        out["decision"] = type(outcome.decision).__name__
    return out


def worker(
    flow: Annotated[
        list[str] | None,
        typer.Option(
            "--flow", help="Register NAME=MODULE:FUNCTION, or MODULE:FLOW for a Prefect @flow (repeatable)."
        ),
    ] = None,
    plan: Annotated[
        list[Path] | None, typer.Option("--plan", help="Register a plan file's flow (repeatable).")
    ] = None,
    run: Annotated[
        str | None,
        typer.Option("--run", help="Drive RUN_ID[=FLOW] once in the foreground and exit (0/1/75)."),
    ] = None,
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            help="NAME=VALUE parameter of a new --run of a Prefect flow (VALUE parsed as JSON, else a string).",
        ),
    ] = None,
    budget: Annotated[
        float | None,
        typer.Option("--budget", help="In-process wait budget in seconds (default SMTHRS_WAIT_BUDGET_S)."),
    ] = None,
    max_runs: Annotated[int, typer.Option("--max-runs", help="Runs driven at once.")] = 8,
    workspace: Annotated[
        Path | None, typer.Option("--workspace", help="Workspace root (default: SMTHRS_WORKSPACE, else cwd).")
    ] = None,
    db: Annotated[str | None, typer.Option("--db", help="Database URL (default: SMTHRS_DB_URL).")] = None,
    grace: Annotated[float, typer.Option("--grace", help="Seconds to let runs stop at shutdown.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines instead of text.")] = False,
) -> None:
    """Drive registered flows until interrupted (or one run with --run)."""
    from smthrs_plugin.runtime import Runtime, open_runtime
    from smthrs_plugin.settings import load_settings

    runtime: Runtime | None = None
    try:
        try:
            check_workspace(workspace)
            settings = load_settings(workspace=workspace, db_url=db_url(db, workspace))
            if budget is not None:
                budget = seconds(budget, "--budget")
            grace = seconds(grace, "--grace")
            parameters = _parse_params(param) if param else None
            if parameters is not None and run is None:
                raise WaitError("invalid_wait", "--param applies to the run given with --run")
            from smthrs_plugin.prefect.steprun import step_settings

            # A Prefect flow's steps use the workspace (and database) this worker was given: registration captures
            # it, and a --run drive re-registers the flow with its parameters inside the same scope.
            with step_settings(workspace=settings.workspace, db=settings.resolved_db_url):
                flows = dict(parse_flow_spec(s) for s in (flow or []))
                if not flows and not plan:  # refused before the runtime creates the workspace or the database
                    raise WaitError(
                        "invalid_wait",
                        "register at least one flow: --flow NAME=MODULE:FUNCTION or --plan FILE",
                    )
                runtime = open_runtime(workspace=settings.workspace, db=settings.resolved_db_url)
                flows.update(_plan_flows(runtime, plan or []))
                # A driver of its own: --budget and --max-runs are this worker's, not the runtime's defaults.
                driver = runtime.run_driver(wait_budget_s=budget, max_runs=max_runs)
                for name, fn in flows.items():
                    driver.register(name, fn)
                if run is not None:
                    outcome = drive_one(driver, run, flows, parameters)
        except SmthrsError as exc:
            _refuse(as_json, exc)
        except BaseException as exc:
            # A second signal while driving --run (KeyboardInterrupt), or SIGTERM inside a Prefect flow (Prefect
            # turns it into its TerminationSignal): the driver released the run (resumable by any worker), never
            # cancelled.
            if not _interrupted(exc):
                raise
            typer.echo(
                json.dumps({"run_id": run, "outcome": "interrupted"})
                if as_json
                else "interrupted; run released"
            )
            raise typer.Exit(EXIT_PARKED) from None
        if run is not None:
            typer.echo(
                json.dumps(_outcome_json(outcome), sort_keys=True) if as_json else _outcome_line(outcome)
            )
            raise typer.Exit(outcome_exit_code(outcome))
        _serve(driver, grace, as_json)
    finally:
        if runtime is not None:
            runtime.close()


def _interrupted(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    prefect_exceptions = sys.modules.get("prefect.exceptions")
    return prefect_exceptions is not None and isinstance(exc, prefect_exceptions.TerminationSignal)


def _parse_params(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        if not eq or not name:
            raise WaitError(
                "invalid_wait", f"--param {item!r}: write NAME=VALUE (e.g. --param day=2026-11-30)"
            )
        try:
            out[name] = decode_json(raw, f"--param {name}")
        except InvalidInput as exc:
            if exc.details.get("bound") != "plain_data":
                raise  # JSON outside the bounds is refused, never kept as a string that looks like the number
            out[name] = raw  # like Prefect's own --param: a value that is not JSON at all is a string
    return out


def drive_one(driver: Any, spec: str, flows: dict[str, Any], parameters: dict[str, Any] | None = None) -> Any:
    """Drive ``RUN_ID[=FLOW]`` once on this thread (created if new) and return the drive outcome; refusals
    (unknown flow, a run of another flow, parameters a Prefect flow cannot take) come before any write."""
    signals = 0

    def _interrupt(signum: int, _frame: Any) -> None:
        # First SIGINT/SIGTERM: a cooperative shutdown (the run is released at its next wait, exit 75). A second
        # one: KeyboardInterrupt wherever the flow is (the driver still releases the run on its way out).
        nonlocal signals
        signals += 1
        if signals > 1:
            raise KeyboardInterrupt
        driver.interrupt()

    run_id, eq, flow_name = spec.partition("=")
    if not run_id:
        raise WaitError("invalid_wait", f"--run {spec!r}: write RUN_ID or RUN_ID=FLOW")
    if not eq:
        if len(flows) != 1:
            raise WaitError(
                "invalid_wait", f"--run {spec!r}: several flows are registered; write RUN_ID=FLOW"
            )
        flow_name = next(iter(flows))
    if flow_name not in flows:
        raise WaitError(
            "unregistered_flow", f"--run {spec!r}: flow {flow_name!r} is not registered (--flow/--plan)"
        )
    prefect_flow = getattr(flows[flow_name], "prefect_flow", None)
    if prefect_flow is not None:
        from smthrs_plugin.prefect.flows import flow_fn, resolve_parameters

        # Checked before the run is created: a Prefect flow that could not be called is refused, not failed.
        params = resolve_parameters(
            prefect_flow, run_id, parameters, runs=driver.runs, journal=driver.journal
        )
        driver.register(flow_name, flow_fn(prefect_flow, params))
    elif parameters is not None:
        raise WaitError("invalid_wait", f"--param applies to Prefect flows; {flow_name!r} is not one")
    existing = driver.runs.get(run_id)
    if existing is None:
        driver.submit(run_id, flow_name)
    elif existing.flow != flow_name:
        raise WaitError(
            "invalid_wait",
            f"run {run_id!r} is a run of flow {existing.flow!r}, not {flow_name!r}",
            run_id=run_id,
        )
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return driver.drive(run_id)
    finally:
        for sig, handler in previous.items():  # a caller in the same process gets its handlers back
            signal.signal(sig, handler)


def _outcome_line(outcome: Any) -> str:
    data = _outcome_json(outcome)
    rest = " ".join(f"{k}={v}" for k, v in sorted(data.items()) if k not in ("run_id", "outcome"))
    return f"run {data['run_id']}: {data['outcome']} {rest}".rstrip()


def _serve(driver: Any, grace: float, as_json: bool) -> None:
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        driver.start()
        msg = {"event": "serving", "flows": list(driver.flows), "owner": str(driver.owner)}
        typer.echo(
            json.dumps(msg, sort_keys=True)
            if as_json
            else f"serving {', '.join(driver.flows)} as {driver.owner}"
        )
        while not stop.wait(0.5):
            pass
        outcomes = driver.stop(grace_s=grace)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    released = [o.run_id for o in outcomes if type(o).__name__ == "DriveReleased"]
    msg = {"event": "stopped", "released": released}
    typer.echo(json.dumps(msg, sort_keys=True) if as_json else f"stopped; released {released or 'nothing'}")


def _plan_flows(runtime: Any, files: list[Path]) -> dict[str, Any]:
    """Flow name → a FlowFn driving that plan file's runs (the driver already owns the run)."""
    from smthrs_plugin.engine.context import RunReleased
    from smthrs_plugin.engine.drive.active_run import FlowCompleted, FlowFailed
    from smthrs_plugin.errors import SchedulerError
    from smthrs_plugin.scheduler.planfile import read_plan_file

    out: dict[str, Any] = {}
    for f in files:
        pf = read_plan_file(f)

        def drive_plan(ctx: Any, pf: Any = pf) -> Any:
            try:
                report = runtime.scheduler(ctx.run_id, drive_run=False).run(pf.plan, pf.executor)
            except SchedulerError as exc:
                if exc.code != "invalid_plan":
                    raise
                # This file is not the plan the run recorded (or it changed): give the run back, resumable by a
                # worker with the right file, exactly as `smthrs run --run-id` leaves a refused run.
                raise RunReleased(ctx.run_id, "refused") from exc
            summary = {
                "plan_id": report.plan_id,
                "key": report.digest,
                "outcomes": report.outcomes,
            }  # key1_: `key`
            return FlowFailed(summary) if report.failed else FlowCompleted(summary)

        if pf.plan.flow in out:
            raise WaitError(
                "invalid_wait", f"two plan files declare flow {pf.plan.flow!r}; one flow, one plan"
            )
        out[pf.plan.flow] = drive_plan
    return out
