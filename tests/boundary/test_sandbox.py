"""The workspace transaction: hermetic reads, whole-tree diff, compare-and-set copy-back, honest flags."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from smthrs_plugin.boundary import (
    Declaration,
    ExpectedSetDeviation,
    Measurer,
    replay_outputs,
    run_in_sandbox,
)
from smthrs_plugin.errors import BoundaryError, BoundaryRefusal, MaterializationConflict
from smthrs_plugin.stores.artifacts import ArtifactStore


def write(root: Path, rel: str, data: bytes) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    write(root, "in.txt", b"input\n")
    write(root, "secret.txt", b"not declared\n")
    write(root, "README", b"readme\n")
    write(root, "dist/old.js", b"old\n")
    write(root, ".git/HEAD", b"ref: main\n")
    write(root, ".smthrs/statcache.json", b"{}")
    return root


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "artifacts").as_uri())


@pytest.fixture
def sbx(tmp_path: Path) -> Path:
    d = tmp_path / "sandboxes"
    d.mkdir()
    return d


def test_hermetic_sandbox_sees_only_declared_reads(ws: Path, store: ArtifactStore, sbx: Path) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt"])

    def body(root: Path) -> list[str]:
        (root / "out.txt").write_bytes((root / "in.txt").read_bytes().upper())
        return sorted(p.name for p in root.iterdir())

    res = run_in_sandbox(ws, decl, body, mode="hermetic", artifacts=store, temp_dir=sbx)
    assert res.value == ["in.txt", "out.txt"]  # no secret.txt, README, .git, .smthrs
    assert (ws / "out.txt").read_bytes() == b"INPUT\n"
    assert (res.evidence.whole_tree_writes_verified, res.evidence.hermetic_reads_verified) == (True, True)
    assert list(sbx.iterdir()) == []  # the temporary tree is gone


def test_hermetic_sandbox_makes_an_undeclared_read_fail(ws: Path, store: ArtifactStore, sbx: Path) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt"])

    def body(root: Path) -> None:
        (root / "out.txt").write_bytes((root / "secret.txt").read_bytes())

    with pytest.raises(FileNotFoundError):
        run_in_sandbox(ws, decl, body, mode="hermetic", artifacts=store, temp_dir=sbx)
    assert not (ws / "out.txt").exists()
    assert list(sbx.iterdir()) == []


def test_shell_command_runs_with_the_sandbox_as_cwd(ws: Path, store: ArtifactStore, sbx: Path) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["out/"])

    def body(root: Path) -> int:
        cmd = (
            "mkdir -p out && tr a-z A-Z < in.txt > out/upper.txt && cat secret.txt > /dev/null 2>&1; echo $?"
        )
        done = subprocess.run(["sh", "-c", cmd], cwd=root, capture_output=True, text=True, check=True)
        return int(done.stdout.strip())

    res = run_in_sandbox(ws, decl, body, artifacts=store, temp_dir=sbx)
    assert res.value != 0  # `cat secret.txt` failed: undeclared reads do not exist in a hermetic sandbox
    assert (ws / "out/upper.txt").read_bytes() == b"INPUT\n"


def test_whole_tree_diff_refuses_a_write_outside_the_declaration(
    ws: Path, store: ArtifactStore, sbx: Path
) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt"])

    def body(root: Path) -> None:
        (root / "out.txt").write_bytes(b"declared")
        (root / "notes" / "scratch.txt").parent.mkdir()
        (root / "notes" / "scratch.txt").write_bytes(b"undeclared")
        (root / "README").unlink()  # an undeclared removal is a write too

    with pytest.raises(BoundaryRefusal) as ei:
        run_in_sandbox(ws, decl, body, mode="whole-tree", artifacts=store, temp_dir=sbx)
    assert ei.value.code == "undeclared_write"
    assert ei.value.details["paths"] == ["README", "notes/scratch.txt"]
    assert not (ws / "out.txt").exists()  # nothing copied back
    assert (ws / "README").exists()
    assert list(sbx.iterdir()) == []


def test_whole_tree_expected_mode_records_and_copies_back_only_declared_outputs(
    ws: Path, store: ArtifactStore, sbx: Path
) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt"], mode="expected")

    def body(root: Path) -> str:
        (root / "out.txt").write_bytes(b"declared")
        (root / ".smthrs").mkdir()
        (root / ".smthrs" / "junk").write_bytes(b"x")  # even dot-directories are in the diff
        return "ok"

    res = run_in_sandbox(ws, decl, body, mode="whole-tree", artifacts=store, temp_dir=sbx)
    assert res.value == "ok"
    assert res.evidence.deviations == (ExpectedSetDeviation((".smthrs/junk",)),)
    assert (res.evidence.whole_tree_writes_verified, res.evidence.hermetic_reads_verified) == (True, False)
    assert (ws / "out.txt").read_bytes() == b"declared"
    assert not (ws / ".smthrs" / "junk").exists()


def test_whole_tree_copy_excludes_state_dirs_and_identical_rewrites_are_not_writes(
    ws: Path, store: ArtifactStore, sbx: Path
) -> None:
    decl = Declaration.of(reads=["in.txt"], writes=["dist/"])

    def body(root: Path) -> list[str]:
        (root / "README").write_bytes(b"readme\n")  # same bytes: touched, not changed
        (root / "dist" / "old.js").unlink()  # a deletion inside the write set
        (root / "dist" / "app.js").write_bytes(b"new\n")
        return sorted(p.name for p in root.iterdir())

    res = run_in_sandbox(ws, decl, body, mode="whole-tree", artifacts=store, temp_dir=sbx)
    assert res.value == ["README", "dist", "in.txt", "secret.txt"]
    assert res.evidence.deviations == ()
    assert res.evidence.removals == ("dist/old.js",)
    assert (ws / "dist/app.js").read_bytes() == b"new\n"
    assert not (ws / "dist/old.js").exists()  # the copy-back applies the same removals a replay would


def test_copy_back_conflict_when_the_workspace_changed_underneath(
    ws: Path, store: ArtifactStore, sbx: Path
) -> None:
    write(ws, "out.txt", b"before")
    decl = Declaration.of(reads=["in.txt"], writes=["out.txt", "log/"])

    def body(root: Path) -> None:
        (root / "out.txt").write_bytes(b"from the step")
        (root / "log").mkdir()
        (root / "log" / "run.txt").write_bytes(b"step log")
        write(ws, "out.txt", b"someone else")  # the real workspace changes while the step runs

    with pytest.raises(MaterializationConflict) as ei:
        run_in_sandbox(ws, decl, body, mode="hermetic", artifacts=store, temp_dir=sbx)
    assert ei.value.code == "materialization_conflict"
    assert isinstance(ei.value, BoundaryError)
    assert ei.value.details["paths"] == ["out.txt"]
    assert (ws / "out.txt").read_bytes() == b"someone else"
    assert not (ws / "log").exists()  # validate all, then copy: nothing partially copied
    assert list(sbx.iterdir()) == []


def test_sandbox_evidence_replays_byte_for_byte(
    ws: Path, store: ArtifactStore, sbx: Path, tmp_path: Path
) -> None:
    big = os.urandom(3 * 2**20)
    decl = Declaration.of(reads=["in.txt"], writes=["build/"], removes=["README"])

    def body(root: Path) -> None:
        (root / "build").mkdir()
        (root / "build" / "big.bin").write_bytes(big)
        (root / "build" / "small.txt").write_bytes(b"small")

    m = Measurer(ws)
    res = run_in_sandbox(ws, decl, body, mode="hermetic", artifacts=store, measurer=m, temp_dir=sbx)
    assert [o.by_digest for o in res.evidence.outputs] == [True, False]
    assert not (ws / "README").exists()  # declared removal applied on copy-back
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    write(fresh, "README", b"readme\n")
    replay_outputs(fresh, res.evidence, store)
    assert (fresh / "build/big.bin").read_bytes() == big == (ws / "build/big.bin").read_bytes()
    assert (fresh / "build/small.txt").read_bytes() == b"small"
    assert not (fresh / "README").exists()


def test_read_changed_between_prepare_and_seeding_is_refused(
    ws: Path, store: ArtifactStore, sbx: Path
) -> None:
    class SneakyMeasurer(Measurer):
        def measure_entries(self, entries):  # type: ignore[no-untyped-def]
            out = super().measure_entries(entries)
            write(ws, "in.txt", b"changed after it was measured\n")
            return out

    with pytest.raises(BoundaryError) as ei:
        run_in_sandbox(
            ws,
            Declaration.of(reads=["in.txt"], writes=["out.txt"]),
            lambda root: None,
            artifacts=store,
            measurer=SneakyMeasurer(ws, stat_cache=None),
            temp_dir=sbx,
        )
    assert ei.value.code == "changed_during_measurement"


def test_unknown_sandbox_mode_is_refused_before_anything_runs(ws: Path, store: ArtifactStore) -> None:
    ran: list[bool] = []
    with pytest.raises(BoundaryError) as ei:
        run_in_sandbox(ws, Declaration(), lambda root: ran.append(True), mode="chroot", artifacts=store)  # type: ignore[arg-type]
    assert ei.value.code == "unsupported_boundary"
    assert ran == []


def test_unchanged_outputs_are_not_rewritten_on_copy_back(ws: Path, store: ArtifactStore, sbx: Path) -> None:
    old = os.stat(ws / "dist/old.js")

    def body(root: Path) -> None:
        (root / "dist" / "app.js").write_bytes(b"new\n")

    res = run_in_sandbox(
        ws, Declaration.of(writes=["dist/"]), body, mode="whole-tree", artifacts=store, temp_dir=sbx
    )
    assert [o.path for o in res.evidence.outputs] == ["dist/app.js", "dist/old.js"]
    now = os.stat(ws / "dist/old.js")
    assert (now.st_ino, now.st_mtime_ns) == (old.st_ino, old.st_mtime_ns)  # make-like tools see no change
    assert (ws / "dist/app.js").read_bytes() == b"new\n"


@pytest.mark.parametrize("seeded_bytes_limit", [1 << 20, -1], ids=["content-compare", "clock-tick"])
def test_same_size_rewrite_with_restored_mtime_is_a_write_and_identical_rewrite_is_not(
    ws: Path, store: ArtifactStore, sbx: Path, monkeypatch: pytest.MonkeyPatch, seeded_bytes_limit: int
) -> None:
    # Both ways of settling a sandbox (small trees compared by content, large ones by lstat identity after a
    # clock tick) must agree on what a write is.
    from smthrs_plugin.boundary import sandbox as sandbox

    monkeypatch.setattr(sandbox, "_REHASH_ALL_BYTES", seeded_bytes_limit)
    write(ws, "other.txt", b"other\n")
    decl = Declaration.of(reads=["in.txt", "other.txt"], writes=["out.txt"])

    def body(root: Path) -> None:
        (root / "out.txt").write_bytes(b"declared")
        st = os.stat(root / "in.txt")
        (root / "in.txt").write_bytes(b"INPUT\n")  # same size, other bytes
        os.utime(root / "in.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
        (root / "other.txt").write_bytes(b"other\n")  # identical bytes: not a change

    with pytest.raises(BoundaryRefusal) as ei:
        run_in_sandbox(ws, decl, body, mode="hermetic", artifacts=store, temp_dir=sbx)
    assert ei.value.code == "undeclared_write"
    assert ei.value.details["paths"] == ["in.txt"]
    assert not (ws / "out.txt").exists()
