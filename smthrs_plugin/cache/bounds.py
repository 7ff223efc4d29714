"""Size bounds of what one step may put in the cache: one output, and all of a step's outputs together.

Invariant: a sealed result over either cap is refused BEFORE anything is recorded or published — the dispatch
settles ``failed`` with ``CacheError(output_too_large)`` naming the path, its size and the setting to raise — so
one step cannot fill the shared tier (or this machine's disk through the local tier). The outputs the body wrote
were already copied back into the workspace by the sandbox; only their publication is refused. Defaults (settings
``SMTHRS_CACHE_MAX_OUTPUT_BYTES`` / ``SMTHRS_CACHE_MAX_STEP_BYTES``): 5 GiB and 20 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..boundary.evidence import Evidence
from ..errors import CacheError
from ..settings import DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_MAX_STEP_BYTES, CacheSettings

__all__ = ["SizeCaps", "check_size"]


@dataclass(frozen=True)
class SizeCaps:
    """``max_output_bytes``: one output file; ``max_step_bytes``: the sum of a step's outputs."""

    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    max_step_bytes: int = DEFAULT_MAX_STEP_BYTES

    def __post_init__(self) -> None:
        for name in ("max_output_bytes", "max_step_bytes"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise CacheError("invalid_declaration", f"SizeCaps.{name} must be a positive int, got {v!r}")

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> SizeCaps:
        return cls(settings.cache_max_output_bytes, settings.cache_max_step_bytes)


def _human(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_size(evidence: Evidence, caps: SizeCaps, *, node: str) -> CacheError | None:
    """The refusal of ``evidence`` under ``caps`` (None when within them)."""
    for o in evidence.outputs:
        if o.size > caps.max_output_bytes:
            return CacheError(
                "output_too_large",
                f"node {node!r} wrote {o.path!r} of {o.size} bytes ({_human(o.size)}), over the cache's cap of"
                f" {caps.max_output_bytes} bytes per output (SMTHRS_CACHE_MAX_OUTPUT_BYTES); nothing was cached"
                " or published. Raise the setting, or write the file outside the step's declared outputs",
                node=node,
                path=o.path,
                size=o.size,
                limit=caps.max_output_bytes,
                setting="SMTHRS_CACHE_MAX_OUTPUT_BYTES",
            )
    total = sum(o.size for o in evidence.outputs)
    if total > caps.max_step_bytes:
        biggest = max(evidence.outputs, key=lambda o: o.size)
        return CacheError(
            "output_too_large",
            f"node {node!r} wrote {total} bytes ({_human(total)}) over {len(evidence.outputs)} outputs (largest"
            f" {biggest.path!r}, {biggest.size} bytes), over the cache's cap of {caps.max_step_bytes} bytes per"
            " step (SMTHRS_CACHE_MAX_STEP_BYTES); nothing was cached or published. Raise the setting, or split"
            " the step",
            node=node,
            path=biggest.path,
            size=total,
            limit=caps.max_step_bytes,
            setting="SMTHRS_CACHE_MAX_STEP_BYTES",
        )
    return None
