"""Plan declarations: inputs, effects, key material, node drafts, compiled nodes and plans. PURE.

Invariants
- Every model is frozen and validated at construction; a refusal is a typed :class:`PlanError` (never a bare
  pydantic ``ValidationError``) whose message names the node or path and says what to change.
- Plain-JSON payloads (literal values, bodies, approval/wait specs) are checked for a canonical form and copied
  at construction, so a later mutation of the caller's dict cannot change a declaration silently; a mutation
  of the model's own copy is caught by :func:`~smthrs_plugin.plan.compile.verify_plan`, which recomputes keys.
- An absent optional field (``nondeterministic``, ``approval``, ``wait``) is ``None`` in Python and is OMITTED
  from every canonical form and every dump, never written as ``null`` (``null`` hashes differently).
- ``priority`` is an exact ``int`` (``bool``, ``float`` and ``str`` refused) of any size; see
  ``compile.priority_json`` for how a priority beyond the JSON-safe range enters the plan digest.
- Node ids never enter a key: renaming a node keeps its key.

The shapes mirror the reference ``@smthrs/plan`` declarations; the convenience constructor
:func:`node` is the public spelling of a node declaration.
"""

from __future__ import annotations

import typing as t
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)
from pydantic import model_validator as _model_validator

from ..canonical import canonical_bytes
from ..errors import CanonicalError, PlanError
from .fileset import EntryInput, Glob, PathEntry, TreeArtifact, entries_overlap, flatten, static_prefix

__all__ = [
    "KEY_MATERIAL_VERSION",
    "sort_strings",
    "Value",
    "Ref",
    "Pending",
    "Input",
    "Effects",
    "KeyMaterial",
    "NodeDraft",
    "WriteConflict",
    "PlanNode",
    "Plan",
    "node",
    "Tier",
    "NodeKind",
    "ConflictStrategy",
    "RuntimeStrategy",
    "BoundaryMode",
]

KEY_MATERIAL_VERSION: t.Final = "flows/key-material/v1"

Tier = t.Literal["sealed", "compensable", "irreversible"]
NodeKind = t.Literal["step", "agent", "merge"]
ConflictStrategy = t.Literal["serialize", "lane", "fail"]
RuntimeStrategy = t.Literal["delay-rebase", "stop-merge"]
BoundaryMode = t.Literal["hard", "expected"]

_UNSET: Any = object()
_SAFE_INT = 2**53 - 1


def _absent(v: object) -> bool:
    return v is None


def _utf16(s: str) -> bytes:
    # surrogatepass: a string that bypassed validation still orders (its key is refused later, by canonical)
    return s.encode("utf-16-be", "surrogatepass")


def sort_strings(values: Iterable[str]) -> list[str]:
    """A string set as keys fold it: NFC-normalised, unique, ordered by UTF-16 code units (the order canonical
    JSON orders member names by, and the reference's string sort), so order and duplicates are not identity."""
    return sorted({unicodedata.normalize("NFC", x) for x in values}, key=_utf16)


def _plain_json(value: Any, what: str) -> Any:
    """Check that ``value`` has a canonical JSON form and return a private deep copy (tuples become lists)."""
    t = type(value)
    if (
        (t is str and value.isascii())
        or value is None
        or t is bool
        or (t is int and -_SAFE_INT <= value <= _SAFE_INT)
    ):
        return value  # a scalar canonical_bytes accepts as is (an ASCII string cannot hold a lone surrogate)
    try:
        canonical_bytes(value)
    except CanonicalError as exc:
        raise PlanError("invalid_node", f"{what} is not plain JSON data: {exc.message}", cause=exc) from exc
    return _copy_json(value)


