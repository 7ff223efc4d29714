"""The identity boundary every control mutation crosses first. PURE (no I/O).

It sits at the root, below the stores, because the control records' owner (``records.control``) decodes stored
principals into :class:`Principal`; other packages import it through ``smthrs_plugin.control.identity``.

Invariants
- Nothing downstream ever sees the caller's object. :func:`decode_input` makes a *copy* by an iterative walk and
  admits only values whose type is *exactly* ``dict``, ``list``, ``str``, ``int``, ``float``, ``bool`` or
  ``None``. Subclasses, tuples, bytes, objects with properties, ``__getattr__``, ``__iter__`` or ``__eq__``
  tricks, non-``str`` keys, cycles, NaN/±Infinity, integers outside ±(2**53-1) and lone surrogates are refused
  with :class:`~smthrs_plugin.errors.InvalidInput`. The walk never calls caller code: it only asks
  ``type(x) is T`` and then uses the built-in behaviour of the exact built-in type (a getter that answers one value
  to the fingerprint and another to the write is the whole exploit).
- The copy is bounded before it is used: canonical bytes <= 4 MiB, container nesting depth <= 128, <= 100,000
  JSON values, <= 100,000 array items + object fields; an idempotency key is 1-1,024 well-formed characters
  (code points, no lone surrogate, no NUL). Every refusal names its ``bound`` and says what to do.
  Depth is checked *before* a container's children are pushed, so hostile depth can never become a
  ``RecursionError``. Every value visit is counted, so a DAG of shared sub-objects cannot blow up either.
- Durable key = operation + caller key + digest of the principal's (kind, id) when a principal is present.
  The fingerprint is SHA-256 of canonical ``{operation, actorId, actorKind, mutation}`` with exactly
  ``input.principal`` and ``input.message.principal`` removed (server-stamped, wall-clock bearing fields), at
  their own depth only: a ``principal`` nested in a signal payload is part of what the caller asked for.

Prior art: Stripe's idempotency keys (same key + different request = error, never a silent replay) and the
copy-then-validate rule of TOCTOU-safe system call boundaries (copy_from_user before checking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeAlias, Union, cast

from .canonical import canonical_bytes, key, sha256_hex
from .errors import CanonicalError, InvalidInput

__all__ = [
    "JSON",
    "Principal",
    "LOCAL_OPERATOR",
    "Mutation",
    "decode_input",
    "check_idempotency_key",
    "check_operation",
    "durable_key",
    "fingerprint",
    "principal_digest",
    "strip_stamped_principals",
    "MAX_CANONICAL_BYTES",
    "MAX_DEPTH",
    "MAX_VALUES",
    "MAX_ENTRIES",
    "MAX_KEY_CHARS",
    "MAX_NAME_CHARS",
    "BOUNDS",
    "refuse",
    "check_text",
    "type_name",
]

JSON: TypeAlias = Union[None, bool, int, float, str, "list[JSON]", "dict[str, JSON]"]

MAX_CANONICAL_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 128
MAX_VALUES = 100_000
MAX_ENTRIES = 100_000
MAX_KEY_CHARS = 1_024
#: Operation names, principal ids and kinds: same shape as an idempotency key.
MAX_NAME_CHARS = 1_024
_SAFE_INT = 2**53 - 1

#: Every ``bound`` an :class:`InvalidInput` raised here can carry (a closed set, like error codes).
BOUNDS = frozenset(
    {
        "canonical_bytes",
        "depth",
        "values",
        "entries",
        "idempotency_key",
        "plain_data",
        "duplicate_member",
        "cycle",
        "number",
        "well_formed_text",
        "principal",
        "operation",
        # value objects built from caller input in cards.py
        "envelope",
        "plan_card",
        "grant_scope",
    }
)

_SURROGATE = re.compile("[\ud800-\udfff]")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
# Descriptors of ``type`` itself: reading a class name through them bypasses any metaclass property, so even the
# refusal message never runs caller code.
_TYPE_QUALNAME = type.__dict__["__qualname__"]
_TYPE_MODULE = type.__dict__["__module__"]


def refuse(bound: str, message: str, *, path: str | None = None, **details: Any) -> InvalidInput:
    """An :class:`InvalidInput` for ``bound`` (one of :data:`BOUNDS`); ``message`` must say what to do."""
    if bound not in BOUNDS:
        raise ValueError(f"unknown bound {bound!r}; known: {sorted(BOUNDS)}")
    if path is not None:
        details["path"] = path
    return InvalidInput("invalid_input", f"{message} (bound {bound!r})", bound=bound, **details)


def type_name(t: type) -> str:
    """``module.qualname`` of ``t`` read through ``type``'s own descriptors: never runs a metaclass property."""
    qualname = _TYPE_QUALNAME.__get__(t, type)
    try:
        module = _TYPE_MODULE.__get__(t, type)
    except AttributeError:  # a class made where globals have no __name__: the name is all we can show
        module = "?"
    module = module if type(module) is str else "?"
    qualname = qualname if type(qualname) is str else "?"
    return qualname if module == "builtins" else f"{module}.{qualname}"


