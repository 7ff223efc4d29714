"""A step with no file effects (no reads, writes or removes) runs in a pooled empty root instead of a seeded tree
(boundary/sandbox.py, boundary/_litter.py). What it proves must not change: every test here either checks the
same facts the full sandbox gives, or runs the full sandbox beside it and compares.

Out of scope, as for every sandbox: a body that opens an absolute path into the real workspace (the sandbox is a
correctness tool, not a security boundary — boundary/sandbox.py's module docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from smthrs_plugin.boundary import (
    Declaration,
    ExpectedSetDeviation,
    Measurer,
    diff_identity,
    run_in_sandbox,
)
from smthrs_plugin.cache import CacheDispatcher, Miss
from smthrs_plugin.cache.requests import node_request
from smthrs_plugin.cache.signing import Trust, generate_key_pair
from smthrs_plugin.errors import BoundaryError, BoundaryRefusal
from smthrs_plugin.plan import node
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import open_database

EFFECT_FREE = Declaration()
#: Not effect-free (it declares a read), but seeds nothing either: the full sandbox over the same empty tree.
FULL_EMPTY = Declaration.of(reads=["no-such-file.txt"])


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    w = tmp_path / "ws"
    w.mkdir()
    (w / "in.txt").write_text("workspace file\n")
    return w


@pytest.fixture
def sandboxes(tmp_path: Path) -> Path:
    s = tmp_path / "sandboxes"
    s.mkdir()
    return s


def _run(ws: Path, decl: Declaration, body: Any, sandboxes: Path, **kw: Any) -> Any:
    return run_in_sandbox(ws, decl, body, artifacts=None, temp_dir=sandboxes, **kw)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_an_effect_free_body_runs_in_an_empty_root_and_both_flags_are_proven(
    ws: Path, sandboxes: Path
) -> None:
    seen: list[list[str]] = []
    res = _run(ws, EFFECT_FREE, lambda root: seen.append(_listing(root)) or 42, sandboxes)
    assert res.value == 42 and seen == [[]]  # hermetic: not even the workspace's own file is visible
    ev = res.evidence
    assert (ev.outputs, ev.removals, ev.deviations, ev.read_set) == ((), (), (), ())
    assert ev.whole_tree_writes_verified and ev.hermetic_reads_verified
    assert ev.diff_identity == diff_identity((), ())
    assert res.prepared.read_set == () and res.prepared.all_reads_exact
    assert _listing(ws) == ["in.txt"]


@pytest.mark.parametrize("mode", ["hard", "expected"])
def test_the_clean_evidence_equals_what_the_full_sandbox_records(
    ws: Path, sandboxes: Path, mode: str
) -> None:
    fast = _run(ws, Declaration(mode=mode), lambda root: None, sandboxes).evidence  # type: ignore[arg-type]
    full = _run(
        ws, Declaration.of(reads=["no-such-file.txt"], mode=mode), lambda root: None, sandboxes
    ).evidence  # type: ignore[arg-type]
    assert fast.to_json() | {"read_set": []} == full.to_json() | {"read_set": []}


def test_hard_mode_a_file_left_in_the_root_is_the_same_refusal_as_the_full_sandbox_and_nothing_leaves(
    ws: Path, sandboxes: Path
) -> None:
    def litter(root: Path) -> None:
        (root / "litter.txt").write_text("undeclared")
        (root / "d").mkdir()
        (root / "d" / "f").write_text("nested")

    errors = []
    for decl in (EFFECT_FREE, FULL_EMPTY):
        with pytest.raises(BoundaryRefusal) as caught:
            _run(ws, decl, litter, sandboxes)
        errors.append((caught.value.code, caught.value.details.get("paths")))
    assert errors[0] == errors[1] == ("undeclared_write", ["d/f", "litter.txt"])
    assert _listing(ws) == ["in.txt"]  # nothing copied back
    # the next effect-free step gets an empty root: the litter was removed with its root, never reused
    assert _run(ws, EFFECT_FREE, _listing, sandboxes).value == []


def test_expected_mode_a_file_left_in_the_root_is_a_recorded_deviation_and_nothing_leaves(
    ws: Path, sandboxes: Path
) -> None:
    decl = Declaration(mode="expected")
    res = _run(ws, decl, lambda root: (root / "litter.txt").write_text("x"), sandboxes)
    assert res.evidence.deviations == (ExpectedSetDeviation(("litter.txt",)),)
    assert res.evidence.outputs == () and res.evidence.boundary_mode == "expected"
    full = _run(ws, Declaration.of(reads=["no-such-file.txt"], mode="expected"),
                lambda root: (root / "litter.txt").write_text("x"), sandboxes)  # fmt: skip
    assert full.evidence.deviations == res.evidence.deviations
    assert _listing(ws) == ["in.txt"]
    assert _run(ws, EFFECT_FREE, _listing, sandboxes).value == []


def test_an_empty_directory_left_in_the_root_is_what_the_full_sandbox_says_and_never_reused(
    ws: Path, sandboxes: Path
) -> None:
    # The sandbox diffs files and links; an empty directory is no output and no write in either variant.
    fast = _run(ws, EFFECT_FREE, lambda root: (root / "empty").mkdir(), sandboxes)
    full = _run(ws, FULL_EMPTY, lambda root: (root / "empty").mkdir(), sandboxes)
    assert fast.evidence.deviations == full.evidence.deviations == ()
    assert _run(ws, EFFECT_FREE, _listing, sandboxes).value == []


def test_a_body_that_removes_its_root_is_the_same_typed_error_and_the_next_step_runs(
    ws: Path, sandboxes: Path
) -> None:
    codes = []
    for decl in (EFFECT_FREE, FULL_EMPTY):
        with pytest.raises(BoundaryError) as caught:
            _run(ws, decl, lambda root: root.rmdir(), sandboxes)
        codes.append(caught.value.code)
    assert codes == ["unsupported_boundary", "unsupported_boundary"]
    assert _run(ws, EFFECT_FREE, _listing, sandboxes).value == []


def test_a_root_replaced_or_made_read_only_by_the_body_is_never_handed_out_again(
    ws: Path, sandboxes: Path
) -> None:
    def read_only(root: Path) -> None:
        os.chmod(root, 0o500)

    def replaced(root: Path) -> None:
        root.rmdir()
        root.mkdir()  # another, empty directory under the same name

    def probe(root: Path) -> list[str]:
        seen = _listing(root)
        (root / "probe").write_text("the root is writable")
        return seen

    for body in (read_only, replaced):
        assert _run(ws, EFFECT_FREE, body, sandboxes).evidence.deviations == ()  # as the full sandbox says
        after = _run(ws, Declaration(mode="expected"), probe, sandboxes)
        assert after.value == [] and after.evidence.deviations == (ExpectedSetDeviation(("probe",)),)


def test_litter_dropped_into_an_idle_root_is_never_seen_by_nor_blamed_on_the_next_step(
    ws: Path, sandboxes: Path
) -> None:
    held: list[Path] = []
    _run(ws, EFFECT_FREE, held.append, sandboxes)
    # A background process of that step writes into its old root after the step settled.
    if held[0].exists():
        (held[0] / "late.txt").write_text("from a background process")
    res = _run(ws, EFFECT_FREE, _listing, sandboxes)
    assert res.value == [] and res.evidence.deviations == ()


def test_a_body_exception_propagates_and_its_litter_never_reaches_another_step(
    ws: Path, sandboxes: Path
) -> None:
    def fails(root: Path) -> None:
        (root / "half.txt").write_text("half")
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        _run(ws, EFFECT_FREE, fails, sandboxes)
    assert _run(ws, EFFECT_FREE, _listing, sandboxes).value == []


def test_whole_tree_mode_still_seeds_the_workspace_for_an_effect_free_body(ws: Path, sandboxes: Path) -> None:
    res = _run(ws, EFFECT_FREE, lambda root: (root / "in.txt").read_text(), sandboxes, mode="whole-tree")
    assert res.value == "workspace file\n"
    assert res.evidence.whole_tree_writes_verified and not res.evidence.hermetic_reads_verified


def test_concurrent_effect_free_steps_never_see_each_others_litter(ws: Path, sandboxes: Path) -> None:
    measurer = Measurer(ws)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            start.wait(timeout=120)
            for i in range(40):
                name = f"t{t}-{i}.txt"
                messy = i % 2 == 0

                def body(root: Path, name: str = name, messy: bool = messy) -> list[str]:
                    seen = _listing(root)
                    if messy:
                        (root / name).write_text(name)
                    return seen

                res = run_in_sandbox(ws, Declaration(mode="expected"), body, artifacts=None,
                                     measurer=measurer, temp_dir=sandboxes)  # fmt: skip
                assert res.value == [], f"{name} started in a root holding {res.value}"
                want = (ExpectedSetDeviation((name,)),) if messy else ()
                assert res.evidence.deviations == want
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert _listing(ws) == ["in.txt"]


def test_the_pool_of_roots_is_removed_at_a_normal_exit(ws: Path, sandboxes: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from smthrs_plugin.boundary import Declaration, run_in_sandbox
        for _ in range(3):
            run_in_sandbox(Path(sys.argv[1]), Declaration(), lambda root: None, artifacts=None, temp_dir=sys.argv[2])
        print(len(list(Path(sys.argv[2]).iterdir())))
        """
    )
    out = subprocess.run([sys.executable, "-c", script, str(ws), str(sandboxes)], check=True, timeout=300,
                         capture_output=True, text=True)  # fmt: skip
    assert out.stdout.strip() == "1"  # one pool directory while the process ran
    assert list(sandboxes.iterdir()) == []


