"""The identity of decoded values: ``id(obj)`` → the key form of the stored bytes it was decoded from.

Invariant: a remembered key form is returned only for the very object it was recorded for (a weak reference
proves it is still that object), and only while that object's guard says it is unchanged since decoding; an
object that dies takes its entry with it (``weakref.finalize``). What "unchanged" means is each codec's own
proof (see ``frames``); this module only keeps the entries.

Travelling identities (results by reference on process pools and Dask). An identity is
process-local, but a Prefect process pool or Dask cluster pickles every value that crosses a process: a decoded
frame arriving in another process would be hashed again. :func:`carry` installs a ``copyreg`` reducer for one exact
type so that a remembered object is pickled as ``arrive(key_form, snapshot)``: the receiving process unpickles the
snapshot and ``arrive`` remembers it under the sender's key form (and may carry it on again). Why it is sound:
- the sender vouches only through its own guard, checked AFTER the snapshot was taken, so the bytes pickled are
  exactly the content the key form names (a snapshot is the object itself when immutable, or a fresh
  Copy-on-Write shallow copy that no other code holds, so no write can reach it while it is pickled);
- pickle is a trusted channel between the processes of one task runner (it executes code by design); nothing read
  from a store is ever unpickled — stored values are decoded by the codecs, never by pickle;
- everything else (an object never remembered, one changed since, a different type) pickles exactly as without
  the reducer, so the worst a failure can do is lose the shortcut: the receiver then hashes again.
"""

from __future__ import annotations

import copyreg
import json
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .registry import JSON

__all__ = ["forget_identities", "carry"]


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


# ----------------------------------------------------------------------------------------- travelling identities

_CARRIED: dict[type, tuple[Callable[[JSON, Any], Any], Callable[[Any], Any]]] = {}
_CARRY_LOCK = threading.Lock()
_NESTED = threading.local()


def carry(cls: type, arrive: Callable[[JSON, Any], Any], snapshot: Callable[[Any], Any]) -> None:
    """Pickle remembered objects of exactly ``cls`` as ``arrive(key_form, snapshot(obj))`` (module docstring).

    ``arrive`` must be a module-level function (pickled by reference) that remembers its second argument under the
    key form and returns it; ``snapshot`` returns an object with the same content that no other code can write to
    while it is pickled. Idempotent; the first registration of a type wins."""
    with _CARRY_LOCK:
        if cls in _CARRIED:
            return
        _CARRIED[cls] = (arrive, snapshot)
        copyreg.pickle(cls, _reduce)


def _plain(obj: Any) -> Any:
    # Protocol 2's reduction: what pickle itself uses for these types at protocols 2 to 5 (no __reduce_ex__ of
    # their own, no keyword-only __getnewargs_ex__), so an object that does not travel pickles as without us.
    return obj.__reduce_ex__(2)


def _reduce(obj: Any) -> Any:
    nested: set[int] | None = getattr(_NESTED, "ids", None)
    if nested is None:
        nested = _NESTED.ids = set()
    if id(obj) in nested:
        # The snapshot inside our own reduction: pickled plainly. (An id left here by an aborted pickle only
        # makes one later pickle of an object at that address plain: the receiver hashes, nothing is wrong.)
        nested.discard(id(obj))
        return _plain(obj)
    carried = _CARRIED.get(type(obj))
    if carried is None:
        return _plain(obj)
    arrive, snapshot = carried
    copy = snapshot(obj)
    known = _IDENTITIES.lookup(
        obj
    )  # AFTER the snapshot: it is unchanged content if obj still was at this point
    if known is None:
        return _plain(obj)
    nested.add(id(copy))
    return (arrive, (known, copy))
