"""Shared option types, exit codes and output helpers of the ``smthrs`` commands.

Exit codes: the one table of :mod:`._exits` (0 done — for a run: completed —, 1 failed/cancelled, 2 refused input,
3 denied, 75 not finished: parked, or held by another live owner); re-exported here for the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from ..errors import SmthrsError
from ..settings import load_settings
from ._exits import refusal_exit

__all__ = [
    "DbOption",
    "JsonOption",
    "WorkspaceOption",
    "db_url",
    "done",
    "refuse",
    "print_refusal",
]

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


def print_refusal(as_json: bool, exc: SmthrsError) -> int:
    """Print a typed refusal (``{"error": {...}}`` with ``--json``); return its :func:`._exits.refusal_exit` code."""
    if as_json:
        typer.echo(json.dumps({"error": exc.to_dict()}, sort_keys=True))
    else:
        typer.echo(f"smthrs: refused: {exc}", err=True)
    return refusal_exit(exc)


def refuse(as_json: bool, exc: SmthrsError) -> NoReturn:
    """Print a typed refusal and exit by :func:`._exits.refusal_exit`."""
    raise typer.Exit(print_refusal(as_json, exc))
