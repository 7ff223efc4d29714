"""Node keys: the plan key, the sealed dispatch key, Ref projection and the run-local ordinal key. PURE.

Invariants (SEMANTICS.md §1)
- The **plan key** is a pure function of declarations and folds upstream plan keys (transitive re-keying):
  ``content({body: material_body, inputs: {"0": ..., "1": ...}, layers, capabilities})``. Value inputs carry
  their value; Ref/Pending inputs carry the upstream plan key with ``reference`` ``ref`` / ``ref-projected``
  (+ ``path``) / ``pending``.
- The **dispatch key** (what the cache is keyed on, sealed tier) has the same shape but folds NO upstream plan
  key: a Ref contributes ``key({kind: "input-value", value: project(result, path)})`` and a Pending only the
  constant ``"ordering-only"``; it adds the scheduler's ``environment`` (omitted when absent — omission is an
  identity, not a wildcard) and ``hermetic = {readSet, writeSet, removes, boundaryMode}`` with the measured
  read digests. So an upstream body edit changes the downstream plan key but not its dispatch key when the
  projected value is unchanged: the downstream settles ``clean`` — Bazel's action key over input *digests*,
  not over how the inputs were produced.
- ``project`` walks object keys; a missing key or a non-object mid-path yields :data:`ABSENT`, which is
  dropped from the key (``{"kind": "input-value"}``) and therefore distinct from JSON ``null``.
- Non-sealed tiers use :func:`run_local_key` over ``["plan-node/v1", plan_id, node_id, node_key]`` + run id:
  replayable inside the run, never published. It is the only key a node id enters.
- :func:`plan_key` writes the canonical text by composition (``_canon``); the generic whole-document walk
  (``_plan_key_reference``) is its definition and the only path a refusal is raised from, so the key and every
  refusal are byte-for-byte those of the walk (tests/plan/test_plan_canon.py, test_compile_golden.py).
- Nothing is fixed up: a value without a canonical form, a missing Ref value or a malformed read set raises
  ``SchedulerError(key_uncomputable)`` (the cause kept) instead of producing a weaker key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any, Final

from ..canonical import key
from ..errors import CanonicalError, PlanError, SchedulerError
from . import _canon
from ._fileset import EntryInput, PathEntry, flatten, normalize_path
from ._model import Effects, KeyMaterial, NodeDraft, Pending, Ref, Value

__all__ = [
    "ABSENT",
    "ORDERING_ONLY",
    "project",
    "material_body",
    "effects_json",
    "plan_key",
    "dispatch_key",
    "input_value_digest",
    "resolve_refs",
    "run_local_key",
]

ORDERING_ONLY: Final = "ordering-only"


class _Absent:
    """The value of a projection that found nothing. Falsy, a singleton, never equal to ``None``."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "ABSENT"


#: A projection that found nothing (missing key or non-object mid-path). Dropped from keys; distinct from null.
ABSENT: Final = _Absent()


def project(value: Any, path: Sequence[str]) -> Any:
    """Walk object keys ``path`` into ``value``; :data:`ABSENT` when a key is missing or a non-object is met."""
    cur = value
    for seg in path:
        if type(cur) is not dict or seg not in cur:
            return ABSENT
        cur = cur[seg]
    return cur


def _entry_list(entries: Sequence[PathEntry]) -> list[Any]:
    return _canon.entry_list(entries)


def effects_json(effects: Effects) -> dict[str, Any]:
    """Plain-JSON form of declared effects, as folded into keys and the plan digest."""
    return {
        "reads": _entry_list(effects.reads),
        "writes": _entry_list(effects.writes),
        "removes": _entry_list(effects.removes),
        "boundaryMode": effects.boundary_mode,
    }


def material_body(draft: NodeDraft) -> dict[str, Any]:
    """``{version, tier, declaration, effects, nodeKind, nondeterministic?, approval?, wait?}``. Absent optional
    members are omitted, never ``null``. Scheduling-only fields (id, priority, conflict/runtime strategy) are not
    here: they do not change what the node computes."""
    m = draft.material
    body: dict[str, Any] = {
        "version": m.version,
        "tier": m.tier,
        "declaration": m.body,
        "effects": effects_json(draft.effects),
        "nodeKind": draft.kind,
    }
    if m.nondeterministic is not None:
        body["nondeterministic"] = m.nondeterministic
    if draft.approval is not None:
        body["approval"] = draft.approval
    if draft.wait is not None:
        body["wait"] = draft.wait
    return body


