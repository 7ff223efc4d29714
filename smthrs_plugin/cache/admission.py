"""Cache admission: the seven conjuncts a settled result must meet before ANY other run may be served it.

In order, the first that fails being the reason reported: ``tier_sealed``, ``boundary_hard``, ``reads_expanded``,
``no_deviation``, ``whole_tree_writes_verified``, ``hermetic_reads_verified``, ``read_set_verified`` (each defined in
docs/rules.md, "Cache admission").

- A result that fails any conjunct is :class:`NotAdmissible`: it stays run-local (recorded under a run-scoped row and
  replayed only by its own run's attempt), never served to another run, never published.
- :func:`reads_expanded` decides that conjunct for a fresh settlement; an entry carries it as the ``readsExpanded``
  claim, and a hit re-expands glob and tree reads on the serving workspace (``cache._serve.verify_entry``).
- A stored entry is re-admitted on every read (:func:`admit_entry`): a claim missing or false is
  ``UnverifiableEvidence``.
- :func:`declared_run_local_reason` names why a declaration is run-local whatever happens at run time (a non-sealed
  tier, ``expected`` boundary mode, a timer node), so ``@step`` can say it once when it is decorated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from ..boundary.boundary import Prepared
from ..boundary.evidence import Evidence
from ..plan.model import NodeDraft

__all__ = [
    "Conjunct",
    "CONJUNCTS",
    "Admissible",
    "NotAdmissible",
    "Admission",
    "admit",
    "admit_settlement",
    "read_set_verified",
    "reads_expanded",
    "admit_entry",
    "admission_claims",
    "declared_run_local_reason",
]

Conjunct = Literal[
    "tier_sealed",
    "boundary_hard",
    "reads_expanded",
    "no_deviation",
    "whole_tree_writes_verified",
    "hermetic_reads_verified",
    "read_set_verified",
]
CONJUNCTS: tuple[Conjunct, ...] = (
    "tier_sealed",
    "boundary_hard",
    "reads_expanded",
    "no_deviation",
    "whole_tree_writes_verified",
    "hermetic_reads_verified",
    "read_set_verified",
)


@dataclass(frozen=True)
class Admissible:
    """Every conjunct holds: the result may be stored in the shared scope and served to any run."""

    tag: Literal["Admissible"] = "Admissible"


@dataclass(frozen=True)
class NotAdmissible:
    """``conjunct`` failed (the first one, in the documented order); ``reason`` says it in words."""

    conjunct: Conjunct
    reason: str
    tag: Literal["NotAdmissible"] = "NotAdmissible"


Admission = Union[Admissible, NotAdmissible]


def _tier_reason(tier: str) -> str:
    return f"tier {tier!r} is not sealed: its results stay with their run"


def _mode_reason(mode: str) -> str:
    return f"boundary mode {mode!r} only records deviations; use 'hard'"


def admit(
    *,
    tier: str,
    evidence: Evidence,
    all_reads_exact: bool,
    read_set_verified: bool,
    reads_expanded: bool = False,
) -> Admission:
    """Evaluate the seven conjuncts in order. ``reads_expanded``: conjunct 3 for a declaration with a glob or
    tree read (see :func:`reads_expanded`); irrelevant when ``all_reads_exact``."""
    if tier != "sealed":
        return NotAdmissible("tier_sealed", _tier_reason(tier))
    if evidence.boundary_mode != "hard":
        return NotAdmissible("boundary_hard", _mode_reason(evidence.boundary_mode))
    if not all_reads_exact and not reads_expanded:
        return NotAdmissible(
            "reads_expanded",
            "a declared read is a glob or a tree, and the body was not confined to its recorded expansion"
            " (only a hermetic sandbox seeds exactly the matched files), so a hit could not prove it would see"
            " the same files again; run it in a hermetic sandbox, or declare exact paths",
        )
    if evidence.deviations:
        kinds = ", ".join(sorted({d.kind for d in evidence.deviations}))
        return NotAdmissible("no_deviation", f"the step deviated from its declaration ({kinds})")
    if not evidence.whole_tree_writes_verified:
        return NotAdmissible(
            "whole_tree_writes_verified", "the writes were not verified over the whole tree (no sandbox)"
        )
    if not evidence.hermetic_reads_verified:
        return NotAdmissible(
            "hermetic_reads_verified",
            "the body did not run in a hermetic sandbox (undeclared reads possible)",
        )
    if not read_set_verified:
        return NotAdmissible(
            "read_set_verified",
            "the read set the key was computed from differs from what the sandbox measured and seeded"
            " (the workspace changed between keying and running)",
        )
    return Admissible()


def _pairs(reads: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(p), str(d)) for p, d in reads))


def read_set_verified(key_reads: Iterable[tuple[str, str]], prepared: Prepared, evidence: Evidence) -> bool:
    """Conjunct 7: the key's reads, the prepared (and seeded) read set and the evidence's read set are one set."""
    measured = _pairs(prepared.read_set)
    return _pairs(key_reads) == measured and _pairs(evidence.read_set) == measured


def reads_expanded(prepared: Prepared, evidence: Evidence) -> bool:
    """Conjunct 3 of a fresh settlement with a glob or tree read: the body saw exactly the recorded expansion.
    The evidence records the prepared expansion as its read set, and a hermetic sandbox seeded exactly those
    files (and hashed them as copied), so no file outside the expansion existed for the body."""
    return evidence.hermetic_reads_verified and _pairs(evidence.read_set) == _pairs(prepared.read_set)


def admit_settlement(
    *, tier: str, key_reads: Iterable[tuple[str, str]], prepared: Prepared, evidence: Evidence
) -> Admission:
    """Admission of a fresh sandbox settlement (conjunct 3 from :func:`reads_expanded`, 7 from
    :func:`read_set_verified`)."""
    return admit(
        tier=tier,
        evidence=evidence,
        all_reads_exact=prepared.all_reads_exact,
        read_set_verified=read_set_verified(key_reads, prepared, evidence),
        reads_expanded=reads_expanded(prepared, evidence),
    )


def admission_claims(
    *,
    tier: str,
    all_reads_exact: bool,
    read_set_verified: bool,
    nondeterministic: bool,
    reads_expanded: bool = False,
) -> dict[str, Any]:
    """The claims an entry carries so a reader can re-admit it (the evidence carries the rest)."""
    return {
        "tier": tier,
        "allReadsExact": all_reads_exact,
        "readsExpanded": reads_expanded,
        "readSetVerified": read_set_verified,
        "nondeterministic": nondeterministic,
    }


def admit_entry(claims: Mapping[str, Any], evidence: Evidence) -> Admission:
    """Re-admit a stored entry from its recorded claims and evidence; a missing or non-boolean claim fails.
    (``readsExpanded`` admits a glob or tree read only because the server re-expands it on every hit.)"""

    def flag(name: str) -> bool:
        return claims.get(name) is True

    return admit(
        tier=str(claims.get("tier")),
        evidence=evidence,
        all_reads_exact=flag("allReadsExact"),
        read_set_verified=flag("readSetVerified"),
        reads_expanded=flag("readsExpanded"),
    )


def declared_run_local_reason(draft: NodeDraft) -> str | None:
    """Why every result of ``draft`` will stay run-local whatever its run does, or None when it may be shared:
    the declaration alone decides it (a non-sealed tier, ``expected`` boundary mode, a ``wait:`` timer)."""
    tier = draft.material.tier
    if tier != "sealed":
        return _tier_reason(tier)
    if draft.wait is not None:
        return "a timer node is keyed by its run: a content key would serve its elapsed clock to other runs"
    mode = draft.effects.boundary_mode
    if mode != "hard":
        return _mode_reason(mode)
    return None
