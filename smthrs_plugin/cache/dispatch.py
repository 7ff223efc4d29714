"""The cache dispatch seam: the one place every plan node and every ``@step`` call goes through.

``CacheDispatcher.dispatch(request, execute)``: local tier, then shared tier → an admissible entry → re-measure its
read set → replay → the stored value (``clean``); or run ``execute`` in the sandbox → settle → admit → publish
(``built``).

Invariants
- **One decision per consult** (sealed only, counted once final); non-sealed tiers do not consult.
- **Per-key serialisation** in a process: the second dispatch of a key is served what the first published.
- **Publication order**: blobs → the local row in the SAME transaction as ``request.on_settled`` → the shared
  entry after commit, blobs first. A failed shared publication is journaled and never fails the dispatch. With
  ``background_publish`` the shared entry is published by the dispatcher's worker (:mod:`._publisher`):
  ``published["shared"] == "queued"``, its final status in ``result.publication``; :meth:`CacheDispatcher.drain`
  and :meth:`CacheDispatcher.close` wait for every queued one, and a crash leaves a spool marker the next
  dispatcher over the same spool republishes.
- **Admission** (:mod:`.admission`): only admitted results are stored ``shared`` and published; a value no codec
  stores exactly is not stored (or fails a ``require_cacheable_value`` build with ``value_uncacheable``).
- **Freshness is the request's, never the key's**: ``max_age_ms``, ``refresh`` and ``no_cache`` decide what is
  served; an expired or refreshed entry is replaced by the build's result.
- **Same key, different result** fails with ``CacheError(result_mismatch)`` unless declared ``nondeterministic``.
- **Failures**: the body's and the boundary's settle ``failed``; database and local-store failures propagate; the
  shared tier never fails a dispatch (unavailable → a miss, or left unpublished, with a warning) — except a shared
  tier whose S3 bucket does not exist: ``CacheError(bucket_missing)`` before anything runs or is written.
- **Publishing takes a configured key**: with only the generated workspace key a shared tier outside the workspace
  is read, never written (:func:`.signing.shared_trust`); the process says so once in its log.
- The seam never computes a key: ``request.key`` is used as given; a malformed request is a typed ``CacheError``
  before anything is written (:mod:`._request_check`: a reused request's components are walked once).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from sqlalchemy.engine import Connection

from .._clock import SYSTEM_CLOCK, Clock
from .._metrics import NULL_METRICS, MetricsPort
from ..boundary import isolation_ran, record_isolation
from ..boundary.evidence import InlineLimits
from ..boundary.measure import Measurer
from ..boundary.sandbox import SandboxResult, run_in_sandbox
from ..canonical import key_digest
from ..codecs import CodecRegistry, default_registry
from ..errors import (
    ArtifactError,
    BoundaryError,
    BoundaryRefusal,
    CacheError,
    CodecError,
    MaterializationConflict,
    StoreError,
)
from ..records.journal import Journal
from ..records.runs import assert_owner
from ..settings import load_cache_settings
from ..stores.artifacts import ArtifactStore
from ..stores.database import Database
from ._publisher import (
    QUEUED,
    Addressed,
    BackgroundPublisher,
    Marker,
    Publication,
    Spool,
    publish_now,
    recover,
)
from ._request_check import RequestCheck
from ._request_check import invalid as _invalid
from ._serve import Refused, replay_entry, same_expansion, served_state, still_served, verify_entry
from ._support import KEY_LOCKS, BlobSink, BlobSource, PhaseTimer, condemnation, expired_age, renewal
from .admission import Admissible, admission_claims, admit, read_set_verified, reads_expanded
from .bounds import SizeCaps, check_size
from .entry import CacheEntry, NotCacheable, Scope, check_cacheable
from .local import ChangeToken, DifferentResult, LocalHit, LocalTier, LocalUndecodable, Remembered
from .model import (
    CacheDecision,
    DispatchRequest,
    DispatchResult,
    Execute,
    Miss,
    SandboxMode,
    StaleReadSet,
    Unmeasurable,
    UnverifiableEvidence,
    VerifiedHit,
)
from .shared import Refusal, SharedTier
from .signing import (
    SigningKey,
    Trust,
    reads_only_notice,
    shared_trust,
    shared_trust_warning,
    trust_from_settings,
)

__all__ = ["CacheDispatcher", "PROVENANCE_EVENT"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Journal record type of every cache publication/invalidation fact.
PROVENANCE_EVENT = "cache-provenance"
#: A local hit refreshes ``last_used_at_ms`` at most this often (a write per hit would dominate hit latency).
_TOUCH_INTERVAL_MS = 60_000


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def _warn_once(message: str | None, level: int = logging.WARNING) -> None:
    """Log a trust message once per process (a dispatcher is built per workspace, often more than once)."""
    if message is None:
        return
    with _WARNED_LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    log.log(level, "%s", message)


@dataclass
class _Consulted:
    """What one dispatch's consult learnt that its build must know: the entry ids it could not serve (never
    compared against by the strict same-key check), and among them those refused for what they ARE rather than
    for this workspace's state (``condemned``: id → reason), which our honest entry may replace at our own name."""

    unservable: set[str] = field(default_factory=set)
    condemned: dict[str, str] = field(default_factory=dict)


