"""``sp.Workspace``: what a ``@step`` function receives as its first argument when it declares one.

Invariant: it is a plain ``pathlib.Path`` whose value is the root of the sandbox the step runs in (a temporary
tree seeded with the declared reads). Declared outputs written under it are copied back into the real workspace
when the step returns; nothing else is. No Prefect import here: ``import smthrs_plugin`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

__all__ = ["Workspace", "with_workspace"]

if TYPE_CHECKING:  # pragma: no cover
    _PathBase = Path
else:
    _PathBase = type(Path())  # the concrete flavour (PosixPath/WindowsPath) subclasses cleanly on 3.10+


class Workspace(_PathBase):
    """The root of a step's sandbox (a ``pathlib.Path``). Read declared inputs and write declared outputs
    relative to it: ``(ws / "data/clean.csv").write_text(...)``."""


def with_workspace(
    args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None, at: int | None, root: Path
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A step function's call arguments with a :class:`Workspace` at ``root`` inserted as its workspace
    parameter ``name``: at positional index ``at``, or by name (keyword-only, or the positionals before it were
    passed by name). ``name`` None: the arguments unchanged."""
    if name is None:
        return args, kwargs
    ws = Workspace(root)
    if at is None or len(args) < at:
        return args, {**kwargs, name: ws}
    return (*args[:at], ws, *args[at:]), kwargs
