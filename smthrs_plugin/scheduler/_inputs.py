"""A run's input observations: source pins, the environment fingerprint, and stop-merge decisions (their rows
are ``records._plans``'s, which holds their SQL; ``MergeStore`` lives there and is re-exported here).

Invariants
- **Source vs produced reads.** A read entry of node N is *produced* when an ancestor of N (a node N depends on,
  transitively) produces (writes or removes) something it may overlap — compile orders every other producer
  before N, whatever the declaration order — so its bytes exist only once that producer settled; it is measured
  at dispatch, after the producers settle, and re-measured by a rebase. Every other read entry is a *source*
  input, the reads of what only N itself or a node that depends on N writes included. Granularity is the
  declared entry (a glob that may overlap a producer is produced as a whole).
- **Pins.** Source entries are expanded (globs, trees) and hashed ONCE, before the first dispatch of the run,
  and persisted (``plan_input_generations``) in the transaction that creates the run's input head. Reopening
  the same run restores them without measuring a source file or expanding a source glob again. A later
  generation (a merge node, a user append) records only the source entries not pinned before.
- **Identity.** The head binds the run to one plan id, one approved base digest and one environment
  fingerprint. Reopening with another plan id, base or environment is refused (``invalid_plan``) before
  anything executes — for every tier. Start a new run for changed work; a new run observes current inputs.
- **Environment.** The scheduler copies ``environment`` at construction. Its normal form sorts and dedups every
  capability-pattern group (pattern sets: equivalent sets recover normally) and keeps layer order (order
  matters). Omission is its own identity, never a wildcard.
- **Merge decisions.** A stop-merge decision (``plan_merges``) is written with the stopped node's ``skipped``
  settlement; its completion (generated node id, parent and new plan digests) is written in the transaction
  that appends the merge generation. Recovery replays decisions and never invents one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from ..canonical import canonical_bytes, key
from ..errors import CanonicalError, SchedulerError
from ..plan import ABSENT, Plan
from ..plan.fileset import PathEntry, entry_json
from ..plan.overlap import produced_reads
from ..records import plans as plan_records
from ..records.plans import MergeDecision, MergeStore
from ..stores.database import Database

__all__ = [
    "normalize_environment",
    "environment_fingerprint",
    "ReadPlan",
    "classify_reads",
    "entry_id",
    "Pins",
    "InputHead",
    "InputStore",
    "MergeDecision",
    "MergeStore",
]


# -------------------------------------------------------------------------------------------- environment


def normalize_environment(environment: Any) -> Any:
    """A private, normal-form copy of a declared environment (plain JSON, or ``ABSENT`` for none).

    ``capabilities`` (a mapping of group → patterns, or a bare list meaning group ``declared``) becomes sorted
    unique pattern lists; everything else, ``layers`` included, keeps its order."""
    if environment is ABSENT:
        return ABSENT
    try:
        canonical_bytes(environment)
    except CanonicalError as exc:
        raise SchedulerError(
            "key_uncomputable",
            f"the scheduler environment is not plain JSON data ({exc.message}); pass a dict of strings/lists",
            cause=exc,
        ) from exc
    env = json.loads(canonical_bytes(environment))
    if isinstance(env, dict) and "capabilities" in env:
        caps = env["capabilities"]
        if isinstance(caps, list):
            caps = {"declared": caps}
        if isinstance(caps, dict) and all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in caps.values()
        ):
            env["capabilities"] = {g: sorted(set(v)) for g, v in caps.items()}
    return env


def environment_fingerprint(environment: Any) -> str:
    """``key({kind: "environment", value})``; an omitted environment has its own fingerprint."""
    if environment is ABSENT:
        return key({"kind": "environment", "omitted": True})
    return key({"kind": "environment", "value": environment})


# ------------------------------------------------------------------------------------------ read classes


def entry_id(entry: PathEntry) -> str:
    """The identity of a declared entry: canonical JSON of its plain form."""
    return canonical_bytes(entry_json(entry)).decode()


@dataclass(frozen=True)
class ReadPlan:
    """How one node's declared reads are observed: ``sources`` are pinned once per run, ``produced`` are
    measured at each dispatch."""

    sources: tuple[PathEntry, ...]
    produced: tuple[PathEntry, ...]


_NO_READS = ReadPlan((), ())


def classify_reads(plan: Plan, start: int = 0) -> dict[str, ReadPlan]:
    """Classify the read entries of ``plan.nodes[start:]`` (see the module invariants)."""
    nodes = plan.nodes[start:]
    if not any(n.effects.reads for n in nodes):
        return dict.fromkeys((n.id for n in nodes), _NO_READS)  # nothing to classify: skip the ancestry walk
    flags = produced_reads(plan.nodes, start)
    out: dict[str, ReadPlan] = {}
    for n, produced_by_ancestor in zip(plan.nodes[start:], flags, strict=True):
        sources: list[PathEntry] = []
        produced: list[PathEntry] = []
        for e, hit in zip(n.effects.reads, produced_by_ancestor, strict=True):
            (produced if hit else sources).append(e)
        out[n.id] = ReadPlan(tuple(sources), tuple(produced))
    return out


class Pins:
    """Pinned source observations: ``entry id → ((path, digest), ...)`` (``digest`` is ``"absent"`` for a
    declared exact path that did not exist)."""

    def __init__(self, files: Mapping[str, Sequence[tuple[str, str]]] | None = None) -> None:
        self._files: dict[str, tuple[tuple[str, str], ...]] = {
            k: tuple((str(p), str(d)) for p, d in v) for k, v in (files or {}).items()
        }

    def __contains__(self, entry: PathEntry) -> bool:
        return entry_id(entry) in self._files

    def __len__(self) -> int:
        return len(self._files)

    def files(self, entry: PathEntry) -> tuple[tuple[str, str], ...]:
        try:
            return self._files[entry_id(entry)]
        except KeyError:
            raise SchedulerError(
                "invalid_plan",
                f"source read {entry_json(entry)} was never pinned for this run; the input records are "
                "inconsistent with the plan — start a new run",
            ) from None

    def merged(self, more: Mapping[str, Sequence[tuple[str, str]]]) -> Pins:
        out = Pins()
        out._files = {**self._files, **{k: tuple(v) for k, v in more.items()}}
        return out

    @staticmethod
    def to_json(files: Mapping[str, Sequence[tuple[str, str]]]) -> list[dict[str, Any]]:
        return plan_records.pins_to_json(files)

    @staticmethod
    def from_json(doc: Any) -> dict[str, tuple[tuple[str, str], ...]]:
        return plan_records.pins_from_json(doc)


def unpinned_sources(reads: Mapping[str, ReadPlan], pins: Pins) -> list[PathEntry]:
    """Source entries of ``reads`` that ``pins`` does not hold yet, unique, in first-use order."""
    seen: dict[str, PathEntry] = {}
    for rp in reads.values():
        for e in rp.sources:
            k = entry_id(e)
            if k not in seen and e not in pins:
                seen[k] = e
    return list(seen.values())


# ------------------------------------------------------------------------------------------------- heads


@dataclass(frozen=True)
class InputHead:
    run_id: str
    plan_id: str
    base_digest: str
    digest: str
    generation: int
    environment_fingerprint: str
    pins: Pins


class InputStore:
    """Input heads and generations of one database (``*_in`` methods write on the caller's transaction)."""

    def __init__(self, db: Database, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.db = db
        self.clock = clock

    def load(self, run_id: str) -> InputHead | None:
        return self.db.read(lambda c: self.load_in(c, run_id))

    def load_in(self, conn: Connection, run_id: str) -> InputHead | None:
        row = plan_records.input_head_in(conn, run_id)
        if row is None:
            return None
        return InputHead(
            run_id=row.run_id,
            plan_id=row.plan_id,
            base_digest=row.base_digest,
            digest=row.digest,
            generation=row.generation,
            environment_fingerprint=row.environment_fingerprint,
            pins=Pins(row.files),
        )

    def create_in(
        self,
        conn: Connection,
        run_id: str,
        plan: Plan,
        environment: Any,
        pins: Mapping[str, Sequence[tuple[str, str]]],
    ) -> None:
        plan_records.create_head_in(
            conn,
            run_id,
            plan,
            environment=environment,
            environment_fingerprint=environment_fingerprint(environment),
            pins=pins,
            now_ms=self.clock.now_ms(),
        )

    def advance_in(
        self, conn: Connection, run_id: str, plan: Plan, pins: Mapping[str, Sequence[tuple[str, str]]]
    ) -> None:
        """The run observed a newer generation of its plan: move the head and record its new source pins."""
        plan_records.advance_head_in(conn, run_id, plan, pins, self.clock.now_ms())
