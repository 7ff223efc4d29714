"""Deployed durable flows resume through Prefect: a flow served by ``flow.serve`` in a subprocess,
started with ``run_deployment``, parks under ``SMTHRS_WAIT_BUDGET_S=0`` — on a timer (Prefect shows it Scheduled at
the stored deadline), an approval or a ``wait_for`` (Paused) — and Prefect's own runner executes the SAME flow run
again, bound to the SAME smthrs run: no ``smthrs worker`` runs anywhere. Approvals (the real CLI) and
``sp.complete`` wake it through the Prefect API; a runner killed while the flow run is parked is replaced by a new
``flow.serve`` that continues it. Real processes, the session's Prefect server, a SQLite workspace."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import smthrs_plugin as sp
from smthrs_plugin.engine.waits.flow_waits import HostWakeFailed, HostWoken

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

FLOW_PY = """\
import os
from prefect import flow
import smthrs_plugin as sp

def _mark(tag, what):
    with open(os.environ["MARKS"], "a") as f:
        f.write(f"{tag}:{what}\\n")

@sp.step
def first(tag: str) -> str:
    _mark(tag, "first")
    return tag + "-1"

@sp.step
def second(tag: str, one: str, got: str) -> str:
    _mark(tag, "second:" + got)
    return one + "-2"

@flow(persist_result=False)
def durable(tag: str, wait: str, seconds: float = 5) -> str:
    one = first(tag)
    if wait == "sleep":
        sp.sleep(seconds, name="nap")
        got = "slept"
    elif wait == "approval":
        sp.require_approval("ship")
        got = "approved"
    else:
        got = str(sp.wait_for("go"))
    return second(tag, one, got)
"""

SERVE_PY = """\
import sys
import depflow

if __name__ == "__main__":  # the runner spawns each flow run in a process that imports this module again
    depflow.durable.serve(name=sys.argv[1])
"""

FLOW = "prefect/durable"
DEADLINE_S = 120.0  # far above any step here; a slow 2-core machine still answers within it


@dataclass
class Served:
    """One ``flow.serve`` subprocess and the workspace its flow runs use."""

    name: str
    workspace: Path
    marks: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: the runner and any flow-run child
            self.proc.wait(timeout=60)


def _serve(flows: Path, workspace: Path, name: str) -> Served:
    # Outside the workspace: a step body's write into the workspace would be an undeclared output.
    marks = workspace.parent / f"{workspace.name}-marks.txt"
    env = {
        **os.environ,  # PREFECT_API_URL: the session's server (prefect_api)
        "SMTHRS_WORKSPACE": str(workspace),
        "SMTHRS_WAIT_BUDGET_S": "0",  # every wait parks: Prefect, not this process, brings the flow run back
        "MARKS": str(marks),
        "PYTHONPATH": os.pathsep.join([str(flows), os.environ.get("PYTHONPATH", "")]),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    log = workspace / f"serve-{name}-{uuid.uuid4().hex[:6]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(flows / "serve_dep.py"), name],
            cwd=flows,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    served = Served(name, workspace, marks, env, proc, log)
    _until(lambda: _deployment_ready(served), f"deployment durable/{name} served", served)
    return served


def _deployment_ready(served: Served) -> bool:
    from prefect.client.orchestration import get_client

    assert served.proc.poll() is None, f"flow.serve exited {served.proc.returncode}"
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(f"durable/{served.name}")
        except Exception:  # not registered yet
            return False
    return True


def _until(cond: Callable[[], Any], what: str, served: Served | None = None) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := cond()):
        if time.monotonic() > deadline:
            tail = "" if served is None else served.log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"not reached within {DEADLINE_S} s: {what}\n{tail}")
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def flows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("depflows")
    (d / "depflow.py").write_text(FLOW_PY)
    (d / "serve_dep.py").write_text(SERVE_PY)
    return d


@pytest.fixture(scope="module")
def served(prefect_api: str, flows: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One deployment served for the module's tests (each uses its own tag, so its own steps and flow run)."""
    s = _serve(flows, tmp_path_factory.mktemp("depws"), "dep-shared")
    yield s
    s.stop()


