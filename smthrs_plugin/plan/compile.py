"""Compile, append and verify plans; the plan digest; conflict annotation. PURE.

- Compile is all-or-nothing: every refusal (``duplicate_node``, ``unknown_dependency``, ``cycle``,
  ``invalid_effects``, ``overlap_forbidden``) is a :class:`PlanError` raised before a plan exists; the steps and
  the conflict rule are in docs/rules.md ("Plan compile").
- Edges are inferred from declarations, never from declaration order (:mod:`smthrs_plugin.plan.overlap`). Plan order
  is the material topological order, so an inferred edge may point to a LATER position; the edge set is acyclic
  and recompiling a plan's own node order reproduces it exactly.
- ``depends_on`` is the material dependencies, then the serialize edges, then the reader edges, each in plan order.
- ``append_plan`` is a new generation: earlier nodes are byte-identical (never re-keyed, never given edges), new
  edges land on new nodes only, ``base_digest`` is kept, ``generation`` + 1, and the total stays within
  ``maximum_plan_nodes`` (``elaboration_failed``, nothing returned).
- ``verify_plan`` replays compile and every append from the stored drafts and refuses any difference with
  ``invalid_plan``.

How compile stays fast: ARCHITECTURE.md ("plan").
"""

from __future__ import annotations

import re
import typing as t
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..canonical import key
from ..errors import CanonicalError, PlanError
from . import _canon
from ._gcpause import gc_paused
from .fileset import Glob, TreeArtifact, check_not_reserved, normalize_path, normalize_pattern
from .keys import effects_json, plan_digest_document, plan_key_with_effects
from .model import (
    NodeDraft,
    Pending,
    Plan,
    PlanNode,
    Ref,
    Value,
    WriteConflict,
    check_write_remove,
)
from .overlap import infer_edges

__all__ = [
    "compile_plan",
    "append_plan",
    "verify_plan",
    "plan_digest",
    "priority_json",
    "DEFAULT_MAXIMUM_PLAN_NODES",
]

DEFAULT_MAXIMUM_PLAN_NODES = 10_000
_NODE_FIELDS = set(PlanNode.model_fields)
_SAFE_INT = 2**53 - 1


def priority_json(priority: int) -> int | str:
    """How a priority enters the digest: a JSON number inside ±(2**53-1), its decimal string outside."""
    return priority if -_SAFE_INT <= priority <= _SAFE_INT else str(priority)


def _node_json(n: PlanNode) -> dict[str, Any]:
    return {
        "id": n.id,
        "kind": n.draft.kind,
        "key": n.key,
        "dependsOn": list(n.depends_on),
        "conflicts": [
            {"with": c.with_, "paths": list(c.paths), "strategy": c.strategy, "runtime": c.runtime}
            for c in n.conflicts
        ],
        "effects": effects_json(n.draft.effects),
        "priority": priority_json(n.draft.priority),
    }


def plan_digest(plan_id: str, flow: str, nodes: Sequence[PlanNode]) -> str:
    """``content({body: {kind: "plan", planId, flow}, inputs: {nodes: literal([{id, kind, key, dependsOn,
    conflicts, effects, priority}...])}})`` over ``nodes`` in plan order (``keys.plan_digest_document``)."""
    return _digest(plan_id, flow, nodes, None, {})


def _digest(
    plan_id: str,
    flow: str,
    nodes: Sequence[PlanNode],
    effs: Sequence[str | None] | None,
    quoted: Mapping[str, str],
) -> str:
    # effs: each node's effects text when keying already wrote it (None: write it here); quoted: the JSON text
    # of the keys this compile wrote, by node id (a node whose id is missing has its key written here).
    try:
        ids: dict[str, str] = {}
        texts = []
        for i, n in enumerate(nodes):
            eff = effs[i] if effs is not None else None
            texts.append(
                _canon.digest_node(
                    n, _canon.effects(n.draft.effects) if eff is None else eff, ids, quoted.get(n.id)
                )
            )
        return _canon.digest(plan_id, flow, texts)
    except Exception:
        # not swallowed: the reference path returns the same digest, or raises the refusal itself
        return _plan_digest_reference(plan_id, flow, nodes)


