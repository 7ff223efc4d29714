"""``smthrs watch RUN [--follow] [--after-cursor C] [--max-events N] [--json]`` — a run's journal as events.

Invariant: one library entry point (:func:`smthrs_plugin.observe.watch.watch`), always called with an explicit
``follow`` — the command's default is the snapshot (a shell user expects a command to end), while the library's
default is the live stream. Without ``--follow`` the command prints the finite snapshot and exits 0: a line per
event, or ONE JSON object ``{"run_id", "events", "cursor"}`` (``cursor`` resumes after the last event; the one
given back when there was none). With ``--follow`` the stream never ends by itself (Ctrl-C, or
``--max-events``): a line per event, or one JSON object PER LINE per event (JSON lines: a stream cannot be one
object). Each event is ``{"sequence", "kind", "run_id", "occurred_at_ms", "payload", "cursor", "partition"}``;
its ``payload`` is the journal record as written (its member names are the journal's, pinned by golden tests, not
this command's). Refused input exits 2 before anything is read — so does a run id this database has neither a run nor a journal for (``run_not_found``), and a SQLite database that does not exist
(a read never creates one).

Absolute imports on purpose; heavy imports stay inside the command.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from smthrs_plugin.cli._common import DbOption, JsonOption
from smthrs_plugin.cli._common import existing_db_url as _existing_db_url
from smthrs_plugin.cli._common import refuse as _refuse
from smthrs_plugin.errors import SmthrsError
from smthrs_plugin.vocabulary import cli_event

__all__ = ["register", "watch_run"]


def register(app: typer.Typer) -> None:
    """Add ``smthrs watch`` to the root app."""
    app.command("watch")(watch_run)


def watch_run(
    run_id: Annotated[str, typer.Argument(help="The run whose journal to read.", show_default=False)],
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            help="Keep streaming new events (Ctrl-C stops). Without it the command prints the snapshot and exits; "
            "the library's watch() is the other way round: live unless follow=False.",
        ),
    ] = False,
    after_cursor: Annotated[
        str | None, typer.Option("--after-cursor", help="Resume after the event this cursor names.")
    ] = None,
    max_events: Annotated[
        int | None, typer.Option("--max-events", min=1, help="Stop after this many events.")
    ] = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Print the journal of RUN_ID as events: the snapshot by default, the live stream with --follow."""
    from smthrs_plugin.observe.watch import require_watchable, watch
    from smthrs_plugin.stores.database import open_database

    events: list[dict[str, Any]] = []
    seen = 0
    try:
        database = open_database(_existing_db_url(db, "watch"))
        stream = watch(database, run_id, follow=follow, after_cursor=after_cursor)  # input refused first
        require_watchable(database, run_id)
        with stream:
            for ev in stream:
                seen += 1
                event = cli_event(ev.to_json())
                if follow:
                    # Flushed per event: a follower is usually piped into another program.
                    typer.echo(json.dumps(event, sort_keys=True) if as_json else _line(event))
                else:
                    events.append(event)
                if max_events is not None and seen >= max_events:
                    break
    except KeyboardInterrupt:
        return
    except SmthrsError as exc:
        _refuse(as_json, exc)
    if follow:
        return
    cursor = events[-1]["cursor"] if events else after_cursor
    if as_json:
        typer.echo(json.dumps({"run_id": run_id, "events": events, "cursor": cursor}, sort_keys=True))
        return
    for e in events:
        typer.echo(_line(e))
    if not events:
        typer.echo(f"no events for {run_id}")


def _line(e: dict[str, Any]) -> str:
    payload = json.dumps(e["payload"], sort_keys=True, separators=(",", ":"))
    if len(payload) > 160:
        payload = payload[:157] + "..."
    return f"{e['sequence']:>6}  {e['kind']:<28} {payload}"
