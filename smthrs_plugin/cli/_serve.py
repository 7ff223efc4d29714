"""``smthrs serve`` — the control plane over HTTP — and ``smthrs signal`` — answer a run's wait.

::

    smthrs serve [--host 127.0.0.1] [--port 8787] [--quiet] [--token-file F] [--as ID/KIND]
                 [--header-timeout S] [--body-timeout S] [--max-connections N] [--max-client-connections N]
    smthrs signal RUN NAME --value JSON [--key K] [--as ID/KIND] [--json]

Invariant: ``serve`` is one call of :func:`smthrs_plugin.serve.server.run_server` (typed refusals — a network bind
without a credential, a token file that is not a small regular file, a limit out of range, a port in use — exit 2
before anything listens; SIGTERM/SIGINT exit 0); ``signal`` is one call
of :meth:`~smthrs_plugin.control.facade.Control.signal` and prints the object the ``signal`` JSON-RPC method
answers (``serve/wire.py``). Exit codes: ``signal`` 0 when the value is delivered (now, or by an identical earlier
call: ``Accepted``/``AlreadyApplied``); 2 for refused input, an unknown run, a ``Conflict`` (the key already names
another signal), an already-answered wait or a settled run (``Terminal``: nothing was delivered).

FastAPI and uvicorn are imported inside the commands: ``smthrs --help`` must not load them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from smthrs_plugin.cli._common import DbOption, JsonOption, WorkspaceOption, existing_db_url
from smthrs_plugin.cli.control_support import fail, parse_principal
from smthrs_plugin.cli.exits import EXIT_OK, exit_code
from smthrs_plugin.errors import SmthrsError
from smthrs_plugin.serve.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CLIENT_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS,
    FD_HEADROOM,
    ConnectionLimits,
)

__all__ = ["register", "serve_command", "signal_command", "DEFAULT_PORT"]

DEFAULT_PORT = 8787


def register(app: typer.Typer) -> None:
    """Add ``smthrs serve`` and ``smthrs signal`` to the root app."""
    app.command("serve")(serve_command)
    app.command("signal")(signal_command)


def serve_command(
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to bind. Loopback prints a per-session approval token; any other address needs "
            "SMTHRS_SERVE_TOKEN or --token-file.",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port (0: a free one).")
    ] = DEFAULT_PORT,
    quiet: Annotated[
        bool, typer.Option("--quiet", help="Print only the token and listening lines (and errors).")
    ] = False,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file", help="A file holding the bearer credential (wins over SMTHRS_SERVE_TOKEN)."
        ),
    ] = None,
    as_: Annotated[
        str | None,
        typer.Option("--as", help="The principal an authenticated caller acts as (default local/operator)."),
    ] = None,
    header_timeout: Annotated[
        float,
        typer.Option(
            "--header-timeout",
            metavar="SECONDS",
            help="A request's line and headers must arrive within this many seconds, or the connection is closed.",
        ),
    ] = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout: Annotated[
        float,
        typer.Option(
            "--body-timeout",
            metavar="SECONDS",
            help="A request's body must arrive within this many seconds of its headers, or the connection is closed.",
        ),
    ] = DEFAULT_BODY_TIMEOUT_S,
    max_connections: Annotated[
        int | None,
        typer.Option(
            "--max-connections",
            help=f"Open connections in total; more are answered 503 (default {DEFAULT_MAX_CONNECTIONS}, or half "
            f"the open-file limit when lower; at most that limit minus {FD_HEADROOM}).",
            show_default=False,
        ),
    ] = None,
    max_client_connections: Annotated[
        int,
        typer.Option(
            "--max-client-connections", help="Open connections per client address; more are answered 503."
        ),
    ] = DEFAULT_MAX_CLIENT_CONNECTIONS,
    workspace: WorkspaceOption = None,
    db: DbOption = None,
) -> None:
    """Serve the control plane over HTTP: JSON-RPC verbs at /rpc, run events at /projections, the review page at /."""
    try:
        # Checked before the server's modules load (FastAPI, uvicorn, the runtime: ~0.9 s of CPU), so a limit out of
        # range is refused at once.
        limits = ConnectionLimits(
            header_timeout_s=header_timeout,
            body_timeout_s=body_timeout,
            max_connections=max_connections,
            max_client_connections=max_client_connections,
        )
        from smthrs_plugin.serve.server import run_server

        run_server(
            host=host,
            port=port,
            quiet=quiet,
            token_file=token_file,
            principal=parse_principal(as_),
            workspace=workspace,
            db=db,
            limits=limits,
        )
    except SmthrsError as exc:
        raise fail(False, exc) from None


def signal_command(
    run_id: Annotated[str, typer.Argument(help="The waiting run.", show_default=False)],
    name: Annotated[str, typer.Argument(help="The wait's name (sp.wait_for(NAME)).", show_default=False)],
    value: Annotated[
        str, typer.Option("--value", help="The value to deliver, as JSON text.", show_default=False)
    ],
    key: Annotated[
        str | None, typer.Option("--key", help="Idempotency key (default: signal:RUN:NAME).")
    ] = None,
    as_: Annotated[
        str | None, typer.Option("--as", help="Who signals, ID/KIND (default local/operator).")
    ] = None,
    workspace: WorkspaceOption = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Deliver a value to a run's wait (what sp.wait_for(NAME) returns); a run parked on it wakes."""
    from smthrs_plugin.runtime import open_runtime
    from smthrs_plugin.serve.wire import loads_json, receipt_payload

    try:
        decoded = loads_json(value, "--value")  # refused (exit 2) before the database is opened
        # A signal goes to an existing run: a mistyped --db must not create an empty database to look in.
        with open_runtime(workspace=workspace, db=existing_db_url(db, "signal", workspace)) as rt:
            control = rt.control()
            receipt = control.signal(
                run_id, name, decoded, idempotency_key=key, principal=parse_principal(as_)
            )
            payload = {**receipt_payload(control, receipt, operation="signal"), "name": name}
    except SmthrsError as exc:
        raise fail(as_json, exc) from None
    code = exit_code("signal", receipt.type, payload.get("status"))  # type: ignore[arg-type]
    if as_json:
        typer.echo(json.dumps(payload, sort_keys=True))
    else:
        typer.echo(_headline(receipt, payload), err=code != EXIT_OK)
    raise typer.Exit(code)


def _headline(receipt: object, payload: dict[str, object]) -> str:
    tag = payload["receipt"]["_tag"]  # type: ignore[index]
    if tag == "Conflict":
        return f"signal: Conflict — {getattr(receipt, 'message', '')}"
    if tag == "Terminal":
        return f"signal: Terminal — run {payload['run_id']} already settled {payload['status']}; nothing delivered"
    where = f" run {payload['run_id']}: {payload['status']}"
    if payload.get("waiting_reason"):
        where += f" ({payload['waiting_reason']})"
    return f"signal: {tag} — {payload['name']!r} delivered to{where}"
