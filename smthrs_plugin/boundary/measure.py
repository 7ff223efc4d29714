"""Measuring a workspace: SHA-256 of file bytes, a stat cache, and bounded glob/tree enumeration.

Invariants
- A digest is the plain hex SHA-256 of the file's bytes (seed compatibility). Files are hashed in parallel on a
  small thread pool (hashlib releases the GIL), at most ``max_workers`` (default 4) in flight.
- The stat cache is a pure cache (Bazel's and git's trick): an entry ``(size, mtime_ns, inode, ctime_ns) →
  digest`` is trusted only when the current stat is identical AND the entry is not *racily clean*: a file whose
  mtime or ctime lies within ``racy_window_ns`` of the moment its entry was recorded may have been rewritten
  within the same timestamp tick after it was hashed, so it is hashed again (git's racy-git rule,
  Documentation/technical/racy-git.txt). It persists as JSON under ``<workspace>/.smthrs/``; a corrupt file is
  dropped with a warning and rebuilt, never trusted.
- Enumeration is sorted, workspace-relative, uses the plan's glob matcher (``fileset.glob_match``; a wildcard
  never matches a dotfile unless the pattern names it), starts at each pattern's ``static_prefix`` and prunes
  directories no pattern can match below. A missing glob root is zero matches; a directory or file that
  vanishes *during* enumeration is ``changed_during_measurement``; more entries than the budget is
  ``enumeration_budget``. Tree artifacts (``dist/``) contain every file below them, dotfiles included.
- Losing the workspace root (or finding another directory in its place) is ``workspace_missing``: it never
  turns every file into an absence. The root is checked once per public call, AFTER everything was read (a
  result is returned only if the root was still the same directory once the last file was measured: a check
  before reading proves nothing a check after does not), and on every error path before the error is reported.
- Symlinks: a link is measured by the bytes of the file it points to when that file is inside the workspace;
  a link (or a path through a linked directory) that resolves outside the workspace is refused
  (``invalid_path``); a dangling link is an absent file. Enumeration never descends into linked directories.
  Only regular files are measured: a FIFO, socket or device is refused (reading a FIFO would block forever).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, Literal

from ..errors import BoundaryError
from ..plan.fileset import PathEntry, TreeArtifact, entry_matches, flatten, glob_match, static_prefix
from ._statcache import DEFAULT_RACY_WINDOW_NS, STAT_CACHE_FILE, StatCache, identity

__all__ = [
    "ABSENT",
    "FileState",
    "MeasureStats",
    "StatCache",
    "Measurer",
    "HashFile",
    "sha256_file",
    "scan_tree",
    "DEFAULT_ENTRY_BUDGET",
    "DEFAULT_RACY_WINDOW_NS",
    "STAT_CACHE_FILE",
]

log = logging.getLogger(__name__)

#: Digest recorded for a declared exact path that does not exist (never a valid hex digest).
ABSENT = "absent"
DEFAULT_ENTRY_BUDGET = 200_000

HashFile = Callable[[IO[bytes]], str]


def sha256_file(f: IO[bytes]) -> str:
    """Hex SHA-256 of an open binary file (``hashlib.file_digest`` where available)."""
    if hasattr(hashlib, "file_digest"):
        return hashlib.file_digest(f, "sha256").hexdigest()  # type: ignore[arg-type]
    h = hashlib.sha256()  # pragma: no cover - Python 3.10
    while chunk := f.read(1 << 20):  # pragma: no cover
        h.update(chunk)
    return h.hexdigest()  # pragma: no cover


@dataclass(frozen=True)
class FileState:
    """A measured regular file: content digest, size in bytes, permission bits."""

    digest: str
    size: int
    mode: int


@dataclass
class MeasureStats:
    """Counters of one :class:`Measurer` (observability and tests): files hashed vs served by the stat cache."""

    hashed: int = 0
    cached: int = 0
    bytes_hashed: int = 0


class _Budget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0

    def tick(self, rel: str) -> None:
        self.seen += 1
        if self.seen > self.limit:
            raise BoundaryError(
                "enumeration_budget",
                f"enumeration visited more than {self.limit} entries (at {rel!r}); narrow the globs or raise"
                " the entry budget",
                budget=self.limit,
                path=rel,
            )


@lru_cache(maxsize=65536)
def _prefix_ok(p: tuple[str, ...], s: tuple[str, ...]) -> bool:
    """Can a path that starts with the segments ``s`` (and goes deeper) match the pattern ``p``?"""
    if not s:
        return bool(p)
    if not p:
        return False
    if p[0] == "**":
        return _prefix_ok(p[1:], s) or (not s[0].startswith(".") and _prefix_ok(p, s[1:]))
    return glob_match(p[0], s[0]) and _prefix_ok(p[1:], s[1:])


_MISS = object()


def _join(base: str, name: str) -> str:
    return f"{base}/{name}" if base else name


class Measurer:
    """Measures files of one workspace root. Long-lived: keep one per workspace so the stat cache stays warm.

    ``stat_cache``: ``"workspace"`` (default) persists it at ``<root>/.smthrs/statcache.json``; a
    :class:`StatCache` to share one; ``None`` to hash every time. ``hash_file`` is injectable (tests count reads).
    ``clock_ns`` is the clock the racy-clean rule compares timestamps with.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        stat_cache: StatCache | None | Literal["workspace"] = "workspace",
        hash_file: HashFile = sha256_file,
        max_workers: int = 4,
        entry_budget: int = DEFAULT_ENTRY_BUDGET,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self._root_s = str(self.root)
        self._root_id = self._rootidentity()
        # Pin the root directory: while this descriptor is open its inode cannot be recycled, so a directory
        # recreated under the same name is recognisably another one.
        self._root_fd: int | None = os.open(self._root_s, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        self._root_real = os.path.realpath(self._root_s)
        if stat_cache == "workspace":
            stat_cache = StatCache(self.root / STAT_CACHE_FILE)
        self.stat_cache: StatCache | None = stat_cache
        self.hash_file = hash_file
        self.max_workers = max_workers
        self.entry_budget = entry_budget
        self.clock_ns = clock_ns
        self.stats = MeasureStats()
        self._stats_lock = threading.Lock()

    # -- root ----------------------------------------------------------------------------------------------

    def _rootidentity(self) -> tuple[int, int]:
        try:
            st = os.stat(self._root_s)
        except OSError as exc:
            raise self._missing_root(exc) from exc
        if not stat_mod.S_ISDIR(st.st_mode):
            raise self._missing_root(None)
        return (st.st_dev, st.st_ino)

    def _missing_root(self, exc: BaseException | None, why: str = "does not exist") -> BoundaryError:
        return BoundaryError(
            "workspace_missing",
            f"workspace root {self._root_s} {why}; restore it (or point SMTHRS_WORKSPACE at the right directory)",
            cause=exc,
            root=self._root_s,
        )

    def check_root(self) -> None:
        """Raise ``workspace_missing`` unless the root is still the same directory it was at construction."""
        if self._rootidentity() != self._root_id:
            raise self._missing_root(None, "was replaced by another directory during the step")

    def close(self) -> None:
        """Release the pinned root descriptor (also done when the measurer is garbage-collected)."""
        fd, self._root_fd = self._root_fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, OSError):
            pass

    def _gone(self, rel: str, exc: BaseException) -> BoundaryError:
        self.check_root()  # a lost root is reported as such, never as per-file absences
        return BoundaryError(
            "changed_during_measurement",
            f"{rel!r} vanished while it was being measured; the workspace changed during measurement — re-run"
            " when nothing else is writing to it",
            cause=exc,
            path=rel,
        )

    # -- enumeration ---------------------------------------------------------------------------------------

    def expand(self, entries: Iterable[Any]) -> tuple[list[str], frozenset[str]]:
        """Sorted unique paths named by ``entries`` and the subset found by enumeration (globs/trees).

        Exact entries are listed whether or not they exist; enumerated ones existed when listed.
        """
        try:
            listed = self._expand(entries)
        except BoundaryError:
            self.check_root()  # a lost root is reported as such, never as the symptom it caused
            raise
        self.check_root()
        return listed

    def _expand(self, entries: Iterable[Any]) -> tuple[list[str], frozenset[str]]:
        budget = _Budget(self.entry_budget)
        exact: set[str] = set()
        found: set[str] = set()
        for e in flatten(entries):
            if isinstance(e, str):
                exact.add(e)
            elif isinstance(e, TreeArtifact):
                self._walk(e.path, None, e, found, budget)
            else:
                for inc in e.include:
                    self._walk(static_prefix(inc), tuple(inc.split("/")), e, found, budget)
        return sorted(exact | found), frozenset(found - exact)

    def _walk(
        self, base: str, pattern: tuple[str, ...] | None, entry: PathEntry, out: set[str], budget: _Budget
    ) -> None:
        top = os.path.join(self._root_s, base) if base else self._root_s
        if base and os.path.lexists(top):
            # The walk never follows links below its start, but the start itself may run through one.
            real = os.path.realpath(top)
            if os.path.commonpath([real, self._root_real]) != self._root_real:
                raise self._invalid(
                    base, f"resolves to {real}, outside the workspace; symlinks must stay inside it"
                )
        if isinstance(entry, TreeArtifact):
            try:
                st = os.stat(top)
            except FileNotFoundError:
                return  # zero matches, trusted once the caller has checked the root after the walk
            if stat_mod.S_ISREG(st.st_mode):
                out.add(base)
                return
        stack = [base]
        first = True
        while stack:
            rel = stack.pop()
            try:
                it = os.scandir(os.path.join(self._root_s, rel) if rel else self._root_s)
            except (FileNotFoundError, NotADirectoryError) as exc:
                if first:
                    return  # a missing glob root or tree is zero matches (the caller checks the root after)
                raise self._gone(rel, exc) from exc
            except OSError as exc:
                raise self._unreadable(rel, exc) from exc
            first = False
            with it:
                for d in it:
                    child = _join(rel, d.name)
                    budget.tick(child)
                    try:
                        if d.is_dir(follow_symlinks=False):
                            if pattern is None or _prefix_ok(pattern, tuple(child.split("/"))):
                                stack.append(child)
                            continue
                        is_link = d.is_symlink()
                    except OSError as exc:
                        raise self._gone(child, exc) from exc
                    if not entry_matches(entry, child):
                        continue
                    if is_link:
                        try:
                            if not stat_mod.S_ISREG(os.stat(d.path).st_mode):
                                continue  # a link to a directory is not descended
                        except FileNotFoundError:
                            continue  # dangling link: no file here
                    out.add(child)

    # -- hashing -------------------------------------------------------------------------------------------

    def measure_entries(self, entries: Iterable[Any]) -> dict[str, FileState | None]:
        """``{path: FileState | None}`` sorted by path for every file the entries name (``None``: a declared
        exact path that does not exist)."""
        try:
            paths, required = self._expand(entries)
        except BoundaryError:
            self.check_root()
            raise
        # measure_paths checks the root after the last file: one check covers enumeration and hashing.
        return self.measure_paths(paths, required=required)

    def measure_paths(
        self, paths: Sequence[str], *, required: Iterable[str] | bool = False
    ) -> dict[str, FileState | None]:
        """Hash normalised workspace-relative ``paths`` in parallel. A path in ``required`` (or every path
        when ``required=True``) that has vanished is ``changed_during_measurement``; others become ``None``."""
        req: frozenset[str] | bool = required if isinstance(required, bool) else frozenset(required)
        ordered = sorted(set(paths))

        checked_dirs: set[str] = set()
        results: dict[str, FileState | None] = {}
        to_hash: list[tuple[str, bool]] = []
        try:
            # Stat pass in this thread (cache hits cost a syscall or two); only misses go to the pool.
            for rel in ordered:
                need = req is True or (not isinstance(req, bool) and rel in req)
                got = self._probe(rel, need, checked_dirs)
                if got is _MISS:
                    to_hash.append((rel, need))
                else:
                    results[rel] = got  # type: ignore[assignment]
            if len(to_hash) == 1:
                results[to_hash[0][0]] = self._hash(*to_hash[0])
            elif to_hash:
                with ThreadPoolExecutor(max_workers=min(self.max_workers, len(to_hash))) as pool:
                    for (rel, _), st in zip(
                        to_hash, pool.map(lambda a: self._hash(*a), to_hash), strict=True
                    ):
                        results[rel] = st
        except BoundaryError:
            self.check_root()  # a lost root is reported as such, never as the symptom it caused
            raise
        finally:
            self._save_cache()
        # The one root check of this call: an absence (or any state) is returned only if the root is still the
        # same directory after the last file was read.
        self.check_root()
        return {rel: results[rel] for rel in ordered}

    def _save_cache(self) -> None:
        if self.stat_cache is None:
            return
        try:
            self.stat_cache.save()
        except OSError as exc:
            # The cache is an optimisation; failing to persist it must not fail the measurement it served.
            log.warning("could not save the stat cache %s: %s", self.stat_cache.file, exc)

    def _unreadable(self, rel: str, exc: BaseException) -> BoundaryError:
        return BoundaryError(
            "unreadable",
            f"cannot read {rel!r}: {type(exc).__name__}: {exc}; fix its permissions or stop declaring it",
            cause=exc,
            path=rel,
        )

    def _invalid(self, rel: str, why: str) -> BoundaryError:
        return BoundaryError("invalid_path", f"{rel!r} {why}", path=rel)

    def _absent(self, rel: str, required: bool, exc: BaseException) -> FileState | None:
        if required:
            raise self._gone(rel, exc)
        return None  # trusted only once measure_paths has checked the root after the last file

    def _probe(self, rel: str, required: bool, checked_dirs: set[str]) -> FileState | None | object:
        """Stat ``rel``: its cached state, ``None`` (absent), or ``_MISS`` when it must be hashed."""
        path = self._root_s + "/" + rel
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError) as exc:
            return self._absent(rel, required, exc)
        except OSError as exc:
            raise self._unreadable(rel, exc) from exc
        if stat_mod.S_ISLNK(st.st_mode):
            self._check_inside(rel, path)
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError) as exc:
                return self._absent(rel, required, exc)  # dangling link
            except OSError as exc:
                raise self._unreadable(rel, exc) from exc
        elif not required:
            # An exact path may run through a linked directory (enumerated ones never do: the walk does not
            # follow links); checked once per directory per call.
            parent = rel.rpartition("/")[0]
            if parent and parent not in checked_dirs:
                self._check_inside(rel, self._root_s + "/" + parent)
                checked_dirs.add(parent)
        if stat_mod.S_ISDIR(st.st_mode):
            raise self._invalid(
                rel, f"is a directory; declare it as a tree ('{rel}/') or a glob ('{rel}/**')"
            )
        if not stat_mod.S_ISREG(st.st_mode):
            raise self._invalid(
                rel, "is not a regular file (FIFO, socket or device); only files can be measured"
            )
        if self.stat_cache is not None:
            digest = self.stat_cache.lookup(rel, st)
            if digest is not None:
                with self._stats_lock:
                    self.stats.cached += 1
                return FileState(digest, st.st_size, stat_mod.S_IMODE(st.st_mode))
        return _MISS

    def _check_inside(self, rel: str, path: str) -> None:
        real = os.path.realpath(path)
        if os.path.commonpath([real, self._root_real]) != self._root_real:
            raise self._invalid(
                rel, f"resolves to {real}, outside the workspace; symlinks must stay inside it"
            )

    def _hash(self, rel: str, required: bool) -> FileState | None:
        path = os.path.join(self._root_s, rel)
        t0 = self.clock_ns()  # before the bytes are read: the racy-clean rule compares timestamps with it
        try:
            # O_NONBLOCK: a path swapped for a FIFO since it was probed must not hang the measurement.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with os.fdopen(fd, "rb") as f:
                before = os.fstat(fd)
                if not stat_mod.S_ISREG(before.st_mode):
                    raise BoundaryError(
                        "changed_during_measurement", f"{rel!r} stopped being a regular file", path=rel
                    )
                try:
                    digest = self.hash_file(f)
                except OSError as exc:
                    raise self._unreadable(rel, exc) from exc
                after = os.fstat(f.fileno())
        except (FileNotFoundError, NotADirectoryError) as exc:
            return self._absent(rel, required, exc)
        except BoundaryError:
            raise
        except OSError as exc:
            raise self._unreadable(rel, exc) from exc
        if identity(before) != identity(after):
            raise BoundaryError(
                "changed_during_measurement",
                f"{rel!r} changed while it was being hashed; re-run when nothing else is writing to it",
                path=rel,
            )
        with self._stats_lock:
            self.stats.hashed += 1
            self.stats.bytes_hashed += before.st_size
        if self.stat_cache is not None:
            self.stat_cache.record(rel, before, digest, t0)
        return FileState(digest, before.st_size, stat_mod.S_IMODE(before.st_mode))


