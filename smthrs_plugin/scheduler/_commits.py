"""The coordinator's commit queue: settlements of in-process jobs commit in the coordinator's own transaction.

Why: a node's settlement (its attempt row, ``attempt-finished``, ``node-settled``, the local cache row) and the
coordinator's own writes (attempt rows of the next admitted nodes, settlements it decided) used to commit apart,
one transaction each — two or more fsynced commits per node, queueing on SQLite's single write lock. Here a job
running in this process hands its settle transaction to the coordinator and waits; the coordinator commits every
settlement queued so far together with its own buffered writes in ONE transaction per scheduling step (group
commit, with the coordinator as the leader).

Invariants
- **Each settlement stays atomic.** Queued functions run one after another in the coordinator's transaction;
  if one raises, that transaction rolls back whole and runs again with each function in its own savepoint (a
  savepoint per settlement costs more than the settlement: it is paid only when one fails). There, one that
  raises rolls back alone and its job receives exactly that exception (as a lone transaction would have raised
  it); the others commit. If the transaction as a whole fails (a lost fence, a storage error), every job queued
  in it receives that error and nothing of it committed.
- **Nothing is reported before it is durable.** A job is released only after the commit holding its settlement;
  the coordinator learns a node's outcome from the job's return, which comes after that release.
- **No deadlock.** A commit asked for on the coordinator's own thread (an inline host) runs at once on that
  thread, and after :meth:`close` (the coordinator stops serving: an abort) queued and later commits run on the
  job's own thread as ordinary group-committed writes.
- Jobs in other processes never see this queue (it does not pickle); they commit themselves, fenced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from ..stores.database import Database
from ..stores.dberrors import RETRY_SQLSTATES, sqlstate, store_error

__all__ = ["CommitQueue"]

T = TypeVar("T")
Write = Callable[[Connection], Any]
#: Set on the thread running a settlement this queue routed (:meth:`CommitQueue.serving`).
_SERVING = threading.local()


class _Queued:
    __slots__ = ("fn", "event", "state", "result", "error")

    def __init__(self, fn: Write) -> None:
        self.fn = fn
        self.event = threading.Event()
        self.state = "queued"  # → "done" | "alone" (the coordinator stopped serving: commit yourself)
        self.result: Any = None
        self.error: BaseException | None = None


class CommitQueue:
    """Settle transactions of in-process jobs, committed by the coordinator (see the module docstring)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._cv = threading.Condition()
        self._queued: list[_Queued] = []
        self._done: list[Future[Any]] = []
        self._open = True
        self._coordinator = threading.get_ident()

    # -- job side ------------------------------------------------------------------------------------------
    def commit(self, fn: Callable[[Connection], T]) -> T:
        """Commit ``fn(conn)`` with the coordinator's next transaction and return its result (or raise its error)
        once that transaction committed."""
        if threading.get_ident() == self._coordinator:
            return self.db.write_batched(fn)
        item = _Queued(fn)
        with self._cv:
            if not self._open:
                item.state = "alone"
            else:
                self._queued.append(item)
                self._cv.notify_all()
        if item.state == "queued":
            item.event.wait()
        if item.state == "alone":
            # After an abort: alone, on this thread (not grouped: a group's leader would run ``fn`` on its own
            # thread), still marked as routed through this queue — the abort committed the coordinator's buffered
            # writes first, so a pipelined attempt's row exists unless that commit failed (then this one fails).
            _SERVING.on = True
            try:
                return self.db.write(fn)
            finally:
                _SERVING.on = False
        if item.error is not None:
            raise item.error
        return item.result  # type: ignore[no-any-return]

    # -- coordinator side ----------------------------------------------------------------------------------
    def watch(self, fut: Future[Any]) -> None:
        """Wake :meth:`wait` when ``fut`` completes."""

        def done(f: Future[Any]) -> None:
            with self._cv:
                self._done.append(f)
                self._cv.notify_all()

        fut.add_done_callback(done)

    def wait(self) -> list[Future[Any]]:
        """Block until a settlement is queued or a watched future completed; return (and forget) the completed
        futures. Queued settlements stay queued for :meth:`writes`."""
        with self._cv:
            while not self._queued and not self._done:
                self._cv.wait()
            done, self._done = self._done, []
            return done

    def pending(self) -> bool:
        with self._cv:
            return bool(self._queued)

    def take(self) -> list[_Queued]:
        """The settlements queued so far, in arrival order, for the coordinator's next transaction."""
        with self._cv:
            items, self._queued = self._queued, []
            return items

    @staticmethod
    def serving() -> bool:
        """Whether the settlement running on this thread now was routed through a commit queue (run in the
        coordinator's transaction, or alone after it stopped serving): what a pipelined job checks, since only
        that route orders its settlement after its attempt row."""
        return getattr(_SERVING, "on", False) is True

    @staticmethod
    def run_in(db: Database, conn: Connection, items: list[_Queued], *, savepoints: bool) -> None:
        """Run the queued settlements in the open transaction on ``conn``, in arrival order.

        ``savepoints=False`` (the common case): one after another, and the first that raises fails the whole
        transaction (the caller then runs it again with savepoints). ``savepoints=True``: each in its own
        savepoint; one that raises rolls back alone and keeps its error for its job."""
        _SERVING.on = True
        try:
            if savepoints:
                CommitQueue._run_each(db, items)
            else:
                for item in items:
                    item.result, item.error = item.fn(conn), None
        finally:
            _SERVING.on = False

    @staticmethod
    def _run_each(db: Database, items: list[_Queued]) -> None:
        for item in items:
            try:
                item.result, item.error = (
                    db.write(item.fn),
                    None,
                )  # nested: a savepoint of the open transaction
            except sa_exc.DBAPIError as exc:
                if sqlstate(exc) in RETRY_SQLSTATES:
                    raise  # PostgreSQL serialization failure: the whole transaction retries, every item again
                item.error = store_error(db, exc, "write")
            except Exception as exc:  # that job's outcome, raised on its own thread; the others still commit
                item.error = exc

    @staticmethod
    def release(items: list[_Queued], error: BaseException | None = None) -> None:
        """Wake the jobs of ``items`` after their transaction ended: committed (``error`` None: each gets its own
        result or savepoint error) or failed as a whole (each gets ``error``; nothing of theirs committed)."""
        for item in items:
            if error is not None:
                item.result, item.error = None, error
            item.state = "done"
            item.event.set()

    def close(self) -> None:
        """Stop serving: every queued and later settlement commits on its job's own thread."""
        with self._cv:
            self._open = False
            items, self._queued = self._queued, []
        for item in items:
            item.state = "alone"
            item.event.set()
