"""CLI startup: the wall time of ``smthrs`` commands in fresh processes, next to a bare ``python -c pass``.

Run: ``python benchmarks/cli_startup.py [--runs 7]``. Every sample is a new process (``python -m smthrs_plugin``
with the same interpreter, so no console-script shim is timed); the median of ``--runs`` samples is printed with
its ratio to ``python -c pass``. ``runs``, ``plan`` and ``cache ls`` read a workspace holding one completed run and
its cache entry, made once before timing (``smthrs run`` on a one-node plan; ``plan`` re-plans that same file, an
answer from what is stored). A CI step pays the interpreter plus this. Goals: ``--help`` ≤ 3×, ``runs`` and
``plan`` ≤ 5× ``python -c pass``; each line says whether its goal is met.

Bytecode: the samples read compiled modules from a bytecode cache of their own (``PYTHONPYCACHEPREFIX`` in the
temporary directory, filled by the preparation and one untimed sample per command), as an installed package or any
second CI step has them; ``PYTHONDONTWRITEBYTECODE`` in the caller's environment would otherwise make every sample
recompile the package from source. ``--no-bytecode-cache`` times that instead (the environment as it is).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _goals import goal_line

PLAN = 'plan: bench\nflow: bench/startup\nnodes:\n  - id: build\n    run: "echo built"\n'


def _time(argv: list[str], env: dict[str, str], cwd: Path, runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
        samples.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr}")
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per command (median reported)")
    parser.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="keep the environment's PYTHONDONTWRITEBYTECODE (every sample compiles what it imports)",
    )
    args = parser.parse_args()

    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="smthrs-cli-bench-") as tmp:
        ws = Path(tmp)
        (ws / "plan.yaml").write_text(PLAN)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SMTHRS_")}
        env.update(SMTHRS_WORKSPACE=str(ws), PYTHONPATH=str(repo), COLUMNS="100")
        if not args.no_bytecode_cache:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(ws / ".pycache")
        smthrs = [sys.executable, "-m", "smthrs_plugin"]
        made = subprocess.run(
            [*smthrs, "run", str(ws / "plan.yaml")], env=env, capture_output=True, text=True
        )
        if made.returncode != 0:
            raise SystemExit(
                f"could not prepare the workspace (smthrs run exited {made.returncode}):\n{made.stderr}"
            )

        cases = [
            ("python -c pass", [sys.executable, "-c", "pass"]),
            ("smthrs --help", [*smthrs, "--help"]),
            ("smthrs runs", [*smthrs, "runs"]),
            ("smthrs plan", [*smthrs, "plan", str(ws / "plan.yaml")]),
            ("smthrs cache ls", [*smthrs, "cache", "ls"]),
        ]
        goals = {"smthrs --help": 3.0, "smthrs runs": 5.0, "smthrs plan": 5.0}
        base = None
        cache = "no bytecode cache" if args.no_bytecode_cache else "bytecode cached"
        print(f"{'command':<18} {'median':>9} {'x python':>9}   ({args.runs} fresh processes each, {cache})")
        lines: list[str] = []
        for name, argv in cases:
            _time(argv, env, ws, 1)  # untimed: fills the bytecode cache for what this command imports
            median = _time(argv, env, ws, args.runs)
            base = median if base is None else base
            goal = goals.get(name)
            met = goal is not None and median / base <= goal
            verdict = "" if goal is None else f"   goal <= {goal:.0f}x: {'met' if met else 'not met'}"
            print(f"{name:<18} {median * 1000:>7.0f}ms {median / base:>8.1f}x{verdict}")
            if goal is not None:
                lines.append(
                    goal_line(
                        name,
                        f"{median / base:.1f}x python -c pass",
                        f"<= {goal:.0f}x",
                        met,
                        f"{median * 1000:.0f} ms vs python -c pass {base * 1000:.0f} ms, {cache}",
                    )
                )
        print()
        print("\n".join(lines))


if __name__ == "__main__":
    main()
