"""The cache dispatch seam's value types: what a caller hands in, what comes back.

This is the *one* seam every plan node and every ``@step`` call goes through: lookup → verify →
replay, or execute in the sandbox → settle → publish. The scheduler and the Prefect host only build a
:class:`DispatchRequest` and read a :class:`DispatchResult`; they never touch cache rows, blobs or evidence flags.

Invariants
- A request carries a key that was computed *by the caller* from declarations plus measured read digests
  (``plan.keys.dispatch_key`` for sealed work, the run-local ordinal key otherwise). The seam never computes a
  weaker key: an uncomputable key is the caller's typed ``key_uncomputable`` error, raised before dispatch.
- Exactly one :data:`CacheDecision` is produced per cache-consulting dispatch (the reference's metrics count each).
  Non-sealed tiers never consult or publish the shared tier (they may replay their own run's attempt).
- ``VerifiedHit`` is the only decision that serves a stored result; every other decision falls through to a real
  execution.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection

Tier = Literal["sealed", "compensable", "irreversible"]
SandboxMode = Literal["hermetic", "whole-tree"]
Outcome = Literal["built", "clean", "failed"]


@dataclass(frozen=True)
class VerifiedHit:
    """A stored entry passed admission, its read set re-measured equal, and its outputs replayed."""

    tier: Literal["local", "shared", "attempt"]
    tag: Literal["VerifiedHit"] = "VerifiedHit"


@dataclass(frozen=True)
class Miss:
    """No servable entry for this key in any consulted tier. ``reason`` None: there was none. ``"expired"``: an
    entry was older than the request's ``max_age_ms`` (``age_ms``: its age, None if unreadable; ``where``: its tier).
    ``"refresh"``: the request asked for a fresh build (``refresh``), so no entry was looked at to be served."""

    reason: Literal["expired", "refresh"] | None = None
    where: Literal["local", "shared"] | None = None
    age_ms: int | None = None
    max_age_ms: int | None = None
    tag: Literal["Miss"] = "Miss"


@dataclass(frozen=True)
class UnverifiableEvidence:
    """An entry exists but its evidence cannot justify reuse (a failed admission conjunct, named in ``reason``)."""

    reason: str
    tag: Literal["UnverifiableEvidence"] = "UnverifiableEvidence"


@dataclass(frozen=True)
class Unmeasurable:
    """The read set could not be re-measured on this host."""

    reason: str
    tag: Literal["Unmeasurable"] = "Unmeasurable"


@dataclass(frozen=True)
class StaleReadSet:
    """Re-measured reads differ from the entry's: ``changed`` is ``[(path, old_digest, new_digest|None)]``."""

    changed: tuple[tuple[str, str, str | None], ...]
    tag: Literal["StaleReadSet"] = "StaleReadSet"


@dataclass(frozen=True)
class ReplayFailed:
    """Verified evidence could not be re-materialised (after one hydrate + retry); ``code`` is the ReplayError code."""

    code: str
    reason: str
    tag: Literal["ReplayFailed"] = "ReplayFailed"


CacheDecision = Union[VerifiedHit, Miss, UnverifiableEvidence, Unmeasurable, StaleReadSet, ReplayFailed]

#: Called inside the write transaction that records a settled dispatch, so the caller's attempt row and journal
#: record commit together with the local cache row.
SettleHook = Callable[["Connection", "DispatchResult"], None]


