"""``watch``: committed journal entries projected as :class:`ControlEvent` values, as a snapshot or a live stream.

- A projection of ``journal_events`` by ``(partition, seq)``, not a bus: nothing uncommitted is delivered, and a
  consumer that reconnects with its last cursor receives what it missed.
- Cursors resume one run: ``after_cursor``/``after_sequence`` without ``run_id`` is refused (``InvalidInput``), as is a
  cursor of another partition (``invalid_cursor``) or of another database (``source_changed``).
- Omitting ``follow`` (or ``follow=True``) opens the live stream, which never ends by itself (close it);
  ``follow=False`` is the finite snapshot. (``smthrs watch`` defaults to the snapshot.)
- Snapshot, then tail, without gaps or duplicates; order is guaranteed within a partition only.
- Other processes' commits are delivered too: the table is polled every ``poll_interval_s``.

The hand-off and the bounds on work: ARCHITECTURE.md ("observe").
"""

from __future__ import annotations

import heapq
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ControlError, InvalidInput
from ..records.journal import Journal, JournalEvent, Subscription, read_page
from ..records.journal import high_water as _high_water
from ..records.journal import partition_page as _partition_page
from ..stores.database import Database
from ._cursor import check_text, decode_cursor, encode_cursor

__all__ = [
    "ControlEvent",
    "WatchStats",
    "WatchStream",
    "watch",
    "require_watchable",
    "event_cursor",
    "PARTITIONS_PER_BATCH",
    "PAGE_SIZE",
]

#: Partitions an unscoped snapshot reads at a time (the reference's eight).
PARTITIONS_PER_BATCH = 8
#: Entries per read of one partition.
PAGE_SIZE = 500
_DISCOVERY_PAGE = 256
_PLAN_PREFIX = "plan:"


@dataclass(frozen=True)
class ControlEvent:
    """One committed journal entry: its per-partition ``sequence``, ``kind`` (the record type), the run it belongs
    to (None for a plan partition), when it was recorded (epoch ms), its payload, and the opaque ``cursor`` to
    resume a scoped watch right after it."""

    sequence: int
    kind: str
    run_id: str | None
    occurred_at: int
    payload: Any
    cursor: str
    partition: str

    def to_json(self) -> dict[str, Any]:
        return {
            "sequence": self.sequence,
            "kind": self.kind,
            "run_id": self.run_id,
            "occurred_at": self.occurred_at,
            "payload": self.payload,
            "cursor": self.cursor,
            "partition": self.partition,
        }


@dataclass(frozen=True)
class WatchStats:
    """How many events a stream delivered from its snapshot (``<= mark``) and from its live tail (``> mark``)."""

    snapshot: int
    tail: int


def event_cursor(source: str, partition: str, sequence: int) -> str:
    """The resume cursor of entry ``sequence`` of ``partition`` in database ``source``."""
    return encode_cursor("watch", source, {"p": partition, "s": sequence})


def watch(
    db: Database,
    run_id: str | None = None,
    *,
    follow: bool = True,
    after_cursor: str | None = None,
    after_sequence: int | None = None,
    poll_interval_s: float = 0.25,
    journal: Journal | None = None,
) -> WatchStream:
    """Stream the journal of ``run_id`` (every partition when None) as :class:`ControlEvent` values.

    Omitting ``follow`` (or ``follow=True``) opens the live stream: the snapshot, then the live tail, until
    :meth:`WatchStream.close` — it never ends by itself, so iterate it with :meth:`WatchStream.next_within` or
    from a thread that can close it. ``follow=False`` ends after the snapshot (a test, a one-shot reader). Resume a
    run's watch with the last event's ``cursor`` (``after_cursor``) or its ``sequence`` (``after_sequence``).
    Every refusal happens here, before anything is read or subscribed."""
    for name, value in (("after_cursor", after_cursor), ("after_sequence", after_sequence)):
        if value is not None and run_id is None:
            raise InvalidInput(
                "invalid_input", f"{name}: a watch cursor resumes one run, so it requires run_id", bound=name
            )
    if after_cursor is not None and after_sequence is not None:
        raise InvalidInput(
            "invalid_input", "give after_cursor or after_sequence, not both", bound="after_sequence"
        )
    if run_id is not None:
        check_text("run_id", run_id, error="invalid_input")
    if after_sequence is not None and (
        not isinstance(after_sequence, int) or isinstance(after_sequence, bool) or after_sequence < 0
    ):
        raise InvalidInput(
            "invalid_input",
            f"after_sequence must be a non-negative int, got {after_sequence!r}",
            bound="after_sequence",
        )
    if (
        not isinstance(poll_interval_s, (int, float))
        or isinstance(poll_interval_s, bool)
        or not poll_interval_s > 0
    ):
        raise ControlError(
            "invalid_options", "poll_interval_s must be a positive number", option="poll_interval_s"
        )
    source = db.source_id
    floor = -1 if after_sequence is None else after_sequence
    if after_cursor is not None:
        assert run_id is not None
        body = decode_cursor(after_cursor, kind="watch", source=source, what="after_cursor")
        seq = body.get("s")
        if body.get("p") != run_id:
            raise ControlError(
                "invalid_cursor",
                f"after_cursor resumes the journal of {body.get('p')!r}, not of {run_id!r}; pass the cursor of an "
                "event of this run",
            )
        if type(seq) is not int or seq < 0:
            raise ControlError(
                "invalid_cursor", "after_cursor has an unknown layout; start again without one"
            )
        floor = seq
    return WatchStream(db, source, run_id, floor, follow, float(poll_interval_s), journal or Journal(db))