def _copy_json(value: Any) -> Any:
    if type(value) is dict:
        return {k: _copy_json(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [_copy_json(v) for v in value]
    return value


def _plan_error(exc: ValidationError, model: str) -> PlanError:
    # pydantic wraps a validator's ValueError (PlanError is one) in a ValidationError: surface the typed error.
    for err in exc.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, PlanError):
            return inner
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or model
    return PlanError(
        "invalid_node",
        f"{model}: field {where!r} refused: {first.get('msg')} (input {first.get('input')!r}); "
        "fix that field of the declaration",
        cause=exc,
        field=where,
    )


class _PlanModel(BaseModel):
    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _plan_error(exc, type(self).__name__) from exc


# ----------------------------------------------------------------------------------------------- inputs


class Value(_PlanModel):
    """A constant input value (plain JSON). ``Value(3)``, ``Value({"k": [1, 2]})``; ``Value(None)`` is
    JSON null."""

    kind: t.Literal["literal"] = "literal"
    value: Any

    def __init__(self, value: Any = _UNSET, /, **data: Any) -> None:
        if value is not _UNSET:
            data["value"] = value
        super().__init__(**data)

    @field_validator("value", mode="before")
    @classmethod
    def _json(cls, v: Any) -> Any:
        return _plain_json(v, "Value")


def _dep_id(v: Any) -> str:
    if type(v) is not str or not v:
        raise PlanError(
            "invalid_node",
            f"dependency id {v!r} must be a non-empty string naming another node of the plan",
        )
    return v


class Ref(_PlanModel):
    """A material input: the result of node ``from`` (optionally projected along object keys ``path``).
    ``Ref("fetch", path=["value"])``. Folded into both keys: the upstream plan key into the plan key, the
    projected *value* into the dispatch key."""

    kind: t.Literal["ref"] = "ref"
    from_: Annotated[str, BeforeValidator(_dep_id)] = Field(alias="from")
    path: tuple[str, ...] = ()

    def __init__(self, from_: Any = _UNSET, /, **data: Any) -> None:
        if from_ is not _UNSET:
            data["from_"] = from_
        super().__init__(**data)

    @field_validator("path", mode="before")
    @classmethod
    def _path(cls, v: Any) -> tuple[str, ...]:
        if isinstance(v, str) or not isinstance(v, Iterable):
            raise PlanError("invalid_node", f"Ref path {v!r} must be a list of object keys, e.g. ['value']")
        out = tuple(v)
        for seg in out:
            if type(seg) is not str:
                raise PlanError(
                    "invalid_node",
                    f"Ref path segment {seg!r} must be a string (projection walks object keys)",
                )
            _plain_json(seg, "Ref path segment")
        return out


class Pending(_PlanModel):
    """An ordering-only dependency on node ``from``: its plan key is folded into the plan key, but it contributes
    only the constant ``"ordering-only"`` to the dispatch key and its value never reaches the executor."""

    kind: t.Literal["pending"] = "pending"
    from_: Annotated[str, BeforeValidator(_dep_id)] = Field(alias="from")

    def __init__(self, from_: Any = _UNSET, /, **data: Any) -> None:
        if from_ is not _UNSET:
            data["from_"] = from_
        super().__init__(**data)


Input = Annotated[Union[Value, Ref, Pending], Field(discriminator="kind")]


# ---------------------------------------------------------------------------------------------- effects


def _entries(v: Any) -> tuple[PathEntry, ...]:
    if isinstance(v, (str, Glob, TreeArtifact, Mapping)):
        v = [v]
    if not isinstance(v, Iterable):
        raise PlanError(
            "invalid_effects", f"{v!r} is not a list of path entries; pass e.g. ['src/**', 'dist/']"
        )
    items: list[EntryInput] = []
    for e in v:
        # a dumped TreeArtifact is {"path": ...}; flatten() spells the mapping form {"tree": ...}
        if isinstance(e, Mapping) and set(e) == {"path"}:
            e = TreeArtifact(path=e["path"])
        items.append(e)
    return flatten(items)


def _nest(a: str, b: str) -> bool:
    return a == "" or b == "" or a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _may_share_path(a: PathEntry, b: PathEntry) -> bool:
    """Could one path fall under both entries? Exact against a glob/tree is decided precisely; a glob is bounded
    by the static prefix of its include patterns (every match lies under it), which is sound and, unlike the
    cross-node conflict rule, does not make every glob pair of one node contradict itself."""
    if isinstance(a, Glob) and not isinstance(b, str):
        ra = [static_prefix(p) for p in a.include]
        rb = [static_prefix(p) for p in b.include] if isinstance(b, Glob) else [b.path]
        return any(_nest(x, y) for x in ra for y in rb)
    if isinstance(b, Glob) and not isinstance(a, str):
        return _may_share_path(b, a)
    return entries_overlap(a, b)


def check_write_remove(writes: Iterable[PathEntry], removes: Iterable[PathEntry]) -> None:
    """Refuse a declaration in which one path could be both written and removed (``invalid_effects``)."""
    rs = tuple(removes)
    for w in writes:
        for r in rs:
            if _may_share_path(w, r):
                raise PlanError(
                    "invalid_effects",
                    f"{_show(w)} is declared written and {_show(r)} removed, and they can name the same path; "
                    "a path is either produced or removed: narrow one of the two declarations",
                    write=_show(w),
                    remove=_show(r),
                )


def _show(e: PathEntry) -> str:
    if isinstance(e, str):
        return repr(e)
    if isinstance(e, TreeArtifact):
        return repr(e.path + "/")
    return "glob " + repr(list(e.include)) + (f" excluding {list(e.exclude)!r}" if e.exclude else "")


class Effects(_PlanModel):
    """Declared file effects. Entries are flattened at construction (filegroups expanded, ``"dist/"`` → tree,
    ``"src/*.py"`` → glob). ``boundary_mode``: ``hard`` refuses deviations, ``expected`` records them."""

    reads: tuple[PathEntry, ...] = ()
    writes: tuple[PathEntry, ...] = ()
    removes: tuple[PathEntry, ...] = ()
    boundary_mode: BoundaryMode = "hard"

    @field_validator("reads", "writes", "removes", mode="before")
    @classmethod
    def _flatten(cls, v: Any) -> tuple[PathEntry, ...]:
        return _entries(v)

    @_model_validator(mode="after")
    def _disjoint(self) -> Effects:
        check_write_remove(self.writes, self.removes)
        return self

    @property
    def produces(self) -> tuple[PathEntry, ...]:
        """``writes ∪ removes``: what this node changes in the workspace."""
        return self.writes + self.removes


# ------------------------------------------------------------------------------------------ key material


def _capabilities(v: Any) -> dict[str, tuple[str, ...]]:
    if v is None:
        return {}
    if isinstance(v, (list, tuple, set, frozenset)):
        v = {"declared": v}
    if not isinstance(v, Mapping):
        raise PlanError(
            "invalid_node",
            f"capabilities {v!r} must be a mapping group -> list of patterns, e.g. {{'declared': ['deploy:prod']}}",
        )
    out: dict[str, tuple[str, ...]] = {}
    for g, pats in v.items():
        if type(g) is not str or isinstance(pats, str) or not isinstance(pats, Iterable):
            raise PlanError(
                "invalid_node", f"capability group {g!r} must be a string mapped to a list of string patterns"
            )
        items = tuple(pats)
        for p in items:
            if type(p) is not str:
                raise PlanError("invalid_node", f"capability pattern {p!r} in group {g!r} must be a string")
            _plain_json(p, "capability pattern")
        out[g] = items
    return out


class KeyMaterial(_PlanModel):
    """Everything about a node that determines what it computes. ``tier`` is the reference's
    material ``kind``: ``sealed`` work is content-addressed; ``compensable``/``irreversible`` work is keyed
    run-locally. ``nondeterministic`` is absent unless declared."""

    version: t.Literal["flows/key-material/v1"] = KEY_MATERIAL_VERSION
    tier: Tier = "sealed"
    nondeterministic: t.Optional[bool] = Field(default=None, exclude_if=_absent)
    body: Any = Field(default_factory=dict)
    inputs: tuple[Input, ...] = ()
    layers: tuple[str, ...] = ()
    capabilities: dict[str, tuple[str, ...]] = Field(default_factory=dict)

    @field_validator("nondeterministic", mode="before")
    @classmethod
    def _strict_bool(cls, v: Any) -> Any:
        if v is not None and type(v) is not bool:
            raise PlanError("invalid_node", f"nondeterministic must be true, false or absent, not {v!r}")
        return v

    @field_validator("body", mode="before")
    @classmethod
    def _body(cls, v: Any) -> Any:
        return _plain_json(v, "node body")

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        if isinstance(v, (str, Mapping, Value, Ref, Pending)) or not isinstance(v, Iterable):
            raise PlanError("invalid_node", f"inputs {v!r} must be a list of Value, Ref or Pending")
        out = []
        for i, item in enumerate(v):
            if not isinstance(item, (Value, Ref, Pending, Mapping)):
                raise PlanError(
                    "invalid_node",
                    f"input #{i} is a {type(item).__name__} ({item!r}); wrap it: Value(value) for a constant, "
                    "Ref('node') for another node's result, Pending('node') for an ordering-only dependency",
                    input=i,
                )
            out.append(item)
        return tuple(out)

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v: Any) -> tuple[str, ...]:
        if isinstance(v, str) or not isinstance(v, Iterable):
            raise PlanError("invalid_node", f"layers {v!r} must be a list of strings")
        out = tuple(v)
        for x in out:
            if type(x) is not str:
                raise PlanError("invalid_node", f"layer {x!r} must be a string")
            _plain_json(x, "layer")
        return out

    @field_validator("capabilities", mode="before")
    @classmethod
    def _caps(cls, v: Any) -> dict[str, tuple[str, ...]]:
        return _capabilities(v)

    def normalized_layers(self) -> list[str]:
        """Layers as keyed: :func:`sort_strings` (NFC, unique, UTF-16 code-unit order)."""
        return sort_strings(self.layers)

    def normalized_capabilities(self) -> dict[str, list[str]]:
        """Capabilities as keyed: every group a :func:`sort_strings` pattern set, and the ``declared`` group
        always present (``[]`` when none), as the reference keys its one capability list."""
        caps = self.capabilities
        out = {"declared": sort_strings(caps.get("declared", ()))}
        for g, p in caps.items():
            if g != "declared":
                out[g] = sort_strings(p)
        return out


