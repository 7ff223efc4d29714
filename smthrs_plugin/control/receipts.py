"""Receipts: the control plane's whole answer to "did my request take effect, and what happened to it?".

The control plane's front door to :mod:`smthrs_plugin._control_receipts`, where the receipts live (below the stores, so the
control records' owner decodes a stored receipt into :class:`Accepted`): the same objects, re-exported.
"""

from __future__ import annotations

from .._control_receipts import (
    RECEIPT_TYPES,
    WAITING_APPROVAL,
    Accepted,
    AlreadyApplied,
    Conflict,
    Parked,
    Receipt,
    Terminal,
    decide_replay,
    receipt_from_dict,
)

__all__ = [
    "Accepted",
    "AlreadyApplied",
    "Parked",
    "Conflict",
    "Terminal",
    "Receipt",
    "RECEIPT_TYPES",
    "WAITING_APPROVAL",
    "receipt_from_dict",
    "decide_replay",
]
