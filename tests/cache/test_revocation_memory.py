"""Revocations a writer of the bucket cannot undo, and markers that cannot break a reader — each sentence of the
threat model ("Trusting a shared cache") pinned by one test, as an attacker with write access to the bucket
would act: on file:// and s3:// (moto).

Machine "a" builds and publishes, an operator revokes, reader "b" sees the marker (any shared lookup that finds a
verified entry lists every marker), the attacker deletes the marker and puts the revoked — validly signed — entry
back; "c" is a reader with a fresh database that never saw the marker.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from _cache_support import Machine, make_machine, upper, upper_node
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin._clock import ManualClock
from smthrs_plugin.cache import UnverifiableEvidence, VerifiedHit
from smthrs_plugin.cache.entry import CacheEntry, decode_entry
from smthrs_plugin.cache.maintenance import revoke
from smthrs_plugin.cache.revocation import MAX_MARKER_BYTES, REVOCATION_FORMAT, Revocations, revocation_store
from smthrs_plugin.cache.shared import SharedTier
from smthrs_plugin.canonical import canonical_bytes, key_digest
from smthrs_plugin.plan.model import NodeDraft
from smthrs_plugin.records.revocation_rows import remembered
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import open_database
from smthrs_plugin.stores.schema import cache_revocations

#: Deadline of a helper process (far above what it needs on a busy machine).
PROCESS_TIMEOUT_S = 120
TEN_YEARS_MS = 10 * 365 * 86_400_000


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    """The shared tier on file:// and s3:// (stores another process can open too)."""
    if request.param == "file":
        return ArtifactStore((tmp_path / "bucket").as_uri())
    name = request.getfixturevalue("s3_bucket")
    return ArtifactStore(f"s3://{name}/cache", request.getfixturevalue("s3_options"))


@pytest.fixture
def cli() -> Any:
    from smthrs_plugin.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def lower(root: Path) -> dict[str, Any]:
    """reads in.txt, writes low.txt: an unrelated key whose shared hit makes a reader list every marker."""
    text = (root / "in.txt").read_text()
    (root / "low.txt").write_text(text.lower())
    return {"lowered": len(text)}


def lower_node() -> NodeDraft:
    return sp.plan.node("lower", body={"cmd": "lower"}, reads=["in.txt"], writes=["low.txt"])


def machine(base: Path, name: str, bucket: ArtifactStore, **kw: Any) -> Machine:
    return make_machine(base, name, bucket, files={"in.txt": "hello\n"}, **kw)


def refused(m: Machine, run_id: str) -> list[str]:
    return [p["reason"] for p in m.provenance(run_id) if p.get("action") == "refused"]


def markers(bucket: ArtifactStore) -> ArtifactStore:
    return revocation_store(bucket)


def plant(bucket: ArtifactStore, name: str, body: bytes) -> None:
    markers(bucket).put_entry(name, body)


def forged_marker(key: str, revoked_at_ms: int, entries: list[str] | None = None) -> bytes:
    return canonical_bytes(
        {
            "format": REVOCATION_FORMAT,
            "key": key,
            "revoked_at_ms": revoked_at_ms,
            "entries": entries or [],
            "by": "mallory",
            "reason": "",
        }
    )


def put_back(bucket: ArtifactStore, name: str, data: bytes) -> None:
    """The attacker restores a document it copied earlier (validly signed by the publisher)."""
    bucket.delete_entry(name)
    bucket.put_entry(name, data)


def sees_markers(b: Machine, run_id: str = "b-low") -> None:
    """A shared hit of an unrelated key: the reader lists (and remembers) every marker of the bucket."""
    assert b.dispatch(lower_node(), lower, run_id=run_id).decision == VerifiedHit("shared")


def seen_then_deleted(base: Path, bucket: ArtifactStore) -> tuple[Machine, Machine, str, str, bytes]:
    """a publishes upper and lower; an operator revokes upper; b sees the marker; the attacker deletes it.
    Returns (a, b, key, entry name, the revoked entry's bytes)."""
    a = machine(base, "a", bucket)
    built = a.dispatch(upper_node(), upper)
    a.dispatch(lower_node(), lower)
    name = a.entry_name(built.key)
    revoked = bucket.get_entry(name)
    assert revoked is not None
    marker = SharedTier(bucket).revocations.revoke(built.key, [], by="operator", reason="bad toolchain")
    b = machine(base, "b", bucket)
    sees_markers(b)
    assert [r.marker for r in remembered(b.db)] == [marker.name]
    markers(bucket).delete_entry(marker.name)  # the attacker
    assert markers(bucket).list_entries() == []
    return a, b, built.key, name, revoked


