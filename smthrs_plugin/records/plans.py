"""The plan records' owner: stored plan generations, a run's input observations and its stop-merge decisions.

Invariants (the tables are ``stores/plan_tables.py``):

- **One owner.** Every statement on ``plan_generations``, ``plan_input_heads``, ``plan_input_generations`` and
  ``plan_merges`` is in this module, and it is the only decoder of their rows (the scheduler's plan and input
  stores keep their rules — verifying a plan, pinning sources, journaling — and call these functions). Writes are
  ``*_in(conn, ...)`` on the caller's transaction: a generation commits with its journal record, an input head
  with its first pins, a merge completion with the generation it appended.
- **Generations are append-only and content-addressed.** A row is stored once under ``(plan_id, digest)`` with
  only the nodes its generation added (first writer wins: the caller inserts only digests :func:`stored_digests_in`
  did not report). :func:`generation_chain_in` walks ``parent_digest`` back to generation 0 and refuses a chain
  with a missing parent, a generation at the wrong depth, or nodes that do not decode (``invalid_plan``): a
  broken chain is never patched into a plan.
- **Input observations are decoded or refused.** A run's pins are the union of its input generations, oldest
  first; a generation that does not decode is ``store_failed`` — never a guess at which inputs a run observed.
- **Merge decisions** (:class:`MergeStore`) are an ``intent`` written with the stopped node's settlement, then
  ``completed`` exactly once in the transaction that appends the merge generation; a row in any other shape is
  ``invalid_plan`` (missing recovery data is not permission to invent an extension).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import canonical_bytes
from ..errors import SchedulerError
from ..plan.keys import ABSENT
from ..plan.model import Plan, PlanNode
from ..stores.database import Database
from ..stores.plan_tables import plan_generations, plan_input_generations, plan_input_heads, plan_merges

__all__ = [
    "StoredGeneration",
    "GenerationRow",
    "stored_digests_in",
    "insert_generation_in",
    "generation_chain_in",
    "generations",
    "PinFiles",
    "pins_to_json",
    "pins_from_json",
    "HeadRow",
    "input_head_in",
    "create_head_in",
    "advance_head_in",
    "MergeDecision",
    "MergeStore",
]

#: Pinned source observations: ``entry id → ((path, digest), ...)``.
PinFiles = Mapping[str, Sequence[tuple[str, str]]]


# ------------------------------------------------------------------------------------------ plan generations


@dataclass(frozen=True)
class StoredGeneration:
    plan_id: str
    digest: str
    base_digest: str
    parent_digest: str | None
    generation: int


@dataclass(frozen=True)
class GenerationRow:
    """One stored generation with the nodes it added, decoded to their plain JSON form."""

    digest: str
    parent_digest: str | None
    generation: int
    flow: str
    maximum_plan_nodes: int
    nodes: Any


#: Serializes a generation's nodes in pydantic's compiled serializer: one pass in Rust instead of a ``model_dump``
#: per node and ``json.dumps`` of the result (about 4x less CPU for a 1,000-node plan, stored on every run's start).
_NODES = TypeAdapter(list[PlanNode])


def _nodes_json(nodes: Sequence[PlanNode]) -> str:
    # Plain (not RFC 8785) JSON on purpose: a priority beyond ±(2**53-1) is a legal exact int of the plan that
    # canonical JSON cannot carry; pydantic writes any int exactly and ``json.loads`` reads it back exactly. The
    # row is data, not a key: its member order is the model's field order, and nothing compares its bytes.
    return _NODES.dump_json(list(nodes), by_alias=True).decode()


def stored_digests_in(conn: Connection, plan_id: str, digests: Sequence[str]) -> set[str]:
    """Which of ``digests`` are stored generations of ``plan_id``."""
    g = plan_generations.c
    rows = conn.execute(
        sa.select(g.digest).where(g.plan_id == plan_id, g.digest.in_(list(digests)))
    ).scalars()
    return set(rows)


def insert_generation_in(
    conn: Connection,
    plan: Plan,
    *,
    digest: str,
    parent_digest: str | None,
    generation: int,
    nodes: Sequence[PlanNode],
    now_ms: int,
) -> None:
    """Store generation ``generation`` of ``plan`` (digest ``digest``) with only the ``nodes`` it added; the caller
    checked it is not stored yet."""
    conn.execute(
        sa.insert(plan_generations).values(
            plan_id=plan.plan_id,
            digest=digest,
            base_digest=plan.base_digest,
            parent_digest=parent_digest,
            generation=generation,
            flow=plan.flow,
            maximum_plan_nodes=plan.maximum_plan_nodes,
            nodes_json=_nodes_json(nodes),
            created_at_ms=now_ms,
        )
    )


def generation_chain_in(conn: Connection, plan_id: str, digest: str) -> list[GenerationRow] | None:
    """The stored generations of ``plan_id`` from generation 0 up to the one with ``digest`` (None when that one is
    not stored); ``SchedulerError(invalid_plan)`` for a broken chain (see the module invariants)."""
    g = plan_generations.c
    chain: list[Any] = []
    want: str | None = digest
    while want is not None:
        row = conn.execute(sa.select(plan_generations).where(g.plan_id == plan_id, g.digest == want)).first()
        if row is None:
            if not chain:
                return None
            raise SchedulerError(
                "invalid_plan",
                f"stored plan {plan_id!r}: generation {chain[-1].generation} names parent {want}, which is "
                "not stored; the plan store is inconsistent — restore it from a backup or start a new run",
                plan_id=plan_id,
            )
        chain.append(row)
        want = row.parent_digest
    chain.reverse()
    out: list[GenerationRow] = []
    for expected_gen, row in enumerate(chain):
        if row.generation != expected_gen:
            raise SchedulerError(
                "invalid_plan",
                f"stored plan {plan_id!r}: generation {row.generation} sits at depth {expected_gen} of its "
                "parent chain; the plan store is inconsistent",
                plan_id=plan_id,
            )
        try:
            nodes = json.loads(row.nodes_json)
        except ValueError as exc:
            raise SchedulerError(
                "invalid_plan",
                f"stored plan {plan_id!r} generation {row.generation} does not decode",
                cause=exc,
            ) from exc
        out.append(
            GenerationRow(
                row.digest, row.parent_digest, row.generation, row.flow, row.maximum_plan_nodes, nodes
            )
        )
    return out


def generations(db: Database, plan_id: str) -> list[StoredGeneration]:
    """Every stored generation of ``plan_id`` (all bases), by (base, generation)."""
    g = plan_generations.c
    rows = db.read(
        lambda c: c.execute(
            sa.select(g.plan_id, g.digest, g.base_digest, g.parent_digest, g.generation)
            .where(g.plan_id == plan_id)
            .order_by(g.base_digest, g.generation, g.digest)
        ).all()
    )
    return [
        StoredGeneration(r.plan_id, r.digest, r.base_digest, r.parent_digest, int(r.generation)) for r in rows
    ]


# --------------------------------------------------------------------------------------------- input heads


def pins_to_json(files: PinFiles) -> list[dict[str, Any]]:
    """The stored form of pinned files: one ``{entry, files}`` item per entry, by entry id."""
    return [{"entry": json.loads(k), "files": [list(f) for f in v]} for k, v in sorted(files.items())]


def pins_from_json(doc: Any) -> dict[str, tuple[tuple[str, str], ...]]:
    """The inverse of :func:`pins_to_json` (``ValueError``/``KeyError``/``TypeError`` for a malformed doc)."""
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for item in doc:
        out[canonical_bytes(item["entry"]).decode()] = tuple((str(p), str(d)) for p, d in item["files"])
    return out


@dataclass(frozen=True)
class HeadRow:
    """A run's input head with the union of the pins of its input generations."""

    run_id: str
    plan_id: str
    base_digest: str
    digest: str
    generation: int
    environment_fingerprint: str
    files: dict[str, tuple[tuple[str, str], ...]]