def _plan_digest_reference(plan_id: str, flow: str, nodes: Sequence[PlanNode]) -> str:
    # The generic construction (one canonical.key walk over the whole document): the definition _canon.digest
    # must equal, and the path every refusal is raised from.
    try:
        return key(plan_digest_document(plan_id, flow, [_node_json(n) for n in nodes]))
    except CanonicalError as exc:
        raise PlanError(
            "invalid_plan", f"plan {plan_id!r} cannot be digested: {exc.message}", cause=exc
        ) from exc


# ------------------------------------------------------------------------------------------- validation


def _check_identity(plan_id: Any, flow: Any, maximum: Any) -> None:
    for name, v in (("plan_id", plan_id), ("flow", flow)):
        if type(v) is not str or not v or "\x00" in v:
            raise PlanError(
                "invalid_plan", f"{name} {v!r} must be a non-empty string without NUL, e.g. 'ci/build'"
            )
    if type(maximum) is not int or maximum < 1:
        raise PlanError(
            "invalid_plan", f"maximum_plan_nodes {maximum!r} must be a positive int (default 10000)"
        )


def _check_entries(d: NodeDraft) -> None:
    # Drafts are validated at construction; this re-check refuses drafts that bypassed validation
    # (model_construct / model_copy(update=...)) so a hostile plan cannot smuggle an escaping path in.
    e = d.effects
    reads, writes, removes = e.reads, e.writes, e.removes
    if (
        type(reads) is tuple
        and type(writes) is tuple
        and type(removes) is tuple
        and not (reads or writes or removes)
    ):
        return  # nothing declared, nothing to re-check (most nodes of a large plan)
    for group in (reads, writes, removes):
        for x in group:
            try:
                ok = _normalised(x)
            except PlanError as exc:
                raise PlanError(exc.code, f"node {d.id!r}: {exc.message}", cause=exc, node=d.id) from exc
            if not ok:
                raise PlanError(
                    "invalid_effects",
                    f"node {d.id!r}: entry {x!r} is not a normalised workspace-relative path entry; declare it "
                    "as a string like 'src/app.py', 'dist/' or 'src/**/*.py'",
                    node=d.id,
                )
    try:
        check_write_remove(e.writes, e.removes)
        check_not_reserved(e.writes, e.removes)
    except PlanError as exc:
        raise PlanError(exc.code, f"node {d.id!r}: {exc.message}", cause=exc, node=d.id) from exc


# A sufficient (not necessary) test for "normalize_path(x) == x": segments of plain name characters, none of
# them "." or "..", no NUL, backslash, wildcard, drive colon or empty segment. Anything else takes the full
# check, which decides (and words the refusal) exactly as before.
_PLAIN_PATH = re.compile(r"(?!\.\.?(?:/|\Z))[A-Za-z0-9_.+-]+(?:/(?!\.\.?(?:/|\Z))[A-Za-z0-9_.+-]+)*\Z")


def _normalised(x: object) -> bool:
    return (
        (type(x) is str and _PLAIN_PATH.match(x) is not None)
        or (isinstance(x, str) and normalize_path(x) == x)
        or (isinstance(x, TreeArtifact) and normalize_path(x.path) == x.path)
        or (
            isinstance(x, Glob)
            and bool(x.include)
            and all(normalize_pattern(p) == p for p in (*x.include, *x.exclude))
        )
    )


