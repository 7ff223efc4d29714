"""The retry path across real process deaths (SIGKILL), on SQLite and PostgreSQL: an admitting process that died
before launching, and an owner that died mid-run, are both taken over by the next call with the same key — at once
here, because the runtime's liveness check is the same-host pid probe (with the default lease check the takeover
waits for the lease to lapse: ``test_control_contract``)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _control_support import crash_plan, journal_types

from smthrs_plugin.cli._control_support import PlanLauncher
from smthrs_plugin.control.receipts import AlreadyApplied
from smthrs_plugin.engine.liveness import SameHostPidProbe
from smthrs_plugin.runtime import open_runtime

HERE = Path(__file__).resolve().parent


def _die(mode: str, db_url: str, ws: Path, marker: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "_control_proc.py"),
            mode,
            db_url,
            str(ws),
            "ctl-host",
            "app:v1",
            str(marker),
        ],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["admit-and-die", "die-mid-run"])
def test_the_same_key_takes_over_a_run_whose_process_died(db_url: str, tmp_path: Path, mode: str) -> None:
    ws, marker = tmp_path / "ws", tmp_path / "build-ran-once"
    ws.mkdir()
    if mode == "admit-and-die":
        marker.touch()  # build must not kill anyone here: the process dies in its launcher, before any node
    _die(mode, db_url, ws, marker)
    with open_runtime(workspace=ws, db=db_url, host_id="ctl-host", liveness=SameHostPidProbe()) as rt:
        control = rt.control()
        card = control.plan(crash_plan(str(marker)))
        status = rt.runs.list(limit=10)[0].status
        assert status == ("pending" if mode == "admit-and-die" else "running")
        launcher = PlanLauncher(rt, {})
        receipt = control.run(card, idempotency_key="app:v1", launcher=launcher)
        assert isinstance(receipt, AlreadyApplied) and receipt.run_id is not None
        assert launcher.report is not None and set(launcher.report.outcomes.values()) <= {"built", "clean"}
        assert control.show(receipt.run_id).status == "completed"
        types = journal_types(rt.db, receipt.run_id)
        expected = "control.run.reclaimed" if mode == "admit-and-die" else "stolen-and-activated"
        assert expected in types