def _render(loc: Any) -> str:
    # ``loc`` is a linked list (parent, segment); built only when a refusal needs it.
    segments: list[str] = []
    while loc is not None:
        loc, seg = loc
        if type(seg) is int:
            segments.append(f"[{seg}]")
        elif _IDENT.match(seg):
            segments.append(f".{seg}")
        else:
            shown = seg if len(seg) <= 32 else seg[:32] + "..."
            segments.append("[" + shown.encode("unicode_escape").decode("ascii").join('""') + "]")
    # A depth refusal's location is 128 segments long; the innermost segments are the informative part.
    kept: list[str] = []
    width = 0
    for seg in segments:  # innermost first
        width += len(seg)
        if width > 160:
            kept.append("...")
            break
        kept.append(seg)
    return "$" + "".join(reversed(kept))


def _ill_formed(s: str) -> bool:
    # ASCII strings (the common case) are answered by a flag CPython keeps on the object.
    return not s.isascii() and _SURROGATE.search(s) is not None


def decode_input(value: object) -> JSON:
    """Copy ``value`` into plain JSON data, or refuse with :class:`InvalidInput` naming the violated ``bound``.

    The returned copy shares nothing mutable with ``value``. Object member order is preserved (it does not
    matter to the canonical form, but it keeps what a reviewer sees familiar).
    """
    holder: list[Any] = [None]
    # Stack entries: (item, target container, slot in target, depth of the enclosing container, location).
    # A ``None`` target marks the end of a container (its id leaves the ancestor set used for cycle detection).
    stack: list[tuple[Any, Any, Any, int, Any]] = [(value, holder, 0, 0, None)]
    on_path: set[int] = set()
    values = 0
    entries = 0
    text = 0  # lower bound of the canonical size: every character costs at least one byte
    while stack:
        item, target, slot, depth, loc = stack.pop()
        if target is None:
            on_path.discard(item)
            continue
        values += 1
        if values > MAX_VALUES:
            raise refuse(
                "values",
                f"input has more than {MAX_VALUES:,} JSON values; send fewer values, or store bulk data as an"
                " artifact and pass its digest",
                path=_render(loc),
                limit=MAX_VALUES,
            )
        t = type(item)
        if t is str:
            text += len(item)
            if text > MAX_CANONICAL_BYTES:
                raise _bytes_refusal(_render(loc))
            if _ill_formed(item):
                raise refuse(
                    "well_formed_text",
                    f"string at {_render(loc)} contains a lone surrogate, which has no UTF-8 form;"
                    " send well-formed Unicode text",
                    path=_render(loc),
                )
            target[slot] = item
        elif item is None or t is bool:
            target[slot] = item
        elif t is int:
            if not -_SAFE_INT <= item <= _SAFE_INT:
                raise refuse(
                    "number",
                    f"integer at {_render(loc)} is outside the JSON-safe range ±(2**53-1); pass it as a string",
                    path=_render(loc),
                )
            target[slot] = item
        elif t is float:
            if item != item or item in (float("inf"), float("-inf")):
                raise refuse(
                    "number",
                    f"number at {_render(loc)} is NaN or infinite and has no JSON form; use null or a string",
                    path=_render(loc),
                )
            target[slot] = item
        elif t is dict or t is list:
            depth += 1
            if depth > MAX_DEPTH:
                raise refuse(
                    "depth",
                    f"input is nested deeper than {MAX_DEPTH} levels at {_render(loc)}; flatten it, or store the"
                    " deep part as an artifact and pass its digest",
                    path=_render(loc),
                    limit=MAX_DEPTH,
                )
            # One C-level snapshot of the members (no caller code can run during it, so no other thread can
            # interleave): the walk below reads the snapshot, never the caller's container again.
            members: Any = tuple(item) if t is list else tuple(item.items())
            n = len(members)
            entries += n
            # Checked before any child is visited: one huge container is refused without walking it.
            if entries > MAX_ENTRIES:
                raise refuse(
                    "entries",
                    f"input has more than {MAX_ENTRIES:,} array items and object fields in total (reached at"
                    f" {_render(loc)}); send fewer, or store bulk data as an artifact and pass its digest",
                    path=_render(loc),
                    limit=MAX_ENTRIES,
                )
            ident = id(item)
            if ident in on_path:
                raise refuse(
                    "cycle",
                    f"input contains a reference cycle at {_render(loc)}; JSON data is a tree, send a copy"
                    " without the back-reference",
                    path=_render(loc),
                )
            on_path.add(ident)
            stack.append((ident, None, None, depth, None))
            if t is list:
                copy_list: list[Any] = [None] * n
                target[slot] = copy_list
                for i in range(n - 1, -1, -1):
                    stack.append((members[i], copy_list, i, depth, (loc, i)))
            else:
                copy_dict: dict[str, Any] = {}
                target[slot] = copy_dict
                children = []
                for k, v in members:
                    if type(k) is not str:
                        raise refuse(
                            "plain_data",
                            f"object at {_render(loc)} has a key of type {type_name(type(k))}; JSON object"
                            " keys must be exactly str",
                            path=_render(loc),
                        )
                    text += len(k)
                    if text > MAX_CANONICAL_BYTES:
                        raise _bytes_refusal(_render(loc))
                    if _ill_formed(k):
                        raise refuse(
                            "well_formed_text",
                            f"an object key at {_render(loc)} contains a lone surrogate; send well-formed"
                            " Unicode text",
                            path=_render(loc),
                        )
                    copy_dict[k] = None  # reserve the slot so the copy keeps the caller's member order
                    children.append((v, copy_dict, k, depth, (loc, k)))
                children.reverse()
                stack.extend(children)
        else:
            raise refuse(
                "plain_data",
                f"value at {_render(loc)} is a {type_name(t)}, not plain JSON data (exactly dict, list, str,"
                " int, float, bool or None; subclasses and tuples are refused); convert it explicitly",
                path=_render(loc),
            )
    decoded = holder[0]
    try:
        size = len(canonical_bytes(decoded))
    except CanonicalError as exc:  # pragma: no cover - the walk above refuses everything canonical refuses
        raise refuse("plain_data", f"input has no canonical JSON form: {exc.message}") from exc
    if size > MAX_CANONICAL_BYTES:
        raise _bytes_refusal(None, size=size)
    return decoded


