"""The docs/explanation/cache.md step-boundary example, run verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

README_EXAMPLE = """
from smthrs_plugin.boundary import Declaration, Evidence, replay_outputs, run_in_sandbox
from smthrs_plugin.stores import ArtifactStore

store = ArtifactStore(".smthrs/artifacts")      # or "s3://bucket/prefix", {"endpoint_url": ...}
decl = Declaration.of(reads=["data/raw.csv"], writes=["data/clean.csv"])

def clean(root):                                 # root = a temp tree holding only data/raw.csv
    rows = [r for r in (root / "data/raw.csv").read_text().splitlines() if r]
    (root / "data/clean.csv").write_text("\\n".join(rows) + "\\n")
    return len(rows)

res = run_in_sandbox(".", decl, clean, mode="hermetic", artifacts=store)
print(res.value, res.evidence.hermetic_reads_verified)    # 2 True
row = res.evidence.to_json()                              # plain JSON: an SQL row or a shared entry
replay_outputs("../elsewhere", Evidence.from_json(row), store)  # verified, atomic, on a fresh tree
"""


def test_readme_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "raw.csv").write_text("a,1\n\nb,2\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(ws)
    exec(compile(README_EXAMPLE, "docs/explanation/cache.md", "exec"), {})
    assert capsys.readouterr().out == "2 True\n"
    assert (ws / "data/clean.csv").read_text() == "a,1\nb,2\n"
    assert (tmp_path / "elsewhere/data/clean.csv").read_text() == "a,1\nb,2\n"