# ------------------------------------------------------------------------------------------------- nodes


def _exact_int(v: Any) -> int:
    if type(v) is not int:
        raise PlanError(
            "invalid_node",
            f"priority {v!r} is a {type(v).__name__}; it must be an exact integer (bool, float and str refused)",
        )
    return v


def _node_id(v: Any) -> str:
    if type(v) is not str or not v:
        raise PlanError("invalid_node", f"node id {v!r} must be a non-empty string, e.g. 'build'")
    if "\x00" in v:
        raise PlanError("invalid_node", f"node id {v!r} contains a NUL character; choose a printable id")
    if not v.isascii():  # an ASCII id is plain JSON as is; skip building the message
        _plain_json(v, f"node id {v!r}")
    return v


def _json_object(v: Any) -> Any:
    if v is None:
        return None
    if type(v) is not dict:
        raise PlanError("invalid_node", f"{v!r} must be a JSON object (a dict), or absent")
    return _plain_json(v, "approval/wait spec")


class NodeDraft(_PlanModel):
    """A node as declared, before compilation. ``approval`` / ``wait`` are optional plain-JSON specs (node
    approval gate, durable timer) that the scheduler interprets; when present they are part of the key."""

    id: Annotated[str, BeforeValidator(_node_id)]
    material: KeyMaterial
    effects: Effects = Field(default_factory=Effects)
    kind: NodeKind = "step"
    priority: Annotated[int, BeforeValidator(_exact_int)] = 0
    conflict_strategy: ConflictStrategy = "serialize"
    runtime_strategy: RuntimeStrategy = "delay-rebase"
    approval: Annotated[t.Optional[dict[str, Any]], BeforeValidator(_json_object)] = Field(
        default=None, exclude_if=_absent
    )
    wait: Annotated[t.Optional[dict[str, Any]], BeforeValidator(_json_object)] = Field(
        default=None, exclude_if=_absent
    )

    def dependencies(self) -> tuple[str, ...]:
        """Material dependencies (Ref and Pending), unique, in input order."""
        inputs = self.material.inputs
        if type(inputs) is tuple and not inputs:
            return ()
        seen: dict[str, None] = {}
        for i in inputs:
            if not isinstance(i, Value):
                seen.setdefault(i.from_, None)
        return tuple(seen)


