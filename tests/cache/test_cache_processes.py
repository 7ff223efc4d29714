"""Eight real processes (eight "machines") dispatch the same key at once against one shared tier, on file:// and
on s3:// (moto): exactly one shared entry, one value for everybody, and no reader ever sees an entry before its
blobs."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import _cache_workers as workers
import pytest

from smthrs_plugin.canonical import key_digest
from smthrs_plugin.stores.artifacts import ArtifactStore

pytestmark = pytest.mark.slow
SPAWN = mp.get_context("spawn")
PROCESSES = 8


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return (tmp_path / "shared").as_uri(), {}
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/shared", request.getfixturevalue("s3_options")


def test_eight_processes_dispatching_one_key_publish_one_entry_and_agree(
    shared_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, options = shared_url
    barrier = SPAWN.Barrier(PROCESSES + 1)
    stop = SPAWN.Event()
    results = SPAWN.Queue()
    reads = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=workers.dispatch_once, args=(str(tmp_path), i, url, options, barrier, results))
        for i in range(PROCESSES)
    ]
    poller = SPAWN.Process(target=workers.poll_entries, args=(url, options, barrier, stop, reads))
    for p in [*procs, poller]:
        p.start()
    try:
        outcomes = [results.get(timeout=180) for _ in range(PROCESSES)]
        stop.set()
        seen, violations = reads.get(timeout=120)
    finally:
        stop.set()
        for p in [*procs, poller]:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in [*procs, poller])
    assert [o[7] for o in outcomes] == [None] * PROCESSES  # no dispatch failed
    keys = {o[6] for o in outcomes}
    assert len(keys) == 1  # the same key everywhere (same declaration, same input bytes)
    assert ArtifactStore(url, options).list_entries() == [key_digest(keys.pop())]
    assert len({repr(o[3]) for o in outcomes}) == 1  # one value for everybody
    assert len({o[5] for o in outcomes}) == 1  # byte-identical outputs everywhere
    built = [o for o in outcomes if o[1] == "built"]
    served = [o for o in outcomes if o[1] == "clean"]
    assert len(built) + len(served) == PROCESSES and built
    assert [o[4] for o in built].count("published") == 1  # exactly one creator; the others found it existing
    assert {o[4] for o in built} <= {"published", "existing"}
    assert {o[2] for o in served} <= {"VerifiedHit"}
    assert seen >= 1 and violations == []
