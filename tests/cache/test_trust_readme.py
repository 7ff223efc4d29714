"""The docs/tutorials/data-teams.md "Trusting a shared cache" example, run verbatim: CI signs and publishes, a laptop that trusts CI's
public key gets a verified hit, a revocation makes the laptop re-execute (and, reading only, not publish)."""

from __future__ import annotations

from pathlib import Path

import pytest

README_EXAMPLE = """
import smthrs_plugin as sp
from smthrs_plugin.cache import (
    CacheDispatcher, Trust, generate_key_pair, load_private_key, node_request, parse_trusted_keys, revoke,
)
from smthrs_plugin.stores import ArtifactStore, open_database

key, pub, _ = generate_key_pair("keys")                 # = smthrs cache keygen keys
ci = Trust.of(load_private_key(key))                    # CI:     SMTHRS_CACHE_SIGNING_KEY=keys/cache-signing.key
laptop = Trust.of(None, parse_trusted_keys(str(pub)))   # laptop: SMTHRS_CACHE_TRUSTED_KEYS=keys/cache-signing.pub
team = ArtifactStore("team-cache")                      # e.g. "s3://bucket/cache", {"endpoint_url": ...}
draft = sp.plan.node("clean", body={"cmd": "clean"}, reads=["raw.csv"], writes=["clean.csv"])

def clean(root):
    (root / "clean.csv").write_text((root / "raw.csv").read_text().strip() + "\\n")
    return "cleaned"

def run(ws, trust, run_id):
    seam = CacheDispatcher(open_database(f"sqlite:///{ws}/state.db"), team, ws, trust=trust)
    res = seam.dispatch(node_request(draft, run_id=run_id, workspace=ws, measurer=seam.measurer), clean)
    print(ws, res.outcome, res.decision.tag, res.published.get("shared"))
    return seam

ci_seam = run("ci", ci, "ci-1")                         # ci built Miss published
run("laptop", laptop, "lap-1")                          # laptop clean VerifiedHit None
revoke(ci_seam.local, ci_seam.shared, "clean", by="ci", reason="bad compiler")
run("laptop", laptop, "lap-2")                          # laptop built UnverifiableEvidence unpublished:unsigned
"""


def test_trust_readme_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for ws in ("ci", "laptop"):
        (tmp_path / ws).mkdir()
        (tmp_path / ws / "raw.csv").write_text("a,1\n")
    monkeypatch.chdir(tmp_path)
    exec(compile(README_EXAMPLE, "docs/tutorials/data-teams.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == [
        "ci built Miss published",
        "laptop clean VerifiedHit None",
        "laptop built UnverifiableEvidence unpublished:unsigned",
    ]
    assert (tmp_path / "laptop" / "clean.csv").read_text() == "a,1\n"
