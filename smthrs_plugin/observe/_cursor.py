"""Opaque continuation cursors of the read APIs (watch, catalog, related), and the text bounds of their inputs.

Invariants:

- A cursor is ``smc1.<base64url(canonical JSON body)>.<check>``: versioned (the ``smc1`` prefix; an unknown
  version is refused, never reinterpreted), with a ``kind`` (``watch``/``runs``/``related``) so that a cursor of
  one API is never accepted by another, and bound to the database's source identity. ``check`` is a truncated
  SHA-256 of the body: an edited or truncated cursor is ``invalid_cursor`` instead of a silently different
  position. It is an integrity check, not a signature: cursors are continuation values, never authorization
  (anyone may read from any position they could name anyway).
- Decoding order: shape, version, check, JSON, kind → ``invalid_cursor``; then the source → ``source_changed``
  (the cursor is well formed but was issued by another database, or by this one before a restore replaced it).
  The caller then checks its own binding (partition, filter tuple, anchor) → ``invalid_cursor``.
- Cursor input is bounded (65,536 characters) before any decoding work; every number it decodes to is an int in
  ``0 <= n < 2**63`` (``invalid_cursor`` otherwise: a forged ``at = 2**70`` never reaches the database).

Prior art: the reference's version-1 catalog cursor (filter before pagination); Relay-style
opaque cursors.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from ..canonical import canonical_bytes, sha256_hex
from ..errors import CanonicalError, ControlError, InvalidInput

__all__ = [
    "encode_cursor",
    "decode_cursor",
    "MAX_CURSOR_CHARS",
    "MAX_CURSOR_INT",
    "MAX_TEXT_UNITS",
    "check_text",
    "check_limit",
]

_PREFIX = "smc1"
_CHECK_CHARS = 16
MAX_CURSOR_CHARS = 65_536
#: Every integer a cursor decodes to is in 0 <= n < MAX_CURSOR_INT (a signed 64-bit column's range).
MAX_CURSOR_INT = 2**63
#: Run ids and equality-filter texts: non-empty, at most this many UTF-16 code units, no NUL, no lone surrogate.
MAX_TEXT_UNITS = 1024


def encode_cursor(kind: str, source: str, body: dict[str, Any]) -> str:
    """The opaque cursor for ``body`` of API ``kind`` issued by database ``source``."""
    payload = canonical_bytes({"v": 1, "kind": kind, "src": source, **body})
    text = base64.urlsafe_b64encode(payload).decode("ascii").rstrip("=")
    return f"{_PREFIX}.{text}.{sha256_hex(payload)[:_CHECK_CHARS]}"


def decode_cursor(cursor: object, *, kind: str, source: str, what: str = "cursor") -> dict[str, Any]:
    """The body of a cursor of API ``kind``; see module invariants for the refusals and their order."""
    if not isinstance(cursor, str):
        raise _invalid(what, f"must be a string returned by this API, got {type(cursor).__name__}")
    if len(cursor) > MAX_CURSOR_CHARS:
        raise _invalid(what, f"is longer than {MAX_CURSOR_CHARS} characters")
    parts = cursor.split(".")
    if len(parts) != 3 or not parts[1]:
        raise _invalid(what, "is not a cursor this API issued (expected smc1.<body>.<check>)")
    version, text, check = parts
    if version != _PREFIX:
        raise _invalid(what, f"has version {version[:16]!r}; this version understands only {_PREFIX!r}")
    try:
        payload = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise _invalid(what, "does not decode (base64)", exc) from exc
    if sha256_hex(payload)[:_CHECK_CHARS] != check:
        raise _invalid(what, "fails its integrity check (edited or truncated)")
    try:
        body = json.loads(payload)
    # RecursionError: a forged body nested past the JSON parser's stack.
    except (ValueError, RecursionError) as exc:
        raise _invalid(what, "does not decode (JSON)", exc) from exc
    if not isinstance(body, dict) or body.get("v") != 1 or not isinstance(body.get("src"), str):
        raise _invalid(what, "has an unknown layout")
    _check_numbers(body, what)
    if body.get("kind") != kind:
        raise _invalid(what, f"was issued by the {body.get('kind')!r} API, not by {kind!r}")
    if body["src"] != source:
        raise ControlError(
            "source_changed",
            f"{what} was issued by database source {body['src']!r}, but this database is {source!r} (another "
            "database, or a restore replaced it); start again without a cursor and rebuild what you derived",
            cursor_source=body["src"],
            source=source,
        )
    return body


def _check_numbers(body: Any, what: str) -> None:
    """Every number a cursor carries is an int in ``0 <= n < 2**63`` (a sequence, a timestamp, a revision): the
    check is only an integrity check, so a forged cursor can carry ``2**70`` or ``1e400``, which must be refused
    here rather than overflow a database parameter later. Iterative (a forged body may be deep)."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        elif type(value) is not int:
            raise _invalid(what, f"carries a non-integer number ({type(value).__name__})")
        elif not 0 <= value < MAX_CURSOR_INT:
            raise _invalid(what, f"carries an integer out of range (0 <= n < 2**63, got {str(value)[:40]})")


def _invalid(what: str, why: str, cause: BaseException | None = None) -> ControlError:
    return ControlError(
        "invalid_cursor",
        f"{what} {why}; pass a cursor exactly as returned by the previous page, or start again without one",
        cause=cause,
    )


def check_text(name: str, value: object, *, error: str = "invalid_options") -> str:
    """``value`` as a durable identifier/filter text, or a typed refusal naming ``name`` (see MAX_TEXT_UNITS).

    ``error`` picks the family: ``invalid_options`` (ControlError) for API options, ``invalid_input``
    (InvalidInput) for ids at the identity boundary."""
    why = None
    if not isinstance(value, str) or not value:
        why = f"must be a non-empty string, got {value!r}"[:200]
    elif "\x00" in value:
        why = "must not contain NUL"
    else:
        try:
            units = len(value.encode("utf-16-le")) // 2
        except UnicodeEncodeError:
            units = -1
        if units < 0:
            why = "must be well-formed text (it contains a lone surrogate)"
        elif units > MAX_TEXT_UNITS:
            why = f"must be at most {MAX_TEXT_UNITS} UTF-16 code units (got {units})"
    if why is None:
        assert isinstance(value, str)
        return value
    if error == "invalid_input":
        raise InvalidInput("invalid_input", f"{name} {why}", bound=name)
    raise ControlError("invalid_options", f"{name} {why}", option=name)


def check_limit(value: object, *, maximum: int, name: str = "limit") -> int:
    """An int page size in 1..maximum, else ``invalid_options`` (numbers are never clamped silently)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= maximum:
        raise ControlError(
            "invalid_options", f"{name} must be an int in 1..{maximum}, got {value!r}", option=name
        )
    return value


def canonical_or_invalid(value: Any, what: str) -> bytes:
    """Canonical bytes of an option value (filters) or ``invalid_options``."""
    try:
        return canonical_bytes(value)
    except CanonicalError as exc:
        raise ControlError("invalid_options", f"{what} is not plain data: {exc.message}", cause=exc) from exc
