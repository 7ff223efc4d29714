"""Cancelling from either side: a flow run cancelled in Prefect (what the UI's Cancel button does:
``set_flow_run_state(id, Cancelling())``) cancels its smthrs run, and ``smthrs cancel`` of a running flow run's run
ends the flow run Cancelled in Prefect — the body interrupted at its wait, the run settled ``cancelled`` once. Plan
timer nodes stop waiting when their pass is cancelled. Real processes, the session's Prefect server, SQLite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import smthrs_plugin as sp

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

DEADLINE_S = 120.0

#: A direct flow run that writes its flow run id (the handshake) and then waits, in process, for a value nobody
#: sends: only a cancellation ends it.
FLOW_PY = """\
import os
import sys

from prefect import flow
from prefect.runtime import flow_run

import smthrs_plugin as sp


@sp.step
def first(tag: str) -> str:
    return tag + "-1"


@sp.step
def after(one: str) -> str:
    with open(os.environ["MARKS"], "a") as f:
        f.write("after\\n")
    return one + "-2"


@flow(persist_result=False)
def quick(tag: str) -> str:
    return first(tag)


@flow(persist_result=False)
def waiter(tag: str) -> str:
    one = first(tag)
    with open(os.environ["HANDSHAKE"] + ".tmp", "w") as f:
        f.write(str(flow_run.id))
    os.replace(os.environ["HANDSHAKE"] + ".tmp", os.environ["HANDSHAKE"])
    got = sp.wait_for("go")
    return after(one + str(got))


if __name__ == "__main__":
    if len(sys.argv) > 2:  # an earlier flow run of this process, ended before the waiter binds
        quick(sys.argv[2])
    waiter(sys.argv[1])
