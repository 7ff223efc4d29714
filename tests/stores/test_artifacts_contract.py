"""Artifact store contract: one suite, run on file://, memory:// and s3:// (moto's real S3 server)."""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
from pathlib import Path

import pytest

from smthrs_plugin.errors import ArtifactError
from smthrs_plugin.stores.artifacts import (
    ArtifactStore,
    Corrupt,
    Created,
    Deleted,
    Existing,
    Intact,
    NotFound,
)


@pytest.fixture
def store(artifacts_url: tuple[str, dict[str, str]]) -> ArtifactStore:
    url, options = artifacts_url
    return ArtifactStore(url, options)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_put_bytes_returns_sha256_and_get_bytes_round_trips(store: ArtifactStore) -> None:
    data = b"hello artifacts"
    d = store.put_bytes(data)
    assert d == sha(data)
    assert store.has(d)
    assert store.get_bytes(d) == data
    assert store.put_bytes(data) == d  # idempotent
    assert store.blob_path(d).endswith(f"/cas/sha256/{d[:2]}/{d[2:]}")


def test_empty_blob_round_trips(store: ArtifactStore) -> None:
    d = store.put_bytes(b"")
    assert store.get_bytes(d) == b""


def test_put_bytes_with_wrong_expected_digest_stores_nothing(store: ArtifactStore) -> None:
    with pytest.raises(ArtifactError) as ei:
        store.put_bytes(b"abc", expected_digest=sha(b"abd"))
    assert ei.value.code == "digest_mismatch"
    assert not store.has(sha(b"abc"))


@pytest.mark.parametrize("bad", ["ABC", "0" * 63, "G" * 64, "A" * 64, 12])
def test_malformed_digest_is_refused(store: ArtifactStore, bad: object) -> None:
    with pytest.raises(ArtifactError) as ei:
        store.get_bytes(bad)  # type: ignore[arg-type]
    assert ei.value.code == "invalid_digest"


def test_missing_blob_is_not_found(store: ArtifactStore, tmp_path: Path) -> None:
    d = sha(b"never stored")
    assert not store.has(d)
    with pytest.raises(ArtifactError) as ei:
        store.get_bytes(d)
    assert ei.value.code == "not_found"
    with pytest.raises(ArtifactError) as ei2:
        store.get_to_file(d, tmp_path / "out.bin")
    assert ei2.value.code == "not_found"
    assert not (tmp_path / "out.bin").exists()
    assert isinstance(store.check_blob(d), NotFound)


def test_tampered_blob_is_corrupt_and_never_served(store: ArtifactStore, tmp_path: Path) -> None:
    d = store.put_bytes(b"original bytes")
    store.fs.pipe_file(store.blob_path(d), b"evil bytes")  # tamper behind the store's back
    with pytest.raises(ArtifactError) as ei:
        store.get_bytes(d)
    assert ei.value.code == "corrupt"
    assert ei.value.details["actual"] == sha(b"evil bytes")
    dest_dir = tmp_path / "dest"
    dest_dir.mkdir()
    with pytest.raises(ArtifactError) as ei2:
        store.get_to_file(d, dest_dir / "out.bin")
    assert ei2.value.code == "corrupt"
    assert list(dest_dir.iterdir()) == []  # neither the file nor a temp file left behind
    assert store.check_blob(d) == Corrupt(d, sha(b"evil bytes"))
    with pytest.raises(ArtifactError):
        store.get_many([d])


