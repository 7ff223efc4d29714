"""Prefect blocks as configuration, against the session's real Prefect server and moto's real S3.

``SMTHRS_ARTIFACTS_BLOCK`` / ``open_runtime(artifacts_block=...)`` build the artifact store (and so the shared cache
tier) from a saved ``S3Bucket`` + ``AwsCredentials``; ``SMTHRS_CACHE_SIGNING_KEY_BLOCK`` reads the publisher key
from a ``Secret`` block. Every unusable block is a typed ``SettingsError`` naming it, raised before anything is
written; the local store is never used instead. Secret values appear in no error, repr, log or journal entry.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

import smthrs_plugin as sp
from smthrs_plugin.cache.signing import SigningKey, generate_key_pair, load_private_key
from smthrs_plugin.errors import SettingsError

pytestmark = [pytest.mark.s3, pytest.mark.prefect]

REPO = Path(__file__).resolve().parents[2]
FOLDER = "team/cache"
_SMTHRS_VARS = (
    "SMTHRS_ARTIFACTS_URL",
    "SMTHRS_ARTIFACTS_OPTIONS",
    "SMTHRS_ARTIFACTS_BLOCK",
    "SMTHRS_CACHE_SIGNING_KEY",
    "SMTHRS_CACHE_SIGNING_KEY_BLOCK",
    "SMTHRS_CACHE_TRUSTED_KEYS",
    "SMTHRS_WORKSPACE",
    "SMTHRS_DB_URL",
)


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Saved:
    """An S3Bucket block saved on the Prefect server, pointing at a moto bucket, with a distinctive secret."""

    ref: str
    bucket: str
    endpoint: str
    secret: str


@pytest.fixture(autouse=True)
def _clean_smthrs_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _SMTHRS_VARS:
        monkeypatch.delenv(var, raising=False)


def save_s3_bucket(bucket: str, endpoint: str, *, secret: str | None = None, **creds: Any) -> Saved:
    """Save an ``AwsCredentials`` block, then an ``S3Bucket`` block referencing it (the production pattern)."""
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    secret = secret if secret is not None else _name("s3cr3t")
    fields: dict[str, Any] = {
        "aws_access_key_id": "testing",
        "aws_secret_access_key": secret,
        "region_name": "us-east-1",
        "aws_client_parameters": AwsClientParameters(endpoint_url=endpoint),
        **creds,
    }
    creds_name = _name("moto-creds")
    AwsCredentials(**fields).save(creds_name)
    bucket_name = _name("team-cache")
    S3Bucket(bucket_name=bucket, bucket_folder=FOLDER, credentials=AwsCredentials.load(creds_name)).save(
        bucket_name
    )
    return Saved(f"s3-bucket/{bucket_name}", bucket, endpoint, secret)


def save_secret(value: str) -> str:
    from prefect.blocks.system import Secret

    name = _name("cache-key")
    Secret(value=value).save(name)
    return name


@pytest.fixture
def saved(s3_endpoint: str, s3_bucket: str) -> Saved:
    return save_s3_bucket(s3_bucket, s3_endpoint)


def bucket_objects(s: Saved) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(
        key="testing",
        secret="testing",
        endpoint_url=s.endpoint,
        skip_instance_cache=True,
        use_listings_cache=False,
    )
    return [str(p) for p in fs.find(s.bucket)]


# -- a one-node plan: the same in every workspace ---------------------------------------------------------------

PLAN = sp.plan.compile_plan(
    "blocks",
    "ci/blocks",
    [sp.plan.node("upper", body={"cmd": "upper"}, reads=["src/in.txt"], writes=["out/up.txt"])],
)


def seeded(ws: Path) -> Path:
    (ws / "src").mkdir(parents=True)
    (ws / "src/in.txt").write_text("shared by a block\n")
    return ws


class Upper:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, ni: sp.NodeInput) -> object:
        self.calls += 1
        (ni.root / "out").mkdir(exist_ok=True)
        (ni.root / "out/up.txt").write_text((ni.root / "src/in.txt").read_text().upper())
        return "upper"


# -- the docs/how-to/blocks.md example, run verbatim --------------------------------------------------------------------------

README_EXAMPLE = """
from prefect.blocks.system import Secret
from prefect_aws import AwsCredentials, S3Bucket
from prefect_aws.client_parameters import AwsClientParameters

import smthrs_plugin as sp
from smthrs_plugin.cache import generate_key_pair

