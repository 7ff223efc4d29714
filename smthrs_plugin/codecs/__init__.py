"""Typed value codecs: how a step's arguments are keyed and its results stored, for values that are not plain JSON.

A codec gives a type a stable tag, a canonical plain-JSON **key form** (folded into dispatch keys: the key is the
content), and an **encode/decode** pair for stored results (a hit returns an equal value of the same type). The
registry (:class:`CodecRegistry`) wraps typed values as ``{"$smthrs": tag, "v": doc}`` inside plain JSON.

Invariants
- Pure: no store, no I/O of its own. Large payloads go through an injected :class:`BlobSink` and come back through a
  :class:`BlobSource` (the dispatch seam passes the content-addressed artifact store).
- Never pickle, never eval. Decoding a class-carrying value (pydantic model, dataclass, Enum) resolves its class
  ONLY among modules already imported in this process (``sys.modules``) — importing a module named by a stored
  document would run that module's code, and whoever can write a shared cache tier controls the document. Import
  the module defining your types before the step runs (defining the step next to them does). A document naming a
  module that is not imported, or a class of another kind, is refused (``CodecError(unsafe_codec)``), and the
  dispatch seam then runs the step instead of serving it.
- A type with no codec is ``CodecError(no_codec)`` naming the type and the ``smthrs_value_codecs`` plugin hook.

Built in: :func:`builtin_codecs` (pydantic ``BaseModel``, dataclasses, aware ``datetime``/``date``/aware ``time``,
``Decimal``, ``UUID``, ``Enum``, ``tuple``, ``bytes``; numpy/pandas/pyarrow when importable), and:
- ``set`` / ``frozenset``: members sorted by the canonical bytes of their key forms (hash-seed independent).
- ``PurePosixPath`` / ``PureWindowsPath`` / ``PosixPath`` (``pathlib.Path``) / ``WindowsPath``: flavour, pure or
  concrete, and the path text as given — never resolved, no file-system access.
- numpy scalars (``np.int64``, ``np.float32``, ``np.bool_``, ``np.datetime64``, ``np.str_`` ...), when numpy is
  installed: ``dtype.str`` and the exact value (every NaN of a dtype keys alike).
- pandas object columns of lists/dicts (as Arrow list/struct columns, when they read back exactly) and
  list/struct/map columns of pyarrow Tables and ``pd.ArrowDtype`` columns.
Plugins add theirs through the ``smthrs_value_codecs(settings)`` hook; the runtime builds the registry
(``Runtime.codecs``).

:func:`path_arguments` lists the ``pathlib`` paths inside an argument (itself, or inside lists, tuples, dicts and
sets), for a caller that must know whether a step was handed a path whose file it may read: a path's key is its
text, never the file's content.
"""

from __future__ import annotations

from ._builtin import INLINE_LIMIT, builtin_codecs
from ._imports import class_path, resolve_class
from ._paths import path_arguments
from .registry import (
    HOOK_NAME,
    JSON,
    MARKER,
    BlobSink,
    BlobSource,
    CodecRegistry,
    ValueCodec,
    type_name,
)

__all__ = [
    "HOOK_NAME",
    "INLINE_LIMIT",
    "JSON",
    "MARKER",
    "BlobSink",
    "BlobSource",
    "CodecRegistry",
    "ValueCodec",
    "builtin_codecs",
    "class_path",
    "default_registry",
    "path_arguments",
    "resolve_class",
    "type_name",
]


def default_registry() -> CodecRegistry:
    """A registry of :func:`builtin_codecs` only (the runtime adds the plugins' codecs to its own)."""
    return CodecRegistry(builtin_codecs())