def test_put_file_streams_a_multipart_sized_file_with_progress(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    data = os.urandom(3 * 2**20) * 4  # 12 MiB: more than one S3 part
    src.write_bytes(data)
    seen: list[tuple[int, int | None]] = []
    d = store.put_file(src, progress=lambda done, total: seen.append((done, total)))
    assert d == sha(data)
    assert seen and seen[-1] == (len(data), len(data))
    assert [s[0] for s in seen] == sorted(s[0] for s in seen)
    out = tmp_path / "out" / "copy.bin"
    out.parent.mkdir()
    got: list[int] = []
    store.get_to_file(d, out, progress=lambda done, total: got.append(done))
    assert out.read_bytes() == data
    assert got[-1] == len(data)
    assert isinstance(store.check_blob(d), Intact)


def test_put_file_with_wrong_expected_digest_stores_nothing(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "f.bin"
    src.write_bytes(b"measured once")
    with pytest.raises(ArtifactError) as ei:
        store.put_file(src, expected_digest=sha(b"measured twice"))
    assert ei.value.code == "digest_mismatch"
    assert list(store.iter_blobs()) == []


def test_batch_calls_keep_input_order(store: ArtifactStore) -> None:
    blobs = [f"blob-{i}".encode() * (i + 1) for i in range(10)]
    ds = store.put_many(blobs)
    assert ds == [sha(b) for b in blobs]
    missing = sha(b"absent")
    assert store.has_many([*ds[:3], missing]) == {ds[0]: True, ds[1]: True, ds[2]: True, missing: False}
    assert store.get_many(reversed(ds)) == {d: b for d, b in reversed(list(zip(ds, blobs, strict=True)))}
    with pytest.raises(ArtifactError) as ei:
        store.get_many([ds[0], missing])
    assert ei.value.code == "not_found"
    assert list(store.iter_blobs()) == sorted(ds)


def test_delete_blob_reports_what_it_did(store: ArtifactStore) -> None:
    d = store.put_bytes(b"gc me")
    assert store.delete_blob(d) == Deleted(d)
    assert store.delete_blob(d) == NotFound(d)
    assert not store.has(d)


def test_entries_are_first_writer_wins(store: ArtifactStore) -> None:
    assert store.get_entry("k1") is None
    assert store.put_entry("k1", b'{"v": 1}') == Created("k1")
    assert store.put_entry("k1", b'{"v": 2}') == Existing("k1", b'{"v": 1}')
    assert store.get_entry("k1") == b'{"v": 1}'
    store.put_entry("a0", b"{}")
    assert store.list_entries() == ["a0", "k1"]
    assert store.delete_entry("k1") == Deleted("k1")
    assert store.delete_entry("k1") == NotFound("k1")
    assert store.list_entries() == ["a0"]
    assert store.entry_path("a0").endswith("/ac/a0.json")


def test_writes_recreate_directories_removed_after_the_first_write(tmp_path: Path) -> None:
    # The local backend creates its directories when a write finds them missing (not before every write): a
    # store whose tree was pruned or wiped meanwhile (gc, an operator) must still take every write.
    import shutil

    store = ArtifactStore(str(tmp_path / "store"))
    store.put_entry("k1", b"{}")
    first = store.put_bytes(b"one")
    shutil.rmtree(tmp_path / "store")

    assert store.put_entry("k2", b'{"v": 2}') == Created("k2")
    second = store.put_bytes(b"two")
    src = tmp_path / "f.bin"
    src.write_bytes(b"three")
    third = store.put_file(src)

    assert store.get_entry("k2") == b'{"v": 2}'
    assert [store.get_bytes(d) for d in (second, third)] == [b"two", b"three"]
    assert not store.has(first) and store.get_entry("k1") is None


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "x" * 201, "sp ace"])
def test_bad_entry_names_are_refused_before_writing(store: ArtifactStore, bad: str) -> None:
    with pytest.raises(ArtifactError) as ei:
        store.put_entry(bad, b"{}")
    assert ei.value.code == "invalid_name"
    assert store.list_entries() == []


class Abort(Exception):
    pass


def test_half_written_blob_is_never_visible(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    data = os.urandom(2**20) * 12  # 12 MiB, several chunks and S3 parts
    src.write_bytes(data)

    def crash_halfway(done: int, total: int | None) -> None:
        if done >= len(data) // 2:
            raise Abort("writer died mid-transfer")

    with pytest.raises(Abort):
        store.put_file(src, progress=crash_halfway)
    d = sha(data)
    assert not store.has(d)
    assert list(store.iter_blobs()) == []
    with pytest.raises(ArtifactError) as ei:
        store.get_bytes(d)
    assert ei.value.code == "not_found"
    # the same store still works afterwards
    assert store.put_file(src) == d
    assert store.get_bytes(d) == data


def test_store_pickles_as_url_and_options(store: ArtifactStore) -> None:
    d = store.put_bytes(b"shared")
    _ = store.fs  # open the filesystem in this process first
    state = store.__getstate__()
    assert set(state) == {"url", "storage_options", "max_workers"}
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url
    assert clone.get_bytes(d) == b"shared"


def test_unknown_protocol_is_refused_at_construction() -> None:
    with pytest.raises(ArtifactError) as ei:
        ArtifactStore("ftp://example.com/cache")
    assert ei.value.code == "invalid_url"


def test_relative_local_path_is_resolved_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    s = ArtifactStore("rel/artifacts")
    assert s.url == "file://" + str(tmp_path / "rel" / "artifacts")
    d = s.put_bytes(b"x")
    assert (tmp_path / "rel" / "artifacts" / "cas" / "sha256" / d[:2] / d[2:]).read_bytes() == b"x"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_refusing_endpoint_is_unavailable_with_cause() -> None:
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": f"http://127.0.0.1:{_closed_port()}",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    store = ArtifactStore("s3://nobody-home/prefix", options)
    for call in (
        lambda: store.put_bytes(b"x"),
        lambda: store.get_bytes(sha(b"x")),
        lambda: store.get_entry("k"),
    ):
        with pytest.raises(ArtifactError) as ei:
            call()
        assert ei.value.code == "unavailable"
        assert ei.value.cause is not None
        assert "connect" in str(ei.value.cause).lower()
