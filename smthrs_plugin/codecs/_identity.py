"""The identity of decoded values: ``id(obj)`` → the key form of the stored bytes it was decoded from.

Invariant: a remembered key form is returned only for the very object it was recorded for (a weak reference
proves it is still that object), and only while that object's guard says it is unchanged since decoding; an
object that dies takes its entry with it (``weakref.finalize``). What "unchanged" means is each codec's own
proof (see ``_frames``); this module only keeps the entries.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._registry import JSON

__all__ = ["forget_identities"]


class _IdentityCache:
    """Process-local ``id(obj) → (weakref, key form, guard)``: the key form of a decoded value, reused while
    ``guard(obj)`` says the object is unchanged. Entries are dropped when the object dies (weakref.finalize)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[weakref.ref[Any], JSON, Callable[[Any], bool]]] = {}

    def remember(self, obj: Any, key_form: JSON, guard: Callable[[Any], bool]) -> None:
        ident = id(obj)
        with self._lock:
            self._entries[ident] = (weakref.ref(obj), key_form, guard)
        weakref.finalize(obj, self._drop, ident)

    def _drop(self, ident: int) -> None:
        with self._lock:
            self._entries.pop(ident, None)

    def lookup(self, obj: Any) -> JSON | None:
        with self._lock:
            entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        if not entry[2](obj):
            self._drop(id(obj))  # changed since decoding: never trust this entry again
            return None
        return json.loads(json.dumps(entry[1]))  # a private copy: callers may mutate what they get

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_IDENTITIES = _IdentityCache()


def forget_identities() -> None:
    """Drop every remembered digest (tests and benchmarks use it to measure the hashing path)."""
    _IDENTITIES.clear()
