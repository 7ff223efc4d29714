"""Setting up a shared tier on S3 (moto): publishing takes a configured key, and a missing bucket is refused.

- A machine nobody gave a publishing key reads the team's bucket but uploads nothing to it (the key generated for
  its workspace signs only the workspace's own store), and its log says so once per process, not per entry.
- A reader configured with the team's public keys is served the team's entries and uploads nothing either.
- A shared tier whose bucket does not exist is ``CacheError(bucket_missing)`` naming the command that creates it,
  before the body runs or anything is written; an endpoint that does not answer stays a passing fault of the
  shared tier, as before (the dispatch builds, the entry stays local).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from _cache_support import make_machine, team_trust, upper, upper_node

from smthrs_plugin.cache.signing import trust_from_settings
from smthrs_plugin.errors import CacheError
from smthrs_plugin.settings import load_cache_settings
from smthrs_plugin.stores.artifacts import ArtifactStore

pytestmark = pytest.mark.s3

_TRUST_VARS = ("SMTHRS_CACHE_SIGNING_KEY", "SMTHRS_CACHE_SIGNING_KEY_BLOCK", "SMTHRS_CACHE_TRUSTED_KEYS")


def _objects(store: ArtifactStore) -> list[str]:
    """Every object under the store's root (entries, blobs, anything)."""
    root = store.entry_path("x").rsplit("/ac/", 1)[0]
    return sorted(store.fs.find(root)) if store.fs.exists(root) else []


def _settings_trust(monkeypatch: pytest.MonkeyPatch, home: Path, **env: str) -> Any:
    """The trust this machine's SMTHRS_CACHE_* environment gives it (as a runtime builds it; a generated key is
    kept under ``home``)."""
    for var in _TRUST_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    home.mkdir(parents=True, exist_ok=True)
    return trust_from_settings(load_cache_settings(), home)


@pytest.fixture
def team_bucket(s3_bucket: str, s3_options: dict[str, str]) -> ArtifactStore:
    return ArtifactStore(f"s3://{s3_bucket}/cache", s3_options)