# -- cannot: un-revoke for a reader that has seen the marker ------------------------------------------------------


def test_a_marker_deleted_after_a_reader_saw_it_still_revokes_for_that_reader(
    tmp_path: Path, bucket: ArtifactStore
) -> None:
    _, b, key, _, _ = seen_then_deleted(tmp_path, bucket)
    res = b.dispatch(upper_node(), upper, run_id="b-up")
    assert (res.outcome, res.value, b.calls["upper"]) == ("built", {"length": 6}, 1)
    assert isinstance(res.decision, UnverifiableEvidence) and "revoked" in res.decision.reason
    assert refused(b, "b-up") == ["revoked"]
    assert res.key == key


def test_a_reader_with_a_fresh_database_that_never_saw_a_deleted_marker_serves_the_entry(
    tmp_path: Path, bucket: ArtifactStore
) -> None:
    # The stated limit: nobody signs the bucket's markers, so a marker deleted before a reader listed it is
    # unknown to that reader.
    seen_then_deleted(tmp_path, bucket)
    c = machine(tmp_path, "c", bucket)
    res = c.dispatch(upper_node(), upper, run_id="c-up")
    assert (res.outcome, res.decision, c.calls["upper"]) == ("clean", VerifiedHit("shared"), 0)
    assert remembered(c.db) == []