def _start(served: Served, **parameters: Any) -> str:
    from prefect.deployments import run_deployment

    flow_run = run_deployment(f"durable/{served.name}", parameters=parameters, timeout=0)
    return str(flow_run.id)


class Watch:
    """A flow run's Prefect states as seen by polling (type, name, scheduled time) — the test's only view of
    Prefect, besides its API."""

    def __init__(self, flow_run_id: str) -> None:
        self.flow_run_id = flow_run_id
        self.seen: list[tuple[str, str, Any]] = []

    def state(self) -> Any:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(uuid.UUID(self.flow_run_id)).state
        shown = (state.type.value, state.name, state.state_details.scheduled_time)
        if not self.seen or self.seen[-1] != shown:
            self.seen.append(shown)
        return state

    def history(self) -> list[tuple[str, str]]:
        """Every state Prefect recorded for the flow run, oldest first: ``(type, name)``."""
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            states = client.read_flow_run_states(uuid.UUID(self.flow_run_id))
        return [(st.type.value, str(st.name)) for st in sorted(states, key=lambda st: st.timestamp)]

    def until(self, served: Served, what: str, test: Callable[[Any], bool]) -> Any:
        try:
            return _until(lambda: (s := self.state()) is not None and test(s) and s, what, served)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nstates seen: {self.seen}") from None


def _after(history: list[tuple[str, str]], *states: tuple[str, str]) -> bool:
    """``states`` occur in ``history`` in this order (other states may come between)."""
    it = iter(history)
    return all(any(seen == want for seen in it) for want in states)


def _parked(kind: str) -> Callable[[Any], bool]:
    return lambda s: s.type.value == kind and s.name == "Parked"


def _completed(s: Any) -> bool:
    assert not (s.is_failed() or s.is_crashed() or s.is_cancelled()), f"{s.type.value} {s.name}: {s.message}"
    return bool(s.is_completed())


def _journal(served: Served, run_id: str) -> list[Any]:
    with sp.open_runtime(served.workspace) as rt:
        return rt.journal.read(run_id, limit=500)


def _runs_of(served: Served, flow_run_id: str) -> list[str]:
    with sp.open_runtime(served.workspace) as rt:
        return sorted(r.run_id for r in rt.runs.list(flow=FLOW, limit=200) if flow_run_id in r.run_id)


def _marks(served: Served, tag: str) -> list[str]:
    lines = served.marks.read_text().splitlines() if served.marks.exists() else []
    return [line.split(":", 1)[1] for line in lines if line.startswith(f"{tag}:")]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()  # nothing listens there now: a connection is refused at once
    return port


def _run_status(served: Served, run_id: str) -> str | None:
    with sp.open_runtime(served.workspace) as rt:
        rec = rt.runs.get(run_id)
    return None if rec is None else rec.status


def _assert_one_run_each_step_once(served: Served, flow_run_id: str, tag: str, got: str) -> list[Any]:
    run_id = f"prefect-{flow_run_id}"
    # Called once Prefect shows the flow run Completed: the smthrs run (and its buffered hit records) settled
    # BEFORE Prefect was told, in the runner's process (prefect/_flowrun.py) — no wait for a hook.
    assert _run_status(served, run_id) == "completed"
    assert _runs_of(served, flow_run_id) == [run_id]  # re-executions reclaimed it: no fresh suffix
    assert _marks(served, tag) == ["first", f"second:{got}"]  # each step body once
    events = _journal(served, run_id)
    # The first step built by the first execution and served clean to the second; the step after the wait built
    # once (a hit's record is buffered, so it may land after the build that followed it).
    outcomes = sorted(
        (e.payload["step"].rsplit(".", 1)[-1], e.payload["outcome"])
        for e in events
        if e.type == "step-settled"
    )
    assert outcomes == [("depflow:first", "built"), ("depflow:first", "clean"), ("depflow:second", "built")]
    records = [e.payload for e in events if e.type == "prefect-flow-run"]
    assert len(records) == 1 and records[0]["flow_run_id"] == flow_run_id and records[0]["deployment_id"]
    return events


