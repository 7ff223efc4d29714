"""``smthrs doctor [--workspace DIR] [--db URL] [--artifacts URL] [--timeout S] [--json]`` — is this machine set up?

Invariants:
- The checks run in one fixed order and each answers one row ``(check, status, detail, fix)``, ``status`` one of
  ``ok``, ``warn``, ``fail``; a failing or warning row names its fix (a command or the variable to set). ``--json``
  prints ONE object ``{"ok": bool, "checks": [{"check", "status", "detail", "fix"}, ...]}``.
- Exit codes (:mod:`.exits`): 0 when no check failed (warnings included); 2 (``EXIT_REFUSED``) when a failed check
  is a configuration problem — the same command fails until someone changes the setup (a missing bucket, a key
  that does not parse, a database path that cannot exist); 75 (``EXIT_TEMPFAIL``) when every failure is a
  dependency that did not answer (a database server, the S3 endpoint, the Prefect API): a retry may pass.
- It never hangs: every probe of a database, a bucket or an API runs under ``--timeout`` seconds (a probe still
  running then fails its row), and the S3 client is given the same connect and read timeouts.
- It leaves nothing behind: no database is created (a missing SQLite file is only checked to be creatable), no
  workspace key is generated, and the store probe deletes the object it wrote under ``doctor/``. Opening an
  existing database brings its schema to the head revision, as every command does.
- Heavy imports (SQLAlchemy, fsspec, cryptography, Prefect's settings, urllib.request) stay inside the checks.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import typer

from smthrs_plugin.cli._common import DbOption, JsonOption, WorkspaceOption
from smthrs_plugin.cli.exits import EXIT_OK, EXIT_REFUSED, EXIT_TEMPFAIL, refusal_exit
from smthrs_plugin.errors import SmthrsError

if TYPE_CHECKING:  # pragma: no cover
    from smthrs_plugin.cache.signing import PublicKey, SigningKey
    from smthrs_plugin.settings import Settings
    from smthrs_plugin.stores.artifacts import ArtifactStore

__all__ = ["register", "doctor", "Row", "run_checks", "doctor_exit"]

Status = Literal["ok", "warn", "fail"]
T = TypeVar("T")

#: Below this many seconds Prefect's ephemeral server may not start on a busy machine (its own default is 20 s).
MIN_STARTUP_TIMEOUT_S = 60
#: Where the store probe writes, under the store's root.
PROBE_PREFIX = "doctor"
_KEYGEN_FIX = (
    "create a key pair (`smthrs cache keygen DIR`) and set SMTHRS_CACHE_SIGNING_KEY=DIR/cache-signing.key (or"
    " SMTHRS_CACHE_SIGNING_KEY_BLOCK to a Prefect Secret block holding it)"
)


@dataclass(frozen=True)
class Row:
    """One check's answer. ``exit_code``: what a failed row makes the command exit with (``EXIT_REFUSED`` for a
    configuration problem, ``EXIT_TEMPFAIL`` for a dependency that did not answer); ``EXIT_OK`` otherwise."""

    check: str
    status: Status
    detail: str
    fix: str = ""
    exit_code: int = EXIT_OK

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "status": self.status, "detail": self.detail, "fix": self.fix}


def _ok(check: str, detail: str) -> Row:
    return Row(check, "ok", detail)


def _warn(check: str, detail: str, fix: str) -> Row:
    return Row(check, "warn", detail, fix)


def _fail(check: str, detail: str, fix: str, *, config: bool) -> Row:
    return Row(check, "fail", detail, fix, EXIT_REFUSED if config else EXIT_TEMPFAIL)


def _typed_fail(check: str, exc: SmthrsError, fix: str) -> Row:
    """A failed row for a typed error, classified as the CLI classifies it (a passing fault: 75; else 2)."""
    return Row(
        check, "fail", exc.message, fix, EXIT_TEMPFAIL if refusal_exit(exc) == EXIT_TEMPFAIL else EXIT_REFUSED
    )


class _TimedOut(Exception):
    pass


def _bounded(timeout_s: float, what: str, fn: Callable[[], T]) -> T:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``: a probe that does not answer (a DNS lookup,
    a server that accepts and never replies) cannot hang the command. Its exception is re-raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=run, name=f"smthrs-doctor-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _TimedOut(f"{what} did not answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


@dataclass
class _State:
    """What earlier checks learnt that later ones need."""

    settings: Settings
    timeout_s: float
    store: ArtifactStore | None = None
    shared: bool = False
    bucket_ok: bool = True
    signer: SigningKey | None = None
    signer_failed: bool = False
    trusted: tuple[PublicKey, ...] = ()


# -- the checks ------------------------------------------------------------------------------------------------


def _database(st: _State) -> Row:
    from smthrs_plugin.stores import normalize_url, open_database
    from smthrs_plugin.stores.migrate import VERSION_TABLE, script_heads

    url = st.settings.resolved_db_url
    fix_url = "point SMTHRS_DB_URL (or --db) at a database this machine can reach and write"
    try:
        normalized, dialect = normalize_url(url)
    except SmthrsError as exc:
        return _typed_fail("database", exc, fix_url)
    if dialect == "sqlite":
        path = Path(normalized.removeprefix("sqlite:///"))
        if not path.exists():
            parent = next((p for p in path.parents if p.exists()), None)
            if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                where = "nothing" if parent is None else f"{parent} (not a writable directory)"
                return _fail(
                    "database",
                    f"cannot create the SQLite database {path}: its nearest parent is {where}",
                    fix_url,
                    config=True,
                )
            return _ok("database", f"SQLite {path} does not exist yet; the first `smthrs run` creates it")

    def opened() -> list[str]:
        import sqlalchemy as sa

        db = open_database(normalized)
        return sorted(
            db.read(lambda c: c.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all())
        )

    try:
        revisions = _bounded(st.timeout_s, "the database", opened)
    except _TimedOut as exc:
        return _fail("database", f"{_shown_url(normalized)}: {exc}", fix_url, config=False)
    except SmthrsError as exc:
        fix = "upgrade smthrs-plugin on this machine" if exc.code == "schema_too_new" else fix_url
        return _typed_fail("database", exc, fix)
    head = sorted(script_heads())
    if revisions != head:  # pragma: no cover - open_database migrates to head or refuses
        return _fail(
            "database",
            f"schema revision {revisions}, expected {head}",
            "run any smthrs command to migrate",
            config=True,
        )
    return _ok("database", f"{_shown_url(normalized)} reachable, schema at head ({', '.join(head)})")


def _workspace(st: _State) -> Row:
    import tempfile

    ws = st.settings.workspace
    fix = "run from the project directory, or pass --workspace DIR (SMTHRS_WORKSPACE) to a directory you can write"
    if not ws.is_dir():
        return _fail("workspace", f"{ws} is not a directory", fix, config=True)
    state = st.settings.state_dir
    probe_dir = state if state.is_dir() else ws
    try:
        with tempfile.NamedTemporaryFile(dir=probe_dir, prefix=".smthrs-doctor-"):
            pass
    except OSError as exc:
        return _fail("workspace", f"cannot write in {probe_dir}: {exc.strerror or exc}", fix, config=True)
    return _ok("workspace", f"{ws} is writable")


def _shared_tier(st: _State) -> Row:
    from smthrs_plugin.cache.signing import is_workspace_store
    from smthrs_plugin.stores.artifacts import ArtifactStore

    fix = (
        "set SMTHRS_ARTIFACTS_URL=s3://BUCKET/PREFIX (or SMTHRS_ARTIFACTS_BLOCK) on every machine of the team"
    )
    try:
        location = _bounded(st.timeout_s, "the artifacts block", st.settings.artifacts_location)
        options = _bounded_options(location.url, dict(location.options), st.timeout_s)
        st.store = ArtifactStore(location.url, options)
    except _TimedOut as exc:
        return _fail(
            "shared tier", str(exc), "check PREFECT_API_URL (the block is read from Prefect)", config=False
        )
    except SmthrsError as exc:
        return _typed_fail("shared tier", exc, fix)
    url = st.store.url
    if is_workspace_store(url, st.settings.workspace):
        return _ok(
            "shared tier", f"none: the artifact store {url} is this workspace's own (the cache is local)"
        )
    if st.store.kind == "memory":
        return _warn("shared tier", f"{url} lives in one process: nothing is shared", fix)
    st.shared = True
    return _ok("shared tier", f"{url}")


def _bucket(st: _State) -> Row:
    from smthrs_plugin.cache.shared import bucket_of, create_bucket_command, missing_bucket

    store = st.store
    if store is None or bucket_of(store) is None:
        st.bucket_ok = store is not None
        return _ok("bucket", "not applicable: the artifact store is not on S3")
    bucket = bucket_of(store)
    try:
        missing = _bounded(st.timeout_s, f"bucket {bucket!r}", lambda: missing_bucket(store))
    except (_TimedOut, SmthrsError) as exc:
        st.bucket_ok = False
        return _fail("bucket", str(exc), _endpoint_fix(store), config=False)
    if missing is not None:
        st.bucket_ok = False
        fix = f"create the bucket: {create_bucket_command(store, missing)} (or point SMTHRS_ARTIFACTS_URL elsewhere)"
        return _fail("bucket", f"bucket {missing!r} does not exist", fix, config=True)
    return _ok("bucket", f"{bucket!r} exists")


def _store_probe(st: _State) -> Row:
    import uuid

    store = st.store
    if store is None or not st.bucket_ok:
        return _warn(
            "store probe", "not run: the artifact store is not usable (rows above)", "fix the rows above"
        )
    data = b"smthrs doctor probe " + uuid.uuid4().hex.encode()

    def probe() -> None:
        fs = store.fs
        folder = f"{_root(store)}/{PROBE_PREFIX}"
        path = f"{folder}/probe-{uuid.uuid4().hex}"
        made = _make_dirs(Path(folder)) if store.kind == "local" else []
        try:
            fs.pipe_file(path, data)
            try:
                if fs.cat_file(path) != data:
                    raise OSError(f"read back different bytes from {path}")
            finally:
                fs.rm_file(path)
        finally:
            _remove_empty(made)

    try:
        _bounded(st.timeout_s, "the store probe", probe)
    except _TimedOut as exc:
        return _fail("store probe", str(exc), _endpoint_fix(store), config=False)
    except PermissionError as exc:
        grant = f"grant this machine's credentials read, write and delete on {store.url}/*"
        s = st.settings
        if s.cache_signing_key is None and s.cache_signing_key_block is None and _can_list(st, store):
            # A reader never writes the shared tier: read-only credentials are enough for it.
            return _warn(
                "store probe", f"{store.url}: readable, not writable ({exc})", f"to publish: {grant}"
            )
        return _fail("store probe", f"{store.url}: access denied ({exc})", grant, config=True)
    except Exception as exc:
        return _fail(
            "store probe", f"{store.url}: {type(exc).__name__}: {exc}", _endpoint_fix(store), config=False
        )
    return _ok("store probe", f"wrote, read and deleted an object under {store.url}/{PROBE_PREFIX}/")


def _signing_key(st: _State) -> Row:
    from smthrs_plugin.cache.signing import configured_signing_key

    s = st.settings
    if s.cache_signing_key is None and s.cache_signing_key_block is None:
        if st.shared:
            return _ok("signing key", "none configured: this machine does not publish to the shared tier")
        return _ok("signing key", "none configured (not needed: no shared tier)")
    try:
        st.signer = _bounded(st.timeout_s, "the signing key", lambda: configured_signing_key(s))
    except _TimedOut as exc:
        st.signer_failed = True
        return _fail(
            "signing key",
            str(exc),
            "check PREFECT_API_URL (the key block is read from Prefect)",
            config=False,
        )
    except SmthrsError as exc:
        st.signer_failed = True
        return _typed_fail("signing key", exc, _KEYGEN_FIX)
    assert st.signer is not None
    source = (
        f"block {s.cache_signing_key_block}" if s.cache_signing_key_block else f"file {s.cache_signing_key}"
    )
    return _ok("signing key", f"key id {st.signer.key_id} ({source}); public key {st.signer.public.b64()}")


def _trusted_keys(st: _State) -> Row:
    from smthrs_plugin.cache.signing import parse_trusted_keys

    spec = st.settings.cache_trusted_keys
    fix = (
        "set SMTHRS_CACHE_TRUSTED_KEYS to the publishers' public keys, comma-separated: files (DIR/cache-signing.pub)"
        " or their base64 (`smthrs cache keygen` prints it)"
    )
    if spec is None:
        if st.shared and st.signer is None:
            return _warn("trusted keys", "none: this machine serves no entry another machine published", fix)
        return _ok("trusted keys", "none configured: only this machine's own entries are served")
    try:
        st.trusted = parse_trusted_keys(spec)
    except SmthrsError as exc:
        return _typed_fail("trusted keys", exc, fix)
    ids = ", ".join(k.key_id for k in st.trusted)
    signer = st.signer
    if signer is not None and signer.key_id not in {k.key_id for k in st.trusted}:
        return _warn(
            "trusted keys",
            f"{ids} — not this machine's signing key {signer.key_id}: machines configured with the same list ignore"
            " the entries it publishes",
            f"add this key's public key ({signer.public.b64()}) to SMTHRS_CACHE_TRUSTED_KEYS on every machine",
        )
    return _ok("trusted keys", ids)


def _publishing(st: _State) -> Row:
    if not st.shared:
        return _ok("publishing", "local only: no shared tier to publish to")
    if st.signer_failed:
        return _warn("publishing", "unknown: the signing key did not load", "fix the signing key row")
    if st.signer is None:
        return _ok(
            "publishing",
            "reads only: no publishing key, so entries built here stay in the local tier (to publish: "
            f"{_KEYGEN_FIX})",
        )
    return _ok("publishing", f"publishes to {st.store.url if st.store else '-'} as {st.signer.key_id}")


def _isolation(st: _State) -> Row:
    from smthrs_plugin.boundary import namespace_available

    choice = st.settings.isolation
    allow = (
        "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or"
        " kernel.apparmor_restrict_unprivileged_userns=0; in a container, a seccomp profile permitting unshare)"
    )
    if choice == "thread":
        return _ok("isolation", "thread (SMTHRS_ISOLATION=thread: bodies run in the calling thread)")
    if choice == "process":
        return _ok("isolation", "process (SMTHRS_ISOLATION=process)")
    ws = st.settings.workspace
    try:
        available = _bounded(
            st.timeout_s, "the namespace probe", lambda: namespace_available(ws if ws.is_dir() else None)
        )
    except _TimedOut as exc:
        return _warn("isolation", f"unknown: {exc}", "run `smthrs doctor` again (every build probes it too)")
    if available:
        return _ok("isolation", f"namespace (SMTHRS_ISOLATION={choice})")
    if choice == "namespace":
        return _fail(
            "isolation",
            "SMTHRS_ISOLATION=namespace, but this kernel or container refuses private mount namespaces: every"
            " build fails",
            f"{allow}, or set SMTHRS_ISOLATION=process",
            config=True,
        )
    return _warn(
        "isolation",
        "process: private mount namespaces are refused here, so C libraries and subprocesses opening absolute"
        " workspace paths are not confined",
        allow,
    )


def _prefect_api(st: _State) -> Row:
    # urllib.request loads http.client, email and ssl: only this check pays for them, not every `smthrs` command.
    import urllib.error
    import urllib.request

    url = _prefect_setting("PREFECT_API_URL", lambda s: s.api.url)
    if not url:
        return _ok(
            "prefect api", "ephemeral: PREFECT_API_URL is not set, so a flow starts Prefect's local server"
        )
    health = str(url).rstrip("/") + "/health"
    fix = (
        f"start the server PREFECT_API_URL names ({url}; `prefect server start`), or unset PREFECT_API_URL to use"
        " the ephemeral server"
    )
    request = urllib.request.Request(health, headers={"Accept": "application/json"})
    key = os.environ.get("PREFECT_API_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")

    def get() -> int:
        with urllib.request.urlopen(request, timeout=st.timeout_s) as answer:  # noqa: S310 (the configured API)
            return int(answer.status)

    try:
        status = _bounded(st.timeout_s, health, get)
    except (_TimedOut, urllib.error.URLError, OSError, ValueError) as exc:
        return _fail("prefect api", f"{health} did not answer: {exc}", fix, config=False)
    if status != 200:
        return _fail("prefect api", f"{health} answered HTTP {status}", fix, config=False)
    return _ok("prefect api", f"{url} answers /health")


def _startup_timeout(st: _State) -> Row:
    from smthrs_plugin.prefect.environment import DEFAULT_STARTUP_TIMEOUT_S, STARTUP_TIMEOUT_SETTING

    check = "prefect startup timeout"
    fix = (
        f"export {STARTUP_TIMEOUT_SETTING}={DEFAULT_STARTUP_TIMEOUT_S} (before Prefect is imported), or run"
        " `prefect server start` once and set PREFECT_API_URL"
    )
    if _prefect_setting("PREFECT_API_URL", lambda s: s.api.url):
        return _ok(check, "not used: PREFECT_API_URL is set")
    raw = os.environ.get(STARTUP_TIMEOUT_SETTING)
    if raw is not None:
        try:
            value = int(raw.strip())
        except ValueError:
            return _fail(
                check, f"{STARTUP_TIMEOUT_SETTING}={raw!r} is not a whole number of seconds", fix, config=True
            )
        source = STARTUP_TIMEOUT_SETTING
    else:
        from smthrs_plugin.prefect.environment import startup_timeout_s, startup_timeout_updates

        # What smthrs gives the server where it starts Prefect: the profile's value when the user chose one.
        if startup_timeout_updates():
            value, source = DEFAULT_STARTUP_TIMEOUT_S, "smthrs's default"
        else:
            value, source = startup_timeout_s(), "the Prefect profile"
    if value < MIN_STARTUP_TIMEOUT_S:
        return _warn(check, f"{value} s ({source}): a first start on a busy machine can take longer", fix)
    return _ok(check, f"{value} s ({source})")


CHECKS: tuple[Callable[[_State], Row], ...] = (
    _database,
    _workspace,
    _shared_tier,
    _bucket,
    _store_probe,
    _signing_key,
    _trusted_keys,
    _publishing,
    _isolation,
    _prefect_api,
    _startup_timeout,
)


def run_checks(settings: Settings, timeout_s: float = 10.0) -> list[Row]:
    """Every check, in order, over ``settings``."""
    st = _State(settings, timeout_s)
    return [check(st) for check in CHECKS]


def doctor_exit(rows: list[Row]) -> int:
    """0 when nothing failed; else 2 when a failure is a configuration problem, else 75 (module docstring)."""
    codes = {r.exit_code for r in rows if r.status == "fail"}
    if not codes:
        return EXIT_OK
    return EXIT_REFUSED if EXIT_REFUSED in codes else EXIT_TEMPFAIL


# -- helpers ---------------------------------------------------------------------------------------------------


def _prefect_setting(env: str, read: Callable[[Any], Any]) -> Any:
    """A Prefect setting: its environment variable when set (no Prefect import), else Prefect's current settings
    (its profile), read only then."""
    if env in os.environ:
        return os.environ[env].strip() or None
    from prefect.settings import get_current_settings

    return read(get_current_settings())


def _bounded_options(url: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """S3 options with connect/read timeouts and one attempt per request, the configured ones kept."""
    if not url.startswith(("s3://", "s3a://")):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", timeout_s)
    config.setdefault("read_timeout", timeout_s)
    config.setdefault("retries", {"max_attempts": 1})
    return {**options, "config_kwargs": config, "skip_instance_cache": True}


def _root(store: ArtifactStore) -> str:
    """The store's root as a path of its fsspec filesystem (where ``ac/`` and ``cas/`` live)."""
    return store.entry_path("probe").rsplit("/ac/", 1)[0]


