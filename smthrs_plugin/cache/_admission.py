"""Cache admission: the seven conjuncts a settled result must meet before ANY other run may be served it.

SEMANTICS.md §4 and seed step-boundaries ("why only whole-tree evidence may enter the shared cache"). All seven,
in this order (the first that fails is the reason reported):

1. ``tier_sealed`` — the node is sealed. Compensable and irreversible work is keyed run-locally and never shared.
2. ``boundary_hard`` — the declaration is in ``hard`` mode. Expected mode only records deviations; what it
   settles is a claim about this run, not a reusable fact.
3. ``reads_exact`` — every declared read is an exact file path. Globs and trees are expanded at prepare into
   exact ``(path, digest)`` pairs, and those pairs are what a hit re-measures (``check_read_set``); but a file that
   *newly matches* the glob later is invisible to that re-measure, so the recorded read set cannot prove the
   step would read the same inputs again. Disqualified: any ``Glob`` (``src/**/*.py``), any ``TreeArtifact``
   (``src/``), any ``Filegroup`` containing one. Not disqualifying: an exact path that does not exist (it is
   measured as ``absent`` and a hit re-checks that it is still absent). Decided by ``Prepared.all_reads_exact``.
4. ``no_deviation`` — the evidence carries no ``ExpectedSetDeviation``, ``MissingDeclaredOutput`` or
   ``SurvivingDeclaredRemoval``.
5. ``whole_tree_writes_verified`` — the sandbox diffed the whole tree (only the sandbox sets it).
6. ``hermetic_reads_verified`` — the body ran in a hermetic sandbox seeded only with the declared reads.
7. ``read_set_verified`` — the read set the *key* folded (``DispatchRequest.reads``, measured by the caller)
   equals the read set the sandbox measured at prepare and seeded. Otherwise the workspace changed between
   keying and running, and the result belongs to different bytes than its key names.

A result that fails any conjunct is :class:`NotAdmissible`: it stays run-local (recorded under a run-scoped row
and replayed only by its own run's attempt), never served to another run, never published. A stored entry is
re-admitted on every read (:func:`admit_entry`): a shared entry written by another host is only as good as the
claims it carries, so a claim missing or false is ``UnverifiableEvidence``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

from ..boundary._boundary import Prepared
from ..boundary._evidence import Evidence

__all__ = [
    "Conjunct",
    "CONJUNCTS",
    "Admissible",
    "NotAdmissible",
    "Admission",
    "admit",
    "admit_settlement",
    "read_set_verified",
    "admit_entry",
    "admission_claims",
]

Conjunct = Literal[
    "tier_sealed",
    "boundary_hard",
    "reads_exact",
    "no_deviation",
    "whole_tree_writes_verified",
    "hermetic_reads_verified",
    "read_set_verified",
]
CONJUNCTS: tuple[Conjunct, ...] = (
    "tier_sealed",
    "boundary_hard",
    "reads_exact",
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


def admit(
    *,
    tier: str,
    evidence: Evidence,
    all_reads_exact: bool,
    read_set_verified: bool,
) -> Admission:
    """Evaluate the seven conjuncts in order."""
    if tier != "sealed":
        return NotAdmissible("tier_sealed", f"tier {tier!r} is not sealed: its results stay with their run")
    if evidence.boundary_mode != "hard":
        return NotAdmissible(
            "boundary_hard", f"boundary mode {evidence.boundary_mode!r} only records deviations; use 'hard'"
        )
    if not all_reads_exact:
        return NotAdmissible(
            "reads_exact",
            "a declared read is a glob or a tree: a file newly matching it would not be re-measured on a hit;"
            " declare exact paths to make the step shareable",
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


def admit_settlement(
    *, tier: str, key_reads: Iterable[tuple[str, str]], prepared: Prepared, evidence: Evidence
) -> Admission:
    """Admission of a fresh sandbox settlement (conjunct 7 from :func:`read_set_verified`)."""
    return admit(
        tier=tier,
        evidence=evidence,
        all_reads_exact=prepared.all_reads_exact,
        read_set_verified=read_set_verified(key_reads, prepared, evidence),
    )


def admission_claims(
    *, tier: str, all_reads_exact: bool, read_set_verified: bool, nondeterministic: bool
) -> dict[str, Any]:
    """The claims an entry carries so a reader can re-admit it (the evidence carries the rest)."""
    return {
        "tier": tier,
        "allReadsExact": all_reads_exact,
        "readSetVerified": read_set_verified,
        "nondeterministic": nondeterministic,
    }


def admit_entry(claims: Mapping[str, Any], evidence: Evidence) -> Admission:
    """Re-admit a stored entry from its recorded claims and evidence; a missing or non-boolean claim fails."""

    def flag(name: str) -> bool:
        return claims.get(name) is True

    return admit(
        tier=str(claims.get("tier")),
        evidence=evidence,
        all_reads_exact=flag("allReadsExact"),
        read_set_verified=flag("readSetVerified"),
    )
