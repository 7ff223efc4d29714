"""The typer app of ``smthrs``: the root group and every command group registered on it.

Invariant: every command is one function that parses its options, calls one library entry point, and prints
either a human line or ONE JSON object (``--json``). Exit codes are in :mod:`.exits`. Each command group lives in
its own module exposing ``register(app)``; this module only assembles them, so a new group never means branching
inside an existing command. Heavy imports stay inside the command functions: no ``--help`` pays for Prefect or
SQLAlchemy.

Every argument is checked to be UTF-8 text before any command parses it (:class:`_TextArgsGroup`): the one place
that sees the whole argv, whether it comes from the shell or from a test's runner.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .. import __version__
from ..errors import SmthrsError
from . import _cache, _control, _doctor, _plugins, _recover, _run, _runs, _serve, _watch, worker
from ._common import PlainHelpGroup, check_text_args, print_refusal
from .exits import EXIT_OK

__all__ = ["app"]


class _TextArgsGroup(PlainHelpGroup):
    """The root group: refuses a non-UTF-8 argument (exit 2, typed; one JSON object with ``--json``) before any
    command sees it — otherwise it would surface as a ``UnicodeEncodeError`` traceback from whichever database
    query, file name or JSON encoder met it first."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # ctx: typer's vendored click Context
        try:
            check_text_args(args)
        except SmthrsError as exc:
            raise typer.Exit(print_refusal("--json" in args, exc)) from None
        return super().parse_args(ctx, args)

    # typer's rich help gives every option a type column, a flag too (``--json  <bool>``): a flag takes no value,
    # so its column stays empty. Every command is reached through this root group, so one place covers them all.
    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        _flags_without_placeholder(params)
        return params

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _commands_without_flag_placeholders(command, ctx)
        return command


def _flags_without_placeholder(params: list[Any]) -> None:
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # shown in help only: a flag's error messages name its option strings


def _commands_without_flag_placeholders(command: Any, ctx: Any) -> None:
    _flags_without_placeholder(command.get_params(ctx))  # the command's --help option included
    for sub in getattr(command, "commands", {}).values():
        _commands_without_flag_placeholders(sub, ctx)


app = typer.Typer(
    name="smthrs",
    cls=_TextArgsGroup,
    help="Durable execution for Prefect: plans, approvals, runs, cache and recovery.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help and usage errors in click's plain format: typer's rich formatter imports rich (and markdown-it,
    # pygments), which every `smthrs --help` and every mistyped option would pay for. Each sub-Typer says the same.
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"smthrs {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_print_version),
    ] = False,
) -> None:
    """smthrs — durable execution for Prefect."""


for _module in (_recover, _cache, _run, _runs, _watch, worker, _plugins, _control, _serve, _doctor):
    _module.register(app)
