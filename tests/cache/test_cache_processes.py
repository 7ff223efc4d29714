"""Eight real processes (eight "machines") dispatch the same key at once against one shared tier, on file:// and
on s3:// (moto): exactly one servable shared entry per publisher key, one value for everybody, and no reader ever
sees an entry before its blobs (or a torn one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _cache_workers as workers
import pytest
from _procs import worker_processes

from smthrs_plugin.cache.shared import Candidate, check_document, entry_name
from smthrs_plugin.cache.signing import Trust
from smthrs_plugin.canonical import key_digest
from smthrs_plugin.stores.artifacts import ArtifactStore

pytestmark = pytest.mark.slow
PROCS = worker_processes("_cache_workers", "s3fs")
PROCESSES = 8


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return (tmp_path / "shared").as_uri(), {}
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/shared", request.getfixturevalue("s3_options")


def _race(
    tmp_path: Path, url: str, options: dict[str, Any], publishers: int
) -> tuple[list[tuple[Any, ...]], int, list[str]]:
    barrier = PROCS.Barrier(PROCESSES + 1)
    stop = PROCS.Event()
    results = PROCS.Queue()
    reads = PROCS.Queue()
    for p in range(publishers if publishers > 1 else 0):  # create the keys before the start line
        workers.publisher_trust(tmp_path, p, publishers)
    procs = [
        PROCS.Process(
            target=workers.dispatch_once, args=(str(tmp_path), i, url, options, barrier, results, publishers)
        )
        for i in range(PROCESSES)
    ]
    poller = PROCS.Process(target=workers.poll_entries, args=(url, options, barrier, stop, reads))
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
    return outcomes, seen, violations


def test_eight_processes_dispatching_one_key_publish_one_entry_and_agree(
    shared_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, options = shared_url
    outcomes, seen, violations = _race(tmp_path, url, options, publishers=1)
    assert [o[7] for o in outcomes] == [None] * PROCESSES  # no dispatch failed
    keys = {o[6] for o in outcomes}
    assert len(keys) == 1  # the same key everywhere (same declaration, same input bytes)
    (kid,) = {o[8] for o in outcomes}  # one team key
    assert ArtifactStore(url, options).list_entries() == [entry_name(key_digest(keys.pop()), kid)]
    assert len({repr(o[3]) for o in outcomes}) == 1  # one value for everybody
    assert len({o[5] for o in outcomes}) == 1  # byte-identical outputs everywhere
    built = [o for o in outcomes if o[1] == "built"]
    served = [o for o in outcomes if o[1] == "clean"]
    assert len(built) + len(served) == PROCESSES and built
    assert [o[4] for o in built].count("published") == 1  # exactly one creator; the others found it existing
    assert {o[4] for o in built} <= {"published", "existing"}
    assert {o[2] for o in served} <= {"VerifiedHit"}
    assert seen >= 1 and violations == []


def test_eight_processes_with_two_publisher_keys_leave_one_servable_entry_per_publisher(
    shared_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, options = shared_url
    outcomes, seen, violations = _race(tmp_path, url, options, publishers=2)
    assert [o[7] for o in outcomes] == [None] * PROCESSES
    (key,) = {o[6] for o in outcomes}
    kids = {o[8] for o in outcomes}
    assert len(kids) == 2
    store = ArtifactStore(url, options)
    names = store.list_entries()
    assert names and set(names) <= {entry_name(key_digest(key), k) for k in kids}
    trust = Trust(None, tuple(workers.publisher_trust(tmp_path, p, 2).signer.public for p in range(2)))  # type: ignore[union-attr]
    for name in names:  # each publisher's one entry verifies under the trusted keys
        assert isinstance(check_document(name, store.get_entry(name) or b"", trust), Candidate)
    for kid in kids:
        creators = [o for o in outcomes if o[8] == kid and o[4] == "published"]
        assert len(creators) == (1 if entry_name(key_digest(key), kid) in names else 0)
    assert len({repr(o[3]) for o in outcomes}) == 1 and len({o[5] for o in outcomes}) == 1
    assert seen >= 1 and violations == []