def _bytes_refusal(path: str | None, *, size: int | None = None) -> InvalidInput:
    measured = f" ({size:,} bytes)" if size is not None else ""
    return refuse(
        "canonical_bytes",
        f"input is larger than {MAX_CANONICAL_BYTES:,} canonical JSON bytes{measured}; store large data as an"
        " artifact and pass its digest instead",
        path=path,
        limit=MAX_CANONICAL_BYTES,
    )


def check_text(value: object, bound: str, what: str, *, limit: int = MAX_NAME_CHARS) -> str:
    """``value`` when it is exactly a str of 1..``limit`` well-formed characters without NUL; else refuse."""
    if type(value) is not str:
        raise refuse(bound, f"{what} must be a str, got a {type_name(type(value))}")
    n = len(value)
    if not 1 <= n <= limit:
        raise refuse(
            bound,
            f"{what} must be 1 to {limit:,} characters, got {n:,}; choose a shorter name for the intent",
            limit=limit,
        )
    if "\x00" in value:
        raise refuse(bound, f"{what} contains a NUL character; remove it")
    if _ill_formed(value):
        raise refuse(bound, f"{what} contains a lone surrogate; use well-formed Unicode text")
    return value


def check_idempotency_key(idempotency_key: object) -> str:
    """Return the key when it is 1-1,024 well-formed characters without NUL; else :class:`InvalidInput`.

    A good key names the intent (``deploy:v1.4.0``, ``cancel:run-17``); reusing it for another intent answers
    ``Conflict``.
    """
    return check_text(idempotency_key, "idempotency_key", "the idempotency key", limit=MAX_KEY_CHARS)


