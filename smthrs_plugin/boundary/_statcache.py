"""The stat cache: ``path → (size, mtime_ns, inode, ctime_ns) → digest``, with git's racy-clean rule.

Invariant: a pure cache. An entry is trusted only when the current stat is identical AND the entry is not
*racily clean* — a file whose mtime or ctime lies within ``racy_window_ns`` of the moment its entry was recorded
may have been rewritten within the same timestamp tick after it was hashed, so it is hashed again (git,
Documentation/technical/racy-git.txt). Persisted as JSON (atomic temp + rename) when a trustworthy entry was
recorded (a racily clean one could never be trusted after a reload either); a corrupt file is dropped
with a warning and rebuilt, never trusted. Concurrent processes may overwrite each other's saves: that only
costs re-hashing, never a wrong digest.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

__all__ = ["StatCache", "identity", "DEFAULT_RACY_WINDOW_NS", "STAT_CACHE_FILE"]

log = logging.getLogger("smthrs_plugin.boundary.measure")

#: 2 s covers coarse filesystem clocks (FAT keeps 2 s mtimes) and modest NFS clock skew.
DEFAULT_RACY_WINDOW_NS = 2_000_000_000
STAT_CACHE_FILE = ".smthrs/statcache.json"
_FORMAT = "smthrs-statcache/1"


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """The stat fields a cache entry is keyed on: (size, mtime_ns, inode, ctime_ns)."""
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


class StatCache:
    """``path → (size, mtime_ns, inode, ctime_ns, digest, recorded_ns)`` with git's racy-clean rule.

    ``file=None`` keeps it in memory only. Thread-safe. Concurrent processes may overwrite each other's saves
    (last writer wins): that only costs re-hashing, never a wrong digest.
    """

    def __init__(self, file: Path | None, *, racy_window_ns: int = DEFAULT_RACY_WINDOW_NS) -> None:
        self.file = file
        self.racy_window_ns = racy_window_ns
        self._entries: dict[str, tuple[int, int, int, int, str, int]] | None = None
        self._dirty = False
        self._lock = threading.Lock()

    def _load(self) -> dict[str, tuple[int, int, int, int, str, int]]:
        if self._entries is not None:
            return self._entries
        entries: dict[str, tuple[int, int, int, int, str, int]] = {}
        if self.file is not None:
            try:
                raw = self.file.read_bytes()
            except FileNotFoundError:
                raw = None
            if raw is not None:
                try:
                    doc = json.loads(raw)
                    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                        raise ValueError(
                            f"unknown format {doc.get('format') if isinstance(doc, dict) else doc!r}"
                        )
                    for k, v in doc["entries"].items():
                        size, mtime, ino, ctime, digest, rec = v
                        if not (
                            type(size) is int
                            and type(mtime) is int
                            and type(ino) is int
                            and type(ctime) is int
                            and type(rec) is int
                            and type(digest) is str
                            and len(digest) == 64
                        ):
                            raise ValueError(f"malformed entry for {k!r}")
                        entries[k] = (size, mtime, ino, ctime, digest, rec)
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    # A pure cache: dropping it costs one re-hash of everything, trusting it could cost a wrong key.
                    log.warning("stat cache %s is corrupt (%s); rebuilding it", self.file, exc)
                    entries = {}
                    self._dirty = True
        self._entries = entries
        return entries

    def lookup(self, path: str, st: os.stat_result) -> str | None:
        """The cached digest when ``st`` is identical and the entry is not racily clean, else ``None``."""
        entries = self._entries
        if entries is None:
            with self._lock:
                entries = self._load()
        e = entries.get(path)  # a dict read needs no lock; writers replace whole tuples
        if (
            e is None
            or e[0] != st.st_size
            or e[1] != st.st_mtime_ns
            or e[2] != st.st_ino
            or e[3] != st.st_ctime_ns
        ):
            return None
        # racily clean: recorded too soon after the last change to rule out a same-tick rewrite
        if self._racy(e):
            return None
        return e[4]

    def record(self, path: str, st: os.stat_result, digest: str, recorded_ns: int) -> None:
        """Remember ``digest`` for ``st``; ``recorded_ns`` is the clock read *before* the file was opened."""
        entry = (*identity(st), digest, recorded_ns)
        with self._lock:
            self._load()[path] = entry
            if not self._racy(entry):
                self._dirty = True
            # A racily clean entry is never trusted, now or after a reload (the rule reads only the entry's own
            # fields), so persisting it would rewrite the file for nothing: a file measured again and again
            # within the window of its last change (a re-run right after a build) costs no save per measurement.

    def _racy(self, e: tuple[int, int, int, int, str, int]) -> bool:
        return max(e[1], e[3]) + self.racy_window_ns > e[5]

    def __len__(self) -> int:
        with self._lock:
            return len(self._load())

    def save(self) -> None:
        """Persist atomically (temp file + rename) when something changed."""
        if self.file is None:
            return
        with self._lock:
            if not self._dirty:
                return
            doc = {"format": _FORMAT, "entries": {k: list(v) for k, v in sorted(self._load().items())}}
            self._dirty = False
        data = json.dumps(doc, separators=(",", ":")).encode()
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_name(f"{self.file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.file)
