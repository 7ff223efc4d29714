"""Shared-tier publication after the local commit: what one publication does, the spool that outlives a crash, and
the background publisher (a bounded queue and one worker thread per dispatcher) that takes it off a node's path.

Invariants
- **After the local commit only.** A publication's entry is already this workspace's local row when it is queued:
  a crash loses the publication, never the entry. Its spool marker is written BEFORE that commit, so a crash
  anywhere after it leaves a marker, and the next dispatcher with the same spool on this host (the next run's
  process) republishes every marker whose process is gone (:meth:`Spool.orphans`); a marker whose local row
  was replaced, invalidated or never committed is dropped (nothing of that build is left to publish).
- **The same outcomes as inline.** :func:`publish_now` is the one interpretation of a publication's outcome (the
  same signed document, ``replaced``/``kept-first-writer``/``unpublished`` records, a warning, a rival's
  ``_invalidate``), whether it runs in the dispatch or on the worker.
- **Bounded, never dropped.** At most :data:`CAPACITY` publications and :data:`BUDGET_BYTES` of inline outputs
  wait; past either, :meth:`BackgroundPublisher.offer` refuses and the producer publishes inline (back-pressure).
- **FIFO, one worker, per-key order.** :meth:`BackgroundPublisher.drain` returns once every publication offered
  before it has run, and re-raises the first unexpected error one met (a database failure journaling its outcome).
  A dispatch of a key with a queued publication waits for it first (:meth:`BackgroundPublisher.wait_for_key`):
  a same-key build (a refresh, an expired entry) never publishes before an older one, as when publishing inline.
- **The worker never blocks exit.** It is a daemon thread, and every live publisher is drained at interpreter exit
  (before daemon threads stop); a forked child never uses its parent's worker (it publishes inline).
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import re
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..stores.artifacts import ArtifactStore
from .entry import CacheEntry
from .local import LocalHit, LocalLookup
from .shared import AlreadyPublished, PublicationFailed, Published, Replaced, SharedTier

__all__ = [
    "Addressed",
    "BackgroundPublisher",
    "BUDGET_BYTES",
    "CAPACITY",
    "Marker",
    "Publication",
    "QUEUED",
    "Spool",
    "drain_all",
    "publish_now",
    "recover",
]

log = logging.getLogger(__name__)
#: A publication's own warnings keep the dispatch seam's logger, inline or not: a filter on it still sees them.
_seam_log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".dispatch")

#: ``published["shared"]`` of a publication handed to the background publisher (its final status comes later).
QUEUED = "queued"
#: Publications waiting at most, per publisher; one more is published inline by its producer.
CAPACITY = 256
#: Inline output bytes waiting at most, per publisher (a waiting entry holds its inline outputs in memory).
BUDGET_BYTES = 64 * 1024 * 1024


class Addressed(Protocol):
    """Where a publication's records go: the run, node and key of the dispatch, and the owner fencing them."""

    @property
    def run_id(self) -> str: ...

    @property
    def node_id(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def owner(self) -> Any: ...


@dataclass(frozen=True)
class Marker:
    """What a spool marker names: the build whose entry must reach the shared tier."""

    key: str
    run_id: str
    node_id: str
    created_at_ms: Any
    condemned: Mapping[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "run_id": self.run_id,
            "node_id": self.node_id,
            "created_at_ms": self.created_at_ms,
            "condemned": dict(self.condemned),
        }

    def matches(self, entry: CacheEntry) -> bool:
        """Whether ``entry`` (the local row now) is the one this marker's build committed."""
        prov = entry.provenance
        return (
            entry.key == self.key
            and prov.get("run_id") == self.run_id
            and prov.get("node_id") == self.node_id
            and prov.get("created_at_ms") == self.created_at_ms
        )


@dataclass
class Publication:
    """One entry to publish, addressed like its dispatch. ``owner``: the fence of its records (its dispatch's owner;
    None for a dispatch outside an owned run, and for a marker republished by the next runtime after a crash: the
    process that owned the run is gone, and the records say what became of its build)."""

    run_id: str
    node_id: str
    key: str
    entry: CacheEntry
    condemned: Mapping[str, str]
    owner: Any = None
    marker: Path | None = None
    future: Future[str] = field(default_factory=Future)


def publish_now(
    shared: SharedTier,
    source: ArtifactStore,
    pub: Publication,
    journal: Callable[[Addressed, dict[str, Any]], None],
    invalidate: Callable[[Addressed, str, str], None],
) -> str:
    """Publish ``pub.entry`` to ``shared`` (blobs from ``source``) and say how it went, as ``published["shared"]``
    does: ``published`` | ``existing`` | ``unpublished:<stage>``. A failure is journaled and warned about, never
    raised; only ``journal``/``invalidate`` (the database) raise."""
    entry = pub.entry
    try:
        outcome = shared.publish(entry, source, condemned=pub.condemned)
    except PublicationFailed as failed:
        _seam_log.warning(
            "could not publish %s to the shared tier %s (stage %s): %s; the run continues, the entry stays local",
            entry.name,
            shared.store.url,
            failed.stage,
            failed.cause,
        )
        journal(pub, {"action": "unpublished", "stage": failed.stage, "reason": str(failed.cause)})
        return f"unpublished:{failed.stage}"
    if isinstance(outcome, Published):
        return "published"
    if isinstance(outcome, Replaced):
        # Our own name held a document that was not servable (planted, damaged, revoked, blobs missing):
        # quarantine never blocks — the honest entry took its place.
        journal(pub, {"action": "replaced", "tier": "shared", "reason": outcome.reason})
        return "published"
    assert isinstance(outcome, AlreadyPublished)
    winner = outcome.winner
    if winner.result == entry.result or entry.nondeterministic:
        if winner.result != entry.result:
            journal(pub, {"action": "kept-first-writer", "tier": "shared"})
        return "existing"
    # A rival host with our key published a different result between our pre-check and now: our local commit
    # stands (it cannot be undone), but this host stops serving it and follows the shared winner from now on.
    invalidate(pub, entry.name, "result-mismatch")
    journal(
        pub,
        {
            "action": "unpublished",
            "stage": "result_mismatch",
            "reason": "another host published a different result",
        },
    )
    return "unpublished:result_mismatch"


# -- the spool ---------------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


class Spool:
    """Markers of publications not done yet: one small file each under ``root/<host>/``, named ``<pid>-<n>.json``.

    A marker is written without ``fsync``: it only has to outlive its process (a kill, a crash of the
    interpreter), which the page cache guarantees; a machine crash may lose it with the publication, never the
    local row (SQLite commits it durably). Any failure to write one is reported by :meth:`write` answering None:
    the caller then publishes inline, before the dispatch returns."""

    def __init__(self, root: str | Path, host_id: str) -> None:
        self.dir = Path(root) / (re.sub(r"[^A-Za-z0-9._-]", "_", host_id) or "host")
        self._seq = itertools.count()
        self._warned = False

    def write(self, marker: Marker) -> Path | None:
        path = self.dir / f"{os.getpid()}-{next(self._seq)}.json"
        data = json.dumps(marker.to_json(), sort_keys=True).encode("utf-8")
        try:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            except FileNotFoundError:
                self.dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot keep shared-tier publications in the spool %s (%s): they are published before each"
                    " node returns instead",
                    self.dir,
                    exc,
                )
            self.remove(path)
            return None
        return path

    def remove(self, path: Path | None) -> None:
        if path is None:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # left behind: the next recovery finds its row already published ("existing")
            log.warning("could not remove the publication marker %s: %s", path, exc)

    def orphans(self) -> list[tuple[Path, Marker | None]]:
        """Markers of this host's processes that are gone, each claimed for this process first (renamed: two
        processes starting at once never both take one); an unreadable marker comes with None."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("cannot list the publication spool %s: %s", self.dir, exc)
            return []
        me = os.getpid()
        found: list[tuple[Path, Marker | None]] = []
        for name in sorted(names):
            head = name.split("-", 1)[0]
            if not name.endswith(".json") or not head.isdigit():
                continue
            pid = int(head)
            if pid == me or _alive(pid):
                continue
            claimed = self.dir / f"{me}-{next(self._seq)}.json"
            try:
                os.rename(self.dir / name, claimed)
                found.append((claimed, _read_marker(claimed)))
            except FileNotFoundError:
                continue  # another process claimed it first
            except OSError as exc:
                log.warning("cannot claim the publication marker %s: %s", self.dir / name, exc)
        return found


def _read_marker(path: Path) -> Marker | None:
    try:
        doc = json.loads(path.read_bytes())
        condemned = doc.get("condemned") or {}
        if not isinstance(condemned, dict):
            return None
        return Marker(
            str(doc["key"]),
            str(doc["run_id"]),
            str(doc["node_id"]),
            doc.get("created_at_ms"),
            {str(k): str(v) for k, v in condemned.items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("publication marker %s is unreadable (%s): it is dropped", path, exc)
        return None


def recover(
    spool: Spool,
    publisher: BackgroundPublisher,
    lookup: Callable[[str], LocalLookup],
    publish: Callable[[Publication], str],
) -> int:
    """Queue on ``publisher`` every publication a process of this host that is gone left in ``spool``: each whose
    local row (``lookup(key)``, a ``LocalHit``) is still that build's entry; the others are dropped (the row was
    replaced, invalidated or never committed). A full queue publishes inline (``publish``). Returns how many."""
    queued = 0
    for path, marker in spool.orphans():
        found = lookup(marker.key) if marker is not None else None
        if marker is None or not isinstance(found, LocalHit) or not marker.matches(found.entry):
            spool.remove(path)
            continue
        pub = Publication(
            marker.run_id, marker.node_id, marker.key, found.entry, marker.condemned, marker=path
        )
        if not publisher.offer(pub):
            publish(pub)
            spool.remove(path)
        queued += 1
    if queued:
        log.info("republishing %d shared-tier entries a stopped process left unpublished", queued)
    return queued


# -- the background publisher ------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[BackgroundPublisher] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


class BackgroundPublisher:
    """Runs ``run(publication)`` on one worker thread, in offer order (see the module invariants). ``run``
    answers the final ``published["shared"]`` status; ``spool`` (optional) loses each marker once its
    publication ran."""

    def __init__(
        self,
        run: Callable[[Publication], str],
        *,
        spool: Spool | None = None,
        name: str = "smthrs-publisher",
        capacity: int = CAPACITY,
        budget_bytes: int = BUDGET_BYTES,
    ) -> None:
        self._run = run
        self.spool = spool
        self.name = name
        self.capacity = capacity
        self.budget_bytes = budget_bytes
        self._cond = threading.Condition()
        self._queue: deque[Publication] = deque()
        self._bytes = 0
        self._offered = 0
        self._done = 0
        self._keys: dict[str, int] = {}
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False

    def offer(self, pub: Publication) -> bool:
        """Queue ``pub``; False when the queue is full (or closed, or this is a forked child): publish it inline."""
        size = pub.entry.evidence.inline_bytes
        with self._cond:
            if (
                self._closed
                or self._pid != os.getpid()
                or len(self._queue) >= self.capacity
                or self._bytes + size > self.budget_bytes
            ):
                return False
            self._queue.append(pub)
            self._bytes += size
            self._offered += 1
            self._keys[pub.key] = self._keys.get(pub.key, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
                with _LIVE_LOCK:
                    _LIVE.add(self)
            self._cond.notify_all()
        return True

    @property
    def pending(self) -> int:
        """Publications offered and not finished yet."""
        with self._cond:
            return self._offered - self._done

    def wait_for_key(self, key: str) -> None:
        """Return once no publication of ``key`` is queued or running (at once when none is)."""
        if not self._keys:  # the common case, read without the lock: a stale answer only delays a wait
            return
        with self._cond:
            while self._keys.get(key) and self._pid == os.getpid():
                self._cond.wait()

    def drain(self) -> None:
        """Return once every publication offered before this call has run; raise the first unexpected error any
        publication met since the previous drain (its outcome's record could not be written)."""
        with self._cond:
            target = self._offered
            while self._done < target and self._pid == os.getpid():
                self._cond.wait()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Drain, then stop the worker (a later offer is refused: its producer publishes inline)."""
        try:
            self.drain()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
                thread = self._thread
            if thread is not None and thread is not threading.current_thread() and self._pid == os.getpid():
                thread.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                pub = self._queue.popleft()
            try:
                status = self._run(pub)
            except BaseException as exc:  # kept for drain(), which raises it; the marker stays for a retry
                log.error(
                    "the background publication of %s (run %s, node %s) failed: %r",
                    pub.entry.name,
                    pub.run_id,
                    pub.node_id,
                    exc,
                )
                with self._cond:
                    self._errors.append(exc)
                pub.future.set_exception(exc)
            else:
                if self.spool is not None:
                    self.spool.remove(pub.marker)
                pub.future.set_result(status)
            finally:
                with self._cond:
                    self._done += 1
                    self._bytes -= pub.entry.evidence.inline_bytes
                    left = self._keys.get(pub.key, 1) - 1
                    if left:
                        self._keys[pub.key] = left
                    else:
                        self._keys.pop(pub.key, None)
                    self._cond.notify_all()


@atexit.register
def drain_all() -> None:
    """Drain every live publisher of this process (at interpreter exit, before daemon threads stop)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for publisher in live:
        try:
            publisher.drain()
        except Exception:  # the process is exiting: report; the marker is republished by the next run
            log.exception("a shared-tier publication failed at exit")
