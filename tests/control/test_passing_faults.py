"""A passing fault of the environment never burns a CI key, through the REAL ``smthrs run PLAN --key K`` (one
subprocess per command) and real faults: a full disk (an 8 MB tmpfs holding the workspace and its database, filled
by a node mid-run) and an S3 endpoint that disappears mid-run (a private moto server, stopped while a node runs).

While the fault lasts, the same command answers 75 every time, naming the fault (its code) and what to do; the run
is never settled ``failed``. Once the fault is gone, the same command with the same key completes the run (exit 0),
its settled nodes replayed. A node's own failure stays a failure: exit 1, and 1 again on the retry.

No test depends on the machine's speed: "the node got there" is a marker file polled with a deadline far above any
command's duration; nothing asserts elapsed time.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

DEADLINE_S = 120  # far above any command's duration, however busy the machine
PASSING = {"unreachable", "disk_full", "locked", "read_only", "unavailable"}

FILL_PLAN = """\
plan: fill
flow: ci/fill
nodes:
  - id: build
    run: "mkdir -p dist && cp src/app.txt dist/app.txt && echo build >> $LOG"
    reads: ["src/app.txt"]
    writes: ["dist/"]
  - id: fill
    run: "echo fill >> $LOG; test -f $MARKS/filled || { touch $MARKS/filled; cat /dev/zero > $FILLER 2>/dev/null; true; }"
    needs: [build]
  - id: test
    run: "grep -q release dist/app.txt && echo ok > dist/ok.txt && echo test >> $LOG"
    reads: ["dist/app.txt"]
    writes: ["dist/ok.txt"]
    needs: [fill]
"""

S3_PLAN = """\
plan: upload
flow: ci/upload
nodes:
  - id: build
    run: "mkdir -p dist && cp src/app.txt dist/app.txt && echo build >> $LOG"
    reads: ["src/app.txt"]
    writes: ["dist/"]
  - id: bundle
    run: "echo bundle >> $LOG; test -f $MARKS/stop || { touch $MARKS/stop; while [ ! -f $MARKS/stopped ]; do sleep 0.05; done; }; head -c 2000000 /dev/urandom > bundle.bin"
    writes: ["bundle.bin"]
    needs: [build]
"""

FAILING_PLAN = """\
plan: broken
flow: ci/broken
nodes:
  - id: build
    run: "echo build >> $LOG"
  - id: test
    run: "echo test >> $LOG; exit 3"
    needs: [build]