class _FailedOutcome(Exception):
    """Carries a ``failed`` result through the dispatch observer so it is counted as a ``Failure`` exit."""

    def __init__(self, result: DispatchResult) -> None:
        super().__init__(result.outcome)
        self.result = result


class CacheDispatcher:
    """The dispatch seam over one workspace, one database (local tier) and the artifact stores.

    ``artifacts``: the local artifact store (spilled outputs of this workspace's settles, blobs of local rows).
    ``shared``: the shared tier's store (``ac/`` entries + blobs); None → the same store as ``artifacts`` (one
    URL for everything, the default). ``journal``: where ``cache-provenance`` records go (None → a
    :class:`Journal` on ``db``). ``measurer``: the workspace's long-lived measurer (one per workspace: its stat
    cache is what makes hits cheap). ``sandbox_mode``: ``"hermetic"`` honours each request's ``sandbox``;
    ``"whole-tree"`` runs every body over a full copy (never admissible: undeclared reads are possible).
    ``trust``: the publisher keys (:mod:`.signing`; None → from ``SMTHRS_CACHE_SIGNING_KEY`` /
    ``SMTHRS_CACHE_TRUSTED_KEYS``, else this workspace's own key). ``size_caps``: the output size bounds (None →
    ``SMTHRS_CACHE_MAX_OUTPUT_BYTES`` / ``SMTHRS_CACHE_MAX_STEP_BYTES``). ``revocation_refresh_s``: how stale the
    revocation view of a LOCAL hit may be (None → ``SMTHRS_CACHE_REVOCATION_REFRESH_S``, 60 s). ``codecs``:
    the value codecs results are stored and read back with (None → the built-ins,
    :func:`~smthrs_plugin.codecs.default_registry`; the runtime passes its plugins' registry).
    ``background_publish``: shared entries are published after the dispatch returns, by one worker thread
    (``published["shared"] == "queued"``; :meth:`drain`/:meth:`close` wait for them); False (the default):
    before it returns. ``spool``: the directory whose markers let the next dispatcher over it republish what a
    crash left unpublished (background only; the runtime passes ``<workspace>/.smthrs/publishing``).
    """

    def __init__(
        self,
        db: Database,
        artifacts: ArtifactStore,
        workspace: str | Path,
        *,
        shared: ArtifactStore | None = None,
        journal: Journal | None = None,
        metrics: MetricsPort = NULL_METRICS,
        measurer: Measurer | None = None,
        sandbox_mode: SandboxMode = "hermetic",
        clock: Clock = SYSTEM_CLOCK,
        host_id: str | None = None,
        limits: InlineLimits = InlineLimits(),
        temp_dir: str | Path | None = None,
        trust: Trust | None = None,
        size_caps: SizeCaps | None = None,
        revocation_refresh_s: float | None = None,
        codecs: CodecRegistry | None = None,
        background_publish: bool = False,
        spool: str | Path | None = None,
    ) -> None:
        if sandbox_mode not in ("hermetic", "whole-tree"):
            raise _invalid(f"sandbox_mode {sandbox_mode!r} is neither 'hermetic' nor 'whole-tree'")
        self.workspace = Path(workspace).resolve()
        self.measurer = measurer if measurer is not None else Measurer(self.workspace)
        if self.measurer.root.resolve() != self.workspace:
            raise _invalid(f"the measurer measures {self.measurer.root}, not the workspace {self.workspace}")
        self.db = db
        self.artifacts = artifacts
        self.shared_store = shared if shared is not None else artifacts
        self.local = LocalTier(db, clock=clock)
        if trust is None or size_caps is None or revocation_refresh_s is None:
            cache_settings = load_cache_settings()
            if trust is None:
                trust = trust_from_settings(cache_settings, self.workspace)
            if size_caps is None:
                size_caps = SizeCaps.from_settings(cache_settings)
            if revocation_refresh_s is None:
                revocation_refresh_s = cache_settings.cache_revocation_refresh_s
        self.trust: Trust = trust
        self.size_caps: SizeCaps = size_caps
        self.shared = SharedTier(
            self.shared_store,
            shared_trust(trust, self.shared_store.url, self.workspace),
            clock=clock,
            revocation_refresh_ms=int(revocation_refresh_s * 1000),
            revocation_memory=db,
        )
        _warn_once(shared_trust_warning(trust, self.shared_store.url, self.workspace))
        _warn_once(reads_only_notice(trust, self.shared_store.url, self.workspace), logging.INFO)
        self.journal = journal if journal is not None else Journal(db, clock=clock)
        self.metrics = metrics
        self.sandbox_mode: SandboxMode = sandbox_mode
        self.clock = clock
        self.host_id = host_id or socket.gethostname()
        self.limits = limits
        self.temp_dir = temp_dir
        self.codecs: CodecRegistry = codecs if codecs is not None else default_registry()
        self._spool = Spool(spool, self.host_id) if spool is not None and background_publish else None
        self._requests = RequestCheck(self.workspace)
        self._publisher: BackgroundPublisher | None = None
        if background_publish:
            self._publisher = BackgroundPublisher(self._publish_queued, spool=self._spool)
            self.recover_publications()

    @property
    def _signer(self) -> SigningKey | None:
        """The key this dispatcher publishes to its shared tier with (None: it reads that tier only)."""
        return None if self.shared.trust is None else self.shared.trust.signer

    # -- the seam --------------------------------------------------------------------------------------------

    def dispatch(self, request: DispatchRequest, execute: Execute) -> DispatchResult:
        """Serve ``request`` from the cache or run ``execute(sandbox_root)``; see the module invariants."""
        checked = self._requests.check(request)
        record_isolation(
            None
        )  # a hit runs no body: nothing from an earlier dispatch in this context may show
        try:
            with self.metrics.observe_dispatch():
                with KEY_LOCKS.hold(key_digest(request.key)):
                    result = self._dispatch(request, execute, checked)
                if result.outcome == "failed":
                    raise _FailedOutcome(result)
        except _FailedOutcome as failed:
            return failed.result
        return result

    def _dispatch(self, request: DispatchRequest, execute: Execute, checked: bool) -> DispatchResult:
        """``checked``: whether this dispatch walked ``request.components`` (else a build walks them before its
        body runs: :mod:`._request_check`)."""
        if self._publisher is not None:  # per-key order: an older build of this key publishes first
            self._publisher.wait_for_key(request.key)
        timer = PhaseTimer()
        if request.tier != "sealed" or request.no_cache:
            return self._build(request, execute, None, timer, checked=checked)
        if request.consult_shared or (request.publish_shared and self._signer is not None):
            self.shared.require_bucket()  # a missing bucket fails here, before anything runs or is written
        seen = _Consulted()
        decision, served = self._consult(request, timer, seen)
        self.metrics.cache_decision(decision.tag)
        if served is not None:
            return served
        return self._build(request, execute, decision, timer, seen, checked=checked)

    # -- consult ---------------------------------------------------------------------------------------------

    def _consult(
        self, request: DispatchRequest, timer: PhaseTimer, seen: _Consulted
    ) -> tuple[CacheDecision, DispatchResult | None]:
        if request.refresh:
            return self._refresh(request, seen), None
        with timer("lookup"):
            # The token first: a commit after it (another process invalidating the row, ...) changes it. Not for a
            # scheduler's node (``on_settled``): every settlement of its run commits, so a token taken now never
            # matches at the next hit, and the probe (a GIL release per consult) would be pure cost.
            token = self.local.change_token() if request.on_settled is None else None
            remembered = self._remembered(request, token)
            found = self.local.lookup(request.key) if remembered is None else remembered
        failure: CacheDecision | None = None
        if isinstance(found, LocalHit) and self._revoked_locally(request, found.entry):
            self.local.forget(request.key)
            failure = UnverifiableEvidence("local entry: its key was revoked (smthrs cache revoke)")
        elif isinstance(found, LocalHit) and (expired := self._expired(request, found.entry, "local")):
            self.local.forget(request.key)
            self._expire(request, found.entry, expired)
            failure = expired
        elif isinstance(found, LocalUndecodable):
            self._invalidate(request, found.key_digest, "undecodable")
            failure = UnverifiableEvidence(f"local entry: {found.reason}")
        elif isinstance(found, LocalHit):
            outcome = self._serve(
                request,
                found.entry,
                "local",
                found.last_used_at_ms,
                timer,
                token=token,
                verified=remembered is not None,
            )
            if isinstance(outcome, DispatchResult):
                return outcome.decision or VerifiedHit("local"), outcome
            if not isinstance(outcome, UnverifiableEvidence):
                return outcome, None  # the read set or the replay failed: another tier's copy would too
            failure = outcome
        if not request.consult_shared:
            return failure or Miss(), None
        # Trusted publishers in order (own key first); a refused document is absent, an unservable entry is
        # remembered so the build never compares against it.
        shared_failure: CacheDecision | None = None
        candidates = self.shared.candidates(request.key)
        while True:
            try:
                with timer("lookup"):
                    judged = next(candidates, None)
            except ArtifactError as exc:
                log.warning("shared cache tier %s is unavailable for lookup: %s", self.shared_store.url, exc)
                self._journal(request, {"action": "unavailable", "stage": "lookup", "reason": str(exc)})
                break
            if judged is None:
                break
            if isinstance(judged, Refusal):
                self._journal_refusal(request, judged)
                failure = failure or UnverifiableEvidence(
                    f"shared entry {judged.name}: {judged.reason}: {judged.detail}"
                )
                continue
            if expired := self._expired(request, judged.entry, "shared"):
                # Never compared against and replaced at our own name by the build (it is too old for this
                # request whoever asks, like a condemned entry).
                self._expire(request, judged.entry, expired)
                seen.unservable.add(judged.entry_id)
                seen.condemned[judged.entry_id] = f"expired ({expired_age(expired)})"
                shared_failure = shared_failure or expired
                continue
            outcome = self._serve(request, judged.entry, "shared", None, timer)
            if isinstance(outcome, DispatchResult):
                return outcome.decision or VerifiedHit("shared"), outcome
            seen.unservable.add(judged.entry_id)
            if (why := condemnation(outcome)) is not None:
                seen.condemned[judged.entry_id] = why
            if isinstance(outcome, (StaleReadSet, Unmeasurable)):
                return outcome, None  # this workspace's reads: every publisher's copy would fail the same way
            shared_failure = shared_failure or outcome
        if isinstance(shared_failure, Miss) and failure is not None:
            # The shared copy expired too: the local entry is the one this host would have served.
            return failure, None
        return shared_failure or failure or Miss(), None

    def _expired(
        self, request: DispatchRequest, entry: CacheEntry, where: Literal["local", "shared"]
    ) -> Miss | None:
        """``Miss(reason="expired")`` when ``entry`` is older than ``request.max_age_ms`` by this seam's clock (an
        entry with no readable creation time cannot be shown fresh: expired), else None."""
        if request.max_age_ms is None:
            return None
        created = entry.provenance.get("created_at_ms")
        now = self.clock.now_ms()
        age = now - created if isinstance(created, int) and not isinstance(created, bool) else None
        if age is not None and age <= request.max_age_ms:
            return None
        return Miss(reason="expired", where=where, age_ms=age, max_age_ms=request.max_age_ms)

    def _expire(self, request: DispatchRequest, entry: CacheEntry, expired: Miss) -> None:
        """Journal an expired entry (and invalidate its local row, so the build's result replaces it — a valid row
        is first-writer-wins, and an unchanged result would otherwise keep the old creation time)."""

        def tx(conn: Connection) -> None:
            self._fence(conn, request)
            if expired.where == "local":
                self.local.invalidate_in(conn, entry.name)
            self._journal_in(
                conn,
                request,
                {
                    "action": "expired",
                    "tier": expired.where,
                    "entry": entry.name,
                    "age_ms": expired.age_ms,
                    "max_age_ms": expired.max_age_ms,
                },
            )

        self.db.write(tx)

    def _refresh(self, request: DispatchRequest, seen: _Consulted) -> Miss:
        """A refresh serves nothing: the local row is invalidated and every trusted shared entry is left out of the
        build's same-key check and replaced at our own name, so the build's result becomes the entry."""
        self.local.forget(request.key)
        self._invalidate(request, key_digest(request.key), "refresh")
        if request.consult_shared:
            try:
                for judged in self.shared.candidates(request.key):
                    if not isinstance(judged, Refusal):
                        seen.unservable.add(judged.entry_id)
                        seen.condemned[judged.entry_id] = "a refresh was requested"
            except ArtifactError as exc:
                log.warning("shared cache tier %s is unavailable for lookup: %s", self.shared_store.url, exc)
        return Miss(reason="refresh")

    def _remembered(self, request: DispatchRequest, token: ChangeToken | None) -> LocalHit | None:
        """This process's last verified serve of ``request.key`` when nothing can have changed since: no commit to
        the database (same ``token``: the row is exactly the one served), the same declaration and read set,
        every read, output and removal in the state that verification left (:func:`still_served`, by stat
        and the stat cache's racy-timestamp rule), and globs and trees still expanding to exactly the recorded
        paths (:func:`same_expansion`). Then the row need not be read nor the entry re-verified; its
        revocation, value decoding and hit record are done as for any local hit. None: verify in full."""
        memo = self.local.recall(request.key, token)
        if memo is None:
            return None
        if (
            memo.entry.key != request.key
            or memo.entry.evidence.read_set != tuple(sorted(request.reads))
            or memo.verified[0] != request.declaration
            or not still_served(memo.verified[1], self.workspace, self.measurer)
            or not same_expansion(request.declaration, memo.entry.evidence.read_set, self.measurer)
        ):
            self.local.forget(request.key)
            return None
        return LocalHit(memo.entry, memo.last_used_at_ms)

    def _revoked_locally(self, request: DispatchRequest, entry: CacheEntry) -> bool:
        """Whether a local row's key was revoked, by this process's revocation view (bounded staleness: re-listed
        at most every ``revocation_refresh_s`` — a warm local hit pays no round trip to the shared tier)."""
        revocations = self.shared.revocations
        try:
            marker = revocations.revoking(entry, fresh=False)
        except ArtifactError as exc:
            revocations.mark_listed()
            log.warning(
                "could not list cache revocations in %s (%s); local hits use the previous list until the next"
                " refresh",
                revocations.store.url,
                exc,
            )
            return False
        if marker is None:
            return False
        self._invalidate(request, entry.name, "revoked")
        return True

    def _serve(
        self,
        request: DispatchRequest,
        entry: CacheEntry,
        tier: str,
        last_used_ms: int | None,
        timer: PhaseTimer,
        *,
        token: ChangeToken | None = None,
        verified: bool = False,
    ) -> DispatchResult | CacheDecision:
        """Serve ``entry``: verify (confinement, admission, read set), decode its value, replay its outputs, record
        the hit. ``verified``: a remembered local serve whose verification and outputs still hold
        (:meth:`_remembered`), so only its value is decoded again. ``token``: the database change token taken
        before ``entry``'s local row was read; a fully verified local serve is remembered under it."""
        if not verified:
            with timer("verify"):
                verdict = verify_entry(
                    entry, tier, request.reads, self.workspace, self.measurer, request.declaration
                )
            if isinstance(verdict, Refused):
                return self._refused(request, entry, verdict)
        with timer("replay"):
            value = self._decode_value(entry, tier)
        if isinstance(value, Refused):
            return self._refused(request, entry, value)
        if not verified:
            with timer("replay"):
                failed = replay_entry(entry, self.workspace, self.artifacts, self.shared, self.measurer)
            if failed is not None:
                return self._refused(request, entry, failed)
            if tier == "local" and token is not None and last_used_ms is not None:
                state = served_state(entry, self.workspace)
                if state is not None:
                    self.local.remember(
                        request.key,
                        Remembered(token, entry, last_used_ms, (request.declaration, state)),
                    )
        result = DispatchResult(
            outcome="clean",
            key=request.key,
            decision=VerifiedHit("local" if tier == "local" else "shared"),
            value=value,
            evidence=entry.evidence,
            timings=timer.ms,
        )
        with timer("record"):
            self._record_hit(request, entry, tier, last_used_ms, result)
        return result

    def _decode_value(self, entry: CacheEntry, tier: str) -> Any:
        """The entry's stored value decoded by the codecs, or :class:`Refused` (never served, never run as code)."""
        try:
            return self.codecs.decode(entry.value, BlobSource(self.artifacts, self.shared_store, self.shared))
        except CodecError as exc:
            reason = f"{exc.code}: {exc.message}"
        except ArtifactError as exc:
            if exc.code == "unavailable":
                raise  # the local store failed: a storage failure, not the entry's
            reason = f"a blob of its value: {exc.code}: {exc.message}"
        log.warning(
            "the %s cache entry %s is not served: its value cannot be decoded (%s)", tier, entry.name, reason
        )
        return Refused(
            UnverifiableEvidence(f"{tier} entry: its value cannot be decoded ({reason})"),
            invalidate=tier == "local",
            reason="undecodable-value",
        )

    def _refused(self, request: DispatchRequest, entry: CacheEntry, refused: Refused) -> CacheDecision:
        self.local.forget(request.key)
        if refused.invalidate:
            self._invalidate(request, entry.name, refused.reason)
        elif refused.reason:
            # A shared entry refused for a named reason (it reaches outside the request's declaration): there is
            # no local row to invalidate, but the refusal is still a fact an operator must be able to find.
            self._journal(
                request,
                {
                    "action": "refused",
                    "entry": entry.name,
                    "reason": refused.reason,
                    "detail": str(refused.decision),
                },
            )
        return refused.decision

    def _record_hit(
        self,
        request: DispatchRequest,
        entry: CacheEntry,
        tier: str,
        last_used_ms: int | None,
        result: DispatchResult,
    ) -> None:
        stale = last_used_ms is None or self.clock.now_ms() - last_used_ms >= _TOUCH_INTERVAL_MS
        if tier == "local" and not stale and request.on_settled is None and request.owner is None:
            return  # nothing to record: the fast path of a warm local hit

        def tx(conn: Connection) -> None:
            self._fence(conn, request)
            if tier == "shared":
                self.local.record_in(conn, entry)  # the next hit on this host is local
            elif stale:
                self.local.touch_in(conn, entry.name)
            if request.on_settled is not None:
                request.on_settled(conn, result)

        self._write(request, tx)

    # -- build -----------------------------------------------------------------------------------------------

    def _build(
        self,
        request: DispatchRequest,
        execute: Execute,
        decision: CacheDecision | None,
        timer: PhaseTimer,
        seen: _Consulted | None = None,
        *,
        checked: bool = True,
    ) -> DispatchResult:
        if not checked:
            self._requests.components(request)  # stored with the entry: walked before the body runs
        mode: SandboxMode = (
            "whole-tree" if "whole-tree" in (request.sandbox, self.sandbox_mode) else "hermetic"
        )
        try:
            with timer("execute"), self.metrics.observe_sandbox_execution():
                settled: SandboxResult[Any] = run_in_sandbox(
                    self.workspace,
                    request.declaration,
                    execute,
                    mode=mode,
                    artifacts=self.artifacts,
                    measurer=self.measurer,
                    limits=self.limits,
                    temp_dir=self.temp_dir,
                    metrics=self.metrics,
                )
        except BoundaryRefusal as exc:
            self.metrics.boundary_settled("Refused")
            return self._settle_failure(request, decision, exc, timer)
        except MaterializationConflict as exc:
            self.metrics.sandbox_conflict()
            return self._settle_failure(request, decision, exc, timer)
        except (StoreError, ArtifactError):
            raise  # the database or the local artifact store failed: not the node's failure
        except BoundaryError as exc:
            if isinstance(exc.cause, ArtifactError) and exc.cause.code == "unavailable":
                raise exc.cause from None  # spilling to the local store failed: a storage failure
            return self._settle_failure(request, decision, exc, timer)
        except Exception as exc:  # the executor's own failure is an outcome, not an exception
            return self._settle_failure(request, decision, exc, timer)
        self.metrics.boundary_settled("Deviation" if settled.evidence.deviations else "Clean")
        with timer("publish"):
            return self._publish(request, decision, settled, timer, seen or _Consulted(), isolation_ran())

    def _settle_failure(
        self, request: DispatchRequest, decision: CacheDecision | None, exc: BaseException, timer: PhaseTimer
    ) -> DispatchResult:
        result = DispatchResult(
            outcome="failed", key=request.key, decision=decision, error=exc, timings=timer.ms
        )
        if request.on_settled is not None or request.owner is not None:

            def tx(conn: Connection) -> None:
                self._fence(conn, request)
                if request.on_settled is not None:
                    request.on_settled(conn, result)

            self._write(request, tx)
        return result

    def _publish(
        self,
        request: DispatchRequest,
        decision: CacheDecision | None,
        settled: SandboxResult[Any],
        timer: PhaseTimer,
        seen: _Consulted,
        isolation: str | None = None,
    ) -> DispatchResult:
        ev = settled.evidence
        value = None if request.discard_value else settled.value
        built = DispatchResult(
            outcome="built",
            key=request.key,
            decision=decision,
            value=value,
            evidence=ev,
            deviations=ev.deviations,
            timings=timer.ms,
        )
        if request.no_cache:  # nothing stored: only the caller's settle record
            return self._commit(
                request, dataclasses.replace(built, published={"local": "no-cache"}), None, None
            )
        too_large = check_size(ev, self.size_caps, node=request.node_id) if request.tier == "sealed" else None
        if too_large is not None:  # refused before anything is recorded or published
            failed = dataclasses.replace(
                built, outcome="failed", error=too_large, published={"local": "unpublished:output_too_large"}
            )
            return self._commit(request, failed, None, None)
        try:
            stored = self.codecs.encode(value, BlobSink(self.artifacts))
            cacheable = check_cacheable(stored)
        except CodecError as exc:
            cacheable = NotCacheable(exc.message)
        if isinstance(cacheable, NotCacheable) and request.require_cacheable_value:
            err = CacheError(
                "value_uncacheable",
                f"{request.subject or request.node_id} returned a {type(value).__module__}."
                f"{type(value).__qualname__} that no value codec stores exactly ({cacheable.reason}), so its result"
                " cannot be cached. Return plain data or a type with a value codec (register one through the"
                " `smthrs_value_codecs` plugin hook), or declare that its value is not cached"
                " (@sp.step(cache_value=False): its outputs are cached, every call returns None)",
                node=request.node_id,
                key=request.key,
            )
            failed = dataclasses.replace(
                built, outcome="failed", error=err, published={"local": "unpublished:value_uncacheable"}
            )
            return self._commit(request, failed, None, None)
        if isinstance(cacheable, NotCacheable):
            log.warning(
                "node %s (key %s) built a value no value codec stores exactly, so it is NOT cached: %s",
                request.node_id,
                request.key,
                cacheable.reason,
            )
            result = dataclasses.replace(
                built, published={"local": "unpublished:value", "shared": "unpublished:value"}
            )
            payload = {"action": "unpublished", "stage": "value", "reason": cacheable.reason}
            return self._commit(request, result, None, payload)
        verified = read_set_verified(request.reads, settled.prepared, ev)
        expanded = reads_expanded(settled.prepared, ev)
        admission = admit(
            tier=request.tier,
            evidence=ev,
            all_reads_exact=settled.prepared.all_reads_exact,
            read_set_verified=verified,
            reads_expanded=expanded,
        )
        scope: Scope = "shared" if isinstance(admission, Admissible) else "run-local"
        entry = CacheEntry.build(
            key=request.key,
            subject=request.subject or request.node_id,
            components=dict(request.components),
            evidence=ev,
            value=stored,
            canonical_value=cacheable.canonical,
            value_blobs=tuple(self.codecs.blob_digests(stored)),
            admission=admission_claims(
                tier=request.tier,
                all_reads_exact=settled.prepared.all_reads_exact,
                read_set_verified=verified,
                nondeterministic=request.nondeterministic,
                reads_expanded=expanded,
            ),
            provenance={
                "run_id": request.run_id,
                "node_id": request.node_id,
                "attempt": request.attempt,
                "host": self.host_id,
                "created_at_ms": self.clock.now_ms(),
                **renewal(decision),
                # How the body was kept from the live workspace (``smthrs cache explain`` shows it).
                **({"isolation": isolation} if isolation is not None else {}),
            },
            scope=scope,
        )
        if scope == "run-local":
            assert not isinstance(admission, Admissible)
            result = dataclasses.replace(
                built, published={"local": "run-local", "shared": f"unpublished:{admission.conjunct}"}
            )
            payload = {"action": "run-local", "conjunct": admission.conjunct, "reason": admission.reason}
            return self._commit(request, result, entry, payload)
        rival = self._shared_rival(request, entry, seen)
        if rival is not None and not request.nondeterministic:
            return self._commit(request, self._mismatch(request, built, rival, "shared"), None, None)
        publish = request.publish_shared and rival is None
        # The marker precedes the commit: a crash after it always leaves one to republish from.
        marker = self._mark(request, entry, seen) if publish else None
        try:
            result = self._commit(request, built, entry, None)
        except BaseException:
            self._unmark(marker)
            raise
        if result.outcome == "built" and publish:
            return self._publish_shared(request, entry, result, seen, marker)
        self._unmark(marker)
        return result

    def _shared_rival(
        self, request: DispatchRequest, entry: CacheEntry, seen: _Consulted
    ) -> CacheEntry | None:
        """A different result already published for this key (checked before our local commit): the first
        trusted publisher's entry, in lookup order, that verifies, is not revoked, was not found unservable by
        this dispatch's consult, and whose blobs all exist. Refused or unservable documents are never compared
        against: they cannot make an honest build fail."""
        if not (request.consult_shared or request.publish_shared):
            return None
        try:
            for judged in self.shared.candidates(request.key):
                if isinstance(judged, Refusal) or judged.entry_id in seen.unservable:
                    continue
                if judged.entry.result == entry.result:
                    return None
                if not self.shared.blobs_present(judged.entry):
                    continue
                return judged.entry
        except ArtifactError as exc:
            log.warning("shared cache tier %s is unavailable: %s", self.shared_store.url, exc)
        return None

    def _mismatch(
        self, request: DispatchRequest, built: DispatchResult, rival: CacheEntry, tier: str
    ) -> DispatchResult:
        prov = rival.provenance
        err = CacheError(
            "result_mismatch",
            f"key {request.key} already has a different result in the {tier} tier (run {prov.get('run_id')!r}, node"
            f" {prov.get('node_id')!r}, host {prov.get('host')!r}): node {request.node_id!r} is not deterministic."
            " Make its value and outputs depend only on its declared inputs, or declare it nondeterministic to keep"
            " the first writer",
            key=request.key,
            tier=tier,
            node=request.node_id,
        )
        return dataclasses.replace(
            built, outcome="failed", error=err, published={"local": "unpublished:result_mismatch"}
        )

    def _commit(
        self,
        request: DispatchRequest,
        result: DispatchResult,
        entry: CacheEntry | None,
        payload: dict[str, Any] | None,
    ) -> DispatchResult:
        """The settle transaction: fence → local row → journal → the caller's ``on_settled`` hook."""

        def tx(conn: Connection) -> DispatchResult:
            self._fence(conn, request)
            res, extra = result, payload
            if entry is not None:
                rec = self.local.record_in(conn, entry)
                if isinstance(rec, DifferentResult):
                    if entry.nondeterministic:
                        extra = {"action": "kept-first-writer", "tier": "local"}
                        res = dataclasses.replace(res, published={**res.published, "local": "existing"})
                    else:
                        res = self._mismatch(request, res, rec.existing, "local")
                elif entry.scope == "shared":
                    res = dataclasses.replace(res, published={**res.published, "local": "published"})
            if res.outcome == "failed" and isinstance(res.error, CacheError):
                extra = {"action": "unpublished", "stage": res.error.code, "reason": res.error.message}
            if extra is not None:
                self._journal_in(conn, request, extra)
            if request.on_settled is not None:
                request.on_settled(conn, res)
            return res

        return self._write(request, tx)

    def _publish_shared(
        self,
        request: DispatchRequest,
        entry: CacheEntry,
        result: DispatchResult,
        seen: _Consulted,
        marker: Path | None = None,
    ) -> DispatchResult:
        if self._signer is None:
            self._journal(
                request,
                {
                    "action": "unpublished",
                    "stage": "signing",
                    "reason": "this machine has no publishing key (SMTHRS_CACHE_SIGNING_KEY or"
                    " SMTHRS_CACHE_SIGNING_KEY_BLOCK): it reads the shared tier but never publishes to it",
                },
            )
            return _published(result, "unpublished:unsigned")
        # Its records are fenced like the dispatch's other records, inline or queued: whoever queued it waits for
        # it before its run ends (a scheduler pass before it returns, a step before its run settles), so a queued
        # publication journals while its owner still holds the run, and a zombie's is refused (FenceLost).
        pub = Publication(
            request.run_id,
            request.node_id,
            request.key,
            entry,
            dict(seen.condemned),
            owner=request.owner,
            marker=marker,
        )
        if self._publisher is not None and self._publisher.offer(pub):
            return dataclasses.replace(
                result, published={**result.published, "shared": QUEUED}, publication=pub.future
            )
        status = self._publish_queued(pub)
        self._unmark(marker)
        return _published(result, status)

    def _publish_queued(self, pub: Publication) -> str:
        return publish_now(self.shared, self.artifacts, pub, self._journal, self._invalidate)

    def _mark(self, request: DispatchRequest, entry: CacheEntry, seen: _Consulted) -> Path | None:
        """The spool marker of a background publication about to be committed (None: published inline)."""
        if self._spool is None or self._signer is None:
            return None
        created = entry.provenance.get("created_at_ms")
        return self._spool.write(
            Marker(request.key, request.run_id, request.node_id, created, dict(seen.condemned))
        )

    def _unmark(self, marker: Path | None) -> None:
        if marker is not None and self._spool is not None:
            self._spool.remove(marker)

    def recover_publications(self) -> int:
        """Queue what a stopped process of this host left unpublished in the spool (a crash after a local commit;
        :func:`._publisher.recover`); returns how many. Called when the dispatcher is built."""
        if self._spool is None or self._publisher is None:
            return 0
        return recover(self._spool, self._publisher, self.local.lookup, self._publish_queued)

    def drain(self) -> None:
        """Wait until every shared publication queued so far has run (their outcomes are journaled and in each
        result's ``publication``); raise the first database failure one met. Free without a background
        publisher."""
        if self._publisher is not None:
            self._publisher.drain()

    def close(self) -> None:
        """Drain the background publisher and stop its worker (later publications run inline); release the local
        tier's change probe."""
        try:
            if self._publisher is not None:
                self._publisher.close()
        finally:
            self.local.close()

    def _journal_refusal(self, request: DispatchRequest, refusal: Refusal) -> None:
        self._journal(
            request,
            {
                "action": "refused",
                "tier": "shared",
                "entry": refusal.name,
                "publisher": refusal.publisher,
                "reason": refusal.reason,
                "detail": refusal.detail,
            },
        )

    # -- durable side records --------------------------------------------------------------------------------

    def _write(self, request: DispatchRequest, tx: Callable[[Connection], T]) -> T:
        """Commit a settle transaction (the one calling ``request.on_settled``) the way the caller asked."""
        commit = request.commit
        return commit(tx) if commit is not None else self.db.write_batched(tx)  # type: ignore[no-any-return]

    def _fence(self, conn: Connection, request: Addressed) -> None:
        if request.owner is not None:
            assert_owner(conn, request.run_id, request.owner)

    def _journal_in(self, conn: Connection, request: Addressed, payload: dict[str, Any]) -> None:
        self.journal.append_in(
            conn, request.run_id, PROVENANCE_EVENT, {"key": request.key, "node": request.node_id, **payload}
        )

    def _journal(self, request: Addressed, payload: dict[str, Any]) -> None:
        def tx(conn: Connection) -> None:
            self._fence(conn, request)
            self._journal_in(conn, request, payload)

        self.db.write(tx)

    def _invalidate(self, request: Addressed, row_key: str, reason: str) -> None:
        def tx(conn: Connection) -> None:
            self._fence(conn, request)
            if self.local.invalidate_in(conn, row_key):
                self._journal_in(conn, request, {"action": "invalidated", "reason": reason})

        self.db.write(tx)


def _published(result: DispatchResult, status: str) -> DispatchResult:
    return dataclasses.replace(result, published={**result.published, "shared": status})
