"""``smthrs`` — the command line (typer).

The typer app and its command groups are assembled in :mod:`._app` (``app`` here loads it on first use); exit
codes are in :mod:`.exits`.

Startup: every ``smthrs`` step of a CI pipeline pays for what this package imports before the command runs, so
importing it loads nothing but :mod:`.exits`. :func:`main` answers ``smthrs --help`` and ``smthrs --version``
without typer (:mod:`._root_help`, pinned byte for byte against the typer app's own output); every other command
line goes to the typer app, whose command modules import the stores, SQLAlchemy, Prefect, fsspec or FastAPI inside
the command that needs them, and whose help is click's plain format (no rich). ``tests/cli/test_cli_startup.py``
pins which libraries each command leaves unloaded; ``benchmarks/cli_startup.py`` measures the wall time.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from .exits import EXIT_DENIED, EXIT_FAILED, EXIT_OK, EXIT_PARKED, EXIT_REFUSED

if TYPE_CHECKING:  # pragma: no cover
    from ._app import app as app

__all__ = ["app", "main", "EXIT_OK", "EXIT_FAILED", "EXIT_REFUSED", "EXIT_DENIED", "EXIT_PARKED"]


def main() -> None:
    """Console-script entry point (``smthrs``)."""
    from ._root_help import quick_answer

    text = quick_answer(sys.argv[1:])
    if text is not None:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            # As the typer app does when the reader went away: exit 1, and (stdout pointed at /dev/null) no second
            # error when the interpreter flushes stdout at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None
        raise SystemExit(EXIT_OK)
    from ._app import app

    app()


def __getattr__(name: str) -> object:
    # The typer app loads on first use (PEP 562): `from smthrs_plugin.cli import app` keeps working, and `main`
    # answers --help and --version without it.
    if name == "app":
        from ._app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
