"""Cache admission: the seven conjuncts a settled result must meet before ANY other run may be served it.

the step-boundary rules ("why only whole-tree evidence may enter the shared cache"). All seven,
in this order (the first that fails is the reason reported):

1. ``tier_sealed`` — the node is sealed. Compensable and irreversible work is keyed run-locally and never shared.
2. ``boundary_hard`` — the declaration is in ``hard`` mode. Expected mode only records deviations; what it
   settles is a claim about this run, not a reusable fact.
3. ``reads_expanded`` — every declared read is an exact file path, OR the body saw exactly the recorded
   *expansion* of the declared reads. A glob (``data/*.csv``), a tree (``data/``) or a filegroup holding one is
   expanded at prepare into the sorted ``(path, digest)`` pairs of every file it matches; the key folds those
   pairs (with the patterns themselves, in the declaration), the hermetic sandbox seeds exactly those files, and
   the evidence records them as its read set. So the result is a function of that expansion and of nothing the
   body could see besides it. Decided for a fresh settlement by :func:`reads_expanded` (hermetic sandbox, and the
   evidence's read set is the prepared expansion), carried by an entry as the ``readsExpanded`` claim.
   Beyond the exact-reads rule this relies on the hit verification (``cache._serve.verify_entry``): for a
   declaration with a glob or tree read, the declared reads are expanded AGAIN on the serving workspace and the
   entry is served only if that expansion is identical to the recorded one — same paths, same digests. A file
   newly matching, one no longer matching, or one changed is a ``StaleReadSet``, in the local and the shared tier
   alike; an entry whose recorded set omits a file that matches now is never served, whatever it claims.
   Still disqualified: a glob or tree read whose body ran over the whole tree or in place (no hermetic sandbox:
   it could list or open files outside the expansion), and an entry without the claim (written by a version that
   did not re-verify expansions). Not disqualifying: an exact path that does not exist (it is measured as
   ``absent`` and a hit re-checks that it is still absent).
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

Some declarations are run-local whatever happens at run time (a non-sealed tier, ``expected`` boundary mode, a
timer node): :func:`declared_run_local_reason` names why, so ``@step`` can say it once when it is decorated
instead of leaving every miss to look like a first entry.
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
