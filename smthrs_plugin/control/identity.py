"""The identity boundary every control mutation crosses first (copy, decode, bound, durable key, fingerprint).

The control plane's front door to :mod:`smthrs_plugin._control_identity`, where the boundary lives (below the stores, so the
control records' owner decodes stored principals into :class:`Principal`): the same objects, re-exported.
"""

from __future__ import annotations

from .._control_identity import (
    BOUNDS,
    JSON,
    LOCAL_OPERATOR,
    MAX_CANONICAL_BYTES,
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_KEY_CHARS,
    MAX_NAME_CHARS,
    MAX_VALUES,
    Mutation,
    Principal,
    check_idempotency_key,
    check_operation,
    check_text,
    decode_input,
    durable_key,
    fingerprint,
    principal_digest,
    refuse,
    strip_stamped_principals,
    type_name,
)

__all__ = [
    "JSON",
    "Principal",
    "LOCAL_OPERATOR",
    "Mutation",
    "decode_input",
    "check_idempotency_key",
    "check_operation",
    "durable_key",
    "fingerprint",
    "principal_digest",
    "strip_stamped_principals",
    "MAX_CANONICAL_BYTES",
    "MAX_DEPTH",
    "MAX_VALUES",
    "MAX_ENTRIES",
    "MAX_KEY_CHARS",
    "MAX_NAME_CHARS",
    "BOUNDS",
    "refuse",
    "check_text",
    "type_name",
]
