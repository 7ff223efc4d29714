"""The composition root: ``open_runtime(...)`` wires the stores, the journal, the owner, the cache dispatch seam
and plan schedulers from settings.

- The one wiring point: nothing else in the package constructs a run driver (:meth:`Runtime.run_driver`,
  :attr:`Runtime.driver`), the cache dispatch seam (:attr:`Runtime.dispatcher`, and :func:`process_dispatcher` in a
  task-runner worker process), the control plane (:meth:`Runtime.control`) or the cache tiers
  (:meth:`Runtime.cache_tiers`), so all of them share one owner, journal, clock, liveness check, metrics and
  publisher trust. Each is built on first use, once per runtime.
- Explicit arguments win over ``SMTHRS_*`` settings, which win over the embedded defaults; bad settings (a Prefect
  block included) raise a typed error from ``open_runtime`` before the workspace or the database is touched.
- One workspace, one measurer, shared by the dispatcher and every scheduler.
- A scheduler made by :meth:`Runtime.scheduler` drives its own run through
  :class:`~smthrs_plugin.engine.drive.pass_lifecycle.PassLifecycle` and gates ``approval:`` nodes with the control
  plane's ``NodeGate`` (ARCHITECTURE.md, "runtime.py").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._clock import SYSTEM_CLOCK, Clock
from ._metrics import NULL_METRICS, MetricsPort
from .boundary.evidence import InlineLimits
from .boundary.measure import Measurer
from .cache.bounds import SizeCaps
from .cache.dispatch import CacheDispatcher
from .cache.local import LocalTier
from .cache.model import SandboxMode
from .cache.shared import SharedTier
from .cache.signing import Trust, shared_trust_warning, trust_from_settings
from .codecs import CodecRegistry
from .control.approvals import NodeGate
from .control.facade import Control
from .engine.drive.driver import RunDriver
from .engine.drive.pass_lifecycle import PassLifecycle
from .engine.ownership.arbiter import Ownership
from .engine.ownership.liveness import LivenessCheck
from .engine.waits.flow_waits import HostWaker, set_default_host_waker
from .hooks.manager import Plugins, get_plugins
from .hooks.wiring import observed_metrics, scheduler_options
from .plan import ABSENT, Concurrency
from .records.journal import Journal
from .records.runs import OwnerId, RunStore, current_owner
from .records.waits import WaitStore
from .scheduler import PlanScheduler, Reconciler
from .scheduler.host import Host
from .settings import Settings, load_settings
from .stores.artifacts import ArtifactStore
from .stores.database import Database, open_database

__all__ = ["open_runtime", "Runtime", "CacheTiers", "process_codecs", "process_dispatcher"]


@dataclass(frozen=True)
class CacheTiers:
    """The cache's stores as ``smthrs cache`` maintains them: the local tier (this database's index), the local
    artifact store, the shared tier, this machine's host id, and what to say loudly about the shared tier's trust
    (None when nothing)."""

    local: LocalTier
    artifacts: ArtifactStore
    shared: SharedTier
    host_id: str
    warning: str | None = None


class Runtime:
    """Everything one process needs to run plans against one workspace. Use as a context manager."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        artifacts: ArtifactStore,
        *,
        owner: OwnerId,
        liveness: LivenessCheck,
        metrics: MetricsPort,
        clock: Clock,
        plugins: Plugins | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.settings = settings
        # Plugins (hooks/): the only place they are consulted is this composition root.
        self.plugins: Plugins = plugins if plugins is not None else get_plugins()
        self._plugin_hosts: list[Host] = []
        self.workspace: Path = settings.workspace
        self.db = db
        self.artifacts = artifacts
        self.clock = clock
        self.metrics = metrics
        self.journal = Journal(db, clock=clock)
        self.owner = owner
        self.runs = RunStore(db, journal=self.journal, clock=clock)
        self.ownership = Ownership(
            db, owner=owner, journal=self.journal, liveness=liveness, settings=settings, clock=clock
        )
        self.waits = WaitStore(db, journal=self.journal, runs_store=self.runs, clock=clock)
        # Value codecs: built-ins + every plugin's `smthrs_value_codecs`; results are stored through them.
        self.codecs: CodecRegistry = self.plugins.codecs(settings)
        # Publisher trust from SMTHRS_CACHE_* settings (cache/signing.py): decided at open, so a bad key
        # is refused before anything runs, and shared by the dispatcher and the cache tiers.
        self.trust: Trust = trust if trust is not None else trust_from_settings(settings, self.workspace)
        self._lifecycle = PassLifecycle(self.runs, self.ownership, self.waits)
        self._schedulers: list[PlanScheduler] = []
        self._lock = threading.RLock()
        self._measurer: Measurer | None = None
        self._dispatcher: CacheDispatcher | None = None
        self._driver: RunDriver | None = None
        self._control: Control | None = None

    @property
    def measurer(self) -> Measurer:
        """The workspace's one measurer, shared by the dispatcher and every scheduler (its stat cache is what keeps
        re-measurement cheap), built on first use."""
        with self._lock:
            if self._measurer is None:
                self._measurer = Measurer(self.workspace.resolve())
            return self._measurer

    @property
    def dispatcher(self) -> CacheDispatcher:
        """The cache dispatch seam over this runtime's workspace, database and artifact store (every node and
        every ``@step`` goes through it), built on first use."""
        with self._lock:
            if self._dispatcher is None:
                self._dispatcher = CacheDispatcher(
                    self.db,
                    self.artifacts,
                    self.workspace,
                    measurer=self.measurer,
                    journal=self.journal,
                    metrics=self.metrics,
                    clock=self.clock,
                    host_id=self.owner.host_id,
                    trust=self.trust,
                    size_caps=SizeCaps.from_settings(self.settings),
                    revocation_refresh_s=self.settings.cache_revocation_refresh_s,
                    codecs=self.codecs,
                    # Shared entries are published off each node's path; close() waits for them, and a crash
                    # leaves spool markers the next runtime over this workspace republishes.
                    background_publish=True,
                    spool=self.settings.state_dir / "publishing",
                )
            return self._dispatcher

    @dispatcher.setter
    def dispatcher(self, seam: CacheDispatcher) -> None:
        """Put a wrapper of the seam in its place (one that times or records dispatches, as the benchmarks do):
        schedulers made afterwards dispatch through it."""
        with self._lock:
            self._dispatcher = seam

    @property
    def driver(self) -> RunDriver:
        """This runtime's run driver (``engine.drive.driver.RunDriver``, settings' wait budget, 8 runs at once), built
        on first use: register flows on it, then ``drive`` one run or ``start`` its sweeps (the caller stops it)."""
        with self._lock:
            if self._driver is None:
                self._driver = self._new_driver(None, 8)
            return self._driver

    def run_driver(self, *, wait_budget_s: float | None = None, max_runs: int = 8) -> RunDriver:
        """A NEW run driver wired like :attr:`driver` (this runtime's database, owner, journal, waits, clock,
        liveness check and metrics), with its own flow registry, wait budget (None: ``SMTHRS_WAIT_BUDGET_S``) and
        cap on runs driven at once: for a caller whose registration is its own (``sp.durable_run`` binds a run's
        parameters into the flow it registers; ``smthrs worker --budget/--max-runs``)."""
        return self._new_driver(wait_budget_s, max_runs)

    def _new_driver(self, wait_budget_s: float | None, max_runs: int) -> RunDriver:
        return RunDriver(
            self.db,
            settings=self.settings,
            owner=self.owner,
            clock=self.clock,
            liveness=self.ownership.liveness,
            journal=self.journal,
            waits=self.waits,
            wait_budget_s=wait_budget_s,
            max_runs=max_runs,
            metrics=self.metrics,
        )

    def cache_tiers(self, shared: str | None = None, *, trusted: bool = False) -> CacheTiers:
        """The cache tiers for maintenance (``smthrs cache``): the local tier over this database, this runtime's
        artifact store, and the shared tier on ``shared`` (a URL, opened with the artifact store's options; None:
        the artifact store). ``trusted``: the shared tier judges entries with this runtime's publisher trust, as
        the dispatcher does (and ``warning`` says when a remote tier is read with the workspace's own key only);
        otherwise it judges nothing (listing, gc and revocation see every entry)."""
        shared_store = ArtifactStore(shared, self.artifacts.storage_options) if shared else self.artifacts
        trust = self.trust if trusted else None
        warning = None if trust is None else shared_trust_warning(trust, shared_store.url, self.workspace)
        return CacheTiers(
            LocalTier(self.db),
            self.artifacts,
            SharedTier(shared_store, trust, revocation_memory=self.db),
            self.owner.host_id,
            warning,
        )

    def scheduler(
        self,
        run_id: str,
        *,
        concurrency: Concurrency | Mapping[str, Any] | None = None,
        environment: Any = ABSENT,
        host: Host | None = None,
        rebase_limit: int = 3,
        reconciler: Reconciler | None = None,
        source_id: str = "runtime",
        drive_run: bool = True,
        gate: Any = None,
    ) -> PlanScheduler:
        """A scheduler for ``run_id`` that drives its own run. Without ``host``, a plugin's host provider may
        select one (the Prefect host when a flow run is active), else the local thread pool; ``reconciler``,
        ``environment`` and ``concurrency`` left open come from the plugins (``hooks.wiring``).

        ``drive_run=False``: a run driver (``engine.drive.driver.RunDriver``, ``smthrs worker --plan``) already owns the
        run and settles or parks it after the pass; the scheduler only schedules."""
        opts = scheduler_options(
            self.plugins,
            self.settings,
            run_id,
            host=host,
            reconciler=reconciler,
            environment=environment,
            concurrency=concurrency,
            lifecycle=self._lifecycle,
        )
        if opts.host_owned and opts.host is not None:
            self._plugin_hosts.append(opts.host)
        sched = PlanScheduler(
            run_id,
            self.owner,
            source_id,
            opts.environment,
            opts.concurrency,
            rebase_limit,
            db=self.db,
            dispatcher=self.dispatcher,
            workspace=self.workspace,
            host=opts.host,
            reconciler=opts.reconciler,
            metrics=self.metrics,
            artifacts=self.artifacts,
            journal=self.journal,
            measurer=self.measurer,
            clock=self.clock,
            lifecycle=opts.lifecycle if drive_run else None,
            # Node approval gates (control plane): a node declaring `approval:` asks before its attempt begins and
            # parks the run `waiting-approval` until `smthrs approve RUN_ID --request R` decides it.
            gate=gate if gate is not None else NodeGate(self.db.url, run_id, self.owner),
        )
        self._schedulers.append(sched)
        return sched

    def control(self) -> Control:
        """The control plane over this runtime's database (plan cards, approvals, receipts; ``control/``), built on
        first use and then shared (it serves concurrent callers: ``smthrs serve``'s request threads), wired
        here: this process's owner (the one the schedulers claim with, so an admitted run is launched by its
        admitter), the plugins' approval authority (default: only ``local/operator``) and liveness check, and their
        run waker (told after a decision, signal or cancellation commits: a parked Prefect deployment flow run is
        resumed through the Prefect API)."""
        with self._lock:
            if self._control is None:
                self._control = Control(
                    self.db,
                    owner=self.owner,
                    authority=self.plugins.approval_authority(self.settings),
                    liveness=self.ownership.liveness,
                    settings=self.settings,
                    journal=self.journal,
                    clock=self.clock,
                    waker=self.plugins.host_waker(self.settings),
                    on_decided=(
                        self.plugins.notify_approval_decided
                        if self.plugins.has_observers("smthrs_approval_decided")
                        else None
                    ),
                )
            return self._control

    @property
    def actions(self) -> Mapping[str, Any]:
        """Plan actions from plugins (``call: <name>`` in plan files)."""
        return self.plugins.actions()

    def drain_publications(self) -> None:
        """Wait for every shared-tier publication this runtime's dispatcher queued so far (none built yet: free);
        raises the first database failure one met journaling its outcome."""
        with self._lock:
            dispatcher = self._dispatcher
        drain = getattr(dispatcher, "drain", None)  # a replaced seam (tests, benchmarks) may have none
        if drain is not None:
            drain()

    def close(self) -> None:
        """Close the hosts of the schedulers this runtime made; wait for the dispatcher's queued shared-tier
        publications (raising the first failure one met, after everything is closed); release the measurer's
        pinned root."""
        for s in self._schedulers:
            s.close()
        self._schedulers.clear()
        hosts, self._plugin_hosts = self._plugin_hosts, []
        for h in hosts:
            h.close()
        with self._lock:
            measurer, dispatcher = self._measurer, self._dispatcher
        try:
            close = getattr(dispatcher, "close", None)  # a replaced seam (tests, benchmarks) may have none
            if close is not None:
                close()  # drains its publications; releases the hit path's change probe connection
            else:
                local = getattr(dispatcher, "local", None)
                if local is not None:
                    local.close()
        finally:
            if measurer is not None:
                measurer.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Runtime(workspace={str(self.workspace)!r}, db={self.db!r}, artifacts={self.artifacts!r})"


