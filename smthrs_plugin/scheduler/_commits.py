"""The pass's commit pipeline: the coordinator's writes and the settlements of its in-process jobs share commits.

Why: a node's settlement (its attempt row, ``attempt-finished``, ``node-settled``, the local cache row) and the
coordinator's own writes (attempt rows of the next admitted nodes, settlements it decided) used to commit apart,
one transaction each — two or more fsynced commits per node, queueing on SQLite's single write lock. Here every
write of the pass goes through ONE first-in-first-out queue, and whoever arrives while no commit is in flight
leads: it takes everything queued so far (the coordinator's buffered writes and the settlements queued
meanwhile), runs it in ONE fenced transaction and commits once (leader/follower group commit). A job that queues
its settlement waits for the commit that holds it; the coordinator hands its writes over without waiting
(:meth:`CommitQueue.push`), so it prepares and dispatches the next nodes while a job's thread is inside the fsync
of the last commit, and it learns each job's outcome from the committed settlement itself
(:meth:`CommitQueue.wait`), not from the job's thread returning afterwards.

Invariants
- **Order.** Writes commit in the order they were queued; a group is a prefix of the queue. The coordinator
  pushes the begin of a pipelined job before it submits that job, so the job's settlement always follows its
  attempt row.
- **Each settlement stays atomic.** Queued functions run one after another in the group's transaction; if one
  raises, that transaction rolls back whole and runs again with each settlement in its own savepoint (a savepoint
  per settlement costs more than the settlement: it is paid only when one fails). There, one that raises rolls back
  alone and its job receives exactly that exception (as a lone transaction would have raised it); the others, and
  the coordinator's writes, commit. If the transaction as a whole fails (a lost fence, a storage error, a
  coordinator write refused), every job queued in it receives that error, the coordinator receives it from its next
  :meth:`CommitQueue.wait` or :meth:`CommitQueue.drive`, and nothing of it committed.
- **A queued settlement is announced, never reported.** A job that queues its settlement names its node
  (``commit(fn, returned=...)``): the coordinator hears at once that the body returned and may free its permit; it
  learns the outcome only from the commit.
- **Nothing is reported before it is durable.** A job is released, and the coordinator told its outcome, only
  after the commit holding its settlement; ``on_commit`` callbacks (journal subscribers) run after that commit on
  the leader's thread.
- **Progress without deadlock.** A job that queues while no commit is in flight leads; a leader hands the lead to
  the first job still queued, or gives it up, under the lock that queues writes. The coordinator's writes never
  make a commit of their own unless it asks for their durability (:meth:`CommitQueue.drive`: it then leads when
  nobody does). A commit asked for on the coordinator's own thread (an inline host) runs at once on that thread.
  After :meth:`CommitQueue.close` (an abort) queued and later settlements run on the job's own thread as
  ordinary group-committed writes, and queued coordinator writes are dropped (an abort discards them);
  :meth:`CommitQueue.hold` (what an interrupt does first) waits out the commit in flight and commits nothing
  more, so the attempts it then marks ``failed`` can neither begin nor settle behind its back; the coordinator
  writes it took off the queue are handed to the interrupt (:meth:`CommitQueue.take_held`), which commits them with
  its marking: a pipelined job already runs, and its begin must not be lost with them.
- Jobs in other processes never see this queue (it does not pickle); they commit themselves, fenced.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from ..errors import SchedulerError
from ..records.run_fence import fenced_block
from ..records.runs import OwnerId
from ..stores.database import Database
from ..stores.dberrors import RETRY_SQLSTATES, sqlstate, store_error

__all__ = ["CommitQueue", "Events", "Written"]

T = TypeVar("T")
Write = Callable[[Connection], Any]
#: Set on the thread running a settlement this queue routed (:meth:`CommitQueue.serving`), with the entry it runs.
_SERVING = threading.local()


class _Signal:
    """A job's wake-up: set, cleared and waited on like a ``threading.Event``, for one waiting thread. A bare lock
    held until set (no Condition, no waiter list): one is made, set and waited on for every settlement.

    ``set``/``clear`` of one signal never run at once: a signal is set under the queue's condition (a promotion to
    lead), or by the one thread that took its entry off the queue under that condition (a leader releasing its
    group, ``close``); only the entry's own job clears it (a promoted leader sent back by ``hold``, under the
    condition, before ``hold`` returns and so before any ``close``). Only the entry's own job waits on it."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def clear(self) -> None:
        if self._set:
            self._set = False
            self._lock.acquire()  # released by set(): does not block

    def wait(self) -> None:
        self._lock.acquire()
        self._lock.release()  # it stays set, as an Event does


