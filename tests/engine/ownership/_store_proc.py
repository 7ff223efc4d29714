"""Process bodies for the store's real-process tests, run as ``python _store_proc.py COMMAND ...``.

Every command prints JSON lines on stdout (flushed), so the parent test can follow it step by step. Timings
(stale window, heartbeat interval) come from SMTHRS_* environment variables set by the parent.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def say(**fields: object) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


def wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.002)


def cmd_migrate(url: str, go: str) -> None:
    from smthrs_plugin.stores.database import open_database

    say(event="ready")  # imported and at the start line: the parent starts the race once both say so
    wait_for(go)
    db = open_database(url)
    say(event="opened", source_id=db.source_id)


def cmd_claim(url: str, go: str, n: str) -> None:
    from smthrs_plugin.engine.ownership.arbiter import Ownership
    from smthrs_plugin.stores.database import open_database

    own = Ownership(open_database(url))
    say(event="ready")
    wait_for(go)
    for i in range(int(n)):
        decision = own.claim(f"race-{i}")
        say(event="decision", run_id=f"race-{i}", kind=decision.kind, nonce=own.owner.nonce)


def cmd_own(url: str, run_id: str, mode: str) -> None:
    """Claim ``run_id``, heartbeat it, and (mode=write) keep writing fenced attempts until refused 3 times."""
    from smthrs_plugin.canonical import key
    from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
    from smthrs_plugin.engine.ownership.heartbeat import Heartbeater
    from smthrs_plugin.errors import FenceLost
    from smthrs_plugin.records.attempts import AttemptStore
    from smthrs_plugin.stores.database import open_database

    db = open_database(url)
    own = Ownership(db)
    decision = own.claim(run_id)
    if not isinstance(decision, Activated):
        say(event="not-activated", kind=decision.kind)
        raise SystemExit(3)
    hb = Heartbeater(own, run_id).start()
    say(event="activated", nonce=own.owner.nonce, pid=os.getpid())
    if mode == "idle":
        while True:
            time.sleep(1)
    store = AttemptStore(db)
    refusals = 0
    i = 0
    while refusals < 3:
        k = key({"step": i})
        try:
            started = store.begin(run_id, own.owner, k, node_id=f"n{i}")
            store.complete(run_id, own.owner, k, started.attempt, result={"i": i})
            say(event="wrote", i=i)
        except FenceLost as exc:
            refusals += 1
            say(event="refused", i=i, code=exc.code)
        i += 1
        time.sleep(0.02)
    hb.interrupted.wait(120)  # returns at the interrupt; the bound only guards against a hang
    say(event="done", interrupt=None if hb.interrupt is None else hb.interrupt.reason)
    hb.stop()


def cmd_crash_in_tx(url: str, run_id: str, event_file: str) -> None:
    """Write run state inside a transaction, signal, and block before the journal record (the parent kills us)."""
    from smthrs_plugin.records.journal import Journal
    from smthrs_plugin.records.runs import RunStore
    from smthrs_plugin.stores.database import open_database

    db = open_database(url)
    journal = Journal(db)
    runs = RunStore(db, journal=journal)

    def body(conn: object) -> None:
        runs.request_cancel(run_id)  # the state write (it journals its own record too)
        Path(event_file).write_text("inside", encoding="utf-8")
        while True:  # blocked inside the open transaction until SIGKILL
            time.sleep(0.05)
        journal.append(run_id, "cancel-noted", {})  # never reached

    say(event="starting")
    db.write(body)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"migrate": cmd_migrate, "claim": cmd_claim, "own": cmd_own, "crash-in-tx": cmd_crash_in_tx}[command](
        *args
    )
