"""Shared option types, exit codes, argument checks and output helpers of the ``smthrs`` commands.

Exit codes: the one table of :mod:`.exits` (0 done — for a run: completed —, 1 failed/cancelled, 2 refused input,
3 denied, 75 not finished: parked, or held by another live owner); re-exported here for the commands.

Invariants of the argument checks (each refusal is typed, exit 2, and says what to pass instead):

- **Every argument is UTF-8 text** (:func:`check_text_args`, run on the whole argv before any command parses it):
  on POSIX an argument whose bytes are not UTF-8 arrives as a str with lone surrogates, which no database driver,
  JSON encoder or terminal can write back; refusing it up front means no command can meet one half-way.
- **A command that reads or repairs a database never creates one** (:func:`existing_db_url`): a SQLite path that
  does not exist is refused before anything is opened, so ``--db`` with a typo cannot answer "no runs" or "fenced"
  from an empty database it just made (nor create its parent directories). Only ``run``, ``plan``, ``worker``
  and ``recover restore`` create one. A PostgreSQL URL is not checked here: the server says whether it exists.
- **A duration is a finite number of seconds in 0..** :data:`MAX_SECONDS` (:func:`seconds`): ``inf`` or ``nan``
  would otherwise overflow a millisecond cutoff or a thread join far from the option that caused it.

The JSON vocabulary (one spelling per state in every command's ``--json``; docs/rules.md "JSON vocabulary",
:mod:`smthrs_plugin.vocabulary`): a run's ``status`` is one of ``CLI_STATUSES`` and, while parked, ``waiting_reason``
one of ``CLI_WAITING_REASONS`` (``cli_state`` translates the stored names: ``suspended`` is ``parked``, ``waiting-approval`` is ``approval``,
``event`` is ``signal``); times are ``*_at_ms`` integers. The nested ``receipt`` and ``card`` keep the reference's
wire names (``_tag``, ``receiptId``, ``planId`` ...): they are what is recorded and digested. Exit codes are still
computed from the stored names (:mod:`.exits`), before the translation, so none changes.
"""

from __future__ import annotations

import json
import math
import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperGroup

from ..errors import ControlError, InvalidInput, SettingsError, SmthrsError, StoreError, passing_fault
from .exits import refusal_exit

__all__ = [
    "DbOption",
    "JsonOption",
    "WorkspaceOption",
    "MAX_SECONDS",
    "check_text_args",
    "db_url",
    "existing_db_url",
    "check_workspace",
    "seconds",
    "done",
    "refuse",
    "print_refusal",
    "safe_text",
    "PlainHelpGroup",
]

#: The longest duration any option takes (ten years): far beyond any real grace or budget, and small enough that
#: its milliseconds fit a SQLite INTEGER and a thread join's timeout.
MAX_SECONDS = 10 * 365 * 24 * 3600

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Database URL (default: SMTHRS_DB_URL, else <workspace>/.smthrs/state.db)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
WorkspaceOption = Annotated[
    Path | None,
    typer.Option("--workspace", help="Workspace directory (default: SMTHRS_WORKSPACE, else the cwd)."),
]