def test_a_machine_without_a_publishing_key_uploads_nothing_to_the_team_bucket_and_says_so_once(
    tmp_path: Path,
    team_bucket: ArtifactStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    trust = _settings_trust(monkeypatch, tmp_path / "laptop-home")
    assert trust.origin == "workspace-default" and trust.signer is not None  # the generated key exists
    caplog.set_level(logging.INFO, logger="smthrs_plugin.cache.dispatch")
    laptop = make_machine(tmp_path, "laptop", team_bucket, files={"in.txt": "abc"}, trust=trust)
    first = laptop.dispatch(upper_node(), upper)
    laptop.write("in.txt", "abcd")
    second = laptop.dispatch(upper_node(), upper, run_id="r2")

    assert [r.outcome for r in (first, second)] == ["built", "built"]
    assert {r.published["shared"] for r in (first, second)} == {"unpublished:unsigned"}
    assert first.published["local"] == "published"  # the local tier keeps it
    assert _objects(team_bucket) == []  # not an entry, not a blob
    assert laptop.dispatch(upper_node(), upper, run_id="r3").outcome == "clean"  # served from the local tier
    # Said once (one log line, whatever the number of entries), and what to do is named.
    said = [r.getMessage() for r in caplog.records if "no publishing key" in r.getMessage()]
    assert len(said) == 1 and "SMTHRS_CACHE_SIGNING_KEY" in said[0] and "SMTHRS_CACHE_TRUSTED_KEYS" in said[0]
    stages = [p.get("stage") for p in laptop.provenance() if p.get("action") == "unpublished"]
    assert stages == ["signing"]


def test_the_generated_workspace_key_still_publishes_to_the_workspaces_own_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trust = _settings_trust(monkeypatch, tmp_path / "solo-home")
    own = ArtifactStore((tmp_path / "solo" / "ws" / ".smthrs" / "artifacts").as_uri())
    solo = make_machine(tmp_path, "solo", own, files={"in.txt": "abc"}, trust=trust, one_store=True)
    assert solo.dispatch(upper_node(), upper).published["shared"] == "published"


def test_a_reader_with_the_teams_public_key_is_served_the_teams_entries_and_uploads_nothing(
    tmp_path: Path, team_bucket: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ci_trust = team_trust(tmp_path)
    ci = make_machine(tmp_path, "ci", team_bucket, files={"in.txt": "abc"}, trust=ci_trust)
    assert ci.dispatch(upper_node(), upper).published["shared"] == "published"
    published = _objects(team_bucket)
    assert published

    assert ci_trust.signer is not None
    reader = _settings_trust(
        monkeypatch, tmp_path / "laptop-home", SMTHRS_CACHE_TRUSTED_KEYS=ci_trust.signer.public.b64()
    )
    assert reader.signer is None and reader.origin == "reader-only"
    laptop = make_machine(tmp_path, "laptop", team_bucket, files={"in.txt": "abc"}, trust=reader)
    hit = laptop.dispatch(upper_node(), upper)
    assert (hit.outcome, hit.decision.tag if hit.decision else None) == ("clean", "VerifiedHit")
    assert laptop.calls["upper"] == 0 and (laptop.ws / "out.txt").read_text() == "ABC"

    laptop.write("in.txt", "something else")
    built = laptop.dispatch(upper_node(), upper, run_id="r2")
    assert (built.outcome, built.published["shared"]) == ("built", "unpublished:unsigned")
    assert _objects(team_bucket) == published  # nothing new in the bucket


def test_a_shared_tier_whose_bucket_does_not_exist_is_refused_before_anything_runs_or_is_written(
    tmp_path: Path, s3_endpoint: str, s3_options: dict[str, str]
) -> None:
    bucket = "smthrs-absent-" + uuid.uuid4().hex[:8]
    absent = ArtifactStore(f"s3://{bucket}/cache", s3_options)
    ci = make_machine(tmp_path, "ci", absent, files={"in.txt": "abc"})

    with pytest.raises(CacheError) as refused:
        ci.dispatch(upper_node(), upper)
    err = refused.value
    assert err.code == "bucket_missing" and err.details["bucket"] == bucket
    assert f"aws s3 mb s3://{bucket} --endpoint-url {s3_endpoint}" in err.message
    assert ci.calls["upper"] == 0  # the body never ran
    assert not (ci.ws / "out.txt").exists()
    assert ci.provenance() == [] and ci.dispatcher.local.lookup(ci.request(upper_node()).key) is None
    assert not absent.fs.exists(bucket)  # and nothing created it

    # The same refusal at every dispatch until the bucket exists; then the tier works as always.
    with pytest.raises(CacheError, match="bucket_missing|does not exist"):
        ci.dispatch(upper_node(), upper)
    absent.fs.mkdir(bucket)
    done = ci.dispatch(upper_node(), upper)
    assert (done.outcome, done.published["shared"]) == ("built", "published")


def test_an_endpoint_that_does_not_answer_stays_a_passing_fault_of_the_shared_tier(tmp_path: Path) -> None:
    # A closed port: the bucket cannot be checked, so nothing is refused; the dispatch builds, the entry stays local.
    gone = ArtifactStore(
        "s3://smthrs-gone/cache",
        {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": "http://127.0.0.1:9",
            "config_kwargs": {"retries": {"max_attempts": 1}},
        },
    )
    ci = make_machine(tmp_path, "ci", gone, files={"in.txt": "abc"})
    res = ci.dispatch(upper_node(), upper)
    assert res.outcome == "built" and res.published["local"] == "published"
    assert res.published["shared"].startswith("unpublished:")
    assert [p["action"] for p in ci.provenance()][:1] == ["unavailable"]