def _content(draft: NodeDraft, inputs: dict[str, Any]) -> dict[str, Any]:
    m: KeyMaterial = draft.material
    return {
        "kind": "content",
        "body": material_body(draft),
        "inputs": inputs,
        "layers": m.normalized_layers(),
        "capabilities": m.normalized_capabilities(),
    }


def plan_key(draft: NodeDraft, upstream: Mapping[str, str]) -> str:
    """The plan key of ``draft`` given the plan keys of its dependencies (``upstream[node_id]``).

    Raises ``PlanError(unknown_dependency)`` when a dependency has no key, ``PlanError(invalid_node)`` when the
    declaration has no canonical form."""
    return plan_key_with_effects(draft, upstream, None, {})


def plan_key_with_effects(
    draft: NodeDraft, upstream: Mapping[str, str], eff: str | None, quoted: Mapping[str, str]
) -> str:
    """:func:`plan_key`, given what the caller already wrote: the canonical text of ``effects_json(draft.effects)``
    (``None``: write it here) and, by node id, the JSON text of upstream keys (compile writes each once and
    reuses it for every dependent and in the plan digest)."""
    try:
        eff_text = _canon.effects(draft.effects) if eff is None else eff
        return _canon.plan_key(draft, upstream, eff_text, quoted)
    except Exception:
        # not swallowed: the reference path returns the same key, or raises the refusal itself
        return _plan_key_reference(draft, upstream)


def _plan_key_reference(draft: NodeDraft, upstream: Mapping[str, str]) -> str:
    # The generic construction: the whole content document walked and encoded by canonical.key. It is the
    # definition _canon.plan_key must equal, and the path every refusal is raised from (same code, same message).
    inputs: dict[str, Any] = {}
    for i, inp in enumerate(draft.material.inputs):
        if isinstance(inp, Value):
            inputs[str(i)] = {"kind": "literal", "value": inp.value}
            continue
        try:
            up = upstream[inp.from_]
        except KeyError:
            raise PlanError(
                "unknown_dependency",
                f"node {draft.id!r} input #{i} names {inp.from_!r}, which has no plan key; declare that node "
                "in the plan (or fix the id)",
                node=draft.id,
                dependency=inp.from_,
            ) from None
        if isinstance(inp, Pending):
            inputs[str(i)] = {"kind": "digest", "digest": up, "reference": "pending"}
        elif inp.path:
            inputs[str(i)] = {
                "kind": "digest",
                "digest": up,
                "reference": "ref-projected",
                "path": list(inp.path),
            }
        else:
            inputs[str(i)] = {"kind": "digest", "digest": up, "reference": "ref"}
    try:
        return key(_content(draft, inputs))
    except CanonicalError as exc:
        raise PlanError(
            "invalid_node", f"node {draft.id!r} cannot be keyed: {exc.message}", cause=exc, node=draft.id
        ) from exc


def _uncomputable(draft: NodeDraft, why: str, cause: BaseException | None = None) -> SchedulerError:
    return SchedulerError(
        "key_uncomputable",
        f"dispatch key of node {draft.id!r} cannot be computed: {why}",
        cause=cause,
        node=draft.id,
    )


def input_value_digest(value: Any) -> str:
    """``key({kind: "input-value", value})``; an :data:`ABSENT` value drops the member (distinct from null)."""
    if value is ABSENT:
        return key({"kind": "input-value"})
    return key({"kind": "input-value", "value": value})


def resolve_refs(draft: NodeDraft, results: Mapping[str, Any]) -> dict[int, Any]:
    """The projected value of every Ref input, by input index — exactly what the executor may see and what
    :func:`dispatch_key` folds. Pending inputs are absent by design (ordering only)."""
    out: dict[int, Any] = {}
    for i, inp in enumerate(draft.material.inputs):
        if isinstance(inp, Ref):
            if inp.from_ not in results:
                raise _uncomputable(
                    draft, f"input #{i} needs the result of {inp.from_!r}, which has none yet"
                )
            out[i] = project(results[inp.from_], inp.path)
    return out


