"""Receipts: the control plane's whole answer to "did my request take effect, and what happened to it?".

The control plane's front door to :mod:`smthrs_plugin._control_receipts`, where the receipts live (below the stores, so the
control records' owner decodes a stored receipt into :class:`Accepted`): the same objects, re-exported.
"""

from __future__ import annotations

# The same names and objects as the module below (its __all__), so the two lists can never drift apart.
from .._control_receipts import *  # noqa: F403
from .._control_receipts import __all__ as __all__