def _can_list(st: _State, store: ArtifactStore) -> bool:
    """Whether this machine may list the store's root (one level: cheap on any bucket), what a reader needs
    besides reading objects. Not answering counts as no: the caller reports the refusal it already met."""
    try:
        _bounded(st.timeout_s, "the store listing", lambda: store.fs.ls(_root(store), detail=False))
    except (_TimedOut, OSError):
        return False
    return True


def _make_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, deepest first."""
    made: list[Path] = []
    for d in (folder, *folder.parents):
        if d.exists():
            break
        made.append(d)
    for d in reversed(made):
        d.mkdir(exist_ok=True)
    return made


def _remove_empty(made: list[Path]) -> None:
    """Remove the directories the probe created, deepest first, while they are empty: one another process wrote
    into meanwhile (a run creating the artifact store) is theirs now and stays."""
    for d in made:
        try:
            d.rmdir()
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return
            raise


def _endpoint_fix(store: ArtifactStore) -> str:
    endpoint = store.storage_options.get("endpoint_url")
    where = f"the endpoint {endpoint}" if endpoint else "the S3 endpoint"
    return f"check that {where} answers and that AWS credentials are set for this machine"


def _shown_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# -- the command -----------------------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    """Add ``smthrs doctor`` to the root app."""
    app.command("doctor")(doctor)


def doctor(
    workspace: WorkspaceOption = None,
    db: DbOption = None,
    artifacts: Annotated[
        str | None,
        typer.Option(
            "--artifacts",
            help="Artifact store URL (default: SMTHRS_ARTIFACTS_URL, else <workspace>/.smthrs/artifacts).",
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, max=600.0, help="Seconds each network probe may take.")
    ] = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Check this machine's setup (database, workspace, shared cache tier and its bucket, publisher keys,
    isolation, Prefect API) and print one row per check; exit 0 when nothing failed, 2 for a configuration
    problem, 75 when a dependency did not answer."""
    from smthrs_plugin.settings import load_settings

    try:
        settings = load_settings(workspace=workspace, db_url=db, artifacts_url=artifacts)
    except SmthrsError as exc:
        rows = [_typed_fail("settings", exc, "fix the SMTHRS_* variable the detail names")]
    else:
        rows = run_checks(settings, timeout)
    code = doctor_exit(rows)
    if as_json:
        typer.echo(json.dumps({"ok": code == EXIT_OK, "checks": [r.to_json() for r in rows]}, sort_keys=True))
    else:
        typer.echo(_table(rows))
    raise typer.Exit(code)


def _table(rows: list[Row]) -> str:
    width = max(len("CHECK"), *(len(r.check) for r in rows))
    lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
    for r in rows:
        lines.append(f"{r.check:<{width}}  {r.status:<6}  {r.detail}")
        if r.fix:
            lines.append(f"{'':<{width}}  {'':<6}  fix: {r.fix}")
    return "\n".join(lines)
