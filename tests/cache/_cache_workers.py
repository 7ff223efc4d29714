"""Process bodies of the cache race test (importable by multiprocessing's spawn)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from _cache_support import make_machine, upper, upper_node

from smthrs_plugin.boundary import referenced_digests
from smthrs_plugin.cache.entry import CacheEntry, decode_entry
from smthrs_plugin.stores.artifacts import ArtifactStore


def dispatch_once(base: str, i: int, url: str, options: dict[str, Any], barrier: Any, out: Any) -> None:
    """One machine: its own workspace, database and local blobs; the same shared tier as the others."""
    shared = ArtifactStore(url, options)
    m = make_machine(Path(base), f"p{i}", shared, files={"in.txt": "the same input\n" * 1000})
    req = m.request(upper_node(), run_id=f"run-{i}")
    _ = shared.fs  # connect before the start line
    barrier.wait(timeout=120)
    res = m.dispatch(upper_node(), upper, run_id=f"run-{i}")
    out.put(
        (
            i,
            res.outcome,
            res.decision.tag if res.decision else None,
            res.value,
            res.published.get("shared"),
            hashlib.sha256((m.ws / "out.txt").read_bytes()).hexdigest(),
            req.key,
            repr(res.error) if res.error else None,
        )
    )


def poll_entries(url: str, options: dict[str, Any], barrier: Any, stop: Any, out: Any) -> None:
    """Read the shared tier as fast as possible: every visible entry must decode and its blobs must exist."""
    store = ArtifactStore(url, options)
    _ = store.fs
    barrier.wait(timeout=120)
    seen = 0
    violations: list[str] = []
    final = False
    while True:
        if stop.is_set():
            final = True
        for name in store.list_entries():
            data = store.get_entry(name)
            if data is None:
                continue
            seen += 1
            entry = decode_entry(data, name=name)
            if not isinstance(entry, CacheEntry):
                violations.append(f"undecodable entry {name}: {entry.reason}")
                continue
            present = store.has_many(sorted(referenced_digests(entry.evidence)))
            violations += [f"entry {name} visible before blob {d}" for d, ok in present.items() if not ok]
        if final:
            break
    out.put((seen, violations))