# Once, by whoever administers the team's Prefect (or in the Prefect UI: Blocks -> S3 Bucket / Secret):
AwsCredentials(
    aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY, region_name="us-east-1",
    aws_client_parameters=AwsClientParameters(endpoint_url=ENDPOINT),  # omit on AWS itself
).save("team-s3", overwrite=True)
S3Bucket(
    bucket_name=BUCKET, bucket_folder="smthrs", credentials=AwsCredentials.load("team-s3")
).save("team-cache", overwrite=True)
key, pub, _ = generate_key_pair("ci-keys")                  # = smthrs cache keygen ci-keys
Secret(value=key.read_text()).save("cache-signing-key", overwrite=True)

# Every machine: name the blocks, nothing else (SMTHRS_ARTIFACTS_BLOCK / SMTHRS_CACHE_SIGNING_KEY_BLOCK).
with sp.open_runtime("ci", artifacts_block="s3-bucket/team-cache") as rt:
    print(rt.artifacts.url)                                  # s3://<BUCKET>/smthrs
    print(rt.dispatcher.trust.describe())                    # signing key <id>; trusted <id> (configured)
"""


def test_readme_blocks_example_runs(
    tmp_path: Path,
    s3_endpoint: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK", "cache-signing-key")
    given = {
        "ACCESS_KEY_ID": "testing",
        "SECRET_ACCESS_KEY": "testing",
        "ENDPOINT": s3_endpoint,
        "BUCKET": s3_bucket,
    }
    exec(compile(README_EXAMPLE, "docs/how-to/blocks.md", "exec"), dict(given))
    url, trust = capsys.readouterr().out.splitlines()
    key_id = load_private_key(tmp_path / "ci-keys/cache-signing.key").key_id
    assert url == f"s3://{s3_bucket}/smthrs"
    assert trust == f"signing key {key_id}; trusted {key_id} (configured)"


# -- the store ---------------------------------------------------------------------------------------------------


def test_an_s3_bucket_block_names_the_store_by_argument_and_by_SMTHRS_ARTIFACTS_BLOCK(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    with sp.open_runtime(tmp_path / "a", artifacts_block=saved.ref) as rt:
        assert rt.artifacts.url == f"s3://{saved.bucket}/{FOLDER}"
        assert rt.artifacts.storage_options == {
            "key": "testing",
            "secret": saved.secret,
            "endpoint_url": saved.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }
        digest = rt.artifacts.put_bytes(b"written through the block\n")
    # The bytes are in the block's bucket, under its folder: the block is the store, not a description of one.
    assert [p for p in bucket_objects(saved) if digest[2:] in p][0].startswith(f"{saved.bucket}/{FOLDER}/")

    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", saved.ref)
    with sp.open_runtime(tmp_path / "b") as rt:
        assert rt.artifacts.url == f"s3://{saved.bucket}/{FOLDER}"
        assert rt.artifacts.get_bytes(digest) == b"written through the block\n"
    assert not (tmp_path / "b" / ".smthrs" / "artifacts").exists()  # never the local default


def test_explicit_storage_options_are_laid_over_the_blocks(tmp_path: Path, saved: Saved) -> None:
    with sp.open_runtime(tmp_path, artifacts_block=saved.ref, artifacts_options={"use_ssl": False}) as rt:
        assert rt.artifacts.storage_options["use_ssl"] is False
        assert rt.artifacts.storage_options["endpoint_url"] == saved.endpoint


def test_an_argument_beats_the_environment_whichever_it_names(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_ARTIFACTS_URL", (tmp_path / "env-store").as_uri())
    with sp.open_runtime(tmp_path / "ws", artifacts_block=saved.ref) as rt:
        assert rt.artifacts.url == f"s3://{saved.bucket}/{FOLDER}"
    monkeypatch.delenv("SMTHRS_ARTIFACTS_URL")
    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", saved.ref)
    explicit = (tmp_path / "explicit").as_uri()
    with sp.open_runtime(tmp_path / "ws", artifacts=explicit) as rt:
        assert rt.artifacts.url == explicit


def test_a_remote_file_system_block_is_an_fsspec_url_and_its_settings(
    tmp_path: Path, s3_bucket: str, s3_options: dict[str, str]
) -> None:
    from prefect.filesystems import RemoteFileSystem

    name = _name("rfs")
    RemoteFileSystem(basepath=f"s3://{s3_bucket}/rfs/", settings=s3_options).save(name)
    with sp.open_runtime(tmp_path, artifacts_block=f"remote-file-system/{name}") as rt:
        assert rt.artifacts.url == f"s3://{s3_bucket}/rfs"
        assert rt.artifacts.storage_options == s3_options
        assert rt.artifacts.get_bytes(rt.artifacts.put_bytes(b"x")) == b"x"


# -- the shared tier ---------------------------------------------------------------------------------------------


def test_two_workspaces_configured_only_by_blocks_share_the_cache_tier_signed_with_a_key_from_a_secret_block(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, key = generate_key_pair(tmp_path / "keys")
    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", saved.ref)

    # Machine A publishes with the key held by a Secret block (bare name: the `secret/` type is implied).
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK", save_secret(key.pem().decode()))
    built = Upper()
    with sp.open_runtime(seeded(tmp_path / "a")) as rt:
        assert rt.dispatcher.trust.signer is not None and rt.dispatcher.trust.signer.key_id == key.key_id
        assert rt.dispatcher.trust.origin == "configured"
        report = rt.scheduler("a1").run(PLAN, built)
    assert [(s.node, s.outcome) for s in report.settlements] == [("upper", "built")] and built.calls == 1
    entries = [p for p in bucket_objects(saved) if "/ac/" in p]
    assert len(entries) == 1 and entries[0].endswith(f".{key.key_id}.json")

    # Machine B: a fresh workspace and database, the same block, A's public key trusted (the existing trust setup).
    monkeypatch.delenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK")
    monkeypatch.setenv("SMTHRS_CACHE_TRUSTED_KEYS", key.public.b64())
    served = Upper()
    with sp.open_runtime(seeded(tmp_path / "b")) as rt:
        report = rt.scheduler("b1").run(PLAN, served)
    assert [(s.node, s.outcome, s.cache_decision) for s in report.settlements] == [
        ("upper", "clean", "VerifiedHit")
    ]
    assert served.calls == 0
    assert (tmp_path / "b/out/up.txt").read_bytes() == (tmp_path / "a/out/up.txt").read_bytes()


PLAN_FILE = """\
plan: blocks-cli
flow: ci/blocks-cli
nodes:
  - id: upper
    run: "mkdir -p out && tr a-z A-Z < src/in.txt > out/up.txt"
    reads: ["src/in.txt"]
    writes: ["out/"]
