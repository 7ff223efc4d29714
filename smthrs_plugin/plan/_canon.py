"""Canonical JSON text of the documents compile hashes, written by composition instead of a generic walk. PURE.

Invariant: every function here returns exactly the RFC 8785 text that ``canonical.canonical_bytes`` writes for
the same document (decoded), or raises. It never returns a weaker or different form: whenever it cannot *prove*
the bytes equal — a leaf of an unexpected type, an integer outside the safe range, a lone surrogate, a missing
upstream key — it raises, and the caller recomputes through the reference path (``keys._plan_key_reference``,
``compile._plan_digest_reference``), which returns the same key or raises the exact refusal it always raised.

Why composition is exact: RFC 8785 is defined member by member — an object is its members sorted by key (UTF-16
code units) and joined, an array its elements joined, each written independently of its context — so the text
of a document is the concatenation of the texts of its parts. The skeletons spelled here (the plan key's
``content`` document, ``material_body``, digest inputs and nodes) have fixed ASCII member names, written in
sorted order. Leaves are written the way both the stdlib encoder and ``rfc8785`` write them: strings through
the C ``encode_basestring`` (the stdlib's own ``ensure_ascii=False`` string encoder; lone surrogates refused
first), safe ints as ``str(int)``. Free-form user values (bodies, literal values, approval/wait specs,
capability groups) go through ``canonical_bytes`` itself, wrapped in as many one-element lists as they sit deep
in the document, so its depth limit counts exactly as in a whole-document walk.

Why it exists: a generic walk re-checks every node's whole document (and the digest re-walks all nodes at once);
for 100,000 nodes that walk was most of compile's time (benchmarks/graph.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from collections.abc import Iterator
from json.encoder import encode_basestring
from typing import Any

from ..canonical import KEY_PREFIX, canonical_bytes
from .fileset import Glob, TreeArtifact
from .model import Pending, Ref, Value

__all__ = ["Slow", "text", "value", "effects", "plan_key", "dispatch_key", "digest_node", "digest"]

_SAFE_INT = 2**53 - 1


class Slow(Exception):
    """The fast path cannot prove its text equals the reference's; recompute through the reference path."""


def text(s: Any) -> str:
    """Canonical text of a string leaf."""
    if type(s) is not str:
        raise Slow
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise Slow from None
    return encode_basestring(s)


def value(v: Any, depth: int) -> str:
    """Canonical text of a plain-JSON value nested ``depth`` containers deep in its document."""
    tv = type(v)
    if tv is str:
        return text(v)
    if tv is int:
        if -_SAFE_INT <= v <= _SAFE_INT:
            return str(v)
        raise Slow
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    wrapped = v
    for _ in range(depth):
        wrapped = [wrapped]
    raw = canonical_bytes(wrapped)
    return raw[depth : len(raw) - depth].decode("utf-8")


def _strings(items: Any) -> str:
    if type(items) is not tuple:
        raise Slow
    return "[" + ",".join([text(x) for x in items]) + "]"


def _entry(e: Any) -> str:
    # keys.entry_declared(e): an exact path as its string, a tree or a glob tagged (members in sorted order)
    t = type(e)
    if t is str:
        return text(e)
    if t is TreeArtifact:
        return '{"_tag":"TreeArtifact","path":' + text(e.path) + "}"
    if t is Glob:
        exclude = e.exclude
        head = '{"_tag":"Glob","exclude":' + _strings(exclude) + "," if exclude else '{"_tag":"Glob",'
        return head + '"include":' + _strings(e.include) + "}"
    raise Slow


def _entries(entries: Any) -> str:
    if not entries:
        return "[]"
    if type(entries) is not tuple:
        raise Slow
    return "[" + ",".join([_entry(e) for e in entries]) + "]"


_EMPTY_EFFECTS = {
    mode: f'{{"boundaryMode":"{mode}","reads":[],"writes":[]}}' for mode in ("hard", "expected")
}


def effects(e: Any) -> str:
    """Canonical text of ``keys.effects_json(e)``: a node's effects as the plan digest folds them."""
    reads, writes, removes, mode = e.reads, e.writes, e.removes, e.boundary_mode
    if not reads and not writes and not removes and type(mode) is str and mode in _EMPTY_EFFECTS:
        return _EMPTY_EFFECTS[mode]
    return (
        '{"boundaryMode":'
        + text(mode)
        + ',"reads":'
        + _entries(reads)
        + (',"removes":' + _entries(removes) if removes else "")
        + ',"writes":'
        + _entries(writes)
        + "}"
    )


#: ``,"version":…}`` by version: the tail of most material bodies (sealed, no nondeterministic, no wait).
#: Bounded, since a draft that bypassed validation could carry any string there.
_TAILS: dict[str, str] = {}


