"""The plain step boundary: prepare → run in place → settle, hard vs expected mode, evidence, replay."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from smthrs_plugin.boundary import (
    Declaration,
    Evidence,
    ExpectedSetDeviation,
    InlineLimits,
    Measurer,
    MissingDeclaredOutput,
    ReadSetChanged,
    ReadSetMatches,
    SurvivingDeclaredRemoval,
    check_read_set,
    prepare,
    referenced_digests,
    replay_outputs,
    settle,
)
from smthrs_plugin.canonical import canonical_bytes
from smthrs_plugin.errors import BoundaryRefusal, PlanError, ReplayError
from smthrs_plugin.stores.artifacts import ArtifactStore

MiB = 2**20


def write(root: Path, rel: str, data: bytes) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    write(root, "in.txt", b"input")
    write(root, "old/stale.txt", b"stale")
    return root


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "artifacts").as_uri())


def test_settle_records_outputs_removals_and_no_sandbox_flags(ws: Path, store: ArtifactStore) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt"], removes=["old/"])
    prepared = prepare(ws, decl)
    assert prepared.read_set == (("in.txt", hashlib.sha256(b"input").hexdigest()),)
    assert prepared.all_reads_exact
    write(ws, "out.txt", b"result")
    os.remove(ws / "old" / "stale.txt")
    ev = settle(prepared, artifacts=store)
    assert [(o.path, o.inline) for o in ev.outputs] == [("out.txt", b"result")]
    assert ev.removals == ("old/",)
    assert ev.deviations == ()
    assert (ev.whole_tree_writes_verified, ev.hermetic_reads_verified) == (False, False)
    assert ev.read_set == prepared.read_set
    assert ev.diff_identity.startswith("key1_")


def test_hard_mode_refuses_a_write_to_an_undeclared_path(ws: Path, store: ArtifactStore) -> None:
    prepared = prepare(ws, Declaration.of(reads=["in.txt"], writes=["out.txt"]))
    write(ws, "out.txt", b"ok")
    write(ws, "in.txt", b"overwritten by the step")  # a read the step also wrote, without declaring it
    with pytest.raises(BoundaryRefusal) as ei:
        settle(prepared, artifacts=store)
    assert ei.value.code == "undeclared_write"
    assert ei.value.details["paths"] == ["in.txt"]


def test_expected_mode_records_the_deviation_as_data(ws: Path, store: ArtifactStore) -> None:
    prepared = prepare(ws, Declaration.of(reads=["in.txt"], writes=["out.txt"], mode="expected"))
    write(ws, "out.txt", b"ok")
    os.remove(ws / "in.txt")
    ev = settle(prepared, artifacts=store)
    assert ev.deviations == (ExpectedSetDeviation(("in.txt",)),)
    assert [o.path for o in ev.outputs] == ["out.txt"]


def test_missing_declared_output(ws: Path, store: ArtifactStore) -> None:
    decl = Declaration.of(writes=["out.txt", "dist/"])
    write(ws, "dist/app.js", b"js")
    with pytest.raises(BoundaryRefusal) as ei:
        settle(prepare(ws, decl), artifacts=store)
    assert ei.value.code == "missing_declared_output"
    assert ei.value.details["paths"] == ["out.txt"]
    ev = settle(prepare(ws, Declaration.of(writes=["out.txt", "gen/"], mode="expected")), artifacts=store)
    assert ev.deviations == (MissingDeclaredOutput(("gen/", "out.txt")),)


def test_surviving_declared_removal(ws: Path, store: ArtifactStore) -> None:
    with pytest.raises(BoundaryRefusal) as ei:
        settle(prepare(ws, Declaration.of(removes=["old/"])), artifacts=store)
    assert ei.value.code == "surviving_declared_removal"
    assert ei.value.details["paths"] == ["old/stale.txt"]
    ev = settle(prepare(ws, Declaration.of(removes=["old/stale.txt"], mode="expected")), artifacts=store)
    assert ev.deviations == (SurvivingDeclaredRemoval(("old/stale.txt",)),)
    assert ev.removals == ()  # a surviving removal is never replayed as a deletion


def test_declaration_refuses_contradictions_before_anything_runs() -> None:
    with pytest.raises(PlanError) as ei:
        Declaration.of(writes=["build/out"], removes=["build/"])
    assert ei.value.code == "invalid_effects"
    with pytest.raises(PlanError):
        Declaration.of(removes=["*.tmp"])
    with pytest.raises(PlanError):
        Declaration.of(writes=["../escape"])
    with pytest.raises(PlanError):
        Declaration.of(mode="strict")  # type: ignore[arg-type]


def make_outputs(root: Path) -> dict[str, bytes]:
    """Small inline files, one 2 MiB file (over the per-output limit), and 10 x 900 KiB (over the total)."""
    files = {"a/small.txt": b"small", "a/tool.sh": b"#!/bin/sh\necho hi\n", "b/big.bin": os.urandom(2 * MiB)}
    for i in range(10):
        files[f"c/part{i:02d}.bin"] = os.urandom(900 * 1024)
    for rel, data in files.items():
        write(root, rel, data)
    os.chmod(root / "a/tool.sh", 0o755)
    return files


def test_replay_on_a_fresh_workspace_reproduces_every_output(
    ws: Path, store: ArtifactStore, tmp_path: Path
) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["a/", "b/", "c/"], removes=["old/"])
    prepared = prepare(ws, decl)
    files = make_outputs(ws)
    os.remove(ws / "old" / "stale.txt")
    ev = settle(prepared, artifacts=store)
    # inline decisions: sorted path order, ≤ 1 MiB each, ≤ 8 MiB in total
    inline = [o.path for o in ev.outputs if not o.by_digest]
    assert [o.path for o in ev.outputs] == sorted(files)
    assert "b/big.bin" not in inline
    assert ev.inline_bytes <= 8 * MiB and sum(len(files[p]) for p in inline) == ev.inline_bytes
    spilled = [o.path for o in ev.outputs if o.by_digest]
    # big.bin is over 1 MiB; nine 900 KiB parts fill the 8 MiB total, so the tenth spills too
    assert spilled == ["b/big.bin", "c/part09.bin"]
    assert sum(len(d) for d in files.values()) > 8 * MiB
    assert referenced_digests(ev) == {hashlib.sha256(files[p]).hexdigest() for p in spilled}
    assert all(store.has(d) for d in referenced_digests(ev))
    # through plain JSON (an SQL row / a shared entry) and back
    doc = json.loads(json.dumps(ev.to_json()))
    canonical_bytes(doc)
    ev2 = Evidence.from_json(doc)
    assert ev2 == ev
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    write(fresh, "old/stale.txt", b"stale")
    done = replay_outputs(fresh, ev2, store)
    assert (done.outputs, done.removals) == (len(files), 1)
    for rel, data in files.items():
        assert (fresh / rel).read_bytes() == data
    assert os.stat(fresh / "a/tool.sh").st_mode & 0o777 == 0o755
    assert not (fresh / "old").exists()


def spilled_setup(ws: Path, store: ArtifactStore) -> tuple[Evidence, str]:
    prepared = prepare(ws, Declaration.of(writes=["out/"]))
    write(ws, "out/keep.txt", b"inline")
    write(ws, "out/large.bin", os.urandom(2 * MiB))
    ev = settle(prepared, artifacts=store, limits=InlineLimits())
    (digest,) = referenced_digests(ev)
    return ev, digest


def test_tampered_spilled_blob_is_boundary_corruption(ws: Path, store: ArtifactStore, tmp_path: Path) -> None:
    ev, digest = spilled_setup(ws, store)
    store.fs.pipe_file(store.blob_path(digest), b"tampered")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(ReplayError) as ei:
        replay_outputs(fresh, ev, store)
    assert ei.value.code == "boundary_corruption"
    assert ei.value.cause is not None
    assert not (fresh / "out").exists()  # nothing partially replayed


def test_deleted_spilled_blob_is_missing_artifact(ws: Path, store: ArtifactStore, tmp_path: Path) -> None:
    ev, digest = spilled_setup(ws, store)
    store.delete_blob(digest)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(ReplayError) as ei:
        replay_outputs(fresh, ev, store)
    assert ei.value.code == "missing_artifact"
    assert ei.value.details["digest"] == digest
    assert not (fresh / "out").exists()


def test_tampered_evidence_row_is_refused_on_decode(ws: Path, store: ArtifactStore) -> None:
    ev, _ = spilled_setup(ws, store)
    doc = ev.to_json()
    doc["outputs"][1]["inline"] = "dGFtcGVyZWQ="  # base64("tampered")
    with pytest.raises(ReplayError) as ei:
        Evidence.from_json(doc)
    assert ei.value.code == "boundary_corruption"
    doc = ev.to_json()
    doc["outputs"][0]["path"] = "../etc/passwd"
    with pytest.raises(ReplayError):
        Evidence.from_json(doc)
    with pytest.raises(ReplayError) as ei2:
        Evidence.from_json({**ev.to_json(), "format": "smthrs-evidence/99"})
    assert ei2.value.code == "unsupported_boundary"


def test_replay_refuses_to_write_through_a_symlink_out_of_the_workspace(
    ws: Path, store: ArtifactStore, tmp_path: Path
) -> None:
    ev, _ = spilled_setup(ws, store)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", fresh / "out")
    with pytest.raises(ReplayError) as ei:
        replay_outputs(fresh, ev, store)
    assert ei.value.code == "unsupported_boundary"
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_check_read_set_names_stale_reads(ws: Path) -> None:
    m = Measurer(ws)
    prepared = prepare(ws, Declaration.of(reads=["in.txt", "absent.txt"]), measurer=m)
    assert check_read_set(ws, prepared.read_set, measurer=m) == ReadSetMatches()
    write(ws, "in.txt", b"changed")
    write(ws, "absent.txt", b"now here")
    assert check_read_set(ws, prepared.read_set, measurer=m) == ReadSetChanged(("absent.txt", "in.txt"))


def test_key_material_is_plain_sorted_data(ws: Path) -> None:
    decl = Declaration.of(
        reads=["in.txt", "src/**/*.py"], writes=["z.txt", "dist/"], removes=["old/", "b.txt"]
    )
    prepared = prepare(ws, decl)
    assert not prepared.all_reads_exact
    km = prepared.key_material()
    canonical_bytes(km)
    assert km["removes"] == ["b.txt", "old/"]
    assert km["boundaryMode"] == "hard"
    assert km["readSet"] == [{"path": "in.txt", "digest": hashlib.sha256(b"input").hexdigest()}]