class _Entry:
    """One queued unit: a job's settlement (``fn``, its job waits on ``event``) or a batch of the coordinator's
    writes (``writes``; nobody waits on it but the coordinator, through the queue's condition)."""

    __slots__ = ("fn", "writes", "event", "state", "result", "error", "outcome", "tags")

    def __init__(self, fn: Write | None, writes: list[Write] | None = None, tags: Any = None) -> None:
        self.fn = fn
        self.writes = writes
        self.event = _Signal() if fn is not None else None
        # "queued" → "lead" (a job promoted to lead the next group) | "done" | "alone" (commit yourself) |
        # "dropped" (coordinator writes an abort discarded)
        self.state = "queued"
        self.result: Any = None
        self.error: BaseException | None = None
        #: What the settlement told the coordinator (:meth:`CommitQueue.settled`), valid once it committed.
        self.outcome: Any = None
        #: The coordinator's bookkeeping for a batch of its writes (returned by :meth:`CommitQueue.wait`).
        self.tags = tags


class Events(NamedTuple):
    """What :meth:`CommitQueue.wait` returns: the outcomes of committed settlements (durable), the completed
    futures, the tags of committed coordinator batches and the jobs whose bodies returned and whose settlements
    were queued since (not durable yet: their outcomes follow in ``settled``)."""

    settled: list[Any]
    done: list[Future[Any]]
    written: list[Any]
    returned: list[str]


