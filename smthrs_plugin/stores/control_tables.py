"""Tables of the control plane: plan cards, approval tokens, decisions, grants, receipts, admitted runs and resume
delegations (DDL: migration ``0006_control_plane``).

Declared on :data:`~smthrs_plugin.stores.schema.metadata` and registered in ``stores/__init__.py`` so the
migrated-schema diff test covers them.

Invariants:

- ``control_plans`` holds one reviewable card per row (canonical JSON in ``card_json``, its digest beside it).
  Cards are never rewritten; ``seq`` numbers the cards of one card digest (0, 1, ...): a new card of the same
  content is minted only after the previous one was denied or spent, so "the current card of this content" is
  the row with the highest ``seq``.
- ``control_tokens`` is one approval request: a plan card's (``kind = 'Plan'``, ``plan_id``) or a running step's
  (``kind = 'Node'``, ``(run_id, request_id)`` unique). The digest and envelope it pins never change.
- ``control_decisions`` has at most ONE row per token (primary key): resolving is first writer wins, so a token
  is decided exactly once (``AlreadyResolved`` is the durable evidence). A denial installs no grant.
- ``control_grants`` records what an approval authorised, for how long (``once | run | remembered``) and, for
  ``once``, the run that used it (``used_by_run``).
- ``control_receipts`` stores only ``Accepted`` receipts under their durable key with the request fingerprint
  (``Parked`` is never recorded; replays are computed from the row).
- ``control_runs`` are the approval facts of an admitted run (card, token, grant, decider), written in the same
  transaction as the run row and its receipt. ``control_resumes`` are resume delegations a node decision recorded.
- Run-scoped rows cascade with their run (like ``attempts``); plan-scoped rows live as long as the database.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, ForeignKey, Index, Integer, PrimaryKeyConstraint, Table, Text

from .schema import metadata

__all__ = [
    "control_plans",
    "control_tokens",
    "control_decisions",
    "control_grants",
    "control_receipts",
    "control_runs",
    "control_resumes",
]

control_plans = Table(
    "control_plans",
    metadata,
    Column("plan_id", Text, primary_key=True),
    Column("digest", Text, nullable=False),
    Column("seq", Integer, nullable=False),
    Column("flow_id", Text, nullable=False),
    # The persisted plan (scheduler plan store) the card pins: its file plan id and digest.
    Column("plan_name", Text, nullable=False),
    Column("plan_digest", Text, nullable=False),
    Column("deploy_class", Integer, nullable=False),
    Column("card_json", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    Index(None, "digest", "seq", unique=True),
)

control_tokens = Table(
    "control_tokens",
    metadata,
    Column("token_id", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("plan_id", Text, ForeignKey("control_plans.plan_id")),
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE")),
    Column("request_id", Text),
    Column("flow_id", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("envelope_json", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    Index(None, "plan_id", unique=True),
    Index(None, "run_id", "request_id", unique=True),
)

control_decisions = Table(
    "control_decisions",
    metadata,
    Column("token_id", Text, ForeignKey("control_tokens.token_id", ondelete="CASCADE"), primary_key=True),
    Column("decision", Text, nullable=False),
    Column("principal_id", Text, nullable=False),
    Column("principal_kind", Text, nullable=False),
    Column("scope", Text),
    Column("grant_id", Text),
    Column("via_grant_id", Text),
    Column("decided_at_ms", BigInteger, nullable=False),
)

control_grants = Table(
    "control_grants",
    metadata,
    Column("grant_id", Text, primary_key=True),
    Column("token_id", Text, ForeignKey("control_tokens.token_id", ondelete="CASCADE"), nullable=False),
    Column("kind", Text, nullable=False),
    Column("scope", Text, nullable=False),
    Column("flow_id", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("envelope_digest", Text, nullable=False),
    Column("envelope_json", Text, nullable=False),
    Column("run_id", Text),
    Column("principal_id", Text, nullable=False),
    Column("principal_kind", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    Column("used_at_ms", BigInteger),
    Column("used_by_run", Text),
    Index(None, "kind", "scope", "flow_id", "digest", "envelope_digest"),
    Index(None, "run_id", "digest"),
)

control_receipts = Table(
    "control_receipts",
    metadata,
    Column("durable_key", Text, primary_key=True),
    Column("operation", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("receipt_json", Text, nullable=False),
    Column("run_id", Text),
    Column("created_at_ms", BigInteger, nullable=False),
    Index(None, "run_id"),
)

control_runs = Table(
    "control_runs",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
    Column("plan_id", Text, ForeignKey("control_plans.plan_id"), nullable=False),
    Column("card_digest", Text, nullable=False),
    Column("token_id", Text),
    Column("grant_id", Text),
    Column("durable_key", Text, nullable=False),
    Column("admitted_by_id", Text, nullable=False),
    Column("admitted_by_kind", Text, nullable=False),
    Column("admitted_at_ms", BigInteger, nullable=False),
    Index(None, "plan_id"),
)

control_resumes = Table(
    "control_resumes",
    metadata,
    Column("run_id", Text, ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    Column("token_id", Text, nullable=False),
    Column("decision", Text, nullable=False),
    Column("principal_id", Text, nullable=False),
    Column("principal_kind", Text, nullable=False),
    Column("created_at_ms", BigInteger, nullable=False),
    PrimaryKeyConstraint("run_id", "token_id"),
)