def _process_host_waker() -> HostWaker | None:
    """The process-wide plugins' run waker under this process's settings: what ``sp.complete`` tells a run's host
    with when called without ``waker=`` (it has no runtime to ask; ``engine`` never calls the plugin manager)."""
    return get_plugins().host_waker(load_settings())


set_default_host_waker(_process_host_waker)


def process_dispatcher(
    db: Database,
    artifacts: ArtifactStore,
    workspace: str | Path,
    *,
    shared: ArtifactStore,
    host_id: str,
    sandbox_mode: SandboxMode,
    limits: InlineLimits,
    temp_dir: str | None,
) -> CacheDispatcher:
    """The cache dispatch seam of a task-runner worker process (a Prefect process pool, Dask), rebuilt from what
    crossed the process boundary (``prefect/_worker.py`` keeps one per process and description). It has no
    runtime: trust, size caps and codecs come from this process's ``SMTHRS_*`` settings, and it counts nothing
    (the coordinator's process owns the metrics)."""
    return CacheDispatcher(
        db,
        artifacts,
        Path(workspace),
        shared=shared,
        host_id=host_id,
        sandbox_mode=sandbox_mode,
        limits=limits,
        temp_dir=temp_dir,
    )


_PROCESS_CODECS: dict[int, tuple[Plugins, CodecRegistry]] = {}
_PROCESS_CODECS_LOCK = threading.Lock()


