"""``smthrs`` — the command line (typer).

Invariant: every command is one function that parses its options, calls one library entry point, and prints
either a human line or ONE JSON object (``--json``). Exit codes are in :mod:`._common`. Each command
group lives in its own module exposing ``register(app)``; this package only assembles them, so a new group never
means branching inside an existing command. Heavy imports stay inside the command functions: ``smthrs --help``
must not pay for Prefect or SQLAlchemy.

Every argument is checked to be UTF-8 text before any command parses it (:class:`_TextArgsGroup`): the one place
that sees the whole argv, whether it comes from the shell or from a test's runner.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup

from ..errors import SmthrsError
from . import _cache, _control, _plugins, _recover, _run, _runs, _serve, _watch, worker
from ._common import check_text_args, print_refusal
from .exits import EXIT_DENIED, EXIT_FAILED, EXIT_OK, EXIT_PARKED, EXIT_REFUSED

__all__ = ["app", "main", "EXIT_OK", "EXIT_FAILED", "EXIT_REFUSED", "EXIT_DENIED", "EXIT_PARKED"]


class _TextArgsGroup(TyperGroup):
    """The root group: refuses a non-UTF-8 argument (exit 2, typed; one JSON object with ``--json``) before any
    command sees it — otherwise it would surface as a ``UnicodeEncodeError`` traceback from whichever database
    query, file name or JSON encoder met it first."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # ctx: typer's vendored click Context
        try:
            check_text_args(args)
        except SmthrsError as exc:
            raise typer.Exit(print_refusal("--json" in args, exc)) from None
        return super().parse_args(ctx, args)


app = typer.Typer(
    name="smthrs",
    cls=_TextArgsGroup,
    help="Durable execution for Prefect: plans, approvals, runs, cache and recovery.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """smthrs — durable execution for Prefect."""


for _module in (_recover, _cache, _run, _runs, _watch, worker, _plugins, _control, _serve):
    _module.register(app)


def main() -> None:
    """Console-script entry point (``smthrs``)."""
    app()