def _material_body(draft: Any, m: Any) -> str:
    # keys.material_body; members in sorted order: approval?, declaration, nondeterministic?, tier?, version, wait?
    approval, tier, version, nondeterministic, wait = (
        draft.approval,
        m.tier,
        m.version,
        m.nondeterministic,
        draft.wait,
    )
    head = (
        '{"approval":' + value(approval, 2) + ',"declaration":' if approval is not None else '{"declaration":'
    )
    if nondeterministic is None and wait is None and tier == "sealed" and type(version) is str:
        tail = _TAILS.get(version)
        if tail is None:
            tail = ',"version":' + text(version) + "}"
            if len(_TAILS) < 64:
                _TAILS[version] = tail
    else:
        tail = ""
        if nondeterministic is not None:
            tail += ',"nondeterministic":' + value(nondeterministic, 2)
        if tier != "sealed":
            tail += ',"tier":' + value(tier, 2)
        tail += ',"version":' + text(version)
        if wait is not None:
            tail += ',"wait":' + value(wait, 2)
        tail += "}"
    return head + value(m.body, 2) + tail


def _path(path: Any) -> str:
    if type(path) is not tuple:
        raise Slow
    return "[" + ",".join([text(seg) for seg in path]) + "]"


def _input(inp: Any, upstream: Any, quoted: Any) -> str:
    t = type(inp)
    if t is Value or (t is not Pending and t is not Ref and isinstance(inp, Value)):
        return '{"kind":"literal","value":' + value(inp.value, 3) + "}"
    up = quoted.get(inp.from_)
    if up is None:
        up = upstream.get(inp.from_)
        if up is None:
            raise Slow
        up = text(up)
    if t is Pending or (t is not Ref and isinstance(inp, Pending)):
        return '{"digest":' + up + ',"kind":"digest","reference":"pending"}'
    if inp.path:
        return (
            '{"digest":' + up + ',"kind":"digest","path":' + _path(inp.path) + ',"reference":"ref-projected"}'
        )
    return '{"digest":' + up + ',"kind":"digest","reference":"ref"}'


def _members(parts: list[str]) -> str:
    if len(parts) > 10:
        # members order by key text ("10" before "2"); a quote sorts below every digit, so sorting the
        # written members orders them by key
        parts.sort()
    return ",".join(parts)


def _caps_layers(m: Any) -> tuple[str, str]:
    caps_in, layers_in = m.capabilities, m.layers
    caps = (
        '{"declared":[]}' if type(caps_in) is dict and not caps_in else value(m.normalized_capabilities(), 1)
    )
    if type(layers_in) is tuple and not layers_in:
        layers = "[]"
    else:
        layers = "[" + ",".join([text(x) for x in m.normalized_layers()]) + "]"
    return caps, layers


#: Per draft (by id, checked through a weak reference): the text of its material body, capabilities and layers as
#: its plan key wrote them inside :func:`remembering` — ``verify_plan``, which every ``PlanScheduler.run`` calls
#: first, keys every node there — so the dispatch key of the same draft reuses them instead of writing them again.
#: A plain ``compile_plan`` remembers nothing: its plan is verified again before it runs, and the references it
#: would keep are two tracked objects per node for the cyclic GC to walk.
_STATIC: dict[int, tuple[Any, str, str, str]] = {}
_STATIC_MAX = 1 << 18  # bounds memory only: a miss writes the text again
_REMEMBERING = threading.local()


@contextlib.contextmanager
def remembering() -> Iterator[None]:
    """Remember the static texts of every draft keyed on this thread inside the ``with`` block (see ``_STATIC``)."""
    before = getattr(_REMEMBERING, "on", False)
    _REMEMBERING.on = True
    try:
        yield
    finally:
        _REMEMBERING.on = before


class _DraftRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference that carries its draft's id: one object per remembered draft, where a closure per draft
    (a function, its cell and the reference) tripled what the cyclic GC tracks — a 100,000-node compile allocated
    300,000 of them, and each full collection they triggered walked the whole heap."""

    __slots__ = ("k",)
    k: int


def _forget(ref: _DraftRef) -> None:
    _STATIC.pop(ref.k, None)


def _remember(draft: Any, body: str, caps: str, layers: str) -> None:
    k = id(draft)
    try:
        ref = _DraftRef(draft, _forget)
    except TypeError:
        return
    ref.k = k
    if len(_STATIC) >= _STATIC_MAX:
        _STATIC.clear()
    _STATIC[k] = (ref, body, caps, layers)


def _static(draft: Any, m: Any) -> tuple[str, str, str]:
    """The body, capabilities and layers text of ``draft`` (remembered by its last plan key, else written now)."""
    entry = _STATIC.get(id(draft))
    if entry is not None and entry[0]() is draft:
        return entry[1], entry[2], entry[3]
    caps, layers = _caps_layers(m)
    return _material_body(draft, m), caps, layers


def plan_key(draft: Any, upstream: Any, quoted: Any) -> str:
    """``keys.plan_key(draft, upstream)``; ``quoted`` maps some node ids to the JSON text of ``upstream[id]``
    (written once by the caller, reused by every dependent)."""
    m = draft.material
    inputs = m.inputs
    members = _input_members(inputs, lambda i, inp: _input(inp, upstream, quoted))
    caps, layers = _caps_layers(m)
    body = _material_body(draft, m)
    if getattr(_REMEMBERING, "on", False):
        _remember(draft, body, caps, layers)
    return _content_key(body, caps, "", members, layers)


def _input_members(inputs: Any, text_of: Any) -> str:
    """The members of a key document's ``inputs`` object: ``"<index>":<text_of(index, input)>`` in index order."""
    return _members([f'"{i}":' + text_of(i, inp) for i, inp in enumerate(inputs)]) if inputs else ""


