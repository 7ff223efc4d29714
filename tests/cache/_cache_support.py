"""Helpers of the cache suites: a "machine" (workspace + database + local artifact store + dispatcher) sharing one
shared-tier store with other machines, step bodies, a counting metrics port."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import smthrs_plugin as sp
from smthrs_plugin._clock import SYSTEM_CLOCK, Clock
from smthrs_plugin._metrics import NullMetrics
from smthrs_plugin.boundary import InlineLimits, Measurer
from smthrs_plugin.cache import CacheDispatcher, DispatchRequest, DispatchResult
from smthrs_plugin.cache.bounds import SizeCaps
from smthrs_plugin.cache.dispatch import PROVENANCE_EVENT
from smthrs_plugin.cache.requests import node_request
from smthrs_plugin.cache.shared import entry_name
from smthrs_plugin.cache.signing import Trust, workspace_key
from smthrs_plugin.canonical import key_digest
from smthrs_plugin.plan.model import NodeDraft
from smthrs_plugin.records.journal import Journal
from smthrs_plugin.stores.artifacts import ArtifactStore
from smthrs_plugin.stores.database import Database, open_database

#: Small inline limits so even tiny outputs are spilled to the artifact store (blob paths are exercised).
SPILL_ALL = InlineLimits(max_inline_bytes=0, max_total_inline_bytes=0)


class CountingMetrics(NullMetrics):
    """A MetricsPort that counts cache decisions and boundary settlements (and still checks tags)."""

    __slots__ = ("decisions", "settlements", "_lock")

    def __init__(self) -> None:
        self.decisions: Counter[str] = Counter()
        self.settlements: Counter[str] = Counter()
        self._lock = threading.Lock()

    def cache_decision(self, tag: Any) -> None:
        super().cache_decision(tag)
        with self._lock:
            self.decisions[tag] += 1

    def boundary_settled(self, tag: Any) -> None:
        super().boundary_settled(tag)
        with self._lock:
            self.settlements[tag] += 1


@dataclass
class Machine:
    """One host: its own workspace, database and local blobs; the shared tier is common to every machine."""

    root: Path
    ws: Path
    db: Database
    artifacts: ArtifactStore
    shared: ArtifactStore
    measurer: Measurer
    dispatcher: CacheDispatcher
    journal: Journal
    metrics: CountingMetrics
    calls: Counter[str] = field(default_factory=Counter)

    def request(self, draft: NodeDraft, run_id: str = "r1", **kw: Any) -> DispatchRequest:
        return node_request(draft, run_id=run_id, workspace=self.ws, measurer=self.measurer, **kw)

    def dispatch(self, draft: NodeDraft, body: Any, run_id: str = "r1", **kw: Any) -> DispatchResult:
        def counted(root: Path) -> Any:
            self.calls[draft.id] += 1
            return body(root)

        return self.dispatcher.dispatch(self.request(draft, run_id, **kw), counted)

    def entry_name(self, key: str) -> str:
        """The shared entry name this machine publishes ``key`` under (its signing key's)."""
        signer = self.dispatcher.trust.signer
        assert signer is not None
        return entry_name(key_digest(key), signer.key_id)

    def provenance(self, run_id: str = "r1") -> list[dict[str, Any]]:
        return [e.payload for e in self.journal.read(run_id, limit=1000) if e.type == PROVENANCE_EVENT]

    def write(self, rel: str, data: bytes | str) -> Path:
        p = self.ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return p


def make_machine(
    base: Path,
    name: str,
    shared: ArtifactStore,
    *,
    db_url: str | None = None,
    files: dict[str, str] | None = None,
    limits: InlineLimits = SPILL_ALL,
    one_store: bool = False,
    trust: Trust | None = None,
    clock: Clock = SYSTEM_CLOCK,
    size_caps: SizeCaps | None = None,
    revocation_refresh_s: float = 60.0,
    background: bool = False,
) -> Machine:
    """A machine under ``base/name``. ``trust`` defaults to :func:`team_trust` of ``base``: every machine of one
    test signs with, and trusts, one team key (as a CI fleet configured with SMTHRS_CACHE_SIGNING_KEY would).
    ``background``: its dispatcher publishes to the shared tier in the background (spool ``base/name/spool``), as a
    runtime's does."""
    root = base / name
    ws = root / "ws"
    ws.mkdir(parents=True)
    for rel, text in (files or {}).items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    db = open_database(db_url or f"sqlite:///{(root / 'state.db').as_posix()}")
    artifacts = shared if one_store else ArtifactStore((root / "blobs").as_uri())
    measurer = Measurer(ws)
    journal = Journal(db)
    metrics = CountingMetrics()
    dispatcher = CacheDispatcher(
        db,
        artifacts,
        ws,
        shared=shared,
        journal=journal,
        metrics=metrics,
        measurer=measurer,
        limits=limits,
        host_id=name,
        trust=trust if trust is not None else team_trust(base),
        clock=clock,
        size_caps=size_caps or SizeCaps(),
        revocation_refresh_s=revocation_refresh_s,
        background_publish=background,
        spool=root / "spool" if background else None,
    )
    return Machine(root, ws, db, artifacts, shared, measurer, dispatcher, journal, metrics)


def team_trust(base: Path) -> Trust:
    """One signing key shared by every machine (and every spawned process) under ``base``."""
    key = workspace_key(base / "team")
    return Trust(key, (), "configured")


# -- step bodies (module level: importable by spawned processes) -------------------------------------------------


def upper(root: Path) -> dict[str, Any]:
    """reads in.txt, writes out.txt = upper(in.txt); value: its length."""
    text = (root / "in.txt").read_text()
    (root / "out.txt").write_text(text.upper())
    return {"length": len(text)}


def upper_node(**kw: Any) -> NodeDraft:
    return sp.plan.node("upper", body={"cmd": "upper"}, reads=["in.txt"], writes=["out.txt"], **kw)


def tamper(store: ArtifactStore, digest: str) -> None:
    """Flip one byte of a stored blob behind the store's back."""
    path = store.blob_path(digest)
    data = bytearray(store.fs.cat_file(path))
    data[0] ^= 0x01
    store.fs.pipe_file(path, bytes(data))