def test_a_deployed_flow_parked_on_a_timer_is_run_again_by_prefect_at_its_deadline_and_completes(
    served: Served,
) -> None:
    flow_run_id = _start(served, tag="timer", wait="sleep", seconds=5)
    run_id = f"prefect-{flow_run_id}"
    watch = Watch(flow_run_id)
    parked = watch.until(served, "flow run Scheduled (Parked) at the timer", _parked("SCHEDULED"))
    with sp.open_runtime(served.workspace) as rt:
        clock = rt.driver.waits.clock(FLOW, run_id, "nap")
    assert clock is not None
    # Prefect holds the flow run until the stored deadline (never before it).
    assert parked.state_details.scheduled_time.timestamp() * 1000 >= clock.due_at_ms
    watch.until(served, "flow run Completed", _completed)

    events = _assert_one_run_each_step_once(served, flow_run_id, "timer", "slept")
    after = [e for e in events if e.type == "step-settled"][-1]
    settled = [e for e in events if e.type == "run-settled"]
    assert after.created_at_ms >= clock.due_at_ms and len(settled) == 1
    assert settled[0].created_at_ms >= clock.due_at_ms
    fired = [e for e in events if e.type == "run-activated"]
    # Executed again only after the deadline, once.
    assert len(fired) == 2 and fired[1].created_at_ms >= clock.due_at_ms
    assert _after(
        watch.history(), ("SCHEDULED", "Parked"), ("RUNNING", "Running"), ("COMPLETED", "Completed")
    )


def test_a_deployed_flow_parked_on_an_approval_waits_until_smthrs_approve_then_completes(
    served: Served,
) -> None:
    flow_run_id = _start(served, tag="gate", wait="approval")
    run_id = f"prefect-{flow_run_id}"
    watch = Watch(flow_run_id)
    watch.until(served, "flow run Paused (Parked) on the approval", _parked("PAUSED"))
    assert _run_status(served, run_id) == "suspended"
    assert watch.state().is_paused() and _marks(served, "gate") == ["first"]  # nothing resumes it on its own

    approve = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "approve", run_id, "--request", "ship", "--json"],
        env=served.env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert approve.returncode == 0, approve.stdout + approve.stderr
    assert "could not be told" not in approve.stderr
    watch.until(served, "flow run Completed", _completed)
    assert _after(
        watch.history(), ("PAUSED", "Parked"), ("SCHEDULED", "Resuming"), ("COMPLETED", "Completed")
    )

    events = _assert_one_run_each_step_once(served, flow_run_id, "gate", "approved")
    approved = next(e for e in events if e.type == "control.approval.approved")
    assert approved.seq < [e for e in events if e.type == "step-settled"][-1].seq


def test_a_deployed_flow_waiting_for_an_event_is_woken_by_sp_complete_through_the_prefect_api(
    served: Served,
) -> None:
    flow_run_id = _start(served, tag="event", wait="event")
    run_id = f"prefect-{flow_run_id}"
    watch = Watch(flow_run_id)
    watch.until(served, "flow run Paused (Parked) on the event", _parked("PAUSED"))

    db = f"sqlite:///{served.workspace / '.smthrs' / 'state.db'}"
    done = sp.complete(run_id, "go", 7, db=db)  # the installed plugins' waker resumes the flow run
    assert done.wake is not None  # it woke the parked run in its own transaction
    watch.until(served, "flow run Completed", _completed)
    assert _after(
        watch.history(), ("PAUSED", "Parked"), ("SCHEDULED", "Resuming"), ("COMPLETED", "Completed")
    )
    _assert_one_run_each_step_once(served, flow_run_id, "event", "7")


