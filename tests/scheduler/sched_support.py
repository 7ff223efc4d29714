"""Real parts for scheduler tests: a SQLite file, a local artifact store, a workspace, an owned run, the real
cache dispatch seam. Nothing is mocked."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from smthrs_plugin.boundary.measure import Measurer
from smthrs_plugin.cache.dispatch import CacheDispatcher
from smthrs_plugin.engine.ownership.arbiter import Activated, Ownership
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.records.runs import OwnerId, RunStore
from smthrs_plugin.scheduler import InlineHost, PlanScheduler
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import Database, open_database
from smthrs_plugin.stores.schema import attempts, step_cache

#: Journal payload members that vary between otherwise identical runs, dropped at any depth together with every
#: ``*_at_ms`` timestamp (the lifecycle ``fact`` of engine records carries the run's timestamps).
_VOLATILE = {"owner", "nonce", "revision", "host_id", "pid", "lease"}


def scrub(value: Any) -> Any:
    """A journal payload without timestamps, revisions and owner identities (recursively)."""
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items() if k not in _VOLATILE and not k.endswith("_at_ms")}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


@dataclass
class Env:
    root: Path
    db: Database
    artifacts: ArtifactStore
    ws: Path
    owner: OwnerId
    dispatcher: CacheDispatcher
    journal: Journal
    claimed: set[str] = field(default_factory=set)

    def claim(self, run_id: str, flow: str = "flow", *, liveness: Any = None) -> None:
        RunStore(self.db, journal=self.journal).create(run_id, flow)
        decision = Ownership(self.db, owner=self.owner, journal=self.journal, liveness=liveness).claim(run_id)
        assert isinstance(decision, Activated), decision
        self.claimed.add(run_id)

    def scheduler(self, run_id: str = "r1", *, host: Any = None, **kw: Any) -> PlanScheduler:
        if run_id not in self.claimed:
            self.claim(run_id)
        kw.setdefault("measurer", self.dispatcher.measurer)
        return PlanScheduler(
            run_id,
            self.owner,
            db=self.db,
            dispatcher=self.dispatcher,
            workspace=self.ws,
            host=host if host is not None else InlineHost(),
            artifacts=self.artifacts,
            journal=self.journal,
            **kw,
        )

    def records(
        self, partition: str = "r1", *, types: tuple[str, ...] | None = None
    ) -> list[tuple[str, Any]]:
        """Journal records (type, payload) of a partition, without volatile members."""
        out: list[tuple[str, Any]] = []
        after = None
        while True:
            page = self.journal.read(partition, after_seq=after, limit=1000)
            if not page:
                return out
            for e in page:
                if types is None or e.type in types:
                    out.append((e.type, scrub(e.payload)))
            after = page[-1].seq

    def attempt_rows(self, run_id: str = "r1") -> list[dict[str, Any]]:
        a = attempts.c
        rows = self.db.read(
            lambda c: c.execute(
                sa.select(a.key, a.attempt, a.state, a.node_id, a.meta_json, a.result_json, a.error_json)
                .where(a.run_id == run_id)
                .order_by(a.key_digest, a.attempt)
            ).all()
        )
        return [
            {
                "key": r.key,
                "attempt": r.attempt,
                "state": r.state,
                "node_id": r.node_id,
                "meta": json.loads(r.meta_json) if r.meta_json else None,
                "result": json.loads(r.result_json) if r.result_json else None,
                "error": json.loads(r.error_json) if r.error_json else None,
            }
            for r in rows
        ]

    def cache_keys(self) -> list[str]:
        c = step_cache.c
        return sorted(self.db.read(lambda conn: conn.execute(sa.select(c.key)).scalars().all()))


def make_env(
    root: Path, *, ws: Path | None = None, owner: OwnerId | None = None, db_url: str | None = None
) -> Env:
    root.mkdir(parents=True, exist_ok=True)
    db = open_database(db_url or f"sqlite:///{(root / 'state.db').as_posix()}")
    artifacts = ArtifactStore(str(root / "artifacts"))
    workspace = ws or root / "ws"
    workspace.mkdir(parents=True, exist_ok=True)
    journal = Journal(db)
    dispatcher = CacheDispatcher(
        db, artifacts, workspace, journal=journal, measurer=Measurer(workspace, stat_cache=None)
    )
    return Env(
        root=root,
        db=db,
        artifacts=artifacts,
        ws=workspace,
        owner=owner or OwnerId("test-host", os.getpid(), uuid.uuid4().hex),
        dispatcher=dispatcher,
        journal=journal,
    )
