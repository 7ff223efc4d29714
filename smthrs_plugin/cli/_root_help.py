"""``smthrs --help`` and ``smthrs --version`` answered without typer or any command module.

A CI step that only asks for the help or the version would otherwise pay for typer and every command module.
:data:`BODY` is the typer app's own root help (click's plain format) below its usage line, as rendered 78
columns wide — the width click uses on any terminal of 80 columns or more (and when stdout is not a terminal);
``tests/cli/test_cli_startup.py`` pins it byte for byte against the app, so adding a command or changing a help
line fails there until :data:`BODY` is updated (the failure shows the new text). A narrower terminal, or any other
command line, goes to the typer app.
"""

from __future__ import annotations

import os
import sys

from .. import __version__

__all__ = ["BODY", "quick_answer", "program_name", "terminal_columns"]

#: Click wraps help to ``min(columns, 80) - 2``: from 80 columns up the text is the same.
_FIXED_WIDTH_FROM = 80

BODY = """\

  Durable execution for Prefect: plans, approvals, runs, cache and recovery.

Options:
  --version  Print the version and exit.
  --help     Show this message and exit.

Commands:
  run      Run a plan file and print its report (on the local host, or as a
           Prefect flow run with --prefect).
  runs     List runs in creation order, a page at a time.
  show     Show one run: status, flow, times, parent, lineage, wait and
           cancellation.
  watch    Print the journal of RUN_ID as events: the snapshot by default, the
           live stream with --follow.
  worker   Drive registered flows until interrupted (or one run with --run).
  plugins  List the loaded smthrs plugins (entry-point group ``smthrs``),
           their hooks, actions and hosts.
  plan     Plan a plan file: store it and print its reviewable card (plan id,
           digest, node graph, approval state).
  approve  Approve a plan card (its launch) or a run's node request (the run
           resumes).
  deny     Deny a plan card (it never launches) or a node request (the node
           fails with ApprovalDenied).
  resume   Drive a run again now (after a node approval, or a crash): settled
           nodes replay clean. A run another live process owns is followed to
           its end (or, its owner gone, taken over at its lease expiry); exit
           0 only once the run completed.
  cancel   Cancel a run: a parked or pending run settles cancelled now, a
           running one at its owner's next heartbeat.
  serve    Serve the control plane over HTTP: JSON-RPC verbs at /rpc, run
           events at /projections, the review page at /.
  signal   Deliver a value to a run's wait (what sp.wait_for(NAME) returns); a
           run parked on it wakes.
  doctor   Check this machine's setup (database, workspace, shared cache tier
           and its bucket, publisher keys, isolation, Prefect API) and print
           one row per check; exit 0 when nothing failed, 2 for a
           configuration problem, 75 when a dependency did not answer.
  recover  Disaster recovery of the durable store: backup, restore, fence.
  cache    The content-addressed step cache: list entries, explain a miss,
           verify blobs, collect garbage.
"""


def quick_answer(argv: list[str]) -> str | None:
    """What ``smthrs <argv>`` prints when that is only the root help or the version (and the text is the one the
    typer app would print); None for anything else."""
    if argv == ["--version"]:
        return f"smthrs {__version__}\n"
    if argv == ["--help"] and terminal_columns() >= _FIXED_WIDTH_FROM:
        return f"Usage: {program_name()} [OPTIONS] COMMAND [ARGS]...\n" + BODY
    return None


def program_name() -> str:
    """The program name click's usage line shows: the script's file name, or ``python -m <package>`` under
    ``python -m`` (click's ``_detect_program_name``)."""
    path = sys.argv[0]
    package = getattr(sys.modules["__main__"], "__package__", None)
    if package in (None, ""):
        return os.path.basename(path)
    name = os.path.splitext(os.path.basename(path))[0]
    module = package if name == "__main__" else f"{package}.{name}"
    return f"python -m {module.lstrip('.')}"


def terminal_columns() -> int:
    """The terminal width click wraps help to, as ``shutil.get_terminal_size`` answers it (``COLUMNS`` when a
    positive integer, else the terminal's, else 80), without importing ``shutil``."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    try:
        columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        columns = 0
    return columns or 80
