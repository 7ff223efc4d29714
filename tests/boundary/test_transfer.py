"""A sandbox tree as content of the artifact store (boundary/transfer.py): what remote execution ships to
a worker and what comes back. Real files, a real ``file://`` store and moto's real S3 server where the store's
behaviour matters (verified reads, a blob deleted or replaced behind the store's back).

The invariants pinned here are the module docstring's: hydration is verified, a delta is computed by content and
never by clock, a delta names no blob the store lacks, and a delta is untrusted where it is applied (refused whole
before a byte is written)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from _trees import snapshot

from smthrs_plugin.boundary.transfer import Delta, Entry, apply_delta, delta_of, hydrate, manifest_of, upload
from smthrs_plugin.errors import ArtifactError, RemoteError
from smthrs_plugin.stores.artifacts import ArtifactStore, Intact

#: A date no real clock shows as "now": 1970 and 2100.
FAR_PAST_S = 0
FAR_FUTURE_S = 4_102_444_800


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    """A fresh store on local disk and on moto's S3 (a fresh URL each: the process-wide "already uploaded" memo is
    keyed by URL, so no test sees another's)."""
    if request.param == "file":
        return ArtifactStore((tmp_path / "artifacts").as_uri())
    bucket = request.getfixturevalue("s3_bucket")
    return ArtifactStore(f"s3://{bucket}/artifacts", request.getfixturevalue("s3_options"))


@pytest.fixture
def file_store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "artifacts").as_uri())


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the tree, holding a file a hostile delta or a followed link would reach."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.txt").write_bytes(b"not part of any tree")
    return d


@pytest.fixture
def src(tmp_path: Path, outside: Path) -> Path:
    """A tree with every kind of entry that travels: files of both normalised modes (from odd raw modes), an empty
    file, two files sharing one blob, an empty directory, nested directories, links (relative, dangling, and one
    to a directory outside the tree, which must be shipped as a link and never followed)."""
    root = tmp_path / "src"
    (root / "bin").mkdir(parents=True)
    (root / "nested" / "deep").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_bytes(b"alpha")
    os.chmod(root / "a.txt", 0o600)  # no execute bit: travels as 0o644
    (root / "dup.txt").write_bytes(b"alpha")
    (root / "bin" / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "bin" / "run.sh", 0o775)  # owner-execute: travels as 0o755, group-write dropped
    (root / "nested" / "deep" / "c.bin").write_bytes(bytes(range(256)) * 64)
    (root / "zero").write_bytes(b"")
    os.symlink("a.txt", root / "link-to-a")
    os.symlink("does/not/exist", root / "dangling")
    os.symlink(str(outside), root / "out-link")
    return root


def damage(store: ArtifactStore, digest: str, how: str) -> None:
    """Behind the store's back: other bytes under the blob's name, or no blob at all."""
    if how == "corrupt":
        store.fs.pipe_file(store.blob_path(digest), b"other bytes under that name")
    else:
        store.delete_blob(digest)


def shipped(src: Path, store: ArtifactStore) -> dict[str, Entry]:
    manifest = manifest_of(src)
    upload(src, manifest, store)
    return manifest


# -- round trip -------------------------------------------------------------------------------------------------


def test_a_hydrated_tree_reproduces_files_modes_empty_directories_and_links_from_the_store_alone(
    src: Path, store: ArtifactStore, tmp_path: Path
) -> None:
    manifest = shipped(src, store)
    dst = tmp_path / "worker"
    dst.mkdir()
    hydrate(manifest, store, dst)

    assert manifest_of(dst) == manifest
    assert (dst / "a.txt").read_bytes() == b"alpha"
    assert (dst / "nested" / "deep" / "c.bin").read_bytes() == (
        src / "nested" / "deep" / "c.bin"
    ).read_bytes()
    assert (dst / "zero").read_bytes() == b""
    # Only the owner-execute bit travels (0o600 -> 0o644, 0o775 -> 0o755).
    assert stat.S_IMODE(os.stat(dst / "a.txt").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(dst / "bin" / "run.sh").st_mode) == 0o755
    assert (dst / "empty").is_dir() and not any((dst / "empty").iterdir())
    # Links keep their target verbatim and are never followed: what the outside link points at is not shipped.
    assert os.readlink(dst / "link-to-a") == "a.txt"
    assert os.readlink(dst / "dangling") == "does/not/exist"
    assert os.readlink(dst / "out-link") == os.readlink(src / "out-link")
    assert manifest["out-link"] == Entry("link", target=os.readlink(src / "out-link"))
    assert not any(rel.startswith("out-link/") for rel in manifest)