"""


def _smthrs(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in _SMTHRS_VARS}
    return subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", *args],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_smthrs_run_with_only_SMTHRS_ARTIFACTS_BLOCK_set_publishes_to_and_serves_from_the_blocks_store(
    tmp_path: Path, saved: Saved
) -> None:
    _, _, key = generate_key_pair(tmp_path / "keys")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN_FILE)
    block = {"SMTHRS_ARTIFACTS_BLOCK": saved.ref}
    a = _smthrs(
        "run", str(plan), "--workspace", str(seeded(tmp_path / "a")), "--json",
        env={**block, "SMTHRS_CACHE_SIGNING_KEY_BLOCK": f"secret/{save_secret(key.pem().decode())}"},
        cwd=tmp_path,
    )  # fmt: skip
    assert a.returncode == 0, a.stderr
    assert [s["outcome"] for s in json.loads(a.stdout)["settlements"]] == ["built"]
    b = _smthrs(
        "run", str(plan), "--workspace", str(seeded(tmp_path / "b")), "--json",
        env={**block, "SMTHRS_CACHE_TRUSTED_KEYS": key.public.b64()},
        cwd=tmp_path,
    )  # fmt: skip
    assert b.returncode == 0, b.stderr
    assert [(s["outcome"], s["cache_decision"]) for s in json.loads(b.stdout)["settlements"]] == [
        ("clean", "VerifiedHit")
    ]
    assert (tmp_path / "b/out/up.txt").read_text() == "SHARED BY A BLOCK\n"
    assert saved.secret not in a.stdout + a.stderr + b.stdout + b.stderr


def test_smthrs_run_with_an_unknown_block_exits_2_naming_it_and_writes_nothing(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN_FILE)
    missing = f"s3-bucket/{_name('no-such')}"
    out = _smthrs(
        "run", str(plan), "--workspace", str(tmp_path / "ws"), "--json",
        env={"SMTHRS_ARTIFACTS_BLOCK": missing}, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    error = json.loads(out.stdout)["error"]
    assert (error["family"], error["code"], error["reason"], error["block"]) == (
        "settings",
        "invalid_setting",
        "not_found",
        missing,
    )
    assert not (tmp_path / "ws").exists()


def test_smthrs_cache_ls_with_shared_lists_the_blocks_shared_tier(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = seeded(tmp_path / "a")
    # A publisher: the bucket is written only with a configured key.
    key, _, _ = generate_key_pair(tmp_path / "keys")
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(key))
    with sp.open_runtime(ws, artifacts_block=saved.ref) as rt:
        rt.scheduler("a1").run(PLAN, Upper())
    out = _smthrs(
        "cache", "ls", "--with-shared", "--workspace", str(ws), "--json",
        env={"SMTHRS_ARTIFACTS_BLOCK": saved.ref, "SMTHRS_CACHE_SIGNING_KEY": str(key)}, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [e["tier"] for e in json.loads(out.stdout)["entries"]].count("shared") == 1


@sp.step(reads=["src/in.txt"], writes=["out/step.txt"])
def shout(ws: sp.Workspace) -> int:
    text = (ws / "src/in.txt").read_text().upper()
    (ws / "out").mkdir(exist_ok=True)
    (ws / "out/step.txt").write_text(text)
    return len(text)


@flow(persist_result=False)
def shouting() -> int:
    return int(shout())


def test_a_step_in_a_flow_with_only_SMTHRS_ARTIFACTS_BLOCK_set_publishes_to_the_blocks_store(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", saved.ref)
    monkeypatch.setenv("SMTHRS_WORKSPACE", str(seeded(tmp_path / "a")))
    # A publisher: the bucket is written only with a configured key.
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(generate_key_pair(tmp_path / "keys")[0]))
    assert shouting() == len("shared by a block\n")
    assert len([p for p in bucket_objects(saved) if f"{FOLDER}/ac/" in p]) == 1
    assert not (tmp_path / "a/.smthrs/artifacts").exists()


# -- refusals: typed, naming the block, nothing written ----------------------------------------------------------


def refused(ws: Path, **kwargs: Any) -> SettingsError:
    with pytest.raises(SettingsError) as info:
        sp.open_runtime(ws, **kwargs)
    assert not ws.exists(), f"{ws} was written before the refusal"
    return info.value


def test_an_unknown_block_is_refused_naming_it_and_nothing_is_written(tmp_path: Path, saved: Saved) -> None:
    missing = f"s3-bucket/{_name('no-such')}"
    err = refused(tmp_path / "ws", artifacts_block=missing)
    assert (err.code, err.details["reason"], err.details["block"]) == (
        "invalid_setting",
        "not_found",
        missing,
    )
    assert missing.split("/")[1] in err.message and "prefect block ls" in err.message
    assert bucket_objects(saved) == []


def test_a_block_of_the_wrong_type_is_refused(tmp_path: Path) -> None:
    ref = f"secret/{save_secret('not a store')}"
    err = refused(tmp_path / "ws", artifacts_block=ref)
    assert (err.details["reason"], err.details["block"]) == ("wrong_type", ref)
    assert "s3-bucket" in err.message


def test_a_malformed_block_name_is_refused_without_asking_prefect(tmp_path: Path) -> None:
    err = refused(tmp_path / "ws", artifacts_block="team-cache")
    assert err.details["reason"] == "invalid_name" and "<block type slug>/<block name>" in err.message


def test_a_url_and_a_block_at_the_same_level_are_refused(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = (tmp_path / "store").as_uri()
    err = refused(tmp_path / "ws", artifacts=url, artifacts_block=saved.ref)
    assert err.details["reason"] == "conflict" and url in err.message
    monkeypatch.setenv("SMTHRS_ARTIFACTS_URL", url)
    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", saved.ref)
    err = refused(tmp_path / "ws")
    assert err.details["reason"] == "conflict" and "SMTHRS_ARTIFACTS_URL" in err.message
    assert not (tmp_path / "store").exists()


def test_an_unreachable_prefect_api_is_a_typed_error_naming_the_block(tmp_path: Path, saved: Saved) -> None:
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    with temporary_settings({PREFECT_API_URL: down}):
        err = refused(tmp_path / "ws", artifacts_block=saved.ref)
    assert (err.details["reason"], err.details["block"]) == ("unreachable", saved.ref)
    assert down in err.message and "never falls back" in err.message


def test_incomplete_credentials_are_refused(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    half = save_s3_bucket(s3_bucket, s3_endpoint, aws_access_key_id=None)
    err = refused(tmp_path / "ws", artifacts_block=half.ref)
    assert err.details["reason"] == "missing_credentials" and "access key id" in err.message
    assert half.secret not in str(err)


def test_a_stored_block_that_no_longer_validates_is_refused_without_echoing_its_values(
    tmp_path: Path, saved: Saved
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import BlockDocumentUpdate

    slug, name = saved.ref.split("/")
    with get_client(sync_client=True) as client:  # e.g. saved by another version of the block's package
        doc = client.read_block_document_by_name(name, slug, include_secrets=True)
        data = {**doc.data, "bucket_name": {"not": "a string"}}
        client.update_block_document(doc.id, BlockDocumentUpdate(data=data, merge_existing_data=False))
    err = refused(tmp_path / "ws", artifacts_block=saved.ref)
    assert err.details["reason"] == "invalid_block" and "bucket_name" in err.message
    assert saved.secret not in "".join(traceback.format_exception(err)) + json.dumps(err.to_dict())


def test_an_assume_role_the_store_cannot_honour_is_refused(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str
) -> None:
    role = save_s3_bucket(s3_bucket, s3_endpoint, assume_role_arn="arn:aws:iam::123456789012:role/cache")
    err = refused(tmp_path / "ws", artifacts_block=role.ref)
    assert err.details["reason"] == "unsupported" and "assume_role_arn" in err.message


def test_a_signing_key_block_that_cannot_be_used_is_refused_before_anything_is_written(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK", _name("no-such-key"))
    err = refused(tmp_path / "ws", artifacts_block=saved.ref)
    assert (err.details["reason"], err.details["setting"]) == ("not_found", "SMTHRS_CACHE_SIGNING_KEY_BLOCK")

    garbage = _name("not-a-key-value")
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK", save_secret(garbage))
    err = refused(tmp_path / "ws", artifacts_block=saved.ref)
    assert err.details["reason"] == "invalid_block" and garbage not in str(err)
    assert garbage not in "".join(traceback.format_exception(err))

    priv, _, _ = generate_key_pair(tmp_path / "keys")
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(priv))
    err = refused(tmp_path / "ws", artifacts_block=saved.ref)
    assert err.details["reason"] == "conflict" and "SMTHRS_CACHE_SIGNING_KEY" in err.message
    assert bucket_objects(saved) == []


# -- secrets -----------------------------------------------------------------------------------------------------


@pytest.fixture
def all_logs() -> Iterator[list[str]]:
    """Every log record of every logger (DEBUG included), formatted with its arguments."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    root, handler = logging.getLogger(), Collect(logging.DEBUG)
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