def _topological(
    drafts: Sequence[NodeDraft], placed: set[str]
) -> tuple[list[NodeDraft], dict[str, tuple[str, ...]]]:
    """Depth-first post-order in declaration order over material dependencies (already placed ids are leaves).
    Also returns each draft's material dependencies (``NodeDraft.dependencies()``, computed once here)."""
    where = {d.id: i for i, d in enumerate(drafts)}
    # One pass over every input: refuse an unknown dependency, collect each draft's material dependencies
    # (what NodeDraft.dependencies() returns: Ref/Pending ids, unique, in input order) and decide the common
    # case — every dependency declared earlier (or already placed). Then the post-order below would emit
    # exactly the declaration order (each node's dependencies are finished when the outer loop reaches it),
    # and there is no cycle to find.
    material: dict[str, tuple[str, ...]] = {}
    ordered = True
    for n, d in enumerate(drafts):
        inputs = d.material.inputs
        if type(inputs) is tuple and not inputs:
            material[d.id] = ()
            continue
        found: dict[str, None] = {}
        for i, inp in enumerate(inputs):
            ti = type(inp)
            if ti is Value:
                continue
            if ti is not Ref and ti is not Pending:
                if isinstance(inp, Value):
                    continue
                if not isinstance(inp, (Ref, Pending)):
                    # only reachable by bypassing validation (model_construct / model_copy(update=...))
                    raise PlanError(
                        "invalid_node",
                        f"node {d.id!r} input #{i} is a {ti.__name__}, not a Value, Ref or Pending; declare "
                        "inputs with Value(...), Ref('node') or Pending('node')",
                        node=d.id,
                        input=i,
                    )
            dep = t.cast("Ref | Pending", inp).from_
            w = where.get(dep)
            if w is None:
                if dep not in placed:
                    raise PlanError(
                        "unknown_dependency",
                        f"node {d.id!r} input #{i} depends on {dep!r}, which is not a node of this plan; "
                        f"declare {dep!r} or fix the id",
                        node=d.id,
                        dependency=dep,
                    )
            elif w >= n:
                ordered = False
            found[dep] = None
        material[d.id] = tuple(found)
    if ordered:
        return list(drafts), material
    by_id = {d.id: d for d in drafts}
    deps = {nid: [x for x in ds if x not in placed] if placed else ds for nid, ds in material.items()}
    state: dict[str, int] = {}
    order: list[NodeDraft] = []
    for d in drafts:
        if d.id in state:
            continue
        state[d.id] = 1
        stack: list[tuple[str, Any]] = [(d.id, iter(deps[d.id]))]
        while stack:
            nid, it = stack[-1]
            for dep in it:
                st = state.get(dep)
                if st is None:
                    state[dep] = 1
                    stack.append((dep, iter(deps[dep])))
                    break
                if st == 1:
                    ids = [s[0] for s in stack]
                    cycle = [*ids[ids.index(dep) :], dep]
                    raise PlanError(
                        "cycle",
                        f"dependencies form a cycle: {' -> '.join(cycle)}; remove one of these Ref/Pending inputs",
                        cycle=cycle,
                    )
            else:
                stack.pop()
                state[nid] = 2
                order.append(by_id[nid])
    return order, material


# ------------------------------------------------------------------------------------------------ build


def _build(
    plan_id: str,
    flow: str,
    existing: Sequence[PlanNode],
    drafts: Sequence[Any],
    generation: int,
    maximum: int,
) -> tuple[tuple[PlanNode, ...], list[str | None], dict[str, str]]:
    for i, d in enumerate(drafts):
        if not isinstance(d, NodeDraft):
            raise PlanError(
                "invalid_node",
                f"node #{i} is a {type(d).__name__}, not a NodeDraft; declare nodes with smthrs_plugin.node(...)",
            )
    total = len(existing) + len(drafts)
    if total > maximum:
        raise PlanError(
            "elaboration_failed",
            f"plan {plan_id!r} would have {total} nodes, over maximum_plan_nodes={maximum}; nothing was "
            "committed — split the plan or raise maximum_plan_nodes (leave room for generated merge nodes)",
            nodes=total,
            maximum=maximum,
        )
    placed = {n.id for n in existing}
    seen: set[str] = set()
    for d in drafts:
        if d.id in placed or d.id in seen:
            where = "an earlier generation" if d.id in placed else "this declaration"
            raise PlanError(
                "duplicate_node",
                f"node id {d.id!r} is declared twice (already in {where}); give every node a unique id",
                node=d.id,
            )
        seen.add(d.id)
    order, material = _topological(drafts, placed)
    for d in order:
        _check_entries(d)

    base = len(existing)
    pos: dict[str, int] = {n.id: n.position for n in existing}
    for i, d in enumerate(order):
        pos[d.id] = base + i
    all_drafts: list[NodeDraft] = [n.draft for n in existing] + order
    ids: list[str] = [n.id for n in existing] + [d.id for d in order]
    # Edge lists stay tuples (shared empties, no per-node list) while short.
    deps: list[Sequence[int]] = [tuple([pos[x] for x in n.depends_on]) for n in existing]
    deps += [tuple([pos[x] for x in m]) if (m := material[d.id]) else () for d in order]

    keys: dict[str, str] = {n.id: n.key for n in existing}
    # What keying writes once and the digest reuses: each new node's effects text (None where the fast writer
    # declined; the digest then writes it again or takes the reference path) and its key's JSON text.
    effs: list[str | None] = [None] * base
    quoted: dict[str, str] = {}
    for d in order:
        try:
            eff: str | None = _canon.effects(d.effects)
        except Exception:
            eff = None  # declined: plan_key_with_effects writes it again or takes the reference path
        effs.append(eff)
        k = keys[d.id] = plan_key_with_effects(d, keys, eff, quoted)
        quoted[d.id] = '"' + k + '"'  # a key1_ key is [a-z0-9_]: its JSON text needs no escaping

    # (5) conflict annotations and reader-after-writer edges, in plan order whatever the declaration order.
    effects = [d.effects for d in all_drafts]
    edges, grown, found = infer_edges(
        ids,
        deps,
        [e.reads for e in effects],
        [e.produces for e in effects],
        [d.conflict_strategy for d in all_drafts],
        [d.runtime_strategy for d in all_drafts],
        base,
    )
    conflicts = {
        p: tuple(
            [
                WriteConflict.model_validate(
                    {"with": ids[other], "paths": paths, "strategy": strategy, "runtime": runtime}
                )
                for other, paths, strategy, runtime in annotations
            ]
        )
        for p, annotations in found.items()
    }

    # Every field below was computed here from drafts checked above (isinstance NodeDraft, entries
    # re-checked): validating them again would only re-prove this function's own output. One shared
    # fields-set: a compiled node is frozen, and pydantic copies the set before any model_copy update.
    new_nodes = tuple(
        [
            _trusted_node(
                {
                    "id": ids[p],
                    "position": p,
                    "generation": generation,
                    "key": keys[ids[p]],
                    # no edge added: the names are the material dependencies themselves, already unique and
                    # in input order
                    "depends_on": _names(ids, edges[p]) if p in grown else material[ids[p]],
                    "conflicts": conflicts.get(p, ()),
                    "draft": all_drafts[p],
                }
            )
            for p in range(base, len(ids))
        ]
    )
    return tuple(existing) + new_nodes, effs, quoted