# -- through the dispatch seam: what reaches the cache --------------------------------------------------------


def _dispatcher(tmp_path: Path, ws: Path) -> CacheDispatcher:
    db = open_database(f"sqlite:///{(tmp_path / 'state.db').as_posix()}")
    return CacheDispatcher(
        db,
        ArtifactStore((tmp_path / "blobs").as_uri()),
        ws,
        shared=ArtifactStore((tmp_path / "shared").as_uri()),
        temp_dir=tmp_path / "sandboxes",
        # A shared tier outside the workspace is published to only with a configured key.
        trust=Trust(generate_key_pair(tmp_path / "keys")[2], (), "configured"),
    )


def test_a_hard_effect_free_node_that_writes_in_its_root_fails_typed_and_nothing_is_cached(
    tmp_path: Path, ws: Path, sandboxes: Path
) -> None:
    d = _dispatcher(tmp_path, ws)
    draft = node("quiet", body={"cmd": "noop"})
    calls = []

    def sneaky(root: Path) -> int:
        calls.append(1)
        (root / "litter.txt").write_text("undeclared")
        return 1

    req = node_request(draft, run_id="r1", workspace=ws, measurer=d.measurer)
    res = d.dispatch(req, sneaky)
    assert res.outcome == "failed" and isinstance(res.error, BoundaryRefusal)
    assert res.error.code == "undeclared_write" and res.error.details["paths"] == ["litter.txt"]
    assert d.local.rows() == [] and d.shared_store.list_entries() == []
    assert d.dispatch(req, sneaky).decision == Miss() and len(calls) == 2  # refused again, never served
    assert not (ws / "litter.txt").exists()


