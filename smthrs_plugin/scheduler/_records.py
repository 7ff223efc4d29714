"""The canonical text of the records and rows the scheduler writes for every node, composed from parts.

Why: a pass writes, per node, three journal records (``node-scheduled``, ``attempt-finished``, ``node-settled``)
and two attempt-row JSON columns (its ``meta`` at begin and at settlement). Encoding each through the generic
canonical walk (``canonical.canonical_bytes``) was a large share of a durable no-op node. Their members are ids the
plan compiler validated, keys this process computed, small ints and closed-vocabulary tags, validated here once
when they enter (:func:`quoted`): the text is then written by concatenation.

Invariant: every function returns exactly ``canonical_bytes(payload).decode()`` of the payload it stands for, or
``None`` when it cannot prove that (a member outside the shapes spelled here: a non-ASCII id, an int outside the
JSON-safe range, extra meta members, deviations); the caller then takes the generic path, which encodes — or
refuses — the payload as it always did. Members are written in RFC 8785 order (all ASCII names, sorted).
"""

from __future__ import annotations

from collections.abc import Callable
from json.encoder import encode_basestring
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from ..records.journal import Journal

__all__ = [
    "append_record",
    "quoted",
    "scheduled_text",
    "finished_text",
    "settled_text",
    "begin_meta_text",
    "settle_meta_text",
]

_SAFE_INT = 2**53 - 1
#: Meta members a scheduler attempt row carries at begin (compensable nodes add more: the generic path).
_BEGIN_META = frozenset({"plan_id", "node_id", "tier", "ordinal"})


def append_record(
    journal: Journal, conn: Connection, run_id: str, kind: str, text: str | None, payload: Callable[[], Any]
) -> None:
    """Append the record as the canonical ``text`` composed from validated parts, or — when a part could not be
    composed (None) — as ``payload()``, validated and written by the journal."""
    if text is not None:
        journal.append_canonical_in(conn, run_id, kind, text)
    else:
        journal.append_in(conn, run_id, kind, payload())


def quoted(s: Any) -> str | None:
    """The JSON text of ``s`` when it is an ASCII string (no surrogate can hide there; the escaping of the C
    encoder is RFC 8785's for ASCII), else None."""
    if type(s) is not str or not s.isascii():
        return None
    return encode_basestring(s)


def _int(v: Any) -> str | None:
    if type(v) is not int or not -_SAFE_INT <= v <= _SAFE_INT:
        return None
    return str(v)


def _members(*members: tuple[str, str | None]) -> str | None:
    """``{"name":text,...}`` from members given in RFC 8785 order; None when any text is None (not provable)."""
    if any(text is None for _, text in members):
        return None
    return "{" + ",".join(f'"{name}":{text}' for name, text in members) + "}"


def scheduled_text(plan: str | None, node: str | None, key: str, attempt: int, waited: int) -> str | None:
    """``node-scheduled {plan_id, node_id, dispatch_key, attempt, waited}``; ``plan``/``node`` are
    :func:`quoted` texts."""
    return _members(
        ("attempt", _int(attempt)),
        ("dispatch_key", quoted(key)),
        ("node_id", node),
        ("plan_id", plan),
        ("waited", _int(waited)),
    )


def finished_text(plan: str | None, node: str | None, key: str, attempt: int, outcome: str) -> str | None:
    """``attempt-finished {plan_id, node_id, dispatch_key, attempt, outcome}``."""
    return _members(
        ("attempt", _int(attempt)),
        ("dispatch_key", quoted(key)),
        ("node_id", node),
        ("outcome", quoted(outcome)),
        ("plan_id", plan),
    )


def settled_text(
    plan: str | None,
    node: str | None,
    plan_key: str,
    key: str | None,
    outcome: str,
    attempts: int,
    rebases: int,
) -> str | None:
    """``node-settled {plan_id, node_id, plan_key, dispatch_key?, outcome, attempts, rebases}`` (``job.settled_payload``)."""
    members: list[tuple[str, str | None]] = [("attempts", _int(attempts))]
    if key is not None:
        members.append(("dispatch_key", quoted(key)))
    members += [
        ("node_id", node),
        ("outcome", quoted(outcome)),
        ("plan_id", plan),
        ("plan_key", quoted(plan_key)),
        ("rebases", _int(rebases)),
    ]
    return _members(*members)


def begin_meta_text(meta: dict[str, Any]) -> str | None:
    """The ``meta`` column of a begun attempt: ``{plan_id, node_id, tier, ordinal}``."""
    if type(meta) is not dict or meta.keys() != _BEGIN_META:
        return None
    return _meta_tail("{", meta)


def settle_meta_text(
    meta: dict[str, Any], outcome: str, decision: str | None, deviations: list[Any]
) -> str | None:
    """The ``meta`` column of a settled attempt: the begin meta plus ``outcome``, ``decision`` (a tag or null) and
    ``deviations`` (only an empty list is written here)."""
    if deviations or type(meta) is not dict or meta.keys() != _BEGIN_META:
        return None
    d = "null" if decision is None else quoted(decision)
    o = quoted(outcome)
    if d is None or o is None:
        return None
    head = '{"decision":' + d + ',"deviations":[],'
    tail = _meta_tail("", meta, outcome=o)
    return None if tail is None else head + tail


def _meta_tail(head: str, meta: dict[str, Any], outcome: str | None = None) -> str | None:
    node, ordinal, plan, tier = (
        quoted(meta["node_id"]),
        _int(meta["ordinal"]),
        quoted(meta["plan_id"]),
        quoted(meta["tier"]),
    )
    if node is None or ordinal is None or plan is None or tier is None:
        return None
    return (
        head
        + '"node_id":'
        + node
        + ',"ordinal":'
        + ordinal
        + (',"outcome":' + outcome if outcome is not None else "")
        + ',"plan_id":'
        + plan
        + ',"tier":'
        + tier
        + "}"
    )