class PlainHelpGroup(TyperGroup):
    """A command group helped in click's plain format (its Typer says ``rich_markup_mode=None``: rich would cost
    every invocation its import), listing each command with the whole first paragraph of its help, wrapped, as
    the rich help did — click's default cuts it at the terminal width with "...", which leaves half a sentence."""

    def format_commands(
        self, ctx: Any, formatter: Any
    ) -> None:  # typer's vendored click Context, HelpFormatter
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                summary = command.short_help or (command.help or "").split("\n\n", 1)[0]
                rows.append((name, " ".join(summary.split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def check_text_args(args: Sequence[str]) -> None:
    """Refuse (``InvalidInput``, bound ``well_formed_text``) the first argument that is not UTF-8 text."""
    for i, arg in enumerate(args, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInput(
                "invalid_input",
                f"argument {i} ({_shown(arg)}) is not UTF-8 text; smthrs records ids, keys, names and paths as "
                "text: pass it as UTF-8 (rename a file or directory whose name is not)",
                bound="well_formed_text",
                argument=i,
                cause=exc,
            ) from exc


def _shown(arg: str) -> str:
    """The argument's bytes as an ASCII literal (its surrogates are the bytes the shell passed), shortened."""
    try:
        text = repr(os.fsencode(arg))
    except UnicodeEncodeError:  # a lone surrogate no byte maps to (only from a caller in this process)
        text = ascii(arg)
    return text if len(text) <= 80 else text[:77] + "..."


def db_url(db: str | None, workspace: Path | None = None) -> str:
    """The database URL the options name, resolved as :func:`~smthrs_plugin.runtime.open_runtime` resolves it
    (``--db``, else ``SMTHRS_DB_URL``, else ``<workspace>/.smthrs/state.db``). An empty ``--db`` is refused: it
    would silently mean the default database (``--db "$UNSET_VARIABLE"``)."""
    if db is not None and not db.strip():
        raise StoreError(
            "unsupported_url",
            "--db is empty; pass the database URL (sqlite:///path/to/state.db or postgresql+psycopg://...), or "
            "leave --db out for the default (SMTHRS_DB_URL, else <workspace>/.smthrs/state.db)",
        )
    from ..settings import load_settings

    return load_settings(workspace=workspace, db_url=db).resolved_db_url


def existing_db_url(db: str | None, command: str, workspace: Path | None = None) -> str:
    """:func:`db_url`, refused (``StoreError(not_found)``, exit 2) when it is a SQLite file that does not exist:
    ``smthrs <command>`` reads or repairs a database and must not create an empty one in its place. Nothing is
    created or opened here."""
    from ..stores import normalize_url

    url = db_url(db, workspace)
    normalized, dialect = normalize_url(url)
    if dialect != "sqlite":
        return url
    path = Path(normalized.removeprefix("sqlite:///"))
    if path.is_file():
        return url
    what = "is not a file" if path.exists() else "does not exist"
    raise StoreError(
        "not_found",
        f"the SQLite database {path} {what}; `smthrs {command}` works on an existing database and creates none: "
        "point --db (or SMTHRS_DB_URL) at it as sqlite:///path/to/state.db — without either, the database is "
        "<workspace>/.smthrs/state.db of --workspace, SMTHRS_WORKSPACE or the current directory; `smthrs plan` "
        "and `smthrs run PLAN.yaml` create a new one",
        path=str(path),
        command=command,
    )


def check_workspace(workspace: Path | None) -> None:
    """Refuse (``SettingsError``) a workspace (``--workspace``, else ``SMTHRS_WORKSPACE``, else the cwd) that
    exists and is not a directory, before a runtime tries to create its state directory inside it."""
    from ..settings import load_settings

    ws = load_settings(workspace=workspace).workspace
    if ws.exists() and not ws.is_dir():
        raise SettingsError(
            "invalid_setting",
            f"the workspace {ws} is not a directory; pass --workspace DIR (or set SMTHRS_WORKSPACE) to the project "
            "directory",
            setting="workspace",
        )


def seconds(value: float, option: str) -> float:
    """A duration option: a finite number of seconds in 0..MAX_SECONDS, else refused
    (``ControlError(invalid_options)``) — ``inf``, ``nan`` and negatives included."""
    if not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise ControlError(
            "invalid_options",
            f"{option} {value!r}: give a number of seconds from 0 to {MAX_SECONDS} (ten years)",
            option=option.lstrip("-"),
        )
    return value


def safe_text(value: object, limit: int = 120) -> str:
    """``value`` (text, or any JSON value as compact JSON) safe to print on a terminal: every control, format
    (bidi overrides, zero-width), surrogate, private-use or unassigned character and every line or paragraph
    separator is written as an escape (``\\x1b``, ``\\u202e``), and the result is cut at ``limit`` characters with
    "…". Text from a plan file, a run or a store is someone else's: it must not move the cursor, recolour, hide
    or fake the lines around it, nor run on for pages."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    out: list[str] = []
    used = 0
    for ch in text:
        cat = unicodedata.category(ch)
        piece = ch if cat[0] != "C" and cat not in ("Zl", "Zp") else ascii(ch)[1:-1]
        if used + len(piece) > limit:
            out.append("…")
            break
        out.append(piece)
        used += len(piece)
    return "".join(out)


def done(as_json: bool, payload: dict[str, Any], text: str) -> None:
    typer.echo(json.dumps(payload, sort_keys=True) if as_json else text)


def print_refusal(as_json: bool, exc: SmthrsError) -> int:
    """Print a typed refusal (``{"error": {...}}`` with ``--json``); return its :func:`.exits.refusal_exit` code."""
    if as_json:
        typer.echo(json.dumps({"error": exc.to_dict()}, sort_keys=True))
    elif passing_fault(exc) is not None:
        # Nothing was refused: the environment failed, and the same command succeeds once it is back.
        typer.echo(f"smthrs: not done, try again: {exc}", err=True)
    else:
        typer.echo(f"smthrs: refused: {exc}", err=True)
    return refusal_exit(exc)


def refuse(as_json: bool, exc: SmthrsError) -> NoReturn:
    """Print a typed refusal and exit by :func:`.exits.refusal_exit`."""
    raise typer.Exit(print_refusal(as_json, exc))