def _content_key(body: str, caps: str, between: str, members: str, layers: str) -> str:
    """The key of a ``"kind":"content"`` document from its members' texts (``between``: the members that sort
    between ``capabilities`` and ``inputs``, each with its leading comma)."""
    doc = (
        '{"body":'
        + body
        + ',"capabilities":'
        + caps
        + between
        + ',"inputs":{'
        + members
        + '},"kind":"content","layers":'
        + layers
        + "}"
    )
    return KEY_PREFIX + hashlib.sha256(doc.encode("utf-8")).hexdigest()


_ORDERING_ONLY_INPUT = '{"digest":"ordering-only","kind":"digest","reference":"pending"}'


def _dispatch_input(i: int, inp: Any, digests: Any) -> str:
    # keys.dispatch_key's inputs: a literal as in the plan key, a Pending as an ordering-only digest, a Ref as the
    # digest of its projected value (keys._digest_input)
    t = type(inp)
    if t is Value:
        return '{"kind":"literal","value":' + value(inp.value, 3) + "}"
    if t is Pending:
        return _ORDERING_ONLY_INPUT
    if t is not Ref:
        raise Slow
    digest = text(digests[i])
    if inp.path:
        return (
            '{"digest":'
            + digest
            + ',"kind":"digest","path":'
            + _path(inp.path)
            + ',"reference":"ref-projected"}'
        )
    return '{"digest":' + digest + ',"kind":"digest","reference":"ref"}'


def dispatch_key(
    draft: Any,
    digests: Any,
    environment: str | None,
    mode: str,
    reads: list[tuple[str, str]],
    removes: list[Any] | None,
    writes: list[Any],
) -> str:
    """``keys.dispatch_key`` from the parts it computes: ``digests`` of the Ref inputs by index, the canonical
    text of the environment as folded (``keys.environment_json``, written by :func:`value` at depth 1; ``None``
    when absent) and the members of ``keys.hermetic_json`` (``reads`` the sorted, deduplicated ``(path,
    digest)`` pairs; ``removes`` None when omitted)."""
    m = draft.material
    inputs = m.inputs
    members = _input_members(inputs, lambda i, inp: _dispatch_input(i, inp, digests))
    body, caps, layers = _static(draft, m)
    read_set = ",".join(['{"digest":' + text(d) + ',"path":' + text(p) + "}" for p, d in reads])
    hermetic = '{"boundaryMode":' + text(mode) + ',"readSet":[' + read_set + "]"
    if removes is not None:
        hermetic += ',"removes":' + value(removes, 2)
    hermetic += ',"writeSet":' + (value(writes, 2) if writes else "[]") + "}"
    between = ("" if environment is None else ',"environment":' + environment) + ',"hermetic":' + hermetic
    return _content_key(body, caps, between, members, layers)


def _priority(p: Any) -> str:
    if type(p) is not int:
        raise Slow
    return str(p) if -_SAFE_INT <= p <= _SAFE_INT else '"' + str(p) + '"'


def digest_node(node: Any, eff: str, ids: dict[str, str], key: str | None) -> str:
    """Canonical text of ``compile._node_json(node)``; ``ids`` memoises the text of node ids; ``key`` is the
    JSON text of ``node.key`` when the caller wrote it (None: written here)."""
    deps = []
    for x in node.depends_on:
        t = ids.get(x) if type(x) is str else None
        if t is None:
            t = ids[x] = text(x)
        deps.append(t)
    conflicts = [
        '{"paths":'
        + _strings(c.paths)
        + ',"runtime":'
        + text(c.runtime)
        + ',"strategy":'
        + text(c.strategy)
        + ',"with":'
        + text(c.with_)
        + "}"
        for c in node.conflicts
    ]
    nid = node.id
    it = ids.get(nid) if type(nid) is str else None
    if it is None:
        it = ids[nid] = text(nid)
    d = node.draft
    return (
        '{"conflicts":['
        + ",".join(conflicts)
        + '],"dependsOn":['
        + ",".join(deps)
        + '],"effects":'
        + eff
        + ',"id":'
        + it
        + ',"key":'
        + (text(node.key) if key is None else key)
        + ',"kind":'
        + text(d.kind)
        + ',"priority":'
        + _priority(d.priority)
        + "}"
    )


def digest(plan_id: Any, flow: Any, nodes: list[str]) -> str:
    """``compile.plan_digest`` (``keys.plan_digest_document``) over node texts written by :func:`digest_node`, in
    plan order."""
    doc = (
        '{"body":{"flow":'
        + text(flow)
        + ',"kind":"plan","planId":'
        + text(plan_id)
        + '},"capabilities":{},"inputs":{"nodes":{"kind":"literal","value":['
        + ",".join(nodes)
        + ']}},"kind":"content","layers":[]}'
    )
    return KEY_PREFIX + hashlib.sha256(doc.encode("utf-8")).hexdigest()
