"""Small helpers of the dispatch seam: the process-wide per-key locks, a phase timer, the codecs' blob sink and
source, and how a decision reads in an entry's provenance and a consult's condemnations."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ArtifactError
from ..stores.artifacts import ArtifactStore
from .model import CacheDecision, Miss, ReplayFailed, UnverifiableEvidence
from .shared import SharedTier, same_store

__all__ = [
    "KeyLocks",
    "KEY_LOCKS",
    "PhaseTimer",
    "BlobSink",
    "BlobSource",
    "condemnation",
    "expired_age",
    "renewal",
]


class _Slot:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0


class KeyLocks:
    """One lock per key digest, created on demand and dropped when nobody holds or waits for it.

    Process-wide on purpose: two dispatchers over the same database in one process must serialise the same key
    too, or both would miss and execute (the per-key consult serialisation)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._slots: dict[str, _Slot] = {}

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        with self._guard:
            slot = self._slots.get(name)
            if slot is None:
                slot = self._slots[name] = _Slot()
            slot.users += 1
        try:
            with slot.lock:
                yield
        finally:
            with self._guard:
                slot.users -= 1
                if slot.users == 0:
                    del self._slots[name]

    def __len__(self) -> int:
        with self._guard:
            return len(self._slots)


KEY_LOCKS = KeyLocks()


class PhaseTimer:
    """Accumulates milliseconds per named phase (``with timer("lookup"): ...``)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.ms[phase] = self.ms.get(phase, 0.0) + (time.perf_counter() - started) * 1000.0


class BlobSink:
    """Codec payloads go to the local artifact store (content-addressed); publication copies them to the shared
    tier before the entry (``entry_digests``)."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store

    def put(self, data: bytes) -> str:
        return self.store.put_bytes(data)


class BlobSource:
    """Codec payloads are read from the local artifact store; one missing there (a shared-tier hit on a fresh
    host) is hydrated once from the shared store. Every read is verified against its digest by the store."""

    def __init__(self, artifacts: ArtifactStore, shared_store: ArtifactStore, shared: SharedTier) -> None:
        self.artifacts, self.shared_store, self.shared = artifacts, shared_store, shared

    def get(self, digest: str) -> bytes:
        try:
            return self.artifacts.get_bytes(digest)
        except ArtifactError as exc:
            if exc.code != "not_found" or same_store(self.artifacts, self.shared_store):
                raise
        self.shared.hydrate([digest], self.artifacts)
        return self.artifacts.get_bytes(digest)


#: Replay refusals that judge the entry itself: its key folds the declaration, so every requester of that key
#: would refuse it the same way (unlike a stale read set or a directory in this workspace's way).
_CONDEMNING_REPLAY_CODES = frozenset({"reserved_path", "undeclared_output", "undeclared_removal"})


def condemnation(decision: CacheDecision) -> str | None:
    """Why a consult's refusal of a shared entry judges the entry itself (our build may replace it), or None."""
    if isinstance(decision, UnverifiableEvidence):
        return decision.reason
    if isinstance(decision, ReplayFailed) and decision.code in _CONDEMNING_REPLAY_CODES:
        return f"{decision.code}: {decision.reason}"
    return None


def expired_age(miss: Miss) -> str:
    """``"<age> old, over the limit <max age>"`` of an expired miss, in seconds."""
    age = "of unknown age" if miss.age_ms is None else f"{miss.age_ms / 1000:g} s old"
    return f"{age}, over the limit {(miss.max_age_ms or 0) / 1000:g} s"


def renewal(decision: CacheDecision | None) -> dict[str, Any]:
    """The provenance member of an entry built because an earlier one of its key expired or was refreshed (what
    ``smthrs cache explain`` shows: the key did not change, its entry was renewed)."""
    if not isinstance(decision, Miss) or decision.reason is None:
        return {}
    renewed: dict[str, Any] = {"reason": decision.reason}
    if decision.reason == "expired":
        renewed.update(tier=decision.where, age_ms=decision.age_ms, max_age_ms=decision.max_age_ms)
    return {"renewed": renewed}