def input_head_in(conn: Connection, run_id: str) -> HeadRow | None:
    """The input head of ``run_id`` (None when the run has none); ``SchedulerError(store_failed)`` when an input
    generation does not decode."""
    h = plan_input_heads.c
    row = conn.execute(sa.select(plan_input_heads).where(h.run_id == run_id)).first()
    if row is None:
        return None
    g = plan_input_generations.c
    files: dict[str, tuple[tuple[str, str], ...]] = {}
    for gen in conn.execute(
        sa.select(g.generation, g.pins_json).where(g.run_id == run_id).order_by(g.generation)
    ):
        try:
            files.update(pins_from_json(json.loads(gen.pins_json)))
        except (ValueError, KeyError, TypeError) as exc:
            raise SchedulerError(
                "store_failed",
                f"input generation {gen.generation} of run {run_id!r} does not decode; refusing to guess "
                "which inputs the run observed",
                cause=exc,
                run_id=run_id,
            ) from exc
    return HeadRow(
        run_id=row.run_id,
        plan_id=row.plan_id,
        base_digest=row.base_digest,
        digest=row.digest,
        generation=int(row.generation),
        environment_fingerprint=row.environment_fingerprint,
        files=files,
    )


def create_head_in(
    conn: Connection,
    run_id: str,
    plan: Plan,
    *,
    environment: Any,
    environment_fingerprint: str,
    pins: PinFiles,
    now_ms: int,
) -> None:
    """Bind ``run_id`` to ``plan``'s id, base and environment, and record the pins of its first generation."""
    conn.execute(
        sa.insert(plan_input_heads).values(
            run_id=run_id,
            plan_id=plan.plan_id,
            base_digest=plan.base_digest,
            digest=plan.digest,
            generation=plan.generation,
            environment_fingerprint=environment_fingerprint,
            environment_json=None if environment is ABSENT else canonical_bytes(environment).decode(),
            created_at_ms=now_ms,
            updated_at_ms=now_ms,
        )
    )
    _input_generation_in(conn, run_id, plan, pins, now_ms)


