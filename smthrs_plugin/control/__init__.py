"""Control plane: the identity boundary, receipts and plan cards (pure value types, kept below the records floor in
``smthrs_plugin._control_*`` so the control records' owner, ``records.control``, decodes rows into them), and the
durable parts built on them — approvals (:mod:`.authority`, :mod:`.approvals`), run admission and launching
(:mod:`.launch`), following a run to its end (:mod:`.follow`, the CLI's retry policy) and the facade
:class:`~.facade.Control` (plan, run, approve, deny, cancel, resume, list, show, and the reads the review page and
the CLI show).

Every control mutation first crosses :mod:`.identity` (copy, decode, bound, key, fingerprint), then answers one
of the :mod:`.receipts`; ``plan`` answers a :class:`~smthrs_plugin._control_cards.PlanCard` instead.

The public namespace ``sp.control`` (``__all__``) is what a caller of :class:`Control` (``rt.control()``) and an
approval-authority plugin handle: the five receipts (named as their wire ``_tag``: ``Accepted``,
``AlreadyApplied``, ``Parked``, ``Conflict``, ``Terminal``), plan cards and envelopes, principals, approval
targets, approval states (``PendingApproval``, ``Approved``, ``Denied``) and authorities. ``require_approval`` is
a durable wait: it is ``sp.require_approval``. Everything else is internal; import it from its module.
"""

from __future__ import annotations

from .._control_cards import CardNode, Envelope, PlanApproval, PlanCard
from .approvals import Approved, Denied, PendingApproval, TokenState
from .authority import (
    DEFAULT_AUTHORITY,
    ApprovalAuthority,
    AuthorityRequest,
    Authorized,
    DelegatedAuthority,
    Delegation,
    NodeTarget,
    PlanTarget,
    Unauthorized,
)
from .facade import Control
from .follow import Held, follow
from .identity import LOCAL_OPERATOR, Mutation, Principal
from .receipts import (
    Accepted,
    AlreadyApplied,
    Conflict,
    Parked,
    Receipt,
    Terminal,
    decide_replay,
    receipt_from_dict,
)

# `PendingApproval`: an approval request not decided yet (`Pending` is the plan's ordering-only input, sp.plan).
__all__ = [
    # the facade and its receipts
    "Control",
    "Receipt",
    "Accepted",
    "AlreadyApplied",
    "Parked",
    "Conflict",
    "Terminal",
    "receipt_from_dict",
    "decide_replay",
    # following a run to its end (the retry policy of `smthrs run --key`)
    "follow",
    "Held",
    # who asks, and what a mutation is
    "Principal",
    "LOCAL_OPERATOR",
    "Mutation",
    # plan cards
    "PlanCard",
    "CardNode",
    "PlanApproval",
    "Envelope",
    # approvals: targets, states, authorities
    "PlanTarget",
    "NodeTarget",
    "TokenState",
    "PendingApproval",
    "Approved",
    "Denied",
    "ApprovalAuthority",
    "AuthorityRequest",
    "Authorized",
    "Unauthorized",
    "DelegatedAuthority",
    "Delegation",
    "DEFAULT_AUTHORITY",
]
