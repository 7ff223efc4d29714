"""Process bodies for the artifact race and crash tests (importable by multiprocessing's spawn)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from smthrs_plugin.errors import ArtifactError
from smthrs_plugin.stores.artifacts import ArtifactStore, Existing

ENTRY = "race-entry"


def publish(url: str, options: dict[str, Any], i: int, barrier: Any, out: Any) -> None:
    """Publish a writer-specific blob, then an entry referencing it, all at once with the other writers."""
    store = ArtifactStore(url, options)
    _ = store.fs  # open the filesystem before the start line
    blob = f"writer-{i}-".encode() * 40_000
    barrier.wait(timeout=120)
    digest = store.put_bytes(blob)
    entry = json.dumps({"writer": i, "blob": digest, "pad": "p" * 300_000}).encode()
    outcome = store.put_entry(ENTRY, entry)
    seen = outcome.data if isinstance(outcome, Existing) else entry
    out.put((i, type(outcome).__name__, hashlib.sha256(entry).hexdigest(), hashlib.sha256(seen).hexdigest()))


def poll(url: str, options: dict[str, Any], barrier: Any, stop: Any, out: Any) -> None:
    """Read the entry as fast as possible while writers race; every visible entry must be complete and its
    blob must already exist."""
    store = ArtifactStore(url, options)
    _ = store.fs
    barrier.wait(timeout=120)
    seen = 0
    violations: list[str] = []
    final = False
    while True:
        if stop.is_set():
            final = True  # one more read after every writer finished
        data = store.get_entry(ENTRY)
        if data is not None:
            seen += 1
            try:
                doc = json.loads(data)
            except ValueError:
                violations.append(f"torn entry of {len(data)} bytes")
            else:
                try:
                    store.get_bytes(doc["blob"])
                except ArtifactError as exc:
                    violations.append(f"entry visible before its blob: {exc.code}")
        if final:
            break
    out.put((seen, violations))


def put_then_hang(url: str, options: dict[str, Any], src: str, out: Any) -> None:
    """Start storing a big file; announce when half of it went out, then wait to be SIGKILLed."""
    store = ArtifactStore(url, options)
    announced = False

    def progress(done: int, total: int | None) -> None:
        nonlocal announced
        if total and done >= total // 2 and not announced:
            announced = True
            out.put("half")
            time.sleep(120)

    store.put_file(src, progress=progress)
    out.put("finished")  # never reached when the test kills us