def require_watchable(db: Database, run_id: str) -> None:
    """Refuse (``run_not_found``) a run this database has neither a row nor a journal for: an empty watch would read
    as success to a script that mistyped the run id. A deleted run whose journal is kept, or a journal
    partition of its own (``plan:<id>``), is still watchable."""
    from .snapshot import Missing, read

    if not isinstance(read(db, [run_id]).items[0], Missing):
        return
    with watch(db, run_id, follow=False) as probe:
        for _ in probe:
            return
    raise ControlError(
        "run_not_found",
        f"run {run_id!r} does not exist and has no journal here; check the run id (`smthrs runs`, or the `runs` "
        "method of smthrs serve, lists them) and the database",
        run_id=run_id,
    )


class _Idle:
    """Yielded by the internal generator when a poll found nothing (lets ``next_within`` honour its timeout)."""


_IDLE = _Idle()


class WatchStream:
    """An iterator of :class:`ControlEvent` (see :func:`watch`). Close it (or use ``with``) to disconnect; closing
    from another thread wakes a blocked reader, which then stops."""

    def __init__(
        self,
        db: Database,
        source: str,
        partition: str | None,
        floor: int,
        follow: bool,
        poll_interval_s: float,
        journal: Journal,
    ) -> None:
        self.db, self.source, self.follow = db, source, follow
        self._partition = partition
        self._poll = poll_interval_s
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._hints: set[str] = set()
        #: partition → last delivered sequence, for partitions whose snapshot is done (the "live" ones).
        self._floors: dict[str, int] = {}
        self._start_floor = floor
        self._scan_position: str | None = None
        self._scan_done = partition is not None
        self._sub: Subscription | None = None
        self._from_snapshot = 0
        self._from_tail = 0
        if follow:
            # Subscribe BEFORE pinning any mark: a commit after the pin is then either seen by the pin's read or
            # hinted to the tail (and the poll catches it regardless).
            self._sub = journal.subscribe(_weak_hint(self), partition=partition)
        self._gen = self._events()

    # -- consumer API ---------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[ControlEvent]:
        return self

    def __next__(self) -> ControlEvent:
        for item in self._gen:
            if isinstance(item, ControlEvent):
                return item
        raise StopIteration

    def next_within(self, timeout_s: float) -> ControlEvent | None:
        """The next event, or None when none arrived within about ``timeout_s`` (poll granularity) or the stream
        ended."""
        deadline = time.monotonic() + timeout_s
        for item in self._gen:
            if isinstance(item, ControlEvent):
                return item
            if time.monotonic() >= deadline:
                return None
        return None

    def close(self) -> None:
        """Disconnect: stop the subscription and end the iteration (idempotent, thread-safe)."""
        self._closed.set()
        self._wake.set()
        sub, self._sub = self._sub, None
        if sub is not None:
            sub.close()

    @property
    def stats(self) -> WatchStats:
        """Events delivered so far, by the path that delivered them."""
        return WatchStats(self._from_snapshot, self._from_tail)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __del__(self) -> None:
        # A stream dropped without close() must not leave its subscription in the process-wide hub.
        sub = getattr(self, "_sub", None)
        if sub is not None:
            sub.close()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the stream ---------------------------------------------------------------------------------------------
    def _on_commit(self, event: JournalEvent) -> None:
        with self._lock:
            self._hints.add(event.partition)
        self._wake.set()

    def _events(self) -> Iterator[ControlEvent | _Idle]:
        if self._partition is not None:
            p = self._partition
            mark = _high_water(self.db, p)
            floor = self._start_floor
            if mark is not None and mark > floor:
                for ev in self._range(p, floor, mark):
                    if self._closed.is_set():
                        return
                    self._from_snapshot += 1
                    yield ev
                floor = mark
            self._floors[p] = floor
        else:
            while True:
                batch = _partition_page(self.db, self._scan_position, PARTITIONS_PER_BATCH)
                if not batch:
                    break
                merged = heapq.merge(
                    *(self._range(p, -1, mark) for p, mark in batch),
                    key=lambda e: (e.occurred_at, e.partition, e.sequence),
                )
                for ev in merged:
                    if self._closed.is_set():
                        return
                    self._from_snapshot += 1
                    yield ev
                for p, mark in batch:
                    self._floors[p] = mark
                self._scan_position = batch[-1][0]
                if self.follow:
                    # The reserved slot: serve the live tail between snapshot batches.
                    self._hint(*(p for p, _ in batch))
                    yield from self._drain()
            self._scan_done = True
        if not self.follow:
            return
        if self._partition is not None:
            self._hint(self._partition)
        while not self._closed.is_set():
            delivered = False
            for ev in self._drain():
                delivered = True
                yield ev
            if self._closed.is_set():
                return
            if self._wake.wait(self._poll):
                self._wake.clear()
            else:
                self._discover()
            if not delivered:
                yield _IDLE

    def _hint(self, *partitions: str) -> None:
        with self._lock:
            self._hints.update(partitions)

    def _live_floor(self, p: str) -> int | None:
        """The last delivered sequence of ``p`` if the tail may read it now, else None (its snapshot is pending)."""
        floor = self._floors.get(p)
        if floor is not None:
            return floor
        if self._partition is not None:
            return None
        # Unscoped: a partition the name-ordered scan already passed without seeing it was created afterwards,
        # so nothing of it was delivered; one the scan has not reached yet will be read by the snapshot.
        if self._scan_done or (self._scan_position is not None and p <= self._scan_position):
            return -1
        return None

    def _drain(self) -> Iterator[ControlEvent]:
        self._wake.clear()
        with self._lock:
            hints, self._hints = self._hints, set()
        for p in sorted(hints):
            floor = self._live_floor(p)
            if floor is None:
                continue
            for ev in self._range(p, floor, None):
                if self._closed.is_set():
                    return
                self._from_tail += 1
                yield ev

    def _discover(self) -> None:
        """A poll: hint every live partition whose durable high-water mark is past what was delivered."""
        if self._partition is not None:
            self._hint(self._partition)
            return
        position: str | None = None
        while not self._closed.is_set():
            page = _partition_page(self.db, position, _DISCOVERY_PAGE)
            if not page:
                return
            for p, mark in page:
                floor = self._live_floor(p)
                if floor is not None and mark > floor:
                    self._hint(p)
            position = page[-1][0]

    def _range(self, partition: str, after: int, upto: int | None) -> Iterator[ControlEvent]:
        """Entries of ``partition`` with ``after < seq <= upto`` (no upper bound when None), in pages; records
        each as delivered just before yielding it."""
        while True:
            rows = read_page(self.db, partition, after, upto, PAGE_SIZE)
            for row in rows:
                ev = self._event(row)
                after = ev.sequence
                self._floors[partition] = after
                yield ev
            if len(rows) < PAGE_SIZE:
                return

    def _event(self, entry: JournalEvent) -> ControlEvent:
        partition, seq = entry.partition, entry.seq
        return ControlEvent(
            sequence=seq,
            kind=entry.type,
            run_id=None if partition.startswith(_PLAN_PREFIX) else partition,
            occurred_at=entry.created_at_ms,
            payload=entry.payload,
            cursor=event_cursor(self.source, partition, seq),
            partition=partition,
        )


def _weak_hint(stream: WatchStream) -> Callable[[JournalEvent], None]:
    # The hub must not keep an abandoned stream alive (its __del__ then closes the subscription).
    ref = weakref.ref(stream)

    def hint(event: JournalEvent) -> None:
        s = ref()
        if s is not None:
            s._on_commit(event)

    return hint
