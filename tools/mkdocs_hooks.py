"""MkDocs hooks for the docs site (``mkdocs.yml``): pages generated from the code, so they cannot drift.

- ``reference/cli.md``: the marker ``<!-- smthrs:cli -->`` becomes every ``smthrs`` command's usage, help and
  options, read from the typer app itself.
- ``architecture.md``: the page is ARCHITECTURE.md (the file at the repository root, which contributors read in
  their checkout), its links rewritten to the site's pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI_MARKER = "<!-- smthrs:cli -->"
# ARCHITECTURE.md links repository paths; on the site the same documents are pages.
_ARCH_LINKS = {"(README.md)": "(index.md)", "(docs/rules.md)": "(rules.md)"}


def _cell(text: str) -> str:
    # Help texts name placeholders like <plan>: text, not HTML.
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _option_rows(command: Any) -> list[str]:
    rows = []
    for param in command.params:  # typer vendors its own click: compare by kind, not by class
        if param.param_type_name != "option" or param.hidden:
            continue
        names = ", ".join(f"`{n}`" for n in [*param.opts, *param.secondary_opts])
        default = "" if param.default in (None, False, ()) or param.required else f"`{param.default}`"
        required = " (required)" if param.required else ""
        rows.append(f"| {names} | {_cell(param.help or '')}{required} | {default} |")
    return rows


def _argument_names(command: Any) -> str:
    return " ".join(p.name.upper() for p in command.params if p.param_type_name == "argument")


def _command_section(path: list[str], command: Any, out: list[str]) -> None:
    title = " ".join(["smthrs", *path])
    depth = "##" if len(path) <= 1 else "###"
    out.append(f"{depth} `{title}`\n")
    args = _argument_names(command)
    out.append(
        f"```text\n{title}{' [OPTIONS]' if command.params else ''}{(' ' + args) if args else ''}\n```\n"
    )
    if command.help:
        out.append(command.help.strip().replace("<", "&lt;").replace(">", "&gt;") + "\n")
    rows = _option_rows(command)
    if rows:
        out.append("| option | meaning | default |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    if hasattr(command, "commands"):
        for name in sorted(command.commands):
            _command_section([*path, name], command.commands[name], out)


def cli_reference() -> str:
    """Markdown for every ``smthrs`` command, from the typer app."""
    import typer

    from smthrs_plugin.cli import app

    root = typer.main.get_command(app)
    out: list[str] = ["## `smthrs`\n", "```text\nsmthrs [OPTIONS] COMMAND [ARGS]...\n```\n"]
    if root.help:
        out.append(root.help.strip() + "\n")
    rows = _option_rows(root)
    if rows:
        out.append("| option | meaning | default |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    for name in root.commands:  # the order `smthrs --help` lists them in
        _command_section([name], root.commands[name], out)
    return "\n".join(out)


def architecture_page() -> str:
    """ARCHITECTURE.md with its links pointing at the site's pages."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for old, new in _ARCH_LINKS.items():
        text = text.replace(old, new)
    return text


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs hook: fill the generated pages."""
    if page.file.src_uri == "architecture.md":
        return architecture_page()
    if CLI_MARKER in markdown:
        return markdown.replace(CLI_MARKER, cli_reference())
    return markdown
