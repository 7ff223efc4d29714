"""gc keeps referenced blobs and respects its grace period; verify reports a tampered blob; the CLI commands."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from _cache_support import make_machine, tamper, upper, upper_node
from typer.testing import CliRunner

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.boundary import referenced_digests
from smthrs_plugin.boundary.evidence import Evidence, Output, diff_identity
from smthrs_plugin.cache.entry import CacheEntry, check_cacheable
from smthrs_plugin.cache.local import LocalTier, row_key_of
from smthrs_plugin.cache.maintenance import gc, verify
from smthrs_plugin.cache.shared import SharedTier
from smthrs_plugin.canonical import key
from smthrs_plugin.engine.ownership.arbiter import Ownership
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.settings import load_settings
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import Database


def test_gc_keeps_referenced_and_young_blobs_and_deletes_old_garbage(
    tmp_path: Path, shared: ArtifactStore
) -> None:
    m = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"})
    built = m.dispatch(upper_node(), upper)
    (referenced,) = referenced_digests(built.evidence)
    local_garbage = m.artifacts.put_bytes(b"nobody references me")
    shared_garbage = shared.put_bytes(b"orphan in the shared tier")
    tier = SharedTier(shared)

    now = gc(
        m.dispatcher.local, m.artifacts, tier, grace_s=3600
    )  # everything is younger than the grace period
    assert now.deleted_blobs == () and now.kept_young == 2
    later = ManualClock(int(time.time() * 1000) + 2 * 3600 * 1000)  # two hours on: the garbage is old
    dry = gc(m.dispatcher.local, m.artifacts, tier, grace_s=3600, dry_run=True, clock=later)
    assert sorted(dry.deleted_blobs) == sorted([local_garbage, shared_garbage])
    assert m.artifacts.has(local_garbage)  # a dry run deletes nothing

    report = gc(m.dispatcher.local, m.artifacts, tier, grace_s=3600, clock=later)
    assert sorted(report.deleted_blobs) == sorted([local_garbage, shared_garbage])
    assert not m.artifacts.has(local_garbage) and not shared.has(shared_garbage)
    assert m.artifacts.has(referenced) and shared.has(referenced)  # referenced by the local row and the entry
    (m.ws / "out.txt").unlink()
    assert m.dispatch(upper_node(), upper).outcome == "clean"  # the entry still replays after gc


def _age(store: ArtifactStore, digest: str, seconds: float) -> None:
    """Make a local blob look ``seconds`` old (gc reads the store's modification time)."""
    path = store.blob_path(digest)
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_gc_collects_an_old_invalidated_row_and_then_its_blob(tmp_path: Path) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    m = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"})
    built = m.dispatch(upper_node(), upper, publish_shared=False, consult_shared=False)
    (digest,) = referenced_digests(built.evidence)
    m.dispatcher.local.invalidate(m.dispatcher.local.rows()[0].key_digest)
    _age(m.artifacts, digest, 7200)
    assert (
        gc(m.dispatcher.local, m.artifacts, SharedTier(shared), grace_s=3600).deleted_rows == ()
    )  # invalidated just now
    report = gc(m.dispatcher.local, m.artifacts, SharedTier(shared), grace_s=0)
    assert len(report.deleted_rows) == 1 and report.deleted_blobs == (digest,)
    assert m.dispatcher.local.rows() == []


def _run_local_entry(run_id: str) -> CacheEntry:
    outs = (Output("out.txt", "a" * 64, 3, 0o644, None),)
    ev = Evidence(outs, (), diff_identity(outs, ()), (), True, True, (), "hard")
    cacheable = check_cacheable(run_id)
    return CacheEntry.build(
        key=key({"run": run_id}),
        subject="s",
        components={"inputs": {"0": run_id}},
        evidence=ev,
        value=run_id,
        canonical_value=cacheable.canonical,  # type: ignore[union-attr]
        admission={
            "tier": "sealed",
            "allReadsExact": False,
            "readSetVerified": True,
            "nondeterministic": False,
        },
        provenance={"run_id": run_id, "node_id": "n", "attempt": 1, "host": "h", "created_at_ms": 1},
        scope="run-local",
    )


def test_gc_collects_run_local_rows_of_settled_or_unknown_runs_and_keeps_those_of_live_runs(
    db: Database, tmp_path: Path
) -> None:
    clock = ManualClock()
    runs = RunStore(db, clock=clock)
    me = OwnerId("host-a", 1, "nonce-me")
    for run_id in ("live", "settled", "settled-late"):
        runs.create(run_id, "flow")
    ownership = Ownership(db, owner=me, settings=load_settings(host_id="host-a"), clock=clock)
    ownership.claim("settled")
    ownership.claim("settled-late")
    runs.finish("settled", me, "completed")
    tier = LocalTier(db, clock=clock)
    entries = {r: _run_local_entry(r) for r in ("live", "settled", "settled-late", "never-known")}
    for entry in entries.values():
        db.write(lambda c, e=entry: tier.record_in(c, e))
    clock.advance(7200)
    # Settled inside the grace period: its row waits for a later gc.
    runs.finish("settled-late", me, "failed")
    report = gc(tier, ArtifactStore((tmp_path / "cas").as_uri()), grace_s=3600, dry_run=True, clock=clock)
    assert report.deleted_rows == tuple(sorted(row_key_of(entries[r]) for r in ("settled", "never-known")))


def test_verify_reports_a_tampered_blob(tmp_path: Path, shared: ArtifactStore) -> None:
    m = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"})
    built = m.dispatch(upper_node(), upper)
    (digest,) = referenced_digests(built.evidence)
    assert verify(m.dispatcher.local, m.artifacts, SharedTier(shared)).ok
    tamper(shared, digest)
    report = verify(m.dispatcher.local, m.artifacts, SharedTier(shared))
    assert [(p.tier, p.kind, p.digest) for p in report.problems] == [("shared", "corrupt", digest)]
    assert report.entries == 2 and report.blobs == 2


@pytest.fixture
def cli() -> Any:
    from smthrs_plugin.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_cli_ls_explain_verify_gc(tmp_path: Path, cli: Any) -> None:
    shared = ArtifactStore((tmp_path / "a" / "blobs").as_uri())  # one URL for everything, as the CLI defaults
    m = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"}, one_store=True)
    m.dispatch(upper_node(), upper)
    m.write("in.txt", "edited\n")
    m.dispatch(upper_node(), upper)
    opts = ["--db", m.db.url, "--artifacts", m.artifacts.url, "--workspace", str(m.ws), "--json"]

    ls = cli("cache", "ls", "--with-shared", *opts)
    assert ls.exit_code == 0, ls.output
    entries = json.loads(ls.output)["entries"]
    assert sorted(e["tier"] for e in entries) == ["local", "local", "shared", "shared"]

    ex = cli("cache", "explain", "upper", "--db", m.db.url, "--json")
    assert ex.exit_code == 0, ex.output
    assert [(c["category"], c["where"]) for c in json.loads(ex.output)["changes"]] == [("read", "in.txt")]

    ok = cli("cache", "verify", *opts)
    assert ok.exit_code == 0 and json.loads(ok.output)["ok"] is True
    digest = next(
        iter(referenced_digests(m.dispatcher.local.lookup(m.request(upper_node()).key).entry.evidence))
    )  # type: ignore[union-attr]
    tamper(m.artifacts, digest)
    bad = cli("cache", "verify", *opts)
    assert bad.exit_code == 1
    assert {p["kind"] for p in json.loads(bad.output)["problems"]} == {"corrupt"}

    swept = cli("cache", "gc", "--grace", "0", "--dry-run", *opts)
    assert swept.exit_code == 0 and json.loads(swept.output)["deleted_blobs"] == []

    missing = cli("cache", "explain", "nope", "--db", m.db.url, "--json")
    assert missing.exit_code == 2 and json.loads(missing.output)["error"]["code"] == "not_found"
