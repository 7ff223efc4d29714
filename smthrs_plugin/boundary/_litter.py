"""Temporary directories that outlive a killed process: named after their owner, swept once it is gone (private).

A sandbox (under the system temp dir) or a staging directory (under ``<workspace>/.smthrs/tmp``) is removed by the
process that made it — unless that process was SIGKILLed, lost its machine, or crashed in C. Without a sweep such
litter piles up forever (a 1 GB whole-tree sandbox per killed build). So every such directory is named
``<prefix>-<scope>-<pid>-<start>-<random>``:

- ``scope`` identifies the process namespace the pid belongs to: a digest of this boot's id and of the pid
  namespace. A directory of another machine (a workspace on a shared disk) or another container (a shared /tmp)
  has another scope and is never touched — its pid means nothing here.
- ``pid`` and ``start`` (the process start time in clock ticks since boot, ``/proc/<pid>/stat`` field 22) name
  the owner exactly: pid reuse gives a different start time.

Invariant: a directory is swept only when its scope is ours and no process with that pid and start time exists,
i.e. its owner is provably gone and nothing can be using it. Sweeping happens once per process and directory,
when that process first makes a directory there. Where ``/proc`` is missing (not Linux) names carry no owner and
nothing is ever swept: the sweep never guesses.

Prior art: Bazel's output base lock + ``bazel clean`` of stale sandboxes on server start; systemd-tmpfiles.

Empty roots (``take_empty_root`` / ``give_back`` / ``release``): a step with no file effects runs in an empty
directory; creating and removing one per dispatch costs two directory-metadata writes (often milliseconds on a
journaled disk), so a process keeps a small pool of them inside ONE owned directory per temp dir (swept like
any other after a SIGKILL, removed at a normal exit). Invariant: a root is handed to exactly one caller at a
time, and only when it is provably the same directory (device, inode, mode) and empty at the moment it is
handed out; a root that is not is removed, never reused. The pool belongs to one process: a forked child
starts with its own (it never hands out a directory its parent may be using).
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import BoundaryError
from .fsops import rmtree_force

__all__ = [
    "EmptyRoot",
    "give_back",
    "is_untouched",
    "owned_temp_dir",
    "release",
    "staging_dir",
    "take_empty_root",
]

log = logging.getLogger(__name__)

_NAME = re.compile(r"(?P<scope>[0-9a-f]{12})-(?P<pid>[0-9]+)-(?P<start>[0-9]+)-")
_SWEPT: set[tuple[int, str, str]] = set()
_LOCK = threading.Lock()


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``), or None when there is none."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Fields after the command name, which is parenthesised and may itself contain spaces and parentheses.
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[19].decode()


def _scope() -> str | None:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return hashlib.sha256(f"{boot}/{pidns}".encode()).hexdigest()[:12]


_TAG: tuple[int, str | None] | None = None


def _owner_tag() -> str | None:
    # Constant for the life of a process (boot, pid namespace, pid, start time), so read /proc once per pid: a
    # forked child has another pid and computes its own.
    global _TAG
    pid = os.getpid()
    memo = _TAG
    if memo is not None and memo[0] == pid:
        return memo[1]
    scope = _scope()
    start = _start_time(pid)
    tag = None if scope is None or start is None else f"{scope}-{pid}-{start}"
    _TAG = (pid, tag)
    return tag


def _sweep(directory: str, prefix: str, scope: str) -> None:
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    mine = f"{prefix}-"
    for entry in entries:
        if not entry.name.startswith(mine):
            continue
        m = _NAME.match(entry.name, len(mine))
        if m is None or m["scope"] != scope:
            continue  # an old-style name, or another machine's/container's: not ours to judge
        if _start_time(int(m["pid"])) == m["start"]:
            continue  # its owner is alive (possibly this very process)
        try:
            rmtree_force(Path(entry.path))
        except OSError as exc:
            # Litter that cannot be removed stays; the work that triggered the sweep must not fail over it.
            log.warning("could not remove %s left by dead process %s: %s", entry.path, m["pid"], exc)
        else:
            log.info("removed %s left by dead process %s", entry.path, m["pid"])


def owned_temp_dir(prefix: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """``tempfile.mkdtemp`` named after this process (module docstring); the first call for a directory in a
    process first sweeps the directories there whose owner is gone. ``directory`` defaults to the temp dir."""
    where = os.fspath(directory) if directory is not None else tempfile.gettempdir()
    tag = _owner_tag()
    if tag is None:
        return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=where))
    memo = (os.getpid(), os.path.abspath(where), prefix)
    with _LOCK:
        first = memo not in _SWEPT
        _SWEPT.add(memo)
    if first:
        _sweep(where, prefix, tag.split("-", 1)[0])
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{tag}-", dir=where))


def staging_dir(root: Path, prefix: str) -> Path:
    """A fresh directory under ``<root>/.smthrs/tmp`` (same filesystem: ``os.replace`` into place is atomic),
    owned by this process (:func:`owned_temp_dir`)."""
    where = root / ".smthrs" / "tmp"
    where.mkdir(parents=True, exist_ok=True)
    return owned_temp_dir(prefix, where)


# -- empty roots for effect-free steps ---------------------------------------------------------------------------

#: Idle roots kept per temp dir; beyond this (a burst of concurrency) a returned root is removed.
_POOL_MAX = 64


@dataclass(frozen=True)
class EmptyRoot:
    """A private empty directory checked out of the pool: ``path`` and the ``ident`` (device, inode, mode) it had
    when it was handed out."""

    path: Path
    ident: tuple[int, int, int]
    home: str
    pid: int


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_dev, st.st_ino, st.st_mode)


def is_untouched(root: EmptyRoot) -> bool:
    """Whether ``root`` is still the very directory it was (same device, inode and mode; not a link) and empty."""
    try:
        st = os.lstat(root.path)
        if _identity(st) != root.ident:
            return False
        with os.scandir(root.path) as it:
            return next(it, None) is None
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return False


class _Pool:
    def __init__(self, where: str) -> None:
        self.where = where
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.parent: Path | None = None
        self.idle: list[EmptyRoot] = []
        self.names = itertools.count()

    def take(self) -> EmptyRoot:
        while True:
            with self.lock:
                root = self.idle.pop() if self.idle else None
            if root is None:
                return self._make()
            if is_untouched(root):
                return root
            # Something wrote into it while it sat idle (a background process of an earlier step): that litter
            # must never be blamed on, or seen by, the next step.
            log.warning("discarding sandbox root %s: it changed while idle", root.path)
            discard(root)

    def _make(self) -> EmptyRoot:
        for _ in range(2):
            with self.lock:
                if self.parent is None:
                    self.parent = owned_temp_dir("smthrs-sandbox", self.where)
                parent, n = self.parent, next(self.names)
            path = parent / f"r{n}"
            try:
                os.mkdir(path)
                return EmptyRoot(path, _identity(os.lstat(path)), self.where, self.pid)
            except FileNotFoundError:
                with self.lock:  # the pool's directory was removed underneath (a temp cleaner): make another
                    if self.parent == parent:
                        self.parent = None
            except OSError as exc:
                raise BoundaryError(
                    "unsupported_boundary", f"could not create a sandbox root in {parent}: {exc}", cause=exc
                ) from exc
        raise BoundaryError(
            "unsupported_boundary",
            f"the sandbox directory under {self.where} keeps vanishing; stop whatever removes it",
            where=self.where,
        )

    def put(self, root: EmptyRoot) -> bool:
        with self.lock:
            if len(self.idle) < _POOL_MAX and self.parent is not None and root.path.parent == self.parent:
                self.idle.append(root)
                return True
        return False

    def close(self) -> None:
        with self.lock:
            parent, self.parent, self.idle = self.parent, None, []
        if parent is not None and self.pid == os.getpid():
            try:
                rmtree_force(parent)
            except OSError as exc:
                log.warning("could not remove the sandbox roots in %s: %s", parent, exc)


_POOLS: dict[str, _Pool] = {}
_POOLS_LOCK = threading.Lock()


def _pool(directory: str | os.PathLike[str] | None) -> _Pool:
    where = os.path.abspath(os.fspath(directory) if directory is not None else tempfile.gettempdir())
    pool = _POOLS.get(where)
    if pool is None:
        with _POOLS_LOCK:
            pool = _POOLS.setdefault(where, _Pool(where))
    return pool


def take_empty_root(directory: str | os.PathLike[str] | None = None) -> EmptyRoot:
    """An empty private directory under ``directory`` (default: the temp dir), for this caller alone until it
    :func:`give_back`s or :func:`release`s it."""
    return _pool(directory).take()


def give_back(root: EmptyRoot) -> None:
    """Return a root the caller has just checked :func:`is_untouched`; kept for reuse, or removed when the pool
    is full."""
    if root.pid != os.getpid():
        return  # checked out before a fork: the parent's directory, neither ours to reuse nor to remove
    if not _pool(root.home).put(root):
        discard(root)


def release(root: EmptyRoot) -> None:
    """Return a root in an unknown state: reused only when :func:`is_untouched`, otherwise removed."""
    if root.pid != os.getpid():
        return
    if is_untouched(root):
        give_back(root)
    else:
        discard(root)


def discard(root: EmptyRoot) -> None:
    """Remove a root and whatever a step left in it (raises ``OSError`` when that fails)."""
    if root.pid != os.getpid():
        return
    try:
        os.lstat(root.path)
    except FileNotFoundError:
        return  # the step removed it itself
    if os.path.isdir(root.path) and not os.path.islink(root.path):
        rmtree_force(root.path)
    else:
        os.unlink(root.path)


def _close_pools() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


def _forget_pools_in_child() -> None:
    # The parent's roots (and the locks, possibly held by a thread that does not exist here) stay the parent's.
    global _POOLS_LOCK, _LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()
    _LOCK = threading.Lock()


atexit.register(_close_pools)
os.register_at_fork(after_in_child=_forget_pools_in_child)
