"""Explaining a miss: which declared input, argument, environment field or body field changed since the previous
entry of the same subject.

Invariants
- Every entry records its key's ``components`` (what the caller computed the key from, in the one shape
  ``cache/requests.py`` builds for plan nodes and ``@step`` calls alike) and a ``subject`` (the node or function
  identity). A miss builds a new entry; explaining it compares that entry's components with the
  nearest previous entry of the same subject whose key differs — Bazel's ``--explain``/``aquery`` diff, on
  recorded data instead of a re-run. Nothing is re-measured: the explanation is about what was keyed.
- The diff is structural and total: every leaf that differs is reported once, as ``changed``/``added``/
  ``removed`` with its old and new JSON value. Read sets (lists of ``{path, digest}``) are compared by path, so an
  edited file reads ``read src/a.txt: <old digest> → <new digest>``, not "list item 3 changed".
- Categories name what a user edits: ``read`` (a declared input file), ``input`` (an argument / Ref value /
  literal), ``environment`` (a declared environment field), ``body`` (the step's body or source), ``effects``
  (declared writes, removals, boundary mode), ``other`` (anything else the caller folded — e.g. ``key.runId``, the
  run a run-local key belongs to).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..canonical import is_key
from ..errors import CacheError
from ._local import LocalRow, LocalTier
from ._model import DispatchRequest

__all__ = ["Change", "Explanation", "diff_components", "explain", "explain_request"]

Category = Literal["read", "input", "environment", "body", "effects", "other"]
ChangeKind = Literal["changed", "added", "removed"]
Status = Literal["first-entry", "changed", "same-components"]

_INPUT_ROOTS = ("inputs", "args", "arguments", "kwargs")
_BODY_ROOTS = ("body", "source", "function", "code")


@dataclass(frozen=True)
class Change:
    """One differing leaf: ``where`` is a dotted path (a file path for reads); ``old``/``new`` are JSON values
    (``None`` on the missing side of an ``added``/``removed`` change)."""

    category: Category
    kind: ChangeKind
    where: str
    old: Any = None
    new: Any = None

    def to_json(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "kind": self.kind,
            "where": self.where,
            "old": self.old,
            "new": self.new,
        }

    def line(self) -> str:
        label = "read" if self.category == "read" else self.category
        if self.kind == "added":
            return f"{label} {self.where}: added ({_short(self.new)})"
        if self.kind == "removed":
            return f"{label} {self.where}: removed (was {_short(self.old)})"
        return f"{label} {self.where}: {_short(self.old)} → {_short(self.new)}"


@dataclass(frozen=True)
class Explanation:
    """What changed between ``previous_key`` and ``key`` for ``subject`` (``first-entry``: nothing to compare)."""

    subject: str | None
    key: str
    previous_key: str | None
    status: Status
    changes: tuple[Change, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "key": self.key,
            "previous_key": self.previous_key,
            "status": self.status,
            "changes": [c.to_json() for c in self.changes],
        }

    def lines(self) -> list[str]:
        head = f"{self.subject or '?'}: {self.key}"
        if self.status == "first-entry":
            return [head, "  first entry of this subject: nothing earlier to compare with"]
        if self.status == "same-components":
            return [
                head,
                f"  same recorded components as {self.previous_key} (the key folded something unrecorded)",
            ]
        return [head, f"  compared with {self.previous_key}:"] + [f"  - {c.line()}" for c in self.changes]


def _short(v: Any) -> str:
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12]
    text = repr(v) if not isinstance(v, str) else v
    return text if len(text) <= 80 else text[:77] + "..."


def _category(parts: tuple[str, ...]) -> Category:
    top = parts[0] if parts else ""
    if top in _INPUT_ROOTS:
        return "input"
    if top == "environment":
        return "environment"
    if top == "hermetic" or (top == "body" and len(parts) > 1 and parts[1] == "effects"):
        return "effects"
    if top in _BODY_ROOTS:
        return "body"
    return "other"


def _is_read_set(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(x, Mapping) and set(x) == {"path", "digest"} for x in v)
    )


def diff_components(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> tuple[Change, ...]:
    """Every leaf that differs between two component breakdowns, in a stable (sorted path) order."""
    out: list[Change] = []
    _diff(old or {}, new or {}, (), out)
    return tuple(out)


def _diff(a: Any, b: Any, parts: tuple[str, ...], out: list[Change]) -> None:
    if a == b and type(a) is type(b):
        return
    if (_is_read_set(a) or a == []) and (_is_read_set(b) or b == []) and (a or b):
        _diff_reads(a, b, out)
        return
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in sorted(set(a) | set(b)):
            p = (*parts, str(k))
            if k not in a:
                out.append(Change(_category(p), "added", ".".join(p), None, b[k]))
            elif k not in b:
                out.append(Change(_category(p), "removed", ".".join(p), a[k], None))
            else:
                _diff(a[k], b[k], p, out)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, (*parts, str(i)), out)
        return
    out.append(Change(_category(parts), "changed", ".".join(parts), a, b))


def _diff_reads(a: list[Mapping[str, str]], b: list[Mapping[str, str]], out: list[Change]) -> None:
    old = {r["path"]: r["digest"] for r in a}
    new = {r["path"]: r["digest"] for r in b}
    for p in sorted(set(old) | set(new)):
        if p not in old:
            out.append(Change("read", "added", p, None, new[p]))
        elif p not in new:
            out.append(Change("read", "removed", p, old[p], None))
        elif old[p] != new[p]:
            out.append(Change("read", "changed", p, old[p], new[p]))


def _resolve(local: LocalTier, key_or_subject: str) -> LocalRow:
    if is_key(key_or_subject):
        rows = local.rows(key=key_or_subject, limit=1)
        if not rows:
            raise CacheError(
                "not_found",
                f"no local cache entry has key {key_or_subject}; list entries with `smthrs cache ls`",
                key=key_or_subject,
            )
        return rows[0]
    rows = local.rows(subject=key_or_subject, limit=1)
    if rows:
        return rows[0]
    subjects = local.subjects_ending_with(key_or_subject)
    if len(subjects) > 1:
        raise CacheError(
            "not_found",
            f"{key_or_subject!r} names several subjects ({', '.join(subjects[:10])}); pass one of them in full",
            subjects=subjects,
        )
    rows = local.rows(subject=subjects[0], limit=1) if subjects else []
    if not rows:
        raise CacheError(
            "not_found",
            f"no local cache entry for node or key {key_or_subject!r}; list entries with `smthrs cache ls`",
            subject=key_or_subject,
        )
    return rows[0]


def _previous(local: LocalTier, subject: str | None, key: str, before_ms: int | None) -> LocalRow | None:
    if subject is None:
        return None
    for row in local.rows(subject=subject):
        if row.key != key and (before_ms is None or row.created_at_ms <= before_ms):
            return row
    return None


def explain(local: LocalTier, key_or_subject: str) -> Explanation:
    """Explain the newest entry of a key or subject (a node id, ``plan/node`` or a function qualname) against
    the previous entry of its subject. ``CacheError(not_found)`` when there is no such entry."""
    row = _resolve(local, key_or_subject)
    prev = _previous(local, row.subject, row.key, row.created_at_ms)
    return _explained(row.subject, row.key, row.components, prev)


def explain_request(local: LocalTier, request: DispatchRequest) -> Explanation:
    """Explain a request BEFORE dispatching it: its components against the newest entry of its subject."""
    subject = request.subject or request.node_id
    prev = _previous(local, subject, request.key, None)
    return _explained(subject, request.key, dict(request.components), prev)


def _explained(
    subject: str | None, key: str, components: Mapping[str, Any] | None, prev: LocalRow | None
) -> Explanation:
    if prev is None:
        return Explanation(subject, key, None, "first-entry", ())
    changes = diff_components(prev.components, components)
    return Explanation(subject, key, prev.key, "changed" if changes else "same-components", changes)
