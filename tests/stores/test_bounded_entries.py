"""``ArtifactStore.get_entry`` reads bounded: whoever can write the store can plant anything at an entry's name (a
huge object, a FIFO, a directory, a link to a device), and a reader must neither exhaust its memory nor block on
it — a typed ``ArtifactError`` (``too_large``, ``not_a_file``) instead. On file://, memory:// and s3:// (moto)."""

from __future__ import annotations

import concurrent.futures
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from smthrs_plugin.errors import ArtifactError
from smthrs_plugin.stores.artifacts import MAX_ENTRY_BYTES, ArtifactStore, Created, Existing

DEADLINE_S = 60.0


@pytest.fixture
def store(artifacts_url: tuple[str, dict[str, Any]]) -> ArtifactStore:
    url, options = artifacts_url
    return ArtifactStore(url, options)


@pytest.fixture
def local(tmp_path: Path) -> ArtifactStore:
    s = ArtifactStore((tmp_path / "artifacts").as_uri())
    s.put_entry("warm", b"{}")  # creates ac/
    return s


def plant(store: ArtifactStore, name: str, data: bytes) -> None:
    """Write ``data`` at the entry's name behind the store's back (as a bucket writer would)."""
    path = store.entry_path(name)
    if store.kind == "local":
        os.makedirs(os.path.dirname(path), exist_ok=True)
    store.fs.pipe_file(path, data)


def refusal(fn: Callable[[], Any]) -> ArtifactError:
    with pytest.raises(ArtifactError) as caught:
        fn()
    return caught.value


def test_an_entry_of_the_cap_is_read_and_one_byte_more_is_too_large(store: ArtifactStore) -> None:
    plant(store, "at-cap", b"x" * 1000)
    plant(store, "over-cap", b"x" * 1001)
    assert store.get_entry("at-cap", max_bytes=1000) == b"x" * 1000
    err = refusal(lambda: store.get_entry("over-cap", max_bytes=1000))
    assert (err.code, err.details["limit"], err.details["name"]) == ("too_large", 1000, "over-cap")
    assert "smthrs cache verify --with-shared" in err.message
    assert store.get_entry("absent") is None
    assert MAX_ENTRY_BYTES == 32 * 1024 * 1024  # the default every shared-tier reader uses


def test_an_oversize_entry_is_read_no_further_than_the_cap(store: ArtifactStore) -> None:
    size, cap = 8 * 2**20, 64 * 1024
    plant(store, "huge", os.urandom(size))
    plant(store, "small", b"{}")
    assert store.get_entry("small") == b"{}"  # the client is open before measuring (its own set-up allocates)
    if store.kind == "s3":
        # What S3 sent is the measure (moto's server runs in this process: its own copy would blur a heap peak).
        sent: list[int] = []

        def received(http_response: Any, **_: Any) -> None:
            sent.append(int(http_response.headers["content-length"]))

        events = store.fs.s3.meta.events
        events.register("after-call.s3.GetObject", received)
        try:
            assert refusal(lambda: store.get_entry("huge", max_bytes=cap)).code == "too_large"
        finally:
            events.unregister("after-call.s3.GetObject", received)
        assert sent == [cap + 1]
        return
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        err = refusal(lambda: store.get_entry("huge", max_bytes=cap))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.code == "too_large"
    assert peak < 2**20, f"refusing an {size}-byte entry allocated {peak} bytes"


def test_a_huge_sparse_file_is_refused_by_its_size_without_reading_it(local: ArtifactStore) -> None:
    path = local.entry_path("sparse")
    with open(path, "wb") as f:
        f.truncate(800 * 2**20)  # 800 MB on paper, no disk blocks
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        err = refusal(lambda: local.get_entry("sparse"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (err.code, err.details["limit"]) == ("too_large", MAX_ENTRY_BYTES)
    assert peak < 2**20, f"refusing an 800 MB entry allocated {peak} bytes"


def test_a_fifo_at_an_entry_name_is_refused_not_waited_on(local: ArtifactStore) -> None:
    path = local.entry_path("fifo")
    os.mkfifo(path)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: refusal(lambda: local.get_entry("fifo")))
        try:
            err = pending.result(timeout=DEADLINE_S)
        except concurrent.futures.TimeoutError:
            # A reader blocked in open(2): release it (a writer end) so the suite does not hang, then fail.
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("get_entry blocked on a FIFO planted at an entry's name")
    assert (err.code, err.details["name"]) == ("not_a_file", "fifo")


def test_a_directory_at_an_entry_name_is_not_a_file(local: ArtifactStore) -> None:
    os.makedirs(os.path.join(local.entry_path("dir"), "inside"))
    assert refusal(lambda: local.get_entry("dir")).code == "not_a_file"


def test_a_link_to_a_device_is_not_a_file(local: ArtifactStore) -> None:
    os.symlink("/dev/zero", local.entry_path("zero"))  # endless bytes if it were read
    assert refusal(lambda: local.get_entry("zero")).code == "not_a_file"


def test_publishing_over_an_unreadable_document_says_what_holds_the_name(local: ArtifactStore) -> None:
    os.mkfifo(local.entry_path("fifo"))
    with open(local.entry_path("huge"), "wb") as f:
        f.truncate(MAX_ENTRY_BYTES + 1)
    assert refusal(lambda: local.put_entry("fifo", b"{}")).code == "not_a_file"
    assert refusal(lambda: local.put_entry("huge", b"{}")).code == "too_large"
    assert isinstance(local.put_entry("fresh", b"{}"), Created)
    assert local.put_entry("fresh", b"[]") == Existing("fresh", b"{}")
