"""The CLI answers at once: ``smthrs --version`` prints the package version; a fresh ``smthrs --help`` and
``smthrs runs --help`` load none of the heavy libraries (they load inside the command that uses them); no
``--help`` shows a ``<bool>`` placeholder for a flag; ``smthrs cache ls`` names its columns above them (text only).
Fresh processes for the import checks (an in-process check would see what other tests imported); no timings."""

from __future__ import annotations

import json
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
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})), file=sys.stderr)
"""

PLAN = 'plan: p\nflow: ci/p\nnodes:\n  - id: build\n    run: "echo built"\n'


def _loaded_by(*argv: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


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


def test_no_help_shows_a_placeholder_for_a_flag() -> None:
    runner = CliRunner()
    paths = _command_paths(typer.main.get_command(app))
    assert ("cache", "ls") in paths and ("runs",) in paths  # the walk reached the groups and their commands
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert "--help" in result.output and "<bool>" not in result.output, (path, result.output)


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
