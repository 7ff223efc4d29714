"""Write tests/file_weights.txt from a JUnit XML report: seconds per test file, longest first.

``tests/conftest.py`` hands files to pytest-xdist in this order so the longest start first and a long file
never runs alone at the end of ``make test`` (a file's tests stay together under ``--dist loadfile``).
Usage: ``pytest --junitxml=report.xml ...`` then ``python tools/test_weights.py report.xml``.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "file_weights.txt"
FLOOR_S = 2.0  # lighter files keep their collection order after the listed ones


def _file_of(classname: str) -> str | None:
    """``tests.a.test_b.TestC`` -> ``tests/a/test_b.py`` (the longest dotted prefix that is a file)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        rel = "/".join(parts[:end]) + ".py"
        if (REPO / rel).is_file():
            return rel
    return None


def main(report: str) -> int:
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        rel = _file_of(case.get("classname", ""))
        if rel is not None:
            seconds[rel] += float(case.get("time", "0"))
    rows = [f"{s:.0f} {rel}" for rel, s in seconds.most_common() if s >= FLOOR_S]
    header = "# seconds path -- written by tools/test_weights.py from a make test report; read by tests/conftest.py\n"
    OUT.write_text(header + "\n".join(rows) + "\n", encoding="utf-8")
    print(f"{len(rows)} files, {sum(seconds.values()):.0f} s in all -> {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/test_weights.py REPORT.xml")
    sys.exit(main(sys.argv[1]))
