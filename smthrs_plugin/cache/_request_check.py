"""Refusing a malformed dispatch request before anything is written: the seam's first step
(:meth:`~smthrs_plugin.cache.dispatch.CacheDispatcher.dispatch`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..boundary.boundary import Declaration
from ..canonical import canonical_bytes, is_key
from ..errors import CacheError, CanonicalError
from .model import DispatchRequest

__all__ = ["TIERS", "check_request", "invalid"]

TIERS = ("sealed", "compensable", "irreversible")


def invalid(msg: str, **details: Any) -> CacheError:
    """The seam's refusal of a malformed request or setup (``invalid_declaration``)."""
    return CacheError("invalid_declaration", msg, **details)


def check_request(request: DispatchRequest, workspace: Path) -> None:
    """Refuse a malformed request with a typed ``CacheError`` (the seam's first step, before anything is
    written). ``workspace``: the dispatcher's resolved workspace."""
    if not isinstance(request, DispatchRequest):
        raise invalid(f"dispatch takes a DispatchRequest, got {type(request).__name__}")
    if not is_key(request.key):
        raise CacheError(
            "key_uncomputable",
            f"request key {request.key!r} is not a key1_ key; compute it with plan.keys.dispatch_key (sealed)"
            " or run_local_key — the seam never keys a request itself",
        )
    if request.tier not in TIERS:
        raise invalid(f"tier {request.tier!r} is not one of {', '.join(TIERS)}")
    if not isinstance(request.declaration, Declaration):
        raise invalid("request.declaration must be a boundary.Declaration (reads, writes, removes, mode)")
    if request.sandbox not in ("hermetic", "whole-tree"):
        raise invalid(f"sandbox {request.sandbox!r} is neither 'hermetic' nor 'whole-tree'")
    for name in ("run_id", "node_id"):
        v = getattr(request, name)
        if not isinstance(v, str) or not v:
            raise invalid(f"request.{name} must be a non-empty string, got {v!r}")
    if request.subject is not None and (not isinstance(request.subject, str) or not request.subject):
        raise invalid(f"request.subject must be a non-empty string or None, got {request.subject!r}")
    if not all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in request.reads
    ):
        raise invalid("request.reads must be (path, digest) string pairs, as measured for the key")
    try:
        canonical_bytes(dict(request.components))
    except (CanonicalError, TypeError, ValueError) as exc:
        raise invalid(
            f"request.components must be plain JSON data (they are stored for explain): {exc}"
        ) from exc
    ws = Path(request.workspace)
    # The same path as the (resolved) dispatcher workspace needs no realpath walk; anything else is resolved.
    if ws != workspace and ws.resolve() != workspace:
        raise invalid(
            f"request workspace {request.workspace} is not this dispatcher's workspace {workspace};"
            " use one dispatcher per workspace",
        )
