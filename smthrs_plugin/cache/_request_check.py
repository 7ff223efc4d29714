"""Refusing a malformed dispatch request before anything is written: the seam's first step
(:meth:`~smthrs_plugin.cache.dispatch.CacheDispatcher.dispatch`).

A consulting request's ``components`` (stored only by a build, for explain) are walked once per mapping object
a dispatcher has seen (:class:`RequestCheck`): a ``@step``'s request is reused call after call, and re-walking
the same components on every hit was a fifth of a hit's own CPU. A consult that ends in a build walks them again
before the body runs, so a mapping changed in place since is still refused (after the consult's own bookkeeping
of the entries it found: a revoked or expired row forgotten, a refusal journaled). A request that builds at once
(refresh, ``no_cache``, not sealed) is walked up front, before its refresh invalidates anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..boundary.boundary import Declaration
from ..canonical import canonical_bytes, is_key
from ..errors import CacheError, CanonicalError
from .model import DispatchRequest

__all__ = ["TIERS", "RequestCheck", "check_request", "invalid"]

TIERS = ("sealed", "compensable", "irreversible")
#: Components mappings remembered as walked (a bound on memory: the memo is emptied when full).
_WALKED_CAP = 1024


def invalid(msg: str, **details: Any) -> CacheError:
    """The seam's refusal of a malformed request or setup (``invalid_declaration``)."""
    return CacheError("invalid_declaration", msg, **details)


class RequestCheck:
    """One dispatcher's request check (see the module docstring)."""

    def __init__(self, workspace: Path) -> None:
        self.workspace = workspace
        # id -> the mapping itself: holding it pins the id, so another object can never pass as walked.
        self._walked: dict[int, Any] = {}

    def check(self, request: DispatchRequest) -> bool:
        """Refuse a malformed request (typed ``CacheError``); return whether its components were walked now
        (False: this mapping was walked by an earlier dispatch and the request consults first)."""
        check_request(request, self.workspace)
        consults = request.tier == "sealed" and not request.no_cache and not request.refresh
        walk = not consults or self._walked.get(id(request.components)) is not request.components
        if walk:
            self.components(request)
        return walk

    def components(self, request: DispatchRequest) -> None:
        """Walk the request's components (``invalid_declaration`` unless plain JSON) and remember the mapping."""
        components = request.components
        _check_components(components)
        if len(self._walked) >= _WALKED_CAP:
            self._walked.clear()
        self._walked[id(components)] = components


def _check_components(components: Any) -> None:
    try:
        canonical_bytes(dict(components))
    except (CanonicalError, TypeError, ValueError) as exc:
        raise invalid(
            f"request.components must be plain JSON data (they are stored for explain): {exc}"
        ) from exc


def check_request(request: DispatchRequest, workspace: Path) -> None:
    """Refuse a malformed request with a typed ``CacheError``, all but its components (which
    :class:`RequestCheck` walks). ``workspace``: the dispatcher's resolved workspace."""
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
    ws = request.workspace if isinstance(request.workspace, Path) else Path(request.workspace)
    # The same path as the (resolved) dispatcher workspace needs no realpath walk; anything else is resolved.
    if ws != workspace and ws.resolve() != workspace:
        raise invalid(
            f"request workspace {request.workspace} is not this dispatcher's workspace {workspace};"
            " use one dispatcher per workspace",
        )
