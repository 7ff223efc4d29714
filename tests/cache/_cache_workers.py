"""Process bodies of the cache race test (importable by multiprocessing's spawn)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from _cache_support import make_machine, upper, upper_node

from smthrs_plugin.boundary import referenced_digests
from smthrs_plugin.cache.shared import Candidate, check_document
from smthrs_plugin.cache.signing import Trust, workspace_key
from smthrs_plugin.stores.artifacts import ArtifactStore


def publisher_trust(base: Path, i: int, publishers: int) -> Trust | None:
    """Process ``i`` of ``publishers`` keys: signs with key ``i % publishers``, trusts all (None: the team key)."""
    if publishers <= 1:
        return None
    keys = [workspace_key(base / f"team{p}") for p in range(publishers)]
    return Trust(keys[i % publishers], tuple(k.public for k in keys), "configured")


def dispatch_once(
    base: str, i: int, url: str, options: dict[str, Any], barrier: Any, out: Any, publishers: int = 1
) -> None:
    """One machine: its own workspace, database and local blobs; the same shared tier as the others."""
    shared = ArtifactStore(url, options)
    m = make_machine(
        Path(base),
        f"p{i}",
        shared,
        files={"in.txt": "the same input\n" * 1000},
        trust=publisher_trust(Path(base), i, publishers),
    )
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
            m.dispatcher.trust.signer.key_id if m.dispatcher.trust.signer else None,
        )
    )


def poll_entries(url: str, options: dict[str, Any], barrier: Any, stop: Any, out: Any) -> None:
    """Read the shared tier as fast as possible: every visible entry must decode completely (no torn read; its
    signature envelope names the publisher its name carries) and its blobs must exist."""
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
            judged = check_document(name, data, None)
            if not isinstance(judged, Candidate):
                violations.append(f"undecodable entry {name}: {judged.reason}: {judged.detail}")
                continue
            present = store.has_many(sorted(referenced_digests(judged.entry.evidence)))
            violations += [f"entry {name} visible before blob {d}" for d, ok in present.items() if not ok]
        if final:
            break
    out.put((seen, violations))
