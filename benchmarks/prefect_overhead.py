"""What smthrs costs on top of Prefect, measured side by side in one run (one Prefect server, one process).

Run: ``python benchmarks/prefect_overhead.py [--hits 200] [--s3-hits 60] [--nodes 1000] [--rounds 5]
[--p4-rounds 3]`` (``0`` skips a section). Starts Prefect's ephemeral server (in-memory SQLite; or uses
``PREFECT_API_URL``) and moto's S3 server on 127.0.0.1 itself. Ends with one ``GOAL`` line per goal (met / NOT
met, with the bare-Prefect anchor in ms).

- **P1 — a cache hit, local.** The same function, same inputs, called directly after one warm-up build, in
  ``--rounds`` alternating flow runs of each side (medians printed): ``@sp.step`` (key = function source +
  canonical arguments + environment; SQLite local tier; every hit verified and journaled as a fenced
  ``step-settled`` record) vs Prefect's own ``cache_policy=INPUTS + TASK_SOURCE`` with
  ``result_storage=Path(...)``. Goal ≤ 1.0×.
- **P2 — the same on S3 (moto).** ``@sp.step`` with ``SMTHRS_ARTIFACTS_URL=s3://...`` vs Prefect with
  ``result_storage=prefect_aws.S3Bucket`` (a saved block on the same moto bucket). Two smthrs figures: the
  steady state (the entry is indexed locally after the first hit: no S3 round trip) and cold shared hits (a
  fresh machine: every hit reads the entry from S3, then records it locally). Goal ≤ 0.5×.
- **P4 — a 1,000-node no-op plan.** The same DAG (node i waits for node (i-1)//2: a binary tree, depth 10) as
  ``rt.scheduler(...).run(plan)`` on the Prefect host (one task run per node, built; then again, all clean) vs
  bare ``task.submit(wait_for=...)`` with ``NO_CACHE``, both untagged (the Prefect host tags nothing by default:
  any tag costs Prefect a concurrency-slot acquire/release per task run). Also the same plan on the local
  thread-pool host: the scheduler's and the cache's own share (durable attempt rows and journal records, the
  local cache row). A built node's shared-tier entry (an fsynced file and a signature) is published in the
  background, after its local commit: the time the runtime's close then spends draining what is still queued is
  printed beside the figure, and so is the same run with every entry published inline (before each node returns,
  the seam's default). ``--p4-rounds`` alternating rounds of each side; medians printed. Goal ≤ 1.3× built and
  clean. Beside them, the CPU per node of each timed run: this process (every thread) and Prefect's server
  process (when this process started it): on 2 cores their sum bounds the wall time.

Per-task milliseconds are wall time divided by the number of tasks. Figures vary with load (2 shared cores);
the ratio is what to read. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_HOME = tempfile.mkdtemp(prefix="smthrs-bench-prefect-")
for _k, _v in {
    "PREFECT_HOME": _HOME,
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "ERROR",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_ROOT_LEVEL": "CRITICAL",
    # Prefect waits only 20 s for its ephemeral server; a first start on a busy machine needs longer.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ.setdefault(_k, _v)

import prefect  # noqa: E402
from _cpu import cpu_by_process  # noqa: E402
from prefect import flow  # noqa: E402
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.prefect.host import quiet_flow_settings  # noqa: E402


def double(x: int) -> dict:
    return {"y": 2 * x}


smthrs_double = sp.step(double, name="double")


def _per_task(fn: Any, n: int) -> float:
    @flow(persist_result=False)
    def timed() -> float:
        # Both sides start with empty young generations: a full collection (≈200 ms over Prefect's heap on a
        # 2-core VM, ≈0.2 ms a hit over 1,000 hits) is paid by the side whose own garbage triggers it, not by
        # whichever side happened to run when the other's garbage crossed the threshold.
        gc.collect()
        t = time.perf_counter()
        fn(n)
        return time.perf_counter() - t

    return float(timed()) * 1000.0 / n


def _row(label: str, ours: float, theirs: float, goal: str) -> None:
    print(
        f"  {label:<44} smthrs {ours:7.2f} ms/task   prefect {theirs:7.2f} ms/task   ratio {ours / theirs:5.2f}x  (goal {goal})"
    )


# ------------------------------------------------------------------------------------------------------ P1/P2


def bench_hits(
    n: int, workspace: Path, artifacts: str | None, options: dict, prefect_task: Any, rounds: int = 1
) -> tuple[float, float]:
    """(smthrs ms per hit, prefect ms per hit) for ``n`` direct calls with the same input after a warm-up, in
    ``rounds`` alternating flow runs of each (n / rounds calls per flow run): the medians, so a load spike from
    the other tenants of a shared machine lands on both sides instead of skewing one."""
    with sp.step_settings(workspace=workspace, artifacts=artifacts, artifacts_options=options):
        _per_task(lambda k: smthrs_double(21), 1)  # build once
    _per_task(lambda k: prefect_task(21), 1)  # persist once
    per_round = max(1, n // max(1, rounds))
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(max(1, rounds)):
        with sp.step_settings(workspace=workspace, artifacts=artifacts, artifacts_options=options):
            ours.append(_per_task(lambda k: [smthrs_double(21) for _ in range(k)], per_round))
        theirs.append(_per_task(lambda k: [prefect_task(21) for _ in range(k)], per_round))
    return statistics.median(ours), statistics.median(theirs)


def bench_cold_shared(n: int, root: Path, artifacts: str, options: dict) -> float:
    """Machine A builds ``n`` distinct keys; machine B (fresh workspace and database) hits each once."""
    a, b = root / "cold-a", root / "cold-b"
    with sp.step_settings(workspace=a, artifacts=artifacts, artifacts_options=options):
        _per_task(lambda k: [smthrs_double(1000 + i) for i in range(k)], n)
    with sp.step_settings(workspace=b, artifacts=artifacts, artifacts_options=options):
        return _per_task(lambda k: [smthrs_double(1000 + i) for i in range(k)], n)


# ---------------------------------------------------------------------------------------------------------- P4


def noop(ni: sp.NodeInput) -> int:
    return 0


def bare_noop(i: int) -> int:
    return 0


class _CpuSplit:
    """CPU per node of one timed run: this (client) process as a whole — every thread, ended ones included — and
    Prefect's server process, when this process started it (no ``PREFECT_API_URL``). On 2 cores the two together
    bound the wall time."""

    def __enter__(self) -> _CpuSplit:
        self._before = cpu_by_process()
        return self

    def __exit__(self, *exc: object) -> None:
        after = cpu_by_process()
        self.client_s = after["coordinator"] - self._before["coordinator"]
        self.server_s = (
            None
            if os.environ.get("PREFECT_API_URL")
            else after["prefect server"] - self._before["prefect server"]
        )


def bench_plan(n: int, workspace: Path, rounds: int = 1) -> dict[str, float]:
    """ms per node for an ``n``-node binary-tree DAG, medians of ``rounds`` alternating rounds: smthrs on the
    Prefect host (built, then clean; ``drain-built``: the close's wait for queued publications afterwards;
    ``prefect-built-inline``: built with every publication inline), smthrs on the local thread-pool host (the
    scheduler + cache share, without Prefect; first round only), and bare Prefect."""
    def tree(size: int, name: str) -> Any:
        nodes = [
            sp.plan.node(f"n{i}", body={"i": i, "plan": name}, inputs=[sp.plan.Pending(f"n{(i - 1) // 2}")] if i else [])
            for i in range(size)
        ]
        return sp.plan.compile_plan(name, f"bench/{name}", nodes)

    plans = {"timed": tree(n, "bench-p4"), "warm-up": tree(min(n, 64), "bench-p4-warm-up")}
    samples: dict[str, list[float]] = {}

    def run_on(rt: Any, run_id: str, expect: str, which: str = "timed", cpu: str | None = None) -> float:
        plan = plans[which]
        with _CpuSplit() as split:
            t = time.perf_counter()
            report = rt.scheduler(run_id).run(plan, noop)
            elapsed = time.perf_counter() - t
        assert set(report.outcomes.values()) == {expect}, report.outcomes
        if cpu is not None:
            add_cpu(cpu, split, len(plan.nodes))
        return elapsed * 1000.0 / len(plan.nodes)

    @flow(persist_result=False)
    def smthrs_plan(ws: str, run_id: str, expect: str, inline: bool, which: str = "timed") -> tuple[float, float]:
        with sp.open_runtime(ws) as rt:
            if inline:
                # A closed dispatcher's publisher takes nothing more: every entry is published before its node
                # returns, as before publications moved to the background (the A/B of this one change).
                rt.dispatcher.close()
            # Inside a flow run: the Prefect host, one task run per node.
            ms = run_on(rt, run_id, expect, which, None if inline or which != "timed" else f"prefect-{expect}")
            t = time.perf_counter()
            rt.drain_publications()  # what close() would wait for
            return ms, (time.perf_counter() - t) * 1000.0 / n

    task = prefect.Task(bare_noop, name="bare", cache_policy=NO_CACHE, persist_result=False)

    @flow(persist_result=False)
    def bare_plan(count: int, timed: bool = True) -> float:
        with _CpuSplit() as split:
            t = time.perf_counter()
            futs: list[Any] = []
            for i in range(count):
                futs.append(task.submit(i, wait_for=[futs[(i - 1) // 2]] if i else None))
            for f in futs:
                f.wait()
            elapsed = time.perf_counter() - t
        if timed:
            add_cpu("bare", split, count)
        return elapsed

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    def add_cpu(name: str, split: _CpuSplit, nodes: int) -> None:
        add(f"cpu-client-{name}", split.client_s * 1000.0 / nodes)
        if split.server_s is not None:
            add(f"cpu-server-{name}", split.server_s * 1000.0 / nodes)

    # Warm-up (not timed): the first plan run of a process pays its one-time costs (lazy imports, compiled
    # statements, Prefect's task objects), which would land on whichever side runs first.
    for inline in (False, True):
        smthrs_plan(str(workspace / f"warm-up-{inline}"), f"p4-{uuid.uuid4().hex[:6]}", "built", inline, "warm-up")
    bare_plan(len(plans["warm-up"].nodes), timed=False)
    for r in range(max(1, rounds)):
        for inline in (False, True) if r % 2 == 0 else (True, False):  # each side first in turn
            ws = workspace / f"prefect-{r}-{'inline' if inline else 'background'}"
            for expect in ("built",) if inline else ("built", "clean"):
                ms, drain = smthrs_plan(str(ws), f"p4-{uuid.uuid4().hex[:6]}", expect, inline)
                add(f"prefect-{expect}" + ("-inline" if inline else ""), float(ms))
                if expect == "built" and not inline:
                    add("drain-built", float(drain))
        add("bare", float(bare_plan(n)) * 1000.0 / n)
        if r == 0:
            for expect in ("built", "clean"):
                with sp.open_runtime(workspace / "local") as rt:
                    add(f"local-{expect}", run_on(rt, f"p4-{uuid.uuid4().hex[:6]}", expect))
    return {k: statistics.median(v) for k, v in samples.items()}


def _goal(name: str, ours: float, anchor: float, limit: float) -> str:
    ratio = ours / anchor
    verdict = "met" if ratio <= limit else "NOT met"
    return f"GOAL {name}: {ratio:.2f} (goal <= {limit:.2f}) {verdict}  [smthrs {ours:.2f} ms, bare Prefect {anchor:.2f} ms]"


# ---------------------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hits", type=int, default=200)
    ap.add_argument("--s3-hits", type=int, default=60)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument(
        "--rounds", type=int, default=5, help="P1: alternating flow runs of each side (medians are printed)"
    )
    ap.add_argument(
        "--p4-rounds", type=int, default=3, help="P4: alternating rounds of each side (medians are printed)"
    )
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="smthrs-bench-"))
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        import s3fs

        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
        goals: list[str] = []
        with quiet_flow_settings():
            _per_task(lambda k: None, 1)  # start Prefect's server before anything is timed
            print(
                f"prefect {prefect.__version__}; per-task = wall time / tasks, one flow run per measurement"
            )

            native = prefect.Task(
                double,
                name="native-double",
                cache_policy=INPUTS + TASK_SOURCE,
                result_storage=root / "prefect-results",
                persist_result=True,
            )
            if args.hits > 0:
                print("P1  cache hit, local (same function, same input, direct calls)")
                ours, theirs = bench_hits(args.hits, root / "p1", None, {}, native, args.rounds)
                _row("@sp.step hit vs INPUTS+TASK_SOURCE (Path)", ours, theirs, "<= 1.0x")
                goals.append(_goal("P1 cache hit", ours, theirs, 1.0))

            if args.s3_hits > 0:
                print("P2  cache hit on S3 (moto)")
                from prefect_aws import AwsCredentials, S3Bucket

                block = S3Bucket(
                    bucket_name=bucket,
                    bucket_folder="prefect-results",
                    credentials=AwsCredentials(
                        aws_access_key_id="testing",
                        aws_secret_access_key="testing",
                        region_name="us-east-1",
                        aws_client_parameters={"endpoint_url": endpoint},
                    ),
                )
                block.save("smthrs-bench-s3", overwrite=True)
                native_s3 = native.with_options(
                    name="native-double-s3", result_storage=S3Bucket.load("smthrs-bench-s3")
                )
                artifacts = f"s3://{bucket}/smthrs"
                ours_s3, theirs_s3 = bench_hits(args.s3_hits, root / "p2", artifacts, options, native_s3)
                _row("@sp.step hit (steady) vs S3Bucket", ours_s3, theirs_s3, "<= 0.5x")
                cold = bench_cold_shared(args.s3_hits, root, artifacts, options)
                _row("@sp.step cold shared-tier hit vs S3Bucket", cold, theirs_s3, "<= 0.5x")

            if args.nodes > 0:
                print(
                    f"P4  {args.nodes}-node no-op plan (binary tree) on the Prefect host vs bare task.submit(wait_for)"
                )
                p4 = bench_plan(args.nodes, root / "p4", args.p4_rounds)
                _row("plan run, every node built", p4["prefect-built"], p4["bare"], "<= 1.3x")
                _row("plan run, every node clean", p4["prefect-clean"], p4["bare"], "<= 1.3x")
                _row("plan run, built, publishing inline", p4["prefect-built-inline"], p4["bare"], "(A/B)")
                print(
                    f"  (after the built run, close waited {p4['drain-built']:.2f} ms/node for publications still"
                    " queued)"
                )
                print(
                    f"  (the same plan on the local thread-pool host, no Prefect: built {p4['local-built']:.2f} ms/node, "
                    f"clean {p4['local-clean']:.2f} ms/node — the scheduler's and the cache's own share)"
                )
                for side, label in (("prefect-built", "built"), ("prefect-clean", "clean"), ("bare", "bare Prefect")):
                    server = p4.get(f"cpu-server-{side}")
                    print(
                        f"  (CPU per node, {label}: this process {p4[f'cpu-client-{side}']:.2f} ms, Prefect's server "
                        + ("not measured: not started by this process" if server is None else f"{server:.2f} ms")
                        + ")"
                    )
                goals.append(_goal("P4 built", p4["prefect-built"], p4["bare"], 1.3))
                goals.append(_goal("P4 clean", p4["prefect-clean"], p4["bare"], 1.3))
            for line in goals:
                print(line)
    finally:
        moto.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
