"""Process hygiene shared by the suites that start servers."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``Popen(preexec_fn=...)``: the child gets SIGTERM when the test process that started it dies. A test worker
    that is SIGKILLed (a killed CI run, a timeout) never reaches its fixture's teardown; without this its servers
    would outlive it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
