#!/usr/bin/env python3
"""Tests, benchmarks and examples use a package's private modules only from that package's own test folder.

`lint-imports` (contracts in pyproject.toml) checks the library itself; it cannot see tests/, which is not a
package. This applies the same rule there: a module whose name starts with ``_`` may be imported by its own package
and its descendants only, and a test folder stands for the package it mirrors — ``tests/cache/`` for
``smthrs_plugin.cache``, ``tests/engine/waits/`` for ``smthrs_plugin.engine.waits``. A folder that mirrors no package
(``tests/cross_cutting/``, ``tests/`` itself, ``benchmarks/``, ``examples/``) stands for the root package, so it may
use only the root's own private modules (``smthrs_plugin._clock``).

Usage: python tools/check_test_imports.py [REPO_ROOT]. Prints each offending import as ``path:line`` and exits 1 if
there is any, 0 otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "smthrs_plugin"
SCANNED = ("tests", "benchmarks", "examples")


def _is_module(root: Path, dotted: str) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def mirrored_package(root: Path, test_file: Path) -> str:
    """The package a test file's folder stands for: the longest run of its folders that names a package."""
    folders = test_file.relative_to(root).parts[1:-1]
    package = PACKAGE
    for folder in folders:
        candidate = f"{package}.{folder}"
        if not (root.joinpath(*candidate.split(".")) / "__init__.py").is_file():
            break
        package = candidate
    return package


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every dotted name an import statement in ``path`` may load (``from a import b`` yields ``a`` and ``a.b``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def offenders(root: Path) -> list[str]:
    """``path:line: module`` for each private module imported from outside its package's own test folder."""
    out: list[str] = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            own = mirrored_package(root, path)
            for line, dotted in imported_modules(path):
                parts = dotted.split(".")
                if parts[0] != PACKAGE:
                    continue
                for i in range(1, len(parts)):
                    if not (parts[i].startswith("_") and not parts[i].startswith("__")):
                        continue
                    module = ".".join(parts[: i + 1])
                    parent = ".".join(parts[:i])
                    if _is_module(root, module) and not (own == parent or own.startswith(parent + ".")):
                        out.append(f"{path.relative_to(root)}:{line}: {module} is private to {parent}")
                    break
    return sorted(set(out))


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else ".").resolve()
    found = offenders(root)
    for line in found:
        print(line)
    if found:
        print(
            f"{len(found)} import(s) of another package's private module: import its public module or its "
            "__init__, or move the test into tests/<package>/",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
