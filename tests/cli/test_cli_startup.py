"""The CLI answers at once: ``smthrs --version`` prints the package version; ``smthrs --help`` and ``--version``
load neither typer nor any command module, and print byte for byte what the typer app prints; help and usage errors
never load rich; ``smthrs runs`` and ``smthrs plan`` load only what they use (no Prefect, pandas, rich; ``runs`` no
runtime, boundary, fsspec or cache); no ``--help`` shows a ``<bool>`` placeholder for a flag and the command lists
show whole summaries; ``smthrs cache ls`` names its columns above them (text only). Fresh processes for the import
checks (an in-process check would see what other tests imported); no timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import smthrs_plugin
from smthrs_plugin.cli import app

HEAVY = ("prefect", "pandas", "numpy", "pyarrow", "fastapi", "uvicorn", "s3fs")
DEADLINE_S = 120

#: Runs the CLI's own entry point on argv in this interpreter and prints the top-level modules it left loaded.
PROBE = """
import json, sys
from smthrs_plugin.cli import main
sys.argv = ["smthrs", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""

#: The typer app itself on argv (never main()'s quick answers), as the console script `smthrs` would name itself.
TYPER_APP = """
import sys
from smthrs_plugin.cli._app import app
sys.argv = ["smthrs", *sys.argv[1:]]
app()
"""

PLAN = 'plan: p\nflow: ci/p\nnodes:\n  - id: build\n    run: "echo built"\n'


def _modules_after(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> set[str]:
    """Every module a fresh ``smthrs <argv>`` left loaded (whatever its exit code)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        cwd=cwd,
        env=env,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


def _loaded_by(*argv: str) -> set[str]:
    """The top-level packages a fresh ``smthrs <argv>`` left loaded."""
    return {m.split(".")[0] for m in _modules_after(*argv)}


def _fresh(argv: list[str], columns: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE_S, env=env)


def _command_paths(command: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        paths += _command_paths(sub, (*prefix, name))
    return paths


def test_version_prints_smthrs_and_the_package_version_and_exits_0() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"smthrs {smthrs_plugin.__version__}\n"
    fresh = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "--version"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert (fresh.returncode, fresh.stdout) == (0, f"smthrs {smthrs_plugin.__version__}\n"), fresh.stderr


@pytest.mark.parametrize("argv", [("--help",), ("runs", "--help"), ("--version",)], ids=" ".join)
def test_help_and_version_in_a_fresh_process_load_no_heavy_library(argv: tuple[str, ...]) -> None:
    assert sorted(_loaded_by(*argv) & set(HEAVY)) == []


def test_smthrs_help_loads_neither_sqlalchemy_nor_cryptography() -> None:
    # The root help lists commands only: the stores and the cache's signing keys load inside the commands.
    assert sorted(_loaded_by("--help") & {"sqlalchemy", "cryptography", "fsspec"}) == []


@pytest.mark.parametrize("argv", [("--help",), ("--version",)], ids=" ".join)
def test_root_help_and_version_load_neither_typer_nor_a_command_module(argv: tuple[str, ...]) -> None:
    loaded = _modules_after(*argv)
    assert sorted({m.split(".")[0] for m in loaded} & {"typer", "click", "rich", "pydantic", *HEAVY}) == []
    commands = [
        m for m in loaded if m.startswith("smthrs_plugin.cli.") and m != "smthrs_plugin.cli._root_help"
    ]
    assert sorted(commands) == ["smthrs_plugin.cli.exits"]


@pytest.mark.parametrize("columns", [None, "80", "100", "200", "60"])
def test_root_help_is_byte_for_byte_what_the_typer_app_prints(columns: str | None) -> None:
    # main() answers `smthrs --help` from cli/_root_help.py without typer; a command added or a help line changed
    # makes this fail until _root_help.BODY is updated to the typer app's text (shown in the failure). 60 columns:
    # the typer app answers itself (its wrapping depends on the width).
    typer_app = _fresh([sys.executable, "-c", TYPER_APP, "--help"], columns)
    assert typer_app.returncode == 0, typer_app.stderr
    script = _fresh(
        [sys.executable, "-c", "import sys\nfrom smthrs_plugin.cli import main\nmain()", "--help"], columns
    )
    module = _fresh([sys.executable, "-m", "smthrs_plugin", "--help"], columns)
    assert (script.returncode, script.stderr, module.returncode, module.stderr) == (0, "", 0, "")
    # `-c` names the program as a console script would (its file name): the usage line says `smthrs` there too.
    assert script.stdout.replace("Usage: -c ", "Usage: smthrs ", 1) == typer_app.stdout
    usage, body = module.stdout.split("\n", 1)
    assert usage == "Usage: python -m smthrs_plugin [OPTIONS] COMMAND [ARGS]..."
    assert body == typer_app.stdout.split("\n", 1)[1]


def test_version_without_typer_is_what_the_typer_app_prints() -> None:
    typer_app = _fresh([sys.executable, "-c", TYPER_APP, "--version"], None)
    quick = _fresh([sys.executable, "-m", "smthrs_plugin", "--version"], None)
    assert (quick.returncode, quick.stdout, quick.stderr) == (typer_app.returncode, typer_app.stdout, "")


@pytest.mark.parametrize(
    "argv",
    [
        ("runs", "--help"),
        ("cache", "--help"),
        ("recover", "--help"),
        ("cache", "ls", "--help"),
        ("runs", "--bogus"),
    ],
    ids=" ".join,
)
def test_help_and_usage_errors_are_plain_text_without_rich(argv: tuple[str, ...]) -> None:
    assert sorted(_loaded_by(*argv) & {"rich", "markdown_it", "pygments", "sqlalchemy", *HEAVY}) == []


def test_smthrs_runs_loads_the_catalog_and_nothing_of_the_runtime(tmp_path: Path) -> None:
    ws = _workspace_with_a_database(tmp_path)
    loaded = _modules_after("runs", "--json", cwd=ws, env=_env(ws))
    assert "smthrs_plugin.observe.catalog" in loaded  # the command ran
    tops = {m.split(".")[0] for m in loaded}
    assert sorted(tops & {"prefect", "fsspec", "rich", "cryptography", "yaml", *HEAVY}) == []
    unused = (
        "smthrs_plugin.runtime",
        "smthrs_plugin.boundary",
        "smthrs_plugin.cache",
        "smthrs_plugin.scheduler",
    )
    assert sorted(m for m in loaded if m.startswith(unused)) == []


def test_smthrs_plan_loads_neither_prefect_nor_rich_nor_the_http_stack(tmp_path: Path) -> None:
    ws = _workspace_with_a_database(tmp_path)
    loaded = _modules_after("plan", str(ws / "p.yaml"), "--json", cwd=ws, env=_env(ws))
    assert "smthrs_plugin.runtime" in loaded  # the command ran
    tops = {m.split(".")[0] for m in loaded}
    assert (
        sorted(tops & {"prefect", "rich", *HEAVY}) == []
    )  # HEAVY: Prefect, pandas, fastapi, uvicorn, s3fs ...


def _workspace_with_a_database(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "p.yaml").write_text(PLAN)
    planned = CliRunner().invoke(app, ["plan", str(ws / "p.yaml"), "--workspace", str(ws), "--json"])
    assert planned.exit_code == 0, planned.output
    return ws


def _env(ws: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMTHRS_")}
    env["SMTHRS_WORKSPACE"] = str(ws)
    return env


def test_no_help_shows_a_placeholder_for_a_flag() -> None:
    runner = CliRunner()
    paths = _command_paths(typer.main.get_command(app))
    assert ("cache", "ls") in paths and ("runs",) in paths  # the walk reached the groups and their commands
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert "--help" in result.output and "<bool>" not in result.output, (path, result.output)
        cut = [line for line in result.output.splitlines() if line.endswith("...") and "Usage:" not in line]
        assert cut == [], (path, result.output)  # a command list shows whole summaries, not cut ones


def test_cache_ls_prints_a_header_above_its_columns_and_json_stays_one_object(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "p.yaml").write_text(PLAN)
    opts = ["--workspace", str(ws), "--db", f"sqlite:///{(ws / 'state.db').as_posix()}"]
    runner = CliRunner()
    ran = runner.invoke(app, ["run", str(ws / "p.yaml"), *opts, "--json"])
    assert ran.exit_code == 0, ran.output

    listed = runner.invoke(app, ["cache", "ls", *opts])
    assert listed.exit_code == 0, listed.output
    header, row = listed.stdout.splitlines()
    assert header.split() == ["TIER", "SCOPE", "SUBJECT", "KEY", "CREATED", "HOST", "STATE"]
    assert row.split()[0] == "local" and row.split()[2] == "p/build"
    # Each column name starts where its values start.
    for name, value in zip(header.split()[:5], row.split()[:5], strict=True):
        assert header.index(name) == row.index(value), (name, value)

    as_json = runner.invoke(app, ["cache", "ls", *opts, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert [e["subject"] for e in json.loads(as_json.stdout)["entries"]] == ["p/build"]


def test_cache_ls_of_an_empty_cache_says_so_without_a_header(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "p.yaml").write_text(PLAN)
    opts = ["--workspace", str(ws), "--db", f"sqlite:///{(ws / 'state.db').as_posix()}"]
    runner = CliRunner()
    assert runner.invoke(app, ["plan", str(ws / "p.yaml"), *opts, "--json"]).exit_code == 0  # a database
    listed = runner.invoke(app, ["cache", "ls", *opts])
    assert (listed.exit_code, listed.stdout) == (0, "no cache entries\n")
