"""Real processes racing on one artifact store (file:// and s3:// on moto): first writer wins, readers never
see an entry before its blob, and a writer killed mid-transfer leaves nothing visible."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import _artifact_workers as workers
import pytest
from _procs import worker_processes

from smthrs_plugin.stores.artifacts import ArtifactStore

pytestmark = pytest.mark.slow
PROCS = worker_processes("_artifact_workers", "s3fs")
WRITERS = 8


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A store several processes can see (memory:// is per process, so it is not in this suite)."""
    if request.param == "file":
        return (tmp_path / "artifacts").as_uri(), {}
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/shared", request.getfixturevalue("s3_options")


def test_eight_processes_publish_one_entry_exactly_one_wins(shared_url: tuple[str, dict[str, Any]]) -> None:
    url, options = shared_url
    barrier = PROCS.Barrier(WRITERS + 1)
    stop = PROCS.Event()
    results = PROCS.Queue()
    reads = PROCS.Queue()
    procs = [
        PROCS.Process(target=workers.publish, args=(url, options, i, barrier, results))
        for i in range(WRITERS)
    ]
    reader = PROCS.Process(target=workers.poll, args=(url, options, barrier, stop, reads))
    for p in [*procs, reader]:
        p.start()
    try:
        outcomes = [results.get(timeout=120) for _ in range(WRITERS)]
        stop.set()
        seen, violations = reads.get(timeout=120)
    finally:
        stop.set()
        for p in [*procs, reader]:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in [*procs, reader])
    kinds = sorted(kind for _, kind, _, _ in outcomes)
    assert kinds == ["Created"] + ["Existing"] * (WRITERS - 1)
    winner = next(o for o in outcomes if o[1] == "Created")
    final = ArtifactStore(url, options).get_entry(workers.ENTRY)
    assert final is not None
    # the surviving entry is exactly one writer's complete bytes, and every loser was told so
    assert hashlib.sha256(final).hexdigest() == winner[2]
    assert {o[3] for o in outcomes} == {winner[2]}
    assert seen >= 1
    assert violations == []


def test_writer_killed_mid_transfer_leaves_no_visible_blob(
    shared_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, options = shared_url
    src = tmp_path / "big.bin"
    data = os.urandom(2**20) * 14
    src.write_bytes(data)
    out = PROCS.Queue()
    p = PROCS.Process(target=workers.put_then_hang, args=(url, options, str(src), out))
    p.start()
    try:
        assert out.get(timeout=120) == "half"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.join(timeout=60)
    assert p.exitcode == -signal.SIGKILL
    store = ArtifactStore(url, options)
    digest = hashlib.sha256(data).hexdigest()
    assert not store.has(digest)
    assert list(store.iter_blobs()) == []
    if url.startswith("file://"):
        assert store.purge_staging(older_than_s=0) == 1  # the dead writer's staging file, never a blob
    assert store.put_file(src) == digest
    assert store.get_bytes(digest) == data
