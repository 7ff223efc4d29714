"""Process bodies for the observation tests, run as ``python _observe_proc.py COMMAND ...``.

Every command prints JSON lines on stdout (flushed), so the parent test can follow it step by step.
"""

from __future__ import annotations

import json
import sys
import time


def say(**fields: object) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


def cmd_append(url: str, partition: str, n: str, pause_ms: str) -> None:
    """Append ``n`` entries ``{"i": i}`` to ``partition``, pausing between them (another process's commits)."""
    from smthrs_plugin.records.journal import Journal
    from smthrs_plugin.stores.database import open_database

    journal = Journal(open_database(url))
    for i in range(int(n)):
        journal.append(partition, "tick", {"i": i})
        say(event="appended", i=i)
        time.sleep(int(pause_ms) / 1000)
    say(event="done")


def cmd_create_runs(url: str, prefix: str, n: str, start_ms: str, step_ms: str) -> None:
    """Create ``n`` runs named ``<prefix><i>`` (another process inserting while the parent pages), created at
    ``start_ms`` + i * ``step_ms`` (a manual clock: the parent chooses where in its key range they land)."""
    from smthrs_plugin._clock import ManualClock
    from smthrs_plugin.records.runs import RunStore
    from smthrs_plugin.stores.database import open_database

    clock = ManualClock(int(start_ms))
    store = RunStore(open_database(url), clock=clock)
    for i in range(int(n)):
        store.create(f"{prefix}{i:04d}", "flow/late")
        clock.advance(int(step_ms) / 1000)
        if i % 10 == 0:
            say(event="created", i=i)
    say(event="done")


if __name__ == "__main__":
    globals()["cmd_" + sys.argv[1].replace("-", "_")](*sys.argv[2:])
