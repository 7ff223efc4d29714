"""What isolating a building body costs, measured side by side in one run (one process, Prefect and pandas loaded).

Run: ``python benchmarks/isolation.py [--calls 60] [--rounds 5] [--body-ms 20]``.

- **I1 — the isolation itself.** ``IsolatedCall.run`` of a no-op body as ``namespace`` (a forked child in a
  private mount namespace where the workspace path shows the sandbox) and ``process`` (a forked child, the
  sandbox as working directory), against calling the body in this thread. Prints ms added per call.
  Goal ≤ 3 ms added.
- **I2 — a 20 ms body.** The same with a body that computes for ``--body-ms`` ms (CPU, not a sleep). Goal ≤ 1.3×.
- **I3 — @sp.step builds.** Distinct arguments in one flow run (every call builds: key, sandbox, copy-back,
  journal) under ``isolation="namespace"`` vs ``"thread"``; ms per call and the ratio.
- **P1 — hits are unchanged.** The same step, same input, after one build, in a namespace-isolated and an
  in-thread step: a hit never starts a child, so the ratio should be ~1.0×.

``--rounds`` alternate the sides (medians printed) so a load spike lands on both. The machine's own anchors are
printed first: ``fork()`` of this process and a raw 1 MiB memcpy. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_HOME = tempfile.mkdtemp(prefix="smthrs-bench-isolation-")
for _k, _v in {
    "PREFECT_HOME": _HOME,
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "ERROR",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_ROOT_LEVEL": "CRITICAL",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}.items():
    os.environ.setdefault(_k, _v)

import pandas  # noqa: E402,F401 - a realistic flow process has it loaded (fork cost grows with the heap)
from _goals import goal_line  # noqa: E402
from prefect import flow  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.boundary import Declaration, IsolatedCall, namespace_available  # noqa: E402
from smthrs_plugin.prefect.host import quiet_flow_settings  # noqa: E402


def _spin(ms: float) -> int:
    end = time.perf_counter() + ms / 1000.0
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


#: One line per goal, printed last (the GOAL lines of `make bench`).
GOALS: list[str] = []


def _ms(fn: Any, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1000.0 / n


def _alternate(sides: dict[str, Any], n: int, rounds: int) -> dict[str, float]:
    got: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            got[name].append(_ms(fn, n))
    return {k: statistics.median(v) for k, v in got.items()}


def anchors() -> float:
    """Print the machine's anchors; return ``fork()``+exit+wait of this process, ms."""

    def fork_exit() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    buf = bytearray(1 << 20)
    copy = _ms(lambda: bytes(buf), 200)
    fork_ms = _ms(fork_exit, 30)
    print(
        f"anchors: fork()+exit+wait {fork_ms:.2f} ms; 1 MiB copy {copy * 1000:.0f} us; cores {os.cpu_count()}"
    )
    return fork_ms


def bench_raw(calls: int, rounds: int, body_ms: float, fork_ms: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="smthrs-bench-iso-"))
    ws, sandbox = root / "ws", root / "sb" / "root"
    ws.mkdir()
    sandbox.mkdir(parents=True)
    decl = Declaration.of()
    kinds = ["process"] + (["namespace"] if namespace_available() else [])
    for label, body in (("no-op body", lambda: None), (f"{body_ms:g} ms body", lambda: _spin(body_ms))):
        sides: dict[str, Any] = {"thread": body}
        for kind in kinds:
            sides[kind] = lambda kind=kind, body=body: IsolatedCall(ws, sandbox, decl, kind).run(body)
        got = _alternate(sides, calls, rounds)
        base = got["thread"]
        cells = "   ".join(
            f"{k} {v:6.2f} ms (+{v - base:5.2f} ms, {v / base if base > 0.05 else float('nan'):5.2f}x)"
            for k, v in got.items()
            if k != "thread"
        )
        print(f"  I{'1' if label == 'no-op body' else '2'} {label:<14} in-thread {base:6.2f} ms   {cells}")
        for k, v in got.items():
            if k == "thread":
                continue
            anchors = f"{v:.2f} vs {base:.2f} ms in-thread; fork()+exit+wait {fork_ms:.2f} ms"
            if label == "no-op body":
                GOALS.append(
                    goal_line(
                        f"I1 isolation ({k}) added per call",
                        f"+{v - base:.2f} ms",
                        "<= 3 ms",
                        v - base <= 3.0,
                        anchors,
                    )
                )
            else:
                GOALS.append(
                    goal_line(
                        f"I2 isolation ({k}) of a {body_ms:g} ms body",
                        f"{v / base:.2f}x",
                        "<= 1.3x",
                        v / base <= 1.3,
                        anchors,
                    )
                )


def bench_steps(calls: int, rounds: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="smthrs-bench-iso-steps-"))
    kinds = ["thread"] + (["namespace"] if namespace_available() else ["process"])
    steps = {k: sp.step(name=f"work_{k}", writes=["out.txt"], isolation=k)(_write_body) for k in kinds}
    counter = iter(range(10**9))

    def per_call(fn: Any, n: int) -> float:
        @flow(persist_result=False)
        def timed() -> float:
            t = time.perf_counter()
            for _ in range(n):
                fn()
            return time.perf_counter() - t

        return float(timed()) * 1000.0 / n

    with sp.step_settings(workspace=root):
        built = {k: [] for k in kinds}
        hits = {k: [] for k in kinds}
        for k in kinds:
            steps[k](-1)  # warm: runtime open, first build
        for _ in range(rounds):
            for k in kinds:
                built[k].append(per_call(lambda k=k: steps[k](next(counter)), calls))
                hits[k].append(per_call(lambda k=k: steps[k](-1), calls))
    b = {k: statistics.median(v) for k, v in built.items()}
    h = {k: statistics.median(v) for k, v in hits.items()}
    iso = kinds[1]
    print(
        f"  I3 @sp.step build   thread {b['thread']:6.2f} ms   {iso} {b[iso]:6.2f} ms   ratio {b[iso] / b['thread']:5.2f}x"
    )
    print(
        f"  P1 @sp.step hit     thread {h['thread']:6.2f} ms   {iso} {h[iso]:6.2f} ms   ratio {h[iso] / h['thread']:5.2f}x  (goal ~1.0x: a hit starts no child)"
    )


def _write_body(ws: sp.Workspace, x: int) -> int:
    (ws / "out.txt").write_text(str(x))  # through ws: the one spelling every isolation kind accepts
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--body-ms", type=float, default=20.0)
    args = ap.parse_args()
    fork_ms = anchors()
    print(f"namespaces available: {namespace_available()}; uid {os.getuid()}")
    bench_raw(args.calls, args.rounds, args.body_ms, fork_ms)
    with quiet_flow_settings():
        bench_steps(max(5, args.calls // 4), args.rounds)
    print()
    print("\n".join(GOALS))


if __name__ == "__main__":
    main()