def test_an_approval_that_cannot_reach_prefect_stands_is_reported_and_its_retry_resumes_the_flow_run(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    caplog.set_level(logging.WARNING, logger="smthrs_plugin.engine.waits.flow_waits")
    flow_run_id = _start(served, tag="down", wait="approval")
    run_id = f"prefect-{flow_run_id}"
    watch = Watch(flow_run_id)
    watch.until(served, "flow run Paused (Parked) on the approval", _parked("PAUSED"))
    with sp.open_runtime(served.workspace) as rt:
        control = rt.control()
        target = control.pending_requests(run_id)[0]
        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{_closed_port()}/api"}):
            assert isinstance(control.approve(target), sp.control.Accepted)  # the decision stands
        wake = control.last_host_wake()
        assert isinstance(wake, HostWakeFailed) and wake.host == "prefect" and wake.cause is not None
        assert flow_run_id in wake.detail and "Connection refused" in wake.detail
        assert "could not be told" in caplog.text and flow_run_id in caplog.text
        assert (
            _run_status(served, run_id) == "pending"
        )  # woken durably: a smthrs worker could continue it now
        assert watch.state().is_paused()  # ... but Prefect was not told
        # The same decision again: replayed (AlreadyApplied), and the host is asked again — now reachable.
        assert isinstance(control.approve(target), sp.control.AlreadyApplied)
        assert isinstance(control.last_host_wake(), HostWoken)
    watch.until(served, "flow run Completed", _completed)
    _assert_one_run_each_step_once(served, flow_run_id, "down", "approved")


def test_cancelling_a_parked_deployed_run_ends_its_flow_run_cancelled_without_running_the_body_again(
    served: Served,
) -> None:
    flow_run_id = _start(served, tag="cancel", wait="approval")
    run_id = f"prefect-{flow_run_id}"
    watch = Watch(flow_run_id)
    watch.until(served, "flow run Paused (Parked) on the approval", _parked("PAUSED"))
    with sp.open_runtime(served.workspace) as rt:
        control = rt.control()
        assert isinstance(control.cancel(run_id), sp.control.Accepted)
        assert isinstance(
            control.last_host_wake(), HostWoken
        )  # Prefect runs it again, and it finds it cancelled
    final = watch.until(served, "flow run Cancelled", lambda st: st.is_cancelled())
    assert run_id in str(final.message) and "cancelled" in str(final.message)
    assert _runs_of(served, flow_run_id) == [run_id]  # no fresh run to start the flow over in
    assert _run_status(served, run_id) == "cancelled" and _marks(served, "cancel") == ["first"]


def test_a_new_flow_serve_continues_a_flow_run_parked_while_its_runner_was_killed(
    prefect_api: str, flows: Path, tmp_path: Path
) -> None:
    first = _serve(flows, tmp_path, "dep-kill")
    try:
        # Long enough that the killed runner cannot have picked the flow run up again (it prefetches Scheduled
        # flow runs 10 s before their time): the continuation below is the new runner's.
        flow_run_id = _start(first, tag="kill", wait="sleep", seconds=20)
        watch = Watch(flow_run_id)
        watch.until(first, "flow run Scheduled (Parked) at the timer", _parked("SCHEDULED"))
        assert _run_status(first, f"prefect-{flow_run_id}") == "suspended"
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=60)
        assert watch.state().name == "Parked"  # parked in Prefect: nobody had taken it yet
    finally:
        first.stop()

    second = _serve(flows, tmp_path, "dep-kill")
    try:
        watch.until(second, "flow run Completed", _completed)
        # Settled before Prefect showed Completed (prefect/_flowrun.py): stopping the runner now loses nothing.
        assert _run_status(second, f"prefect-{flow_run_id}") == "completed"
    finally:
        second.stop()
    _assert_one_run_each_step_once(second, flow_run_id, "kill", "slept")
