"""``pathlib`` paths as values, and :func:`path_arguments`, which finds them inside a step's argument.

Invariants
- **A path is its text, never the file.** The key form is the flavour (``posix``/``windows``), whether the path is
  pure or concrete, and ``str(path)`` exactly as given: never resolved, made absolute or ``stat``-ed, so keying
  touches no file system. What the FILE holds is not part of this key — a step that reads a path it was given
  declares that read (the step decorator can use :func:`path_arguments` to check for paths inside the workspace).
- **Same class back.** ``PurePosixPath``, ``PureWindowsPath``, ``PosixPath`` and ``WindowsPath`` (exactly; a
  subclass needs its own codec) decode to the same class and string. A concrete path of the other operating
  system's flavour cannot be built here and is refused (``undecodable``), as is a stored string that pathlib would
  not print back unchanged (a forged, non-canonical document).
"""

from __future__ import annotations

import pathlib
from typing import Any

from ..canonical import MAX_DEPTH
from ..errors import CodecError
from .registry import JSON, BlobSink, BlobSource, CodecRegistry, type_name

__all__ = ["PathCodec", "path_arguments"]

# (flavour, pure) -> class. Concrete classes are named, not only the one of this OS, so a stored WindowsPath is
# recognised on POSIX (and refused there: it cannot be instantiated) rather than misread.
_CLASSES: dict[tuple[str, bool], type[pathlib.PurePath]] = {
    ("posix", True): pathlib.PurePosixPath,
    ("windows", True): pathlib.PureWindowsPath,
    ("posix", False): pathlib.PosixPath,
    ("windows", False): pathlib.WindowsPath,
}
_FORMS = {cls: form for form, cls in _CLASSES.items()}


class PathCodec:
    """``PurePosixPath`` / ``PureWindowsPath`` / ``PosixPath`` / ``WindowsPath``: ``{"flavour": "posix" |
    "windows", "pure": bool, "path": str(path)}`` (key form and stored form alike)."""

    tag = "path"

    def handles(self, value: Any) -> bool:
        return type(value) in _FORMS

    def key_form(self, value: Any, registry: CodecRegistry) -> JSON:
        flavour, pure = _FORMS[type(value)]
        return {"flavour": flavour, "pure": pure, "path": str(value)}

    def encode(self, value: Any, registry: CodecRegistry, sink: BlobSink | None) -> JSON:
        doc = self.key_form(value, registry)
        rebuilt = self.decode(doc, registry, None)
        if type(rebuilt) is not type(value) or rebuilt != value:
            raise CodecError(
                "invalid_value",
                f"path {value!r} does not read back equal to itself from its text",
                type=type_name(value),
            )
        return doc

    def decode(self, doc: JSON, registry: CodecRegistry, source: BlobSource | None) -> Any:
        if not (
            type(doc) is dict
            and set(doc) == {"flavour", "pure", "path"}
            and type(doc["flavour"]) is str
            and type(doc["pure"]) is bool
            and type(doc["path"]) is str
            and (doc["flavour"], doc["pure"]) in _CLASSES
        ):
            raise CodecError(
                "undecodable",
                "a stored path must be {'flavour': 'posix' | 'windows', 'pure': bool, 'path': str}",
            )
        cls = _CLASSES[(doc["flavour"], doc["pure"])]
        try:
            path = cls(doc["path"])
        except (NotImplementedError, TypeError, ValueError) as exc:  # e.g. a WindowsPath on POSIX
            raise CodecError(
                "undecodable",
                f"a stored {cls.__name__} cannot be built in this process: {exc}",
                cause=exc,
            ) from exc
        if str(path) != doc["path"]:
            raise CodecError(
                "undecodable",
                f"a stored {cls.__name__} text {doc['path']!r} is not in pathlib's own form ({str(path)!r})",
            )
        return path

    def blob_digests(self, doc: JSON) -> list[str]:
        return []


def path_arguments(value: Any) -> list[pathlib.PurePath]:
    """Every ``pathlib.PurePath`` (any class, subclasses included) in ``value``: ``value`` itself, or found inside
    lists, tuples, dicts (keys and values), sets and frozensets, nested to any depth up to ``MAX_DEPTH``.

    Meant for the step decorator, to see whether an argument names a path (e.g. one inside the workspace) whose
    FILE the step may read: a path's key is its text only. Order: the walk order of lists, tuples and dicts;
    the paths found inside a set come sorted by (class name, text), so the result never depends on the hash seed.
    Duplicates are kept. Other objects are not looked into (a dataclass or pydantic model holding a path is not
    reported). ``CodecError(invalid_value)`` for a value nested deeper than ``MAX_DEPTH`` (or a cycle); nothing
    else is refused — it reads values, it never keys or stores them.
    """
    found: list[pathlib.PurePath] = []
    _collect(value, found, 0)
    return found


def _collect(value: Any, found: list[pathlib.PurePath], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise CodecError("invalid_value", f"value nested deeper than {MAX_DEPTH} levels (or a cycle)")
    if isinstance(value, pathlib.PurePath):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, found, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _collect(k, found, depth + 1)
            _collect(v, found, depth + 1)
    elif isinstance(value, (set, frozenset)):
        inside: list[pathlib.PurePath] = []
        for member in value:
            _collect(member, inside, depth + 1)
        found.extend(sorted(inside, key=lambda p: (type(p).__name__, str(p))))