@dataclass(frozen=True)
class DispatchRequest:
    """Everything the seam needs to serve or execute one node attempt.

    ``key`` is the dispatch key; ``components`` is the plain-JSON breakdown it was computed from (body, inputs,
    environment, read digests ...) recorded with the entry so ``smthrs cache explain`` can say what changed.
    ``reads`` are the measured read digests the key folded, ``[(path, digest)]`` sorted; the seam re-measures them
    before serving a hit. ``declaration`` is a ``boundary.Declaration``.
    """

    run_id: str
    node_id: str
    attempt: int
    key: str
    components: Mapping[str, Any]
    tier: Tier
    declaration: Any
    reads: tuple[tuple[str, str], ...]
    workspace: Path
    sandbox: SandboxMode = "hermetic"
    nondeterministic: bool = False
    consult_shared: bool = True
    publish_shared: bool = True
    on_settled: SettleHook | None = None
    owner: Any = None  # engine.ownership.OwnerId fencing the run's writes (None outside an owned run)
    # Additive (cache engineer): the identity ``smthrs cache explain`` compares entries of — "<plan_id>/<node_id>"
    # for plan nodes, the function's qualname for ``@step``. None → ``node_id``.
    subject: str | None = None
    #: Who commits the settle transaction (the one that calls ``on_settled``): ``commit(fn)`` runs ``fn(conn)`` in
    #: a write transaction and returns its result once committed. None: the seam's own database
    #: (``Database.write_batched``). A scheduler passes its coordinator's commit queue (scheduler/_commits.py).
    commit: Callable[[Callable[[Connection], Any]], Any] | None = field(
        default=None, compare=False, repr=False
    )
    # Freshness and storage (``@step``'s ``cache_expiration`` / ``refresh_cache`` / ``cache_policy=NO_CACHE`` /
    # ``cache_value``). None of them is folded into ``key``: changing them never orphans an entry.
    #: An entry created more than this many milliseconds ago (by the seam's clock, against the entry's
    #: ``provenance.created_at_ms``) is not served, in either tier: ``Miss(reason="expired")``, and the build
    #: replaces it. None: entries never expire.
    max_age_ms: int | None = None
    #: Serve nothing: run ``execute`` and let its result replace the entry (``Miss(reason="refresh")``).
    refresh: bool = False
    #: Neither consult nor store: ``execute`` always runs, its outcome is ``built`` with ``decision=None``, and no
    #: entry is recorded or published (the sandbox, copy-back and ``on_settled`` still happen).
    no_cache: bool = False
    #: A value no codec stores exactly fails the build (``CacheError(value_uncacheable)``) instead of being left
    #: uncached with a warning.
    require_cacheable_value: bool = False
    #: The executor's value is not part of the result: ``None`` is stored and returned (built or served).
    discard_value: bool = False


@dataclass(frozen=True)
class DispatchResult:
    """The settled dispatch. ``outcome`` is ``built`` (the executor ran and succeeded), ``clean`` (served, no
    executor ran) or ``failed`` (the executor raised or the boundary refused; ``error`` says why)."""

    outcome: Outcome
    key: str
    decision: CacheDecision | None
    value: Any = None
    evidence: Any = None
    deviations: tuple[Any, ...] = ()
    error: BaseException | None = None
    published: Mapping[str, str] = field(
        default_factory=dict
    )  # tier -> "published" | "existing" | "unpublished:<stage>" | "queued" (shared, in the background)
    # Additive (cache engineer): milliseconds spent per phase of this dispatch ("lookup", "verify", "replay",
    # "execute", "publish"); for benchmarks and debugging, never part of any key.
    timings: Mapping[str, float] = field(default_factory=dict)
    #: The final ``published["shared"]`` of a publication the dispatcher's background publisher runs after this
    #: result was returned (``published["shared"] == "queued"``); None otherwise. :meth:`final_published` reads it.
    publication: Future[str] | None = field(default=None, compare=False, repr=False)

    def final_published(self, timeout: float | None = None) -> Mapping[str, str]:
        """``published`` with a queued shared publication's final status, waiting for it up to ``timeout``
        seconds (None: as long as it takes; ``CacheDispatcher.drain`` waits for every one). Raises what the
        publication met (a database failure journaling its outcome), or ``TimeoutError``."""
        if self.publication is None:
            return self.published
        return {**self.published, "shared": self.publication.result(timeout)}

    def __reduce__(self) -> tuple[Any, ...]:
        # A queued publication's future stays in this process; a copy elsewhere keeps saying "queued".
        state = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "publication"}
        return (_result, (state,))


def _result(state: dict[str, Any]) -> DispatchResult:
    return DispatchResult(**state)


#: The executor the seam runs on a miss: called with the root of the sandbox tree the body must treat as its
#: workspace (read declared inputs and write declared outputs relative to it; a shell command uses it as cwd).
#: Its return value is the step's value; it must be plain JSON data to be cached.
Execute = Callable[[Path], Any]
