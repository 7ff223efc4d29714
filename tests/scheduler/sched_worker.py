"""A scheduler process for crash tests: ``python sched_worker.py ROOT SCENARIO PHASE [base|grown]``.

It opens the stores under ROOT (a fresh process: its own owner id), claims the run — stealing it from a dead
owner on the same-host pid probe — and runs the scenario's plan on a thread host. Every executor call is
appended (and fsynced) to ROOT/calls.log as ``PHASE NODE KIND SEEN`` before the node does anything else; a node
named in the scenario's ``block`` set touches ROOT/blocked-<node> and sleeps until the parent kills the
process. The report is printed as JSON on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sched_support import make_env  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.engine.ownership.liveness import SameHostPidProbe  # noqa: E402
from smthrs_plugin.scheduler import NodeInput, ThreadHost  # noqa: E402

RUN = "crash-run"


def scenario_plan(name: str) -> sp.plan.Plan:
    if name == "chain":
        return sp.plan.compile_plan(
            "chain",
            "f",
            [
                sp.plan.node("a", body={"n": 1}, writes=["a.txt"]),
                sp.plan.node(
                    "b",
                    body={"n": 2},
                    inputs=[sp.plan.Ref("a", path=["value"])],
                    reads=["a.txt"],
                    writes=["b.txt"],
                ),
                sp.plan.node("c", body={"n": 3}, inputs=[sp.plan.Ref("b")]),
                sp.plan.node("block", body={"n": 4}, inputs=[sp.plan.Ref("c")]),
                sp.plan.node("d", body={"n": 5}, inputs=[sp.plan.Ref("block", path=["value"])]),
            ],
        )
    if name == "compensable":
        return sp.plan.compile_plan(
            "comp",
            "f",
            [
                sp.plan.node("comp", body=1, tier="compensable", writes=["state.txt"]),
                sp.plan.node("z", body=2, inputs=[sp.plan.Ref("comp")]),
            ],
        )
    if name == "irreversible":
        return sp.plan.compile_plan(
            "irr",
            "f",
            [
                sp.plan.node("deploy", body=1, tier="irreversible"),
                sp.plan.node("after", body=2, inputs=[sp.plan.Ref("deploy")]),
                sp.plan.node("free", body=3),
            ],
        )
    if name in ("merge", "merge-grown"):
        return sp.plan.compile_plan(
            "race",
            "f",
            [
                sp.plan.node(
                    "winner", body="w", writes=["shared.txt"], conflict="lane", runtime="stop-merge"
                ),
                sp.plan.node("loser", body="l", writes=["shared.txt"], conflict="lane", runtime="stop-merge"),
                sp.plan.node("tail", body="t", inputs=[sp.plan.Ref("loser")]),
            ],
        )
    raise SystemExit(f"unknown scenario {name}")


#: (scenario, phase) -> nodes that block until the process is killed
BLOCK = {
    ("chain", "first"): {"block"},
    ("compensable", "first"): {"comp"},
    ("irreversible", "first"): {"deploy"},
    ("merge", "first"): {"winner"},
    ("merge-grown", "first"): {"loser+merge"},
}


def executor_for(root: Path, ws: Path, scenario: str, phase: str) -> Any:
    block = BLOCK.get((scenario, phase), set())

    def log(line: str) -> None:
        with open(root / "calls.log", "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def run(ni: NodeInput) -> Any:
        seen = ""
        if scenario == "compensable" and ni.id == "comp":
            seen = (ws / "state.txt").read_text() if (ws / "state.txt").exists() else "<absent>"
        log(f"{phase} {ni.id} {ni.node.kind} {seen}")
        if scenario == "compensable" and ni.id == "comp" and phase == "first":
            (ws / "state.txt").write_text("half-written garbage")  # a partial effect outside the sandbox
        if scenario == "merge" and ni.id == "loser" and phase == "first":
            (ws / "shared.txt").write_text("someone else landed")  # the landing race the loser loses
        if scenario == "merge-grown" and phase == "first":
            # A race with a fixed outcome, whatever the machine's speed: the winner lands only once the loser is
            # running (its sandbox taken from the base, before the landing), and the loser returns only after the
            # winner landed. Without this barrier a slow start let the loser begin after the landing: no conflict,
            # no merge, and the first phase ran to its end.
            if ni.id == "loser":
                (root / "started-loser").touch()
                while not (ws / "shared.txt").exists():  # lose the race to the winner's landing
                    time.sleep(0.01)
            elif ni.id == "winner":
                while not (root / "started-loser").exists():
                    time.sleep(0.01)
        for w in ni.node.effects.writes:
            (ni.root / w).write_text(f"{ni.id}:{list(ni.inputs)}")
        if ni.id in block:
            (root / f"blocked-{ni.id}").touch()
            while True:
                time.sleep(1)
        return {"value": ni.id.upper(), "inputs": [repr(v) for v in ni.inputs]}

    return run


def main() -> None:
    root, scenario, phase = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    which = sys.argv[4] if len(sys.argv) > 4 else "base"
    env = make_env(root, ws=root / "ws")
    env.claim(RUN, liveness=SameHostPidProbe())
    plan = scenario_plan(scenario)
    sched = env.scheduler(RUN, host=ThreadHost(4))
    if which == "grown":
        head = sched.inputs.load(RUN)
        assert head is not None
        grown = sched.plans.load(plan.plan_id, head.digest)
        assert grown is not None and grown.generation > 0, "no grown plan to resume"
        plan = grown
    report = sched.run(plan, executor_for(root, env.ws, scenario, phase))
    sched.host.close()
    print(json.dumps(report.to_json(), sort_keys=True))


if __name__ == "__main__":
    main()
