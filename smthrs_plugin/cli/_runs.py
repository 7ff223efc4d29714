"""``smthrs runs [filters] [--limit N] [--cursor C] [--json]`` and ``smthrs show RUN [--json]`` — the run catalog.

Invariant: ``runs`` is one call of :func:`smthrs_plugin.observe.catalog.list_runs` (filters applied in SQL, pages
in creation order) and ``show`` one call of :func:`smthrs_plugin.observe.snapshot.read`; each prints a human text
or ONE JSON object. ``runs`` prints the cursor of the next page (pass it back with ``--cursor`` and the SAME
filters). Exit codes: 0 done; 2 refused input (bad filter, limit or cursor), a SQLite database that does not exist
(never created by a read), and ``show`` of a run that does not exist (the JSON object still says whether a
tombstone records its deletion).

Absolute imports on purpose; heavy imports stay inside the commands.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated, Any

import typer

from smthrs_plugin.cli._common import DbOption, JsonOption
from smthrs_plugin.cli._common import done as _done
from smthrs_plugin.cli._common import existing_db_url as _existing_db_url
from smthrs_plugin.cli._common import refuse as _refuse
from smthrs_plugin.cli.exits import EXIT_REFUSED
from smthrs_plugin.errors import ControlError, SmthrsError
from smthrs_plugin.vocabulary import cli_run, status_filter, waiting_filter

__all__ = ["register", "list_runs_command", "show_run"]


def register(app: typer.Typer) -> None:
    """Add ``smthrs runs`` and ``smthrs show`` to the root app."""
    app.command("runs")(list_runs_command)
    app.command("show")(show_run)


def list_runs_command(
    status: Annotated[
        str | None,
        typer.Option(
            "--status", help="Only runs with this status: pending|running|parked|completed|failed|cancelled."
        ),
    ] = None,
    flow: Annotated[str | None, typer.Option("--flow", help="Only runs of this flow.")] = None,
    parent: Annotated[str | None, typer.Option("--parent", help="Only children of this run.")] = None,
    roots: Annotated[bool, typer.Option("--roots", help="Only runs without a parent.")] = False,
    lineage: Annotated[str | None, typer.Option("--lineage", help="Only rounds of this lineage.")] = None,
    waiting: Annotated[
        str | None,
        typer.Option(
            "--waiting", help="Only parked runs waiting for this: approval|timer|signal|released|quarantine."
        ),
    ] = None,
    not_waiting: Annotated[
        bool, typer.Option("--not-waiting", help="Only runs with no stored wait.")
    ] = False,
    created_after: Annotated[
        int | None, typer.Option("--created-after", help="Created at or after (epoch ms).")
    ] = None,
    created_before: Annotated[
        int | None, typer.Option("--created-before", help="Created at or before (epoch ms).")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="Page size, 1..200.")] = 100,
    cursor: Annotated[str | None, typer.Option("--cursor", help="Continue after a previous page.")] = None,
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """List runs in creation order, a page at a time."""
    from smthrs_plugin.observe.catalog import ANY, RunFilters, list_runs
    from smthrs_plugin.stores.database import open_database

    try:
        if parent is not None and roots:
            raise ControlError(
                "invalid_options", "--parent and --roots exclude each other; give one", option="parent"
            )
        if waiting is not None and not_waiting:
            raise ControlError(
                "invalid_options",
                "--waiting and --not-waiting exclude each other; give one",
                option="waiting",
            )
        filters = RunFilters(
            status=status_filter(status),
            flow=flow,
            parent_run_id=None if roots else (ANY if parent is None else parent),
            lineage_id=lineage,
            waiting_reason=None if not_waiting else (ANY if waiting is None else waiting_filter(waiting)),
            created_after_ms=created_after,
            created_before_ms=created_before,
        )
        page = list_runs(open_database(_existing_db_url(db, "runs")), filters, cursor=cursor, limit=limit)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    runs = [cli_run(r.to_json()) for r in page.runs]
    lines = [_row(r) for r in runs] or ["no runs"]
    if page.cursor is not None:
        lines.append(f"next page: --cursor {page.cursor}")
    _done(
        as_json,
        {
            "runs": runs,
            "cursor": page.cursor,
            "source": page.source,
            "revision": page.revision,
        },
        "\n".join(lines),
    )


def show_run(
    run_id: Annotated[str, typer.Argument(help="The run to show.", show_default=False)],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show one run: status, flow, times, parent, lineage, wait and cancellation."""
    from smthrs_plugin.observe.snapshot import Missing, read
    from smthrs_plugin.stores.database import open_database

    try:
        batch = read(open_database(_existing_db_url(db, "show")), [run_id])
    except SmthrsError as exc:
        _refuse(as_json, exc)
    obs = batch.items[0]
    j = cli_run(obs.to_json())
    payload = {"run": j, "source": batch.source, "revision": batch.revision}
    if isinstance(obs, Missing):
        why = f"deleted (tombstone at revision {obs.revision})" if obs.deleted else "never recorded here"
        if as_json:
            typer.echo(json.dumps(payload, sort_keys=True))
        else:
            typer.echo(f"smthrs: run {run_id!r} not found: {why}", err=True)
        raise typer.Exit(EXIT_REFUSED)
    text = [
        f"run       {j['run_id']}  ({j['status']}, revision {j['revision']})",
        f"flow      {j['flow']}",
        f"created   {_when(j['created_at_ms'])}   started {_when(j['started_at_ms'])}   "
        f"finished {_when(j['finished_at_ms'])}",
        f"parent    {j['parent_run_id'] or '-'}   lineage {j['lineage_id']} round {j['round_ordinal']}",
    ]
    if j["wait"] is not None:
        w = j["wait"]
        text.append(f"waiting   {w['reason']} until {_when(w['wake_at_ms'])}")
    c = j["cancellation"]
    if c["requested_at_ms"] is not None:
        ack = c["acknowledgement"]
        seen = "not yet acknowledged" if ack is None else f"acknowledged by {ack['host_id']}/{ack['pid']}"
        text.append(f"cancel    requested {_when(c['requested_at_ms'])}, {seen}")
    _done(as_json, payload, "\n".join(text))


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return (
        dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    )


def _row(j: dict[str, Any]) -> str:
    wait = "" if j["waiting_reason"] is None else f"  waiting:{j['waiting_reason']}"
    parent = "" if j["parent_run_id"] is None else f"  parent:{j['parent_run_id']}"
    return f"{j['run_id']:<32} {j['status']:<10} {j['flow']:<24} {_when(j['created_at_ms'])}{parent}{wait}"
