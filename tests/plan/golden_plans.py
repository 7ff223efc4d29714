"""Seeded generator of plans (and of refused plans) for the compile golden test.

Every case is a pure function of its seed, built only through the public declaration API (``node``, ``Ref``,
``Pending``, ``Literal``, ``Glob``, ``compile_plan``, ``append_plan``) plus ``model_copy`` for drafts that
bypassed validation. ``fingerprint(seed)`` is the sha256 of everything a compile produces that is persisted or
hashed — the whole ``Plan.to_json()`` of every generation (node keys, edges, conflict annotations, digests,
``base_digest``, the drafts' dump) — or, for a refused case, of the refusal's ``to_dict()`` (code, message,
details, cause). ``python tests/plan/golden_plans.py`` prints the table the golden test pins; regenerate it
only for a deliberate, versioned change of the key or digest formulas (every stored approval breaks).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from typing import Any

import smthrs_plugin as sp
from smthrs_plugin.errors import SmthrsError
from smthrs_plugin.plan import Glob

CASES = 240

_IDS = ["a", "b", "node", "é", "e\u0301", "𝔸", "\ue000", "x y", 'q"uote', "back\\slash", "ctl\x01", "日本"]
_KEYS = ["k", "a", "B", "é", "𝔸", "\ue000", "\uffff", "", "10", "2", "z\n"]
_STRS = ["", "x", "é", "e\u0301", "𝔸𝔹", "\ue000", "tab\t", "nl\n", "\x1f", "\u2028", '"', "\\", "/"]
_FLOATS = [0.0, -0.0, 1.0, 0.1, 1e21, 1e-7, -2.5, 1e300, 5e-324, 123456789.125]
_INTS = [0, 1, -1, 7, 2**31, -(2**40), 2**53 - 1, -(2**53 - 1)]
_PRODUCED = ["src/a.py", "src/b.py", "src/gen/", "dist/", "dist/app.whl", "out/x", "out/", "src/**/*.py",
             "docs/*.md", "out/sub/f", "build/**"]  # fmt: skip
_REMOVED = ["tmp/old", "tmp/cache/", "trash/*.bak", "legacy/x.py"]
_READS = ["src/**", "src/a.py", "dist/", "out/x", "docs/index.md", "README.md", ".git/HEAD", "**/*.toml",
          "src/gen/mod.py", "tmp/old", "build/lib/x.so"]  # fmt: skip


def _json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 3 or roll < 0.45:
        kind = rng.randrange(5)
        if kind == 0:
            return rng.choice(_INTS)
        if kind == 1:
            return rng.choice(_FLOATS) if rng.random() < 0.5 else rng.choice(_STRS)
        if kind == 2:
            return rng.choice(_STRS)
        return rng.choice([True, False, None])
    if roll < 0.7:
        return [_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(_KEYS) + str(i % 2 or ""): _json(rng, depth + 1) for i in range(rng.randrange(5))}


def _entries(rng: random.Random, pool: list[str], most: int, globs: bool = True) -> list[Any]:
    out: list[Any] = []
    for _ in range(rng.randrange(most + 1)):
        if globs and rng.random() < 0.1:
            out.append(Glob(include=[rng.choice(["src/**/*.py", "docs/**"])], exclude=["src/skip/**"]))
        else:
            out.append(rng.choice(pool))
    return out


def _draft(rng: random.Random, nid: str, earlier: list[str]) -> sp.plan.NodeDraft:
    inputs: list[Any] = []
    for _ in range(rng.randrange(4)):
        r = rng.random()
        if earlier and r < 0.35:
            path = [rng.choice(_KEYS) for _ in range(rng.randrange(3))]
            inputs.append(sp.plan.Ref(rng.choice(earlier), path=path))
        elif earlier and r < 0.6:
            inputs.append(sp.plan.Pending(rng.choice(earlier)))
        else:
            inputs.append(sp.plan.Value(_json(rng)))
    kw: dict[str, Any] = {}
    if rng.random() < 0.8:
        kw["body"] = _json(rng)
    if rng.random() < 0.5:
        kw["writes"] = _entries(rng, _PRODUCED, 2)
    if rng.random() < 0.2:
        kw["removes"] = _entries(rng, _REMOVED, 1, globs=False)
    if rng.random() < 0.5:
        kw["reads"] = _entries(rng, _READS, 3)
    if rng.random() < 0.2:
        kw["boundary"] = "expected"
    if rng.random() < 0.3:
        kw["tier"] = rng.choice(["compensable", "irreversible"])
    if rng.random() < 0.3:
        kw["kind"] = rng.choice(["agent", "merge"])
    if rng.random() < 0.4:
        kw["priority"] = rng.choice([-3, 1, 5, 2**53 - 1, 2**53, -(2**60), 10**30])
    if rng.random() < 0.3:
        kw["conflict"] = "lane"
    if rng.random() < 0.3:
        kw["runtime"] = "stop-merge"
    if rng.random() < 0.3:
        kw["layers"] = [rng.choice(["py3.11", "é", "e\u0301", "base", "𝔸"]) for _ in range(rng.randrange(4))]
    if rng.random() < 0.2:
        kw["capabilities"] = rng.choice(
            [["deploy:prod", "net", "net"], {"declared": ["b", "a"], "𝔸": ["x"], "\ue000": []}]
        )
    if rng.random() < 0.15:
        kw["nondeterministic"] = rng.random() < 0.5
    if rng.random() < 0.15:
        kw["approval"] = {"who": rng.choice(_STRS), "n": _json(rng)}
    if rng.random() < 0.1:
        kw["wait"] = {"seconds": rng.choice(_INTS + _FLOATS)}
    return sp.plan.node(nid, inputs=inputs, **kw)


def _ids(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        nid = rng.choice(_IDS) + str(rng.randrange(10 * n + 10))
        if nid not in taken:
            taken.add(nid)
            out.append(nid)
    return out


def _plan_generations(rng: random.Random, seed: int) -> list[sp.plan.Plan]:
    taken: set[str] = set()
    n = rng.randrange(1, 30)
    ids = _ids(rng, n, taken)
    drafts = [_draft(rng, nid, ids[:i]) for i, nid in enumerate(ids)]
    rng.shuffle(drafts)  # declaration order is not dependency order: exercises the topological sort
    plan = sp.plan.compile_plan(f"plan-{seed}", rng.choice(["ci/build", "flow", "𝔸/é"]), drafts, 10_000)
    out = [plan]
    for _ in range(rng.randrange(3)):
        new = _ids(rng, rng.randrange(1, 6), taken)
        existing = [x.id for x in plan.nodes]
        grown = [_draft(rng, nid, existing + new[:i]) for i, nid in enumerate(new)]
        rng.shuffle(grown)
        plan = sp.plan.append_plan(plan, grown)
        out.append(plan)
    return out


def _bypass(draft: sp.plan.NodeDraft, **effects: Any) -> sp.plan.NodeDraft:
    return draft.model_copy(update={"effects": draft.effects.model_copy(update=effects)})


def _refused(rng: random.Random, seed: int) -> None:
    """Build a plan that compile must refuse; raises the refusal."""
    taken: set[str] = set()
    ids = _ids(rng, rng.randrange(2, 12), taken)
    drafts = [_draft(rng, nid, ids[:i]) for i, nid in enumerate(ids)]
    k = rng.randrange(len(drafts))
    victim = drafts[k]
    flaw = seed % 11
    if flaw == 0:
        drafts.append(sp.plan.node(victim.id))
    elif flaw == 1:
        drafts[k] = sp.plan.node(victim.id, inputs=[sp.plan.Ref("ghost-" + str(seed))])
    elif flaw == 2:
        drafts[0] = sp.plan.node(ids[0], inputs=[sp.plan.Pending(ids[-1])])
        drafts[-1] = sp.plan.node(
            ids[-1], inputs=[sp.plan.Ref(ids[0])] + ([sp.plan.Pending(ids[1])] if len(ids) > 2 else [])
        )
    elif flaw == 3:
        drafts[k] = _bypass(victim, writes=("/etc/passwd",))
    elif flaw == 4:
        drafts[k] = _bypass(victim, reads=("src/../../x",))
    elif flaw == 5:
        drafts[k] = _bypass(victim, writes=("out/x",), removes=("out/",))
    elif flaw == 6:
        drafts[k] = _bypass(victim, writes=(".git/hooks/pre-commit",))
    elif flaw == 7:
        drafts.append(sp.plan.node("w1", writes=["shared/"]))
        drafts.append(sp.plan.node("w2", writes=["shared/f"], conflict="fail"))
    elif flaw == 8:
        bad = victim.model_copy(
            update={"material": victim.material.model_copy(update={"body": [float("nan")]})}
        )
        drafts[k] = bad
    elif flaw == 9:
        bad = victim.model_copy(
            update={"material": victim.material.model_copy(update={"body": {"deep": "\ud800"}})}
        )
        drafts[k] = bad
    rng.shuffle(drafts)
    maximum = len(drafts) - 1 if flaw == 10 else 10_000
    sp.plan.compile_plan(f"refused-{seed}", "flow", drafts, maximum)


#: Declarations ``node()`` must refuse, each with the exact refusal it always gave (code, message, details).
DECLARATION_REFUSALS: list[dict[str, Any]] = [
    {"id": ""},
    {"id": "a\x00b"},
    {"id": 5},
    {"id": "lone\ud800"},
    {"id": "a", "body": float("nan")},
    {"id": "a", "body": 2**60},
    {"id": "a", "body": {1: "x"}},
    {"id": "a", "body": {"s": {1, 2}}},
    {"id": "a", "body": "\udc00"},
    {"id": "a", "inputs": [3]},
    {"id": "a", "inputs": "x"},
    {"id": "a", "reads": ""},
    {"id": "a", "reads": ["/abs"]},
    {"id": "a", "writes": ["x/../y"]},
    {"id": "a", "writes": ["out/"], "removes": ["out/x"]},
    {"id": "a", "boundary": "soft"},
    {"id": "a", "boundary": ["hard"]},
    {"id": "a", "boundary": "soft", "body": float("inf")},
    {"id": "a", "reads": "", "layers": "x"},
    {"id": "a", "priority": True},
    {"id": "a", "priority": 1.0},
    {"id": "a", "kind": "task"},
    {"id": "a", "conflict": "never"},
    {"id": "a", "tier": "pure"},
    {"id": "a", "nondeterministic": 1},
    {"id": "a", "layers": [1]},
    {"id": "a", "capabilities": {"g": "x"}},
    {"id": "a", "approval": [1]},
    {"id": "a", "wait": {"s": float("nan")}},
    {"id": "", "body": float("nan"), "writes": ["/x"]},
]


def declaration_refusal(i: int) -> Any:
    """The ``to_dict()`` of the refusal of ``DECLARATION_REFUSALS[i]`` (or None when it was accepted)."""
    try:
        sp.plan.node(**DECLARATION_REFUSALS[i])
    except SmthrsError as exc:
        return {"refused": type(exc).__name__, **exc.to_dict()}
    return None


def case(seed: int) -> Any:
    """What one seed produces: the JSON of every generation, or the refusal's ``to_dict()``."""
    rng = random.Random(seed)
    if seed % 4 == 3:
        try:
            _refused(rng, seed // 4)
        except SmthrsError as exc:
            return {"refused": type(exc).__name__, **exc.to_dict()}
        return {"refused": None}
    return [p.to_json() for p in _plan_generations(rng, seed)]


def fingerprint(seed: int) -> str:
    """sha256 (first 24 hex digits) of the case's JSON."""
    text = json.dumps(case(seed), sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:24]


def bench_digest(shape: str, n: int) -> str:
    """Digest of the benchmark's plan shape (benchmarks/graph.py) at ``n`` nodes."""
    if shape == "chain":
        drafts = [
            sp.plan.node(f"n{i}", body=i, inputs=[sp.plan.Pending(f"n{i - 1}")] if i else [])
            for i in range(n)
        ]
    else:
        drafts = [sp.plan.node(f"n{i}", body=i, kind="agent" if i % 4 == 0 else "step") for i in range(n)]
    return sp.plan.compile_plan(f"bench-{shape}", "bench", drafts, maximum_plan_nodes=n).digest


if __name__ == "__main__":
    json.dump(
        {
            "cases": {str(s): fingerprint(s) for s in range(CASES)},
            "bench": {
                f"{shape}-{n}": bench_digest(shape, n) for shape in ("chain", "wide") for n in (1, 2000)
            },
            "declarations": [declaration_refusal(i) for i in range(len(DECLARATION_REFUSALS))],
        },
        sys.stdout,
        indent=1,
        sort_keys=True,
    )
    sys.stdout.write("\n")
