"""Settlements share commits (the coordinator's commit queue, ``scheduler/_commits.py``) without weakening any
settlement: each stays atomic with its attempt row and journal records, nothing is reported before its commit is
durable, and a SIGKILL with a batch in flight loses no reported settlement."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

import smthrs_plugin as sp
from smthrs_plugin.errors import StoreError
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.scheduler import ThreadHost
from smthrs_plugin.scheduler._commits import CommitQueue, _Signal
from smthrs_plugin.stores.database import Database, open_database
from smthrs_plugin.stores.schema import attempts

DEADLINE_S = 120.0  # an upper bound on waiting for a child; a failure, never a measurement
NODES = 2000  # far more than settle before the kill point, on any machine


def _wide(n: int) -> sp.plan.Plan:
    nodes = [sp.plan.node(f"n{i}", body=i) for i in range(n)]
    return sp.plan.compile_plan("gc", "gc", nodes, maximum_plan_nodes=n + 10)


def _journal(db: Database, run_id: str) -> list[Any]:
    journal, out, after = Journal(db), [], None
    while page := journal.read(run_id, after_seq=after, limit=1000):
        out += page
        after = page[-1].seq
    return out


def _attempts(db: Database, run_id: str) -> dict[str, list[Any]]:
    a = attempts.c
    rows = db.read(
        lambda c: c.execute(sa.select(a.node_id, a.key, a.attempt, a.state).where(a.run_id == run_id)).all()
    )
    out: dict[str, list[Any]] = {}
    for r in rows:
        out.setdefault(r.node_id, []).append(r)
    return out


def _assert_settlements_atomic(db: Database, run_id: str) -> set[str]:
    """Every ``node-settled`` has its completed attempt row and its ``attempt-finished`` before it, and every
    finished attempt row has its ``attempt-finished``; returns the settled node ids."""
    records = _journal(db, run_id)
    rows = _attempts(db, run_id)
    finished = {
        (e.payload["node_id"], e.payload["attempt"]): e.seq for e in records if e.type == "attempt-finished"
    }
    scheduled = {e.payload["node_id"]: e.seq for e in records if e.type == "node-scheduled"}
    settled: set[str] = set()
    for e in records:
        if e.type != "node-settled":
            continue
        node = e.payload["node_id"]
        settled.add(node)
        done = [
            r for r in rows.get(node, []) if r.state == "completed" and r.key == e.payload["dispatch_key"]
        ]
        assert done, f"{node} settled without its completed attempt row"
        assert scheduled[node] < finished[(node, done[-1].attempt)] < e.seq
    for node, rs in rows.items():
        for r in rs:
            if r.state != "started":
                assert (node, r.attempt) in finished, (
                    f"{node} attempt {r.attempt} finished without its record"
                )
    return settled


def _queue_one_group(
    queue: CommitQueue, journal: Journal, n: int, refused: int | None, coordinator_write: Any = None
) -> tuple[dict[Any, Any], list[threading.Thread], Any]:
    """Make ``n`` jobs' settlements commit as ONE group: a first job leads a commit that holds the lead until the
    ``n`` others queued theirs (job ``refused``'s raises a StoreError after its journal record) and the coordinator
    (this thread) pushed ``coordinator_write`` behind them; then the first of them leads the rest together. Returns
    the box the outcomes land in, the job threads, and the pushed batch (None without one)."""
    outcomes: dict[Any, Any] = {}
    release = threading.Event()

    def hold_the_lead(c: Connection) -> str:
        assert release.wait(DEADLINE_S), "the group never formed"
        return "first"

    def job(i: int) -> None:
        def settle(c: Connection) -> int:
            journal.append_in(c, "p", "settled", {"i": i})
            if i == refused:
                raise StoreError("invalid_argument", f"attempt {i} is already failed; begin a new attempt")
            return i

        try:
            outcomes[i] = queue.commit(settle)
        except StoreError as exc:
            outcomes[i] = exc

    first = threading.Thread(target=lambda: outcomes.update(first=queue.commit(hold_the_lead)))
    first.start()
    _until(lambda: queue._leading, "the first job to lead")
    threads = [threading.Thread(target=job, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    _until(lambda: len(queue._queued) == n, "the jobs to queue their settlements")
    written = queue.push([coordinator_write]) if coordinator_write is not None else None
    release.set()
    return outcomes, [first, *threads], written


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"waited too long for {what}"
        time.sleep(0.01)


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "a job never returned from its commit"


def test_a_wide_plan_settles_every_node_with_its_attempt_row_and_records_in_order(tmp_path: Path) -> None:
    with sp.open_runtime(workspace=tmp_path) as rt, ThreadHost(8) as host:
        report = rt.scheduler("r1", concurrency={"steps": 8}, host=host).run(
            _wide(120), lambda ni: {"i": ni.id}
        )
        assert {s.outcome for s in report.settlements} == {"built"}
        assert _assert_settlements_atomic(rt.db, "r1") == {f"n{i}" for i in range(120)}


def test_a_settlement_refused_inside_a_shared_commit_fails_only_its_own_job(tmp_path: Path) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    journal = Journal(db)
    queue = CommitQueue(db)  # made on this thread: this thread is the coordinator
    outcomes, threads, _ = _queue_one_group(queue, journal, 3, refused=1)
    _join(threads)
    assert outcomes["first"] == "first" and outcomes[0] == 0 and outcomes[2] == 2
    assert isinstance(outcomes[1], StoreError) and outcomes[1].code == "invalid_argument"
    assert sorted(e.payload["i"] for e in journal.read("p")) == [0, 2]  # the refused one left nothing


def test_a_commit_asked_after_the_coordinator_stopped_serving_runs_on_the_jobs_own_thread(
    tmp_path: Path,
) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    journal = Journal(db)
    queue = CommitQueue(db)
    queue.close()
    box: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: box.update(r=queue.commit(lambda c: journal.append_in(c, "p", "t", {})))
    )
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive() and box["r"].event.seq == 0


_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import smthrs_plugin as sp
    from smthrs_plugin.scheduler import ThreadHost

    ws, n = Path(sys.argv[1]), int(sys.argv[2])
    plan = sp.plan.compile_plan(
        "gc", "gc", [sp.plan.node(f"n{i}", body=i) for i in range(n)], maximum_plan_nodes=n + 10
    )
    with sp.open_runtime(workspace=ws) as rt:
        # Post-commit: a line here is a settlement reported to the outside world.
        rt.journal.subscribe(
            lambda e: print(e.payload["node_id"], flush=True) if e.type == "node-settled" else None,
            partition="r1",
        )
        with ThreadHost(8) as host:
            rt.scheduler("r1", concurrency={"steps": 8}, host=host).run(plan, lambda ni: {"i": ni.id})
    print("DONE", flush=True)
    """
)


