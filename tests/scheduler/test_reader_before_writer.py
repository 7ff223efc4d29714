"""A plan file whose readers are declared before their writers builds exactly what the same plan declared in
topological order builds, run after run on the threaded host.

Compile orders every reader after every writer of what it reads, whatever the declaration order (a glob
reader after a tree writer and a glob writer of its directory included), so the readers-first plan cannot
race: without those edges its readers start alongside their writers and fail on inputs that do not exist yet.
Each run gets a fresh workspace and state, so every node really executes (nothing is served from a cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import smthrs_plugin as sp
from smthrs_plugin.scheduler import ThreadHost

RUNS = 20

#: id → (command, reads, writes). Declared in this order, every reader comes before its writers.
NODES: dict[str, tuple[str, list[str], list[str]]] = {
    "package": (
        "mkdir -p dist && cat out/b.txt out/index.txt > dist/package.txt",
        ["out/b.txt", "out/index.txt"],
        ["dist/package.txt"],
    ),
    "index": ("ls out/parts | sort > out/index.txt", ["out/parts/**"], ["out/index.txt"]),
    "transform": ("tr a-z A-Z < out/a.txt > out/b.txt", ["out/a.txt"], ["out/b.txt"]),
    "parts-tree": ("mkdir -p out/parts && printf one > out/parts/one.txt", [], ["out/parts/"]),
    "parts-glob": ("mkdir -p out/parts && printf two > out/parts/two.md", [], ["out/parts/*.md"]),
    "generate": ("mkdir -p out && cat src/seed.txt > out/a.txt", ["src/seed.txt"], ["out/a.txt"]),
}
TOPOLOGICAL = ["generate", "transform", "parts-tree", "parts-glob", "index", "package"]
EXPECTED = {
    "dist/package.txt": "SEED\none.txt\ntwo.md\n",
    "out/a.txt": "seed\n",
    "out/b.txt": "SEED\n",
    "out/index.txt": "one.txt\ntwo.md\n",
    "out/parts/one.txt": "one",
    "out/parts/two.md": "two",
}


def _plan_file(path: Path, order: list[str]) -> Path:
    lines = ["plan: edges", "flow: ci/edges", "nodes:"]
    for nid in order:
        run, reads, writes = NODES[nid]
        lines += [
            f"  - id: {nid}",
            f"    run: {json.dumps(run)}",
            f"    reads: {json.dumps(reads)}",
            f"    writes: {json.dumps(writes)}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _outputs(ws: Path) -> dict[str, str]:
    return {
        f.relative_to(ws).as_posix(): f.read_text()
        for f in sorted(ws.rglob("*"))
        if f.is_file() and f.relative_to(ws).parts[0] in ("out", "dist")
    }


def _build(plan_path: Path, ws: Path) -> tuple[dict[str, str], dict[str, Any]]:
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "seed.txt").write_text("seed\n")
    plan, executor = sp.load_plan(plan_path)
    with sp.open_runtime(workspace=ws) as rt, ThreadHost(8) as host:
        report = rt.scheduler("run", host=host).run(plan, executor)
    settled = {s.node: (s.outcome, s.plan_key, s.dispatch_key) for s in report.settlements}
    return _outputs(ws), settled


def test_a_plan_with_readers_before_writers_builds_what_its_topological_twin_builds_every_time(
    tmp_path: Path,
) -> None:
    readers_first = _plan_file(tmp_path / "readers-first.yaml", list(NODES))
    topological = _plan_file(tmp_path / "topological.yaml", TOPOLOGICAL)

    plan, _ = sp.load_plan(readers_first)
    assert [n.id for n in plan.nodes] == list(NODES)  # plan order is still the declaration order...
    edges = {n.id: set(n.depends_on) for n in plan.nodes}
    assert edges["package"] == {"index", "transform"}  # ...but every reader follows its writers
    assert edges["index"] == {"parts-tree", "parts-glob"}  # a glob reader of a tree and a glob writer
    assert edges["transform"] == {"generate"}
    twin, _ = sp.load_plan(topological)
    assert {n.id: set(n.depends_on) for n in twin.nodes} == edges

    expected_outputs, expected_settled = _build(topological, tmp_path / "topological-ws")
    assert expected_outputs == EXPECTED
    assert {node: s[0] for node, s in expected_settled.items()} == dict.fromkeys(NODES, "built")

    for i in range(RUNS):
        outputs, settled = _build(readers_first, tmp_path / f"readers-first-ws-{i}")
        assert outputs == expected_outputs, f"run {i}"
        # same outcomes, same plan keys, and the same dispatch keys: every reader measured its writers' bytes
        assert settled == expected_settled, f"run {i}"
