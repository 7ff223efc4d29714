"""Small files cross inline under remote execution (prefect/_remote.py, boundary/transfer.py): a shipment carries
the bytes of the sandbox's small files and a delta those of the small files a body changed, by digest, instead of
one store round trip per file each way. What must hold: an inline input is never uploaded and needs no store to
hydrate; an inline output is still stored (a delta never names a blob the store lacks) and is applied without a
store read; inline bytes are verified against their digest where they land, before anything is written; the
inline budget per file and per tree is kept, and what is over it goes through the store as before."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from smthrs_plugin.boundary.transfer import (
    INLINE_FILE_MAX,
    INLINE_TOTAL_MAX,
    Delta,
    apply_delta,
    hydrate,
    manifest_of,
    shipped_tree,
    upload,
)
from smthrs_plugin.errors import RemoteError
from smthrs_plugin.prefect._remote import RemoteTarget, _Box, _Returned, _run_body, _Shipment
from smthrs_plugin.stores.artifacts import ArtifactStore

pytestmark = pytest.mark.prefect

BIG = b"large input " + b"y" * INLINE_FILE_MAX


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "coordinator-tree"
    (root / "in").mkdir(parents=True)
    (root / "in" / "small.txt").write_bytes(b"small input")
    (root / "in" / "big.bin").write_bytes(BIG)
    (root / "tool.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(root / "tool.sh", 0o755)
    return root


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "artifacts").as_uri())


def _body(root: Path) -> int:
    (root / "out").mkdir()
    (root / "out" / "small.txt").write_bytes((root / "in" / "small.txt").read_bytes().upper())
    (root / "out" / "big.bin").write_bytes((root / "in" / "big.bin").read_bytes().upper())
    return len((root / "in" / "big.bin").read_bytes())


class _Done:
    def __init__(self, state: Any) -> None:
        self.state = state

    def wait(self) -> None:
        return None


class PicklingRunner:
    """Stands in for a task runner (not for smthrs code): runs the body task's function here on a cloudpickled
    copy of what a worker would receive, and keeps the shipment it saw."""

    def __init__(self) -> None:
        self.shipments: list[_Shipment] = []

    def submit(self, task: Any, parameters: dict[str, Any]) -> _Done:
        from prefect.states import Completed

        shipped = cloudpickle.loads(cloudpickle.dumps(parameters))
        self.shipments.append(shipped["box"].shipment)
        value = cloudpickle.loads(cloudpickle.dumps(task.fn(**shipped)))
        return _Done(Completed(data=value))


def test_small_inputs_ride_with_the_shipment_and_are_never_uploaded_while_a_large_one_is(
    tree: Path, store: ArtifactStore
) -> None:
    manifest = manifest_of(tree)
    runner = PicklingRunner()
    assert RemoteTarget.of(runner, store, "remote").run("n #1 · remote", _body, tree) == len(BIG)

    (shipment,) = runner.shipments
    small, tool, big = (manifest[p].digest for p in ("in/small.txt", "tool.sh", "in/big.bin"))
    assert set(shipment.inline) == {small, tool}
    assert not store.has(small) and not store.has(tool)  # never went through the store
    assert store.has(big)
    assert (tree / "out" / "small.txt").read_bytes() == b"SMALL INPUT"
    assert (tree / "out" / "big.bin").read_bytes() == BIG.upper()


def test_small_outputs_come_back_inline_are_stored_too_and_apply_without_a_store_read(
    tree: Path, store: ArtifactStore, tmp_path: Path
) -> None:
    manifest, inline = shipped_tree(tree)
    upload(tree, manifest, store, skip=inline)
    out = _run_body(_Box(_Shipment(_body, manifest, store, inline)), "n #1 · remote")
    assert isinstance(out, _Returned)
    changed = dict(out.delta.changed)
    small, big = changed["out/small.txt"].digest, changed["out/big.bin"].digest
    assert dict(out.delta.inline) == {small: b"SMALL INPUT"}
    assert store.has(small) and store.has(big)  # every changed blob is stored before the delta returns

    store.delete_blob(small)  # the coordinator applies the small output from the delta alone
    copy = tmp_path / "copy"
    copy.mkdir()
    hydrate(manifest, store, copy, inline=inline)
    apply_delta(out.delta, store, copy)
    assert (copy / "out" / "small.txt").read_bytes() == b"SMALL INPUT"
    assert (copy / "out" / "big.bin").read_bytes() == BIG.upper()
    assert manifest_of(copy)["out/small.txt"] == changed["out/small.txt"]


def test_inline_bytes_that_do_not_hash_to_their_digest_are_refused_before_anything_is_written(
    tree: Path, store: ArtifactStore, tmp_path: Path
) -> None:
    manifest, inline = shipped_tree(tree)
    upload(tree, manifest, store, skip=inline)
    small = manifest["in/small.txt"].digest
    forged = {**inline, small: b"something else"}
    dest = tmp_path / "hydrated"
    dest.mkdir()
    with pytest.raises(RemoteError) as ei:
        hydrate(manifest, store, dest, inline=forged)
    assert ei.value.code == "input_unavailable"
    assert not (dest / "in" / "small.txt").exists()

    out = _run_body(_Box(_Shipment(_body, manifest, store, inline)), "n #1 · remote")
    digest = dict(out.delta.changed)["out/small.txt"].digest
    tampered = Delta(out.delta.changed, out.delta.removed, ((digest, b"not the output"),))
    with pytest.raises(RemoteError) as ei:
        apply_delta(tampered, store, tree)
    assert ei.value.code == "invalid_delta"
    assert not (tree / "out").exists()


def test_the_inline_budget_per_file_and_per_tree_is_kept_and_the_rest_goes_through_the_store(
    tmp_path: Path, store: ArtifactStore
) -> None:
    root = tmp_path / "many"
    root.mkdir()
    count = INLINE_TOTAL_MAX // INLINE_FILE_MAX + 3
    for i in range(count):
        (root / f"f{i:03d}.bin").write_bytes(bytes([i]) * INLINE_FILE_MAX)
    (root / "over.bin").write_bytes(b"z" * (INLINE_FILE_MAX + 1))
    manifest, inline = shipped_tree(root)
    assert sum(len(b) for b in inline.values()) <= INLINE_TOTAL_MAX
    assert 0 < len(inline) < count
    assert manifest["over.bin"].digest not in inline
    assert manifest == manifest_of(root)
    dest = tmp_path / "dest"
    dest.mkdir()
    upload(root, manifest, store, skip=inline)
    hydrate(manifest, store, dest, inline=inline)
    assert manifest_of(dest) == manifest
