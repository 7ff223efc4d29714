"""The identity boundary every control mutation crosses first (copy, decode, bound, durable key, fingerprint).

The control plane's front door to :mod:`smthrs_plugin._control_identity`, where the boundary lives (below the stores, so the
control records' owner decodes stored principals into :class:`Principal`): the same objects, re-exported.
"""

from __future__ import annotations

# The same names and objects as the module below (its __all__), so the two lists can never drift apart.
from .._control_identity import *  # noqa: F403
from .._control_identity import __all__ as __all__
