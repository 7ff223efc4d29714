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
  edited file reads ``read src/a.txt: <old digest> → <new digest>``, not "list item 3 changed". A ``@step``'s
  reached modules and distributions are named the same way: ``module helpers: <old> → <new>``, ``distribution
  pandas: 2.1.0 → 2.2.0``.
- A bare name resolves to the one subject it names: a plan node id, a step's function name (its qualname) or
  node name; several candidates are refused, listed.
- **A run-local entry says why.** When the explained entry was kept run-local (it failed admission: never served
  to another run, so every other run's call of the same key misses), the explanation names the failed conjunct
  and its reason, re-derived from the entry's recorded claims and evidence (``admit_entry``) — instead of
  calling it a first entry, which is what it would otherwise look like.
- **A renewed entry says so.** An entry built because the earlier entry of the SAME key had expired
  (``cache_expiration``) or a refresh was asked for records it (``provenance.renewed``): its explanation is that
  (``expired``: the earlier entry's tier, age and the limit), not a comparison with another key.
- Categories name what a user edits: ``read`` (a declared input file), ``input`` (an argument / Ref value /
  literal), ``environment`` (a declared environment field), ``body`` (the step's body or source), ``effects``
  (declared writes, removals, boundary mode), ``other`` (anything else the caller folded — e.g. ``key.runId``, the
  run a run-local key belongs to).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from ..canonical import is_key
from ..errors import CacheError
from ..records import cache_index as cache_index
from .admission import NotAdmissible, admit_entry
from .entry import CacheEntry
from .local import LocalRow, LocalTier
from .model import DispatchRequest

__all__ = [
    "Change",
    "Explanation",
    "KeptRunLocal",
    "Renewed",
    "diff_components",
    "explain",
    "explain_request",
]

Category = Literal["read", "input", "environment", "body", "effects", "other"]
ChangeKind = Literal["changed", "added", "removed"]
Status = Literal["first-entry", "changed", "same-components"]

_INPUT_ROOTS = ("inputs", "args", "arguments", "kwargs")
_BODY_ROOTS = ("body", "source", "function", "code")
#: A ``@step``'s identity members named per entry (``prefect/_reach.py``): module digests, distribution versions.
_STEP_MEMBERS = ((".modules.", "module"), (".distributions.", "distribution"))


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
        label, where = self._named()
        if self.kind == "added":
            return f"{label} {where}: added ({_short(self.new)})"
        if self.kind == "removed":
            return f"{label} {where}: removed (was {_short(self.old)})"
        return f"{label} {where}: {_short(self.old)} → {_short(self.new)}"

    def _named(self) -> tuple[str, str]:
        """A step's reached module or distribution is named as such (its name may itself be dotted)."""
        if self.category == "body":
            for marker, label in _STEP_MEMBERS:
                head, found, name = self.where.partition(marker)
                if found and name and head.endswith(".step"):
                    return label, name
        return self.category, self.where


@dataclass(frozen=True)
class KeptRunLocal:
    """Why an entry stays with the run that built it: the admission ``conjunct`` it failed and the ``reason``."""

    conjunct: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"conjunct": self.conjunct, "reason": self.reason}

    def line(self) -> str:
        return f"  kept run-local (never served to another run, which builds it again): {self.reason}"


@dataclass(frozen=True)
class Renewed:
    """Why an entry replaced an earlier entry of its own key: ``expired`` (that entry, in ``tier``, was ``age_ms``
    old, over ``max_age_ms``) or ``refresh`` (a refresh was asked for)."""

    reason: str
    tier: str | None = None
    age_ms: int | None = None
    max_age_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "tier": self.tier,
            "age_ms": self.age_ms,
            "max_age_ms": self.max_age_ms,
        }

    def line(self) -> str:
        if self.reason == "expired":
            age = "of unknown age" if self.age_ms is None else f"{_duration(self.age_ms)} old"
            limit = "?" if self.max_age_ms is None else _duration(self.max_age_ms)
            return (
                f"  expired: the previous entry of this key ({self.tier or '?'} tier) was {age}, over"
                f" cache_expiration {limit}; it ran again and this entry replaced it"
            )
        return f"  {self.reason}: a refresh was asked for (refresh_cache); it ran again and this entry replaced it"


def _duration(ms: int) -> str:
    return f"{ms} ms" if ms < 1000 else str(timedelta(seconds=ms // 1000))


@dataclass(frozen=True)
class Explanation:
    """What changed between ``previous_key`` and ``key`` for ``subject`` (``first-entry``: nothing to compare);
    ``run_local``: why the entry was kept run-local, when it was."""

    subject: str | None
    key: str
    previous_key: str | None
    status: Status
    changes: tuple[Change, ...]
    run_local: KeptRunLocal | None = None
    renewed: Renewed | None = None
    #: How the entry's body was isolated when it was built (``namespace | process | thread | remote``).
    isolation: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "key": self.key,
            "previous_key": self.previous_key,
            "status": self.status,
            "changes": [c.to_json() for c in self.changes],
            "run_local": None if self.run_local is None else self.run_local.to_json(),
            "renewed": None if self.renewed is None else self.renewed.to_json(),
            "isolation": self.isolation,
        }

    def lines(self) -> list[str]:
        head = [f"{self.subject or '?'}: {self.key}"]
        if self.isolation is not None:
            head.append(f"  built with isolation {self.isolation}")
        if self.run_local is not None:
            head.append(self.run_local.line())
        if self.renewed is not None:  # its key did not change: comparing it with another key says nothing
            return [*head, self.renewed.line()]
        if self.status == "first-entry":
            # A run-local key's entry is the first of every run that builds it: its reason says more.
            if self.run_local is not None:
                return head
            return [*head, "  first entry of this subject: nothing earlier to compare with"]
        if self.status == "same-components":
            return [
                *head,
                f"  same recorded components as {self.previous_key} (the key folded something unrecorded)",
            ]
        return [*head, f"  compared with {self.previous_key}:"] + [f"  - {c.line()}" for c in self.changes]


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
    # A bare name: a plan node id, a step's function name (its qualname) or its node name.
    subjects = cache_index.subjects_named(local.db, key_or_subject)
    if len(subjects) > 1:
        shown = ", ".join(subjects[:10]) + (f" and {len(subjects) - 10} more" if len(subjects) > 10 else "")
        raise CacheError(
            "not_found",
            f"{key_or_subject!r} names several subjects ({shown}); pass one of them in full",
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
    explained = _explained(row.subject, row.key, row.components, prev)
    isolation = (row.provenance or {}).get("isolation")
    if isinstance(isolation, str):
        explained = dataclasses.replace(explained, isolation=isolation)
    renewed = _renewed(row)
    if renewed is not None:
        explained = dataclasses.replace(explained, renewed=renewed)
    if row.scope != "run-local":
        return explained
    return dataclasses.replace(explained, run_local=_kept_run_local(local, row))


def _kept_run_local(local: LocalTier, row: LocalRow) -> KeptRunLocal:
    """Why ``row`` stayed run-local, from its entry's own claims and evidence (what admission decided then)."""
    entry = local.load(row.key_digest)
    if not isinstance(entry, CacheEntry):
        return KeptRunLocal("unknown", "its entry cannot be read back to tell which admission rule it failed")
    verdict = admit_entry(entry.admission, entry.evidence)
    if isinstance(verdict, NotAdmissible):
        return KeptRunLocal(verdict.conjunct, verdict.reason)
    return KeptRunLocal("unknown", "it failed cache admission when it was built")


def _renewed(row: LocalRow) -> Renewed | None:
    """The renewal ``row``'s entry recorded (``provenance.renewed``, written by the dispatch seam), if any."""
    got = (row.provenance or {}).get("renewed")
    if not isinstance(got, Mapping) or not isinstance(got.get("reason"), str):
        return None
    tier = got.get("tier")
    return Renewed(
        got["reason"],
        tier if isinstance(tier, str) else None,
        _ms(got.get("age_ms")),
        _ms(got.get("max_age_ms")),
    )


def _ms(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


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
