"""Control plane: the identity boundary, receipts and plan cards (pure parts; durable parts build on them).

Every control mutation first crosses :mod:`.identity` (copy, decode, bound, key, fingerprint), then answers one
of the :mod:`.receipts`; ``plan`` answers a :class:`~.cards.PlanCard` instead.
"""

from __future__ import annotations

from .cards import (
    DEFAULT_SCOPE,
    GRANT_SCOPES,
    CardNode,
    Envelope,
    PlanApproval,
    PlanCard,
    card_digest,
    check_envelope,
    check_plan_digest,
    envelope_matches,
)
from .identity import (
    BOUNDS,
    JSON,
    LOCAL_OPERATOR,
    MAX_CANONICAL_BYTES,
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_KEY_CHARS,
    MAX_VALUES,
    Mutation,
    Principal,
    check_idempotency_key,
    decode_input,
    durable_key,
    fingerprint,
    principal_digest,
    strip_stamped_principals,
)
from .receipts import (
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
    "BOUNDS",
    "JSON",
    "LOCAL_OPERATOR",
    "MAX_CANONICAL_BYTES",
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "MAX_KEY_CHARS",
    "MAX_VALUES",
    "Mutation",
    "Principal",
    "check_idempotency_key",
    "decode_input",
    "durable_key",
    "fingerprint",
    "principal_digest",
    "strip_stamped_principals",
    "RECEIPT_TYPES",
    "WAITING_APPROVAL",
    "Accepted",
    "AlreadyApplied",
    "Conflict",
    "Parked",
    "Receipt",
    "Terminal",
    "decide_replay",
    "receipt_from_dict",
    "DEFAULT_SCOPE",
    "GRANT_SCOPES",
    "CardNode",
    "Envelope",
    "PlanApproval",
    "PlanCard",
    "card_digest",
    "check_envelope",
    "check_plan_digest",
    "envelope_matches",
]