def process_codecs(plugins: Plugins | None = None) -> CodecRegistry:
    """The value-codec registry of ``plugins`` (default: the process-wide plugins) under this process's
    ``SMTHRS_*`` settings, built once per plugin manager: what ``@step`` keys its arguments with before any
    runtime is opened (a runtime over the same plugins builds the same registry as :attr:`Runtime.codecs`)."""
    plugins = plugins if plugins is not None else get_plugins()
    with _PROCESS_CODECS_LOCK:
        cached = _PROCESS_CODECS.get(id(plugins))
        if cached is None or cached[0] is not plugins:
            cached = _PROCESS_CODECS[id(plugins)] = (plugins, plugins.codecs(load_settings()))
        return cached[1]


def open_runtime(
    workspace: str | Path | None = None,
    db: str | None = None,
    artifacts: str | None = None,
    artifacts_options: Mapping[str, Any] | None = None,
    host_id: str | None = None,
    *,
    liveness: LivenessCheck | None = None,
    metrics: MetricsPort = NULL_METRICS,
    clock: Clock = SYSTEM_CLOCK,
    plugins: Plugins | None = None,
    sqlite_synchronous: str | None = None,
    artifacts_block: str | None = None,
) -> Runtime:
    """Open a runtime over ``workspace`` (default ``SMTHRS_WORKSPACE``, else the current directory). ``db`` and
    ``artifacts`` accept URLs (default: SQLite and local artifacts under ``<workspace>/.smthrs``);
    ``artifacts_options`` are fsspec storage options; ``liveness`` decides steals (default: the plugins' answer, built-in
    the lease); ``plugins`` defaults to the process-wide manager (built-ins + installed ``smthrs`` entry points).
    ``sqlite_synchronous`` (default ``SMTHRS_SQLITE_SYNCHRONOUS``, else ``"full"``) is the SQLite commit durability:
    ``"normal"`` trades power-loss durability of the last commits for one fsync less per commit (see
    :func:`~smthrs_plugin.stores.database.open_database`).
    ``artifacts_block`` (default ``SMTHRS_ARTIFACTS_BLOCK``) names a saved Prefect block (``s3-bucket/<name>``) the
    artifact store — and so the shared cache tier — is built from; ``artifacts_options`` are laid over its
    options. ``artifacts`` beats ``SMTHRS_ARTIFACTS_BLOCK``, ``artifacts_block`` beats ``SMTHRS_ARTIFACTS_URL``; a
    URL and a block at the same level are refused (see :mod:`~smthrs_plugin.settings`)."""
    settings = load_settings(
        workspace=workspace,
        db_url=db,
        artifacts_url=artifacts,
        artifacts_options=dict(artifacts_options) if artifacts_options is not None else None,
        host_id=host_id,
        sqlite_synchronous=sqlite_synchronous,
        artifacts_block=artifacts_block,
    )
    # Blocks are loaded (Prefect API) and refused here, before anything is written; the trust policy too, since
    # its key may come from a Secret block.
    location = settings.artifacts_location()
    trust = trust_from_settings(settings, settings.workspace)
    settings.workspace.mkdir(parents=True, exist_ok=True)
    database = open_database(settings.resolved_db_url, sqlite_synchronous=settings.sqlite_synchronous)
    store = ArtifactStore(location.url, location.options)
    plugins = plugins if plugins is not None else get_plugins()
    return Runtime(
        settings,
        database,
        store,
        owner=current_owner(settings),
        liveness=liveness or plugins.liveness(settings),
        metrics=observed_metrics(metrics, plugins),
        clock=clock,
        plugins=plugins,
        trust=trust,
    )