def advance_head_in(conn: Connection, run_id: str, plan: Plan, pins: PinFiles, now_ms: int) -> None:
    """The run observed a newer generation of its plan: move the head and record its new source pins."""
    h = plan_input_heads.c
    conn.execute(
        sa.update(plan_input_heads)
        .where(h.run_id == run_id)
        .values(digest=plan.digest, generation=plan.generation, updated_at_ms=now_ms)
    )
    _input_generation_in(conn, run_id, plan, pins, now_ms)


def _input_generation_in(conn: Connection, run_id: str, plan: Plan, pins: PinFiles, now_ms: int) -> None:
    conn.execute(
        sa.insert(plan_input_generations).values(
            run_id=run_id,
            generation=plan.generation,
            plan_digest=plan.digest,
            pins_json=canonical_bytes(pins_to_json(pins)).decode(),
            created_at_ms=now_ms,
        )
    )


# ------------------------------------------------------------------------------------------------ merges


@dataclass(frozen=True)
class MergeDecision:
    """A durable stop-merge decision: ``node`` was stopped in favour of ``winners``. ``merge_node`` and the
    digests are set once the merge generation was appended (``completed``)."""

    run_id: str
    node: str
    plan_id: str
    winners: tuple[str, ...]
    paths: tuple[str, ...]
    decided_digest: str
    completed: bool
    merge_node: str | None = None
    generation: int | None = None
    parent_digest: str | None = None
    digest: str | None = None


class MergeStore:
    """Stop-merge decisions of one database."""

    def __init__(self, db: Database, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.clock = clock

    def load_in(self, conn: Connection, run_id: str) -> list[MergeDecision]:
        m = plan_merges.c
        out: list[MergeDecision] = []
        for r in conn.execute(
            sa.select(plan_merges).where(m.run_id == run_id).order_by(m.decided_at_ms, m.node_id)
        ):
            try:
                winners = tuple(json.loads(r.winners_json))
                paths = tuple(json.loads(r.paths_json))
            except ValueError as exc:
                raise SchedulerError(
                    "store_failed",
                    f"merge decision of {r.node_id!r} in run {run_id!r} does not decode",
                    cause=exc,
                ) from exc
            if r.state not in ("intent", "completed") or (
                r.state == "completed"
                and (r.merge_node_id is None or r.digest is None or r.generation is None)
            ):
                raise SchedulerError(
                    "invalid_plan",
                    f"merge decision of {r.node_id!r} in run {run_id!r} is inconsistent (state {r.state!r}); "
                    "missing or inconsistent recovery data is not permission to invent an extension",
                    run_id=run_id,
                    node=r.node_id,
                )
            out.append(
                MergeDecision(
                    run_id=r.run_id,
                    node=r.node_id,
                    plan_id=r.plan_id,
                    winners=winners,
                    paths=paths,
                    decided_digest=r.decided_digest,
                    completed=r.state == "completed",
                    merge_node=r.merge_node_id,
                    generation=None if r.generation is None else int(r.generation),
                    parent_digest=r.parent_digest,
                    digest=r.digest,
                )
            )
        return out

    def load(self, run_id: str) -> list[MergeDecision]:
        return self.db.read(lambda c: self.load_in(c, run_id))

    def decide_in(
        self,
        conn: Connection,
        run_id: str,
        plan: Plan,
        node: str,
        winners: Iterable[str],
        paths: Iterable[str],
    ) -> None:
        conn.execute(
            sa.insert(plan_merges).values(
                run_id=run_id,
                node_id=node,
                plan_id=plan.plan_id,
                winners_json=canonical_bytes(list(winners)).decode(),
                paths_json=canonical_bytes(list(paths)).decode(),
                decided_digest=plan.digest,
                state="intent",
                decided_at_ms=self.clock.now_ms(),
            )
        )

    def complete_in(
        self, conn: Connection, run_id: str, node: str, merge_node: str, parent: Plan, grown: Plan
    ) -> None:
        m = plan_merges.c
        done = conn.execute(
            sa.update(plan_merges)
            .where(m.run_id == run_id, m.node_id == node, m.state == "intent")
            .values(
                state="completed",
                merge_node_id=merge_node,
                generation=grown.generation,
                parent_digest=parent.digest,
                digest=grown.digest,
                completed_at_ms=self.clock.now_ms(),
            )
        ).rowcount
        if done != 1:
            raise SchedulerError(
                "invalid_plan",
                f"the merge decision of {node!r} in run {run_id!r} is not an open intent; refusing to append",
                run_id=run_id,
                node=node,
            )
