"""Every hook a plugin may implement, in one place (pluggy project ``"smthrs"``, entry-point group ``smthrs``).

Pluggability is dependency injection at the owning seam: core classes take a host, a reconciler, a
liveness check or an approval authority in their constructors, and only the composition root
(``runtime.open_runtime``) asks the plugin manager which implementations to pass. Core code never calls a hook.

Invariants
- Specs import only *types* from the floors below (scheduler, engine, settings): a plugin never reaches into a
  store through this module.
- Every hook is called through pluggy's own caller (``pm.hook.<name>(...)``, :mod:`.manager`), so a plugin
  written as pluggy documents it behaves as documented: ``tryfirst``/``trylast`` order the implementations, hook
  wrappers (``@hookimpl(wrapper=True)``, and old-style ``hookwrapper=True``) see and may replace an answer, and
  ``pm.add_hookcall_monitoring`` / ``pm.enable_tracing`` see every call. Answers are validated after the call,
  where they are final (a wrapper has had its say), and an invalid one is a ``PluginError`` naming the plugin.
- "Which implementation" hooks are ``firstresult``: the highest-priority plugin that answers (not ``None``) wins
  and the rest are not called; the built-ins (:mod:`.defaults`) answer last (``trylast``), so any installed
  plugin overrides them.
- "Tell me about it" hooks (observers) fan out to every plugin. They run after the fact, on the thread that
  settled the work, and can never change an outcome: a raising observer is logged with its traceback naming its
  plugin, and the observers not yet called are still told.
- Collections (host providers, plan actions, value codecs, run wakers, runtime defaults) are merged across plugins
  (not ``firstresult``: every plugin is asked); a name two plugins both claim is a typed ``PluginError`` naming
  both, never a silent override.
- No hook is ``historic``: an implementation hook is asked when a runtime is opened (a plugin registered later is
  asked by the next one), and an observer registered after an event must not be told about work it did not see
  happen (nor could a historic call return the answers the composition root needs).

Prior art: pytest's and tox's pluggy hookspecs; Bazel's ``--spawn_strategy`` (executor chosen at the composition
root, not by the actions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import pluggy

from ..codecs import ValueCodec
from ..control import authority as _control_authority
from ..engine.ownership.liveness import LivenessCheck
from ..engine.waits.flow_waits import HostWake, HostWaker
from ..scheduler.host import Host
from ..scheduler.model import Report, Settlement
from ..scheduler.reconcile import Reconciler
from ..settings import Settings

__all__ = [
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "hookspec",
    "hookimpl",
    "HostRequest",
    "HostProvider",
    "Principal",
    "Authorized",
    "Unauthorized",
    "AuthorityVerdict",
    "ApprovalAuthority",
    "PlanAction",
    "HostWake",
    "HostWaker",
    "RUNTIME_DEFAULT_KEYS",
    "SmthrsSpecs",
]

PROJECT = "smthrs"
#: Installed distributions announce plugins under this entry-point group (``[project.entry-points.smthrs]``).
ENTRY_POINT_GROUP = "smthrs"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: ``action(node_input, **with_kwargs) -> JSON value`` — what a plan file's ``call: <name>`` runs. Same contract
#: as a ``call: pkg.module:function`` target (``scheduler.planfile``): it runs in the node's sandbox
#: (``node_input.root``) and its value must be plain JSON.
PlanAction = Callable[..., Any]

#: Keys a ``smthrs_runtime_defaults`` answer may set (anything else is ``PluginError(invalid_default)``):
#: ``environment`` — plain JSON folded into every sealed dispatch key of schedulers opened without one;
#: ``concurrency`` — ``{"steps": n, "agents": m}`` for schedulers opened without caps.
RUNTIME_DEFAULT_KEYS = frozenset({"environment", "concurrency"})


@dataclass(frozen=True)
class HostRequest:
    """What a host provider is told when the runtime needs a host for ``run_id``."""

    run_id: str
    workspace: Path
    settings: Settings


@runtime_checkable
class HostProvider(Protocol):
    """Offers a host for a run. ``select`` answers a host when its conditions hold (the Prefect provider: a flow
    run is active in this thread), else ``None`` and the next provider is asked; with no answer the scheduler
    keeps its default local thread pool. ``name`` is what ``smthrs plugins`` lists."""

    name: str

    def select(self, request: HostRequest) -> Host | None: ...


# The approval authority's types belong to the seam that consumes it (control/authority.py: DI at
# the owning seam): a plugin's authority receives the control plane's Principal, so ``principal ==
# Principal("local", "operator")`` holds for the local operator, and answers these verdicts.
Principal = _control_authority.Principal
Authorized = _control_authority.Authorized
Unauthorized = _control_authority.Unauthorized
AuthorityVerdict = _control_authority.AuthorityVerdict


@runtime_checkable
class ApprovalAuthority(Protocol):
    """Decides who may approve or deny. ``action`` is ``"approve"`` or ``"deny"``;
    ``target`` is a plan id or ``"<run id>/<request>"`` for a node gate. The control plane calls it before it
    resolves a token, and again inside the resolving transaction."""

    def authorize(self, principal: Principal, action: str, target: str) -> AuthorityVerdict: ...


class SmthrsSpecs:
    """The hook specifications. Implement any subset in a module or class, mark each with ``@hookimpl`` and
    announce it under the ``smthrs`` entry-point group of your distribution."""

    # -- implementations (which object the runtime wires in) ---------------------------------------------------

    @hookspec
    def smthrs_hosts(self, settings: Settings) -> HostProvider | Sequence[HostProvider] | None:
        """Host providers this plugin offers (asked in plugin priority order; the first that selects wins).

        Not ``firstresult``: a provider answers per run (``select``), so every plugin's providers are collected
        and asked in turn when a run needs a host."""

    @hookspec(firstresult=True)
    def smthrs_reconciler(self, settings: Settings) -> Reconciler | None:
        """The reconciler judging deviations and unabsorbed conflicts (built-in: ``DefaultReconciler``).

        ``firstresult``: one reconciler judges a run; the highest-priority answer wins."""

    @hookspec(firstresult=True)
    def smthrs_liveness_check(self, settings: Settings) -> LivenessCheck | None:
        """The owner liveness check used before a steal (built-in: ``LeaseLiveness``).

        ``firstresult``: one check decides a steal; the highest-priority answer wins."""

    @hookspec(firstresult=True)
    def smthrs_approval_authority(self, settings: Settings) -> ApprovalAuthority | None:
        """Who may approve or deny (built-in: only principal ``local/operator``).

        ``firstresult``: one authority decides; the highest-priority answer wins."""

    @hookspec
    def smthrs_plan_actions(self) -> Mapping[str, PlanAction] | None:
        """Named plan actions, runnable from plan files as ``call: <name>`` (with ``with:`` keyword arguments).

        Not ``firstresult``: merged across plugins; a name two plugins claim is ``PluginError(duplicate_action)``."""

    @hookspec
    def smthrs_value_codecs(self, settings: Settings) -> Sequence[ValueCodec] | None:
        """Value codecs this plugin adds (``smthrs_plugin.codecs.ValueCodec``): how values of its types are keyed
        as ``@step`` arguments and stored as cached results. Merged across plugins after the built-ins; a tag two
        codecs claim is ``CodecError(duplicate_codec)``. A codec's ``decode`` must never execute code named by the
        stored document (no pickle, no importing modules it names). Not ``firstresult`` (merged)."""

    @hookspec
    def smthrs_run_waker(self, settings: Settings) -> HostWaker | None:
        """How this plugin's host is told that a run's durable state changed — a wait answered (``smthrs approve``
        / ``deny``, ``sp.complete``, ``Control.signal``) or a cancellation — so that a host which continues parked
        runs on its own (the Prefect plugin: a flow run of a deployment) executes it again. ``waker(run_id,
        journal) -> HostWake`` is called after the deciding commit, in whichever process decided (CLI, Python,
        ``smthrs serve``); it answers ``HostNotParked`` for a run that is not its host's. Merged across plugins:
        asked in priority order until one answers other than ``HostNotParked``. It must not raise for an
        unreachable host: answer ``HostWakeFailed`` with the cause (a raise is turned into one and logged). Not
        ``firstresult``: whose host a run is is known only when it is woken, so every plugin's waker is kept.

        A waker may also offer ``waker.ended(run_id, journal) -> HostWake | None``, asked BEFORE a decision on a
        parked run: a host that ended the run on its own side where no process could tell smthrs (the Prefect
        plugin: a parked deployment flow run cancelled in Prefect's UI) settles the run and answers why; None
        when its host has not ended it. The first answer other than None wins; the decision is then not made."""

    @hookspec
    def smthrs_runtime_defaults(self, settings: Settings) -> Mapping[str, Any] | None:
        """Defaults for schedulers opened without explicit values (keys: :data:`RUNTIME_DEFAULT_KEYS`).

        Not ``firstresult``: merged key by key, a higher-priority plugin's key wins."""

    # -- observers (told after the fact; never change an outcome; none is firstresult: every plugin is told) ----

    @hookspec
    def smthrs_node_settled(self, run_id: str, plan_id: str | None, settlement: Settlement) -> None:
        """A node settled (plan runs: once per node in plan order when the pass ends; ``@step`` calls: as each
        dispatch settles, with ``plan_id=None``)."""

    @hookspec
    def smthrs_cache_decision(self, decision: str) -> None:
        """The one cache decision of a dispatch counted in this process (``VerifiedHit``, ``Miss`` ...)."""

    @hookspec
    def smthrs_approval_decided(
        self,
        run_id: str | None,
        plan_id: str | None,
        flow: str | None,
        request_id: str | None,
        token_id: str,
        digest: str,
        envelope: Mapping[str, Any],
        decision: str,
        principal: str,
        scope: str | None,
    ) -> None:
        """A plan card (``plan_id``) or a node request (``run_id`` + ``request_id``) was ``approved`` or ``denied``
        by ``principal`` (``ID/KIND``); called after the deciding commit, in the process that decided (CLI, Python,
        ``smthrs serve``). The Prefect plugin emits ``smthrs.approval.approved|denied``."""

    @hookspec
    def smthrs_run_settled(self, run_id: str, report: Report) -> None:
        """A plan pass ended with ``report`` (called on the thread that ran it; the Prefect plugin attaches the
        report to the active flow run as a markdown artifact)."""