_setattr = object.__setattr__
# What PlanNode.model_construct(_NODE_FIELDS, **values) builds when every field is given, without its per-field
# alias/default walk (a tenth of compiling a 100,000-node plan): the instance dict, the fields-set, no extra, no
# private state. Only taken while the model has nothing else model_construct would run (a post-init, private
# attributes, extra fields, a root model); test_plan_compile pins the result equal to model_construct's.
_TRUSTED_OK = (
    not PlanNode.__pydantic_post_init__
    and not PlanNode.__pydantic_root_model__
    and not PlanNode.__private_attributes__
    and PlanNode.model_config.get("extra") != "allow"
    and list(PlanNode.model_fields)
    == ["id", "position", "generation", "key", "depends_on", "conflicts", "draft"]
)


def _trusted_node(values: dict[str, Any]) -> PlanNode:
    if not _TRUSTED_OK:
        return PlanNode.model_construct(_NODE_FIELDS, **values)
    m = PlanNode.__new__(PlanNode)
    _setattr(m, "__dict__", values)
    _setattr(m, "__pydantic_fields_set__", _NODE_FIELDS)
    _setattr(m, "__pydantic_extra__", None)
    _setattr(m, "__pydantic_private__", None)
    return m


def _names(ids: list[str], positions: Sequence[int]) -> tuple[str, ...]:
    if not positions:
        return ()
    if len(positions) == 1:
        return (ids[positions[0]],)
    return tuple(dict.fromkeys([ids[x] for x in positions]))


# ---------------------------------------------------------------------------------------------- public


def compile_plan(
    plan_id: str,
    flow: str,
    nodes: Iterable[NodeDraft],
    maximum_plan_nodes: int = DEFAULT_MAXIMUM_PLAN_NODES,
) -> Plan:
    """Compile node drafts into generation 0 of a plan (see the module invariants). Raises :class:`PlanError`
    (``invalid_plan``, ``invalid_node``, ``duplicate_node``, ``unknown_dependency``, ``cycle``,
    ``invalid_effects``, ``overlap_forbidden``, ``elaboration_failed``); never returns a partial plan."""
    _check_identity(plan_id, flow, maximum_plan_nodes)
    if isinstance(nodes, (str, bytes, NodeDraft)) or not isinstance(nodes, Iterable):
        raise PlanError("invalid_plan", f"nodes must be a list of NodeDraft, not {type(nodes).__name__}")
    with gc_paused():
        built, effs, quoted = _build(plan_id, flow, (), list(nodes), 0, maximum_plan_nodes)
        digest = _digest(plan_id, flow, built, effs, quoted)
        return Plan(
            plan_id=plan_id,
            flow=flow,
            nodes=built,
            digest=digest,
            base_digest=digest,
            generation=0,
            maximum_plan_nodes=maximum_plan_nodes,
        )