class Written:
    """A batch of the coordinator's writes as :meth:`CommitQueue.push` queued it: ``done`` once it committed
    (``error`` set when its transaction failed), ``tags`` the coordinator's bookkeeping for it."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    @property
    def done(self) -> bool:
        return self._entry.state in ("done", "dropped")

    @property
    def error(self) -> BaseException | None:
        return self._entry.error


class CommitQueue:
    """The pass's write queue and its group commits (see the module docstring). ``run_id``/``owner``: the fence
    every group transaction checks once (None: unfenced, for callers that fence inside their functions)."""

    def __init__(self, db: Database, run_id: str | None = None, owner: OwnerId | None = None) -> None:
        self.db = db
        self._run_id = run_id
        self._owner = owner
        self._cv = threading.Condition()
        self._queued: list[_Entry] = []
        self._leading = False
        self._held = False
        self._open = True
        self._writes_open = True
        self._coordinator = threading.get_ident()
        # What the coordinator learns from :meth:`wait`.
        self._settled: list[Any] = []
        self._done: list[Future[Any]] = []
        self._written: list[Any] = []
        self._returned: list[str] = []
        #: Whether a queued settlement wakes the coordinator (:meth:`wait`): only worth it while ready nodes wait
        #: for a permit (the coordinator sets it before it waits); otherwise it reads them at its next wake.
        self.wake_on_return = True
        self._failures: list[BaseException] = []
        #: Coordinator writes :meth:`hold` took off the queue, for the interrupt (:meth:`take_held`).
        self._held_writes: list[Write] = []
        #: Jobs whose outcome the coordinator learned from their committed settlement: their futures need not wake it.
        self._early: set[int] = set()

    # -- job side ------------------------------------------------------------------------------------------
    def commit(self, fn: Callable[[Connection], T], *, returned: str | None = None) -> T:
        """Commit ``fn(conn)`` in the pass's next group and return its result (or raise its error) once that
        transaction committed. ``returned``: the node whose body returned and whose settlement this is — the
        coordinator hears of it at once (:class:`Events`), before the commit: it may free that node's permit,
        never report its outcome."""
        if threading.get_ident() == self._coordinator:
            return self.db.write_batched(fn)
        item = _Entry(fn)
        with self._cv:
            if returned is not None:
                self._returned.append(returned)
                if self.wake_on_return:
                    self._cv.notify_all()
            if not self._open:
                item.state = "alone"
            else:
                self._queued.append(item)
                if not self._leading and not self._held:
                    self._leading = True
                    item.state = "lead"
        assert item.event is not None
        while True:
            if item.state == "queued":
                item.event.wait()
            if item.state != "lead":
                break
            self._lead(item)  # done, or queued again when the queue was held meanwhile
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

    @staticmethod
    def serving() -> bool:
        """Whether the settlement running on this thread now was routed through a commit queue (run in a group,
        or alone after the coordinator stopped serving): what a pipelined job checks, since only that route orders
        its settlement after its attempt row."""
        return getattr(_SERVING, "on", False) is True

    @staticmethod
    def settled(outcome: Any) -> None:
        """Tell the coordinator what the settlement running on this thread decided; it learns it once that
        settlement committed (ignored outside a group: an inline or remote job reports through its future)."""
        entry = getattr(_SERVING, "entry", None)
        if entry is not None:
            entry.outcome = outcome

    # -- coordinator side ----------------------------------------------------------------------------------
    def push(self, writes: list[Write], tags: Any = None) -> Written:
        """Queue a batch of the coordinator's writes for the next group, without waiting for it (see
        :meth:`drive`). Refused once :meth:`hold` or :meth:`close` ran: an abort discards them."""
        entry = _Entry(None, writes, tags)
        with self._cv:
            if not self._writes_open or not self._open:
                entry.state = "dropped"
            else:
                self._queued.append(entry)
        return Written(entry)

    def drive(self, written: Written) -> None:
        """Return once ``written`` (and so everything queued before it) committed, leading commits while nobody
        else does; raise the error of the transaction that failed it."""
        entry = written._entry
        while True:
            with self._cv:
                while entry.state == "queued" and self._leading:
                    self._cv.wait()
                if entry.state != "queued":
                    break
                self._leading = True
            self._lead()
        if entry.state == "dropped":
            raise SchedulerError(
                "store_failed",
                "internal: coordinator writes were asked to commit after the pass stopped serving its commit queue",
            )
        if entry.error is not None:
            with self._cv:  # raised here: not again from wait()
                self._failures = [f for f in self._failures if f is not entry.error]
            raise entry.error

    def watch(self, fut: Future[Any]) -> None:
        """Wake :meth:`wait` when ``fut`` completes, unless the coordinator already learned that job's outcome
        from its committed settlement and the job ended without an error."""

        def done(f: Future[Any]) -> None:
            with self._cv:
                if id(f) in self._early:
                    self._early.discard(id(f))
                    if not f.cancelled() and f.exception() is None:
                        return  # its outcome is known; nothing to wake the coordinator for
                self._done.append(f)
                self._cv.notify_all()

        fut.add_done_callback(done)

    def learned(self, fut: Future[Any]) -> None:
        """The coordinator took ``fut``'s outcome from its committed settlement: its plain return is not news.
        (A future already done has queued itself for :meth:`wait`, or is about to: the coordinator skips it there.)
        Atomic with the done callback, so an id is only remembered for a future whose callback is still to run."""
        with self._cv:
            if not fut.done():
                self._early.add(id(fut))

    def wait(self) -> Events:
        """Block until a settlement committed (or was queued, while :attr:`wake_on_return`), a watched future
        completed or a batch of writes committed; return (and forget) what happened (:class:`Events`). Raises the
        error of a group transaction that failed coordinator writes."""
        with self._cv:
            while not (
                self._settled
                or self._done
                or self._written
                or self._failures
                or (self._returned and self.wake_on_return)
            ):
                self._cv.wait()
            if self._failures:
                raise self._failures.pop(0)
            events = Events(self._settled, self._done, self._written, self._returned)
            self._settled, self._done, self._written, self._returned = [], [], [], []
        return events

    def collect(self) -> list[Any]:
        """The tags of batches committed since the last :meth:`wait` or :meth:`collect` (without blocking)."""
        with self._cv:
            written, self._written = self._written, []
        return written

    def hold(self) -> None:
        """Commit no more groups: wait out the one in flight, take the coordinator's queued writes off the queue
        (for :meth:`take_held`) and refuse later ones; settlements queue and wait for :meth:`close`. What an
        interrupt does first, so the attempts it then marks ``failed`` can neither begin nor settle behind its
        back."""
        with self._cv:
            self._held = True
            self._writes_open = False
            self._held_writes += self._drop_writes()
            while self._leading:
                self._cv.wait()

    def take_held(self) -> list[Write]:
        """The coordinator writes :meth:`hold` took off the queue, in queue order (and forget them). They include
        the begins of pipelined jobs that already run: the interrupt commits them in its own transaction, before
        it marks what is still ``started``, so every body that ran has its attempt."""
        with self._cv:
            held, self._held_writes = self._held_writes, []
        return held

    def close(self) -> None:
        """Stop serving: every queued and later settlement commits on its job's own thread; queued coordinator
        writes are dropped."""
        with self._cv:
            self._open = False
            items, self._queued = self._queued, []
        for item in items:
            if item.fn is None:
                item.state = "dropped"
                continue
            item.state = "alone"
            assert item.event is not None
            item.event.set()
        with self._cv:
            self._cv.notify_all()

    def _drop_writes(self) -> list[Write]:
        kept: list[_Entry] = []
        dropped: list[Write] = []
        for item in self._queued:
            if item.fn is None:
                item.state = "dropped"
                dropped += item.writes or ()
            else:
                kept.append(item)
        self._queued = kept
        return dropped

    # -- the leader ----------------------------------------------------------------------------------------
    def _lead(self, me: _Entry | None = None) -> None:
        """Commit everything queued so far as one group, then hand the lead on (module invariants). ``me``: the
        leading job's own settlement (None: the coordinator leads)."""
        with self._cv:
            if self._held:
                group = []
                if me is not None and me.state == "lead":  # it waits for close() like every queued settlement
                    me.state = "queued"
                    assert me.event is not None
                    me.event.clear()
            else:
                group, self._queued = self._queued, []
        try:
            if group:
                self._commit(group)
        finally:
            with self._cv:
                nxt = (
                    None if self._held else next((item for item in self._queued if item.fn is not None), None)
                )
                if nxt is not None:
                    nxt.state = "lead"
                    assert nxt.event is not None
                    nxt.event.set()
                else:
                    self._leading = False
                self._cv.notify_all()

    def _commit(self, group: list[_Entry]) -> None:
        failure: BaseException | None = None
        # Database.write, not write_batched: the group is this pass's group commit already.
        try:
            try:
                self.db.write(lambda conn: self._run(conn, group, savepoints=False))
            except Exception:
                if all(item.fn is None for item in group):
                    raise
                # Something refused and nothing committed: again, each settlement in its own savepoint, so a
                # refused one fails alone (its job gets its error) and the others commit.
                self.db.write(lambda conn: self._run(conn, group, savepoints=True))
        except BaseException as exc:
            failure = exc
        self._release(group, failure)
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # an interrupt of the leader's thread is the leader's to raise, never to swallow

    def _run(self, conn: Connection, group: list[_Entry], *, savepoints: bool) -> None:
        """Run ``group`` in the open transaction on ``conn``, in queue order, behind one fence check (none of these
        writes touches the run row, so every settlement's own check answers from this one)."""
        fence = (
            fenced_block(conn, self._run_id, self._owner)
            if self._run_id is not None and self._owner is not None
            else contextlib.nullcontext()
        )
        with fence:
            if savepoints:
                CommitQueue._run_each(self.db, conn, group)
            else:
                # Rows and records of the whole group are written by one statement per table at its end
                # (``Database.deferred``): same transaction, same outcome, a fraction of the statements.
                self.db.allow_deferred()
                with _serving():
                    for item in group:
                        if item.fn is None:
                            for w in item.writes or ():
                                w(conn)
                            continue
                        _SERVING.entry = item
                        item.outcome = None
                        item.result, item.error = item.fn(conn), None
                    _SERVING.entry = None

    @staticmethod
    def _run_each(db: Database, conn: Connection, group: list[_Entry]) -> None:
        with _serving():
            for item in group:
                if item.fn is None:
                    for w in item.writes or ():
                        w(conn)  # a coordinator write that raises fails the whole group, as it would alone
                    continue
                _SERVING.entry = item
                item.outcome = None
                try:
                    item.result, item.error = db.write(item.fn), None  # nested: a savepoint of the group
                except sa_exc.DBAPIError as exc:
                    if sqlstate(exc) in RETRY_SQLSTATES:
                        raise  # PostgreSQL serialization failure: the whole transaction retries, every item again
                    item.error = store_error(db, exc, "write")
                except (
                    Exception
                ) as exc:  # that job's outcome, raised on its own thread; the others still commit
                    item.error = exc
                finally:
                    _SERVING.entry = None

    def _release(self, group: list[_Entry], failure: BaseException | None) -> None:
        """Wake the jobs of ``group`` after its transaction ended and tell the coordinator what committed."""
        woken: list[_Signal] = []
        with self._cv:
            for item in group:
                if failure is not None:
                    item.result, item.error = None, failure
                if item.fn is None:
                    item.state = "done"
                    if failure is not None:
                        if not any(f is failure for f in self._failures):
                            self._failures.append(failure)
                    else:
                        self._written.append(item.tags)
                    continue
                if item.error is None and item.outcome is not None:
                    self._settled.append(item.outcome)
                item.state = "done"
                assert item.event is not None
                woken.append(item.event)
            self._cv.notify_all()
        # Woken after the condition is released: a wake-up is a system call, and the coordinator may be waiting
        # for the condition meanwhile. Only this leader sets these (the group left the queue under the condition).
        for event in woken:
            event.set()

    # -- for tests and the reference coordinator ----------------------------------------------------------
    def pending(self) -> bool:
        """Whether anything is queued and not yet taken by a leader."""
        with self._cv:
            return bool(self._queued)


@contextlib.contextmanager
def _serving() -> Iterator[None]:
    _SERVING.on = True
    try:
        yield
    finally:
        _SERVING.on = False
        _SERVING.entry = None