# ----------------------------------------------------------------------------------------------------------------


def scan_tree(
    root: str | os.PathLike[str],
    *,
    exclude_top: Iterable[str] = (),
    budget: int = DEFAULT_ENTRY_BUDGET,
) -> tuple[list[str], dict[str, os.stat_result]]:
    """Every directory and every non-directory entry below ``root`` (dotfiles included, symlinks not
    followed): ``(sorted directories, {path: lstat})``. For whole-tree manifests (the sandbox).

    ``exclude_top`` names top-level entries to skip (``.smthrs``, ``.git``, ``.venv``). A missing root is
    ``workspace_missing``; a directory vanishing mid-scan is ``changed_during_measurement``.
    """
    root_s = os.path.abspath(os.fspath(root))
    skip = frozenset(exclude_top)
    b = _Budget(budget)
    dirs: list[str] = []
    files: dict[str, os.stat_result] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(os.path.join(root_s, rel) if rel else root_s)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if not rel:
                raise BoundaryError(
                    "workspace_missing", f"tree root {root_s} does not exist", cause=exc, root=root_s
                ) from exc
            raise BoundaryError(
                "changed_during_measurement",
                f"directory {rel!r} vanished while the tree was being scanned",
                cause=exc,
                path=rel,
            ) from exc
        except OSError as exc:
            raise BoundaryError("unreadable", f"cannot list {rel!r}: {exc}", cause=exc, path=rel) from exc
        with it:
            for d in it:
                if not rel and d.name in skip:
                    continue
                child = _join(rel, d.name)
                b.tick(child)
                try:
                    st = d.stat(follow_symlinks=False)
                except FileNotFoundError as exc:
                    raise BoundaryError(
                        "changed_during_measurement",
                        f"{child!r} vanished during the scan",
                        cause=exc,
                        path=child,
                    ) from exc
                if stat_mod.S_ISDIR(st.st_mode):
                    dirs.append(child)
                    stack.append(child)
                else:
                    files[child] = st
    return sorted(dirs), dict(sorted(files.items()))
