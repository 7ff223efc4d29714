"""Group commit: concurrent write transactions of one process share one commit.

Why: a small write transaction on SQLite ``synchronous=FULL`` is dominated by the lock handover and the WAL fsync
of its COMMIT, and N threads settling nodes at once each paid both, queueing behind one another on the
database's single write lock. With group commit the first caller to arrive leads: it takes every write queued
so far, runs them one after another in ONE transaction and commits once; callers that arrive while a commit is in
flight queue up and the first of them leads the next group. That is the classic leader/follower group commit
(MySQL's binlog group commit, PostgreSQL's ``commit_delay`` without the delay: nobody waits for company).

Invariants
- **Each write keeps its own transaction's meaning.** A caller returns only after the commit that holds its write
  is durable, with exactly the result its function returned; nothing is reported (post-commit callbacks, the
  return) before that commit. A group is all or nothing: if any function of a group raises (a lost fence, a
  refused settlement) or the commit fails, the whole group rolls back and EVERY member runs its function again
  alone, on its own thread, in a transaction of its own — so each caller sees precisely the outcome (value or
  exception) a lone :meth:`Database.write` would have given it, and one member's refusal never costs another
  member its write. Functions must therefore be safe to run again after a rollback, as any function passed to
  ``Database.write`` already is (serialization failures retry them).
- **Order.** Members of a group run in arrival order; a write queued after another never commits before it.
- A function runs on the leader's thread, inside the leader's open transaction: nested writes become savepoints
  of it and ``on_commit`` callbacks run after its commit, as they would on the caller's own thread.
- No thread waits for a commit that no thread is leading: leadership passes to the first queued caller when a
  leader finishes, under the same lock that queues callers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["GroupCommit"]

T = TypeVar("T")

#: Run a list of functions in ONE transaction and commit; returns their results in order (raises on failure).
RunGroup = Callable[[list[Callable[[Any], Any]]], list[Any]]
#: Run one function in a transaction of its own (``Database.write``).
RunAlone = Callable[[Callable[[Any], T]], T]


class _Member(Generic[T]):
    __slots__ = ("fn", "event", "state", "result", "error")

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.event = threading.Event()
        #: "queued" → "lead" (promoted: lead the next group) | "done" (result/error set) | "alone" (run again alone)
        self.state = "queued"
        self.result: Any = None
        self.error: BaseException | None = None


class GroupCommit:
    """The leader/follower queue of one database handle in one process (see the module docstring)."""

    def __init__(self, run_group: RunGroup, run_alone: RunAlone[Any]) -> None:
        self._run_group = run_group
        self._run_alone = run_alone
        self._lock = threading.Lock()
        self._queue: list[_Member[Any]] = []
        self._leading = False

    def write(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(conn)`` in a write transaction that may be shared with concurrent callers; return its result
        after that transaction committed (see the module invariants)."""
        me: _Member[T] = _Member(fn)
        with self._lock:
            self._queue.append(me)
            lead = not self._leading
            if lead:
                self._leading = True
        if not lead:
            me.event.wait()
            if me.state == "done":
                if me.error is not None:
                    raise me.error
                return me.result  # type: ignore[no-any-return]
            if me.state == "alone":
                return self._run_alone(fn)
            assert me.state == "lead"
        return self._lead(me)

    def _lead(self, me: _Member[T]) -> T:
        alone = False
        try:
            with self._lock:
                group, self._queue = self._queue, []
            alone = self._commit(group, me)
        finally:
            # Hand leadership to the first caller that queued during this commit, or give it up: under the lock
            # that queues callers, so none waits for a leader that will never come.
            with self._lock:
                if self._queue:
                    nxt = self._queue[0]
                    nxt.state = "lead"
                    nxt.event.set()
                else:
                    self._leading = False
        if alone:
            return self._run_alone(me.fn)
        if me.error is not None:
            raise me.error
        return me.result  # type: ignore[no-any-return]

    def _commit(self, group: list[_Member[Any]], me: _Member[Any]) -> bool:
        """Commit ``group`` (which holds ``me``) and release its other members; True when ``me`` must run alone."""
        if len(group) == 1:
            try:
                me.result = self._run_alone(me.fn)
            except BaseException as exc:
                me.error = exc
            me.state = "done"
            return False
        try:
            results = self._run_group([m.fn for m in group])
        except BaseException as exc:
            # Nothing of the group committed. Each member learns its own outcome by running alone (see the
            # module docstring); the leader's own error, if it was the cause, is raised again by its own run.
            for m in group:
                if m is not me:
                    m.state = "alone"
                    m.event.set()
            if not isinstance(exc, Exception):
                raise  # an interrupt of the leader's thread is the leader's to raise, never to swallow
            return True
        for m, r in zip(group, results, strict=True):
            m.result, m.state = r, "done"
            if m is not me:
                m.event.set()
        return False