def test_sigkill_with_a_batch_of_settlements_in_flight_loses_no_reported_settlement(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(ws), str(NODES)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    reported: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + DEADLINE_S
        while len(reported) < 100:
            line = proc.stdout.readline()
            assert line and line.strip() != "DONE", (
                f"the child ended before the kill point: {proc.stderr.read()}"
            )
            reported.append(line.strip())
            assert time.monotonic() < deadline
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE_S)
    assert proc.returncode == -signal.SIGKILL
    db = open_database(f"sqlite:///{ws / '.smthrs' / 'state.db'}")
    settled = _assert_settlements_atomic(db, "r1")
    assert set(reported) <= settled  # every settlement reported before the kill is durable
    assert len(settled) < NODES, "the kill came after the run finished: nothing was in flight"


class _SelfCommitting:
    """A dispatcher that ignores ``request.commit`` and settles in a transaction of its own."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def dispatch(self, request: Any, execute: Any) -> Any:
        from smthrs_plugin.cache.model import DispatchResult, Miss

        result = DispatchResult("built", request.key, Miss(), value=execute(request.workspace))
        self.db.write(lambda c: request.on_settled(c, result))
        return result


def test_a_dispatcher_that_settles_outside_the_coordinators_commit_is_refused_not_misordered(
    tmp_path: Path,
) -> None:
    from smthrs_plugin.errors import SchedulerError

    with sp.open_runtime(workspace=tmp_path) as rt, ThreadHost(4) as host:
        rt.dispatcher = _SelfCommitting(rt.db)  # type: ignore[assignment]
        try:
            rt.scheduler("r1", concurrency={"steps": 4}, host=host).run(_wide(4), lambda ni: {"i": ni.id})
        except SchedulerError as exc:
            assert exc.code == "store_failed" and "request.commit" in exc.message
        else:
            raise AssertionError("a settlement committed outside the coordinator's flush was accepted")
        # Nothing settled out of order: no attempt row is completed without its begin (it would not exist).
        assert all(r.state != "completed" for rs in _attempts(rt.db, "r1").values() for r in rs)


def test_a_refused_coordinator_write_fails_its_whole_group_and_reaches_the_coordinator(
    tmp_path: Path,
) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    journal = Journal(db)
    queue = CommitQueue(db)

    def refused(c: Connection) -> None:
        journal.append_in(c, "p", "coordinator", {})
        raise StoreError("invalid_argument", "attempt 7 is already taken")

    box, threads, written = _queue_one_group(queue, journal, 2, refused=None, coordinator_write=refused)
    _join(threads)
    assert all(isinstance(box[i], StoreError) for i in (0, 1))  # every job of the group got its error
    assert [e.payload for e in journal.read("p")] == []  # all or nothing
    try:
        queue.drive(written)
    except StoreError as exc:
        assert exc.code == "invalid_argument"
    else:
        raise AssertionError("the coordinator was not told its writes failed")


def test_nothing_commits_after_the_queue_is_held_and_held_settlements_run_alone_after_close(
    tmp_path: Path,
) -> None:
    db = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    journal = Journal(db)
    queue = CommitQueue(db)
    queue.hold()
    dropped = queue.push([lambda c: journal.append_in(c, "p", "coordinator", {})])
    box: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: box.update(r=queue.commit(lambda c: journal.append_in(c, "p", "t", {})))
    )
    t.start()
    _until(lambda: len(queue._queued) == 1, "the settlement to queue")
    assert journal.read("p") == [] and t.is_alive()  # held: not committed, its job still waits
    queue.close()
    t.join(DEADLINE_S)
    assert not t.is_alive() and [e.type for e in journal.read("p")] == [
        "t"
    ]  # alone; the dropped write never ran
    assert dropped.done


def test_a_pipelined_job_still_running_when_the_pass_parks_settles_its_attempt_afterwards(
    tmp_path: Path,
) -> None:
    """A park (not a scheduler failure) stops admission while a pipelined job runs: the abort commits the buffered
    begins first, so the job's later settlement, committed alone, completes its attempt row."""
    from sched_support import make_env

    from smthrs_plugin.engine.context import RunParked

    env = make_env(tmp_path)
    release = threading.Event()
    nodes = [
        sp.plan.node("slow", body="slow"),
        sp.plan.node("quick", body="quick", priority=1),
        sp.plan.node("gated", body="gated", inputs=[sp.plan.Pending("quick")], approval={"request": "ship"}),
    ]
    plan = sp.plan.compile_plan("gc-park", "gc", nodes)

    def gate(node: Any) -> None:
        release.set()  # the slow job may finish now, racing the abort either way
        raise RunParked("r1", "approval", "ship", token="t")

    def executor(ni: Any) -> Any:
        if ni.id == "slow":
            assert release.wait(DEADLINE_S), "the gate was never asked"
        return {"node": ni.id}

    with ThreadHost(4) as host:
        try:
            env.scheduler("r1", host=host, gate=gate).run(plan, executor)
        except RunParked:
            pass
        else:
            raise AssertionError("the gated node did not park the pass")
    rows = {r["node_id"]: r["state"] for r in env.attempt_rows()}
    assert rows == {"slow": "completed", "quick": "completed"}, rows
    settled = {p["node_id"] for t, p in env.records(types=("attempt-finished",))}
    assert settled == {"slow", "quick"}


