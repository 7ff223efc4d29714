"""The content-addressed cache: the dispatch seam, admission, the local (SQL) and shared (artifact store) tiers,
explain and maintenance (ls / verify / gc / revoke), and the publisher keys a shared tier is signed with."""

from __future__ import annotations

from .admission import Admissible, Admission, NotAdmissible, admit, admit_entry, admit_settlement
from .dispatch import PROVENANCE_EVENT, CacheDispatcher
from .entry import ENTRY_FORMAT, CacheEntry, Undecodable, check_cacheable, decode_entry
from .local import LocalRow, LocalTier
from .maintenance import revoke
from .model import (
    CacheDecision,
    DispatchRequest,
    DispatchResult,
    Execute,
    Miss,
    ReplayFailed,
    SettleHook,
    StaleReadSet,
    Unmeasurable,
    UnverifiableEvidence,
    VerifiedHit,
)
from .requests import declaration_of, node_request
from .shared import SharedTier
from .signing import Trust, generate_key_pair, load_private_key, parse_trusted_keys, workspace_key

__all__ = [
    "Admissible",
    "Admission",
    "CacheDecision",
    "CacheDispatcher",
    "CacheEntry",
    "DispatchRequest",
    "DispatchResult",
    "ENTRY_FORMAT",
    "Execute",
    "LocalRow",
    "LocalTier",
    "Miss",
    "NotAdmissible",
    "PROVENANCE_EVENT",
    "ReplayFailed",
    "SettleHook",
    "SharedTier",
    "Trust",
    "StaleReadSet",
    "Undecodable",
    "Unmeasurable",
    "UnverifiableEvidence",
    "VerifiedHit",
    "admit",
    "admit_entry",
    "admit_settlement",
    "check_cacheable",
    "declaration_of",
    "decode_entry",
    "generate_key_pair",
    "load_private_key",
    "node_request",
    "parse_trusted_keys",
    "revoke",
    "workspace_key",
]
