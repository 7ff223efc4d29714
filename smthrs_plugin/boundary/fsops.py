"""Small filesystem primitives shared by replay and the sandbox (private).

Every write into a real workspace goes temp file → ``os.replace`` so a reader never sees a half-written file;
destinations are checked to stay inside the workspace even through symlinked directories.

Modes are normalised (``normal_mode``): only the owner-execute bit travels, so every file this package writes
into a sandbox or a workspace is 0o644 or 0o755 — setuid, setgid, sticky and group/world-writable bits are
never copied, replayed or recorded (a cache entry must not be able to plant a setuid or world-writable file).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat as stat_mod
import sys
from pathlib import Path

from ..errors import BoundaryError
from ..plan.fileset import reserved_top

CHUNK = 1 << 20
#: The only two modes a recorded, replayed or copied file may have.
NORMAL_MODES = (0o644, 0o755)


def normal_mode(mode: int) -> int:
    """0o755 when ``mode`` has the owner-execute bit, else 0o644: the only permission fact that travels."""
    return 0o755 if mode & stat_mod.S_IXUSR else 0o644


def copy_with_hash(src: str, dst: str, *, fsync: bool = False) -> tuple[str, int]:
    """Copy ``src`` to a new file ``dst`` (never hard-linked), hashing exactly the bytes written:
    ``(sha256 hex, size)``. The mode is normalised (:func:`normal_mode`); timestamps are copied."""
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fi:
        st = os.fstat(fi.fileno())
        with open(dst, "xb") as fo:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while k := fi.readinto(buf):
                h.update(view[:k])
                fo.write(view[:k])
                n += k
            if fsync:
                fo.flush()
                os.fsync(fo.fileno())
    os.chmod(dst, normal_mode(st.st_mode))
    # mtimes matter to make-like tools running inside a sandbox
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
    return h.hexdigest(), n


def inside(root_real: str, rel: str) -> str:
    """Absolute destination of ``rel`` under ``root_real``, refusing a path whose existing part resolves
    outside it (a symlinked directory pointing elsewhere) or into a reserved top-level directory (a link to
    ``.git/`` must not let a write land in ``.git/hooks``); the latter carries ``reserved=`` in its details."""
    dest = os.path.join(root_real, rel)
    real = os.path.realpath(os.path.dirname(dest))
    if os.path.commonpath([real, root_real]) != root_real:
        raise BoundaryError(
            "invalid_path",
            f"{rel!r} lies under a symlink that resolves to {real}, outside the workspace; remove the link",
            path=rel,
        )
    if real != root_real:
        reserved = reserved_top(os.path.relpath(real, root_real).replace(os.sep, "/"))
        if reserved is not None:
            raise BoundaryError(
                "invalid_path",
                f"{rel!r} lies under a symlink that resolves into the reserved directory {reserved + '/'!r};"
                " remove the link",
                path=rel,
                reserved=reserved,
            )
    return dest


def check_dest(root_real: str, rel: str) -> str:
    """:func:`inside`, plus: no directory where the file goes and no file where a parent directory goes."""
    dest = inside(root_real, rel)
    if os.path.isdir(dest) and not os.path.islink(dest):
        raise BoundaryError("invalid_path", f"cannot write {rel!r}: a directory is in the way", path=rel)
    parent = os.path.dirname(dest)
    while parent != root_real and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise BoundaryError(
            "invalid_path", f"cannot write {rel!r}: {parent} is a file where a directory is needed", path=rel
        )
    return dest


def remove_path(path: str) -> bool:
    """Remove a file, a link or a whole directory; False when nothing was there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat_mod.S_ISDIR(st.st_mode):
        rmtree_force(path)
    else:
        os.unlink(path)
    return True


def rmtree_force(path: str | Path) -> None:
    """``shutil.rmtree`` that also removes directories a step made read-only."""

    def fix(func: object, p: str, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            return
        if isinstance(exc, PermissionError) or getattr(exc, "errno", None) == errno.EACCES:
            parent = os.path.dirname(p)
            os.chmod(parent, stat_mod.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat_mod.S_IRWXU)
                shutil.rmtree(p)
            else:
                os.unlink(p)
            return
        raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fix)
    else:
        shutil.rmtree(path, onerror=lambda func, p, info: fix(func, p, info[1]))