def test_a_manifest_holds_no_absolute_path_and_no_clock(src: Path) -> None:
    # What crosses to a worker: relative paths, digests, normalised modes, sizes, link targets. No mtime, no owner.
    manifest = manifest_of(src)
    assert all(not rel.startswith("/") for rel in manifest)
    assert manifest["a.txt"] == Entry("file", digest=sha(b"alpha"), mode=0o644, size=5)
    assert manifest["empty"] == Entry("dir")
    os.utime(src / "a.txt", (FAR_FUTURE_S, FAR_FUTURE_S))
    assert manifest_of(src) == manifest


# -- hydration is verified --------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_hydrating_a_blob_that_is_corrupt_or_missing_is_input_unavailable_and_nothing_lands_under_its_name(
    src: Path, store: ArtifactStore, tmp_path: Path, how: str
) -> None:
    manifest = shipped(src, store)
    rel = "nested/deep/c.bin"
    damage(store, manifest[rel].digest, how)
    dst = tmp_path / "worker"
    dst.mkdir()
    with pytest.raises(RemoteError) as ei:
        hydrate(manifest, store, dst)
    assert ei.value.code == "input_unavailable"
    assert ei.value.details["path"] == rel
    assert rel in str(ei.value)
    assert not os.path.lexists(dst / rel)
    assert os.listdir(dst / "nested" / "deep") == []  # no half-written temp file either


def test_hydrating_a_manifest_naming_a_path_outside_the_tree_writes_nothing(
    file_store: ArtifactStore, tmp_path: Path, outside: Path
) -> None:
    d = file_store.put_bytes(b"payload")
    dst = tmp_path / "worker"
    dst.mkdir()
    before = snapshot(dst, outside)
    with pytest.raises(RemoteError) as ei:
        hydrate(
            {"ok.txt": Entry("file", digest=d, mode=0o644, size=7), "../outside/x": Entry("dir")},
            file_store,
            dst,
        )
    assert ei.value.code == "invalid_delta"
    assert snapshot(dst, outside) == before


# -- upload: the memo, and force --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_upload_with_force_repairs_a_corrupt_or_missing_blob(
    src: Path, store: ArtifactStore, tmp_path: Path, how: str
) -> None:
    manifest = shipped(src, store)
    damage(store, manifest["a.txt"].digest, how)
    first = tmp_path / "first"
    first.mkdir()
    with pytest.raises(RemoteError):
        hydrate(manifest, store, first)

    # Only the damaged blob is sent again: an intact one is left alone (another worker may be reading it).
    assert upload(src, manifest, store, force=True) == 1
    second = tmp_path / "second"
    second.mkdir()
    hydrate(manifest, store, second)
    assert manifest_of(second) == manifest


def test_upload_asks_the_store_only_about_blobs_this_process_has_not_seen_so_a_stale_memo_needs_force(
    src: Path, store: ArtifactStore, tmp_path: Path
) -> None:
    manifest = manifest_of(src)
    distinct = {e.digest for e in manifest.values() if e.kind == "file"}
    # A blob already in the store (put by someone else) is asked about, found, and not sent.
    store.put_bytes(b"alpha")
    assert upload(src, manifest, store) == len(distinct) - 1
    assert upload(src, manifest, store) == 0

    # Deleted since (a gc): this process still believes it is there, and sends nothing...
    gone = manifest["bin/run.sh"].digest
    store.delete_blob(gone)
    assert upload(src, manifest, store) == 0
    assert not store.has(gone)
    stale = tmp_path / "stale"
    stale.mkdir()
    with pytest.raises(RemoteError) as ei:
        hydrate(manifest, store, stale)
    assert ei.value.code == "input_unavailable"

    # ...which is exactly what force is for: every blob is read, whatever the memo says, and the lost one sent.
    assert upload(src, manifest, store, force=True) == 1
    assert store.has(gone)
    repaired = tmp_path / "repaired"
    repaired.mkdir()
    hydrate(manifest, store, repaired)
    assert manifest_of(repaired) == manifest


