"""Sandboxes and staging directories left by a killed process are swept, and nothing else is (boundary/_litter.py):
real processes, a real SIGKILL in the middle of a step body, a live neighbour whose sandbox must survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from smthrs_plugin.boundary import _litter
from smthrs_plugin.boundary._litter import owned_temp_dir, staging_dir

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="owner tags need /proc (Linux)")

#: A process that runs a step body in a sandbox under argv[2] and blocks in it until killed.
BLOCKED_BODY = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from smthrs_plugin.boundary import Declaration, run_in_sandbox
    ws, sandboxes, ready = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    def body(root):
        (root / "out.txt").write_text("half")
        ready.write_text(str(root))
        time.sleep(3600)
    run_in_sandbox(ws, Declaration(reads=["in.txt"], writes=["out.txt"]), body, artifacts=None, temp_dir=sandboxes)
    """
)


def _until(cond: object, what: str) -> None:
    deadline = time.monotonic() + 120
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _blocked(ws: Path, sandboxes: Path, ready: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", BLOCKED_BODY, str(ws), str(sandboxes), str(ready)])


def test_a_sandbox_left_by_a_killed_body_is_swept_and_a_live_ones_is_not(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "in.txt").write_text("input\n")
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    killed = _blocked(ws, sandboxes, tmp_path / "killed.ready")
    live = _blocked(ws, sandboxes, tmp_path / "live.ready")
    try:
        _until(
            lambda: (tmp_path / "killed.ready").exists() and (tmp_path / "live.ready").exists(), "both bodies"
        )
        killed_root = Path((tmp_path / "killed.ready").read_text())
        live_root = Path((tmp_path / "live.ready").read_text())
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        assert killed_root.exists()  # SIGKILL: nobody cleaned up
        assert not (ws / "out.txt").exists()  # the killed body's half-written output never left its sandbox

        # The next process to make a sandbox there sweeps what the dead one left, and only that.
        subprocess.run(
            [
                sys.executable,
                "-c",
                BLOCKED_BODY.replace("time.sleep(3600)", "pass"),
                str(ws),
                str(sandboxes),
                str(tmp_path / "third.ready"),
            ],
            check=True,
            timeout=300,
        )
        assert not killed_root.parent.exists()
        assert live_root.exists() and (live_root / "out.txt").read_text() == "half"
        assert list(sandboxes.iterdir()) == [live_root.parent]
    finally:
        live.kill()
        live.wait(timeout=60)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def test_only_directories_of_this_machine_whose_owner_is_provably_gone_are_swept(tmp_path: Path) -> None:
    scope = _litter._scope()
    assert scope is not None
    me, my_start = os.getpid(), _litter._start_time(os.getpid())
    where = tmp_path / "tmp"
    where.mkdir()
    names = {
        "dead": f"smthrs-sandbox-{scope}-{_dead_pid()}-12345-abc",
        "reused_pid": f"smthrs-sandbox-{scope}-{me}-1-abc",  # this pid, another start time: a previous owner
        "alive": f"smthrs-sandbox-{scope}-{me}-{my_start}-abc",
        "other_machine": f"smthrs-sandbox-{'0' * 12}-{_dead_pid()}-12345-abc",
        "old_style": "smthrs-sandbox-k2j3h4",
        "not_ours": f"other-{scope}-{_dead_pid()}-12345-abc",
    }
    for name in names.values():
        (where / name / "root").mkdir(parents=True)
        (where / name / "root" / "f").write_text("x")
        os.chmod(where / name / "root", 0o555)  # a read-only tree left by a body: removed all the same
    made = owned_temp_dir("smthrs-sandbox", where)
    left = {p.name for p in where.iterdir()}
    assert left == {made.name} | {names[k] for k in ("alive", "other_machine", "old_style", "not_ours")}
    assert made.name.startswith(f"smthrs-sandbox-{scope}-{me}-{my_start}-")


def test_a_staging_directory_left_by_a_killed_replay_is_swept_from_the_workspace(tmp_path: Path) -> None:
    scope = _litter._scope()
    left = tmp_path / ".smthrs" / "tmp" / f"replay-{scope}-{_dead_pid()}-777-xyz"
    left.mkdir(parents=True)
    (left / "0").write_text("staged output")
    fresh = staging_dir(tmp_path, "replay")
    assert not left.exists()
    assert fresh.parent == tmp_path / ".smthrs" / "tmp" and fresh.is_dir()


def test_a_directory_is_swept_once_per_process_not_at_every_sandbox(tmp_path: Path) -> None:
    scope = _litter._scope()
    owned_temp_dir("smthrs-sandbox", tmp_path)
    late = tmp_path / f"smthrs-sandbox-{scope}-{_dead_pid()}-1-late"
    late.mkdir()
    owned_temp_dir("smthrs-sandbox", tmp_path)
    assert late.exists()  # the next process to make a sandbox here sweeps it
