"""A bounded YAML reader for plan files: plain data and line marks from an untrusted file, in bounded time and memory.

Invariants
- Nothing is built by PyYAML's composer or constructor (both recurse, and the constructor expands aliases without
  a bound). The value is built here, iteratively, from PyYAML's event stream (libyaml's parser when installed,
  else the pure-Python one; both are iterative state machines), so hostile depth can never become a Python
  ``RecursionError`` and an alias can never expand past the budget.
- Every bound is checked *before* the work it bounds: the file is read at most ``MAX_FILE_BYTES + 1`` bytes; a
  container's depth is checked on its start event, before anything under it is read; an alias's expansion is
  counted against the node budget before it is copied.
- Bounds: file ≤ ``MAX_FILE_BYTES`` (1 MiB); container nesting ≤ ``MAX_DEPTH`` (128, as the control plane's input
  boundary, ``control/identity.py``); ≤ ``MAX_NODES`` YAML nodes in all (scalars, keys and containers), an alias
  counting as the full size of what it names. Aliases are supported (a shared ``reads:`` list is a legitimate
  use) but each use is a copy, so the result is a plain tree and every later walk over it is bounded by the
  same budget; the 1 KiB "billion laughs" is refused at the alias that would cross it.
- Refused outright: duplicate mapping keys (YAML says keys are unique; PyYAML keeps the last one silently, which
  would let a later ``approval: none`` undo an earlier ``approval: required``), keys that are not strings
  (complex, numeric, null, alias keys), merge keys (``<<``), duplicate and recursive anchors, explicit tags other
  than the core scalar/collection ones, scalars the core schema cannot build (an integer past Python's digit
  limit), more than one document.
- Every refusal is ``PlanError(invalid_plan_file)`` naming the source, the 1-based line and the field (the
  nearest enclosing mapping key, or ``"(document)"``); nothing is ever fixed up.

The result is ``Loaded(value, marks)``: ``value`` is what ``yaml.safe_load`` would return for an accepted file
(dicts, lists, str/int/float/bool/None, datetimes for unquoted timestamps), and ``marks.line(path)`` is the line of
a mapping key or sequence item addressed by its path (the nearest existing ancestor's line for a missing path).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Union

import yaml

from ..errors import PlanError

__all__ = ["MAX_FILE_BYTES", "MAX_DEPTH", "MAX_NODES", "Loaded", "Marks", "read_bounded", "load_bounded"]

MAX_FILE_BYTES = 1024 * 1024
MAX_DEPTH = 128
#: Enough for a plan file at the library's node cap (10,000 nodes × ~25 YAML nodes each), small enough that the
#: copies an alias makes stay far below the 200 MB a hostile file may cost.
MAX_NODES = 250_000

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "str", "timestamp"))
_MAP_TAG = _TAG + "map"
_SEQ_TAG = _TAG + "seq"
_MERGE_TAG = _TAG + "merge"
_DOCUMENT = "(document)"

# libyaml's parser is ~20x faster on a 1 MiB file; the pure-Python one is the same state machine.
_Loader: Any = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader


class _Mark:
    """Line of one mapping entry (its key) or sequence item, and the marks of what is under it."""

    __slots__ = ("line", "children")

    def __init__(self, line: int, children: dict[Any, _Mark | int] | None) -> None:
        self.line = line
        self.children = children


_Child = Union[_Mark, int]  # a scalar's mark is just its line (one int instead of an object per leaf)


class Marks:
    """1-based lines by path (mapping keys and sequence indexes) into a loaded document."""

    def __init__(self, root: _Mark) -> None:
        self._root = root

    def line(self, path: tuple[Any, ...]) -> int:
        """The line of ``path``; for a path that does not exist, the line of its nearest existing ancestor."""
        cur: _Child = self._root
        best = self._root.line
        for seg in path:
            children = cur.children if isinstance(cur, _Mark) else None
            if children is None:
                break
            try:
                nxt = children.get(seg)
            except TypeError:  # an unhashable segment names nothing
                break
            if nxt is None:
                break
            cur = nxt
            best = nxt.line if isinstance(nxt, _Mark) else nxt
        return best


@dataclass(frozen=True)
class Loaded:
    """An accepted document: its plain value and the line marks of its entries."""

    value: Any
    marks: Marks


def read_bounded(path: str | os.PathLike[str], *, limit: int = MAX_FILE_BYTES) -> str:
    """The text of ``path`` (UTF-8), reading at most ``limit + 1`` bytes: a larger file is refused without being
    read in full (a device or a huge file costs no more memory than the limit)."""
    src = os.fspath(path)
    try:
        with open(src, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise PlanError(
            "invalid_plan_file", f"cannot read plan file {src}: {exc}", cause=exc, file=src
        ) from exc
    if len(data) > limit:
        raise PlanError(
            "invalid_plan_file",
            f"{src}:1: the plan file is larger than {limit:,} bytes; split the plan, or keep bulk data out of it "
            "(reads: names files, it does not inline them)",
            file=src,
            line=1,
            field=_DOCUMENT,
            limit=limit,
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise PlanError(
            "invalid_plan_file",
            f"{src}:{line}: the plan file is not valid UTF-8 ({exc.reason} at byte {exc.start}); save it as UTF-8",
            cause=exc,
            file=src,
            line=line,
            field=_DOCUMENT,
        ) from exc


class _Frame:
    """One open container while its events are read."""

    __slots__ = ("value", "children", "anchor", "start", "key", "key_line", "line", "field")

    def __init__(self, value: Any, line: int, anchor: str | None, start: int, field: str) -> None:
        self.value = value
        self.children: dict[Any, _Child] = {}
        self.anchor = anchor
        self.start = (
            start  # the node count before this container: its size is the count at its end minus this
        )
        self.key: str | None = None  # a mapping's key awaiting its value
        self.key_line = 0
        self.line = line
        self.field = field  # the nearest enclosing mapping key, for refusals

    def line_of(self, key: str) -> int:
        """The line of this mapping's entry ``key`` (already read)."""
        mark = self.children.get(key)
        if isinstance(mark, _Mark):
            return mark.line
        return mark if isinstance(mark, int) else self.line