def dispatch_key(
    draft: NodeDraft,
    *,
    ref_values: Mapping[int, Any],
    read_set: Iterable[tuple[str, str]],
    environment: Any = ABSENT,
    writes: Iterable[EntryInput] | None = None,
    removes: Iterable[EntryInput] | None = None,
    boundary_mode: str | None = None,
    memo: MutableMapping[tuple[str, tuple[str, ...]], str] | None = None,
) -> str:
    """The sealed dispatch key (SEMANTICS.md §1).

    ``ref_values``: the projected value of each Ref input by index (see :func:`resolve_refs`). ``read_set``:
    measured ``(path, digest)`` pairs, globs already expanded. ``environment``: the scheduler's declared
    environment (plain JSON; :data:`ABSENT` omits it). ``writes``/``removes``/``boundary_mode`` default to the
    declaration's. ``memo`` caches input-value digests per ``(from, path)`` across nodes of one run."""
    inputs: dict[str, Any] = {}
    for i, inp in enumerate(draft.material.inputs):
        if isinstance(inp, Value):
            inputs[str(i)] = {"kind": "literal", "value": inp.value}
        elif isinstance(inp, Pending):
            inputs[str(i)] = {"kind": "digest", "digest": ORDERING_ONLY}
        else:
            if i not in ref_values:
                raise _uncomputable(
                    draft, f"no projected value was supplied for Ref input #{i} ({inp.from_!r})"
                )
            mk = (inp.from_, inp.path)
            digest = memo.get(mk) if memo is not None else None
            if digest is None:
                try:
                    digest = input_value_digest(ref_values[i])
                except CanonicalError as exc:
                    raise _uncomputable(draft, f"Ref input #{i} value: {exc.message}", exc) from exc
                if memo is not None:
                    memo[mk] = digest
            inputs[str(i)] = {"kind": "digest", "digest": digest}
    reads: list[dict[str, str]] = []
    for pair in read_set:
        try:
            path, digest = pair
            reads.append({"path": normalize_path(path), "digest": digest})
        except (PlanError, TypeError, ValueError) as exc:
            raise _uncomputable(draft, f"malformed read-set entry {pair!r}", exc) from exc
        if type(digest) is not str or not digest:
            raise _uncomputable(draft, f"read-set entry {pair!r} has no digest string")
    reads.sort(key=lambda r: (r["path"], r["digest"]))
    try:
        w = draft.effects.writes if writes is None else flatten(writes)
        r = draft.effects.removes if removes is None else flatten(removes)
    except PlanError as exc:
        raise _uncomputable(draft, exc.message, exc) from exc
    mode = draft.effects.boundary_mode if boundary_mode is None else boundary_mode
    if mode not in ("hard", "expected"):
        raise _uncomputable(draft, f"boundary mode {mode!r} is neither 'hard' nor 'expected'")
    content = _content(draft, inputs)
    content["hermetic"] = {
        "readSet": reads,
        "writeSet": _entry_list(w),
        "removes": _entry_list(r),
        "boundaryMode": mode,
    }
    if environment is not ABSENT:
        content["environment"] = environment
    try:
        return key(content)
    except CanonicalError as exc:
        raise _uncomputable(draft, exc.message, exc) from exc


def run_local_key(plan_id: str, node_id: str, node_key: str, run_id: str) -> str:
    """Key of a compensable/irreversible node: ``["plan-node/v1", plan_id, node_id, node_key]`` scoped by the
    run. Replays only inside that run; never published to, nor served from, the shared cache."""
    for name, v in (("plan_id", plan_id), ("node_id", node_id), ("node_key", node_key), ("run_id", run_id)):
        if type(v) is not str or not v:
            raise SchedulerError(
                "key_uncomputable", f"run-local key needs a non-empty string {name}, got {v!r}"
            )
    return key(
        {"kind": "run-local", "ordinal": ["plan-node/v1", plan_id, node_id, node_key], "runId": run_id}
    )
