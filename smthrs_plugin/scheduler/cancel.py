"""The cancellation token a scheduler pass hands every node execution, so a typed scheduler failure can interrupt
running siblings (the reference requires that a typed scheduler failure interrupts siblings).

Invariants
- A token is cancelled at most once; cancelling is idempotent and never raises for the canceller: a callback's
  own failure is logged, and the remaining callbacks still run (one stuck subprocess must not shield another).
- ``on_cancel`` registered after cancellation runs its callback at once, on the registering thread: an execution
  that starts racing the interrupt is interrupted too, never missed.
- Threads cannot be killed. Cooperation is the executor's part: poll ``cancelled``, block on ``wait(...)`` or
  register ``on_cancel`` (the plan-file executor kills a ``run:`` command's process group that way).
- A token crossing a process boundary arrives as a fresh token that is never cancelled (its callbacks and event
  cannot travel): interrupting out-of-process executions is their host's concern. The scheduler still marks
  their attempts ``failed`` in its fenced cleanup, and a late settlement finds a terminal row it cannot
  overwrite.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["CancelToken", "NEVER_CANCELLED"]

log = logging.getLogger(__name__)


class CancelToken:
    """Cancellation of one scheduler pass, shared by every node execution it started.

    ``cancelled`` answers now; ``wait(timeout)`` blocks until cancelled (``True``) or the timeout passed
    (``False``); ``on_cancel(fn)`` is a context manager running ``fn()`` once if the pass is interrupted while the
    block runs. ``reason`` says why (``None`` until cancelled)."""

    __slots__ = ("_event", "_lock", "_callbacks", "_reason", "_next", "__weakref__")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._reason: str | None = None
        self._next = 0

    @property
    def cancelled(self) -> bool:
        """Whether the pass was interrupted."""
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        """Why the pass was interrupted (``None`` while it was not)."""
        return self._reason

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled (``True``) or ``timeout`` seconds passed (``False``)."""
        return self._event.wait(timeout)

    def cancel(self, reason: str) -> None:
        """Interrupt every execution holding this token (idempotent): set the flag, then run the callbacks."""
        with self._lock:
            if self._event.is_set():
                return
            self._reason = reason
            self._event.set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for fn in callbacks:
            _call(fn)

    @contextmanager
    def on_cancel(self, fn: Callable[[], object]) -> Iterator[None]:
        """Run ``fn()`` if the token is cancelled while the ``with`` block runs (at once if it already is)."""
        with self._lock:
            late = self._event.is_set()
            if not late:
                handle = self._next
                self._next += 1
                self._callbacks[handle] = fn
        if late:
            _call(fn)
        try:
            yield
        finally:
            if not late:
                with self._lock:
                    self._callbacks.pop(handle, None)

    def __reduce__(self) -> tuple[Any, ...]:
        # An Event and callbacks cannot cross a process boundary: the receiver gets a token that never fires.
        return (CancelToken, ())

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self.cancelled})"


def _call(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # the interrupt of the other executions must still happen; the failure is reported
        log.exception("a cancellation callback failed: %r", fn)


#: The token of an execution nothing can interrupt (the default of a ``NodeInput`` built by hand).
NEVER_CANCELLED = CancelToken()
