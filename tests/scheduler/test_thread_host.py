"""ThreadHost runs at most ``max_workers`` bodies at once, and a job whose body returned (it only waits for its
settlement's commit) gives its slot to the next job instead of holding it."""

from __future__ import annotations

import threading
from typing import Any

from smthrs_plugin.scheduler import ThreadHost
from smthrs_plugin.scheduler.host import body_returned

DEADLINE_S = 120.0  # an upper bound on waiting; a failure, never a measurement


class _Bodies:
    """Counts the jobs inside their bodies, and the most seen at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    def enter(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self._lock:
            self.now -= 1


class _Job:
    def __init__(self, bodies: _Bodies, then: Any = None) -> None:
        self.bodies, self.then = bodies, then

    def run(self) -> str:
        self.bodies.enter()
        self.bodies.leave()
        body_returned()
        if self.then is not None:
            self.then()
        return "done"


def test_a_job_waiting_after_its_body_returned_lets_the_next_job_start() -> None:
    # One slot. The first job, its body done, waits for something only the second job does (as a settlement waits
    # for the group commit the next job's thread may lead): holding its slot would deadlock.
    bodies = _Bodies()
    second_ran = threading.Event()
    with ThreadHost(1) as host:
        first = host.submit(_Job(bodies, then=lambda: second_ran.wait(DEADLINE_S)))
        second = host.submit(_Job(bodies, then=second_ran.set))
        assert second.result(DEADLINE_S) == "done"
        assert first.result(DEADLINE_S) == "done"
    assert second_ran.is_set()
    assert bodies.most == 1


def test_bodies_never_exceed_max_workers_while_many_jobs_wait_after_their_bodies() -> None:
    bodies = _Bodies()
    release = threading.Event()
    with ThreadHost(2) as host:
        waiting = [host.submit(_Job(bodies, then=lambda: release.wait(DEADLINE_S))) for _ in range(2)]
        later = [host.submit(_Job(bodies)) for _ in range(10)]
        for fut in later:  # they ran on the spare threads while the first two wait
            assert fut.result(DEADLINE_S) == "done"
        release.set()
        assert all(f.result(DEADLINE_S) == "done" for f in waiting)
    assert bodies.most <= 2


def test_body_returned_outside_a_thread_host_job_does_nothing() -> None:
    body_returned()  # the coordinator's thread, an inline host, another host's thread: no slot to give back
    body_returned()
