"""Node keys: the plan key, the sealed dispatch key, Ref projection, the run-local key and the plan digest
document. PURE.

The exact documents hashed, and the deliberate differences from the reference, are in docs/rules.md ("Keys").
What a caller relies on:

- ``key(v) = "key1_" + sha256(RFC 8785 bytes of v)`` (``canonical.key``); every document is the reference's,
  member for member (tests/plan/test_reference_goldens.py reproduces its vectors).
- The plan key folds the declaration and upstream plan keys; the dispatch key folds projected Ref values,
  measured read digests, declared effects and the environment instead, never an upstream plan key. A node's id
  enters only the run-local key (non-sealed tiers), never a plan or dispatch key.
- :func:`plan_key` writes the canonical text by composition (``_canon``); the whole-document walk
  (``_plan_key_reference``) is its definition and the only path a refusal is raised from.
- Nothing is fixed up: a value without a canonical form, a missing Ref value or a malformed read set raises
  ``SchedulerError(key_uncomputable)``.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any, Final

from ..canonical import key
from ..errors import CanonicalError, PlanError, SchedulerError
from . import _canon
from .fileset import EntryInput, Glob, PathEntry, TreeArtifact, flatten, normalize_path
from .model import Effects, KeyMaterial, NodeDraft, Pending, Ref, Value, sort_strings

__all__ = [
    "ABSENT",
    "ORDERING_ONLY",
    "project",
    "material_body",
    "effects_json",
    "entry_declared",
    "plan_key",
    "plan_key_with_effects",
    "dispatch_key",
    "hermetic_json",
    "environment_json",
    "input_value_digest",
    "resolve_refs",
    "run_local_key",
    "plan_digest_document",
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


def _array_index(seg: str, length: int) -> int | None:
    # A canonical array index only ("0", "7", "12"; not "07", "-1", "+1", " 1"): the member names an array has.
    if not seg.isascii() or not seg.isdigit() or (len(seg) > 1 and seg[0] == "0"):
        return None
    i = int(seg)
    return i if i < length else None


def project(value: Any, path: Sequence[str]) -> Any:
    """Walk ``path`` into ``value``: object members by key, array elements by canonical index (``"0"``);
    :data:`ABSENT` when a key is missing, an index is out of range or a scalar is met mid-path."""
    cur = value
    for seg in path:
        t = type(cur)
        if t is dict:
            if seg not in cur:
                return ABSENT
            cur = cur[seg]
        elif t is list or t is tuple:
            i = _array_index(seg, len(cur)) if type(seg) is str else None
            if i is None:
                return ABSENT
            cur = cur[i]
        else:
            return ABSENT
    return cur


# ------------------------------------------------------------------------------------------- effects


def entry_declared(entry: PathEntry) -> Any:
    """An entry as the reference declares it: an exact path as its string, ``{_tag: "TreeArtifact", path}``,
    ``{_tag: "Glob", include, exclude?}`` (an empty ``exclude`` omitted)."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, TreeArtifact):
        return {"_tag": "TreeArtifact", "path": entry.path}
    out: dict[str, Any] = {"_tag": "Glob", "include": list(entry.include)}
    if entry.exclude:
        out["exclude"] = list(entry.exclude)
    return out


def effects_json(effects: Effects) -> dict[str, Any]:
    """A node's declared effects as the plan digest folds them (the reference's node effects):
    ``{reads, writes, removes?, boundaryMode}``, entries in declaration order (:func:`entry_declared`),
    ``removes`` omitted when empty."""
    out: dict[str, Any] = {
        "reads": [entry_declared(e) for e in effects.reads],
        "writes": [entry_declared(e) for e in effects.writes],
    }
    if effects.removes:
        out["removes"] = [entry_declared(e) for e in effects.removes]
    out["boundaryMode"] = effects.boundary_mode
    return out


def _nfc(s: str) -> str:
    return s if s.isascii() else unicodedata.normalize("NFC", s)


