"""``SMTHRS_*`` settings (pydantic-settings). Explicit arguments to ``open_runtime``/``@step``/the CLI win.

Defaults are the embedded ones: SQLite at ``<workspace>/.smthrs/state.db`` and local artifacts under
``<workspace>/.smthrs/artifacts``. Ownership timings are settings so that tests can shorten the
stale window instead of sleeping 30 s.

The artifact store is named by a URL (``SMTHRS_ARTIFACTS_URL``/``artifacts=``) or by a saved Prefect block
(``SMTHRS_ARTIFACTS_BLOCK``/``artifacts_block=``, :mod:`._blocks`). Invariants:
- An explicit argument beats the environment, whichever of the two it names: ``artifacts=`` wins over
  ``SMTHRS_ARTIFACTS_BLOCK`` and ``artifacts_block=`` over ``SMTHRS_ARTIFACTS_URL``. A URL and a block at the same
  level (both arguments, or both variables) are ambiguous and refused (``SettingsError``, reason ``conflict``) —
  never resolved silently, since the loser would quietly receive nobody's artifacts.
- Explicit storage options (``SMTHRS_ARTIFACTS_OPTIONS``/``artifacts_options=``) are laid over the block's, key by key.
- Loading settings never contacts Prefect: the block is loaded only by :meth:`Settings.artifacts_location`, which
  is what opens a store. :attr:`Settings.resolved_artifacts_url` refuses while a block is in effect, so a caller
  that only knows URLs can never silently fall back to the local store.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path, PurePath
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ._blocks import ARTIFACTS_BLOCK_SETTING, ArtifactLocation, artifacts_from_block, block_error
from .errors import SettingsError

__all__ = [
    "ArtifactLocation",
    "CacheSettings",
    "Settings",
    "SqliteSynchronous",
    "Execution",
    "Isolation",
    "load_cache_settings",
    "load_settings",
    "sqlite_synchronous_setting",
]

#: ``PRAGMA synchronous`` values smthrs accepts for SQLite (see :attr:`Settings.sqlite_synchronous`).
SqliteSynchronous = Literal["full", "normal"]
#: Where out-of-process bodies run (``Settings.execution``).
Execution = Literal["auto", "shared", "remote"]
#: How a building body is isolated from the live workspace (``Settings.isolation``).
Isolation = Literal["auto", "namespace", "process", "thread"]


#: Default size caps of the cache: one output, and all outputs of one step together.
DEFAULT_MAX_OUTPUT_BYTES = 5 * 1024**3
DEFAULT_MAX_STEP_BYTES = 20 * 1024**3


class CacheSettings(BaseSettings):
    """The cache's trust and size settings (a base of :class:`Settings`; loadable alone with
    :func:`load_cache_settings`, so a dispatcher built without a runtime does not fail on an unrelated setting).

    ``cache_signing_key`` (``SMTHRS_CACHE_SIGNING_KEY``): a private Ed25519 key file (PEM or raw) this machine signs
    its shared entries with; or ``cache_signing_key_block`` (``SMTHRS_CACHE_SIGNING_KEY_BLOCK``): a Prefect ``Secret``
    block (``secret/<name>`` or ``<name>``) holding that key (PEM or base64) — never both. ``cache_trusted_keys`` (``SMTHRS_CACHE_TRUSTED_KEYS``): comma-separated public keys
    (files, or inline base64/PEM) whose entries this machine serves. Neither set: a workspace key generated on
    first use under ``<workspace>/.smthrs/keys/``, trusted only by itself, which signs only the workspace's own
    store (a shared tier elsewhere is read, never published to). Only trusted keys set: this machine reads the
    shared tier but never publishes to it. See :mod:`smthrs_plugin.cache.signing`.
    ``cache_max_output_bytes`` / ``cache_max_step_bytes``: a sealed step whose one output, or whose outputs
    together, exceed them settles ``failed`` (``CacheError(output_too_large)``) before anything is published.
    ``cache_revocation_refresh_s``: how stale this process's view of revocations may be on a LOCAL hit (a shared
    lookup always reads them fresh).
    """

    model_config = SettingsConfigDict(env_prefix="SMTHRS_", extra="ignore", frozen=True)

    cache_signing_key: str | None = None
    cache_signing_key_block: str | None = None
    cache_trusted_keys: str | None = None
    cache_max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    cache_max_step_bytes: int = DEFAULT_MAX_STEP_BYTES
    cache_revocation_refresh_s: float = 60.0

    @field_validator("cache_signing_key", "cache_signing_key_block", "cache_trusted_keys", mode="before")
    @classmethod
    def _blank_is_unset(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("cache_max_output_bytes", "cache_max_step_bytes")
    @classmethod
    def _positive_bytes(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("must be > 0 bytes")
        return v

    @field_validator("cache_revocation_refresh_s")
    @classmethod
    def _non_negative_refresh(cls, v: float) -> float:
        if v < 0:
            raise ValueError("must be >= 0")
        return v


class Settings(CacheSettings):
    """Resolved settings. Use :func:`load_settings` to get typed errors instead of pydantic's."""

    model_config = SettingsConfigDict(env_prefix="SMTHRS_", extra="ignore", frozen=True)

    workspace: Path = Field(default_factory=Path.cwd)
    db_url: str | None = None
    artifacts_url: str | None = None
    artifacts_options: dict[str, Any] = Field(default_factory=dict)
    #: A saved Prefect block (``<type slug>/<name>``, e.g. ``s3-bucket/team-cache``) the artifact store is built
    #: from (module docstring: precedence); loaded only by :meth:`artifacts_location`.
    artifacts_block: str | None = None
    host_id: str = Field(default_factory=socket.gethostname)
    #: The ownership constants (README "Durable store, ownership and recovery"); only tests should shorten them.
    heartbeat_interval_s: float = 1.0
    stale_after_s: float = 30.0
    skew_allowance_s: float = 10.0
    heartbeat_failure_interrupt_s: float = 19.0
    #: Durable waits: how long a run may wait in-process before it parks (and the process may exit), and how often
    #: an in-process waiter re-checks the store when no wake arrives (the wake bus only shortens this poll).
    wait_budget_s: float = 60.0
    wait_poll_s: float = 1.0
    #: SQLite durability of a commit (``PRAGMA synchronous`` on WAL file databases). ``full`` (the default)
    #: fsyncs the WAL at every commit: a committed transition survives an OS crash or power loss. ``normal``
    #: fsyncs only at checkpoints: still safe against PROCESS crashes (the WAL is in the OS page cache), but
    #: an OS crash / power loss may lose the last commits, so an irreversible node that ran may be run again.
    #: Opt in only where that re-execution is acceptable. See :func:`smthrs_plugin.stores.database.open_database`.
    sqlite_synchronous: SqliteSynchronous = "full"
    #: Where node and step bodies run when the flow's task runner is not in this process (``prefect/_remote.py``):
    #: ``auto`` decides from the runner (a process pool or a Dask runner that starts its own local cluster shares
    #: this machine's filesystem; any other out-of-process runner is remote), ``shared`` trusts the workers to
    #: see the workspace at the same path, ``remote`` ships the declared reads and the outputs through the
    #: artifact store (the workers never open the workspace).
    execution: Execution = "auto"
    #: How a building step or node body is kept from the live workspace (``boundary/_isolate.py``): ``namespace``
    #: a forked child in a private mount namespace where the workspace path shows the sandbox; ``process`` a
    #: forked child whose working directory is the sandbox, Python opens of workspace paths outside it refused;
    #: ``thread`` in the calling thread with the same refusals; ``auto`` is ``namespace`` where the kernel allows
    #: it, else ``process`` (said once in the log and on every build's journal record). A step's own
    #: ``isolation=`` wins.
    isolation: Isolation = "auto"
    #: The review page a parked approval names in its Prefect state message, flow-run logs and artifact
    #: (``SMTHRS_REVIEW_URL``, an ``http(s)://`` URL used as given); unset: ``<SMTHRS_SERVE_URL>/`` when that is set.
    review_url: str | None = None
    #: Who decides an approval submitted through Prefect's Resume form (``SMTHRS_PREFECT_UI_PRINCIPAL``, ``ID/KIND``,
    #: judged by the approval authority like ``smthrs approve --as``). Unset: Prefect's Resume decides nothing.
    prefect_ui_principal: str | None = None

    @field_validator("review_url", "prefect_ui_principal", mode="before")
    @classmethod
    def _blank_text_is_unset(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("review_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith(("http://", "https://")) or any(c.isspace() for c in v)):
            raise ValueError("must be an http(s):// URL (the address of the review page)")
        return v

    @field_validator("prefect_ui_principal")
    @classmethod
    def _id_slash_kind(cls, v: str | None) -> str | None:
        if v is not None and "/" not in v.strip("/"):
            raise ValueError("must be a principal ID/KIND, for example ci/reviewer")
        return v

    @field_validator("artifacts_options", mode="before")
    @classmethod
    def _json_options(cls, v: Any) -> Any:
        if isinstance(v, str):
            return json.loads(v) if v.strip() else {}
        return v

    @field_validator("sqlite_synchronous", mode="before")
    @classmethod
    def _lower_synchronous(cls, v: Any) -> Any:
        return _lower(v)

    @field_validator("artifacts_url", "artifacts_block", mode="before")
    @classmethod
    def _blank_location_is_unset(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("wait_budget_s")
    @classmethod
    def _non_negative(cls, v: float) -> float:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("heartbeat_interval_s", "stale_after_s", "heartbeat_failure_interrupt_s", "wait_poll_s")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("must be > 0")
        return v

    @property
    def state_dir(self) -> Path:
        return self.workspace / ".smthrs"

    @property
    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite:///{(self.state_dir / 'state.db').as_posix()}"

    @property
    def effective_artifacts_block(self) -> str | None:
        """The block that configures the artifact store (None: a URL or the local default), without loading it.
        ``SettingsError`` (reason ``conflict``) when a URL and a block are both set (module docstring)."""
        if self.artifacts_block is None:
            return None
        if self.artifacts_url is not None:
            raise block_error(
                "conflict",
                self.artifacts_block,
                ARTIFACTS_BLOCK_SETTING,
                f"an artifact URL ({self.artifacts_url!r}) is set too, at the same level; keep one of them (unset"
                " SMTHRS_ARTIFACTS_URL or SMTHRS_ARTIFACTS_BLOCK). An explicit argument (artifacts= or"
                " artifacts_block=, --artifacts) overrides either variable",
            )
        return self.artifacts_block

    @property
    def resolved_artifacts_url(self) -> str:
        """The artifact URL when no block is in effect. Refuses while one is (use :meth:`artifacts_location`): a
        URL-only caller must never quietly use the local store instead of the block's."""
        block = self.effective_artifacts_block
        if block is not None:
            raise block_error(
                "unsupported",
                block,
                ARTIFACTS_BLOCK_SETTING,
                "this command reads the artifact store only from a URL; pass --artifacts URL (or artifacts=) or"
                " unset the block",
            )
        return self.artifacts_url or (self.state_dir / "artifacts").as_posix()

    def artifacts_location(self) -> ArtifactLocation:
        """Where the artifact store lives: the block's URL and storage options (loaded from Prefect now; typed
        ``SettingsError`` naming it when it cannot be) with explicit ``artifacts_options`` laid over them, or the
        URL setting / local default with ``artifacts_options``."""
        block = self.effective_artifacts_block
        if block is None:
            return ArtifactLocation(self.resolved_artifacts_url, dict(self.artifacts_options))
        loaded = artifacts_from_block(block)
        return ArtifactLocation(loaded.url, {**loaded.options, **self.artifacts_options}, loaded.block)


def load_settings(**overrides: Any) -> Settings:
    """Environment + explicit overrides (``None`` overrides are ignored) → :class:`Settings`.

    An explicit ``artifacts_url`` clears ``SMTHRS_ARTIFACTS_BLOCK`` and an explicit ``artifacts_block`` clears
    ``SMTHRS_ARTIFACTS_URL`` (arguments beat the environment); both given explicitly is refused (reason
    ``conflict``). Raises :class:`SettingsError` naming the offending ``SMTHRS_*`` variable.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("artifacts_url") is not None and given.get("artifacts_block") is not None:
        raise block_error(
            "conflict",
            str(given["artifacts_block"]),
            "artifacts_block",
            f"artifacts={given['artifacts_url']!r} was given too; pass either an artifact URL or a block, not both",
        )
    s = _parsed(given)
    # Resolved on every load, never remembered: a symlink on the way may have been re-pointed since.
    update: dict[str, Any] = {"workspace": Path(s.workspace).resolve()}
    if "artifacts_url" in given:
        update["artifacts_block"] = None
    elif "artifacts_block" in given:
        update["artifacts_url"] = None
    return s.model_copy(update=update)


#: Parsed settings remembered per exact input (a bound on memory: emptied when full).
_PARSED_CAP = 64
_parsed_memo: dict[tuple[Any, ...], Settings] = {}
_parsed_lock = threading.Lock()


def _parsed(given: dict[str, Any]) -> Settings:
    """``Settings(**given)`` over the current environment, remembered per exact input. Parsing reads every
    ``SMTHRS_*`` variable through pydantic-settings (1.5–5 ms: a step's first call in each flow run paid it); the
    result is a pure function of the arguments, those variables, the working directory and the host name (the
    two default factories), which is exactly the memo's key, so a changed variable is parsed afresh."""
    if not all(_plain(v) for v in given.values()):  # parsed (or refused) the long way, never remembered
        return _parse(given)
    # ``repr`` of plain values tells types apart (a Path from a str, a tuple from a list), unlike JSON.
    args = repr(sorted(given.items()))
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k[:7].upper() == "SMTHRS_"))
    key = (args, env, os.getcwd(), socket.gethostname())
    with _parsed_lock:
        hit = _parsed_memo.get(key)
    if hit is not None:
        return hit
    parsed = _parse(given)
    with _parsed_lock:
        if len(_parsed_memo) >= _PARSED_CAP:
            _parsed_memo.clear()
        _parsed_memo[key] = parsed
    return parsed


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is built only of types whose ``repr`` is a faithful key (bounded depth)."""
    t = type(value)
    if value is None or t in (str, int, float, bool) or isinstance(value, PurePath):
        return True
    if depth >= 8:
        return False
    if t in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) is str and _plain(v, depth + 1) for k, v in value.items())
    return False


def _parse(given: dict[str, Any]) -> Settings:
    try:
        return Settings(**given)
    except (ValidationError, json.JSONDecodeError) as exc:
        raise SettingsError(
            "invalid_setting",
            f"invalid smthrs setting: {exc}. Check the SMTHRS_* environment variables and the arguments given.",
            cause=exc,
        ) from exc


def load_cache_settings(**overrides: Any) -> CacheSettings:
    """Only the cache's settings (environment + explicit overrides); :class:`SettingsError` when malformed."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return CacheSettings(**given)
    except ValidationError as exc:
        raise SettingsError(
            "invalid_setting",
            f"invalid smthrs cache setting: {exc}. Check SMTHRS_CACHE_SIGNING_KEY, SMTHRS_CACHE_TRUSTED_KEYS,"
            " SMTHRS_CACHE_MAX_OUTPUT_BYTES, SMTHRS_CACHE_MAX_STEP_BYTES and SMTHRS_CACHE_REVOCATION_REFRESH_S.",
            cause=exc,
        ) from exc


def _lower(v: Any) -> Any:
    # Case-insensitive (SMTHRS_SQLITE_SYNCHRONOUS=NORMAL), like SQLite's own pragma values.
    return v.strip().lower() if isinstance(v, str) else v


class _SqliteOnly(BaseSettings):
    """Just the SQLite durability knob: opening a database must not fail on an unrelated malformed setting."""

    model_config = SettingsConfigDict(env_prefix="SMTHRS_", extra="ignore", frozen=True)

    sqlite_synchronous: SqliteSynchronous = "full"

    @field_validator("sqlite_synchronous", mode="before")
    @classmethod
    def _lower_synchronous(cls, v: Any) -> Any:
        return _lower(v)


def sqlite_synchronous_setting(value: str | None = None) -> SqliteSynchronous:
    """``value`` if given, else ``SMTHRS_SQLITE_SYNCHRONOUS``, else ``"full"``; :class:`SettingsError` if malformed."""
    try:
        s = _SqliteOnly.model_validate({} if value is None else {"sqlite_synchronous": value})
    except ValidationError as exc:
        raise SettingsError(
            "invalid_setting",
            f"invalid SQLite synchronous mode ({'SMTHRS_SQLITE_SYNCHRONOUS' if value is None else repr(value)}): "
            f"{exc}. Use 'full' (the default: durable across power "
            "loss) or 'normal' (SMTHRS_SQLITE_SYNCHRONOUS / sqlite_synchronous=).",
            cause=exc,
        ) from exc
    return s.sqlite_synchronous
