"""Stored plan generations (``records/plans.py``) on SQLite AND PostgreSQL: a generation's row decodes to exactly the
plain JSON of the nodes it added, whatever serializer writes it, for the values JSON makes hard — an exact int
beyond 2**53, floats at the edges of their range, non-ASCII and escaped text."""

from __future__ import annotations

import json

import smthrs_plugin as sp
from smthrs_plugin.records.plans import generation_chain_in, insert_generation_in
from smthrs_plugin.stores.database import Database


def test_a_stored_generation_decodes_to_exactly_the_json_of_its_nodes(db: Database) -> None:
    drafts = [
        sp.plan.node("fetch", body={"url": "https://example.org/é", "ratio": 0.1}, priority=2**80),
        sp.plan.node(
            "日本",
            body={"tiny": 5e-324, "huge": 1e300, "neg": -0.0, "text": 'q"uote\\\n\u2028\ue000𝔸'},
            inputs=[sp.plan.Ref("fetch", path=["value"])],
            priority=-(2**70),
        ),
    ]
    plan = sp.plan.compile_plan("p", "flow/é", drafts, 100)
    db.write(
        lambda c: insert_generation_in(
            c, plan, digest=plan.digest, parent_digest=None, generation=0, nodes=plan.nodes, now_ms=1
        )
    )

    chain = db.read(lambda c: generation_chain_in(c, "p", plan.digest))

    assert chain is not None and len(chain) == 1
    expected = [n.model_dump(mode="json", by_alias=True) for n in plan.nodes]
    assert chain[0].nodes == expected
    # Exact, not merely equal: -0.0 keeps its sign, and the huge priorities stay ints.
    assert json.dumps(chain[0].nodes, sort_keys=True) == json.dumps(expected, sort_keys=True)
    assert [n["draft"]["priority"] for n in chain[0].nodes] == [2**80, -(2**70)]
