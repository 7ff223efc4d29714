"""``smthrs cache ls | explain NODE_OR_KEY | verify [--with-shared] | gc | keygen DIR | revoke KEY_OR_NODE`` — the
content-addressed cache from the command line.

Invariant: each command opens a runtime over the stores named by its options (defaults from ``SMTHRS_*``
settings) and takes the cache tiers from it (``Runtime.cache_tiers``: the composition root is the one place that
assembles them), calls one library function of :mod:`smthrs_plugin.cache`, and prints a human text or ONE JSON
object (``--json``; a ``key`` is a ``key1_`` key, a ``digest`` a plain SHA-256, times ``*_at_ms``). Exit codes
(:mod:`._common`): 0 done, 1 ``verify`` found a problem, 2 a refused input (any typed ``SmthrsError``). The cache
modules (SQLAlchemy, fsspec) are imported inside the commands so ``smthrs --help`` stays cheap.

Every command but ``keygen`` works on an existing database: a SQLite path that does not exist is refused before
the runtime opens (``gc`` on an empty database would see every blob as unreferenced). An empty ``--artifacts`` or
``--shared`` is refused rather than read as "the default" (a ``--shared "$UNSET"`` would revoke or collect in the
wrong store). ``keygen`` never overwrites a key, and a directory it cannot create or write is a typed refusal.
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import CacheError, InvalidInput, SettingsError, SmthrsError
from ._common import (
    MAX_SECONDS,
    DbOption,
    JsonOption,
    PlainHelpGroup,
    WorkspaceOption,
    check_workspace,
    existing_db_url,
    seconds,
)
from ._common import done as _done
from ._common import refuse as _refuse
from .exits import EXIT_FAILED

if TYPE_CHECKING:  # pragma: no cover
    from ..cache.maintenance import VerifyReport
    from ..runtime import CacheTiers, Runtime

__all__ = ["cache_app", "register"]

cache_app = typer.Typer(
    help="The content-addressed step cache: list entries, explain a miss, verify blobs, collect garbage.",
    no_args_is_help=True,
    rich_markup_mode=None,  # click's plain help and usage errors: rich costs every invocation its import
    cls=PlainHelpGroup,
)


def register(app: typer.Typer) -> None:
    """Add the ``cache`` command group to the root ``smthrs`` app."""
    app.add_typer(cache_app, name="cache")


ArtifactsOption = Annotated[
    str | None,
    typer.Option(
        "--artifacts",
        help="Artifact store URL (default: SMTHRS_ARTIFACTS_URL, else <workspace>/.smthrs/artifacts).",
    ),
]
SharedOption = Annotated[
    str | None,
    typer.Option(
        "--shared", help="Shared tier URL when it differs from --artifacts (default: the artifact store)."
    ),
]


def _runtime(
    command: str,
    db: str | None,
    workspace: Path | None,
    artifacts: str | None = None,
    shared: str | None = None,
) -> Runtime:
    """The runtime over the stores the options name (SMTHRS_ARTIFACTS_BLOCK too: the artifact location may come
    from a Prefect block); its ``cache_tiers(shared, trusted=...)`` are what every command works on. Refused before
    anything is created: an empty store option, a workspace that is not a directory, a missing SQLite database."""
    from ..runtime import open_runtime

    for option, value in (("--artifacts", artifacts), ("--shared", shared)):
        if value is not None and not value.strip():
            raise SettingsError(
                "invalid_setting",
                f"{option} is empty; pass the store's URL or path, or leave {option} out for the default",
                setting=option.lstrip("-"),
            )
    check_workspace(workspace)
    url = existing_db_url(db, f"cache {command}", workspace)
    return open_runtime(workspace=workspace, db=url, artifacts=artifacts)


#: The longest node id, subject or key ``explain``/``revoke`` look up (a key is 69 characters): a longer argument is
#: refused before it becomes a LIKE pattern SQLite rejects as "too complex" (a misleading store failure).
_MAX_LOOKUP_CHARS = 1024


def _lookup(value: str, what: str) -> str:
    if not 0 < len(value) <= _MAX_LOOKUP_CHARS:
        raise InvalidInput(
            "invalid_input",
            f"{what} must be 1 to {_MAX_LOOKUP_CHARS} characters, got {len(value)}; pass a key1_ key or a node's "
            "subject as `smthrs cache ls` prints it",
            bound="identifier",
        )
    return value


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: The column names of ``cache ls`` (text only), aligned with its rows; ``created`` is 20 characters (UTC, seconds).
_LS_HEADER = f"{'TIER':6} {'SCOPE':9} {'SUBJECT':32} {'KEY':21} {'CREATED':20} HOST STATE"


@cache_app.command("ls")
def ls(
    db: DbOption = None,
    artifacts: ArtifactsOption = None,
    shared: SharedOption = None,
    workspace: WorkspaceOption = None,
    with_shared: Annotated[
        bool, typer.Option("--with-shared", help="Also list the shared tier's entries.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """List cache entries: local rows (newest first), and the shared tier's with --with-shared."""
    from ..cache.maintenance import list_entries

    try:
        with _runtime("ls", db, workspace, artifacts, shared) as rt:
            st = rt.cache_tiers(shared)
            entries = list_entries(st.local, st.shared if with_shared else None)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    lines = [_LS_HEADER] if entries else []
    for e in entries:
        state = "invalidated" if e.invalidated_at_ms is not None else (e.problem or "ok")
        lines.append(
            f"{e.tier:6} {e.scope or '-':9} {(e.subject or '-'):32} {(e.key or e.name)[:21]:21} "
            f"{_when(e.created_at_ms)} {e.host or '-'} {state}"
        )
    _done(as_json, {"entries": [e.to_json() for e in entries]}, "\n".join(lines) or "no cache entries")


