"""Prefect's ephemeral server startup budget: 180 s unless the user chose one — an explicit
setting (environment variable or prefect.toml) always wins — and a start that still times out is a typed
``SchedulerError(prefect_unavailable)`` naming the setting and ``PREFECT_API_URL``, never Prefect's bare
RuntimeError. Each case runs in a fresh interpreter with a fresh PREFECT_HOME and no PREFECT_API_URL (Prefect reads
its settings at import). No Prefect server is ever started here: the time-out is provoked with a 0 s budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smthrs_plugin.errors import SchedulerError
from smthrs_plugin.prefect.environment import (
    DEFAULT_STARTUP_TIMEOUT_S,
    STARTUP_TIMEOUT_SETTING,
    translated_startup_timeout,
)

PROBE = """
from smthrs_plugin.prefect.environment import startup_timeout_s
from smthrs_plugin.prefect.host import quiet_flow_settings
with quiet_flow_settings():
    print(startup_timeout_s())
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", STARTUP_TIMEOUT_SETTING)}
    home = tmp_path / "prefect-home"
    home.mkdir(exist_ok=True)
    return {**env, "PREFECT_HOME": str(home), **extra}


def _budget(tmp_path: Path, **extra: str) -> int:
    p = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=_env(tmp_path, **extra),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip().splitlines()[-1])


def test_the_ephemeral_server_gets_180_s_when_the_user_chose_no_startup_timeout(tmp_path: Path) -> None:
    assert DEFAULT_STARTUP_TIMEOUT_S == 180
    assert _budget(tmp_path) == 180


def test_an_explicit_startup_timeout_always_wins(tmp_path: Path) -> None:
    assert _budget(tmp_path, **{STARTUP_TIMEOUT_SETTING: "45"}) == 45
    assert _budget(tmp_path, **{STARTUP_TIMEOUT_SETTING: "20"}) == 20  # even Prefect's own default, when chosen
    # Not only the environment: a prefect.toml in the working directory is the user's choice too.
    (tmp_path / "prefect.toml").write_text("[server.ephemeral]\nstartup_timeout_seconds = 33\n")
    assert _budget(tmp_path) == 33


@pytest.mark.slow
def test_a_startup_time_out_is_a_typed_error_that_names_the_setting_and_prefect_api_url(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    plan = tmp_path / "plan.yaml"
    plan.write_text("plan: p\nflow: f\nnodes:\n  - id: a\n    run: 'true'\n")
    p = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "run", str(plan), "--prefect", "--json"],
        # A 0 s budget: Prefect gives up before its first health probe, whatever the machine's speed.
        env=_env(
            tmp_path,
            **{
                STARTUP_TIMEOUT_SETTING: "0",
                "SMTHRS_WORKSPACE": str(ws),
                "SMTHRS_DB_URL": f"sqlite:///{(tmp_path / 'state.db').as_posix()}",
            },
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    err = json.loads(p.stdout.strip().splitlines()[-1])["error"]
    assert err["family"] == "scheduler" and err["code"] == "prefect_unavailable"
    assert STARTUP_TIMEOUT_SETTING in err["message"] and "PREFECT_API_URL" in err["message"]
    assert err["cause"].startswith("RuntimeError: Timed out while attempting to connect to ephemeral Prefect")
    assert "Traceback" not in p.stderr


def test_only_prefects_startup_time_out_is_translated_and_nothing_is_swallowed() -> None:
    # The exact text Prefect 3.9 raises (prefect/server/api/server.py, SubprocessASGIServer.start).
    prefect_text = (
        "Timed out while attempting to connect to ephemeral Prefect API server. "
        "Ephemeral server process exited with code 1."
    )
    with pytest.raises(SchedulerError) as typed, translated_startup_timeout():
        raise RuntimeError(prefect_text)
    assert typed.value.code == "prefect_unavailable" and STARTUP_TIMEOUT_SETTING in typed.value.message
    assert isinstance(typed.value.__cause__, RuntimeError) and str(typed.value.cause) == prefect_text
    with pytest.raises(RuntimeError, match="something else"), translated_startup_timeout():
        raise RuntimeError("something else")


#: A flow author's script, written the way the README shows it: Prefect imported first, an ``@sp.step``, then the
#: budget the flow run's ephemeral server would get (read after the decorator, as the flow would).
AUTHOR_SCRIPT = """
from prefect import flow
from prefect.settings import get_current_settings

import smthrs_plugin as sp

@sp.step
def noop() -> int:
    return 1

print(get_current_settings().server.ephemeral.startup_timeout_seconds)
"""


def _author_budget(tmp_path: Path, **extra: str) -> int:
    script = tmp_path / "pipeline.py"  # a file: a step's key folds its source
    script.write_text(AUTHOR_SCRIPT)
    p = subprocess.run(
        [sys.executable, str(script)],
        env=_env(tmp_path, **extra),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip().splitlines()[-1])


def test_a_script_that_defines_a_step_gives_its_own_flows_ephemeral_server_180_s(tmp_path: Path) -> None:
    assert _author_budget(tmp_path) == 180


def test_a_script_that_defines_a_step_keeps_the_users_startup_timeout(tmp_path: Path) -> None:
    assert _author_budget(tmp_path, **{STARTUP_TIMEOUT_SETTING: "45"}) == 45
    (tmp_path / "prefect.toml").write_text("[server.ephemeral]\nstartup_timeout_seconds = 33\n")
    assert _author_budget(tmp_path) == 33