def _write_entry(entry: PathEntry) -> Any:
    if isinstance(entry, str):
        return _nfc(entry)
    if isinstance(entry, TreeArtifact):
        return {"_tag": "TreeArtifact", "path": _nfc(entry.path)}
    if not isinstance(entry, Glob):
        raise TypeError(f"{entry!r} is not a path entry")
    out: dict[str, Any] = {"_tag": "Glob", "include": sort_strings(entry.include)}
    if entry.exclude:
        out["exclude"] = sort_strings(entry.exclude)
    return out


def _write_entry_order(entry: Any) -> bytes:
    # The reference orders (and deduplicates) write entries by the compact JSON text of a tagged tuple, compared
    # by UTF-16 code units. json.dumps(ensure_ascii=False) escapes exactly as JavaScript's JSON.stringify does
    # for every well-formed string (quote, backslash, the five short C0 escapes, other C0 as lowercase \\u00xx).
    if isinstance(entry, str):
        tagged: list[Any] = ["Path", entry]
    elif entry["_tag"] == "TreeArtifact":
        tagged = ["TreeArtifact", entry["path"]]
    else:
        tagged = ["Glob", entry["include"], entry.get("exclude")]
    text = json.dumps(tagged, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-16-be", "surrogatepass")


def _write_set(entries: Iterable[PathEntry]) -> list[Any]:
    by_order: dict[bytes, Any] = {}
    for e in entries:
        j = _write_entry(e)
        by_order.setdefault(_write_entry_order(j), j)
    return [by_order[k] for k in sorted(by_order)]


def _utf16(s: str) -> bytes:
    return s.encode("utf-16-be", "surrogatepass")


def hermetic_json(
    read_set: Iterable[tuple[str, str]],
    writes: Sequence[PathEntry],
    removes: Sequence[PathEntry],
    boundary_mode: str,
) -> dict[str, Any]:
    """The ``hermetic`` member of a dispatch key: ``readSet`` (``{path, digest}`` pairs, NFC paths, sorted by
    path then digest, duplicates once), ``writeSet`` (entries NFC-normalised, glob patterns as sets, ordered and
    deduplicated as the reference orders them), ``removes`` (a path set; omitted when empty) and
    ``boundaryMode``. Raises ``TypeError``/``ValueError``/``PlanError`` on a malformed pair or entry."""
    reads = [{"path": p, "digest": d} for p, d in _read_pairs(read_set)]
    out: dict[str, Any] = {"readSet": reads, "writeSet": _write_set(writes)}
    removed = _removes(removes)
    if removed is not None:
        out["removes"] = removed
    out["boundaryMode"] = boundary_mode
    return out


def _read_pairs(read_set: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``readSet`` of :func:`hermetic_json` as ``(path, digest)`` pairs, in order."""
    pairs: dict[tuple[str, str], None] = {}
    for pair in read_set:
        path, digest = pair
        if type(digest) is not str or not digest:
            raise ValueError(f"read-set entry {pair!r} has no digest string")
        pairs[(_nfc(normalize_path(path)), digest)] = None
    if len(pairs) < 2:
        return list(pairs)
    return sorted(pairs, key=lambda pd: (_utf16(pd[0]), _utf16(pd[1])))


def _removes(removes: Sequence[PathEntry]) -> list[Any] | None:
    """The ``removes`` member of :func:`hermetic_json` (None: omitted)."""
    if not removes:
        return None
    if all(isinstance(r, str) for r in removes):
        return sort_strings(removes)  # type: ignore[arg-type]
    return _write_set(removes)


# -------------------------------------------------------------------------------------------- plan key


def material_body(draft: NodeDraft) -> dict[str, Any]:
    """``{version, declaration, nondeterministic?, tier?, approval?, wait?}``: the node's own declaration, shared
    by the plan key and the dispatch key. Absent optional members are omitted, never ``null``; ``tier`` only for
    a non-sealed node (module docstring: deliberate differences)."""
    m = draft.material
    body: dict[str, Any] = {"version": m.version, "declaration": m.body}
    if m.nondeterministic is not None:
        body["nondeterministic"] = m.nondeterministic
    if m.tier != "sealed":
        body["tier"] = m.tier
    if draft.approval is not None:
        body["approval"] = draft.approval
    if draft.wait is not None:
        body["wait"] = draft.wait
    return body


def _digest_input(digest: str, inp: Ref | Pending) -> dict[str, Any]:
    """A Ref/Pending input as key material: the digest it resolved to, tagged with the kind of reference (and the
    projection's path), so ``Pending(x)`` and ``Ref(x)`` resolving to one digest never collide."""
    if isinstance(inp, Pending):
        return {"kind": "digest", "digest": digest, "reference": "pending"}
    if inp.path:
        return {"kind": "digest", "digest": digest, "reference": "ref-projected", "path": list(inp.path)}
    return {"kind": "digest", "digest": digest, "reference": "ref"}


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
    """:func:`plan_key`, given what the caller already wrote: ``eff``, the effects text it writes once for the
    plan digest (file effects are not plan-key material, so it is not read here), and, by node id, the JSON text
    of upstream keys (compile writes each once and reuses it for every dependent and in the plan digest)."""
    try:
        return _canon.plan_key(draft, upstream, quoted)
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
        inputs[str(i)] = _digest_input(up, inp)
    try:
        return key(_content(draft, inputs))
    except CanonicalError as exc:
        raise PlanError(
            "invalid_node", f"node {draft.id!r} cannot be keyed: {exc.message}", cause=exc, node=draft.id
        ) from exc


# ----------------------------------------------------------------------------------------- dispatch key


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


_ENV_MEMBERS = frozenset({"declared", "layers", "capabilities", "runScope"})


def _string_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is str for x in v)


def environment_json(environment: Any) -> Any:
    """The environment as the dispatch key folds it. One in the reference's shape — ``{declared: bool, layers:
    [str], capabilities: {group: [str]}, runScope?: str}`` — is normalised as the reference does (layers NFC in
    their order, which is identity; capability groups :func:`sort_strings` sets); any other plain JSON is folded
    as given. :data:`ABSENT` stays absent."""
    env = environment
    if (
        type(env) is dict
        and _ENV_MEMBERS.issuperset(env)
        and {"declared", "layers", "capabilities"}.issubset(env)
        and type(env["declared"]) is bool
        and _string_list(env["layers"])
        and type(env["capabilities"]) is dict
        and all(_string_list(p) for p in env["capabilities"].values())
        and type(env.get("runScope", "")) is str
    ):
        out: dict[str, Any] = {
            "declared": env["declared"],
            "layers": [unicodedata.normalize("NFC", x) for x in env["layers"]],
            "capabilities": {g: sort_strings(p) for g, p in env["capabilities"].items()},
        }
        if "runScope" in env:
            out["runScope"] = env["runScope"]
        return out
    return env


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
    """The sealed dispatch key (module docstring for the document).

    ``ref_values``: the projected value of each Ref input by index (see :func:`resolve_refs`). ``read_set``:
    measured ``(path, digest)`` pairs, globs already expanded. ``environment``: the scheduler's declared
    environment (plain JSON; :data:`ABSENT` omits it). ``writes``/``removes``/``boundary_mode`` default to the
    declaration's. ``memo`` caches input-value digests per ``(from, path)`` across nodes of one run. A non-sealed
    node has no content key (``key_uncomputable``: it is keyed by :func:`run_local_key`).

    The key is written by composition (``_canon.dispatch_key``: a scheduler keys every node it dispatches, and a
    generic walk of the whole document was most of that); :func:`_dispatch_key_reference` is its definition and
    the only path a refusal is raised from."""
    if draft.material.tier != "sealed":
        raise _uncomputable(
            draft,
            f"it is {draft.material.tier!r}; only sealed work is keyed by content (a compensable or irreversible "
            "node is keyed run-locally, run_local_key)",
        )
    digests = _ref_digests(draft, ref_values, memo)
    if type(read_set) is not tuple and type(read_set) is not list:
        read_set = tuple(read_set)  # read twice when the composed path declines
    try:
        w = draft.effects.writes if writes is None else flatten(writes)
        r = draft.effects.removes if removes is None else flatten(removes)
        mode = draft.effects.boundary_mode if boundary_mode is None else boundary_mode
        if mode in ("hard", "expected"):
            env = None if environment is ABSENT else _canon.value(environment_json(environment), 1)
            return _canon.dispatch_key(
                draft, digests, env, mode, _read_pairs(read_set), _removes(r), _write_set(w)
            )
    except Exception:
        pass  # not swallowed: the reference path returns the same key, or raises the refusal itself
    return _dispatch_key_reference(
        draft, digests, read_set, environment, writes=writes, removes=removes, boundary_mode=boundary_mode
    )


def _ref_digests(
    draft: NodeDraft,
    ref_values: Mapping[int, Any],
    memo: MutableMapping[tuple[str, tuple[str, ...]], str] | None,
) -> dict[int, str]:
    """The input-value digest of every Ref input by index (memoised per ``(from, path)`` in ``memo``)."""
    out: dict[int, str] = {}
    for i, inp in enumerate(draft.material.inputs):
        if isinstance(inp, (Value, Pending)):
            continue
        if i not in ref_values:
            raise _uncomputable(draft, f"no projected value was supplied for Ref input #{i} ({inp.from_!r})")
        mk = (inp.from_, inp.path)
        digest = memo.get(mk) if memo is not None else None
        if digest is None:
            try:
                digest = input_value_digest(ref_values[i])
            except CanonicalError as exc:
                raise _uncomputable(draft, f"Ref input #{i} value: {exc.message}", exc) from exc
            if memo is not None:
                memo[mk] = digest
        out[i] = digest
    return out


def _dispatch_key_reference(
    draft: NodeDraft,
    digests: Mapping[int, str],
    read_set: Iterable[tuple[str, str]],
    environment: Any,
    *,
    writes: Iterable[EntryInput] | None,
    removes: Iterable[EntryInput] | None,
    boundary_mode: str | None,
) -> str:
    # The generic construction: the whole content document walked and encoded by canonical.key. It is the
    # definition _canon.dispatch_key must equal, and the path every refusal is raised from.
    inputs: dict[str, Any] = {}
    for i, inp in enumerate(draft.material.inputs):
        if isinstance(inp, Value):
            inputs[str(i)] = {"kind": "literal", "value": inp.value}
        elif isinstance(inp, Pending):
            inputs[str(i)] = _digest_input(ORDERING_ONLY, inp)
        else:
            inputs[str(i)] = _digest_input(digests[i], inp)
    try:
        w = draft.effects.writes if writes is None else flatten(writes)
        r = draft.effects.removes if removes is None else flatten(removes)
    except PlanError as exc:
        raise _uncomputable(draft, exc.message, exc) from exc
    mode = draft.effects.boundary_mode if boundary_mode is None else boundary_mode
    if mode not in ("hard", "expected"):
        raise _uncomputable(draft, f"boundary mode {mode!r} is neither 'hard' nor 'expected'")
    try:
        hermetic = hermetic_json(read_set, w, r, mode)
    except (PlanError, TypeError, ValueError) as exc:
        raise _uncomputable(draft, f"malformed read set or effects: {exc}", exc) from exc
    content = _content(draft, inputs)
    if environment is not ABSENT:
        content["environment"] = environment_json(environment)
    content["hermetic"] = hermetic
    try:
        return key(content)
    except CanonicalError as exc:
        raise _uncomputable(draft, exc.message, exc) from exc


# ------------------------------------------------------------------------------------- run-local, digest


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


def plan_digest_document(plan_id: str, flow: str, nodes: list[Any]) -> dict[str, Any]:
    """The document a plan digest hashes, given its nodes' JSON in plan order: the node list is a *literal*
    input of a content document whose body names the plan (``planId``) and its flow."""
    return {
        "kind": "content",
        "body": {"kind": "plan", "planId": plan_id, "flow": flow},
        "inputs": {"nodes": {"kind": "literal", "value": nodes}},
        "layers": [],
        "capabilities": {},
    }
