"""README.md and docs/ stay true: every code block marked ``<!-- tested-by: PATH -->`` is the code that test runs.

Each such test executes its example verbatim; this module pins that the README still shows that same code (up to
indentation, blank lines and string escaping), so the two cannot drift apart silently.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_MARKED = re.compile(r"<!-- tested-by: (\S+) -->\n```python\n(.*?)```", re.DOTALL)


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def _marked_blocks() -> list[tuple[str, str]]:
    return [m for page in PAGES for m in _MARKED.findall(page.read_text(encoding="utf-8"))]


def test_readme_marks_its_tested_examples() -> None:
    assert len(_marked_blocks()) >= 9


@pytest.mark.parametrize(("path", "block"), _marked_blocks(), ids=lambda v: str(v)[:40])
def test_readme_example_is_the_code_its_test_runs(path: str, block: str) -> None:
    source = (ROOT / path).read_text(encoding="utf-8").replace("\\\\", "\\")
    haystack = _lines(source)
    needle = [line for line in _lines(block) if not re.fullmatch(r"# \w+\.py", line)]  # a file-name caption
    starts = [i for i, line in enumerate(haystack) if line == needle[0]]
    assert any(haystack[i : i + len(needle)] == needle for i in starts), (
        f"README block (first line {needle[0]!r}) no longer matches the example run by {path}"
    )
