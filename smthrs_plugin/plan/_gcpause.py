"""The cyclic garbage collector paused around a plan compile.

Why: compiling a 100,000-node plan allocates several hundred thousand container objects that all live as long as
the plan. Each time they outnumber a quarter of the long-lived heap, CPython runs a full collection, which walks
EVERY tracked object of the process — 0.4 s apiece on a 2-core machine, two to four of them per compile, more in a
process that has Prefect loaded — and finds nothing to free: nothing a compile allocates is cyclic garbage. So the
collector is paused for the compile (as mypy does around its parse) and resumed after it, and the next collection
runs at its usual threshold.

Invariants
- Reference counting is untouched: objects freed by refcount are freed as ever; only cycle detection waits.
- Re-entrant and thread-safe: nested or concurrent compiles share one pause, and the collector is enabled again
  when the last of them ends — only if it was enabled when the first began (a process that disabled it keeps it
  disabled).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_resume = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause cyclic garbage collection for the ``with`` block (see the module docstring)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
