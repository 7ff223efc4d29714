"""Publisher trust of the shared tier: signed entries, quarantine that never blocks, revocation seen by
every reader, size caps, keygen — each attack built on "machine A", tampered as a bucket writer would, run on a
fresh "machine B", then a third machine gets a genuine clean hit. On file://, memory:// and s3:// (moto)."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _cache_support import Machine, make_machine, upper, upper_node
from typer.testing import CliRunner

from smthrs_plugin._clock import ManualClock
from smthrs_plugin.boundary import referenced_digests
from smthrs_plugin.cache import CacheDispatcher, UnverifiableEvidence, VerifiedHit
from smthrs_plugin.cache.bounds import SizeCaps
from smthrs_plugin.cache.entry import CacheEntry, decode_entry, result_digest
from smthrs_plugin.cache.maintenance import revoke, verify
from smthrs_plugin.cache.model import Miss, ReplayFailed
from smthrs_plugin.cache.shared import Candidate, SharedTier, check_document, entry_name, sign_document
from smthrs_plugin.cache.signing import (
    Trust,
    load_private_key,
    parse_trusted_keys,
    trust_from_settings,
    workspace_key,
)
from smthrs_plugin.canonical import canonical_bytes, key_digest
from smthrs_plugin.errors import CacheError, SettingsError
from smthrs_plugin.settings import load_cache_settings
from smthrs_plugin.stores.artifacts import ArtifactStore

Machines = Callable[..., Machine]


def own_key(base: Path, name: str) -> Trust:
    """A machine that signs with its own key and trusts only itself."""
    return Trust(workspace_key(base / f"key-{name}"), (), "configured")


def trusting(base: Path, name: str, *others: str) -> Trust:
    return Trust(
        workspace_key(base / f"key-{name}"), tuple(workspace_key(base / f"key-{o}").public for o in others)
    )


def refusals(m: Machine, run_id: str) -> list[dict[str, Any]]:
    return [p for p in m.provenance(run_id) if p.get("action") == "refused"]


def test_a_forged_value_is_never_served_and_the_honest_entry_replaces_it(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    name = a.entry_name(built.key)
    doc = json.loads(a.shared.get_entry(name) or b"")
    doc["value"] = {"length": 999}  # the attacker's value, with the (unkeyed) result identity recomputed
    doc["result"] = result_digest(canonical_bytes(doc["value"]), doc["evidence"]["diff_identity"])
    assert isinstance(decode_entry(doc, name=key_digest(built.key)), CacheEntry)  # it WOULD decode unsigned
    a.shared.delete_entry(name)
    a.shared.put_entry(name, json.dumps(doc).encode())

    b = machines("b", files={"in.txt": "hello\n"})
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert (res.outcome, res.value, b.calls["upper"]) == ("built", {"length": 6}, 1)
    assert isinstance(res.decision, UnverifiableEvidence) and "bad_signature" in res.decision.reason
    assert [(p["reason"], p["entry"]) for p in refusals(b, "r2")] == [("bad_signature", name)]
    assert b.metrics.decisions == {"UnverifiableEvidence": 1}
    assert (
        res.published["shared"] == "published"
    )  # quarantine never blocks: the forgery at our name was replaced
    assert {"action": "replaced", "tier": "shared"}.items() <= next(
        p for p in b.provenance("r2") if p.get("action") == "replaced"
    ).items()

    c = machines("c", files={"in.txt": "hello\n"})
    hit = c.dispatch(upper_node(), upper, run_id="r3")
    assert (hit.outcome, hit.decision, hit.value, c.calls["upper"]) == (
        "clean",
        VerifiedHit("shared"),
        {"length": 6},
        0,
    )
    assert (c.ws / "out.txt").read_text() == "HELLO\n"


def test_an_untrusted_honest_publisher_is_ignored_until_its_key_is_trusted(
    tmp_path: Path, shared: ArtifactStore
) -> None:
    a = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"}, trust=own_key(tmp_path, "a"))
    assert a.dispatch(upper_node(), upper).published["shared"] == "published"
    b = make_machine(tmp_path, "b", shared, files={"in.txt": "hello\n"}, trust=own_key(tmp_path, "b"))
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert (res.outcome, res.decision, b.calls["upper"]) == ("built", Miss(), 1)  # A's entry is not even read
    c = make_machine(tmp_path, "c", shared, files={"in.txt": "hello\n"}, trust=trusting(tmp_path, "c", "a"))
    hit = c.dispatch(upper_node(), upper, run_id="r3")
    assert (hit.outcome, hit.decision, c.calls["upper"]) == ("clean", VerifiedHit("shared"), 0)


def test_an_entry_signed_by_an_untrusted_key_at_a_trusted_name_is_refused(
    tmp_path: Path, shared: ArtifactStore
) -> None:
    a = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"}, trust=own_key(tmp_path, "a"))
    built = a.dispatch(upper_node(), upper)
    entry = decode_entry(a.shared.get_entry(a.entry_name(built.key)) or b"", name=key_digest(built.key))
    assert isinstance(entry, CacheEntry)
    evil = own_key(tmp_path, "attacker")
    a.shared.delete_entry(a.entry_name(built.key))
    a.shared.put_entry(
        a.entry_name(built.key), sign_document(entry, evil)
    )  # valid signature, wrong publisher
    b = make_machine(tmp_path, "b", shared, files={"in.txt": "hello\n"}, trust=trusting(tmp_path, "b", "a"))
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert res.outcome == "built" and [p["reason"] for p in refusals(b, "r2")] == ["bad_signature"]


def test_a_planted_entry_at_the_honest_publishers_name_does_not_block_publication(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    name = a.entry_name(a.request(upper_node()).key)
    a.shared.put_entry(name, b'{"format": "smthrs-cache-entry/1", "planted": true}')  # before anybody built
    res = a.dispatch(upper_node(), upper)
    assert (res.outcome, res.published["shared"], a.calls["upper"]) == ("built", "published", 1)
    assert [p["reason"] for p in refusals(a, "r1")] == ["unsigned"]
    assert isinstance(check_document(name, a.shared.get_entry(name) or b"", a.dispatcher.trust), Candidate)
    b = machines("b", files={"in.txt": "hello\n"})
    assert b.dispatch(upper_node(), upper, run_id="r2").decision == VerifiedHit("shared")


def differing(root: Path) -> dict[str, Any]:
    """Like ``upper`` but with a different result (as a nondeterministic body would produce)."""
    (root / "out.txt").write_text((root / "in.txt").read_text().upper() + "!")
    return {"length": -1}


def test_an_entry_whose_blob_is_missing_does_not_make_the_honest_build_fail(
    tmp_path: Path, shared: ArtifactStore
) -> None:
    a = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"}, trust=own_key(tmp_path, "a"))
    built = a.dispatch(upper_node(), upper)
    (digest,) = referenced_digests(built.evidence)
    shared.delete_blob(digest)  # nobody has it any more
    b = make_machine(tmp_path, "b", shared, files={"in.txt": "hello\n"}, trust=trusting(tmp_path, "b", "a"))
    res = b.dispatch(upper_node(), differing, run_id="r2")
    assert isinstance(res.decision, ReplayFailed) and res.decision.code == "missing_artifact"
    assert (res.outcome, res.error, res.published["shared"]) == (
        "built",
        None,
        "published",
    )  # no result_mismatch
    c = make_machine(tmp_path, "c", shared, files={"in.txt": "hello\n"}, trust=trusting(tmp_path, "c", "b"))
    hit = c.dispatch(upper_node(), upper, run_id="r3")
    assert (hit.outcome, hit.value, c.calls["upper"]) == ("clean", {"length": -1}, 0)


def test_a_servable_rival_with_another_result_still_fails_a_strict_build(
    tmp_path: Path, shared: ArtifactStore
) -> None:
    a = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"}, trust=own_key(tmp_path, "a"))
    a.dispatch(upper_node(), upper)
    b = make_machine(tmp_path, "b", shared, files={"in.txt": "hello\n"}, trust=trusting(tmp_path, "b", "a"))
    res = b.dispatch(upper_node(), differing, run_id="r2", consult_shared=False)
    assert (
        res.outcome == "failed" and isinstance(res.error, CacheError) and res.error.code == "result_mismatch"
    )


def test_a_revoked_entry_is_re_executed_by_every_reader_including_a_local_copy_after_the_refresh_interval(
    machines: Machines, tmp_path: Path, shared: ArtifactStore
) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    clock = ManualClock(int(time.time() * 1000))
    b = make_machine(tmp_path, "b", shared, files={"in.txt": "hello\n"}, clock=clock, revocation_refresh_s=60)
    assert b.dispatch(upper_node(), upper, run_id="r2").decision == VerifiedHit("shared")
    assert b.dispatch(upper_node(), upper, run_id="r3").decision == VerifiedHit(
        "local"
    )  # B holds a local copy

    report = revoke(a.dispatcher.local, SharedTier(shared), "upper", by="a", reason="bad toolchain")
    assert report.keys == (built.key,) and report.invalidated == (key_digest(built.key),)
    again = a.dispatch(upper_node(), upper, run_id="r4")  # the revoker re-executes at once
    assert (again.outcome, a.calls["upper"]) == ("built", 2)
    assert isinstance(again.decision, UnverifiableEvidence)

    clock.advance(59)  # within the documented staleness bound, B's local copy still serves
    assert b.dispatch(upper_node(), upper, run_id="r5").decision == VerifiedHit("local")
    clock.advance(1)
    res = b.dispatch(upper_node(), upper, run_id="r6")
    # B's local copy is dropped; A's new entry (built after the revocation) is what the shared tier serves now
    assert res.outcome == "clean" and res.decision == VerifiedHit("shared")
    assert any(p.get("reason") == "revoked" for p in b.provenance("r6"))


def test_a_revoked_entry_with_no_newer_copy_is_re_executed(tmp_path: Path, shared: ArtifactStore) -> None:
    a = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    SharedTier(shared).revocations.revoke(built.key, [], by="operator")
    b = make_machine(tmp_path, "b", shared, files={"in.txt": "hello\n"})
    res = b.dispatch(upper_node(), upper, run_id="r2")
    assert (res.outcome, b.calls["upper"], res.published["shared"]) == ("built", 1, "published")
    assert [p["reason"] for p in refusals(b, "r2")] == ["revoked"]
    c = make_machine(tmp_path, "c", shared, files={"in.txt": "hello\n"})
    assert c.dispatch(upper_node(), upper, run_id="r3").decision == VerifiedHit("shared")


@pytest.mark.parametrize(
    ("caps", "setting"),
    [
        (SizeCaps(max_output_bytes=5), "SMTHRS_CACHE_MAX_OUTPUT_BYTES"),
        (SizeCaps(max_step_bytes=5), "SMTHRS_CACHE_MAX_STEP_BYTES"),
    ],
)
def test_an_output_over_the_size_cap_settles_failed_before_publication(
    tmp_path: Path, caps: SizeCaps, setting: str
) -> None:
    shared = ArtifactStore((tmp_path / "shared").as_uri())
    m = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"}, size_caps=caps)
    res = m.dispatch(upper_node(), upper)
    assert res.outcome == "failed" and isinstance(res.error, CacheError)
    assert (
        res.error.code == "output_too_large"
        and setting in res.error.message
        and "out.txt" in res.error.message
    )
    assert res.error.details["size"] == 6 and res.error.details["limit"] == 5
    assert shared.list_entries() == [] and m.dispatcher.local.rows() == []
    assert [p["stage"] for p in m.provenance() if p.get("action") == "unpublished"] == ["output_too_large"]


def test_a_signed_entry_round_trips_to_the_bytes_its_signature_covers(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    built = a.dispatch(upper_node(), upper)
    name = a.entry_name(built.key)
    judged = check_document(name, a.shared.get_entry(name) or b"", a.dispatcher.trust)
    assert isinstance(judged, Candidate) and judged.publisher == a.dispatcher.trust.publishers[0]
    local = a.dispatcher.local.lookup(built.key)
    assert judged.entry.canonical() == local.entry.canonical()  # type: ignore[union-attr]


def test_the_default_is_a_workspace_key_trusted_only_by_itself_and_a_remote_tier_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for var in ("SMTHRS_CACHE_SIGNING_KEY", "SMTHRS_CACHE_TRUSTED_KEYS"):
        monkeypatch.delenv(var, raising=False)
    ws = tmp_path / "ws"
    ws.mkdir()
    m = make_machine(tmp_path, "a", ArtifactStore((tmp_path / "s").as_uri()), files={"in.txt": "x\n"})
    with caplog.at_level(logging.WARNING):
        d = CacheDispatcher(m.db, m.artifacts, ws, shared=ArtifactStore((tmp_path / "team").as_uri()))
        CacheDispatcher(m.db, m.artifacts, ws, shared=ArtifactStore((tmp_path / "team").as_uri()))
        inside = CacheDispatcher(m.db, ArtifactStore((ws / ".smthrs/artifacts").as_uri()), ws)
    assert d.trust.origin == "workspace-default" and d.trust.publishers == inside.trust.publishers
    key_file = ws / ".smthrs/keys/cache-signing.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    warned = [r.message for r in caplog.records if "IGNORED" in r.message]
    assert (
        len(warned) == 1 and str(tmp_path / "team") in warned[0]
    )  # once per process; not for the workspace's own


def test_trusted_keys_alone_make_a_reader_that_never_publishes(
    tmp_path: Path, shared: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = make_machine(tmp_path, "a", shared, files={"in.txt": "hello\n"}, trust=own_key(tmp_path, "a"))
    pub = tmp_path / "key-a/.smthrs/keys/cache-signing.pub"
    monkeypatch.setenv("SMTHRS_CACHE_TRUSTED_KEYS", f" {pub} ")
    monkeypatch.delenv("SMTHRS_CACHE_SIGNING_KEY", raising=False)
    reader = trust_from_settings(load_cache_settings(), tmp_path / "r")
    assert (reader.origin, reader.signer, reader.publishers) == (
        "reader-only",
        None,
        a.dispatcher.trust.publishers,
    )
    r = make_machine(tmp_path, "r", shared, files={"in.txt": "other\n"}, trust=reader)
    res = r.dispatch(upper_node(), upper, run_id="r2")
    assert (res.outcome, res.published["shared"]) == ("built", "unpublished:unsigned")
    a_key = a.request(upper_node()).key
    a.dispatch(upper_node(), upper)
    r.write("in.txt", "hello\n")
    assert r.dispatch(upper_node(), upper, run_id="r3").decision == VerifiedHit("shared")
    assert sorted(shared.list_entries()) == [entry_name(key_digest(a_key), a.dispatcher.trust.publishers[0])]


def test_trusted_keys_accept_files_inline_base64_and_pem_and_refuse_garbage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    k1, k2, k3 = (workspace_key(tmp_path / n) for n in ("1", "2", "3"))
    spec = f"{tmp_path / '1/.smthrs/keys/cache-signing.pub'}, {k2.public.b64()},{k3.public.pem().decode()}"
    assert [k.key_id for k in parse_trusted_keys(spec)] == [k1.key_id, k2.key_id, k3.key_id]
    with pytest.raises(CacheError) as err:
        parse_trusted_keys("not-a-key")
    assert err.value.code == "invalid_key"
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(tmp_path / "missing.key"))
    with pytest.raises(SettingsError, match="SMTHRS_CACHE_SIGNING_KEY"):
        trust_from_settings(load_cache_settings(), tmp_path)


@pytest.fixture
def cli() -> Any:
    from smthrs_plugin.cli import app

    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(
    tmp_path: Path, cli: Any
) -> None:
    out = cli("cache", "keygen", str(tmp_path / "keys"), "--json")
    assert out.exit_code == 0, out.output
    made = json.loads(out.output)
    assert stat.S_IMODE(os.stat(made["private"]).st_mode) == 0o600
    key = load_private_key(made["private"])
    assert key.key_id == made["key_id"] and parse_trusted_keys(made["public_b64"])[0].key_id == key.key_id
    assert parse_trusted_keys(made["public"])[0].key_id == key.key_id
    again = cli("cache", "keygen", str(tmp_path / "keys"), "--json")
    assert again.exit_code == 2 and json.loads(again.output)["error"]["code"] == "invalid_key"


def test_verify_with_shared_lists_refused_entries_with_reasons(
    tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore((tmp_path / "a" / "blobs").as_uri())
    a = make_machine(tmp_path, "a", store, files={"in.txt": "hello\n"}, one_store=True)
    monkeypatch.setenv("SMTHRS_CACHE_SIGNING_KEY", str(tmp_path / "team/.smthrs/keys/cache-signing.key"))
    monkeypatch.delenv("SMTHRS_CACHE_TRUSTED_KEYS", raising=False)
    built = a.dispatch(upper_node(), upper)
    b = make_machine(
        tmp_path, "b", store, files={"in.txt": "other\n"}, trust=own_key(tmp_path, "b"), one_store=True
    )
    b.dispatch(upper_node(), upper, run_id="r2")  # an honest entry by a key this machine does not trust
    digest = key_digest(built.key)
    store.put_entry(digest, b"{}")  # an unsigned, older-format name
    store.put_entry(entry_name(digest, "0" * 16), b"not json")
    opts = ["--db", a.db.url, "--artifacts", store.url, "--workspace", str(a.ws), "--json"]

    local_only = cli("cache", "verify", *opts)
    assert local_only.exit_code == 0, local_only.output
    out = cli("cache", "verify", "--with-shared", *opts)
    assert out.exit_code == 1, out.output
    kinds = sorted(p["kind"] for p in json.loads(out.output)["problems"])
    assert kinds == ["undecodable", "unsigned", "untrusted_key"]

    revoked = cli("cache", "revoke", built.key, *opts)
    assert revoked.exit_code == 0, revoked.output
    assert json.loads(revoked.output)["invalidated"] == [digest]
    after = cli("cache", "verify", "--with-shared", *opts)
    assert "revoked" in [p["kind"] for p in json.loads(after.output)["problems"]]
    nope = cli("cache", "revoke", "nope", *opts)
    assert nope.exit_code == 2 and json.loads(nope.output)["error"]["code"] == "not_found"


def test_library_verify_without_trust_checks_integrity_only(machines: Machines) -> None:
    a = machines("a", files={"in.txt": "hello\n"})
    a.dispatch(upper_node(), upper)
    assert verify(a.dispatcher.local, a.artifacts, SharedTier(a.shared)).ok
