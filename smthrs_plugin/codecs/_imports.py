"""Resolving a class from the import path a stored document names — without running any code.

Invariant: importing a module executes its import-time code, so a document read from a cache tier (which anyone
able to write that tier controls) must never make this process import anything. A class path ``module:qualname``
is resolved ONLY when ``module`` is already in ``sys.modules`` (the process imported it itself, typically because
the step that returns the type lives there), and by static dictionary lookups (``vars(...)``), so neither a
module-level ``__getattr__`` nor a descriptor runs. The object found must be a class of the expected kind; a
function such as ``os:system`` is refused before it could be called. Classes defined inside a function
(``<locals>`` in their qualname) have no import path and cannot be stored.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import CodecError

__all__ = ["class_path", "resolve_class"]


def class_path(cls: type) -> str:
    """``module:qualname`` of ``cls``; ``CodecError(invalid_value)`` when it has no importable path."""
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<locals>" in qualname:
        raise CodecError(
            "invalid_value",
            f"class {qualname or cls!r} has no import path (it is defined inside a function); define it at"
            " module level so a stored value can name it",
        )
    return f"{module}:{qualname}"


def resolve_class(path: Any, base: type | tuple[type, ...], what: str) -> type:
    """The class at ``path`` (``module:qualname``), which must be a subclass of ``base``, looked up among the
    modules already imported (module docstring). ``CodecError(unsafe_codec)`` when the module is not imported,
    ``undecodable`` when the path is malformed or names something else."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise CodecError("undecodable", f"stored {what} names class {path!r}, not a `module:qualname` path")
    module_name, qualname = path.split(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise CodecError(
            "unsafe_codec",
            f"stored {what} names class {path!r}, whose module {module_name!r} is not imported in this process;"
            " decoding never imports a module named by a stored document (that would run its code). Import"
            f" {module_name!r} before the step runs (e.g. where the step is defined)",
            path=path,
        )
    obj: Any = module
    for part in qualname.split("."):
        if not part.isidentifier():
            raise CodecError("undecodable", f"stored {what} names class {path!r}, not a qualified name")
        try:
            namespace = vars(obj)
        except TypeError:
            namespace = {}
        if part not in namespace:
            raise CodecError(
                "undecodable",
                f"stored {what} names class {path!r}, which module {module_name!r} does not define (renamed or"
                " moved since it was stored); the step runs again",
                path=path,
            )
        obj = namespace[part]
    if not isinstance(obj, type) or not issubclass(obj, base):
        raise CodecError(
            "unsafe_codec",
            f"stored {what} names {path!r}, which is not a {what} class; refused without calling it",
            path=path,
        )
    return obj
