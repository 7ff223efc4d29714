"""Compile output is pinned byte for byte: keys, edges, annotations, digests and refusals of generated plans.

Node keys and the plan digest are persisted and approvals bind to them, so a compile change that alters one
byte of them breaks every stored approval. ``compile_golden.json`` was produced by the pre-optimisation
compiler (``python tests/plan/golden_plans.py``) and regenerated once, deliberately, when plan keys, dispatch
keys and the plan digest became the reference implementation's (tests/plan/test_reference_goldens.py) and edges
came to be inferred by data whatever the declaration order (tests/plan/test_compile_reference_edges.py); every
seed must still fingerprint the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import golden_plans

GOLDEN = json.loads((Path(__file__).parent / "compile_golden.json").read_text())


def test_generated_plans_and_refusals_fingerprint_as_pinned() -> None:
    assert len(GOLDEN["cases"]) == golden_plans.CASES
    wrong = [s for s in range(golden_plans.CASES) if golden_plans.fingerprint(s) != GOLDEN["cases"][str(s)]]
    assert wrong == [], f"seeds whose compile output changed: {wrong} (e.g. {golden_plans.case(wrong[0])!r})"


def test_benchmark_shapes_digest_as_pinned() -> None:
    for name, digest in GOLDEN["bench"].items():
        shape, n = name.split("-")
        assert golden_plans.bench_digest(shape, int(n)) == digest, name


def test_declaration_refusals_are_unchanged() -> None:
    pinned = GOLDEN["declarations"]
    assert len(pinned) == len(golden_plans.DECLARATION_REFUSALS)
    for i, expected in enumerate(pinned):
        assert golden_plans.declaration_refusal(i) == expected, golden_plans.DECLARATION_REFUSALS[i]
