"""No argument ends the ``smthrs`` command line in a traceback: a malformed one is a typed refusal, exit 2, with one
JSON ``error`` object under ``--json`` and nothing on stderr that looks like a traceback. The cases an attacker or
an operator on a bad day would hit first run the REAL command line (a subprocess, ``python -m smthrs_plugin``, argv
passed as bytes); the wider sweeps run the same typer app in this process (``CliRunner``), as
``test_cli_inputs.py`` does, so the file stays fast on a loaded machine. Pinned here: argv bytes that are not UTF-8 (on POSIX they arrive as surrogate-escaped
text), durations that are not finite seconds, ``cache keygen`` onto an existing file or key (never overwritten),
integers too long to parse in a JSON ``--param``, caps of 0, a FIFO for a plan file, a workspace that is a file —
and commands that read or repair a database refusing a SQLite path that does not exist WITHOUT creating it (or its
parent directories): ``recover fence`` must never print "fenced" for an empty database a typo made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from smthrs_plugin.cli import app
from smthrs_plugin.cli.worker import _parse_params
from smthrs_plugin.stores.database import open_database

GATE = """\
plan: gate
flow: ci/gate
nodes:
  - id: build
    run: "true"
"""

FLOWS = "def f(ctx):\n    return 1\n"


class Cli:
    """``smthrs`` in a subprocess, in one workspace (its database created by the test that needs one)."""

    def __init__(self, ws: Path) -> None:
        self.ws = ws
        self.env = {**os.environ, "SMTHRS_WORKSPACE": str(ws)}
        self.env.pop("SMTHRS_DB_URL", None)

    def run(self, *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
        proc = subprocess.run(
            [sys.executable, "-m", "smthrs_plugin", *args],
            cwd=self.ws,
            env=self.env,
            capture_output=True,
            timeout=120,
        )
        assert b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
        return proc

    def refused(self, *args: str | bytes) -> dict[str, Any]:
        """Run with ``--json``: exit 2 and exactly one JSON object ``{"error": {...}}`` on stdout."""
        proc = self.run(*args, "--json")
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        error: dict[str, Any] = json.loads(proc.stdout)["error"]
        return error

    def invoke(self, *args: str) -> tuple[int, Any]:
        """The same app in this process (its own environment: this workspace, no SMTHRS_DB_URL); exit code and
        the JSON object printed."""
        result = CliRunner().invoke(
            app, [*args, "--json"], env={"SMTHRS_WORKSPACE": str(self.ws), "SMTHRS_DB_URL": None}
        )
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        out = result.stdout.strip()
        return result.exit_code, json.loads(out.splitlines()[-1]) if out else None

    def refused_here(self, *args: str) -> dict[str, Any]:
        """:meth:`refused`, in this process."""
        code, out = self.invoke(*args)
        assert code == 2, out
        error: dict[str, Any] = out["error"]
        return error


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "gate.yaml").write_text(GATE)
    (ws / "flows.py").write_text(FLOWS)
    return Cli(ws)


@pytest.fixture
def db(cli: Cli) -> str:
    """The workspace's default database, created (and migrated) for real."""
    url = f"sqlite:///{(cli.ws / '.smthrs' / 'state.db').as_posix()}"
    open_database(url).close()
    return url


# -- argv bytes that are not UTF-8 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        (b"approve", b"\xff"),
        (b"deny", b"plan-1", b"--request", b"sh\xe9p"),
        (b"cache", b"explain", b"\xff"),
        (b"cache", b"revoke", b"\xc3"),
        (b"worker", b"--flow", b"x=flows:f", b"--run", b"\xff"),
    ],
    ids=lambda argv: b" ".join(argv).decode("ascii", "backslashreplace"),
)
def test_an_argument_that_is_not_utf8_is_refused_typed_exit_2_never_a_traceback(
    cli: Cli, db: str, argv: tuple[bytes, ...]
) -> None:
    error = cli.refused(*argv)
    assert (error["code"], error["bound"]) == ("invalid_input", "well_formed_text")
    assert "UTF-8" in error["message"]


def test_the_human_form_of_a_non_utf8_refusal_is_one_line_naming_the_bytes(cli: Cli, db: str) -> None:
    text = cli.run(b"cancel", b"r\xff")  # no traceback: checked by run
    assert text.returncode == 2 and text.stdout == b""
    assert text.stderr.startswith(
        b"smthrs: refused: [invalid_input] argument 2 (b'r\\xff') is not UTF-8 text"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("show", "\udcff"),
        ("watch", "\udcff"),
        ("resume", "r1", "--key", "k\udcff"),
        ("runs", "--db", "sqlite:////tmp/\udcff.db"),
        ("plan", "gate\udcff.yaml"),
        ("signal", "r1", "wake", "--value", "\udcff"),
    ],
    ids=" ".join,
)
def test_every_command_refuses_surrogate_escaped_arguments_the_same_way(
    cli: Cli, argv: tuple[str, ...]
) -> None:
    error = cli.refused_here(*argv)
    assert (error["code"], error["bound"]) == ("invalid_input", "well_formed_text")


