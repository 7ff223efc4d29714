"""``sp.Workspace``: what a ``@step`` function receives as its first argument when it declares one.

Invariant: it is a plain ``pathlib.Path`` whose value is the root of the sandbox the step runs in (a temporary
tree seeded with the declared reads). Declared outputs written under it are copied back into the real workspace
when the step returns; nothing else is. No Prefect import here: ``import smthrs_plugin`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

__all__ = ["Workspace"]

if TYPE_CHECKING:  # pragma: no cover
    _PathBase = Path
else:
    _PathBase = type(Path())  # the concrete flavour (PosixPath/WindowsPath) subclasses cleanly on 3.10+


class Workspace(_PathBase):
    """The root of a step's sandbox (a ``pathlib.Path``). Read declared inputs and write declared outputs
    relative to it: ``(ws / "data/clean.csv").write_text(...)``."""
