"""``smthrs doctor``: one row per check in a fixed order; exit 0 when nothing failed, 2 when a failed check is a
configuration problem (its fix is a change), 75 when a dependency did not answer; each failing row names its fix.
Real parts: a moto S3 server, SQLite files, closed ports for a database server and a Prefect API that do not answer.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from smthrs_plugin.cache.signing import generate_key_pair
from smthrs_plugin.cli import app
from smthrs_plugin.stores.database import open_database

CHECKS = [
    "database",
    "workspace",
    "shared tier",
    "bucket",
    "store probe",
    "signing key",
    "trusted keys",
    "publishing",
    "isolation",
    "prefect api",
    "prefect startup timeout",
]
_CLEARED = (
    "SMTHRS_WORKSPACE",
    "SMTHRS_DB_URL",
    "SMTHRS_ARTIFACTS_URL",
    "SMTHRS_ARTIFACTS_BLOCK",
    "SMTHRS_ARTIFACTS_OPTIONS",
    "SMTHRS_CACHE_SIGNING_KEY",
    "SMTHRS_CACHE_SIGNING_KEY_BLOCK",
    "SMTHRS_CACHE_TRUSTED_KEYS",
    "SMTHRS_ISOLATION",
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
)
HEAVY = ("prefect", "pandas", "numpy", "pyarrow", "fastapi", "uvicorn", "s3fs", "sqlalchemy", "cryptography")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    d = tmp_path / "ws"
    d.mkdir()
    return d


def _doctor(ws: Path, monkeypatch: pytest.MonkeyPatch, *extra: str, **env: str) -> tuple[int, dict[str, Any]]:
    """``smthrs doctor --json`` over ``ws`` with only ``env`` configured; (exit code, the JSON object)."""
    for var in _CLEARED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    # The doctor runs in this process, where an earlier test may have pointed Prefect's settings at the session's
    # server: only what this test configures may name a Prefect API.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        result = CliRunner().invoke(app, ["doctor", "--workspace", str(ws), "--timeout", "30", "--json", *extra])
    out = json.loads(result.stdout)
    assert list(out) == ["checks", "ok"] and out["ok"] is (result.exit_code == 0), result.output
    assert [row["check"] for row in out["checks"]] == CHECKS
    for row in out["checks"]:
        assert sorted(row) == ["check", "detail", "fix", "status"] and row["status"] in ("ok", "warn", "fail")
        assert row["status"] == "ok" or row["fix"], row  # every warning and failure names its fix
    return result.exit_code, out


def _row(out: dict[str, Any], check: str) -> dict[str, str]:
    return next(r for r in out["checks"] if r["check"] == check)


def _failed(out: dict[str, Any]) -> list[str]:
    return [r["check"] for r in out["checks"] if r["status"] == "fail"]


def _s3_env(bucket: str, s3_options: dict[str, str]) -> dict[str, str]:
    return {
        "SMTHRS_ARTIFACTS_URL": f"s3://{bucket}/cache",
        "SMTHRS_ARTIFACTS_OPTIONS": json.dumps(s3_options),
    }


@pytest.mark.s3
def test_a_healthy_team_workspace_passes_every_check_and_exits_0_with_one_json_object(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_bucket: str, s3_options: dict[str, str]
) -> None:
    open_database(f"sqlite:///{(ws / '.smthrs' / 'state.db').as_posix()}").close()
    key, pub, signing = generate_key_pair(tmp_path / "keys")
    code, out = _doctor(
        ws,
        monkeypatch,
        **_s3_env(s3_bucket, s3_options),
        SMTHRS_CACHE_SIGNING_KEY=str(key),
        SMTHRS_CACHE_TRUSTED_KEYS=str(pub),
    )
    assert (code, out["ok"], _failed(out)) == (0, True, [])
    statuses = {r["check"]: r["status"] for r in out["checks"]}
    assert statuses.pop("isolation") in ("ok", "warn")  # a kernel that refuses namespaces warns, never fails
    assert set(statuses.values()) == {"ok"}, out
    assert "schema at head" in _row(out, "database")["detail"]
    assert _row(out, "shared tier")["detail"] == f"s3://{s3_bucket}/cache"
    assert signing.key_id in _row(out, "signing key")["detail"]
    assert signing.public.b64() in _row(out, "signing key")["detail"]  # its public key, for the readers
    assert _row(out, "publishing")["detail"].startswith("publishes to")
    assert _row(out, "prefect api")["detail"].startswith("ephemeral")
    assert _row(out, "prefect startup timeout")["detail"].startswith("180 s")
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options)
    assert fs.find(f"{s3_bucket}/cache/doctor") == []  # the probe deleted what it wrote


@pytest.mark.s3
def test_a_missing_bucket_fails_with_the_command_that_creates_it_and_exits_2(
    ws: Path, monkeypatch: pytest.MonkeyPatch, s3_endpoint: str, s3_options: dict[str, str]
) -> None:
    bucket = "smthrs-absent-" + uuid.uuid4().hex[:8]
    code, out = _doctor(ws, monkeypatch, **_s3_env(bucket, s3_options))
    assert (code, _failed(out)) == (2, ["bucket"])
    assert _row(out, "bucket")["fix"].startswith(
        f"create the bucket: aws s3 mb s3://{bucket} --endpoint-url {s3_endpoint}"
    )
    assert _row(out, "store probe")["status"] == "warn"  # not run against a bucket that is not there
    # No publishing key on a shared tier: this machine reads only, and says what to do about it.
    assert _row(out, "publishing")["detail"].startswith("reads only")
    assert _row(out, "trusted keys")["status"] == "warn"


@pytest.mark.parametrize("which", ["unparsable signing key", "unparsable trusted key"])
def test_a_key_that_does_not_parse_fails_its_row_with_keygen_as_the_fix_and_exits_2(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    junk = tmp_path / "junk.key"
    junk.write_text("not a key\n")
    var, check = (
        ("SMTHRS_CACHE_SIGNING_KEY", "signing key")
        if which == "unparsable signing key"
        else ("SMTHRS_CACHE_TRUSTED_KEYS", "trusted keys")
    )
    code, out = _doctor(ws, monkeypatch, **{var: str(junk)})
    assert (code, _failed(out)) == (2, [check])
    assert str(junk) in _row(out, check)["detail"]
    assert "SMTHRS_CACHE_" in _row(out, check)["fix"]


def test_a_signing_key_the_trusted_list_does_not_name_is_a_warning_naming_the_public_key_to_add(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, _, signing = generate_key_pair(tmp_path / "mine")
    _, other_pub, _ = generate_key_pair(tmp_path / "other")
    code, out = _doctor(
        ws, monkeypatch, SMTHRS_CACHE_SIGNING_KEY=str(key), SMTHRS_CACHE_TRUSTED_KEYS=str(other_pub)
    )
    assert code == 0
    row = _row(out, "trusted keys")
    assert row["status"] == "warn" and signing.key_id in row["detail"] and signing.public.b64() in row["fix"]


@pytest.mark.parametrize("where", ["unreachable PostgreSQL", "unwritable SQLite path"])
def test_no_database_fails_the_database_row_naming_smthrs_db_url(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    if where == "unreachable PostgreSQL":
        url, expected = f"postgresql+psycopg://smthrs@127.0.0.1:{_closed_port()}/smthrs", 75  # may come back
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        url, expected = f"sqlite:///{(blocker / 'state.db').as_posix()}", 2  # can never be created there
    code, out = _doctor(ws, monkeypatch, SMTHRS_DB_URL=url)
    assert (code, _failed(out)) == (expected, ["database"])
    assert "SMTHRS_DB_URL" in _row(out, "database")["fix"]
    assert not (tmp_path / "a-file" / "state.db").exists()


def test_a_prefect_api_that_does_not_answer_fails_and_exits_75(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = f"http://127.0.0.1:{_closed_port()}/api"
    code, out = _doctor(ws, monkeypatch, PREFECT_API_URL=api)
    assert (code, _failed(out)) == (75, ["prefect api"])
    row = _row(out, "prefect api")
    assert f"{api}/health" in row["detail"] and "PREFECT_API_URL" in row["fix"]
    assert _row(out, "prefect startup timeout")["detail"].startswith("not used")


def test_a_configuration_failure_outranks_an_unavailable_dependency_in_the_exit_code(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    junk = tmp_path / "junk.key"
    junk.write_text("not a key\n")
    code, out = _doctor(
        ws,
        monkeypatch,
        PREFECT_API_URL=f"http://127.0.0.1:{_closed_port()}/api",
        SMTHRS_CACHE_SIGNING_KEY=str(junk),
    )
    assert (code, _failed(out)) == (2, ["signing key", "prefect api"])


def test_a_short_ephemeral_startup_timeout_warns_and_names_the_variable(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = _doctor(ws, monkeypatch, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="20")
    assert code == 0
    row = _row(out, "prefect startup timeout")
    assert row["status"] == "warn" and row["detail"].startswith("20 s")
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=180" in row["fix"]


def test_a_fresh_workspace_is_checked_without_creating_a_database_or_a_key(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = _doctor(ws, monkeypatch)
    assert code == 0 and "does not exist yet" in _row(out, "database")["detail"]
    assert list(ws.iterdir()) == []  # no state directory, database, key or probe left behind


def test_the_text_table_names_each_fix_under_its_row(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in _CLEARED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{_closed_port()}/api")
    result = CliRunner().invoke(app, ["doctor", "--workspace", str(ws), "--timeout", "30"])
    assert result.exit_code == 75
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "DETAIL"]
    at = next(i for i, line in enumerate(lines) if line.startswith("prefect api "))
    assert lines[at].split()[2] == "fail" and lines[at + 1].strip().startswith("fix: start the server")


def test_doctor_help_in_a_fresh_process_loads_no_heavy_library() -> None:
    probe = (
        "import json, sys\nfrom smthrs_plugin.cli import main\nsys.argv = ['smthrs', 'doctor', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stderr.strip().splitlines()[-1]))
    assert sorted(loaded & set(HEAVY)) == []