"""


class Job:
    """One CI workspace (database under ``<workspace>/.smthrs``), a plan file and the ``smthrs`` command line."""

    def __init__(self, root: Path, plan: str, marks: Path, **env: str) -> None:
        self.ws = root / "ws"
        (self.ws / "src").mkdir(parents=True)
        (self.ws / "src" / "app.txt").write_text("release 1.0\n")
        self.plan = marks / "plan.yaml"
        self.plan.write_text(plan)
        self.marks = marks
        self.log = marks / "executions.log"
        self.env = {
            **os.environ,
            "SMTHRS_WORKSPACE": str(self.ws),
            # A process that died on the fault leaves its lease: a short one keeps the retries quick.
            "SMTHRS_STALE_AFTER_S": "2",
            "SMTHRS_SKEW_ALLOWANCE_S": "0",
            "SMTHRS_HEARTBEAT_INTERVAL_S": "0.2",
            "SMTHRS_WAIT_POLL_S": "0.1",
            "MARKS": str(marks),
            "LOG": str(self.log),
            **env,
        }
        for name in (
            "SMTHRS_DB_URL",
            "SMTHRS_ARTIFACTS_URL",
            "SMTHRS_ARTIFACTS_OPTIONS",
            "SMTHRS_ARTIFACTS_BLOCK",
        ):
            if name not in env:
                self.env.pop(name, None)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "smthrs_plugin", "run", str(self.plan), "--key", "ci:1", "--json"]

    def start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def run(self) -> tuple[int, dict[str, Any]]:
        return self.finish(self.start())

    @staticmethod
    def finish(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any]]:
        out, err = proc.communicate(timeout=DEADLINE_S)
        try:
            return proc.returncode, json.loads(out)
        except ValueError as exc:
            raise AssertionError(f"not one JSON object: {out!r} / {err!r}") from exc

    def executions(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def statuses(self) -> list[str]:
        """Every status the run rows ever settled with (the journal's ``run-settled`` records)."""
        c = sqlite3.connect(self.ws / ".smthrs" / "state.db")
        try:
            rows = c.execute("SELECT payload_json FROM journal_events WHERE type = 'run-settled'").fetchall()
        finally:
            c.close()  # an open handle would keep the tmpfs busy at its umount
        return [json.loads(p)["status"] for (p,) in rows]


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _top_up(filler: Path) -> None:
    """Keep the volume full: whatever a stopped process freed (a checkpointed log) is taken again."""
    with open(filler, "ab", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass  # full again: the fault lasts


def _assert_passing(code: int, out: dict[str, Any], *, families: set[str]) -> str:
    """The answer to a command a passing fault stopped: 75, the fault's typed code, the fix, no SQL."""
    assert code == 75, out
    err = out["error"]
    assert err["family"] in families and err["code"] in PASSING, err
    text = json.dumps(err)
    assert "[SQL" not in text and "SELECT " not in text and "INSERT " not in text and "UPDATE " not in text
    return str(err["message"])


def test_a_full_disk_answers_75_with_the_fault_until_freed_then_the_same_key_completes_the_run(
    volume: Path, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    filler = volume / "filler"
    job = Job(volume, FILL_PLAN, marks, FILLER=str(filler))

    code, out = job.run()  # `fill` fills the volume under the run's database mid-run
    first = _assert_passing(code, out, families={"store", "artifacts"})
    assert out["error"]["run_id"] and "left resumable" in first and "--key" in first
    for _ in range(2):  # the same command, the fault still there: the same answer, every time
        _top_up(filler)
        again, out = job.run()
        message = _assert_passing(again, out, families={"store", "artifacts"})
        assert "disk" in message or "space" in message or "full" in message, message

    filler.unlink()  # the operator frees the disk
    code, out = job.run()
    assert code == 0, out
    assert out["status"] == "completed" and out["receipt"]["_tag"] == "AlreadyApplied"
    outcomes = {s["node"]: s["outcome"] for s in out["settlements"]}
    assert outcomes["build"] == "clean"  # settled before the fault: replayed, not re-run
    assert job.executions().count("build") == 1 and job.executions().count("test") == 1
    assert "failed" not in job.statuses()  # never recorded failed, not even for a moment
    code, out = job.run()
    assert (code, out["status"]) == (0, "completed")


@pytest.fixture
def private_s3() -> Iterator[tuple[Any, str]]:
    """A moto S3 server of this test's own on a fixed port, so it can be stopped and started again there (moto's
    state lives in this process: the bucket and its objects survive the restart)."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    box = [server]
    yield box, f"http://127.0.0.1:{port}"
    box[0].stop()


def test_an_s3_endpoint_gone_mid_run_answers_75_until_it_is_back_then_the_same_key_completes_the_run(
    private_s3: tuple[list[Any], str], tmp_path: Path
) -> None:
    import s3fs
    from moto.server import ThreadedMotoServer

    box, endpoint = private_s3
    # No retry loops of the client: a gone endpoint is answered at once (the fault under test, not its timing).
    options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("smthrs-faults")
    marks = tmp_path / "marks"
    marks.mkdir()
    job = Job(
        tmp_path,
        S3_PLAN,
        marks,
        SMTHRS_ARTIFACTS_URL="s3://smthrs-faults/artifacts",
        SMTHRS_ARTIFACTS_OPTIONS=json.dumps(options),
    )

    proc = job.start()
    _wait_for(marks / "stop", proc)  # `bundle` is running: the endpoint disappears under it
    box[0].stop()
    (marks / "stopped").touch()
    code, out = job.finish(proc)  # its 2 MB output spills to the artifact store, which does not answer
    message = _assert_passing(code, out, families={"artifacts"})
    assert "left resumable" in message and out["error"]["code"] == "unavailable"
    again, out = job.run()
    _assert_passing(again, out, families={"artifacts"})

    host, port = endpoint.removeprefix("http://").split(":")
    box[0] = ThreadedMotoServer(ip_address=host, port=int(port), verbose=False)
    box[0].start()  # the endpoint is back
    code, out = job.run()
    assert code == 0, out
    assert out["status"] == "completed" and out["receipt"]["_tag"] == "AlreadyApplied"
    assert {s["node"]: s["outcome"] for s in out["settlements"]} == {"build": "clean", "bundle": "built"}
    assert job.executions().count("build") == 1
    assert "failed" not in job.statuses()


def test_a_nodes_own_failure_stays_exit_1_on_every_retry(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    job = Job(tmp_path, FAILING_PLAN, marks)
    code, out = job.run()
    assert (code, out["status"]) == (1, "failed"), out
    for _ in range(2):
        code, out = job.run()
        assert (code, out["status"], out["receipt"]["_tag"]) == (1, "failed", "AlreadyApplied"), out
    assert job.executions() == ["build", "test"]  # final: the retry ran nothing again
