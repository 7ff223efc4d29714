"""Decoded frames keep their stored digest when they cross a process: a process pool or a Dask
cluster pickles every value it moves, and the receiving process keys the value without hashing it again — but only
when the sender could still vouch for it (unchanged since decoding), and nothing else about pickling changes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
cloudpickle = pytest.importorskip("cloudpickle")

from test_frames import MemoryCAS  # noqa: E402  (the codec tests' in-memory content-addressed store)

from smthrs_plugin.canonical import key  # noqa: E402
from smthrs_plugin.codecs import _identity, frames  # noqa: E402
from smthrs_plugin.codecs.frames import forget_identities, frame_codecs  # noqa: E402
from smthrs_plugin.codecs.registry import CodecRegistry  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

#: Run in a fresh interpreter: unpickle stdin, key it with hashing forbidden unless HASH_OK, print the key and how
#: many times the canonical stream was hashed; then pickle the value on to stdout (b64) for a next hop.
RECEIVER = textwrap.dedent(
    """
    import base64, json, os, pickle, sys
    from smthrs_plugin.canonical import key
    from smthrs_plugin.codecs import frames
    from smthrs_plugin.codecs.frames import frame_codecs
    from smthrs_plugin.codecs.registry import CodecRegistry
    hashed = []
    original = frames._Arrow.digest_form
    def counting(self, table):
        hashed.append(1)
        return original(self, table)
    frames._Arrow.digest_form = counting
    value = pickle.loads(base64.b64decode(sys.stdin.read()))
    if os.environ.get("MUTATE"):
        value.iloc[0, 0] = -1
    reg = CodecRegistry(frame_codecs())
    k = key(reg.key_form(value))
    onward = base64.b64encode(pickle.dumps(value, protocol=5)).decode()
    print(json.dumps({"key": k, "hashed": len(hashed), "type": type(value).__name__, "onward": onward}))
    """
)


def receive(payload: bytes, **env: str) -> dict[str, Any]:
    import base64

    out = subprocess.run(
        [sys.executable, "-c", RECEIVER],
        input=base64.b64encode(payload).decode(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "random", **env},
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.fixture
def reg() -> CodecRegistry:
    forget_identities()
    return CodecRegistry(frame_codecs())


def frame(rows: int = 5_000) -> Any:
    rng = np.random.default_rng(11)
    return pd.DataFrame(
        {"a": rng.integers(0, 1 << 40, rows), "b": rng.random(rows), "s": [f"v{i}" for i in range(rows)]},
        index=pd.Index([f"r{i}" for i in range(rows)], name="row"),
    )


def stored(reg: CodecRegistry, value: Any) -> tuple[Any, str]:
    """``value`` stored and decoded back (a cached result), and the key of the original."""
    cas = MemoryCAS()
    return reg.decode(reg.encode(value, cas), cas), key(reg.key_form(value))


@pytest.mark.parametrize(
    "make",
    [frame, lambda: frame()["b"].rename("b"), lambda: pa.Table.from_pandas(frame())],
    ids=["DataFrame", "Series", "Table"],
)
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_a_decoded_value_pickled_to_another_process_is_keyed_there_without_hashing(
    reg: CodecRegistry, make: Any, dumps: Any
) -> None:
    decoded, expected = stored(reg, make())
    first = receive(dumps(decoded))
    assert first == {**first, "key": expected, "hashed": 0, "type": type(decoded).__name__}
    # ... and it travels on from there (the parent of a process pool re-pickles what a worker returned).
    import base64

    second = receive(base64.b64decode(first["onward"]))
    assert (second["key"], second["hashed"]) == (expected, 0)


def test_a_decoded_frame_changed_before_pickling_is_hashed_by_the_receiver(reg: CodecRegistry) -> None:
    decoded, expected = stored(reg, frame())
    decoded.iloc[0, 0] = 12345  # Copy-on-Write replaced the block: the sender can no longer vouch for it
    got = receive(pickle.dumps(decoded))
    assert got["hashed"] == 1
    assert got["key"] == key(reg.key_form(decoded)) != expected


def test_a_frame_changed_after_it_arrived_is_hashed_again_in_the_receiver(reg: CodecRegistry) -> None:
    decoded, expected = stored(reg, frame())
    got = receive(pickle.dumps(decoded), MUTATE="1")
    assert got["hashed"] == 1 and got["key"] != expected


def test_a_write_racing_the_pickle_never_reaches_the_bytes_sent_under_the_old_key(
    reg: CodecRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sender snapshots first, then checks its guard. A write AFTER the guard passed lands in the original
    # (Copy-on-Write copies the block), never in the snapshot that travels under the old key.
    decoded, expected = stored(reg, frame())
    before = decoded.iloc[0, 0]
    lookup = _identity._IDENTITIES.lookup

    def lookup_then_write(obj: Any) -> Any:
        known = lookup(obj)
        obj.iloc[0, 0] = 999
        return known

    monkeypatch.setattr(_identity._IDENTITIES, "lookup", lookup_then_write)
    payload = pickle.dumps(decoded)
    monkeypatch.undo()
    assert decoded.iloc[0, 0] == 999
    got = receive(payload)
    assert (got["hashed"], got["key"]) == (0, expected)
    assert pickle.loads(payload).iloc[0, 0] == before


def test_a_write_before_the_guard_is_seen_and_the_frame_travels_without_a_key(
    reg: CodecRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded, expected = stored(reg, frame())
    arrive, snapshot = _identity._CARRIED[type(decoded)]

    def snapshot_then_write(obj: Any) -> Any:
        copy = snapshot(obj)
        obj.iloc[0, 0] = 999  # after the snapshot, before the guard: the guard refuses to vouch
        return copy

    monkeypatch.setitem(_identity._CARRIED, type(decoded), (arrive, snapshot_then_write))
    payload = pickle.dumps(decoded)
    monkeypatch.undo()
    got = receive(payload)
    assert got["hashed"] == 1 and got["key"] == key(reg.key_form(decoded)) != expected


def test_values_that_do_not_travel_pickle_exactly_as_without_the_reducer(reg: CodecRegistry) -> None:
    stored(reg, frame())  # installs the reducers in this process
    assert type(pd.DataFrame) and pd.DataFrame in _identity._CARRIED
    own = frame(50)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        for protocol in (2, 4, 5):
            back = pickle.loads(dumps(own, protocol=protocol))
            pd.testing.assert_frame_equal(back, own)
            assert _identity._IDENTITIES.lookup(back) is None  # never decoded, so never vouched for
    # A frame inside a container, twice: pickle's memo keeps one object.
    decoded, _ = stored(reg, frame(50))
    pair = pickle.loads(pickle.dumps([decoded, decoded, own]))
    assert pair[0] is pair[1]
    pd.testing.assert_frame_equal(pair[0], decoded)


def test_a_numpy_array_does_not_travel_and_keeps_pickles_own_buffers(reg: CodecRegistry) -> None:
    # numpy's protocol-5 out-of-band buffers (what Dask uses) must not be traded for a shortcut on every array.
    cas = MemoryCAS()
    arr = reg.decode(reg.encode(np.arange(100_000, dtype="int64"), cas), cas)
    assert _identity._IDENTITIES.lookup(arr) is not None  # keyed by reference inside this process...
    assert np.ndarray not in _identity._CARRIED  # ...but not given a reducer
    buffers: list[Any] = []
    pickle.dumps(arr, protocol=5, buffer_callback=buffers.append)
    assert buffers


def test_pickling_in_many_threads_at_once_keeps_every_reference(
    reg: CodecRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    pairs = [stored(reg, frame(2_000 + i)) for i in range(4)]
    decoded = [df for df, _ in pairs]
    expected = {len(df): k for df, k in pairs}
    results: list[bytes] = []
    lock = threading.Lock()

    def work(df: Any) -> None:
        for _ in range(20):
            data = pickle.dumps(df)
            with lock:
                results.append(data)

    threads = [threading.Thread(target=work, args=(df,)) for df in decoded]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80

    def no_hashing(self: Any, table: Any) -> Any:
        raise AssertionError("a frame that arrived with its key was hashed")

    monkeypatch.setattr(frames._Arrow, "digest_form", no_hashing)
    for data in results:
        back = pickle.loads(data)
        assert key(reg.key_form(back)) == expected[len(back)]
    assert getattr(_identity._NESTED, "ids", set()) == set()  # no snapshot id left behind
