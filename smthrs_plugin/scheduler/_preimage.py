"""Compensable work: capture the workspace pre-image of a node's write scope before each attempt, restore it
before a retry.

Invariants (the reference requires: "Compensable attempts use the supplied pre-image and restore it
before a retry. That promise covers only state the snapshot actually captures.")
- The pre-image covers exactly the files under the node's declared ``writes ∪ removes`` (globs and trees
  expanded at capture), by content digest and permission bits. The bytes go to the content-addressed artifact
  store *before* the attempt starts and the manifest is recorded in the attempt row's meta in the transaction
  that begins the attempt, so a process that dies mid-attempt leaves a durable image its successor restores.
- Restoring makes the scope equal to the image: files the image holds are rewritten (verified bytes, staged
  then renamed) when they differ, files it does not hold are removed. Nothing outside the scope is touched.
- A retry is a new execution of the same node in the same run after an attempt that did not complete
  (interrupted or failed). A delay-rebase is not a retry: it re-executes against the newly landed state, which
  restoring would clobber.
"""

from __future__ import annotations

import os
import stat as stat_mod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..boundary.measure import Measurer
from ..plan.model import Effects
from ..stores.artifacts import ArtifactStore

__all__ = ["PreImage", "Restored", "capture_preimage", "restore_preimage"]


@dataclass(frozen=True)
class PreImage:
    """``files``: sorted ``(path, sha256, mode)`` of every file in the scope before the attempt."""

    files: tuple[tuple[str, str, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"files": [list(f) for f in self.files]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PreImage:
        return cls(tuple((str(p), str(d), int(m)) for p, d, m in doc["files"]))


@dataclass(frozen=True)
class Restored:
    """What a restore changed: files rewritten and files removed."""

    rewritten: tuple[str, ...]
    removed: tuple[str, ...]


def _scope(effects: Effects) -> tuple[Any, ...]:
    return effects.writes + effects.removes


def capture_preimage(
    workspace: Path, measurer: Measurer, effects: Effects, artifacts: ArtifactStore
) -> PreImage:
    """Measure the write scope and store its bytes by digest. Raises ``BoundaryError``/``ArtifactError``."""
    states = measurer.measure_entries(_scope(effects))
    files = tuple((p, s.digest, s.mode) for p, s in states.items() if s is not None)
    if files:
        artifacts.put_files([(workspace / p, d) for p, d, _ in files])
    return PreImage(files)


def restore_preimage(
    workspace: Path, measurer: Measurer, effects: Effects, image: PreImage, artifacts: ArtifactStore
) -> Restored:
    """Make the write scope equal to ``image`` (see the module invariants)."""
    want = {p: (d, m) for p, d, m in image.files}
    now = {p: s for p, s in measurer.measure_entries(_scope(effects)).items() if s is not None}
    removed = sorted(p for p in now if p not in want)
    for p in removed:
        os.unlink(workspace / p)
    rewritten: list[str] = []
    for p, (digest, mode) in sorted(want.items()):
        cur = now.get(p)
        if cur is not None and cur.digest == digest and cur.mode == mode:
            continue
        dest = workspace / p
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or (dest.exists() and not stat_mod.S_ISREG(os.lstat(dest).st_mode)):
            os.unlink(dest)
        artifacts.get_to_file(digest, dest)
        os.chmod(dest, mode)
        rewritten.append(p)
    return Restored(tuple(rewritten), tuple(removed))