def test_a_store_that_fails_under_the_approval_gate_stops_the_pass_and_never_fails_the_node(
    tmp_path: Path,
) -> None:
    """The gate could not read the decision because the store failed (a passing fault): that is nobody's denial,
    so the node is not settled failed; the pass stops with the fault and the same run can be resumed."""
    from sched_support import make_env

    env = make_env(tmp_path)
    plan = sp.plan.compile_plan(
        "gate-fault", "gc", [sp.plan.node("gated", body="gated", approval={"request": "ship"})]
    )

    def gate(node: Any) -> None:
        raise StoreError("disk_full", "the disk holding the database is full; free space and retry")

    with ThreadHost(2) as host:
        try:
            env.scheduler("r1", host=host, gate=gate).run(plan, lambda ni: {"node": ni.id})
        except Exception as exc:  # noqa: BLE001 - the pass must stop with the fault itself
            from smthrs_plugin.errors import passing_fault

            assert passing_fault(exc) is not None, exc
        else:
            raise AssertionError("a passing fault under the gate settled the pass")
    assert not env.records(types=("node-settled",)), "the gated node was settled"


def test_a_typed_failure_with_a_pipelined_begin_still_queued_records_that_attempt_as_interrupted(
    tmp_path: Path,
) -> None:
    """Sealed jobs start before their begins commit. A typed failure (a store fault inside a body) stops the pass
    while those begins are still queued: the interrupt commits them with its marking, so the journal shows each
    body that ran and that it ended interrupted, never a body that ran with no attempt at all."""
    from sched_support import make_env

    env = make_env(tmp_path)
    ran: list[str] = []
    nodes = [sp.plan.node("slow", body="slow", priority=1), sp.plan.node("boom", body="boom")]
    plan = sp.plan.compile_plan("gc-typed", "gc", nodes)

    def executor(ni: Any) -> Any:
        ran.append(ni.id)
        if ni.id == "boom":
            raise StoreError("disk_full", "the disk holding the database is full; free space and retry")
        assert ni.cancel.wait(DEADLINE_S), "the typed failure never cancelled the pass"
        return {"node": ni.id}

    with ThreadHost(4) as host:
        try:
            env.scheduler("r1", host=host).run(plan, executor)
        except Exception as exc:  # noqa: BLE001 - the pass must stop with the fault itself
            assert "disk" in str(exc), exc
        else:
            raise AssertionError("a store fault in a body settled the pass")
    assert sorted(ran) == ["boom", "slow"]
    rows = {r["node_id"]: r["state"] for r in env.attempt_rows()}
    assert rows == {"slow": "failed", "boom": "failed"}, rows
    finished = sorted((p["node_id"], p["outcome"]) for t, p in env.records(types=("attempt-finished",)))
    assert finished == [("boom", "failed"), ("slow", "failed")]
    assert not env.records(types=("node-settled",))


