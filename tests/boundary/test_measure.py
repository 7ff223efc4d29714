"""Measurement: SHA-256 of bytes, the stat cache with git's racy-clean rule, bounded sorted enumeration."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import IO

import pytest

from smthrs_plugin.boundary.measure import (
    ABSENT,
    DEFAULT_RACY_WINDOW_NS,
    STAT_CACHE_FILE,
    Measurer,
    StatCache,
    sha256_file,
)
from smthrs_plugin.errors import BoundaryError
from smthrs_plugin.plan.fileset import Glob

FUTURE = 10 * DEFAULT_RACY_WINDOW_NS  # a clock far enough ahead that fresh files are not racily clean


class CountingHash:
    """Injected hashing function: counts how many files were actually read."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, f: IO[bytes]) -> str:
        with self.lock:
            self.calls.append(getattr(f, "name", "?"))
        return sha256_file(f)


def write(root: Path, rel: str, data: bytes = b"x") -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_digest_is_sha256_of_the_bytes(tmp_path: Path) -> None:
    write(tmp_path, "a.txt", b"hello")
    m = Measurer(tmp_path)
    got = m.measure_entries(["a.txt", "missing.txt"])
    assert list(got) == ["a.txt", "missing.txt"]
    assert got["a.txt"] is not None and got["a.txt"].digest == hashlib.sha256(b"hello").hexdigest()
    assert got["a.txt"].size == 5
    assert got["missing.txt"] is None


def test_unchanged_100mb_file_is_not_read_again(tmp_path: Path) -> None:
    big = tmp_path / "data" / "big.bin"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(100 * 2**20)  # sparse: 100 MB of zeros without the disk traffic
    counter = CountingHash()
    clock = lambda: os.stat(big).st_mtime_ns + FUTURE  # noqa: E731
    m = Measurer(tmp_path, hash_file=counter, clock_ns=clock)
    first = m.measure_entries(["data/big.bin"])
    assert len(counter.calls) == 1
    assert m.measure_entries(["data/big.bin"]) == first
    assert len(counter.calls) == 1
    assert (m.stats.hashed, m.stats.cached) == (1, 1)
    # persisted: a fresh measurer (another process, later) still does not read it
    assert (tmp_path / STAT_CACHE_FILE).is_file()
    m2 = Measurer(tmp_path, hash_file=counter, clock_ns=clock)
    assert m2.measure_entries(["data/big.bin"]) == first
    assert len(counter.calls) == 1


def test_racily_clean_entry_is_hashed_again_until_recorded_late_enough(tmp_path: Path) -> None:
    p = write(tmp_path, "a.txt", b"aaaa")
    mtime = os.stat(p).st_mtime_ns
    now = [mtime + 1_000_000]  # recorded 1 ms after the last change: inside the racy window
    counter = CountingHash()
    m = Measurer(tmp_path, hash_file=counter, clock_ns=lambda: now[0], stat_cache=StatCache(None))
    m.measure_paths(["a.txt"])
    m.measure_paths(["a.txt"])
    assert len(counter.calls) == 2  # identical stat, but the entry could hide a same-tick rewrite
    now[0] = max(mtime, os.stat(p).st_ctime_ns) + FUTURE
    m.measure_paths(["a.txt"])
    assert len(counter.calls) == 3  # the previous record was still racy
    m.measure_paths(["a.txt"])
    assert len(counter.calls) == 3  # recorded long after the change: trusted


def test_racily_clean_records_alone_do_not_rewrite_the_stat_cache_file(tmp_path: Path) -> None:
    p = write(tmp_path, "a.txt", b"aaaa")
    changed = max(os.stat(p).st_mtime_ns, os.stat(p).st_ctime_ns)
    now = [changed + 1_000_000]  # inside the racy window: the entry could not be trusted after a reload
    m = Measurer(tmp_path, clock_ns=lambda: now[0])
    m.measure_paths(["a.txt"])
    assert not (tmp_path / STAT_CACHE_FILE).exists()
    now[0] = changed + FUTURE  # recorded late enough: worth persisting
    m.measure_paths(["a.txt"])
    doc = json.loads((tmp_path / STAT_CACHE_FILE).read_bytes())
    assert doc["entries"]["a.txt"][-1] == changed + FUTURE
    counter = CountingHash()
    assert Measurer(tmp_path, hash_file=counter).measure_paths(["a.txt"]) == m.measure_paths(["a.txt"])
    assert counter.calls == []  # the persisted entry serves another measurer without reading the file


