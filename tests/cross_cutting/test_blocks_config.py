"""Prefect blocks as configuration, the parts that never reach Prefect.

Naming a block must not make smthrs import Prefect until a store is actually opened from it: ``import
smthrs_plugin``, ``smthrs --help``, loading settings and an explicit URL that overrides the block stay Prefect-free.
A URL-only caller can never quietly use the local store while a block is in effect. The server-backed behaviour
(loading S3Bucket/Secret blocks, refusals, the shared tier) is in ``tests/prefect/test_blocks.py`` (a separate basename: pytest imports both as top-level modules).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smthrs_plugin._blocks import ArtifactLocation
from smthrs_plugin.errors import SettingsError
from smthrs_plugin.settings import load_settings

PROBE = """
import json, sys
from pathlib import Path
import smthrs_plugin as sp
from smthrs_plugin.settings import load_settings
out = {{"block": load_settings().effective_artifacts_block}}
with sp.open_runtime({ws!r}, artifacts={url!r}) as rt:
    out["url"] = rt.artifacts.url
out["prefect"] = sorted(m for m in sys.modules if m == "prefect" or m.startswith("prefect."))[:3]
print(json.dumps(out))
"""

HELP = """
import sys
from smthrs_plugin.cli import app
try:
    app(["--help"])
except SystemExit:
    pass
print("PREFECT" if any(m == "prefect" or m.startswith("prefect.") for m in sys.modules) else "CLEAN")
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMTHRS_")}
    # An API nobody serves: had anything asked Prefect, it would have failed loudly rather than passed quietly.
    return {**env, "PREFECT_API_URL": "http://127.0.0.1:9/api", **extra}


def test_naming_a_block_imports_no_prefect_until_a_store_is_opened_from_it(tmp_path: Path) -> None:
    url = (tmp_path / "explicit").as_uri()
    p = subprocess.run(
        [sys.executable, "-c", PROBE.format(ws=str(tmp_path / "ws"), url=url)],
        env=_env(SMTHRS_ARTIFACTS_BLOCK="s3-bucket/team-cache"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    # The explicit URL argument wins over the variable, and the block is never loaded (Prefect never imported).
    assert json.loads(p.stdout) == {"block": "s3-bucket/team-cache", "url": url, "prefect": []}


def test_smthrs_help_imports_no_prefect_with_a_block_configured() -> None:
    p = subprocess.run(
        [sys.executable, "-c", HELP],
        env=_env(SMTHRS_ARTIFACTS_BLOCK="s3-bucket/team-cache", SMTHRS_CACHE_SIGNING_KEY_BLOCK="cache-key"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "CLEAN"


def test_a_url_only_caller_is_refused_while_a_block_is_in_effect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SMTHRS_ARTIFACTS_URL", raising=False)
    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", "s3-bucket/team-cache")
    s = load_settings(workspace=tmp_path)
    with pytest.raises(SettingsError) as info:
        _ = s.resolved_artifacts_url  # never the local default instead of the block's store
    assert (info.value.details["reason"], info.value.details["block"]) == (
        "unsupported",
        "s3-bucket/team-cache",
    )
    # An explicit URL argument clears the block; an explicit block argument clears a URL variable.
    url = (tmp_path / "x").as_uri()
    assert load_settings(workspace=tmp_path, artifacts_url=url).resolved_artifacts_url == url
    monkeypatch.setenv("SMTHRS_ARTIFACTS_URL", url)
    s = load_settings(workspace=tmp_path, artifacts_block="s3-bucket/other")
    assert (s.artifacts_url, s.effective_artifacts_block) == (None, "s3-bucket/other")


def test_a_url_and_a_block_given_together_are_refused_before_prefect_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SMTHRS_ARTIFACTS_BLOCK", raising=False)
    with pytest.raises(SettingsError) as info:
        load_settings(artifacts_url="s3://b/x", artifacts_block="s3-bucket/team-cache")
    assert info.value.details["reason"] == "conflict"
    monkeypatch.setenv("SMTHRS_ARTIFACTS_URL", "s3://b/x")
    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", "s3-bucket/team-cache")
    with pytest.raises(SettingsError) as info:
        load_settings(workspace=tmp_path).artifacts_location()
    assert info.value.details["reason"] == "conflict" and "SMTHRS_ARTIFACTS_URL" in info.value.message


@pytest.mark.parametrize("name", ["team-cache", "s3-bucket/", "/team-cache", "S3 Bucket/x", "a/b/c"])
def test_a_malformed_block_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(workspace=tmp_path, artifacts_block=name).artifacts_location()
    assert info.value.details["reason"] == "invalid_name" and "s3-bucket/team-cache" in info.value.message


def test_an_artifact_location_never_shows_its_storage_options() -> None:
    loc = ArtifactLocation("s3://b/x", {"key": "AKID", "secret": "do-not-print"}, "s3-bucket/team-cache")
    assert "do-not-print" not in repr(loc) and "s3-bucket/team-cache" in repr(loc)
