"""Durable waits, side by side in one run (SQLite): what the wake bus buys, and what a durable timer cycle costs.

Run: ``python benchmarks/waits.py [--rounds 20] [--runs 40] [--poll 0.1]``.

- **wake latency**: a run waits in-process on ``sp.wait_for``; another thread completes the deferred. With the wake
  bus the waiter resumes on the completion's commit; with the no-op bus it resumes at its next poll (``--poll``
  seconds). Figures: milliseconds from ``sp.complete`` returning to the flow returning (median), and the ratio.
- **timer cycle**: a flow that ``sp.sleep(0)``\\s beyond a zero in-process budget parks ``timer``; the driver fires
  the clock, wakes the run and re-drives it to completion (park → fire → wake → claim → re-execute → settle),
  against the same flow without the sleep (claim → execute → settle). Figures: milliseconds per run, and the ratio.

Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.engine.drive.driver import RunDriver  # noqa: E402
from smthrs_plugin.engine.wakebus import NoopWakeBus, WakeBus  # noqa: E402
from smthrs_plugin.settings import load_settings  # noqa: E402
from smthrs_plugin.stores.database import open_database  # noqa: E402


def _settings(poll: float) -> Any:
    return load_settings(heartbeat_interval_s=1.0, wait_budget_s=3600, wait_poll_s=poll, host_id="bench")


def wake_latency(root: Path, bus: WakeBus, rounds: int, poll: float) -> list[float]:
    db = open_database(f"sqlite:///{root / type(bus).__name__}.db")
    driver = RunDriver(db, settings=_settings(poll), bus=bus)
    done: dict[str, float] = {}

    def waiter(ctx: Any) -> None:
        sp.wait_for("go")
        done[ctx.run_id] = time.perf_counter()

    driver.register("w", waiter)
    out: list[float] = []
    for i in range(rounds):
        rid = f"r{i}"
        driver.submit(rid, "w")
        t = threading.Thread(target=driver.drive, args=(rid,))
        t.start()
        while bus.waiters(rid) == 0:
            time.sleep(0.001)
        time.sleep(poll / 3)  # land somewhere inside a poll interval, not right at its start
        sp.complete(rid, "go", i, db=db, bus=bus)
        sent = time.perf_counter()
        t.join()
        out.append((done[rid] - sent) * 1000)
    return out


def timer_cycle(root: Path, runs: int, *, sleep: bool) -> float:
    db = open_database(f"sqlite:///{root / ('timer' if sleep else 'plain')}.db")
    driver = RunDriver(db, settings=_settings(1.0), wait_budget_s=0)

    def flow(ctx: Any) -> int:
        if sleep:
            sp.sleep(0)
        return 1

    driver.register("f", flow)
    started = time.perf_counter()
    for i in range(runs):
        driver.submit(f"r{i}", "f")
        driver.drive(f"r{i}")
    if sleep:
        while driver.tick().fired:  # fire every due clock; the woken runs are re-driven in the background
            driver.drain()
        driver.drain()
    elapsed = time.perf_counter() - started
    assert all(driver.runs.get(f"r{i}").status == "completed" for i in range(runs))  # type: ignore[union-attr]
    return elapsed * 1000 / runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--poll", type=float, default=0.1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="smthrs-bench-waits-") as tmp:
        root = Path(tmp)
        bus = statistics.median(wake_latency(root, WakeBus(), args.rounds, args.poll))
        noop = statistics.median(wake_latency(root, NoopWakeBus(), args.rounds, args.poll))
        print(f"wake latency (median of {args.rounds}, poll {args.poll * 1000:.0f} ms)")
        print(f"  wake bus      {bus:8.2f} ms")
        print(f"  polling only  {noop:8.2f} ms   ({noop / bus:.1f}x the bus)")
        plain = timer_cycle(root, args.runs, sleep=False)
        timer = timer_cycle(root, args.runs, sleep=True)
        print(f"timer cycle per run ({args.runs} runs, SQLite)")
        print(f"  no wait                             {plain:8.2f} ms")
        print(f"  park -> fire -> wake -> re-drive    {timer:8.2f} ms   ({timer / plain:.1f}x)")


if __name__ == "__main__":
    main()