def test_block_secrets_never_appear_in_reprs_errors_logs_or_the_journal(
    tmp_path: Path, saved: Saved, monkeypatch: pytest.MonkeyPatch, all_logs: list[str]
) -> None:
    _, _, key = generate_key_pair(tmp_path / "keys")
    pem = key.pem().decode()
    monkeypatch.setenv("SMTHRS_ARTIFACTS_BLOCK", saved.ref)
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK", save_secret(pem))
    secrets = (saved.secret, pem.splitlines()[1])
    seen: list[str] = []
    with sp.open_runtime(seeded(tmp_path / "a")) as rt:
        report = rt.scheduler("s1").run(PLAN, Upper())
        location = rt.settings.artifacts_location()
        signer: SigningKey | None = rt.dispatcher.trust.signer
        seen += [
            repr(rt),
            repr(rt.settings),
            repr(rt.artifacts),
            repr(location),
            repr(signer),
            str(rt.settings),
        ]
        seen += [json.dumps(e.payload, default=str) for e in rt.journal.read("s1")]
        seen.append(json.dumps(report.to_json(), default=str))
    assert location.options["secret"] == saved.secret  # it is there, only never shown
    # Refusals built from the same blocks.
    monkeypatch.delenv("SMTHRS_CACHE_SIGNING_KEY_BLOCK")
    for bad in (
        save_s3_bucket(saved.bucket, saved.endpoint, secret=saved.secret, aws_access_key_id=None).ref,
        f"secret/{save_secret(saved.secret)}",
    ):
        err = refused(tmp_path / "ws", artifacts_block=bad)
        seen += [str(err), repr(err), json.dumps(err.to_dict()), "".join(traceback.format_exception(err))]
    seen += all_logs
    text = "\n".join(seen)
    for secret in secrets:
        assert secret not in text
    assert saved.ref in text  # the block itself is named
