"""``smthrs plan PLAN.yaml`` (text) shows what a reviewer approves: per node its command (``run``/``call``), tier,
reads and writes, needs, timer and approval gate (who may approve, the scopes), plus the plan's own gate — and
prints every value from the plan file safely: no terminal escape, bidi override or line break of the file reaches
the terminal, and a long command is cut. Real typer app in-process, real SQLite workspace."""

from __future__ import annotations

import unicodedata
from pathlib import Path

from typer.testing import CliRunner

from smthrs_plugin.cli import app

RELEASE = """\
plan: release
flow: ci/release
approval: required
envelope: {capabilities: ["deploy:prod"]}
nodes:
  - id: build
    run: "make dist"
    reads: ["src/a.txt", "src/b.txt", "src/c.txt", "src/d.txt", "src/e.txt", "src/f.txt", "src/g.txt"]
    writes: ["dist/"]
  - id: cool-down
    wait: {seconds: 60}
    needs: [build]
  - id: deploy
    call: "os.path:join"
    with: {a: "b"}
    tier: irreversible
    needs: [cool-down]
    approval: {request: ship, envelope: {capabilities: ["deploy:prod"]}}
"""
HOSTILE = (
    "plan: hostile\n"
    'flow: "ci/\\e[31mred\\e]0;title\\a"\n'
    "nodes:\n"
    "  - id: build\n"
    '    run: "echo \\e[2J\\e[H hi \\u202e gnp.exe \\u2028 next; printf ' + "x" * 300 + '"\n'
    '    writes: ["out\\e(0.txt"]\n'
    "  - id: deploy\n"
    '    run: "true"\n'
    "    needs: [build]\n"
    '    approval: {request: "ship\\nfake: approved", envelope: {capabilities: ["a\\e[0m"]}}\n'
)


def _card(tmp_path: Path, text: str) -> str:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    (ws / "plan.yaml").write_text(text)
    db = f"sqlite:///{(ws / 'state.db').as_posix()}"
    result = CliRunner().invoke(app, ["plan", str(ws / "plan.yaml"), "--db", db, "--workspace", str(ws)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_card_shows_each_nodes_command_tier_effects_needs_and_gate(tmp_path: Path) -> None:
    card = _card(tmp_path, RELEASE)
    lines = card.splitlines()
    assert lines[0] == "plan release-" + lines[0].split("release-")[1].split()[0] + "  flow ci/release"
    assert lines[2].startswith("approval: pending  →  smthrs approve release-")
    assert (
        "  plan gate: who may approve: local/operator (scopes once|remembered|run); default scope run; "
        in card
    )
    assert "    run     make dist" in lines
    assert "    reads   7: src/a.txt, src/b.txt, src/c.txt, src/d.txt, src/e.txt, +2 more" in lines
    assert "    writes  1: dist/" in lines
    assert "  cool-down  (step, sealed)" in lines and '    wait    {"seconds": 60}' in lines
    assert "    needs   cool-down" in lines
    assert "  deploy  (step, irreversible)" in lines
    assert '    call    os.path:join with {"a": "b"}' in lines
    gate = next(x for x in lines if x.startswith("    gate    "))
    assert gate == (
        "    gate    approval ship: who may approve: local/operator (scopes once|remembered|run); default scope run;"
        ' envelope capabilities ["deploy:prod"]'
    )


def test_attacker_controlled_text_reaches_the_terminal_escaped_and_bounded(tmp_path: Path) -> None:
    card = _card(tmp_path, HOSTILE)
    # Nothing the plan file holds can drive the terminal: no control, format or separator character but newlines
    # between the card's own lines.
    assert not [c for c in card if c != "\n" and (unicodedata.category(c)[0] == "C" or c in "\u2028\u2029")]
    assert "flow ci/\\x1b[31mred\\x1b]0;title\\x07" in card
    run = next(x for x in card.splitlines() if x.startswith("    run     echo"))
    assert "\\x1b[2J\\x1b[H hi \\u202e gnp.exe \\u2028 next" in run
    assert run.endswith("…") and len(run) <= len("    run     ") + 101  # cut: the file holds 300 more
    assert "    writes  1: out\\x1b(0.txt" in card
    # A line break in a request id cannot forge a line of the card.
    assert not any(line.startswith("fake: approved") for line in card.splitlines())
    assert "approval ship\\nfake: approved:" in card and '["a\\u001b[0m"]' in card