def _append(plan: Plan, drafts: Sequence[Any]) -> Plan:
    if not drafts:
        raise PlanError("invalid_plan", f"append to plan {plan.plan_id!r} needs at least one node draft")
    generation = plan.generation + 1
    with gc_paused():
        built, effs, quoted = _build(
            plan.plan_id, plan.flow, plan.nodes, drafts, generation, plan.maximum_plan_nodes
        )
        return Plan(
            plan_id=plan.plan_id,
            flow=plan.flow,
            nodes=built,
            digest=_digest(plan.plan_id, plan.flow, built, effs, quoted),
            base_digest=plan.base_digest,
            generation=generation,
            maximum_plan_nodes=plan.maximum_plan_nodes,
        )


def append_plan(plan: Plan, drafts: Iterable[NodeDraft]) -> Plan:
    """A new generation of ``plan`` with ``drafts`` appended (earlier nodes frozen, ``base_digest`` kept).
    ``plan`` is verified first; refusals are :class:`PlanError` and nothing partial is returned."""
    verify_plan(plan)
    if isinstance(drafts, (str, bytes, NodeDraft)) or not isinstance(drafts, Iterable):
        raise PlanError("invalid_plan", f"drafts must be a list of NodeDraft, not {type(drafts).__name__}")
    return _append(plan, list(drafts))


def _first_difference(a: PlanNode, b: PlanNode) -> str | None:
    for field in ("id", "position", "generation", "key", "depends_on", "conflicts"):
        if getattr(a, field) != getattr(b, field):
            return field
    return None


def verify_plan(plan: Plan) -> Plan:
    """Recompute keys, annotations, edges and digests of every generation from the stored drafts; refuse any
    difference with ``PlanError(invalid_plan)``. Returns ``plan`` unchanged when it verifies."""
    if not isinstance(plan, Plan):
        raise PlanError("invalid_plan", f"expected a compiled Plan, got {type(plan).__name__}")
    _check_identity(plan.plan_id, plan.flow, plan.maximum_plan_nodes)
    generations: list[list[NodeDraft]] = []
    for i, n in enumerate(plan.nodes):
        if n.generation == len(generations):
            generations.append([])
        elif n.generation != len(generations) - 1:
            raise PlanError(
                "invalid_plan",
                f"node {n.id!r} at position {i} claims generation {n.generation}, out of sequence; recompile the plan",
                node=n.id,
            )
        generations[-1].append(n.draft)
    expected_generation = max(len(generations) - 1, 0)
    if plan.generation != expected_generation:
        raise PlanError(
            "invalid_plan",
            f"plan {plan.plan_id!r} claims generation {plan.generation} but its nodes span {expected_generation}",
        )
    try:
        # Keyed here for the run that follows: its dispatch keys reuse each draft's static texts (_canon).
        with _canon.remembering():
            rebuilt = compile_plan(
                plan.plan_id, plan.flow, generations[0] if generations else [], plan.maximum_plan_nodes
            )
            base_digest = rebuilt.digest
            for drafts in generations[1:]:
                rebuilt = _append(rebuilt, drafts)
    except PlanError as exc:
        raise PlanError(
            "invalid_plan",
            f"plan {plan.plan_id!r} does not recompile: {exc.message}",
            cause=exc,
            reason=exc.code,
        ) from exc
    for mine, theirs in zip(plan.nodes, rebuilt.nodes, strict=True):
        field = _first_difference(mine, theirs)
        if field is not None:
            raise PlanError(
                "invalid_plan",
                f"plan {plan.plan_id!r}: node {mine.id!r} has a {field} that does not match its declaration "
                f"(stored {getattr(mine, field)!r}, recomputed {getattr(theirs, field)!r}); recompile the plan",
                node=mine.id,
                field=field,
            )
    if base_digest != plan.base_digest:
        raise PlanError(
            "invalid_plan",
            f"plan {plan.plan_id!r}: base_digest does not match generation 0; the approved base was altered",
        )
    if rebuilt.digest != plan.digest:
        raise PlanError(
            "invalid_plan",
            f"plan {plan.plan_id!r}: digest {plan.digest} does not match its nodes ({rebuilt.digest}); recompile",
        )
    return plan
