"""Process hygiene shared by the suites that start servers."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PRELOAD: set[str] = set()


def die_with_parent() -> None:
    """``Popen(preexec_fn=...)``: the child gets SIGTERM when the test process that started it dies. A test worker
    that is SIGKILLed (a killed CI run, a timeout) never reaches its fixture's teardown; without this its servers
    would outlive it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def worker_processes(*preload: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of the suites that race real processes. A forkserver that has imported
    ``preload`` (the worker module, s3fs) forks each racer already warm: the racers are still separate processes with
    their own interpreter state and file descriptors, but none pays the two seconds of imports a spawned one does,
    which on two cores would stretch the start line the race depends on. The server itself is started clean (not
    forked from the threaded test process), so no lock held by another thread is inherited."""
    _PRELOAD.update(preload)  # one forkserver per test process: it must know every suite's modules
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(sorted(_PRELOAD))
    return ctx


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the open and the read: ESRCH
        return False