def test_a_job_that_is_not_pipelined_starts_only_after_its_begin_committed_even_beside_pipelined_ones(
    tmp_path: Path,
) -> None:
    """A batch holds a sealed node (pipelined: it starts at once) and an irreversible one (its recovery reads its
    begun attempt, so that begin must be durable before its body runs). The sealed job holds back its own commit
    until the irreversible body has looked: the irreversible attempt is already committed, seen from another
    connection."""
    from sched_support import make_env

    env = make_env(tmp_path)
    looked = threading.Event()
    seen: dict[str, Any] = {}
    nodes = [
        sp.plan.node("free", body="free", priority=1),
        sp.plan.node("deploy", body="deploy", tier="irreversible"),
    ]
    plan = sp.plan.compile_plan("gc-mixed", "gc", nodes)

    def executor(ni: Any) -> Any:
        if ni.id == "free":
            assert looked.wait(DEADLINE_S), "the irreversible body never ran"
        else:
            other = open_database(env.db.url)
            try:
                seen["deploy"] = [
                    r[0]
                    for r in other.read(
                        lambda c: c.execute(
                            sa.select(attempts.c.state).where(attempts.c.node_id == "deploy")
                        ).all()
                    )
                ]
            finally:
                other.close()
                looked.set()
        return {"node": ni.id}

    with ThreadHost(4) as host:
        report = env.scheduler("r1", host=host).run(plan, executor)
    assert {s.node: s.outcome for s in report.settlements} == {"free": "built", "deploy": "built"}
    assert seen["deploy"] == ["started"]