"""


def _until(cond: Callable[[], Any], what: str, proc: subprocess.Popen[bytes] | None = None) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {DEADLINE_S} s: {what}")
        if proc is not None and proc.poll() is not None and not cond():
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"the flow process exited {proc.returncode} before {what}:\n{out[-4000:]}")
        time.sleep(0.1)
    return value


class Child:
    """One direct flow run in its own process, parked in-process on ``sp.wait_for('go')``."""

    def __init__(self, tmp: Path, tag: str, *before: str) -> None:
        (tmp / "cancelflow.py").write_text(FLOW_PY)
        self.workspace = tmp / "ws"
        self.workspace.mkdir()
        self.handshake = tmp / "flow-run-id"
        self.marks = tmp / "marks"
        self.env = {
            **os.environ,  # PREFECT_API_URL: the session's server
            "SMTHRS_WORKSPACE": str(self.workspace),
            "SMTHRS_WAIT_BUDGET_S": "3600",  # the wait stays in process: the body is running when cancelled
            "HANDSHAKE": str(self.handshake),
            "MARKS": str(self.marks),
            "PYTHONPATH": str(tmp),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(tmp / "cancelflow.py"), tag, *before],
            cwd=tmp,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.flow_run_id: str = _until(
            lambda: self.handshake.exists() and self.handshake.read_text(), "the body waits", self.proc
        )
        self.run_id = f"prefect-{self.flow_run_id}"
        _until(lambda: self.status() == "running", "the smthrs run is running", self.proc)

    def status(self) -> str | None:
        with sp.open_runtime(self.workspace) as rt:
            rec = rt.runs.get(self.run_id)
        return None if rec is None else rec.status

    def journal(self) -> list[Any]:
        with sp.open_runtime(self.workspace) as rt:
            return rt.journal.read(self.run_id, limit=500)

    def exited(self) -> int:
        self.proc.wait(timeout=DEADLINE_S)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


@pytest.fixture
def child(tmp_path: Path, prefect_api: str) -> Iterator[Callable[..., Child]]:
    started: list[Child] = []

    def start(tag: str, *before: str) -> Child:
        c = Child(tmp_path, tag, *before)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def _prefect_state(flow_run_id: str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id)).state


def _assert_cancelled_once(c: Child, principal: str) -> None:
    assert c.status() == "cancelled"
    events = c.journal()
    requested = [e.payload for e in events if e.type == "control.run.cancel-requested"]
    assert len(requested) == 1 and requested[0]["principal"]["id"] == principal, requested
    settled = [e.payload for e in events if e.type == "run-settled"]
    assert len(settled) == 1 and settled[0]["status"] == "cancelled"
    assert not c.marks.exists()  # the body stopped at its wait: the step after it never ran


def test_cancelling_a_running_flow_run_in_prefect_cancels_its_smthrs_run_once(
    child: Callable[[str], Child],
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    c = child("ui")
    with get_client(sync_client=True) as client:  # what the UI's Cancel button does
        client.set_flow_run_state(uuid.UUID(c.flow_run_id), Cancelling(), force=True)
    c.exited()
    _assert_cancelled_once(c, "prefect")
    final = _until(lambda: (st := _prefect_state(c.flow_run_id)).is_final() and st, "a final Prefect state")
    assert final.is_cancelled(), f"{final.type.value} {final.name}: {final.message}"


def test_a_flow_run_bound_after_an_earlier_one_ended_is_still_watched_for_cancellation(
    child: Callable[..., Child],
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    # The process's watcher went idle when the first flow run ended; the waiter's binding wakes it.
    c = child("second", "first")
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(c.flow_run_id), Cancelling(), force=True)
    c.exited()
    _assert_cancelled_once(c, "prefect")


def test_smthrs_cancel_of_a_running_flow_run_ends_the_prefect_flow_run_cancelled(
    child: Callable[[str], Child],
) -> None:
    c = child("cli")
    out = subprocess.run(
        [sys.executable, "-m", "smthrs_plugin", "cancel", c.run_id, "--json"],
        env=c.env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    c.exited()
    _assert_cancelled_once(c, "local")
    final = _until(lambda: (st := _prefect_state(c.flow_run_id)).is_final() and st, "a final Prefect state")
    assert final.is_cancelled(), f"{final.type.value} {final.name}: {final.message}"
    assert c.run_id in str(final.message)


def test_a_timer_node_stops_waiting_when_its_pass_is_cancelled(tmp_path: Path) -> None:
    import concurrent.futures

    from smthrs_plugin.engine.context import activate
    from smthrs_plugin.engine.lease import NAMED, Refused, acquire
    from smthrs_plugin.scheduler.cancel import CancelToken
    from smthrs_plugin.scheduler.model import NodeInput
    from smthrs_plugin.scheduler.timer import TimerInterrupted, run_timer, timer_name

    plan = sp.plan.compile_plan("p", "f", [sp.plan.node("cool", body={}, wait={"seconds": 3600})])
    (node,) = [n for n in plan.nodes if n.id == "cool"]
    token = CancelToken()
    with sp.open_runtime(tmp_path) as rt:
        lease = acquire(
            "timer-run", "f", NAMED, ownership=rt.ownership, runs=rt.runs, waits=rt.waits, budget_s=7200
        )
        assert not isinstance(lease, Refused)
        with lease:
            ni = NodeInput(node, 1, (), tmp_path, "key", "hard", cancel=token)

            def body() -> object:
                with activate(lease.context):
                    return run_timer(ni)

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(body)
                # Cancelled once the clock is scheduled: the node is inside its wait.
                _until(lambda: rt.waits.clock("f", "timer-run", timer_name("cool")) is not None, "the clock")
                assert not waiting.done()
                token.cancel("a sibling failed")
                with pytest.raises(TimerInterrupted, match="a sibling failed"):
                    waiting.result(timeout=DEADLINE_S)
            clock = rt.waits.clock("f", "timer-run", timer_name("cool"))
            assert clock is not None and clock.pending  # kept: the next drive finds its original deadline
            lease.release("test")