# -- durations ------------------------------------------------------------------------------------------------


def test_cache_gc_grace_inf_is_refused_typed_exit_2_not_an_overflow_traceback(cli: Cli, db: str) -> None:
    error = cli.refused("cache", "gc", "--grace", "inf")
    assert (error["code"], error["option"]) == ("invalid_options", "grace")


@pytest.mark.parametrize("grace", ["-inf", "nan", "-1", "1e300"])
def test_cache_gc_refuses_any_grace_that_is_not_finite_seconds_before_looking_at_any_blob(
    cli: Cli, db: str, grace: str
) -> None:
    error = cli.refused_here("cache", "gc", "--grace", grace)
    assert (error["code"], error["option"]) == ("invalid_options", "grace")
    code, report = cli.invoke("cache", "gc", "--grace", "0", "--dry-run")
    assert code == 0 and report["grace_s"] == 0, report


@pytest.mark.parametrize(
    "option",
    [("--budget", "inf"), ("--budget", "nan"), ("--budget", "-1"), ("--grace", "inf"), ("--grace", "nan")],
)
def test_worker_refuses_a_budget_or_grace_that_is_not_finite_seconds(
    cli: Cli, option: tuple[str, str]
) -> None:
    error = cli.refused_here("worker", "--flow", "x=flows:f", "--run", "r1", *option)
    assert (error["code"], error["option"]) == ("invalid_options", option[0].lstrip("-"))


# -- cache keygen never overwrites --------------------------------------------------------------------------------


def test_keygen_onto_an_existing_file_is_refused_and_the_file_is_untouched(cli: Cli) -> None:
    existing = cli.ws / "gate.yaml"
    error = cli.refused("cache", "keygen", str(existing))
    assert (error["family"], error["code"]) == ("cache", "invalid_key")
    assert existing.read_text() == GATE
    below = cli.refused_here("cache", "keygen", str(existing / "keys"))  # under a file: typed, not OSError
    assert below["code"] == "invalid_key"


def test_keygen_onto_an_existing_key_or_the_key_file_itself_never_overwrites_it(cli: Cli) -> None:
    code, written = cli.invoke("cache", "keygen", str(cli.ws / "keys"))
    assert code == 0, written
    key, pub = Path(written["private"]), Path(written["public"])
    pem, pub_pem = key.read_bytes(), pub.read_bytes()
    for target in (cli.ws / "keys", key):
        error = cli.refused_here("cache", "keygen", str(target))
        assert error["code"] == "invalid_key"
    assert (key.read_bytes(), pub.read_bytes()) == (pem, pub_pem)


# -- JSON arguments ---------------------------------------------------------------------------------------------


def test_a_worker_param_with_an_integer_past_pythons_digit_limit_is_refused_exit_2(cli: Cli) -> None:
    # 5,000 digits: int() raises ValueError past 4,300, which the worker once kept as the string of digits.
    error = cli.refused("worker", "--flow", "x=flows:f", "--run", "r1", "--param", "n=" + "1" * 5000)
    assert (error["code"], error["bound"]) == ("invalid_input", "number")
    assert not (cli.ws / ".smthrs").exists()  # refused before the runtime opened


@pytest.mark.parametrize(
    ("value", "bound"),
    [
        ("1" * 101, "number"),
        ("NaN", "number"),
        ("1e400", "number"),
        ('{"a": 1, "a": 2}', "duplicate_member"),
        ("[" * 200 + "]" * 200, "depth"),
    ],
    ids=["101-digits", "nan", "overflow", "duplicate", "deep"],
)
def test_a_worker_param_outside_the_json_bounds_is_refused_exit_2_not_kept_as_a_string(
    cli: Cli, value: str, bound: str
) -> None:
    error = cli.refused_here("worker", "--flow", "x=flows:f", "--run", "r1", "--param", f"n={value}")
    assert (error["code"], error["bound"]) == ("invalid_input", bound)
    assert not (cli.ws / ".smthrs").exists()  # refused before the runtime opened


def test_a_worker_param_that_is_not_json_at_all_is_still_the_string_itself() -> None:
    assert _parse_params(["day=2026-11-30", "n=42", "s=hello world", 'q=[1, {"a": true}]']) == {
        "day": "2026-11-30",
        "n": 42,
        "s": "hello world",
        "q": [1, {"a": True}],
    }


# -- commands that read or repair a database never create one ----------------------------------------------------


