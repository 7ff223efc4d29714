"""Small helpers of the dispatch seam: the process-wide per-key locks and a phase timer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["KeyLocks", "KEY_LOCKS", "PhaseTimer"]


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