def test_an_expected_effect_free_node_that_writes_in_its_root_is_a_deviation_kept_run_local(
    tmp_path: Path, ws: Path, sandboxes: Path
) -> None:
    d = _dispatcher(tmp_path, ws)
    draft = node("quiet", body={"cmd": "noop"}, boundary="expected")
    req = node_request(draft, run_id="r1", workspace=ws, measurer=d.measurer)
    res = d.dispatch(req, lambda root: (root / "litter.txt").write_text("x"))
    assert res.outcome == "built" and [dv.kind for dv in res.deviations] == ["expected-set-deviation"]
    assert res.published["shared"] == "unpublished:boundary_hard"
    assert d.shared_store.list_entries() == []
    assert [r.scope for r in d.local.rows()] == ["run-local"]


def test_a_clean_effect_free_node_is_admitted_and_served_from_the_cache(
    tmp_path: Path, ws: Path, sandboxes: Path
) -> None:
    d = _dispatcher(tmp_path, ws)
    draft = node("quiet", body={"cmd": "noop"})
    calls = []

    def body(root: Path) -> dict[str, int]:
        calls.append(1)
        return {"answer": 42}

    first = d.dispatch(node_request(draft, run_id="r1", workspace=ws, measurer=d.measurer), body)
    assert first.outcome == "built" and first.published["shared"] == "published"
    again = d.dispatch(node_request(draft, run_id="r2", workspace=ws, measurer=d.measurer), body)
    assert (again.outcome, again.value, len(calls)) == ("clean", {"answer": 42}, 1)