def load_bounded(text: str, *, source: str) -> Loaded | None:
    """Build the single YAML document in ``text`` within the module's bounds (``None`` for an empty stream);
    ``source`` names the file in refusals."""
    loader = _Loader(text)
    try:
        return _Builder(loader, source).document()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = mark.line + 1 if mark is not None else 1
        why = getattr(exc, "problem", None) or str(exc)
        if "nesting depth" in why:
            # libyaml's scanner looks ahead over flow brackets and has its own (larger) depth cap, so a deep
            # bracket run can stop there before its start events reach ours: the same refusal either way.
            raise PlanError(
                "invalid_plan_file",
                f"{source}:{line}: field {_DOCUMENT!r}: nested deeper than {MAX_DEPTH} levels; flatten the structure",
                cause=exc,
                file=source,
                line=line,
                field=_DOCUMENT,
                limit=MAX_DEPTH,
            ) from exc
        raise PlanError(
            "invalid_plan_file",
            f"{source}:{line}: not valid YAML: {why}",
            cause=exc,
            file=source,
            line=line,
            field=_DOCUMENT,
        ) from exc
    finally:
        loader.dispose()


class _Builder:
    def __init__(self, loader: Any, source: str) -> None:
        self.loader = loader
        self.source = source
        self.nodes = 0
        # anchor -> (value, marks, size in nodes); an anchor is entered only once its node is complete.
        self.anchors: dict[str, tuple[Any, _Child, int]] = {}
        self.open_anchors: set[str] = set()

    def refuse(self, line: int, field: str, why: str, **details: Any) -> PlanError:
        return PlanError(
            "invalid_plan_file",
            f"{self.source}:{line}: field {field!r}: {why}",
            file=self.source,
            line=line,
            field=field,
            **details,
        )

    def count(self, n: int, line: int, field: str, what: str) -> None:
        if self.nodes + n > MAX_NODES:
            raise self.refuse(
                line,
                field,
                f"{what} would make the document more than {MAX_NODES:,} YAML nodes (aliases count as the full "
                "size of what they name); write a smaller plan, or split it",
                limit=MAX_NODES,
            )
        self.nodes += n

    def document(self) -> Loaded | None:
        ld = self.loader
        ld.get_event()  # StreamStart
        if ld.check_event(yaml.StreamEndEvent):
            return None
        ld.get_event()  # DocumentStart
        value, mark = self.node()
        ld.get_event()  # DocumentEnd
        if not ld.check_event(yaml.StreamEndEvent):
            line = ld.peek_event().start_mark.line + 1
            raise self.refuse(line, _DOCUMENT, "a plan file holds one YAML document; remove the second (---)")
        ld.get_event()
        root = mark if isinstance(mark, _Mark) else _Mark(mark, None)
        return Loaded(value, Marks(root))

    def node(self) -> tuple[Any, _Child]:
        """Read one node (iteratively: ``stack`` holds the open containers) and return it with its mark."""
        ld = self.loader
        stack: list[_Frame] = []
        while True:
            event = ld.get_event()
            line = event.start_mark.line + 1
            top = stack[-1] if stack else None
            awaiting_key = top is not None and isinstance(top.value, dict) and top.key is None
            # The field a refusal names: the key this node is the value of, else the nearest enclosing key.
            field = _DOCUMENT if top is None else top.key if top.key is not None else top.field
            done: tuple[Any, _Child] | None = None
            if isinstance(event, yaml.ScalarEvent):
                self.count(1, line, field, "this value")
                if awaiting_key:
                    assert top is not None
                    top.key, top.key_line = self.key(event, top, line), line
                    continue
                value = self.scalar(event, line, field)
                if event.anchor is not None:
                    self.anchor(event.anchor, line, field)
                    self.anchors[event.anchor] = (value, line, 1)
                done = (value, line)
            elif isinstance(event, yaml.AliasEvent):
                if awaiting_key:
                    raise self.refuse(line, field, f"an alias (*{event.anchor}) cannot be a mapping key")
                done = self.alias(event, line, field)
            elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                is_map = isinstance(event, yaml.MappingStartEvent)
                if awaiting_key:
                    raise self.refuse(
                        line, field, "a mapping key must be a plain string, not a list or mapping"
                    )
                if len(stack) + 1 > MAX_DEPTH:
                    raise self.refuse(
                        line,
                        field,
                        f"nested deeper than {MAX_DEPTH} levels; flatten the structure",
                        limit=MAX_DEPTH,
                    )
                if event.tag not in (None, "!", _MAP_TAG if is_map else _SEQ_TAG):
                    raise self.refuse(line, field, f"tag {event.tag!r} is not allowed in a plan file")
                if event.anchor is not None:
                    self.anchor(event.anchor, line, field)
                    self.open_anchors.add(event.anchor)
                self.count(1, line, field, "this " + ("mapping" if is_map else "list"))
                stack.append(_Frame({} if is_map else [], line, event.anchor, self.nodes - 1, field))
                continue
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                frame = stack.pop()
                closed = _Mark(frame.line, frame.children)
                if frame.anchor is not None:
                    self.open_anchors.discard(frame.anchor)
                    self.anchors[frame.anchor] = (frame.value, closed, self.nodes - frame.start)
                done = (frame.value, closed)
            else:  # pragma: no cover - the parser emits no other event inside a document
                raise self.refuse(line, field, f"unexpected YAML event {type(event).__name__}")
            value, mark = done
            if not stack:
                return value, mark
            parent = stack[-1]
            if isinstance(parent.value, dict):
                key = parent.key
                assert key is not None
                parent.value[key] = value
                # A mapping entry is located at its key (as the field names it), what is under it by its own marks.
                parent.children[key] = (
                    _Mark(parent.key_line, mark.children) if isinstance(mark, _Mark) else parent.key_line
                )
                parent.key = None
            else:
                parent.children[len(parent.value)] = mark
                parent.value.append(value)

    def key(self, event: Any, frame: _Frame, line: int) -> str:
        tag = self.tag_of(event)
        if tag == _MERGE_TAG:
            raise self.refuse(
                line, frame.field, "merge keys (<<) are not supported in plan files; write the fields out"
            )
        if event.anchor is not None:
            raise self.refuse(
                line, frame.field, f"an anchor (&{event.anchor}) on a mapping key is not supported"
            )
        if tag != _TAG + "str":
            raise self.refuse(
                line,
                frame.field,
                f"mapping key {event.value!r} must be a string (quote it: {event.value!r}: ...)",
            )
        key = event.value
        if key in frame.value:
            raise self.refuse(
                line,
                key,
                f"duplicate key {key!r} (first on line {frame.line_of(key)}); a key may appear once per "
                "mapping — remove one",
            )
        return str(key)

    def tag_of(self, event: Any) -> str:
        tag = event.tag
        if tag is None or tag == "!":
            tag = self.loader.resolve(yaml.ScalarNode, event.value, event.implicit)
        return str(tag)

    def scalar(self, event: Any, line: int, field: str) -> Any:
        tag = self.tag_of(event)
        if tag not in _SCALAR_TAGS:
            raise self.refuse(line, field, f"tag {tag!r} is not allowed in a plan file")
        node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
        try:
            return self.loader.yaml_constructors[tag](self.loader, node)
        except (ValueError, OverflowError, yaml.YAMLError) as exc:
            raise self.refuse(
                line, field, f"{event.value[:80]!r} is not a valid {tag[len(_TAG) :]}: {exc}"
            ) from exc

    def anchor(self, name: str, line: int, field: str) -> None:
        if name in self.anchors or name in self.open_anchors:
            raise self.refuse(line, field, f"anchor &{name} is defined twice; give each anchor its own name")

    def alias(self, event: Any, line: int, field: str) -> tuple[Any, _Child]:
        name = event.anchor
        if name in self.open_anchors:
            raise self.refuse(
                line, field, f"alias *{name} refers to a node that contains it (a recursive alias)"
            )
        if name not in self.anchors:
            raise self.refuse(line, field, f"alias *{name} names no anchor defined before it")
        value, mark, size = self.anchors[name]
        self.count(size, line, field, f"alias *{name} ({size:,} nodes)")
        # A copy, so the result is a tree: later walks over it cost what the budget counted, and no two places
        # share one mutable value. The marks are shared: they are never mutated.
        return _copy_tree(value), (_Mark(line, mark.children) if isinstance(mark, _Mark) else line)


def _copy_tree(value: Any) -> Any:
    """A deep copy of plain dict/list data, iteratively (the budget already bounds its size)."""
    if not isinstance(value, (dict, list)):
        return value
    root: Any = {} if isinstance(value, dict) else []
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        src, dst = stack.pop()
        items = src.items() if isinstance(src, dict) else enumerate(src)
        for k, v in items:
            if isinstance(v, (dict, list)):
                c: Any = {} if isinstance(v, dict) else []
                stack.append((v, c))
            else:
                c = v
            if isinstance(dst, dict):
                dst[k] = c
            else:
                dst.append(c)
    return root
