"""The docs/explanation/cache.md cache example, run verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

from smthrs_plugin.cache.signing import generate_key_pair

README_EXAMPLE = """
import smthrs_plugin as sp
from smthrs_plugin.boundary import Measurer
from smthrs_plugin.cache import CacheDispatcher, node_request
from smthrs_plugin.stores import ArtifactStore, open_database

db = open_database("sqlite:///.smthrs/state.db")
local = ArtifactStore(".smthrs/artifacts")          # this machine's blobs
shared = ArtifactStore("../team-cache")             # the team's tier, e.g. "s3://bucket/cache", {"endpoint_url": ...}
measurer = Measurer(".")                            # one per workspace: its stat cache makes hits cheap
seam = CacheDispatcher(db, local, ".", shared=shared, measurer=measurer)

draft = sp.plan.node("clean", body={"cmd": "clean"}, reads=["data/raw.csv"], writes=["data/clean.csv"])

def clean(root):                                    # root = a hermetic sandbox holding only data/raw.csv
    rows = [r for r in (root / "data/raw.csv").read_text().splitlines() if r]
    (root / "data/clean.csv").write_text("\\n".join(rows) + "\\n")
    return {"rows": len(rows)}

first = seam.dispatch(node_request(draft, run_id="run-1", workspace=".", measurer=measurer), clean)
again = seam.dispatch(node_request(draft, run_id="run-2", workspace=".", measurer=measurer), clean)
print(first.outcome, first.decision.tag, first.published["shared"])   # built Miss published
print(again.outcome, again.decision.tag, again.value)                 # clean VerifiedHit {'rows': 2}
"""


def test_readme_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ws = tmp_path / "ws"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "raw.csv").write_text("a,1\n\nb,2\n")
    # A publishing machine: the team's tier outside the workspace is published to only with a configured key.
    key, _, _ = generate_key_pair(tmp_path / "keys")
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(key))
    monkeypatch.delenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK", raising=False)
    monkeypatch.chdir(ws)
    exec(compile(README_EXAMPLE, "docs/explanation/cache.md", "exec"), {})
    assert capsys.readouterr().out == "built Miss published\nclean VerifiedHit {'rows': 2}\n"
    assert (ws / "data/clean.csv").read_text() == "a,1\nb,2\n"
    assert (tmp_path / "team-cache" / "ac").is_dir()