class _HoldFirstSettlement:
    """A pass-through dispatcher whose first settlement waits inside its group's transaction until ``hold`` bodies
    ran, and which records how many settlements each committed transaction held."""

    def __init__(self, db: Database, hold: int) -> None:
        self.db, self.hold = db, hold
        self.cv = threading.Condition()
        self.bodies = 0
        self.running = 0
        self.most_running = 0
        self.groups: list[int] = []  # settlements each committed transaction held
        self._pending = 0
        self._first = True

    def _committed(self) -> None:
        self.groups.append(self._pending)
        self._pending = 0

    def body(self) -> None:
        with self.cv:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        with self.cv:
            self.running -= 1
            self.bodies += 1
            self.cv.notify_all()

    def dispatch(self, request: Any, execute: Any) -> Any:
        from smthrs_plugin.cache.model import DispatchResult, Miss

        result = DispatchResult("built", request.key, Miss(), value=execute(request.workspace))
        with self.cv:
            first, self._first = self._first, False

        def tx(conn: Connection) -> Any:
            if first:
                with self.cv:
                    assert self.cv.wait_for(lambda: self.bodies >= self.hold, DEADLINE_S), "bodies held back"
            if not self._pending:  # the first settlement of this transaction (they run one after another)
                self.db.on_commit(self._committed)
            self._pending += 1
            return request.on_settled(conn, result)

        request.commit(tx)
        return result


def _run_held(tmp_path: Path, *, nodes: int, hold: int, steps: int, workers: int) -> _HoldFirstSettlement:
    """Run a wide plan of no-op nodes through :class:`_HoldFirstSettlement`; every node builds and settles atomically."""
    with sp.open_runtime(workspace=tmp_path) as rt, ThreadHost(workers) as host:
        dispatcher = _HoldFirstSettlement(rt.db, hold=hold)
        rt.dispatcher = dispatcher  # type: ignore[assignment]

        def executor(ni: Any) -> Any:
            dispatcher.body()
            return {"i": ni.id}

        report = rt.scheduler("r1", concurrency={"steps": steps}, host=host).run(_wide(nodes), executor)
        assert {s.outcome for s in report.settlements} == {"built"}
        assert _assert_settlements_atomic(rt.db, "r1") == {f"n{i}" for i in range(nodes)}
    return dispatcher


def test_a_node_frees_its_step_permit_when_its_body_returns_not_when_its_settlement_commits(
    tmp_path: Path,
) -> None:
    """While the first settlement's commit is held, bodies beyond ``steps`` run (never more than ``steps`` at once)
    and their settlements wait for the next commit together: a group commit holds every ready settlement, not
    only one per permit. Were permits held until the commit, only ``steps`` bodies could run and the held commit
    would wait until its deadline. (Four: the thread host's spare threads for jobs waiting on a commit.)"""
    dispatcher = _run_held(tmp_path, nodes=9, hold=4, steps=2, workers=2)
    assert dispatcher.most_running <= 2
    assert sum(dispatcher.groups) == 9


def test_with_one_step_permit_a_node_keeps_it_until_its_settlement_commits(tmp_path: Path) -> None:
    """``steps: 1`` stays one node at a time, settlement included: the admission order is then the same on every
    host (a dependent made ready by a settlement competes before the next node is admitted)."""
    dispatcher = _run_held(tmp_path, nodes=5, hold=1, steps=1, workers=4)  # the first commit waits for itself
    assert set(dispatcher.groups) == {1}, dispatcher.groups


def test_a_jobs_wake_up_signal_acts_as_an_event_for_its_one_waiting_thread() -> None:
    """The queue's per-settlement signal: set twice is set once (a promoted leader's own signal is set again when
    its group is released), a set signal stays set for every wait, a cleared one (a leader sent back to wait by a
    hold) blocks its waiter until the next set."""
    s = _Signal()
    s.set()
    s.set()
    s.wait()
    s.wait()
    s.clear()
    s.clear()
    assert s._lock.locked()  # a wait now blocks
    woke = threading.Event()
    t = threading.Thread(target=lambda: (s.wait(), woke.set()))
    t.start()
    s.set()
    t.join(DEADLINE_S)
    assert not t.is_alive() and woke.is_set()
    s.wait()  # still set after its waiter woke