class WriteConflict(_PlanModel):
    """Conflict annotation on each node of an overlapping pair (the new node only, when the other is frozen),
    naming the other node and the overlapping ``paths``: ``serialize`` (an edge was added, later → earlier) or
    ``lane`` (no edge: both may run; the runtime strategy absorbs a landing race)."""

    with_: str = Field(alias="with")
    paths: tuple[str, ...] = ()
    strategy: t.Literal["serialize", "lane"]
    runtime: RuntimeStrategy


class PlanNode(_PlanModel):
    """A compiled node: stable ``position`` (plan order), the ``generation`` that appended it, its plan ``key``,
    ``depends_on`` (material dependencies first, then edges compile added), and its conflict annotations."""

    id: str
    position: int
    generation: int
    key: str
    depends_on: tuple[str, ...]
    conflicts: tuple[WriteConflict, ...] = ()
    draft: NodeDraft

    @property
    def kind(self) -> NodeKind:
        return self.draft.kind

    @property
    def priority(self) -> int:
        return self.draft.priority

    @property
    def tier(self) -> Tier:
        return self.draft.material.tier

    @property
    def effects(self) -> Effects:
        return self.draft.effects


class Plan(_PlanModel):
    """A compiled, immutable plan. ``digest`` covers every node; ``base_digest`` is generation 0's digest (what
    an approval binds to) and survives every append. Build one with ``compile_plan``/``append_plan``; a
    hand-made or deserialised plan must pass ``verify_plan`` before use."""

    plan_id: str
    flow: str
    nodes: tuple[PlanNode, ...]
    digest: str
    base_digest: str
    generation: int
    maximum_plan_nodes: int

    _index: dict[str, PlanNode] | None = PrivateAttr(default=None)

    def node(self, node_id: str) -> PlanNode:
        """The node named ``node_id`` (``PlanError(unknown_dependency)`` when there is none)."""
        if self._index is None:
            self._index = {n.id: n for n in self.nodes}
        try:
            return self._index[node_id]
        except KeyError:
            raise PlanError(
                "unknown_dependency", f"plan {self.plan_id!r} has no node {node_id!r}", node=node_id
            ) from None

    def __contains__(self, node_id: object) -> bool:
        if self._index is None:
            self._index = {n.id: n for n in self.nodes}
        return node_id in self._index

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (absent optional fields omitted); :meth:`from_json` reverses it."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def from_json(cls, data: Any) -> Plan:
        """Decode :meth:`to_json` output. Refuses malformed data with ``PlanError(invalid_plan)``. The result is
        NOT verified: call ``verify_plan`` before using it."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            inner = _plan_error(exc, cls.__name__)
            raise PlanError("invalid_plan", f"stored plan is malformed: {inner.message}", cause=exc) from exc
        except PlanError as exc:
            raise PlanError("invalid_plan", f"stored plan is malformed: {exc.message}", cause=exc) from exc


# ------------------------------------------------------------------------------------------- constructor

#: The declaration of a node without file effects, one per boundary mode, validated once and shared: an
#: ``Effects`` is immutable (frozen, tuples of frozen entries), and most nodes of a large plan have none.
_NO_EFFECTS: dict[str, Effects] = {m: Effects(boundary_mode=m) for m in ("hard", "expected")}


def _nothing(entries: Any) -> bool:
    # Only an empty tuple or list: "" is not "no entries" (it is refused as an empty path), a generator is
    # consumed by validation.
    return type(entries) in (tuple, list) and not entries


def node(
    id: str,
    body: Any = _UNSET,
    inputs: Iterable[Value | Ref | Pending] = (),
    reads: Iterable[EntryInput] = (),
    writes: Iterable[EntryInput] = (),
    removes: Iterable[EntryInput] = (),
    boundary: BoundaryMode = "hard",
    tier: Tier = "sealed",
    kind: NodeKind = "step",
    priority: int = 0,
    conflict: ConflictStrategy = "serialize",
    runtime: RuntimeStrategy = "delay-rebase",
    layers: Iterable[str] = (),
    capabilities: Mapping[str, Iterable[str]] | Iterable[str] | None = None,
    nondeterministic: bool | None = None,
    approval: Mapping[str, Any] | None = None,
    wait: Mapping[str, Any] | None = None,
) -> NodeDraft:
    """Declare a node. ``body`` is plain JSON (default ``{}``); refusals are ``PlanError`` naming
    the node, raised before anything is compiled.

    >>> d = node("build", body={"cmd": "make"}, inputs=[Ref("fetch", path=["value"])], writes=["dist/"])
    """
    try:
        material: dict[str, Any] = {
            "tier": tier,
            "inputs": inputs,
            "layers": layers,
            "capabilities": capabilities,
        }
        if body is not _UNSET:
            material["body"] = body
        if nondeterministic is not None:
            material["nondeterministic"] = nondeterministic
        key_material = KeyMaterial(**material)  # validated first: its refusal wins over an effects refusal
        effects: Effects | None = None
        if _nothing(reads) and _nothing(writes) and _nothing(removes) and type(boundary) is str:
            effects = _NO_EFFECTS.get(boundary)
        if effects is None:
            declared: dict[str, Any] = {
                "reads": reads,
                "writes": writes,
                "removes": removes,
                "boundary_mode": boundary,
            }
            effects = Effects(**declared)
        data: dict[str, Any] = {
            "id": id,
            "material": key_material,
            "effects": effects,
            "kind": kind,
            "priority": priority,
            "conflict_strategy": conflict,
            "runtime_strategy": runtime,
        }
        if approval is not None:
            data["approval"] = dict(approval) if isinstance(approval, Mapping) else approval
        if wait is not None:
            data["wait"] = dict(wait) if isinstance(wait, Mapping) else wait
        return NodeDraft(**data)
    except PlanError as exc:
        details = {**exc.details, "node": str(id)}
        raise PlanError(exc.code, f"node {id!r}: {exc.message}", cause=exc, **details) from exc
