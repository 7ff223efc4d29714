"""The one JSON decoder for text this process did not write: shared-tier entries and revocation markers, ``/rpc``
request bodies, the CLI's JSON arguments, remote workers' frames and deltas.

Invariants
- **Bounded before parsing.** A document over ``max_bytes`` is refused by its length, before a parser sees it, and
  one with more containers and strings than an eighth of the cap by a count of their opening characters; so what
  parsing allocates is a small multiple of the cap.
- **Every refusal is typed**: :class:`~smthrs_plugin.errors.InvalidInput` with a ``bound`` naming the limit and a
  message saying what to send instead — never ``RecursionError``, ``MemoryError``-by-design, ``UnicodeDecodeError``
  or ``ValueError`` from ``int()``'s digit limit leaking to the caller.
- **One meaning per document.** Duplicate member names are refused (``{"ident": A, "ident": B}`` would otherwise
  mean B to this parser and A to another); ``NaN``/``Infinity`` constants and numbers that overflow a float are
  refused (they have no JSON form to re-encode); integers longer than :data:`MAX_INT_DIGITS` digits are refused
  (converting them costs quadratic time); text must be strict UTF-8 and a ``\\u`` escape must not leave a lone
  surrogate (which no UTF-8 encoder can write back).
- **Depth is bounded** at ``max_depth`` containers: a deeper document is refused whether the C parser's own
  recursion guard trips first or the walk after parsing finds it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import InvalidInput

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_INT_DIGITS",
    "decode_json",
]

#: The default cap on a document's encoded size.
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
#: Containers nested deeper than this are refused.
MAX_JSON_DEPTH = 128
#: An integer literal longer than this (sign excluded) is refused.
MAX_INT_DIGITS = 100


def _refuse(bound: str, what: str, message: str, **details: Any) -> InvalidInput:
    return InvalidInput("invalid_input", f"{what} {message} (bound {bound!r})", bound=bound, **details)


def decode_json(
    data: bytes | bytearray | memoryview | str,
    what: str,
    *,
    max_bytes: int = MAX_DOCUMENT_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """Parse ``data`` as one JSON document, bounded; ``what`` names it in refusals ("the request body", "shared
    entry ac/…"). Raises :class:`~smthrs_plugin.errors.InvalidInput` for anything outside the bounds."""
    if isinstance(data, str):
        size = len(data)  # characters: a lower bound of the UTF-8 size, checked again after encoding
        if size > max_bytes:
            raise _too_large(what, size, max_bytes)
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _lone_surrogate(what) from exc
    else:
        raw = bytes(data)
    if len(raw) > max_bytes:
        raise _too_large(what, len(raw), max_bytes)
    # Parsed, a container or a string costs ~60 bytes however short its text ("[]," is 3): counting their
    # opening characters (C-speed, conservative inside strings) bounds what parsing may allocate to a small
    # multiple of the text.
    items, most = raw.count(b"[") + raw.count(b"{") + raw.count(b'"') // 2, max(1024, max_bytes // 8)
    if items > most:
        raise _refuse(
            "values",
            what,
            f"holds about {items} containers and strings, more than a {max_bytes}-byte document may; send fewer",
            limit=most,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(
            "well_formed_text", what, f"is not UTF-8 text ({exc.reason} at byte {exc.start}); send UTF-8 JSON"
        ) from exc

    def no_constant(name: str) -> Any:
        raise _refuse(
            "number", what, f"holds {name}, which has no JSON form; send a finite number or a string"
        )

    def bounded_int(literal: str) -> int:
        if len(literal.lstrip("-")) > MAX_INT_DIGITS:
            raise _refuse(
                "number",
                what,
                f"holds an integer of {len(literal.lstrip('-'))} digits (at most {MAX_INT_DIGITS}); send it as a "
                "string",
                limit=MAX_INT_DIGITS,
            )
        return int(literal)

    def finite_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise _refuse(
                "number", what, f"holds {literal[:40]!r}, beyond a float's range; send it as a string"
            )
        return value

    def unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise _refuse(
                "duplicate_member",
                what,
                f"names member {dup[:80]!r} twice; an object's member names must be unique",
                member=dup[:80],
            )
        return out

    try:
        doc = json.loads(
            text,
            parse_constant=no_constant,
            parse_int=bounded_int,
            parse_float=finite_float,
            object_pairs_hook=unique_members,
        )
    except RecursionError as exc:
        raise _too_deep(what, max_depth) from exc
    except json.JSONDecodeError as exc:
        raise _refuse(
            "plain_data", what, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    _check_shape(doc, what, max_depth, check_text="\\u" in text)
    return doc


def _check_shape(doc: Any, what: str, max_depth: int, *, check_text: bool) -> None:
    """Depth (iteratively: a deep document must not exhaust this walk's stack either) and, when the text had
    ``\\u`` escapes, that every string can be written back as UTF-8."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                raise _too_deep(what, max_depth)
            if check_text:
                for k in value:
                    _check_text(k, what)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            if depth > max_depth:
                raise _too_deep(what, max_depth)
            stack.extend((v, depth + 1) for v in value)
        elif check_text and isinstance(value, str):
            _check_text(value, what)


def _check_text(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _lone_surrogate(what) from exc


def _lone_surrogate(what: str) -> InvalidInput:
    # Text holding a lone surrogate (given as such, or through a \u escape) has no UTF-8 form to write back.
    return _refuse(
        "well_formed_text", what, "holds a lone surrogate, which UTF-8 cannot encode; send UTF-8 text"
    )


def _too_large(what: str, size: int, limit: int) -> InvalidInput:
    return _refuse(
        "canonical_bytes",
        what,
        f"is {size} bytes, over the {limit}-byte limit; send a smaller document",
        limit=limit,
    )


def _too_deep(what: str, limit: int) -> InvalidInput:
    return _refuse("depth", what, f"is nested deeper than {limit} levels; flatten the structure", limit=limit)