def test_a_deleted_marker_still_revokes_in_a_new_process_over_the_same_database(
    tmp_path: Path, bucket: ArtifactStore
) -> None:
    _, b, _, name, revoked = seen_then_deleted(tmp_path, bucket)
    key_file = tmp_path / "team" / ".smthrs" / "keys" / "cache-signing.key"
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import smthrs_plugin as sp\n"
        "from _cache_support import upper, upper_node\n"
        "from smthrs_plugin.cache.requests import node_request\n"
        "ws, db, url, opts = sys.argv[1:5]\n"
        "rt = sp.open_runtime(ws, db=db, artifacts=url, artifacts_options=json.loads(opts))\n"
        "seam = rt.dispatcher\n"
        "req = node_request(upper_node(), run_id='p-up', workspace=ws, measurer=seam.measurer)\n"
        "res = seam.dispatch(req, upper)\n"
        "print(json.dumps({'outcome': res.outcome, 'decision': res.decision.tag, 'why': str(res.decision)}))\n"
    )
    env = {**os.environ, "SMTHRS_CACHE_SIGNING_KEY": str(key_file)}
    env.pop("SMTHRS_CACHE_TRUSTED_KEYS", None)
    env.pop("SMTHRS_ARTIFACTS_BLOCK", None)
    opts = json.dumps(dict(bucket.storage_options))
    out = subprocess.run(
        [sys.executable, "-c", code, str(b.ws), b.db.url, bucket.url, opts],
        check=True,
        timeout=PROCESS_TIMEOUT_S,
        capture_output=True,
        text=True,
        env=env,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert (got["outcome"], got["decision"]) == ("built", "UnverifiableEvidence"), out.stderr
    assert "revoked" in got["why"]
    # The new process published its honest re-execution at that name; the attacker restores the revoked one
    # again, and the new process's revocation still holds (it read the same remembered row).
    put_back(bucket, name, revoked)
    fresh = Revocations(markers(bucket), memory=open_database(b.db.url))
    entry = decode_entry(revoked, name=name.split(".", 1)[0])
    assert isinstance(entry, CacheEntry) and fresh.revoking(entry, fresh=True) is not None


def test_a_marker_body_swapped_at_the_same_name_does_not_weaken_what_a_reader_remembers(
    tmp_path: Path, bucket: ArtifactStore
) -> None:
    a = machine(tmp_path, "a", bucket)
    built = a.dispatch(upper_node(), upper)
    a.dispatch(lower_node(), lower)
    entry = decode_entry(bucket.get_entry(a.entry_name(built.key)) or b"", name=key_digest(built.key))
    assert isinstance(entry, CacheEntry)
    marker = SharedTier(bucket).revocations.revoke(built.key, [], by="operator")
    b = machine(tmp_path, "b", bucket)
    sees_markers(b)
    markers(bucket).delete_entry(marker.name)
    plant(bucket, marker.name, forged_marker(built.key, 0))  # revokes nothing that exists, as written
    again = Revocations(markers(bucket), memory=b.db)  # as a new process over b's database
    found = again.revoking(entry, fresh=True)
    assert found is not None and found.remembered and found.name == marker.name


def test_entry_ids_named_by_a_remembered_marker_stay_revoked_whenever_they_were_created(
    tmp_path: Path, bucket: ArtifactStore
) -> None:
    # The publisher's clock runs an hour ahead: its entry looks created after the revocation, and only the entry
    # id the revoker named revokes it.
    a = machine(tmp_path, "a", bucket, clock=ManualClock(int(time.time() * 1000) + 3_600_000))
    built = a.dispatch(upper_node(), upper)
    a.dispatch(lower_node(), lower)
    report = revoke(a.dispatcher.local, SharedTier(bucket), "upper", by="operator")
    assert len(report.entries) == 1
    b = machine(tmp_path, "b", bucket)
    sees_markers(b)
    markers(bucket).delete_entry(report.markers[0])
    assert [r.entries for r in remembered(b.db)] == [report.entries]
    res = b.dispatch(upper_node(), upper, run_id="b-up")
    assert (res.outcome, refused(b, "b-up")) == ("built", ["revoked"])
    assert res.key == built.key


def test_smthrs_cache_revoke_remembers_its_revocation_in_the_local_database_at_once(
    tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore((tmp_path / "a" / "blobs").as_uri())
    a = make_machine(tmp_path, "a", store, files={"in.txt": "hello\n"}, one_store=True)
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(tmp_path / "team/.smthrs/keys/cache-signing.key"))
    monkeypatch.delenv("SMTHRS_CACHE_TRUSTED_KEYS", raising=False)
    built = a.dispatch(upper_node(), upper)
    opts = ["--db", a.db.url, "--artifacts", store.url, "--workspace", str(a.ws), "--json"]
    out = cli("cache", "revoke", built.key, *opts)
    assert out.exit_code == 0, out.output
    marker = json.loads(out.output)["markers"][0]
    assert [r.marker for r in remembered(a.db)] == [marker]
    markers(store).delete_entry(marker)  # the attacker; the signed entry itself is still in the bucket
    after = cli("cache", "verify", "--with-shared", *opts)
    assert after.exit_code == 1, after.output
    assert "revoked" in [p["kind"] for p in json.loads(after.output)["problems"]]


# -- cannot: make a forged future-dated marker revoke forever -----------------------------------------------------


def test_a_forged_future_dated_marker_is_remembered_capped_at_the_readers_first_sighting(
    tmp_path: Path, bucket: ArtifactStore
) -> None:
    clock = ManualClock(int(time.time() * 1000))
    t0 = clock.now_ms()
    a = machine(tmp_path, "a", bucket, clock=clock)
    a.dispatch(lower_node(), lower)
    key = a.request(upper_node()).key
    name = f"{key_digest(key)}.forged"
    plant(bucket, name, forged_marker(key, t0 + TEN_YEARS_MS))
    b = machine(tmp_path, "b", bucket, clock=clock)
    sees_markers(b)
    assert [(r.marker, r.revoked_at_ms, r.seen_at_ms) for r in remembered(b.db)] == [(name, t0, t0)]

    clock.advance(1)  # 1 s later: entries created now are after b saw the marker
    a.dispatch(upper_node(), upper)
    c = machine(tmp_path, "c", bucket, clock=clock)
    live = c.dispatch(upper_node(), upper, run_id="c-up")
    # While the marker is in the bucket it is honoured as written (an attacker can always cause re-runs) ...
    assert (live.outcome, refused(c, "c-up")) == ("built", ["revoked"])
    markers(bucket).delete_entry(name)
    # ... once it is gone, b's capped memory does not revoke what was created after b first saw it.
    res = b.dispatch(upper_node(), upper, run_id="b-up")
    assert (res.outcome, res.decision, b.calls["upper"]) == ("clean", VerifiedHit("shared"), 0)


# -- cannot: make planted junk permanent ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b'{"format": "smthrs-cache-revocation/1", "key": "key1_nope", "revoked_at_ms": 1, "entries": []}',
        b'{"format": "smthrs-cache-revocation/1", "revoked_at_ms": 1, "revoked_at_ms": 2}',
    ],
    ids=["not-json", "not-a-key", "duplicate-member"],
)
def test_a_malformed_marker_revokes_only_while_it_is_there_and_is_never_remembered(
    tmp_path: Path, bucket: ArtifactStore, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    a = machine(tmp_path, "a", bucket)
    built = a.dispatch(upper_node(), upper)
    a.dispatch(lower_node(), lower)
    name = f"{key_digest(built.key)}.junk"
    plant(bucket, name, body)
    b = machine(tmp_path, "b", bucket)
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.cache.revocation"):
        sees_markers(b)
    assert any(name in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    [junk] = b.dispatcher.shared.revocations.all()
    assert junk.problem is not None and junk.name == name
    assert remembered(b.db) == []
    markers(bucket).delete_entry(name)
    res = b.dispatch(upper_node(), upper, run_id="b-up")
    assert (res.outcome, res.decision, b.calls["upper"]) == ("clean", VerifiedHit("shared"), 0)


def test_a_remembered_row_that_does_not_decode_still_revokes_its_whole_key(
    tmp_path: Path, bucket: ArtifactStore, caplog: pytest.LogCaptureFixture
) -> None:
    _, b, key, name, revoked = seen_then_deleted(tmp_path, bucket)
    b.db.write(lambda c: c.execute(sa.update(cache_revocations).values(entries_json="{broken")))
    entry = decode_entry(revoked, name=key_digest(key))
    assert isinstance(entry, CacheEntry)
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.cache.revocation"):
        found = Revocations(markers(bucket), memory=b.db).revoking(entry, fresh=True)
    assert found is not None and found.problem is not None and found.remembered
    assert any("does not decode" in r.getMessage() for r in caplog.records)
    assert name.startswith(key_digest(key))


# -- cannot: make a reader crash, hang or exhaust memory -------------------------------------------------------------


def _deep() -> bytes:
    return b"[" * 100_000 + b"]" * 100_000  # 200 KB: recursion, not size


def _oversize() -> bytes:
    return b"[" + b"0," * (MAX_MARKER_BYTES // 2) + b"0]"


@pytest.mark.parametrize(
    ("kind", "problem"),
    [("deep", "depth"), ("oversize", "too_large"), ("fifo", "not a regular file")],
)
def test_a_hostile_marker_is_a_problem_never_an_exception_and_the_run_of_its_key_completes(
    tmp_path: Path, bucket: ArtifactStore, kind: str, problem: str
) -> None:
    a = machine(tmp_path, "a", bucket)
    built = a.dispatch(upper_node(), upper)
    b = machine(tmp_path, "b", bucket, revocation_refresh_s=0)  # every local hit re-lists the markers
    assert b.dispatch(upper_node(), upper, run_id="b-1").decision == VerifiedHit("shared")
    name = f"{key_digest(built.key)}.{kind}"
    if kind == "fifo":
        if not bucket.url.startswith("file://"):
            pytest.skip("a FIFO exists only on a local file system")
        path = Path(markers(bucket).entry_path(name))
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    else:
        plant(bucket, name, _deep() if kind == "deep" else _oversize())

    res = b.dispatch(upper_node(), upper, run_id="b-2")  # a LOCAL hit first: its revocation view re-lists
    assert (res.outcome, res.value, b.calls["upper"]) == ("built", {"length": 6}, 1)
    assert "revoked" in refused(b, "b-2")
    c = machine(tmp_path, "c", bucket)  # a fresh database: the shared lookup lists the marker
    assert c.dispatch(upper_node(), upper, run_id="c-1").outcome == "built"
    [hostile] = SharedTier(bucket).revocations.all()
    assert hostile.name == name and hostile.problem is not None and problem in hostile.problem
    assert remembered(b.db) == [] and remembered(c.db) == []


RUN_PLAN = """\
plan: revoked-run
nodes:
  - id: upper
    run: "mkdir -p out && tr a-z A-Z < src/in.txt > out/up.txt"
    reads: ["src/in.txt"]
    writes: ["out/"]
"""


def _smthrs_run(ws: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SMTHRS_")}
    return subprocess.run(
        [str(Path(sys.executable).with_name("smthrs")), "run", "plan.yaml", "--json"],
        cwd=ws,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
    )


def test_smthrs_run_of_a_key_with_a_deeply_nested_marker_re_executes_and_exits_0(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "in.txt").write_text("hello\n")
    (ws / "plan.yaml").write_text(RUN_PLAN)
    bucket = ArtifactStore((tmp_path / "bucket").as_uri())
    env = {"SMTHRS_ARTIFACTS_URL": bucket.url}
    first = _smthrs_run(ws, env)
    assert first.returncode == 0, first.stderr
    [settled] = json.loads(first.stdout)["settlements"]
    assert settled["outcome"] == "built"
    plant(bucket, f"{key_digest(settled['dispatch_key'])}.deep", _deep())

    again = _smthrs_run(ws, env)  # a new process: its local hit lists the markers first
    assert again.returncode == 0, again.stderr
    assert "RecursionError" not in again.stderr and "Traceback" not in again.stderr
    assert [s["outcome"] for s in json.loads(again.stdout)["settlements"]] == ["built"]
    assert (ws / "out" / "up.txt").read_text() == "HELLO\n"
