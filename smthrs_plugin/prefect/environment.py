"""Prefect's ephemeral API server gets the startup time a busy machine needs, and a failure says what to do.

Invariants
- Wherever smthrs starts Prefect (``smthrs run --prefect``, :func:`~.prefect.share_prefect_api`, every flow run
  entered through :func:`~.prefect.quiet_flow_settings`, the examples, the benchmarks, the test sessions), and in
  every process that defines an ``@sp.step`` (:func:`give_ephemeral_server_time`: a flow author's own ``@flow``
  starts the server before smthrs is called), the ephemeral server is given :data:`DEFAULT_STARTUP_TIMEOUT_S`
  (180 s) to become healthy. Prefect's own default
  (20 s) is shorter than a first start on a fresh, busy 2-core machine.
- An explicit user setting always wins: the environment variable :data:`STARTUP_TIMEOUT_SETTING`, or any value other
  than Prefect's own default set in a Prefect profile, ``prefect.toml`` or an enclosing ``temporary_settings``.
  Prefect reads the variable into its settings when ``prefect`` is first imported, so scripts set it before that
  import (``os.environ.setdefault``).
- A start that still times out is never swallowed: Prefect's ``RuntimeError`` becomes
  ``SchedulerError(prefect_unavailable)`` — naming the setting and ``PREFECT_API_URL`` — with Prefect's error (and
  the server's output) kept as its cause. Any other ``RuntimeError`` passes through unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import SchedulerError

__all__ = [
    "STARTUP_TIMEOUT_SETTING",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "startup_timeout_updates",
    "startup_timeout_s",
    "give_ephemeral_server_time",
    "is_startup_timeout",
    "startup_timeout_error",
    "translated_startup_timeout",
]

#: Prefect 3's setting (``server.ephemeral.startup_timeout_seconds``, an int, no alias): how long it waits for its
#: ephemeral server's ``/health`` before raising.
STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
#: The budget smthrs gives it when the user has not chosen one.
DEFAULT_STARTUP_TIMEOUT_S = 180
#: The start of the message Prefect 3.9's ``SubprocessASGIServer.start`` raises (``prefect.server.api.server``).
_TIMEOUT_TEXT = "Timed out while attempting to connect to ephemeral Prefect API server"


def _prefect_default() -> int:
    from prefect.settings.models.server.ephemeral import ServerEphemeralSettings

    return int(ServerEphemeralSettings.model_fields["startup_timeout_seconds"].default)


def startup_timeout_s() -> int:
    """The startup budget Prefect will use in the current settings context."""
    from prefect.settings import get_current_settings

    return int(get_current_settings().server.ephemeral.startup_timeout_seconds)


def startup_timeout_updates() -> dict[Any, int]:
    """Updates for ``prefect.settings.temporary_settings`` that give the ephemeral server
    :data:`DEFAULT_STARTUP_TIMEOUT_S` — empty when the user set the timeout (environment variable, or a value other
    than Prefect's default in the current settings)."""
    if STARTUP_TIMEOUT_SETTING in os.environ:
        return {}
    if startup_timeout_s() != _prefect_default():
        return {}
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    return {PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: DEFAULT_STARTUP_TIMEOUT_S}


def give_ephemeral_server_time() -> bool:
    """Give Prefect's ephemeral server :data:`DEFAULT_STARTUP_TIMEOUT_S` in this process (and its children) unless
    the user chose a budget; True when it changed anything.

    A flow author's own ``@flow`` starts the ephemeral server before any smthrs code runs, with the settings Prefect
    read at import: the budget goes into the environment (children inherit it) and Prefect's root settings are
    rebuilt from it (``refresh_global_settings_context``, Prefect's own way to pick up a variable set after import).
    """
    if not startup_timeout_updates():
        return False
    os.environ[STARTUP_TIMEOUT_SETTING] = str(DEFAULT_STARTUP_TIMEOUT_S)
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()
    return True


def is_startup_timeout(exc: BaseException) -> bool:
    """Is ``exc`` Prefect's "the ephemeral server did not become healthy in time" error?"""
    return type(exc) is RuntimeError and str(exc).startswith(_TIMEOUT_TEXT)


def startup_timeout_error(exc: BaseException) -> SchedulerError:
    """The typed error for Prefect's startup time-out ``exc`` (kept as the cause): what happened, and what to do."""
    return SchedulerError(
        "prefect_unavailable",
        f"Prefect's ephemeral API server did not become healthy within {startup_timeout_s()} s; on a slow or "
        f"busy machine give it longer (export {STARTUP_TIMEOUT_SETTING}=600, set before Prefect is imported), "
        "or run a server once "
        "(`prefect server start`) and point PREFECT_API_URL at it (PREFECT_API_URL=http://127.0.0.1:4200/api); "
        "the cause holds Prefect's own error",
        cause=exc,
        setting=STARTUP_TIMEOUT_SETTING,
    )


@contextmanager
def translated_startup_timeout() -> Iterator[None]:
    """Raise :func:`startup_timeout_error` for Prefect's startup time-out inside the block; anything else passes."""
    try:
        yield
    except RuntimeError as exc:
        if is_startup_timeout(exc):
            raise startup_timeout_error(exc) from exc
        raise