def check_operation(operation: object) -> str:
    """Return the operation name (``run``, ``approve``, ...) when well-formed; else :class:`InvalidInput`."""
    return check_text(operation, "operation", "the operation name", limit=MAX_NAME_CHARS)


@dataclass(frozen=True)
class Principal:
    """Who asks: a stable ``(id, kind)`` pair. The default is the fixed local identity ``local/operator``.

    A principal is supplied by authentication, never trusted from a caller's payload: transports overwrite
    caller-supplied ``principal`` fields.
    """

    id: str = "local"
    kind: str = "operator"

    def __post_init__(self) -> None:
        check_text(self.id, "principal", "the principal id", limit=MAX_NAME_CHARS)
        check_text(self.kind, "principal", "the principal kind", limit=MAX_NAME_CHARS)

    def __str__(self) -> str:
        return f"{self.id}/{self.kind}"

    def to_json(self) -> dict[str, str]:
        """``{"id": ..., "kind": ...}``."""
        return {"id": self.id, "kind": self.kind}

    @classmethod
    def from_json(cls, value: object) -> Principal:
        """Decode ``{"id": str, "kind": str}`` (exactly those members) or refuse with :class:`InvalidInput`."""
        data = decode_input(value)
        if type(data) is not dict or set(data) != {"id", "kind"}:
            raise refuse(
                "principal", 'a principal is an object {"id": str, "kind": str} with no other members'
            )
        return cls(id=data["id"], kind=data["kind"])  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: object) -> Principal:
        """Parse the ``ID/KIND`` notation used by ``smthrs approve --as`` (split at the last ``/``)."""
        if type(text) is not str or "/" not in text:
            raise refuse("principal", "write a principal as ID/KIND, for example local/operator")
        ident, _, kind = text.rpartition("/")
        return cls(id=ident, kind=kind)


#: The fixed local identity the default approval policy recognises.
LOCAL_OPERATOR = Principal()


def principal_digest(principal: Principal) -> str:
    """Plain hex SHA-256 of canonical ``{"id", "kind"}``: the principal's part of a durable key."""
    if type(principal) is not Principal:
        raise refuse("principal", f"expected a Principal, got a {type_name(type(principal))}")
    return sha256_hex(canonical_bytes(principal.to_json()))


