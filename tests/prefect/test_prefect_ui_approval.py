"""A flow run parked on an smthrs approval, as Prefect's UI shows it and as its Resume button acts on it.

Deployed flows are served by ``flow.serve`` subprocesses (the session's Prefect server, flow-run logs sent to it);
Prefect's Resume is driven through its client API (``prefect.flow_runs.resume_flow_run(run_id, run_input=...)``),
which is what the UI's Resume form calls. The approval authority of the served processes is a real plugin (an
installed ``smthrs`` entry point on their ``PYTHONPATH``) that lets ``ci/reviewer`` decide request ``ship`` only.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

import smthrs_plugin as sp

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

FLOW_PY = """\
from prefect import flow
import smthrs_plugin as sp

@sp.step
def first(tag: str) -> str:
    return tag + "-1"

@sp.step
def second(one: str) -> str:
    return one + "-2"

@flow(persist_result=False)
def uigated(tag: str, request: str = "ship") -> str:
    one = first(tag)
    sp.require_approval(request)
    return second(one)
"""

SERVE_PY = """\
import sys
import uiflow

if __name__ == "__main__":
    uiflow.uigated.serve(name=sys.argv[1])
"""

GATE_PY = """\
from smthrs_plugin.control import Authorized, Principal, Unauthorized
from smthrs_plugin.hooks.specs import hookimpl

REVIEWER = Principal("ci", "reviewer")


class ShipOnly:
    def authorize(self, principal, action, target):
        if principal == Principal() or (principal == REVIEWER and target.endswith("/ship")):
            return Authorized(principal)
        return Unauthorized(principal, f"{principal} may not {action} {target}")


@hookimpl
def smthrs_approval_authority(settings):
    return ShipOnly()
