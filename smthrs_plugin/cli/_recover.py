"""``smthrs recover backup|verify|restore|fence`` — disaster recovery of the durable store.

Invariant: ``backup`` and ``fence`` work on an EXISTING database — a SQLite path that does not exist is refused
(exit 2, naming the path) before anything is created, so ``fence --db`` with a typo can never answer "fenced" for an
empty database it just made while the restored one stays unfenced. Only ``restore`` creates a database (the
backup's copy, at ``--db``).

JSON: ``action`` says what was done (``backed-up`` | ``verified`` | ``restored`` | ``fenced``); it is not named
``status``, which in every command's JSON is a run's status.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import SmthrsError
from ._common import DbOption, JsonOption, PlainHelpGroup
from ._common import db_url as _db_url
from ._common import done as _done
from ._common import existing_db_url as _existing_db_url
from ._common import refuse as _refuse

recover_app = typer.Typer(
    help="Disaster recovery of the durable store: backup, restore, fence.",
    no_args_is_help=True,
    rich_markup_mode=None,  # click's plain help and usage errors: rich costs every invocation its import
    cls=PlainHelpGroup,
)


def register(app: typer.Typer) -> None:
    """Add the ``recover`` command group to the root ``smthrs`` app."""
    app.add_typer(recover_app, name="recover")


@recover_app.command("backup")
def recover_backup(
    directory: Annotated[Path, typer.Argument(help="Empty (or new) directory to write the backup into.")],
    db: DbOption = None,
    as_json: JsonOption = False,
) -> None:
    """Online backup of a SQLite store (manifest written last). PostgreSQL: use pg_dump."""
    from ..engine.recovery import backup
    from ..stores.database import open_database

    try:
        written = backup(open_database(_existing_db_url(db, "recover backup")), directory)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    m = written.manifest
    _done(
        as_json,
        {"action": "backed-up", "directory": str(written.directory), "manifest": m.to_json()},
        f"backed up revision {m.revision} of source {m.source_id} into {written.directory} ({m.bytes} bytes)",
    )


@recover_app.command("verify")
def recover_verify(
    directory: Annotated[Path, typer.Argument(help="A backup directory.")],
    as_json: JsonOption = False,
) -> None:
    """Check a backup (manifest, digest, SQLite integrity, schema) without restoring it."""
    from ..engine.recovery import verify

    try:
        verified = verify(directory)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    m = verified.manifest
    _done(
        as_json,
        {"action": "verified", "manifest": m.to_json()},
        f"backup {directory} is intact (revision {m.revision})",
    )


@recover_app.command("restore")
def recover_restore(
    directory: Annotated[Path, typer.Argument(help="A backup directory written by `smthrs recover backup`.")],
    db: DbOption = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing database.")] = False,
    no_fence: Annotated[
        bool,
        typer.Option("--no-fence", help="Do not fence the restored runs (unsafe while old owners live)."),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Restore a backup into the SQLite store and fence it (pre-backup owners lose every run)."""
    from ..engine.recovery import restore

    try:
        restored = restore(directory, _db_url(db), force=force, fence_runs=not no_fence)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    released = list(restored.fenced.released) if restored.fenced else []
    _done(
        as_json,
        {
            "action": "restored",
            "url": restored.url,
            "manifest": restored.manifest.to_json(),
            "released": released,
        },
        f"restored revision {restored.manifest.revision} into {restored.url}; released {len(released)} running run(s)",
    )


@recover_app.command("fence")
def recover_fence(db: DbOption = None, as_json: JsonOption = False) -> None:
    """Clear pending claims and release every running run (after a restore done outside smthrs, e.g. pg_restore)."""
    from ..engine.recovery import fence
    from ..stores.database import open_database

    try:
        fenced = fence(open_database(_existing_db_url(db, "recover fence")))
    except SmthrsError as exc:
        _refuse(as_json, exc)
    _done(
        as_json,
        {"action": "fenced", "released": list(fenced.released), "claims_cleared": fenced.claims_cleared},
        f"fenced: released {len(fenced.released)} running run(s), cleared {fenced.claims_cleared} pending claim(s)",
    )
