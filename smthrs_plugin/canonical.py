"""RFC 8785 canonical JSON, ``key1_`` content keys and SHA-256 helpers.

Invariant: a key is a pure function of plain JSON data. ``key(v) = "key1_" + sha256(rfc8785(v)).hexdigest()``.
Nothing is coerced silently: a value that has no canonical JSON form (NaN, ±Infinity, non-str keys, cycles,
lone surrogates, bytes, integers outside the IEEE-754 safe range, arbitrary objects, str/int/dict subclasses)
raises :class:`~smthrs_plugin.errors.CanonicalError` instead of hashing a weaker, lossy form. An absent optional
field is modelled by omitting the member; ``None`` is JSON ``null`` and hashes differently.

The serialisation itself is delegated to the ``rfc8785`` package (UTF-16 member ordering, ECMAScript number
formatting); this module only guards its input so that every refusal is typed.

Fast path (byte-identical, proved by a hypothesis test against ``rfc8785``): the guard's walk also notes whether
the value holds a float whose Python ``repr`` is not its ECMAScript form, or an object key outside the Basic
Multilingual Plane. When it holds neither, the stdlib's C encoder (``sort_keys``, compact separators,
``ensure_ascii=False``) writes the same bytes, because the only places RFC 8785 differs from it are exactly those
two: ECMAScript number formatting and member order by UTF-16 code units (which equals code-point order for
BMP-only keys, but not for surrogate pairs vs U+E000..U+FFFF). RFC 8785's number form starts from the same
shortest round-trip digits as ``repr`` and rewrites only an integral float (``1.0`` → ``1``, ``0.0`` → ``0``)
and the exponent forms (``1e+16`` → ``10000000000000000``, ``1e-05`` → ``0.00001``); a float whose ``repr``
has neither a trailing ``.0`` nor an ``e`` (``0.25``, ``-3.125``, a rounded duration like ``12.345``) prints
alike in both, so it stays on the fast path. String escaping is the same in both
(quote, backslash, the five short C0 escapes, other C0 controls as lowercase 6-character unicode escapes,
everything else literal UTF-8); lone surrogates, non-str keys, cycles and unsafe integers never reach either
encoder. Anything else takes ``rfc8785``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

import rfc8785

from .errors import CanonicalError

__all__ = ["canonical_bytes", "key", "key_digest", "sha256_hex", "is_key", "MAX_DEPTH"]

KEY_PREFIX = "key1_"
#: Deeper structures are refused: recursion in the serialiser must never become a RecursionError.
MAX_DEPTH = 256
_SAFE_INT = 2**53 - 1
_SCALARS = (str, int, float, bool, type(None))


# The fast path's encoder (see the module docstring): only ever given values _check() proved plain (no float,
# BMP-only keys); cycles and NaN are refused by _check() before it runs.
_plain_encode = json.JSONEncoder(
    ensure_ascii=False, sort_keys=True, separators=(",", ":"), check_circular=False, allow_nan=False
).encode


def _check(value: Any) -> bool:
    """Refuse ``value`` unless it has a canonical form; return whether it is *plain* (every float printed alike by
    ``repr`` and ECMAScript, every object key inside the BMP), i.e. whether the stdlib encoder writes its RFC 8785
    bytes."""
    # Iterative walk with an explicit ancestor set: detects cycles (shared, acyclic sub-objects are fine)
    # and refuses anything that is not *exactly* a JSON type.
    plain = True
    stack: list[tuple[Any, int, bool]] = [(value, 0, False)]
    on_path: set[int] = set()
    while stack:
        item, depth, leaving = stack.pop()
        if leaving:
            on_path.discard(id(item))
            continue
        t = type(item)
        if t is str:
            _check_str(item)
            continue
        if t is bool or item is None:
            continue
        if t is int:
            if not -_SAFE_INT <= item <= _SAFE_INT:
                raise CanonicalError(
                    "not_canonicalizable",
                    f"integer {item} is outside the JSON-safe range ±(2**53-1); pass it as a string",
                )
            continue
        if t is float:
            if item != item or item in (float("inf"), float("-inf")):
                raise CanonicalError(
                    "not_canonicalizable", f"{item!r} has no JSON form; use null or a string instead"
                )
            if plain:
                # Only an integral float or an exponent form is written differently by ECMAScript (docstring).
                text = repr(item)
                plain = "e" not in text and not text.endswith(".0")
            continue
        if t is dict or t is list or t is tuple:
            if depth >= MAX_DEPTH:
                raise CanonicalError("not_canonicalizable", f"value nested deeper than {MAX_DEPTH} levels")
            if id(item) in on_path:
                raise CanonicalError("not_canonicalizable", "value contains a reference cycle")
            on_path.add(id(item))
            stack.append((item, depth, True))
            if t is dict:
                for k, v in item.items():
                    if type(k) is not str:
                        raise CanonicalError(
                            "not_canonicalizable",
                            f"object key {k!r} is a {type(k).__name__}; JSON object keys must be str",
                        )
                    _check_str(k)
                    # A non-BMP key is a surrogate pair in UTF-16: member order differs from code-point order.
                    if plain and not k.isascii() and max(k) > "\uffff":
                        plain = False
                    stack.append((v, depth + 1, False))
            else:
                for v in item:
                    stack.append((v, depth + 1, False))
            continue
        raise CanonicalError(
            "not_canonicalizable",
            f"a {t.__module__}.{t.__qualname__} is not plain JSON data (dict, list, str, int, float, bool, None);"
            " convert it explicitly (e.g. to a dict or a string) before keying it",
        )
    return plain


def _check_str(s: str) -> None:
    if s.isascii():
        return  # no surrogate can hide in ASCII; skips an encode for nearly every key and value
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CanonicalError(
            "not_canonicalizable", "string contains a lone surrogate; it has no UTF-8 form", cause=exc
        ) from exc


def canonical_bytes(value: Any) -> bytes:
    """RFC 8785 bytes of ``value``; :class:`CanonicalError` when it has no canonical form."""
    if _check(value):
        return _plain_encode(value).encode("utf-8")
    try:
        return rfc8785.dumps(value)
    except rfc8785.CanonicalizationError as exc:  # pragma: no cover - _check refuses first
        raise CanonicalError("not_canonicalizable", str(exc), cause=exc) from exc


def sha256_hex(data: bytes) -> str:
    """Plain hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def key(value: Any) -> str:
    """``"key1_" + sha256(canonical(value))``: the content key of plain JSON data."""
    return KEY_PREFIX + sha256_hex(canonical_bytes(value))


def key_digest(k: str) -> str:
    """Row key of attempt and cache rows: hex SHA-256 of the UTF-8 of a ``key1_`` key."""
    if not is_key(k):
        raise CanonicalError("not_canonicalizable", f"{k!r} is not a key1_ key")
    return _key_digest(k)


@functools.lru_cache(maxsize=8192)
def _key_digest(k: str) -> str:
    # A node's key is digested at its begin, its settlement and every read of its rows: remember the recent ones
    # (a pure function of a validated string; the bound is on memory only).
    return sha256_hex(k.encode("utf-8"))


#: ``key1_`` and 64 lowercase hex digits, nothing else (``\Z``: not even a trailing newline).
_KEY_RE = re.compile(re.escape(KEY_PREFIX) + r"[0-9a-f]{64}\Z")


def is_key(k: object) -> bool:
    """True for a well-formed ``key1_<64 lowercase hex>`` string."""
    return type(k) is str and _KEY_RE.match(k) is not None