def test_file_rewritten_with_same_size_and_mtime_is_rehashed(tmp_path: Path) -> None:
    p = write(tmp_path, "a.txt", b"aaaa")
    counter = CountingHash()
    m = Measurer(tmp_path, hash_file=counter)  # the real clock: the file was just written
    before = m.measure_paths(["a.txt"])["a.txt"]
    st = os.stat(p)
    p.write_bytes(b"bbbb")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime_ns
    assert os.stat(p).st_mtime_ns == st.st_mtime_ns and os.stat(p).st_size == st.st_size
    after = m.measure_paths(["a.txt"])["a.txt"]
    assert len(counter.calls) == 2
    assert before is not None and after is not None
    assert after.digest == hashlib.sha256(b"bbbb").hexdigest() != before.digest


def test_corrupt_stat_cache_is_rebuilt_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, "a.txt", b"x")
    cache = tmp_path / STAT_CACHE_FILE
    cache.parent.mkdir()
    cache.write_bytes(b"{not json")
    counter = CountingHash()
    with caplog.at_level(logging.WARNING, logger="smthrs_plugin.boundary.measure"):
        got = Measurer(tmp_path, hash_file=counter).measure_paths(["a.txt"])
    assert got["a.txt"] is not None
    assert len(counter.calls) == 1
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    doc = json.loads(cache.read_bytes())
    assert doc["format"] == "smthrs-statcache/1" and "a.txt" in doc["entries"]


def test_files_are_hashed_in_parallel(tmp_path: Path) -> None:
    for i in range(6):
        write(tmp_path, f"f{i}.txt", bytes([i]) * 1000)
    meet = threading.Barrier(2, timeout=120)

    def rendezvous(f: IO[bytes]) -> str:
        meet.wait()  # only returns when a second file is being hashed at the same time
        return sha256_file(f)

    got = Measurer(tmp_path, hash_file=rendezvous, stat_cache=None).measure_entries(["*.txt"])
    assert sorted(got) == [f"f{i}.txt" for i in range(6)]
    assert all(
        s is not None and s.digest == hashlib.sha256(bytes([i]) * 1000).hexdigest()
        for i, s in enumerate(got.values())
    )


def tree(root: Path) -> None:
    for rel in [
        "src/a.py",
        "src/b/c.py",
        "src/b/notes.txt",
        "src/.hidden.py",
        "src/.cache/x.py",
        "src/b/.d/e.py",
        "top.py",
        ".smthrs/state.txt",
    ]:
        write(root, rel, rel.encode())


def test_glob_enumeration_is_sorted_and_skips_unnamed_dotfiles(tmp_path: Path) -> None:
    tree(tmp_path)
    m = Measurer(tmp_path, stat_cache=None)
    paths, enumerated = m.expand([Glob(include=("src/**/*.py",))])
    assert paths == ["src/a.py", "src/b/c.py"]
    assert enumerated == frozenset(paths)
    assert m.expand(["src/.cache/**"])[0] == ["src/.cache/x.py"]
    assert m.expand(["src/**/.hidden.py"])[0] == ["src/.hidden.py"]
    assert m.expand(["**/*.py"])[0] == ["src/a.py", "src/b/c.py", "top.py"]
    assert m.expand([Glob(include=("src/**",), exclude=("src/b/**",))])[0] == ["src/a.py"]


def test_tree_artifact_contains_every_file_below_it(tmp_path: Path) -> None:
    tree(tmp_path)
    paths, _ = Measurer(tmp_path, stat_cache=None).expand(["src/b/"])
    assert paths == ["src/b/.d/e.py", "src/b/c.py", "src/b/notes.txt"]


def test_missing_glob_root_is_zero_matches(tmp_path: Path) -> None:
    tree(tmp_path)
    m = Measurer(tmp_path, stat_cache=None)
    assert m.measure_entries(["nope/**/*.py", "nope/", "top.py/*.x"]) == {}


def test_enumeration_budget_is_enforced(tmp_path: Path) -> None:
    for i in range(10):
        write(tmp_path, f"d/f{i}.txt")
    with pytest.raises(BoundaryError) as ei:
        Measurer(tmp_path, stat_cache=None, entry_budget=5).expand(["d/**"])
    assert ei.value.code == "enumeration_budget"


