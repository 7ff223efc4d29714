"""Many coordinator processes on one database (SQLite, and PostgreSQL when configured), SIGKILLed at random and
re-driven until every run completes: no settlement a process saw commit is lost, none is doubled.

Each coordinator (``_many_worker.py``) drives its runs through the public API and appends ``run_id node_id
attempt`` to its own report after the settlement committed. A seeded ``random.Random`` picks which processes die
and after how many reported settlements; a new process re-drives each killed one's unfinished runs once their
lease lapses (``SMTHRS_STALE_AFTER_S`` shortened). The checks read the database: attempt rows and the journal.
Every wait has a 120 s deadline and waits on a condition (a report's length, a process's exit), never a time.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from smthrs_plugin.records.attempts import AttemptRecord, AttemptStore
from smthrs_plugin.records.journal import Journal, JournalEvent
from smthrs_plugin.records.runs import RunStore
from smthrs_plugin.stores.database import open_database

pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).with_name("_many_worker.py"))
FAST = {"SMTHRS_STALE_AFTER_S": "1", "SMTHRS_SKEW_ALLOWANCE_S": "0", "SMTHRS_HEARTBEAT_INTERVAL_S": "0.1"}
DEADLINE_S = 120.0
PROCESSES = 4
RUNS_PER_PROCESS = 2
NODES = 40
#: Rounds in which killing is allowed; later rounds only re-drive, so the test ends.
KILL_ROUNDS = 2


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {DEADLINE_S:.0f} s: {what}")
        time.sleep(0.01)


@dataclass
class Coordinator:
    """One worker process and its report file."""

    runs: list[str]
    report: Path
    proc: subprocess.Popen[bytes] = field(init=False)

    def start(self, db_url: str, workspace: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, db_url, str(workspace), str(self.report), str(NODES), *self.runs],
            stdout=subprocess.DEVNULL,
            stderr=self.report.with_suffix(".err").open("wb"),
            env={**os.environ, **FAST},
        )

    def lines(self) -> list[str]:
        return self.report.read_text().splitlines() if self.report.exists() else []

    def settled(self) -> int:
        return sum(1 for line in self.lines() if not line.startswith("owner "))

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def reached(self, settlements: int) -> bool:
        """It reported ``settlements`` settlements, or exited before it could."""
        return self.settled() >= settlements or self.exited()

    def nonce(self) -> str | None:
        first = self.lines()[:1]
        return first[0].split()[1] if first and first[0].startswith("owner ") else None

    def stderr(self) -> str:
        return self.report.with_suffix(".err").read_text()


@pytest.fixture
def coordinators() -> Iterator[list[Coordinator]]:
    started: list[Coordinator] = []
    yield started
    for c in started:  # a failed assertion must not leave coordinators behind
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait()


def _events(journal: Journal, run_id: str) -> list[JournalEvent]:
    out: list[JournalEvent] = []
    while page := journal.read(run_id, after_seq=out[-1].seq if out else None, limit=500):
        out += page
    return out


def test_killed_coordinators_neither_lose_nor_double_a_settlement(
    db_url: str, tmp_path: Path, coordinators: list[Coordinator]
) -> None:
    rng = random.Random(7)
    open_database(db_url).close()  # migrate once, before the processes race to
    pending = [[f"p{g}-r{r}" for r in range(RUNS_PER_PROCESS)] for g in range(PROCESSES)]
    all_runs = [run for group in pending for run in group]
    killed_nonces: set[str] = set()
    kills = 0
    db = open_database(db_url)
    runs = RunStore(db)
    for round_ in range(10):
        if not pending:
            break
        wave = [Coordinator(group, tmp_path / f"report-{round_}-{i}.txt") for i, group in enumerate(pending)]
        for i, c in enumerate(wave):
            c.start(db_url, tmp_path / f"ws-{round_}-{i}")
            coordinators.append(c)
        if round_ < KILL_ROUNDS:
            victims = rng.sample(wave, rng.randint(1, len(wave)))
            # After how many reported settlements each victim dies (round 0: anywhere in its first 60 of 80).
            after = [rng.randint(1, 60 if round_ == 0 else 10) for _ in victims]
            for v, n in zip(victims, after, strict=True):
                _wait(partial(v.reached, n), f"{n} settlements reported by {v.runs}")
                if v.proc.poll() is None:  # not reaped yet: the pid is still this process (or its zombie)
                    os.kill(v.proc.pid, signal.SIGKILL)
        for c in wave:
            _wait(c.exited, f"the coordinator of {c.runs} exits")
            if c.proc.returncode == -signal.SIGKILL:
                kills += 1
                nonce = c.nonce()
                if nonce is not None:
                    killed_nonces.add(nonce)
            else:
                assert c.proc.returncode == 0, c.stderr()
        # A killed coordinator's unfinished runs go to one new process.
        pending = []
        for c in wave:
            if c.proc.returncode == -signal.SIGKILL:
                left = [r for r in c.runs if (rec := runs.get(r)) is None or rec.status != "completed"]
                if left:
                    pending.append(left)
    assert not pending, f"runs still unfinished after 10 rounds: {pending}"
    assert kills >= 1, "no coordinator was killed mid-run: the test proved nothing"

    attempts = AttemptStore(db)
    journal = Journal(db)
    rows: dict[str, list[AttemptRecord]] = {}
    for run_id in all_runs:
        rec = runs.get(run_id)
        assert rec is not None and rec.status == "completed", (run_id, rec)
        rows[run_id] = attempts.list(run_id)
        completed = [r for r in rows[run_id] if r.state == "completed"]
        # Exactly one completed attempt per node: built once, replayed (never re-run) by later owners.
        assert Counter(r.node_id for r in completed) == {f"n{i}": 1 for i in range(NODES)}, run_id
        # Every other attempt row was begun by an owner that was killed before settling it.
        for r in rows[run_id]:
            if r.state != "completed":
                assert r.owner_nonce in killed_nonces, (run_id, r)
        events = _events(journal, run_id)
        finished = Counter(
            e.payload["node_id"]
            for e in events
            if e.type == "attempt-finished" and e.payload["outcome"] == "built"
        )
        built = Counter(
            e.payload["node_id"]
            for e in events
            if e.type == "node-settled" and e.payload["outcome"] == "built"
        )
        assert finished == built == {f"n{i}": 1 for i in range(NODES)}, run_id
        by_attempt = {
            (e.payload["node_id"], e.payload["attempt"]) for e in events if e.type == "attempt-finished"
        }
        for r in completed:
            assert (r.node_id, r.attempt) in by_attempt, (run_id, r)

    for c in coordinators:
        nonce = c.nonce()
        reported = set()
        for line in c.lines()[1:]:
            run_id, node_id, attempt = line.split()
            match = [r for r in rows[run_id] if r.node_id == node_id and r.attempt == int(attempt)]
            assert len(match) == 1 and match[0].state == "completed", (line, match)
            assert match[0].owner_nonce == nonce, (line, match)
            reported.add((run_id, node_id, int(attempt)))
        if c.proc.returncode == 0:
            # A coordinator that lived reported every settlement it made (the kills above may lose the last ones).
            own = {
                (run_id, r.node_id, r.attempt)
                for run_id in c.runs
                for r in rows[run_id]
                if r.owner_nonce == nonce and r.state == "completed"
            }
            assert reported == own, c.runs
    db.close()
