"""Threads started together: the suites that race writers or readers in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable

#: Far above any thread's work here: a thread still alive after it is a hang, not a slow machine.
DEADLINE_S = 120.0


def run_threads(target: Callable[[int], object], n: int) -> list[BaseException]:
    """Run ``target(i)`` for i in range(n) on n threads released together by a barrier; return what they raised
    (the test asserts on it). A thread still running at the deadline fails the test."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait(DEADLINE_S)
            target(i)
        except BaseException as exc:  # collected: the test asserts on them
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), f"a thread running {target!r} never returned"
    return errors
