"""The house's import rules fail `make lint` when broken: `lint-imports` (the contracts in pyproject.toml) on the
library, tools/check_test_imports.py on tests, benchmarks and examples. Each test plants one violation in a copy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy_package(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "smthrs_plugin", root / "smthrs_plugin", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency (make lint installs it)")
def test_the_library_as_it_is_keeps_every_import_contract(tmp_path: Path) -> None:
    done = _lint_imports(_copy_package(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency (make lint installs it)")
def test_a_module_importing_another_packages_private_module_breaks_the_lint(tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    _append(root / "smthrs_plugin" / "cli" / "exits.py", "from ..cache import _support  # noqa")
    done = _lint_imports(root)
    assert done.returncode == 1
    assert "smthrs_plugin.cli.exits -> smthrs_plugin.cache._support" in done.stdout


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency (make lint installs it)")
def test_an_import_up_the_floors_breaks_the_lint(tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    _append(root / "smthrs_plugin" / "records" / "runs.py", "from ..scheduler import model as _upward  # noqa")
    done = _lint_imports(root)
    assert done.returncode == 1
    assert "Floors: imports flow one way BROKEN" in done.stdout
    assert "smthrs_plugin.records.runs -> smthrs_plugin.scheduler.model" in done.stdout


def _check_test_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_test_imports.py"), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _tiny_repo(tmp_path: Path) -> Path:
    root = tmp_path / "tiny"
    for rel in ("smthrs_plugin/__init__.py", "smthrs_plugin/cache/__init__.py", "smthrs_plugin/cache/_support.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("", encoding="utf-8")
    (root / "smthrs_plugin" / "_clock.py").write_text("", encoding="utf-8")
    return root


def _test_file(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_a_test_outside_its_package_folder_importing_a_private_module_is_reported(tmp_path: Path) -> None:
    root = _tiny_repo(tmp_path)
    _test_file(root, "tests/cross_cutting/test_a.py", "from smthrs_plugin.cache._support import x\n")
    _test_file(root, "benchmarks/b.py", "from smthrs_plugin.cache import _support\n")
    done = _check_test_imports(root)
    assert done.returncode == 1
    assert "tests/cross_cutting/test_a.py:1: smthrs_plugin.cache._support is private to smthrs_plugin.cache" in (
        done.stdout
    )
    assert "benchmarks/b.py:1:" in done.stdout


def test_a_package_test_folder_may_use_its_own_private_modules_and_every_test_the_roots(tmp_path: Path) -> None:
    root = _tiny_repo(tmp_path)
    _test_file(root, "tests/cache/test_a.py", "from smthrs_plugin.cache._support import x\n")
    _test_file(root, "tests/cache/deeper/test_b.py", "import smthrs_plugin.cache._support\n")
    _test_file(root, "tests/cross_cutting/test_c.py", "from smthrs_plugin._clock import ManualClock\n")
    done = _check_test_imports(root)
    assert done.returncode == 0, done.stdout