def test_subtree_vanishing_mid_enumeration_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree(tmp_path)
    real_scandir = os.scandir

    class Listed(list):  # type: ignore[type-arg]
        def __enter__(self) -> Listed:
            return self

        def __exit__(self, *a: object) -> None:
            return None

    def scandir_then_vanish(path: str) -> Listed:
        with real_scandir(path) as it:
            entries = Listed(it)
        if str(path).endswith("/src"):
            shutil.rmtree(tmp_path / "src" / "b")  # a concurrent `rm -rf src/b` right after src was listed
        return entries

    monkeypatch.setattr(os, "scandir", scandir_then_vanish)
    with pytest.raises(BoundaryError) as ei:
        Measurer(tmp_path, stat_cache=None).expand(["src/**/*.py"])
    assert ei.value.code == "changed_during_measurement"


def test_losing_the_workspace_root_is_workspace_missing(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    tree(ws)
    m = Measurer(ws, stat_cache=None)
    shutil.rmtree(ws)
    for call in (lambda: m.measure_entries(["top.py"]), lambda: m.expand(["**/*.py"])):
        with pytest.raises(BoundaryError) as ei:
            call()
        assert ei.value.code == "workspace_missing"
    ws.mkdir()  # another directory in its place is not the same workspace
    with pytest.raises(BoundaryError) as ei2:
        m.measure_entries(["top.py"])
    assert ei2.value.code == "workspace_missing"
    with pytest.raises(BoundaryError) as ei3:
        Measurer(tmp_path / "never")
    assert ei3.value.code == "workspace_missing"


class CountingRootChecks(Measurer):
    """A real measurer that counts its workspace-root checks."""

    checks = 0

    def check_root(self) -> None:
        self.checks += 1
        super().check_root()


def test_each_measurement_checks_the_root_once(tmp_path: Path) -> None:
    tree(tmp_path)
    m = CountingRootChecks(tmp_path, stat_cache=None)
    m.measure_entries(["top.py", "missing.py", "src/**/*.py", "nothere/**"])
    assert m.checks == 1
    m.measure_paths(["top.py", "gone.py"])
    assert m.checks == 2
    m.expand(["**/*.py"])
    assert m.checks == 3


def test_root_lost_while_files_are_read_is_workspace_missing_not_absence(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    write(ws, "a.txt", b"a")

    def hash_then_lose_root(f: IO[bytes]) -> str:
        shutil.rmtree(ws)  # the open descriptor still reads the bytes; the root is gone afterwards
        return sha256_file(f)

    m = Measurer(ws, stat_cache=None, hash_file=hash_then_lose_root)
    with pytest.raises(BoundaryError) as ei:
        m.measure_entries(["a.txt", "b.txt"])
    assert ei.value.code == "workspace_missing"


def test_unreadable_file_keeps_its_cause(tmp_path: Path) -> None:
    write(tmp_path, "a.txt")

    def broken_disk(f: IO[bytes]) -> str:
        raise OSError(5, "Input/output error")

    with pytest.raises(BoundaryError) as ei:
        Measurer(tmp_path, hash_file=broken_disk, stat_cache=None).measure_paths(["a.txt"])
    assert ei.value.code == "unreadable"
    assert isinstance(ei.value.cause, OSError) and ei.value.cause.errno == 5


def test_symlinks_inside_are_hashed_by_target_bytes_and_escapes_refused(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    write(ws, "data/v3.csv", b"rows")
    os.symlink("v3.csv", ws / "data" / "current.csv")
    os.symlink("nowhere.csv", ws / "data" / "dangling.csv")
    write(tmp_path, "outside/secret", b"s")
    os.symlink(tmp_path / "outside" / "secret", ws / "escape")
    os.symlink(tmp_path / "outside", ws / "linkdir")
    m = Measurer(ws, stat_cache=None)
    got = m.measure_entries(["data/current.csv", "data/dangling.csv"])
    assert got["data/current.csv"] is not None
    assert got["data/current.csv"].digest == hashlib.sha256(b"rows").hexdigest()
    assert got["data/dangling.csv"] is None
    assert m.expand(["data/*.csv"])[0] == ["data/current.csv", "data/v3.csv"]  # dangling link: no file
    for entry in ("escape", "linkdir/secret", "linkdir/"):
        with pytest.raises(BoundaryError) as ei:
            m.measure_entries([entry])
        assert ei.value.code == "invalid_path"


def test_directory_and_fifo_are_not_files(tmp_path: Path) -> None:
    write(tmp_path, "d/x")
    os.mkfifo(tmp_path / "pipe")
    m = Measurer(tmp_path, stat_cache=None)
    for entry in ("d", "pipe"):
        with pytest.raises(BoundaryError) as ei:
            m.measure_entries([entry])
        assert ei.value.code == "invalid_path"
    assert ABSENT == "absent"
