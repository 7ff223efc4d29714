"""Boundary evidence: what a settled step produced, as plain, verifiable data.

Invariants
- Outputs are recorded by content digest, in sorted path order. An output is carried inline only while it is
  at most ``max_inline_bytes`` (1 MiB) and the inline total of the settle stays within
  ``max_total_inline_bytes`` (8 MiB); anything else lives in the artifact store and is referenced by digest
  (``referenced_digests``) — a per-output bound alone would let a wide write set build an unbounded row.
- ``diff_identity`` is a ``key1_`` key over the post-state (outputs and removals); decoding recomputes it and
  checks every inline payload against its digest, so a damaged row is ``boundary_corruption``, never replayed.
- An absence is only legitimate when declared: ``removals`` lists declared removals and deletions inside the
  write set; a declared output that went missing is a deviation, never a cached "delete this" (SEMANTICS §4).
- An output's ``mode`` is normalised (0o644, or 0o755 when the owner-execute bit was set): only that bit is part
  of the post-state, so the diff identity of honest entries does not depend on umasks, and setuid, setgid,
  sticky or group/world-writable bits can never be recorded. Decoding REFUSES any other mode as
  ``boundary_corruption`` (a forged or foreign record) rather than normalising it silently.
- Paths are normalised workspace-relative paths (decoding refuses anything else as ``boundary_corruption``).
  Whether a path is one the *requesting* declaration may touch is decided when serving (the cache's
  confinement check) and again, for reserved directories, by ``replay_outputs``.
- ``whole_tree_writes_verified`` / ``hermetic_reads_verified`` are set only by the sandbox, which proves them;
  the plain boundary leaves both false and its results stay run-local.
- The JSON form (``to_json``/``from_json``) is plain data (RFC 8785-canonicalisable): it goes into SQL rows
  and shared-tier entries.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from ..canonical import key
from ..errors import PlanError, ReplayError
from ..plan.fileset import normalize_path
from ..stores.artifacts import is_digest
from .fsops import NORMAL_MODES, normal_mode

__all__ = [
    "InlineLimits",
    "Output",
    "ExpectedSetDeviation",
    "MissingDeclaredOutput",
    "SurvivingDeclaredRemoval",
    "Deviation",
    "Evidence",
    "diff_identity",
    "referenced_digests",
    "EVIDENCE_FORMAT",
    "NORMAL_MODES",
    "normal_mode",
]

EVIDENCE_FORMAT = "smthrs-evidence/1"
MiB = 2**20


@dataclass(frozen=True)
class InlineLimits:
    """Inline budget of one settle (seed defaults: 1 MiB per output, 8 MiB in total)."""

    max_inline_bytes: int = 1 * MiB
    max_total_inline_bytes: int = 8 * MiB


@dataclass(frozen=True)
class Output:
    """One declared output: ``inline`` bytes, or ``None`` when it is stored by digest in the artifact store.
    ``mode`` is 0o644 or 0o755 (see the module invariants)."""

    path: str
    digest: str
    size: int
    mode: int
    inline: bytes | None = field(default=None, repr=False)

    @property
    def by_digest(self) -> bool:
        return self.inline is None


@dataclass(frozen=True)
class ExpectedSetDeviation:
    """Expected mode: the step wrote (or deleted) paths outside its declared write set."""

    paths: tuple[str, ...]
    kind: ClassVar[str] = "expected-set-deviation"


@dataclass(frozen=True)
class MissingDeclaredOutput:
    """A declared output (exact path or tree) does not exist after the step, and was not declared removed."""

    paths: tuple[str, ...]
    kind: ClassVar[str] = "missing-declared-output"


@dataclass(frozen=True)
class SurvivingDeclaredRemoval:
    """A declared removal still exists after the step."""

    paths: tuple[str, ...]
    kind: ClassVar[str] = "surviving-declared-removal"


Deviation = Union[ExpectedSetDeviation, MissingDeclaredOutput, SurvivingDeclaredRemoval]
_DEVIATIONS: dict[str, type[Deviation]] = {
    c.kind: c for c in (ExpectedSetDeviation, MissingDeclaredOutput, SurvivingDeclaredRemoval)
}


def diff_identity(outputs: Iterable[Output], removals: Iterable[str]) -> str:
    """``key1_`` key of the post-state a replay reproduces."""
    return key(
        {
            "kind": "boundary-diff/v1",
            "outputs": [
                {"path": o.path, "digest": o.digest, "mode": o.mode} for o in sorted(outputs, key=_path)
            ],
            "removals": sorted(set(removals)),
        }
    )


def _path(o: Output) -> str:
    return o.path


@dataclass(frozen=True)
class Evidence:
    """What one settle observed; see the module invariants. Build it with ``settle``/``run_in_sandbox``."""

    outputs: tuple[Output, ...]
    removals: tuple[str, ...]
    diff_identity: str
    deviations: tuple[Deviation, ...] = ()
    whole_tree_writes_verified: bool = False
    hermetic_reads_verified: bool = False
    read_set: tuple[tuple[str, str], ...] = ()
    boundary_mode: str = "hard"

    @property
    def inline_bytes(self) -> int:
        return sum(o.size for o in self.outputs if o.inline is not None)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (inline payloads base64); round-trips through :meth:`from_json`."""
        outs: list[dict[str, Any]] = []
        for o in self.outputs:
            d: dict[str, Any] = {"path": o.path, "digest": o.digest, "size": o.size, "mode": o.mode}
            if o.inline is not None:
                d["inline"] = base64.b64encode(o.inline).decode("ascii")
            outs.append(d)
        return {
            "format": EVIDENCE_FORMAT,
            "boundary_mode": self.boundary_mode,
            "outputs": outs,
            "removals": list(self.removals),
            "diff_identity": self.diff_identity,
            "deviations": [{"kind": d.kind, "paths": list(d.paths)} for d in self.deviations],
            "whole_tree_writes_verified": self.whole_tree_writes_verified,
            "hermetic_reads_verified": self.hermetic_reads_verified,
            "read_set": [{"path": p, "digest": dg} for p, dg in self.read_set],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Evidence:
        """Decode and verify a record: a malformed or tampered one is ``ReplayError(boundary_corruption)``,
        an unknown format version ``ReplayError(unsupported_boundary)``."""
        if not isinstance(doc, Mapping):
            raise _corrupt(f"evidence must be a JSON object, got {type(doc).__name__}")
        if doc.get("format") != EVIDENCE_FORMAT:
            raise ReplayError(
                "unsupported_boundary",
                f"evidence format {doc.get('format')!r} is not {EVIDENCE_FORMAT!r}; it was written by another"
                " version of smthrs — re-run the step to record fresh evidence",
            )
        try:
            outputs = tuple(_decode_output(o) for o in doc["outputs"])
            removals = tuple(_decode_removal(r) for r in doc["removals"])
            deviations = tuple(
                _DEVIATIONS[d["kind"]](tuple(normalize_path(p) for p in d["paths"]))
                for d in doc["deviations"]
            )
            read_set = tuple((normalize_path(r["path"]), _read_digest(r["digest"])) for r in doc["read_set"])
            flags = (doc["whole_tree_writes_verified"], doc["hermetic_reads_verified"])
            mode = doc["boundary_mode"]
            ident = doc["diff_identity"]
        except (KeyError, TypeError, ValueError, PlanError) as exc:
            raise _corrupt(f"evidence record is malformed: {type(exc).__name__}: {exc}", exc) from exc
        if not all(type(f) is bool for f in flags) or mode not in ("hard", "expected"):
            raise _corrupt("evidence flags or boundary mode are malformed")
        if [o.path for o in outputs] != sorted({o.path for o in outputs}):
            raise _corrupt("evidence outputs are not unique and sorted by path")
        ev = cls(outputs, removals, ident, deviations, flags[0], flags[1], read_set, mode)
        if diff_identity(outputs, removals) != ident:
            raise _corrupt("evidence diff_identity does not match its outputs and removals")
        return ev


def _corrupt(msg: str, exc: BaseException | None = None) -> ReplayError:
    return ReplayError(
        "boundary_corruption", msg + "; the record is not served — drop it and re-run the step", cause=exc
    )


def _read_digest(d: object) -> str:
    if d == "absent" or is_digest(d):
        return str(d)
    raise ValueError(f"read digest {d!r} is neither a sha256 hex digest nor 'absent'")


def _decode_output(o: Mapping[str, Any]) -> Output:
    path = normalize_path(o["path"])
    if path != o["path"]:
        raise ValueError(f"output path {o['path']!r} is not normalised")
    digest, size, mode = o["digest"], o["size"], o["mode"]
    if not is_digest(digest) or type(size) is not int or size < 0 or type(mode) is not int:
        raise ValueError(f"output {path!r} has a malformed digest, size or mode")
    if mode not in NORMAL_MODES:
        # Only the owner-execute bit travels; a setuid/world-writable mode is something no honest settle records.
        raise _corrupt(f"output {path!r} has mode {mode:#o}, which is not a normalised mode (0o644 or 0o755)")
    inline: bytes | None = None
    if "inline" in o:
        inline = base64.b64decode(o["inline"], validate=True)
        if len(inline) != size or hashlib.sha256(inline).hexdigest() != digest:
            raise _corrupt(f"inline bytes of {path!r} no longer hash to {digest}")
    return Output(path, digest, size, mode, inline)


def _decode_removal(r: object) -> str:
    if not isinstance(r, str):
        raise ValueError(f"removal {r!r} is not a string")
    tree = r.endswith("/")
    norm = normalize_path(r[:-1] if tree else r) + ("/" if tree else "")
    if norm != r:
        raise ValueError(f"removal {r!r} is not normalised")
    return norm


def referenced_digests(evidence: Evidence) -> frozenset[str]:
    """Digests the evidence needs from the artifact store: every output not carried inline. A shared tier
    must hold all of them before the entry becomes visible, and a fresh host must fetch them to replay."""
    return frozenset(o.digest for o in evidence.outputs if o.inline is None)
