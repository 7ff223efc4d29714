"""Replaying recorded outputs onto a workspace that never ran the step.

Invariants
- Stage everything, then publish: every output is first written to a staging directory under
  ``<root>/.smthrs/tmp`` and verified against its digest; only when all of them verified are they renamed into
  place (``os.replace``: a reader sees the old file or the new one, never a torn one) and the declared
  removals applied. A failure while staging leaves the workspace untouched.
- Three refusals a caller can act on: ``missing_artifact`` (a spilled blob is not in
  the store: hydrate it from the shared tier and retry once), ``boundary_corruption`` (bytes no longer hash to
  their digest: never served), ``unsupported_boundary`` (anything else; the cause is kept whole).
- Outputs never land outside the workspace, even through a symlinked directory.
- Defence in depth, whoever the caller: every output and removal must be a normalised workspace-relative path
  (else ``boundary_corruption``) and none may lie in, or resolve through a link into, a reserved top-level
  directory ``.smthrs/``, ``.git/``, ``.venv/`` (``reserved_path``) — checked before anything is staged. Whether
  a path is one the requesting declaration may touch is the cache's confinement check (it knows the request).
- Only the owner-execute bit travels: every replayed file is written 0o644 or 0o755.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArtifactError, BoundaryError, PlanError, ReplayError
from ..plan.fileset import normalize_path, reserved_top
from ..stores.artifacts import ArtifactStore, ProgressFn
from ._litter import staging_dir
from .evidence import Evidence
from .fsops import check_dest, inside, normal_mode, remove_path, rmtree_force

__all__ = ["Replayed", "replay_outputs", "check_replayable"]


@dataclass(frozen=True)
class Replayed:
    """What a replay wrote: output count, removals applied (paths that existed), bytes written."""

    outputs: int
    removals: int
    bytes_written: int


def _unsupported(msg: str, exc: BaseException | None = None) -> ReplayError:
    return ReplayError("unsupported_boundary", msg, cause=exc)


def replay_outputs(
    root: str | os.PathLike[str],
    evidence: Evidence,
    artifacts: ArtifactStore | None,
    *,
    progress: ProgressFn | None = None,
) -> Replayed:
    """Write every output of ``evidence`` into ``root`` (verified) and apply its removals."""
    root_p = Path(os.path.abspath(os.fspath(root)))
    if not root_p.is_dir():
        err = BoundaryError("workspace_missing", f"workspace root {root_p} does not exist", root=str(root_p))
        raise _unsupported(f"cannot replay into {root_p}: it is not a directory", err) from err
    root_real = os.path.realpath(root_p)
    for o in evidence.outputs:
        check_replayable(o.path, "output")
    for r in evidence.removals:
        check_replayable(r, "removal")
    try:
        dests = [check_dest(root_real, o.path) for o in evidence.outputs]
        removal_dests = [inside(root_real, r.rstrip("/")) for r in evidence.removals]
    except BoundaryError as exc:
        if "reserved" in exc.details:
            raise ReplayError(
                "reserved_path", f"refused to replay: {exc.message}", cause=exc, path=exc.details.get("path")
            ) from exc
        raise _unsupported(f"cannot replay: {exc.message}", exc) from exc
    try:
        stage = staging_dir(root_p, "replay")
    except OSError as exc:
        raise _unsupported(f"cannot create a staging directory under {root_p}/.smthrs: {exc}", exc) from exc
    try:
        staged: list[tuple[str, str]] = []
        written = 0
        for i, (o, dest) in enumerate(zip(evidence.outputs, dests, strict=True)):
            tmp = str(stage / str(i))
            if o.inline is not None:
                if hashlib.sha256(o.inline).hexdigest() != o.digest:
                    raise ReplayError(
                        "boundary_corruption",
                        f"inline bytes of {o.path!r} no longer hash to {o.digest}; the record is not served",
                        path=o.path,
                    )
                with open(tmp, "xb") as f:
                    f.write(o.inline)
            else:
                _fetch(artifacts, o.digest, o.path, tmp, progress)
            os.chmod(tmp, normal_mode(o.mode))  # only the owner-execute bit travels
            written += o.size
            staged.append((tmp, dest))
        # Everything verified: publish.
        try:
            for tmp, dest in staged:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                os.replace(tmp, dest)
            removed = sum(remove_path(d) for d in removal_dests)
        except OSError as exc:
            raise _unsupported(f"could not write replayed outputs into {root_p}: {exc}", exc) from exc
        return Replayed(outputs=len(staged), removals=removed, bytes_written=written)
    finally:
        rmtree_force(stage)


def check_replayable(path: str, what: str) -> None:
    """Refuse (``ReplayError``) an output or removal path that is not normalised (``boundary_corruption``) or
    lies in a reserved top-level directory (``reserved_path``). Removals may end in ``/`` (a tree)."""
    bare = path[:-1] if what == "removal" and isinstance(path, str) and path.endswith("/") else path
    try:
        ok = normalize_path(bare) == bare
    except PlanError:
        ok = False
    if not ok:
        raise ReplayError(
            "boundary_corruption",
            f"{what} {path!r} is not a normalised workspace-relative path; the record is not served",
            path=str(path),
        )
    reserved = reserved_top(bare)
    if reserved is not None:
        raise ReplayError(
            "reserved_path",
            f"{what} {path!r} lies in the reserved directory {reserved + '/'!r}; a replay never writes or"
            " removes there — the record is not served",
            path=path,
        )


def _fetch(
    artifacts: ArtifactStore | None, digest: str, path: str, tmp: str, progress: ProgressFn | None
) -> None:
    if artifacts is None:
        raise ReplayError(
            "missing_artifact",
            f"output {path!r} is stored by digest {digest} and no artifact store was given; pass artifacts=",
            digest=digest,
            path=path,
        )
    try:
        artifacts.get_to_file(digest, tmp, progress=progress)
    except ArtifactError as exc:
        if exc.code == "not_found":
            raise ReplayError(
                "missing_artifact",
                f"blob {digest} of {path!r} is not in {artifacts.url}; hydrate it from the shared tier and retry",
                cause=exc,
                digest=digest,
                path=path,
            ) from exc
        if exc.code == "corrupt":
            raise ReplayError(
                "boundary_corruption",
                f"blob {digest} of {path!r} no longer hashes to its digest; it is not served",
                cause=exc,
                digest=digest,
                path=path,
            ) from exc
        raise _unsupported(f"could not fetch {path!r} ({digest}): {exc}", exc) from exc
