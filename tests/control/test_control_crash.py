"""The retry path across real process deaths (SIGKILL), on SQLite and PostgreSQL: an admitting process that died
before launching, and an owner that died mid-run, are both taken over by the next call with the same key — once
the dead owner's lease expired (liveness, here the same-host pid probe, is consulted only for an expired lease).
The retry waits for that expiry (``follow``, the CLI's retry loop) with the stale window shortened to 1 s; nothing
here asserts elapsed time."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _control_support import crash_plan, journal_types

from smthrs_plugin.cli.control_support import PlanLauncher, follow
from smthrs_plugin.control.receipts import AlreadyApplied
from smthrs_plugin.engine.ownership.liveness import SameHostPidProbe
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
def test_the_same_key_takes_over_a_run_whose_process_died(
    db_url: str, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SMTHRS_STALE_AFTER_S", "1")
    monkeypatch.setenv("SMTHRS_HEARTBEAT_INTERVAL_S", "0.1")
    monkeypatch.setenv("SMTHRS_WAIT_POLL_S", "0.05")
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
        # The retry may come before the dead owner's lease expired: it waits for the expiry, then takes over.
        again = lambda: control.run(card, idempotency_key="app:v1", launcher=launcher)  # noqa: E731
        assert follow(control, receipt.run_id, again) is None
        assert launcher.report is not None and set(launcher.report.outcomes.values()) <= {"built", "clean"}
        assert control.show(receipt.run_id).status == "completed"
        types = journal_types(rt.db, receipt.run_id)
        expected = "control.run.reclaimed" if mode == "admit-and-die" else "stolen-and-activated"
        assert expected in types
