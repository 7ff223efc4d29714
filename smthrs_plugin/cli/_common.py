"""Shared option types, exit codes and output helpers of the ``smthrs`` commands.

Exit codes (DESIGN.md §8): 0 done/accepted, 1 a node or run failed, 2 usage or refused input (every typed
:class:`~smthrs_plugin.errors.SmthrsError` refusal), 3 approval refused/denied, 75 parked waiting for approval or a
timer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from ..errors import SmthrsError
from ..settings import load_settings

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_DENIED = 3
EXIT_PARKED = 75

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Database URL (default: SMTHRS_DB_URL, else <workspace>/.smthrs/state.db)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
WorkspaceOption = Annotated[
    Path | None,
    typer.Option("--workspace", help="Workspace directory (default: SMTHRS_WORKSPACE, else the cwd)."),
]


def db_url(db: str | None) -> str:
    return load_settings(db_url=db).resolved_db_url


def done(as_json: bool, payload: dict[str, Any], text: str) -> None:
    typer.echo(json.dumps(payload, sort_keys=True) if as_json else text)


def refuse(as_json: bool, exc: SmthrsError) -> NoReturn:
    if as_json:
        typer.echo(json.dumps({"error": exc.to_dict()}, sort_keys=True))
    else:
        typer.echo(f"smthrs: refused: {exc}", err=True)
    raise typer.Exit(EXIT_REFUSED)
