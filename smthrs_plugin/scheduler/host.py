"""Hosts: where node executions run. The coordinator submits a :class:`~.job.NodeJob` and gets a Future back.

Invariants
- The coordinator thread is the single writer of a run's scheduling state; a host only runs jobs. A job's
  durable writes (its attempt settlement and journal records) happen inside the dispatch seam's own write
  transaction, fenced by the run's owner, wherever the job runs.
- A job is plain data plus callables that pickle by reference (URLs and ids, never engines or open files), so
  a host may run it in another process (the Prefect host, a Dask worker); :class:`ThreadHost` and
  :class:`InlineHost` run it in this one.
- ``submit`` never raises for the job's own failure: whatever the job raises is in its Future.

:class:`ThreadHost` is the local thread-pool host (it lives beside the protocol so that the composition root, below
``prefect`` in the layering, can default to it). :class:`InlineHost` runs each job on the submitting thread before ``submit`` returns: completions then
arrive in submission order, which makes a run fully deterministic (differential tests, debugging).
"""

from __future__ import annotations

import contextvars
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from ..errors import SettingsError

__all__ = ["Host", "Job", "ThreadHost", "InlineHost", "default_workers", "body_returned"]

#: The slot a ThreadHost job holds on its thread (see :func:`body_returned`).
_SLOT = threading.local()


@runtime_checkable
class Job(Protocol):
    """Anything with ``run() -> result``; the scheduler submits :class:`~.job.NodeJob` instances."""

    def run(self) -> Any: ...


@runtime_checkable
class Host(Protocol):
    """Runs submitted jobs and reports through Futures.

    A host may also declare ``shares_process = True``: every job it runs runs in the submitting process, on
    another thread than the submitter (so it reaches the coordinator's commit queue, ``_commits.py``), which
    lets the coordinator start sealed jobs before their attempt rows commit (``_session.py``, pipelining).
    Absent or False: each job starts only after its attempt row committed."""

    def submit(self, job: Job) -> Future[Any]:
        """Start ``job`` (now or later); its result or exception arrives through the returned Future."""
        ...

    def close(self) -> None:
        """Wait for running jobs and release the host's workers. Idempotent."""
        ...


def body_returned() -> None:
    """Tell the host running the current job that its body returned: what is left is waiting for its settlement's
    commit. A :class:`ThreadHost` then starts another job on another thread (so a group commit can hold more
    settlements than the host has workers); elsewhere (another host, the coordinator's thread) nothing happens.
    Idempotent."""
    release = getattr(_SLOT, "release", None)
    if release is not None:
        _SLOT.release = None
        release()


def default_workers() -> int:
    """Default worker count of the local host: enough threads to overlap I/O-bound nodes on a small machine."""
    return min(32, (os.cpu_count() or 1) + 4)


class ThreadHost:
    """Runs at most ``max_workers`` jobs' bodies at once (default :func:`default_workers`) on a thread pool. Node
    executions are usually I/O-bound (subprocesses, file copies, hashing that releases the GIL), so threads overlap
    them well. The scheduler's ``concurrency.steps`` caps how many are in flight; ``max_workers`` caps how many
    run at once.

    A job whose body returned (:func:`body_returned`) only waits for its settlement's commit: it gives its slot
    back, and the host starts the next job on a spare thread. Up to ``max_workers`` such waiting jobs get spare
    threads; beyond that the next job waits for a thread, never for anything a waiting job needs (the commit it
    waits for is led by one of them or by the coordinator), so a full pool slows down and never deadlocks."""

    def __init__(self, max_workers: int | None = None, *, thread_name_prefix: str = "smthrs-node") -> None:
        if max_workers is not None and (type(max_workers) is not int or max_workers < 1):
            raise SettingsError(
                "invalid_setting",
                f"max_workers={max_workers!r} must be a positive int (or None for the default)",
            )
        self.max_workers = max_workers or default_workers()
        #: Jobs run on this process's worker threads, never on the submitter's (see ``Host``).
        self.shares_process = True
        # Twice the slots: a spare thread for every job that may be waiting for its settlement's commit.
        self._pool = ThreadPoolExecutor(
            max_workers=2 * self.max_workers, thread_name_prefix=thread_name_prefix
        )
        self._slots = threading.Semaphore(self.max_workers)
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, job: Job) -> Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("this host is closed; create a new one")
            # The job runs in this submitter's context (the current run of engine/context.py: a timer node and
            # ``sp.sleep`` inside a node need it), as InlineHost's jobs do.
            return self._pool.submit(contextvars.copy_context().run, self._run, job)

    def _run(self, job: Job) -> Any:
        self._slots.acquire()
        _SLOT.release = self._slots.release
        try:
            return job.run()
        finally:
            body_returned()  # the slot goes back when the job returns, if its body did not say so earlier

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ThreadHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ThreadHost(max_workers={self.max_workers})"


class InlineHost:
    """Runs every job on the submitting thread, before :meth:`submit` returns (deterministic completions)."""

    def submit(self, job: Job) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(job.run())
        except BaseException as exc:  # the Future carries it to the coordinator, which decides
            fut.set_exception(exc)
        return fut

    def close(self) -> None:
        return None

    def __repr__(self) -> str:
        return "InlineHost()"