@cache_app.command("explain")
def explain(
    node_or_key: Annotated[
        str,
        typer.Argument(
            help="A key1_ key, a subject (plan/node, module:qualname), or a bare node id, step function name or"
            " step node name (refused, listing the candidates, when it names several subjects)."
        ),
    ],
    db: DbOption = None,
    workspace: WorkspaceOption = None,
    as_json: JsonOption = False,
) -> None:
    """Why the newest entry of a node (or key) missed: what changed since the previous entry of that node, and,
    when that entry was kept run-local (never served to another run), the admission rule it failed."""
    from ..cache.explain import explain as explain_entry

    try:
        _lookup(node_or_key, "NODE_OR_KEY")
        with _runtime("explain", db, workspace) as rt:
            explained = explain_entry(rt.cache_tiers().local, node_or_key)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    _done(as_json, _explained_json(explained.to_json()), "\n".join(explained.lines()))


def _explained_json(out: dict[str, Any]) -> dict[str, Any]:
    """``cache explain --json``: the explanation's ``status`` (first-entry | changed | same-components) is named
    ``comparison``: in every command's JSON ``status`` is a run's status, and this is not one."""
    shown = {k: v for k, v in out.items() if k != "status"}
    shown["comparison"] = out["status"]
    return shown


@cache_app.command("verify")
def verify(
    db: DbOption = None,
    artifacts: ArtifactsOption = None,
    shared: SharedOption = None,
    workspace: WorkspaceOption = None,
    with_shared: Annotated[
        bool,
        typer.Option(
            "--with-shared",
            help="Also judge every shared entry as this machine would (signature, trusted key, revocation) and"
            " re-hash the blobs of those it would serve.",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Re-hash every blob a servable entry references; list refused shared entries with --with-shared; exit 1 on
    a problem."""
    try:
        # --with-shared: the shared tier judges entries with this machine's publisher trust, as a dispatcher would.
        with _runtime("verify", db, workspace, artifacts, shared) as rt:
            st = rt.cache_tiers(shared, trusted=with_shared)
            report = _verify_with_progress(st, with_shared, show=not as_json and sys.stderr.isatty())
    except SmthrsError as exc:
        _refuse(as_json, exc)
    lines = [
        f"checked {report.entries} entries, {report.blobs} blobs: " + ("ok" if report.ok else "PROBLEMS")
    ]
    lines += [
        f"  {p.kind}: {p.tier} entry {p.entry[:40]} {p.digest or ''} {p.detail}" for p in report.problems
    ]
    if with_shared and st.shared.trust is not None:
        lines.append(f"trust: {st.shared.trust.describe()}")
    if st.warning is not None:
        lines.append(f"WARNING: {st.warning}")
    out = report.to_json()
    if with_shared:
        out["trust"] = None if st.shared.trust is None else st.shared.trust.describe()
        out["warning"] = st.warning
    _done(as_json, out, "\n".join(lines))
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


def _verify_with_progress(st: CacheTiers, with_shared: bool, *, show: bool) -> VerifyReport:
    from ..cache.maintenance import verify as verify_cache

    shared = st.shared if with_shared else None
    if not show:
        return verify_cache(st.local, st.artifacts, shared)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("verifying blobs", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return verify_cache(st.local, st.artifacts, shared, progress=progress)


@cache_app.command("gc")
def gc(
    db: DbOption = None,
    artifacts: ArtifactsOption = None,
    shared: SharedOption = None,
    workspace: WorkspaceOption = None,
    grace: Annotated[
        float,
        typer.Option("--grace", help=f"Keep anything younger than this many seconds (0..{MAX_SECONDS})."),
    ] = 3600.0,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report what would be deleted; delete nothing.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Delete expired rows and every unreferenced blob older than --grace (never a referenced blob)."""
    from ..cache.maintenance import gc as gc_cache

    try:
        grace_s = seconds(grace, "--grace")  # inf/nan/negative: refused before the runtime opens
        with _runtime("gc", db, workspace, artifacts, shared) as rt:
            st = rt.cache_tiers(shared)
            report = gc_cache(st.local, st.artifacts, st.shared, grace_s=grace_s, dry_run=dry_run)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    verb = "would delete" if dry_run else "deleted"
    _done(
        as_json,
        report.to_json(),
        f"{verb} {len(report.deleted_blobs)} blob(s) and {len(report.deleted_rows)} row(s); kept"
        f" {report.referenced} referenced and {report.kept_young} young blob(s) (grace {report.grace_s:g}s)",
    )


@cache_app.command("keygen")
def keygen(
    directory: Annotated[Path, typer.Argument(help="Where to write cache-signing.key (0600) and .pub.")],
    as_json: JsonOption = False,
) -> None:
    """Write a publisher key pair: point SMTHRS_CACHE_SIGNING_KEY at the private file on a publishing machine
    (CI), and add the public key to SMTHRS_CACHE_TRUSTED_KEYS on every reader."""
    try:
        priv, pub, key = _generate(directory)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    _done(
        as_json,
        {"private": str(priv), "public": str(pub), "key_id": key.key_id, "public_b64": key.public.b64()},
        f"wrote {priv} (private, 0600) and {pub}; key id {key.key_id}\n"
        f"  publisher: export SMTHRS_CACHE_SIGNING_KEY={priv}\n"
        f"  readers:   export SMTHRS_CACHE_TRUSTED_KEYS={key.public.b64()}   (or the path {pub})",
    )


def _generate(directory: Path) -> tuple[Path, Path, Any]:
    """``generate_key_pair`` with the directory checked first and the file system's refusals typed: a path that is
    a file (perhaps the key itself) is never a directory to write into, and an unwritable one says so."""
    from ..cache.signing import generate_key_pair

    target = directory.expanduser()
    if target.exists() and not target.is_dir():
        raise CacheError(
            "invalid_key",
            f"{target} exists and is not a directory; keygen writes cache-signing.key and cache-signing.pub INTO a "
            "directory — pass a new or empty directory (an existing key is never overwritten)",
            where=str(target),
        )
    try:
        return generate_key_pair(target)
    except OSError as exc:
        raise CacheError(
            "invalid_key",
            f"cannot write a key pair into {target} ({exc.strerror or exc}); pass a directory you can create and "
            "write",
            where=str(target),
            cause=exc,
        ) from exc


@cache_app.command("revoke")
def revoke(
    key_or_node: Annotated[str, typer.Argument(help="A key1_ key, or a node id / subject (all its keys).")],
    db: DbOption = None,
    artifacts: ArtifactsOption = None,
    shared: SharedOption = None,
    workspace: WorkspaceOption = None,
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded in the marker).")] = "",
    as_json: JsonOption = False,
) -> None:
    """Revoke a cached result for every reader: a marker in the shared tier (readers re-execute; their local
    copies are dropped within SMTHRS_CACHE_REVOCATION_REFRESH_S), and this machine's local rows at once."""
    from ..cache.maintenance import revoke as revoke_key

    try:
        _lookup(key_or_node, "KEY_OR_NODE")
        with _runtime("revoke", db, workspace, artifacts, shared) as rt:
            st = rt.cache_tiers(shared)
            report = revoke_key(st.local, st.shared, key_or_node, by=st.host_id, reason=reason)
    except SmthrsError as exc:
        _refuse(as_json, exc)
    lines = [f"revoked {k} (marker {m})" for k, m in zip(report.keys, report.markers, strict=True)]
    lines.append(f"{len(report.entries)} copies named, {len(report.invalidated)} local row(s) invalidated")
    _done(as_json, report.to_json(), "\n".join(lines))
