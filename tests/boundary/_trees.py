"""Helpers of the boundary tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any


def snapshot(*roots: Path) -> dict[str, tuple[Any, ...]]:
    """Everything observable under ``roots`` (links not followed): kind, bytes or target, permission bits."""
    out: dict[str, tuple[Any, ...]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode):
                    out[p] = ("link", os.readlink(p))
                elif stat.S_ISDIR(st.st_mode):
                    out[p] = ("dir", stat.S_IMODE(st.st_mode))
                else:
                    out[p] = ("file", Path(p).read_bytes(), stat.S_IMODE(st.st_mode))
    return out
