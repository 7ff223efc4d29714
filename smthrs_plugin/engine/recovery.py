"""Disaster recovery: online backup, verification, restore, and the fence that makes a restored store safe.

Invariants:

- **Backups are complete or absent.** ``backup(db, dir)`` copies a SQLite database with SQLite's online backup
  API (one consistent snapshot while writers keep going), fsyncs it, and writes ``manifest.json`` LAST (temp file
  + rename). A directory without a manifest is an unfinished backup and :func:`verify` refuses it. The manifest
  pins the copy's SHA-256, its source identity, global revision and schema revision.
- **PostgreSQL is refused, not half-supported**: use ``pg_dump``/``pg_restore`` and then :func:`fence`.
- **A restored store is fenced before anyone sees it.** A backup still names the owners that were live when it
  was taken; a surviving pre-backup owner would pass the fence against the restored rows. :func:`restore`
  therefore fences a private copy first (``fence=True``, the default) and only then copies it into the target
  through the backup API (so processes that hold the target open see the new content, never a half-written or
  replaced-under-them file). Afterwards every pre-backup owner's next write fails with ``FenceLost``.
- :func:`fence` is ONE write transaction: clear every pending claim and suspend every ``running`` run with
  waiting reason ``released`` and no owner, so the runs are claimable at once (no stale-window wait), each with
  an ``interrupt-released {cause: "recovery-fence"}`` journal record.

Prior art: the reference's ``DisasterRecovery`` (restoring a backup resets the fence), SQLite's
backup API, write-the-manifest-last from git's packfile/index writing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..errors import StoreError
from ..records.journal import Journal
from ..records.runs import claimed_count_in, execution_fact, release_all_in, running_owners_in
from ..stores.database import Database, normalize_url, open_database
from ..stores.migrate import VERSION_TABLE, known_revisions

__all__ = [
    "BackupManifest",
    "BackupWritten",
    "Verified",
    "Restored",
    "Fenced",
    "backup",
    "verify",
    "restore",
    "fence",
    "BACKUP_FORMAT",
    "MANIFEST_NAME",
    "DATABASE_NAME",
]

BACKUP_FORMAT = "smthrs-backup/1"
MANIFEST_NAME = "manifest.json"
DATABASE_NAME = "state.db"


@dataclass(frozen=True)
class BackupManifest:
    format: str
    database: str
    sha256: str
    bytes: int
    source_id: str
    revision: int
    schema_revisions: tuple[str, ...]
    created_at_ms: int

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema_revisions"] = list(self.schema_revisions)
        return d


@dataclass(frozen=True)
class BackupWritten:
    directory: Path
    manifest: BackupManifest


@dataclass(frozen=True)
class Verified:
    directory: Path
    manifest: BackupManifest


@dataclass(frozen=True)
class Fenced:
    """What a fence did: the runs it released (suspended, ``released``) and how many pending claims it cleared."""

    released: tuple[str, ...]
    claims_cleared: int
    revision: int | None


@dataclass(frozen=True)
class Restored:
    url: str
    manifest: BackupManifest
    fenced: Fenced | None


def backup(db: Database, directory: str | os.PathLike[str], *, clock: Clock = SYSTEM_CLOCK) -> BackupWritten:
    """Write a verified-on-read backup of a SQLite database into ``directory`` (empty or absent)."""
    src_path = db.sqlite_path
    if src_path is None:
        raise StoreError(
            "backup_failed",
            "online backup supports SQLite only; for PostgreSQL use `pg_dump -Fc DBNAME > smthrs.dump` (and "
            "`pg_restore`), then run `smthrs recover fence --db URL` on the restored database",
        )
    out = Path(directory)
    if (out / MANIFEST_NAME).exists() or (out / DATABASE_NAME).exists():
        raise StoreError("backup_failed", f"{out} already holds a backup; choose an empty directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        partial = out / f".{DATABASE_NAME}.partial"
        with (
            contextlib.closing(sqlite3.connect(str(src_path), timeout=30)) as src,
            contextlib.closing(sqlite3.connect(str(partial))) as dst,
        ):
            src.backup(dst)  # one step: a consistent snapshot even while other processes write
        info = _read_identity(partial)
        _fsync(partial)
        os.replace(partial, out / DATABASE_NAME)
        digest, size = _sha256_file(out / DATABASE_NAME)
        manifest = BackupManifest(
            BACKUP_FORMAT, DATABASE_NAME, digest, size, info["source_id"], info["revision"],
            tuple(info["schema_revisions"]), clock.now_ms(),
        )  # fmt: skip
        tmp = out / f".{MANIFEST_NAME}.partial"
        tmp.write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=True), encoding="utf-8")
        _fsync(tmp)
        os.replace(tmp, out / MANIFEST_NAME)  # LAST: its presence means the backup is complete
        _fsync_dir(out)
    except (OSError, sqlite3.Error) as exc:
        raise StoreError("backup_failed", f"backing up {db!r} into {out} failed: {exc}", cause=exc) from exc
    return BackupWritten(out, manifest)


def verify(directory: str | os.PathLike[str]) -> Verified:
    """Check a backup: manifest present and well-formed, bytes match the digest, SQLite integrity ok, schema
    known to this code. Raises ``StoreError(restore_failed)`` saying what is wrong."""
    d = Path(directory)
    mpath = d / MANIFEST_NAME
    if not mpath.exists():
        raise StoreError(
            "restore_failed",
            f"{d} holds no complete backup: {MANIFEST_NAME} is written last, so its absence means the backup never "
            "finished; use another backup",
        )
    try:
        raw = json.loads(mpath.read_text(encoding="utf-8"))
        manifest = BackupManifest(
            raw["format"], raw["database"], raw["sha256"], int(raw["bytes"]), raw["source_id"], int(raw["revision"]),
            tuple(raw["schema_revisions"]), int(raw["created_at_ms"]),
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(
            "restore_failed", f"{mpath} is not a valid backup manifest: {exc}", cause=exc
        ) from exc
    if manifest.format != BACKUP_FORMAT:
        raise StoreError("restore_failed", f"{mpath}: unknown backup format {manifest.format!r}")
    dbfile = d / manifest.database
    try:
        digest, size = _sha256_file(dbfile)
    except OSError as exc:
        raise StoreError("restore_failed", f"{dbfile} is missing or unreadable: {exc}", cause=exc) from exc
    if (digest, size) != (manifest.sha256, manifest.bytes):
        raise StoreError(
            "restore_failed", f"{dbfile} does not match its manifest (sha256/size differ): corrupt backup"
        )
    try:
        with contextlib.closing(
            sqlite3.connect(f"{dbfile.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        ) as c:
            check = c.execute("PRAGMA integrity_check").fetchone()[0]
    except sqlite3.Error as exc:
        raise StoreError(
            "restore_failed", f"{dbfile} is not a readable SQLite database: {exc}", cause=exc
        ) from exc
    if check != "ok":
        raise StoreError("restore_failed", f"{dbfile} fails SQLite's integrity check: {check}")
    unknown = set(manifest.schema_revisions) - known_revisions()
    if unknown:
        raise StoreError(
            "restore_failed",
            f"the backup's schema {sorted(unknown)} is newer than this smthrs_plugin; restore it with a newer version",
        )
    return Verified(d, manifest)


def restore(
    directory: str | os.PathLike[str],
    url: str,
    *,
    force: bool = False,
    fence_runs: bool = True,
    clock: Clock = SYSTEM_CLOCK,
) -> Restored:
    """Restore a verified backup into the SQLite database at ``url`` (``force=True`` to overwrite an existing one).

    With ``fence_runs`` (default) the restored state is fenced (see module invariants) before it becomes visible."""
    verified = verify(directory)
    normalized, dialect = normalize_url(url)
    if dialect != "sqlite":
        raise StoreError(
            "restore_failed",
            "restore supports SQLite only; for PostgreSQL use `pg_restore`, then `smthrs recover fence --db URL`",
        )
    target = Database(normalized, dialect).sqlite_path
    assert target is not None
    if target.exists() and not force:
        raise StoreError(
            "restore_failed",
            f"{target} exists; pass --force (force=True) to overwrite it with the backup "
            "(its pre-backup owners will be fenced)",
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.restore-{uuid.uuid4().hex[:12]}"
    fenced: Fenced | None = None
    try:
        shutil.copyfile(verified.directory / verified.manifest.database, staging)
        # Migrate and fence a private copy: nobody else can see it until it is complete.
        staged = open_database(f"sqlite:///{staging.as_posix()}")
        try:
            if fence_runs:
                fenced = fence(staged, clock=clock)
        finally:
            staged.close()
        with (
            contextlib.closing(sqlite3.connect(str(staging))) as src,
            contextlib.closing(sqlite3.connect(str(target), timeout=30)) as dst,
        ):
            src.backup(dst)  # into the live file, through SQLite's locking: open handles see the new content
    except (OSError, sqlite3.Error) as exc:
        raise StoreError(
            "restore_failed", f"restoring {directory} into {target} failed: {exc}", cause=exc
        ) from exc
    finally:
        for p in (staging, Path(f"{staging}-wal"), Path(f"{staging}-shm")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    Database(normalized, dialect).close()  # this process reconnects lazily to the restored content
    return Restored(normalized, verified.manifest, fenced)


def fence(db: Database, *, clock: Clock = SYSTEM_CLOCK, cause: str = "recovery-fence") -> Fenced:
    """Clear every pending claim and release every running run, in one write transaction."""
    journal = Journal(db, clock=clock)

    def fn(conn: Connection) -> Fenced:
        running = running_owners_in(conn)
        claimed = claimed_count_in(conn)
        if not running and not claimed:
            return Fenced((), 0, None)
        now = clock.now_ms()
        rev = db.next_revision(conn)
        release_all_in(conn, now, rev)
        for row in running:
            owner = {"host_id": row.owner_host, "pid": row.owner_pid, "nonce": row.owner_nonce}
            journal.append_in(
                conn,
                row.run_id,
                "interrupt-released",
                {"cause": cause, "owner": owner, "fact": execution_fact(conn, row.run_id)},
            )
        return Fenced(tuple(row.run_id for row in running), int(claimed), rev)

    return db.write(fn)


def _read_identity(path: Path) -> dict[str, Any]:
    with contextlib.closing(sqlite3.connect(str(path))) as c:
        source_id, revision = c.execute("SELECT source_id, revision FROM meta WHERE id = 1").fetchone()
        revs = [r[0] for r in c.execute(f"SELECT version_num FROM {VERSION_TABLE}")]
    return {"source_id": source_id, "revision": int(revision), "schema_revisions": sorted(revs)}


def _sha256_file(path: Path) -> tuple[str, int]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256") if hasattr(hashlib, "file_digest") else _digest_stream(f)
    return digest.hexdigest(), path.stat().st_size


def _digest_stream(f: Any) -> Any:  # Python 3.10 has no hashlib.file_digest
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Some filesystems refuse fsync on a directory; the file data itself was fsynced above, so the rename's
    # durability is the only thing left to the filesystem there.
    with contextlib.suppress(OSError):
        _fsync(path)
