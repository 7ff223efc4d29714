"""``smthrs`` — the command line (typer).

Invariant: every command is one function that parses its options, calls one library entry point, and prints
either a human line or ONE JSON object (``--json``). Exit codes are in :mod:`._common` (DESIGN.md §8). Each command
group lives in its own module exposing ``register(app)``; this package only assembles them, so a new group never
means branching inside an existing command. Heavy imports stay inside the command functions: ``smthrs --help``
must not pay for Prefect or SQLAlchemy.
"""

from __future__ import annotations

import typer

from . import _cache, _control, _plugins, _recover, _run, _runs, _serve, _watch, _worker
from ._exits import EXIT_DENIED, EXIT_FAILED, EXIT_OK, EXIT_PARKED, EXIT_REFUSED

__all__ = ["app", "main", "EXIT_OK", "EXIT_FAILED", "EXIT_REFUSED", "EXIT_DENIED", "EXIT_PARKED"]

app = typer.Typer(
    name="smthrs",
    help="Durable execution for Prefect: plans, approvals, runs, cache and recovery.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """smthrs — durable execution for Prefect."""


for _module in (_recover, _cache, _run, _runs, _watch, _worker, _plugins, _control, _serve):
    _module.register(app)


def main() -> None:
    """Console-script entry point (``smthrs``)."""
    app()
