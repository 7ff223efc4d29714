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
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
from pathlib import Path

from ._fsops import rmtree_force

__all__ = ["owned_temp_dir", "staging_dir"]

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


def _owner_tag() -> str | None:
    scope = _scope()
    start = _start_time(os.getpid())
    if scope is None or start is None:
        return None
    return f"{scope}-{os.getpid()}-{start}"


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
