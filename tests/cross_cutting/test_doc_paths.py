"""The docs name only what the repository holds.

Every repository path named in a docstring or comment under ``smthrs_plugin/``, or in README.md, ARCHITECTURE.md
or the docs site (``docs/**/*.md``), must exist; package-relative mentions (``records/runs.py``, ``_flowrun.py``) resolve against
``smthrs_plugin/`` or against the mentioning module's own package (or one enclosing it). No text cites a document
outside the repository, an issue number or a "seed N". Each failure lists every offender as ``file:line: text``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "smthrs_plugin"
_ROOTED = ("smthrs_plugin/", "tests/", "examples/", "benchmarks/", ".ci/")
# A path token: directories joined by "/" ending in a file name with a known suffix, or a rooted directory
# (``tests/cache/``). Tokens inside a URL, a placeholder (``tests/<package>/``) or a glob are not paths. In a
# module, a bare ``_flowrun.py`` in double backticks names a module too.
_PATH = re.compile(r"(?<![\w./:@<-])(\.?[\w.-]+(?:/[\w.-]+)*/?)(?![\w/<*{-])")
_BARE_MODULE = re.compile(r"`+(_?\w+\.py)`+")
# "seed" as a citation of the reference's documents ("seed 004", "seeds/001", "the seed's", "(seed: ...)"); the
# hash seed and seeding a sandbox are words, not citations.
_BANNED = re.compile(
    r"DESIGN\.md|SEMANTICS\.md|PREFECT\.md|\bissues? #?\d+|\bseeds?[ /]#?\d+|\bthe seed\b|\bseed(?::|'s)|\bseeds? \"",
    re.IGNORECASE,
)
_SUFFIXES = (".py", ".md", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".json", ".html", ".js", ".css", ".mako")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _python_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _python_prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring in one module."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                value = body[0].value.value
                if isinstance(value, str):
                    for offset, line in enumerate(value.splitlines()):
                        yield body[0].lineno + offset, line


def _markdown_prose(path: Path) -> Iterator[tuple[int, str]]:
    if path.exists():
        yield from enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)


def _mentions(text: str, *, bare: bool) -> Iterator[str]:
    for match in _PATH.finditer(text):
        token = match.group(1).rstrip(".")
        rooted = token.startswith(_ROOTED)
        if "//" in token or (not rooted and "/" not in token):
            continue
        if rooted or token.endswith(_SUFFIXES):
            yield token
    if (
        bare
    ):  # in a module, ``_flowrun.py`` names a module; in markdown a bare name is often the reader's file
        for match in _BARE_MODULE.finditer(text):
            yield match.group(1)


def _bases(path: Path) -> list[Path]:
    """Where a mention in ``path`` may be rooted: the repository, the package, and every package enclosing it."""
    bases = [ROOT, PACKAGE]
    parent = path.parent
    while parent != ROOT and ROOT in parent.parents:
        bases.append(parent)
        parent = parent.parent
    return bases


def _exists(mention: str, path: Path) -> bool:
    return any((base / mention).exists() for base in _bases(path))


def _prose() -> Iterator[tuple[Path, int, str]]:
    for path in _python_files():
        for line, text in _python_prose(path):
            yield path, line, text
    for path in _markdown_files():
        for line, text in _markdown_prose(path):
            yield path, line, text


def _banned_scope() -> list[Path]:
    files = [p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    files += [p for p in _markdown_files() if p.exists()]
    files += [p for p in (ROOT / ".ci").rglob("*") if p.is_file()]
    files += [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    return sorted(files)


def test_every_path_the_docs_name_exists() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {mention} (in: {text.strip()})"
        for path, line, text in _prose()
        for mention in _mentions(text, bare=path.suffix == ".py")
        if not _exists(mention, path)
    ]
    assert not offenders, "paths named in docs that the repository does not hold:\n" + "\n".join(offenders)


def test_no_text_cites_an_outside_document_an_issue_or_a_seed() -> None:
    offenders = []
    for path in _banned_scope():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if _BANNED.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "citations of outside documents, issues or seeds:\n" + "\n".join(offenders)