READERS = [
    ("recover", "fence"),
    ("recover", "backup", "{tmp}/backup"),
    ("runs",),
    ("show", "r1"),
    ("watch", "r1"),
    ("cache", "ls"),
    ("cache", "explain", "build"),
    ("cache", "verify"),
    ("cache", "gc", "--dry-run"),
    ("cache", "revoke", "build"),
    ("approve", "plan-1"),
    ("deny", "plan-1"),
    ("cancel", "r1"),
    ("resume", "r1", "--key", "k"),
    ("run", "NO_SUCH_PLAN_ID", "--key", "k"),
]


@pytest.mark.parametrize(
    "argv", [("recover", "fence"), ("runs",), ("signal", "r1", "go", "--value", "1")], ids=" ".join
)
def test_recover_fence_and_runs_on_a_typo_db_exit_2_and_create_neither_the_file_nor_its_directory(
    cli: Cli, tmp_path: Path, argv: tuple[str, ...]
) -> None:
    missing = tmp_path / "nonexistent" / "typo.db"
    error = cli.refused(*argv, "--db", f"sqlite:///{missing.as_posix()}")
    assert (error["family"], error["code"], error["path"]) == ("store", "not_found", str(missing))
    assert not missing.parent.exists()
    text = cli.run(*argv, "--db", f"sqlite:///{missing.as_posix()}")
    assert text.returncode == 2 and b"fenced" not in text.stdout and b"no runs" not in text.stdout
    assert not missing.parent.exists()


@pytest.mark.parametrize("argv", READERS, ids=" ".join)
def test_a_command_that_reads_or_repairs_a_database_refuses_a_missing_sqlite_path_and_creates_nothing(
    cli: Cli, tmp_path: Path, argv: tuple[str, ...]
) -> None:
    missing = tmp_path / "nonexistent" / "typo.db"
    args = [a.format(tmp=tmp_path) for a in argv]
    error = cli.refused_here(*args, "--db", f"sqlite:///{missing.as_posix()}")
    assert (error["family"], error["code"], error["path"]) == ("store", "not_found", str(missing))
    assert "--db" in error["message"]
    assert not missing.parent.exists()
    assert not (tmp_path / "backup").exists()


def test_recover_fence_on_the_default_path_of_a_workspace_without_a_database_creates_nothing(
    cli: Cli,
) -> None:
    error = cli.refused_here("recover", "fence")
    assert error["path"] == str(cli.ws / ".smthrs" / "state.db")
    assert not (cli.ws / ".smthrs").exists()


def test_recover_fence_and_runs_still_work_on_an_existing_database(cli: Cli, db: str) -> None:
    code, fenced = cli.invoke("recover", "fence", "--db", db)
    assert code == 0 and fenced["action"] == "fenced"
    code, listed = cli.invoke("runs")  # the default database of the workspace, which exists
    assert code == 0 and listed["runs"] == []


def test_an_empty_db_option_is_refused_not_read_as_the_default_database(cli: Cli, db: str) -> None:
    for argv in (("recover", "fence"), ("runs",), ("plan", str(cli.ws / "gate.yaml")), ("run", "gate.yaml")):
        error = cli.refused_here(*argv, "--db", "")
        assert (error["code"], "empty" in error["message"]) == ("unsupported_url", True)


# -- other malformed arguments ------------------------------------------------------------------------------------


def test_a_concurrency_cap_of_zero_is_refused_input_before_a_run_is_admitted(cli: Cli) -> None:
    error = cli.refused_here("run", str(cli.ws / "gate.yaml"), "--key", "k1", "--steps", "0")
    assert (error["code"], error["cap"]) == ("invalid_concurrency", "steps")
    assert not (cli.ws / ".smthrs").exists()  # nothing admitted: not even a database
    assert cli.refused_here("resume", "r1", "--key", "k", "--agents", "-1")["code"] == "invalid_concurrency"


def test_a_plan_file_that_is_a_fifo_is_refused_without_blocking_on_it(cli: Cli) -> None:
    fifo = cli.ws / "planted.yaml"
    os.mkfifo(fifo)
    error = cli.refused("plan", str(fifo))  # a subprocess: a blocked read would time out, not hang the suite
    assert error["code"] == "invalid_plan_file"


@pytest.mark.parametrize(
    "argv",
    [("plan", "gate.yaml"), ("approve", "plan-1"), ("cache", "ls"), ("run", "gate.yaml")],
    ids=" ".join,
)
def test_a_workspace_that_is_a_file_is_refused_typed(cli: Cli, argv: tuple[str, ...]) -> None:
    error = cli.refused_here(*argv, "--workspace", str(cli.ws / "gate.yaml"))
    assert (error["family"], error["code"]) == ("settings", "invalid_setting")


@pytest.mark.parametrize("command", ["explain", "revoke"])
def test_cache_lookups_refuse_an_empty_or_oversized_key_before_it_reaches_sqlite(
    cli: Cli, db: str, command: str
) -> None:
    for value in ("", "k" * 5000):
        error = cli.refused_here("cache", command, value)
        assert (error["code"], error["bound"]) == ("invalid_input", "identifier")
