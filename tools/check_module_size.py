#!/usr/bin/env python3
"""One concept per module: no module of the package is longer than the ceiling (1,000 lines).

Modules are the package's Python files and the review page's ES modules (``smthrs_plugin/serve/static/*.js``).

The ceiling is a limit, not a target to split files against. Usage: python tools/check_module_size.py [REPO_ROOT]
[--max-lines N]. Prints each module over the ceiling and exits 1 if there is any, 0 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 1000


def main(argv: list[str]) -> int:
    args = argv[1:]
    limit = MAX_LINES
    if "--max-lines" in args:
        i = args.index("--max-lines")
        limit = int(args[i + 1])
        del args[i : i + 2]
    root = Path(args[0] if args else ".").resolve()
    over = []
    package = root / "smthrs_plugin"
    modules = sorted(package.rglob("*.py")) + sorted((package / "serve" / "static").glob("*.js"))
    for path in modules:
        with path.open(encoding="utf-8") as f:
            count = sum(1 for _ in f)
        if count > limit:
            over.append(f"{path.relative_to(root)}: {count} lines (ceiling {limit}): split out a concept")
    for line in over:
        print(line)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
