"""Typed value codecs: how a step's arguments are keyed and its results stored, for values that are not plain JSON.

A codec gives a type a stable tag, a canonical plain-JSON **key form** (folded into dispatch keys) and an
**encode/decode** pair for stored results (a hit returns an equal value of the same type). The registry
(:class:`CodecRegistry`) wraps typed values as ``{"$smthrs": tag, "v": doc}`` inside plain JSON.

- Pure: no I/O of its own; large payloads go through an injected :class:`BlobSink` and come back through a
  :class:`BlobSource`.
- Never pickle, never eval: a class-carrying value decodes only to a class of a module already in ``sys.modules``;
  anything else is ``CodecError(unsafe_codec)`` and the dispatch seam runs the step instead of serving it.
- A type with no codec is ``CodecError(no_codec)`` naming the type and the ``smthrs_value_codecs`` plugin hook.
- :func:`builtin_codecs` are the built-ins (key forms: docs/rules.md, "Typed values"); plugins add theirs through
  the ``smthrs_value_codecs(settings)`` hook; the runtime builds the registry (``Runtime.codecs``).
- :func:`path_arguments` lists the ``pathlib`` paths inside an argument (itself, or inside lists, tuples, dicts and
  sets): a path's key is its text, never the file's content.
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