def durable_key(operation: str, idempotency_key: str, principal: Principal | None) -> str:
    """The key a receipt is stored under: ``key({operation, idempotencyKey, principal: digest?})``.

    The principal member is omitted (not ``null``) when there is none. A stamped wall-clock time is never part
    of it: a retried call must land on the same key.
    """
    material: dict[str, JSON] = {
        "operation": check_operation(operation),
        "idempotencyKey": check_idempotency_key(idempotency_key),
    }
    if principal is not None:
        material["principal"] = principal_digest(principal)
    return key(material)


def strip_stamped_principals(mutation: JSON) -> JSON:
    """``mutation`` without ``input.principal`` and ``input.message.principal`` (and nothing else).

    Shallow copies on the two touched levels only; ``mutation`` itself is not modified.
    """
    if type(mutation) is not dict:
        return mutation
    inp = mutation.get("input")
    if type(inp) is not dict:
        return mutation
    stripped = {k: v for k, v in inp.items() if k != "principal"}
    message = stripped.get("message")
    if type(message) is dict and "principal" in message:
        stripped["message"] = {k: v for k, v in message.items() if k != "principal"}
    return {**mutation, "input": stripped}


def fingerprint(operation: str, actor: Principal | None, mutation: Mutation | JSON) -> str:
    """Plain hex SHA-256 of canonical ``{operation, actorId, actorKind, mutation}`` (stamped principals removed).

    ``mutation`` is a :class:`Mutation` (its ``{"input": ...}`` body is used) or already-decoded JSON. The actor
    members are omitted when there is no actor. Equal fingerprints under one durable key replay the recorded
    receipt; different ones answer ``Conflict``.
    """
    # ``type(...) is`` rather than isinstance: isinstance may read a hostile ``__class__`` property.
    body: JSON = cast(Mutation, mutation).body() if type(mutation) is Mutation else cast(JSON, mutation)
    material: dict[str, JSON] = {
        "operation": check_operation(operation),
        "mutation": strip_stamped_principals(body),
    }
    if actor is not None:
        if type(actor) is not Principal:
            raise refuse("principal", f"the actor must be a Principal, got a {type_name(type(actor))}")
        material["actorId"] = actor.id
        material["actorKind"] = actor.kind
    return sha256_hex(canonical_bytes(material))


@dataclass(frozen=True, eq=True)
class Mutation:
    """One control mutation after the identity boundary: constructing it *is* crossing the boundary.

    ``input`` is replaced by its decoded, bounded copy in ``__post_init__``, so a ``Mutation`` never holds
    the caller's object. Build it first, before any lookup or write.
    """

    operation: str
    idempotency_key: str
    input: JSON
    principal: Principal | None = None

    def __post_init__(self) -> None:
        check_operation(self.operation)
        check_idempotency_key(self.idempotency_key)
        if self.principal is not None and type(self.principal) is not Principal:
            raise refuse(
                "principal", f"principal must be a Principal or None, got a {type_name(type(self.principal))}"
            )
        object.__setattr__(self, "input", decode_input(self.input))

    __hash__ = None  # type: ignore[assignment]  # holds mutable JSON; compare, never hash

    def body(self) -> dict[str, JSON]:
        """``{"input": input}``: the part of the mutation its fingerprint covers (besides operation and actor)."""
        return {"input": self.input}

    @property
    def durable_key(self) -> str:
        """:func:`durable_key` of this mutation."""
        return durable_key(self.operation, self.idempotency_key, self.principal)

    @property
    def fingerprint(self) -> str:
        """:func:`fingerprint` of this mutation, with its principal as the actor."""
        return fingerprint(self.operation, self.principal, self)

    def to_json(self) -> dict[str, JSON]:
        """``{operation, idempotencyKey, input, principal?}`` for storage or display."""
        out: dict[str, JSON] = {
            "operation": self.operation,
            "idempotencyKey": self.idempotency_key,
            "input": self.input,
        }
        if self.principal is not None:
            out["principal"] = dict(self.principal.to_json())
        return out
