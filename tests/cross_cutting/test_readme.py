"""README.md and the docs site stay true: every Python block is run by a test or names the test that pins it.

A block marked ``<!-- tested-by: PATH -->`` is executed verbatim by that test; this module pins that the page still
shows that same code (up to indentation, blank lines and string escaping), so the two cannot drift apart
silently. A block that cannot run as written (it names a remote cluster, a deployment) is marked
``<!-- pinned by PATH (...) -->``: the test at PATH exercises what it shows. A Python block with neither fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_MARKED = re.compile(r"<!-- tested-by: (\S+) -->\n```python\n(.*?)```", re.DOTALL)
_PYTHON_BLOCK = re.compile(r"^```python\n", re.MULTILINE)
_MARKER = re.compile(r"<!-- (?:tested-by: (\S+) -->|pinned by (\S+) )[^\n]*\n$")


def _lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def _marked_blocks() -> list[tuple[str, str, str]]:
    return [
        (page.relative_to(ROOT).as_posix(), path, block)
        for page in PAGES
        for path, block in _MARKED.findall(page.read_text(encoding="utf-8"))
    ]


def test_pages_mark_their_tested_examples() -> None:
    assert len(_marked_blocks()) >= 19


def test_every_python_block_is_tested_or_names_the_test_that_pins_it() -> None:
    unmarked = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in _PYTHON_BLOCK.finditer(text):
            head = text[: block.start()]
            marker = _MARKER.search(head[head.rfind("<!--") :]) if "<!--" in head else None
            named = marker and (marker.group(1) or marker.group(2))
            if not named or not (ROOT / named).is_file():
                unmarked.append(f"{page.relative_to(ROOT)}:{head.count(chr(10)) + 1}")
    assert unmarked == [], f"Python blocks with no tested-by/pinned-by marker naming an existing file: {unmarked}"


@pytest.mark.parametrize(("page", "path", "block"), _marked_blocks(), ids=lambda v: str(v)[:40])
def test_page_example_is_the_code_its_test_runs(page: str, path: str, block: str) -> None:
    source = (ROOT / path).read_text(encoding="utf-8").replace("\\\\", "\\")
    haystack = _lines(source)
    needle = [line for line in _lines(block) if not re.fullmatch(r"# \w+\.py", line)]  # a file-name caption
    starts = [i for i, line in enumerate(haystack) if line == needle[0]]
    assert any(haystack[i : i + len(needle)] == needle for i in starts), (
        f"{page} block (first line {needle[0]!r}) no longer matches the example run by {path}"
    )