"""

REVIEW = "http://review.example:8765/"
DEADLINE_S = 120.0


@dataclass
class Served:
    name: str
    workspace: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: the runner and any flow-run child
            self.proc.wait(timeout=60)


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
    d = tmp_path_factory.mktemp("uiflows")
    (d / "uiflow.py").write_text(FLOW_PY)
    (d / "serve_ui.py").write_text(SERVE_PY)
    (d / "uigate.py").write_text(GATE_PY)
    dist = d / "uigate-0.1.dist-info"  # what an installer leaves behind: the plugin's entry point
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: uigate\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[smthrs]\nuigate = uigate\n")
    return d


def _serve(flows: Path, workspace: Path, name: str, **extra: str) -> Served:
    env = {
        **os.environ,  # PREFECT_API_URL: the session's server (prefect_api)
        "SMTHRS_WORKSPACE": str(workspace),
        "SMTHRS_WAIT_BUDGET_S": "0",  # every wait parks
        "SMTHRS_REVIEW_URL": REVIEW,
        "PYTHONPATH": os.pathsep.join([str(flows), os.environ.get("PYTHONPATH", "")]),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PREFECT_LOGGING_TO_API_ENABLED": "true",  # the flow runs' logs are what the test reads
        "PREFECT_LOGGING_LEVEL": "INFO",  # the suite's default (WARNING) would drop the parked line
        **extra,
    }
    log = workspace / f"serve-{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(flows / "serve_ui.py"), name],
            cwd=flows,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    served = Served(name, workspace, env, proc, log)
    _until(lambda: _ready(served), f"deployment uigated/{name} served", served)
    return served


def _ready(served: Served) -> bool:
    from prefect.client.orchestration import get_client

    assert served.proc.poll() is None, f"flow.serve exited {served.proc.returncode}"
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(f"uigated/{served.name}")
        except Exception:  # not registered yet
            return False
    return True


@pytest.fixture(scope="module")
def with_principal(
    prefect_api: str, flows: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    s = _serve(
        flows, tmp_path_factory.mktemp("uiws"), "ui-principal", SMTHRS_PREFECT_UI_PRINCIPAL="ci/reviewer"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def without_principal(
    prefect_api: str, flows: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    s = _serve(flows, tmp_path_factory.mktemp("uiws"), "ui-none")
    yield s
    s.stop()


def _start(served: Served, **parameters: Any) -> str:
    from prefect.deployments import run_deployment

    return str(run_deployment(f"uigated/{served.name}", parameters=parameters, timeout=0).id)


def _state(flow_run_id: str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(uuid.UUID(flow_run_id)).state


def _parked_states(flow_run_id: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(uuid.UUID(flow_run_id))
    return sum(1 for s in states if s.is_paused() and s.name == "Parked")


def _logs(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])))
    return [entry.message for entry in logs]


def _log_with(flow_run_id: str, *needles: str) -> str:
    return str(
        _until(
            lambda: next((m for m in _logs(flow_run_id) if all(n in m for n in needles)), None),
            f"a log line of flow run {flow_run_id} with {needles}",
        )
    )


def _parked(served: Served, flow_run_id: str, times: int = 1) -> Any:
    return _until(
        lambda: (
            (s := _state(flow_run_id)) is not None
            and s.is_paused()
            and s.name == "Parked"
            and _parked_states(flow_run_id) >= times
            and s
        ),
        f"flow run {flow_run_id} Paused (Parked) {times} time(s)",
        served,
    )


def _journal(served: Served, run_id: str) -> list[Any]:
    with sp.open_runtime(served.workspace) as rt:
        return rt.journal.read(run_id, limit=500)


def _decisions(served: Served, run_id: str) -> list[tuple[str, str]]:
    decided = ("control.approval.approved", "control.approval.denied")
    return [
        (e.type, "{id}/{kind}".format(**e.payload["principal"]))
        for e in _journal(served, run_id)
        if e.type in decided
    ]


def _status(served: Served, run_id: str) -> str | None:
    with sp.open_runtime(served.workspace) as rt:
        row = rt.runs.get(run_id)
    return None if row is None else row.status


def test_a_parked_approval_names_the_command_the_review_page_and_the_resume_form_in_its_state_and_logs(
    with_principal: Served,
) -> None:
    from prefect.flow_runs import resume_flow_run

    flow_run_id = _start(with_principal, tag="named")
    run_id = f"prefect-{flow_run_id}"
    state = _parked(with_principal, flow_run_id)
    command = f"smthrs approve {run_id} --request ship"
    message = str(state.message)
    assert command in message and f"smthrs deny {run_id} --request ship" in message and REVIEW in message
    assert "Resume here with a decision (recorded as ci/reviewer)" in message and len(message) < 500
    assert state.state_details.run_input_keyset  # the UI shows a Resume form
    logged = _log_with(flow_run_id, "parked:", command)
    assert REVIEW in logged and "approval 'ship'" in logged

    # Approve from the form: the decision is recorded as the configured principal and the run completes.
    resume_flow_run(uuid.UUID(flow_run_id), run_input={"decision": "approve", "note": "looks fine"})
    final = _until(lambda: (s := _state(flow_run_id)).is_final() and s, "flow run final", with_principal)
    assert final.is_completed(), f"{final.type.value} {final.name}: {final.message}"
    assert _status(with_principal, run_id) == "completed"
    assert _decisions(with_principal, run_id) == [("control.approval.approved", "ci/reviewer")]
    assert "note: looks fine" in _log_with(flow_run_id, "recorded approve", "ci/reviewer")


def test_a_deny_from_the_resume_form_settles_the_run_as_the_cli_deny_does(with_principal: Served) -> None:
    from prefect.flow_runs import resume_flow_run

    flow_run_id = _start(with_principal, tag="denied")
    run_id = f"prefect-{flow_run_id}"
    _parked(with_principal, flow_run_id)
    resume_flow_run(uuid.UUID(flow_run_id), run_input={"decision": "deny"})
    final = _until(lambda: (s := _state(flow_run_id)).is_final() and s, "flow run final", with_principal)
    assert final.is_failed() and "approval_denied" in str(final.message)
    # A failed ending is concluded by the flow run's state hook, after Prefect shows it: wait for it.
    _until(lambda: _status(with_principal, run_id) == "failed", f"smthrs run {run_id} failed", with_principal)
    assert _decisions(with_principal, run_id) == [("control.approval.denied", "ci/reviewer")]


def test_a_principal_the_gate_does_not_allow_is_refused_on_the_flow_run_and_it_stays_parked(
    with_principal: Served,
) -> None:
    from prefect.flow_runs import resume_flow_run

    # ci/reviewer may decide "ship" only
    flow_run_id = _start(with_principal, tag="refused", request="launch")
    run_id = f"prefect-{flow_run_id}"
    _parked(with_principal, flow_run_id)
    resume_flow_run(uuid.UUID(flow_run_id), run_input={"decision": "approve"})
    refused = _log_with(flow_run_id, "was refused (control/unauthorized)")
    assert f"smthrs approve {run_id} --request launch" in refused
    _parked(with_principal, flow_run_id, times=2)  # executed again, parked again
    assert _decisions(with_principal, run_id) == [] and _status(with_principal, run_id) == "suspended"
    with sp.open_runtime(with_principal.workspace) as rt:
        assert [t.request_id for t in rt.control().pending_requests(run_id)] == ["launch"]


def test_without_the_principal_resume_records_nothing_and_says_where_to_decide(
    without_principal: Served,
) -> None:
    from prefect.flow_runs import resume_flow_run

    flow_run_id = _start(without_principal, tag="nothing")
    run_id = f"prefect-{flow_run_id}"
    state = _parked(without_principal, flow_run_id)
    assert "Prefect's Resume decides nothing here" in str(state.message)
    assert f"smthrs approve {run_id} --request ship" in str(state.message)
    resume_flow_run(uuid.UUID(flow_run_id))
    said = _log_with(flow_run_id, "resumed from Prefect without a decision")
    assert f"smthrs approve {run_id} --request ship" in said
    _parked(without_principal, flow_run_id, times=2)
    assert _decisions(without_principal, run_id) == [] and _status(without_principal, run_id) == "suspended"


# -- a direct flow run: nothing would continue it after a Resume ----------------------------------------------


@flow(persist_result=False)
def gated_here(n: int) -> int:
    sp.require_approval("ship")
    return n


def test_a_direct_flow_runs_resume_is_refused_and_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.flow_runs import resume_flow_run

    monkeypatch.setenv("SMTHRS_WAIT_BUDGET_S", "0")
    monkeypatch.setenv("SMTHRS_REVIEW_URL", REVIEW)
    with sp.step_settings(workspace=tmp_path), pytest.raises(sp.RunParked) as parked:
        gated_here(1)
    run_id = parked.value.run_id
    flow_run_id = run_id.removeprefix("prefect-")
    state = _state(flow_run_id)
    assert state.is_paused() and f"smthrs approve {run_id} --request ship" in str(state.message)
    assert REVIEW in str(state.message) and "Prefect's Resume is refused here" in str(state.message)
    with pytest.raises(RuntimeError, match="resuming_from_prefect_decides_nothing"):
        resume_flow_run(uuid.UUID(flow_run_id), run_input={"decision": "approve"})
    with pytest.raises(RuntimeError, match="resuming_from_prefect_decides_nothing"):
        resume_flow_run(uuid.UUID(flow_run_id))
    assert _state(flow_run_id).is_paused()  # still shown parked, not Running with nobody running it
    with sp.open_runtime(tmp_path) as rt:
        assert [t.request_id for t in rt.control().pending_requests(run_id)] == ["ship"]


# -- the settle hook ------------------------------------------------------------------------------------------


@sp.step
def plus_one(n: int) -> int:
    return n + 1


@flow(persist_result=False)
def settled_once(n: int) -> int:
    return plus_one(n)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_settle_hook_runs_once_per_flow_run_direct_or_driven(tmp_path: Path) -> None:
    lines = _Lines()
    logger = logging.getLogger("prefect.flow_runs")
    level = logger.level
    logger.setLevel(logging.INFO)  # the suite's default (WARNING) drops the hook lines
    logger.addHandler(lines)
    try:
        with sp.step_settings(workspace=tmp_path):
            assert settled_once(1) == 2  # hooks the flow
            # A driver's flow is `flow.with_options(...)`: its hook lists are copies of the hooked ones.
            assert isinstance(sp.durable_run(settled_once, "hook-once-1", {"n": 2}), sp.DriveSettled)
            assert isinstance(sp.durable_run(settled_once, "hook-once-2", {"n": 3}), sp.DriveSettled)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    running = [line for line in lines.lines if line.startswith("Running hook '_settle_flow_run'")]
    assert len(running) == 3, lines.lines
    with sp.open_runtime(tmp_path) as rt:
        assert {rt.runs.get(r).status for r in ("hook-once-1", "hook-once-2")} == {"completed"}  # type: ignore[union-attr]
