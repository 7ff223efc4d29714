"""A worker's delta may never remove or replace the root of the tree it is applied to (boundary/transfer.py): ``.``,
``""``, ``./`` — removed, or reported as a file, a link or a directory — are ``RemoteError(invalid_delta)``
before a byte is written or removed, and the coordinator's sandbox is left exactly as it was. A delta writing
under a path it reports as a file is refused the same way (it would otherwise fail half-way with an untyped
``OSError``), while replacing a directory by a file or a link — a removed path under a reported leaf — still
applies. Real files and a real ``file://`` artifact store."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from _trees import snapshot as tree_snapshot

from smthrs_plugin.boundary.transfer import Delta, Entry, apply_delta, delta_of, hydrate, manifest_of, upload
from smthrs_plugin.errors import RemoteError
from smthrs_plugin.stores.artifacts import ArtifactStore

ROOT_SPELLINGS = [".", "", "./"]


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "artifacts").as_uri())


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The coordinator's sandbox: files, a nested directory, a link."""
    root = tmp_path / "sandbox"
    (root / "src" / "deep").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"alpha")
    (root / "src" / "deep" / "b.txt").write_bytes(b"beta")
    os.symlink("a.txt", root / "link-to-a")
    return root


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Everything observable under ``root`` and the root itself (links not followed)."""
    return {".": ("dir" if root.is_dir() and not root.is_symlink() else "gone",), **tree_snapshot(root)}


def _payload(store: ArtifactStore) -> Entry:
    return Entry("file", digest=store.put_bytes(b"payload"), mode=0o644, size=7)


def _refused(delta: Delta, store: ArtifactStore, tree: Path) -> RemoteError:
    before = snapshot(tree)
    with pytest.raises(RemoteError) as ei:
        apply_delta(delta, store, tree)
    assert ei.value.code == "invalid_delta", ei.value
    assert snapshot(tree) == before
    return ei.value


@pytest.mark.parametrize("root", ROOT_SPELLINGS, ids=repr)
def test_a_delta_removing_the_root_is_invalid_delta_and_the_sandbox_is_untouched(
    tree: Path, store: ArtifactStore, root: str
) -> None:
    # Legitimate paths around it: a refusal that came after applying them would show in the snapshot.
    delta = Delta((("legit.txt", _payload(store)),), ("a.txt", root, "src/deep/b.txt"))
    _refused(delta, store, tree)
    assert (tree / "a.txt").read_bytes() == b"alpha"


@pytest.mark.parametrize("root", ROOT_SPELLINGS, ids=repr)
@pytest.mark.parametrize("kind", ["file", "link", "dir"])
def test_a_delta_replacing_the_root_by_a_file_a_link_or_a_directory_is_invalid_delta_and_nothing_is_written(
    tree: Path, store: ArtifactStore, tmp_path: Path, root: str, kind: str
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    entry = {
        "file": _payload(store),
        "link": Entry("link", target=str(elsewhere)),
        "dir": Entry("dir"),
    }[kind]
    delta = Delta((("legit.txt", _payload(store)), (root, entry)), ("a.txt",))
    _refused(delta, store, tree)
    assert list(elsewhere.iterdir()) == []


def test_a_delta_writing_under_a_path_it_reports_as_a_file_is_invalid_delta_before_anything_is_written(
    tree: Path, store: ArtifactStore
) -> None:
    payload = _payload(store)
    delta = Delta((("legit.txt", payload), ("made", payload), ("made/inner.txt", payload)), ("a.txt",))
    err = _refused(delta, store, tree)
    assert err.details["path"] == "made/inner.txt"


@pytest.mark.parametrize("leaf", ["file", "link"])
def test_a_directory_replaced_by_a_file_or_a_link_on_the_worker_still_applies(
    tree: Path, store: ArtifactStore, tmp_path: Path, leaf: str
) -> None:
    # The delta of that change names the removed children under the new leaf: that is not a write under it.
    manifest = manifest_of(tree)
    upload(tree, manifest, store)
    worker = tmp_path / "worker"
    worker.mkdir()
    hydrate(manifest, store, worker)
    shutil.rmtree(worker / "src")
    if leaf == "file":
        (worker / "src").write_bytes(b"now a file")
    else:
        os.symlink("a.txt", worker / "src")
    delta = delta_of(worker, manifest, store)
    assert "src/deep/b.txt" in delta.removed
    apply_delta(delta, store, tree)
    assert manifest_of(tree) == manifest_of(worker)