def test_upload_refuses_a_file_that_changed_since_its_manifest_was_taken(
    src: Path, file_store: ArtifactStore
) -> None:
    manifest = manifest_of(src)
    (src / "a.txt").write_bytes(b"ALPHA")
    with pytest.raises(ArtifactError) as ei:
        upload(src, manifest, file_store)
    assert ei.value.code == "digest_mismatch"
    assert not file_store.has(sha(b"ALPHA"))


# -- delta_of is by content -------------------------------------------------------------------------------------


@pytest.mark.parametrize("when_s", [FAR_PAST_S, FAR_FUTURE_S], ids=["far-past", "far-future"])
def test_rewriting_identical_bytes_with_any_mtime_is_not_a_change(
    src: Path, file_store: ArtifactStore, when_s: int
) -> None:
    before = manifest_of(src)
    (src / "a.txt").write_bytes(b"alpha")
    os.utime(src / "a.txt", (when_s, when_s))
    os.utime(src / "bin", (when_s, when_s))
    assert delta_of(src, before, file_store) == Delta((), ())


def test_changing_content_while_restoring_the_old_mtime_is_a_change(
    src: Path, file_store: ArtifactStore
) -> None:
    before = manifest_of(src)
    st = os.stat(src / "a.txt")
    (src / "a.txt").write_bytes(b"ALPHA")  # same size, other bytes
    os.utime(src / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    delta = delta_of(src, before, file_store)
    assert delta == Delta((("a.txt", Entry("file", digest=sha(b"ALPHA"), mode=0o644, size=5)),), ())


def _create(root: Path) -> None:
    (root / "new.txt").write_bytes(b"new")


def _modify(root: Path) -> None:
    (root / "a.txt").write_bytes(b"alpha, longer")


def _remove(root: Path) -> None:
    (root / "dup.txt").unlink()


def _chmod_x(root: Path) -> None:
    os.chmod(root / "zero", 0o755)


def _new_empty_dir(root: Path) -> None:
    (root / "fresh").mkdir()


def _remove_dir(root: Path) -> None:
    shutil.rmtree(root / "nested")


def _file_to_dir(root: Path) -> None:
    (root / "a.txt").unlink()
    (root / "a.txt").mkdir()
    (root / "a.txt" / "inner.txt").write_bytes(b"inner")


def _dir_to_file(root: Path) -> None:
    shutil.rmtree(root / "bin")
    (root / "bin").write_bytes(b"now a file")


def _new_link(root: Path) -> None:
    os.symlink("bin/run.sh", root / "ln2")


def _retarget_link(root: Path) -> None:
    os.unlink(root / "link-to-a")
    os.symlink("dup.txt", root / "link-to-a")


#: (mutation, {changed path: kind}, {removed paths}) — the exact delta each body change must produce.
CASES: list[tuple[Callable[[Path], None], dict[str, str], set[str]]] = [
    (_create, {"new.txt": "file"}, set()),
    (_modify, {"a.txt": "file"}, set()),
    (_remove, {}, {"dup.txt"}),
    (_chmod_x, {"zero": "file"}, set()),
    (_new_empty_dir, {"fresh": "dir"}, set()),
    (_remove_dir, {}, {"nested", "nested/deep", "nested/deep/c.bin"}),
    (_file_to_dir, {"a.txt": "dir", "a.txt/inner.txt": "file"}, set()),
    (_dir_to_file, {"bin": "file"}, {"bin/run.sh"}),
    (_new_link, {"ln2": "link"}, set()),
    (_retarget_link, {"link-to-a": "link"}, set()),
]
CASE_IDS = [fn.__name__.lstrip("_") for fn, _, _ in CASES]


@pytest.mark.parametrize(("mutate", "changed", "removed"), CASES, ids=CASE_IDS)
def test_delta_of_names_exactly_what_the_body_changed(
    src: Path,
    file_store: ArtifactStore,
    mutate: Callable[[Path], None],
    changed: dict[str, str],
    removed: set[str],
) -> None:
    before = manifest_of(src)
    mutate(src)
    delta = delta_of(src, before, file_store)
    assert {rel: e.kind for rel, e in delta.changed} == changed
    assert set(delta.removed) == removed
    if "zero" in changed:
        assert dict(delta.changed)["zero"] == Entry("file", digest=sha(b""), mode=0o755, size=0)


def test_delta_of_stores_the_blob_of_every_changed_file_before_returning_and_only_those(
    src: Path, store: ArtifactStore
) -> None:
    before = manifest_of(src)  # nothing uploaded: the store starts empty
    _create(src)
    _modify(src)
    delta = delta_of(src, before, store)
    digests = {e.digest for _, e in delta.changed if e.kind == "file"}
    assert digests == {sha(b"new"), sha(b"alpha, longer")}
    assert all(isinstance(store.check_blob(d), Intact) for d in digests)
    assert not store.has(before["bin/run.sh"].digest)  # an unchanged file is not shipped back


# -- apply_delta reproduces the worker's tree -------------------------------------------------------------------


def _all_at_once(root: Path) -> None:
    for fn, _, _ in CASES:
        fn(root)


@pytest.mark.parametrize(
    "mutate", [fn for fn, _, _ in CASES] + [_all_at_once], ids=[*CASE_IDS, "all-at-once"]
)
def test_applying_a_workers_delta_to_a_copy_of_the_original_reproduces_the_workers_tree(
    src: Path, store: ArtifactStore, tmp_path: Path, mutate: Callable[[Path], None]
) -> None:
    manifest = shipped(src, store)
    coordinator = tmp_path / "coordinator"
    shutil.copytree(src, coordinator, symlinks=True)
    worker = tmp_path / "worker"
    worker.mkdir()
    hydrate(manifest, store, worker)

    mutate(worker)
    delta = delta_of(worker, manifest, store)
    apply_delta(delta, store, coordinator)
    assert manifest_of(coordinator) == manifest_of(worker)


# -- apply_delta: a delta is untrusted ------------------------------------------------------------------------------


HOSTILE_PATHS = [
    "../x",
    "/etc/x",
    "a/../../x",
    "a//b",
    "./a",
    "",
    "a\\b",
    "a\x00b",
    "..",
    "a/",
    "a/..",
]


def _payload(store: ArtifactStore) -> Entry:
    return Entry("file", digest=store.put_bytes(b"payload"), mode=0o644, size=7)


@pytest.mark.parametrize("where", ["changed", "removed"])
@pytest.mark.parametrize("bad", HOSTILE_PATHS, ids=repr)
def test_a_delta_naming_a_path_that_is_not_normalised_and_inside_is_refused_before_anything_is_written(
    src: Path, file_store: ArtifactStore, outside: Path, bad: str, where: str
) -> None:
    payload = _payload(file_store)
    # Legitimate entries first: a refusal that came after writing them would show in the snapshot.
    changed: tuple[tuple[str, Entry], ...] = (("legit.txt", payload), ("fresh", Entry("dir")))
    removed: tuple[str, ...] = ("a.txt",)
    if where == "changed":
        changed += ((bad, payload),)
    else:
        removed += (bad,)
    before = snapshot(src, outside)
    with pytest.raises(RemoteError) as ei:
        apply_delta(Delta(changed, removed), file_store, src)
    assert ei.value.code == "invalid_delta"
    assert snapshot(src, outside) == before


def test_a_delta_writing_under_a_link_that_points_outside_the_tree_is_refused_and_nothing_lands_outside(
    src: Path, file_store: ArtifactStore, outside: Path
) -> None:
    payload = _payload(file_store)
    before = snapshot(src, outside)
    with pytest.raises(RemoteError) as ei:
        apply_delta(Delta((("out-link/x", payload),), ()), file_store, src)
    assert ei.value.code == "invalid_delta"
    assert snapshot(src, outside) == before


@pytest.mark.parametrize(
    "delta_of_store",
    [
        pytest.param(lambda p: Delta((("out-link/x", p),), ("a.txt",)), id="after-a-removal"),
        pytest.param(lambda p: Delta((("fresh", Entry("dir")), ("out-link/x", p)), ()), id="after-a-new-dir"),
        pytest.param(lambda p: Delta((), ("bin/run.sh", "out-link/secret.txt")), id="removal-under-the-link"),
    ],
)
def test_a_delta_with_a_path_under_a_link_leading_outside_is_refused_before_any_of_its_other_paths_is_written(
    src: Path, file_store: ArtifactStore, outside: Path, delta_of_store: Callable[[Entry], Delta]
) -> None:
    delta = delta_of_store(_payload(file_store))
    before = snapshot(src, outside)
    with pytest.raises(RemoteError) as ei:
        apply_delta(delta, file_store, src)
    assert ei.value.code == "invalid_delta"
    assert snapshot(src, outside) == before


def test_a_delta_naming_one_path_twice_is_refused_before_anything_is_written(
    src: Path, file_store: ArtifactStore
) -> None:
    payload = _payload(file_store)
    other = Entry("file", digest=file_store.put_bytes(b"other"), mode=0o644, size=5)
    before = snapshot(src)
    with pytest.raises(RemoteError) as ei:
        apply_delta(
            Delta((("legit.txt", payload), ("a.txt", payload), ("legit.txt", other)), ()), file_store, src
        )
    assert ei.value.code == "invalid_delta"
    assert snapshot(src) == before


@pytest.mark.parametrize(
    "entry",
    [
        Entry("fifo"),  # type: ignore[arg-type]
        Entry("socket", digest=sha(b"payload")),  # type: ignore[arg-type]
        Entry("file", digest=sha(b"payload"), mode=0o4755, size=7),
        Entry("file", digest=sha(b"payload"), mode=0o777, size=7),
        Entry("file", digest=sha(b"payload"), mode=0o600, size=7),
        Entry("file", digest=sha(b"payload"), mode=0, size=7),
    ],
    ids=["kind-fifo", "kind-socket", "setuid", "world-writable", "0o600", "mode-0"],
)
def test_a_delta_with_an_unknown_kind_or_a_file_mode_other_than_644_or_755_is_refused_before_anything_is_written(
    src: Path, file_store: ArtifactStore, entry: Entry
) -> None:
    payload = _payload(file_store)
    before = snapshot(src)
    with pytest.raises(RemoteError) as ei:
        apply_delta(Delta((("legit.txt", payload), ("odd", entry)), ("a.txt",)), file_store, src)
    assert ei.value.code == "invalid_delta"
    assert snapshot(src) == before


def test_a_delta_over_the_entry_budget_is_refused_before_anything_is_written(
    src: Path, file_store: ArtifactStore
) -> None:
    payload = _payload(file_store)
    delta = Delta(tuple((f"f{i}.txt", payload) for i in range(3)), ("a.txt",))
    before = snapshot(src)
    with pytest.raises(RemoteError) as ei:
        apply_delta(delta, file_store, src, budget=3)
    assert ei.value.code == "invalid_delta"
    assert snapshot(src) == before
    apply_delta(delta, file_store, src, budget=4)  # at the budget: applied
    assert not (src / "a.txt").exists() and (src / "f2.txt").read_bytes() == b"payload"


@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_applying_a_delta_whose_blob_is_missing_or_corrupt_is_output_unavailable_and_the_file_is_not_written(
    src: Path, store: ArtifactStore, how: str
) -> None:
    data = b"the worker's output"
    d = store.put_bytes(data)
    damage(store, d, how)
    with pytest.raises(RemoteError) as ei:
        apply_delta(
            Delta((("out/result.bin", Entry("file", digest=d, mode=0o644, size=len(data))),), ()), store, src
        )
    assert ei.value.code == "output_unavailable"
    assert ei.value.details["path"] == "out/result.bin"
    assert not os.path.lexists(src / "out" / "result.bin")


# -- only files, directories and links travel -------------------------------------------------------------------


def test_a_fifo_in_the_tree_is_unsupported_tree_when_shipping_and_when_diffing(
    src: Path, file_store: ArtifactStore
) -> None:
    before = manifest_of(src)
    os.mkfifo(src / "nested" / "pipe")
    with pytest.raises(RemoteError) as ei:
        manifest_of(src)
    assert ei.value.code == "unsupported_tree"
    assert ei.value.details["path"] == "nested/pipe"
    with pytest.raises(RemoteError) as ei2:
        delta_of(src, before, file_store)
    assert ei2.value.code == "unsupported_tree"


def test_a_delta_creating_a_link_and_a_path_under_it_is_refused_before_anything_is_written(
    src: Path, file_store: ArtifactStore, outside: Path
) -> None:
    # delta_of never reports a path under a link it reports: such a delta would drop the file (the link replaces
    # the directory it was written into) or aim at whatever the link points to. Refused whole.
    payload = _payload(file_store)
    before = snapshot(src, outside)
    delta = Delta((("ln", Entry("link", target=str(outside))), ("ln/x", payload)), ())
    with pytest.raises(RemoteError) as ei:
        apply_delta(delta, file_store, src)
    assert ei.value.code == "invalid_delta"
    assert snapshot(src, outside) == before
