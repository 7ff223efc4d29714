"""The plugin manager: ``pluggy.PluginManager("smthrs")``, the built-ins, and every installed distribution's
``smthrs`` entry points — wrapped in :class:`Plugins`, the typed facade the composition root reads.

Invariants
- Loading is explicit and loud: an entry point that fails to import is ``PluginError(load_failed)`` naming the
  entry point and its distribution; two entry points with one name are ``duplicate_plugin`` (pluggy's own loader
  would silently keep the first); an implementation that does not match its spec is ``invalid_plugin``. A broken
  plugin never degrades into "no plugin".
- One process-wide manager (:func:`get_plugins`), loaded on first use (entry-point discovery costs ~20 ms, so
  ``smthrs --help`` never pays it). Tests build private ones with :func:`new_plugins`.
- Every hook is called through pluggy's own caller, ``pm.hook.<name>(...)`` (:mod:`._calls`): ``firstresult``,
  ``tryfirst``/``trylast``, hook wrappers and pluggy's tracing work as pluggy documents them. Nothing here calls
  an implementation's function itself.
- Answers are validated where they are final — after the call, once every hook wrapper has had its say: a host
  provider without ``select``, an action that is not callable, a runtime default outside
  :data:`~.specs.RUNTIME_DEFAULT_KEYS`, a run waker that is not callable, are typed errors naming the plugin
  (found by asking each implementing plugin alone, through pluggy, only when the answer list cannot say).
- Observers are told by :meth:`Plugins.notify_*` through ``pm.hook`` too; an observer that raises is logged with
  its traceback naming its plugin and the others are still told (telemetry must not break the work it observes).
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

from ..codecs import CodecRegistry, builtin_codecs
from ..engine.ownership.liveness import LivenessCheck
from ..engine.waits.flow_waits import HostNotParked, HostWake, HostWakeFailed, HostWaker
from ..errors import PluginError
from ..records.journal import Journal
from ..scheduler.host import Host
from ..scheduler.model import Report, Settlement
from ..scheduler.reconcile import Reconciler
from ..settings import Settings
from ._calls import culprits, describe_culprits, notify, owned_answers
from ._defaults import BUILTIN_NAME, BuiltinPlugin
from .specs import (
    ENTRY_POINT_GROUP,
    PROJECT,
    RUNTIME_DEFAULT_KEYS,
    HostProvider,
    HostRequest,
    PlanAction,
    SmthrsSpecs,
)

__all__ = ["Plugins", "PluginInfo", "get_plugins", "new_plugins", "reset_plugins"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin: its name, where it came from (``builtin`` | ``entry-point`` | ``registered``), its
    distribution (name, version) when it came from one, and the hooks it implements."""

    name: str
    source: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]
    value: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "distribution": self.distribution,
            "version": self.version,
            "hooks": list(self.hooks),
            "value": self.value,
        }


class Plugins:
    """The typed view of a plugin manager (see the module docstring)."""

    def __init__(self, pm: pluggy.PluginManager, infos: Iterable[PluginInfo] = ()) -> None:
        self.pm = pm
        self._infos: dict[str, PluginInfo] = {i.name: i for i in infos}
        self._actions: dict[str, PlanAction] | None = None
        self._action_owners: dict[str, str | None] = {}

    # -- registration ----------------------------------------------------------------------------------------

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register ``plugin`` (a module or an object with ``@hookimpl`` methods) by hand; returns its name."""
        name = name or _default_name(plugin)
        _register(self.pm, plugin, name)
        self._infos[name] = _info(self.pm, plugin, name, "registered", None, None)
        self._actions = None
        return name

    def describe(self) -> list[PluginInfo]:
        """Every registered plugin in registration order (what ``smthrs plugins`` prints)."""
        out = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:
                continue
            info = self._infos.get(name) or _info(self.pm, plugin, name, "registered", None, None)
            out.append(info)
        return out

    # -- implementations -------------------------------------------------------------------------------------
    # Every answer comes from one pluggy call (``pm.hook.<name>``) and is validated here, where the answer is
    # final: a hook wrapper of any plugin, in any order, has had its say (a built-in wrapper could be outranked
    # by a later ``tryfirst`` wrapper and validate an answer that is then changed). ``_calls`` names the plugin.

    def host_providers(self, settings: Settings) -> list[HostProvider]:
        """Providers in priority order (highest first)."""
        hook, kwargs = "smthrs_hosts", {"settings": settings}
        out: list[HostProvider] = []
        for owner, answer in owned_answers(self.pm, hook, kwargs):
            for p in _items(answer):
                if not _is_provider(p):
                    raise self._invalid(
                        "invalid_plugin",
                        hook,
                        kwargs,
                        owner,
                        lambda a: any(not _is_provider(x) for x in _items(a)),
                        f"smthrs_hosts returned {p!r}, which is not a host provider (it needs a `name: str` and "
                        "`select(request) -> Host | None`)",
                    )
                out.append(p)
        return out

    def select_host(self, request: HostRequest) -> tuple[str, Host] | None:
        """``(provider name, host)`` of the first provider that selects, or None (keep the local default)."""
        for p in self.host_providers(request.settings):
            host = p.select(request)
            if host is not None:
                if not callable(getattr(host, "submit", None)) or not callable(getattr(host, "close", None)):
                    raise PluginError(
                        "invalid_plugin",
                        f"host provider {p.name!r} selected {host!r}, which has no submit(job)/close()",
                        provider=p.name,
                    )
                return p.name, host
        return None

    def reconciler(self, settings: Settings) -> Reconciler:
        """The ``smthrs_reconciler`` answer (``firstresult``; built-in: ``DefaultReconciler``)."""
        return self._first("smthrs_reconciler", "judge", settings)  # type: ignore[no-any-return]

    def liveness(self, settings: Settings) -> LivenessCheck:
        """The ``smthrs_liveness_check`` answer (``firstresult``; built-in: ``LeaseLiveness``)."""
        return self._first("smthrs_liveness_check", "check", settings)  # type: ignore[no-any-return]

    def approval_authority(self, settings: Settings) -> Any:
        """The ``smthrs_approval_authority`` answer (``firstresult``; built-in: only ``local/operator``)."""
        return self._first("smthrs_approval_authority", "authorize", settings)

    def _first(self, hook: str, method: str, settings: Settings) -> Any:
        kwargs: dict[str, Any] = {"settings": settings}
        answer = getattr(self.pm.hook, hook)(**kwargs)
        if answer is None:
            raise PluginError(
                "invalid_plugin",
                f"no plugin answered {hook}: a hook wrapper answered None or the built-in plugin {BUILTIN_NAME!r} "
                "is missing; a wrapper must return the answer it was given or a replacement",
            )
        if not callable(getattr(answer, method, None)):
            # firstresult: the culprit is the first plugin, in call order, whose own answer is invalid.
            raise self._invalid(
                "invalid_plugin",
                hook,
                kwargs,
                None,
                lambda a: a is not None and not callable(getattr(a, method, None)),
                f"{hook} returned {answer!r}, which has no {method}() method",
                first_only=True,
            )
        return answer

    def actions(self) -> Mapping[str, PlanAction]:
        """Every plan action by name (merged across plugins; computed once per manager)."""
        if self._actions is None:
            self._actions, self._action_owners = self._merge_actions()
        return self._actions

    def action_owners(self) -> dict[str, str | None]:
        """Which plugin provides each plan action (what ``smthrs plugins`` prints); ``None`` for one only a hook
        wrapper adds. Validated like :meth:`actions`."""
        self.actions()
        return dict(self._action_owners)

    def _merge_actions(self) -> tuple[dict[str, PlanAction], dict[str, str | None]]:
        hook, kwargs = "smthrs_plan_actions", dict[str, Any]()
        merged: dict[str, PlanAction] = {}
        owners: dict[str, str | None] = {}
        for owner, answer in owned_answers(self.pm, hook, kwargs):
            if not isinstance(answer, Mapping):
                raise self._invalid(
                    "invalid_plugin",
                    hook,
                    kwargs,
                    owner,
                    lambda a: a is not None and not isinstance(a, Mapping),
                    f"smthrs_plan_actions must return a mapping name -> callable, got {type(answer).__name__}",
                )
            for action, fn in answer.items():
                if not _is_action(action, fn):
                    raise self._invalid(
                        "invalid_plugin",
                        hook,
                        kwargs,
                        owner,
                        lambda a: isinstance(a, Mapping) and not all(map(_is_action, a, a.values())),
                        f"action {action!r} must be a non-empty name without ':' mapped to a callable",
                    )
                if action in merged:
                    first = owners[action]
                    if first is None or owner is None or first == owner:
                        claim = describe_culprits(
                            culprits(self.pm, hook, kwargs, _claims(action)),
                            hook,
                        )
                    else:
                        claim = describe_culprits([first, owner], hook)
                    raise PluginError(
                        "duplicate_action",
                        f"plan action {action!r} is provided by both {claim}; "
                        "uninstall one of them or ask its author to rename the action",
                        action=action,
                    )
                merged[action] = fn
                owners[action] = owner
        return merged, owners

    def host_waker(self, settings: Settings) -> HostWaker | None:
        """One waker over every plugin's ``smthrs_run_waker`` answer (``None`` when no plugin offers one): asked in
        priority order, the first answer other than ``HostNotParked`` wins (a run has one host). A waker that
        raises answers ``HostWakeFailed`` naming its plugin, with the exception as the cause."""
        hook, kwargs = "smthrs_run_waker", {"settings": settings}
        wakers: list[tuple[str, HostWaker]] = []
        for owner, answer in owned_answers(self.pm, hook, kwargs):
            if not callable(answer):
                raise self._invalid(
                    "invalid_plugin",
                    hook,
                    kwargs,
                    owner,
                    lambda a: a is not None and not callable(a),
                    f"smthrs_run_waker returned {answer!r}, which is not callable (it must be waker(run_id, "
                    "journal) -> HostWoken | HostNotParked | HostWakeFailed)",
                )
            # A waker only a hook wrapper gives has no plugin: it is named by its own ``host`` or its name.
            wakers.append((owner or getattr(answer, "host", None) or _callable_name(answer), answer))
        return _MergedWaker(tuple(wakers)) if wakers else None

    def runtime_defaults(self, settings: Settings) -> dict[str, Any]:
        """Merged runtime defaults; a higher-priority plugin's key wins."""
        hook, kwargs = "smthrs_runtime_defaults", {"settings": settings}
        out: dict[str, Any] = {}
        # Answers come highest priority first: apply them lowest first so the higher one's key wins.
        for owner, answer in reversed(owned_answers(self.pm, hook, kwargs)):
            if not isinstance(answer, Mapping):
                raise self._invalid(
                    "invalid_default",
                    hook,
                    kwargs,
                    owner,
                    lambda a: a is not None and not isinstance(a, Mapping),
                    "smthrs_runtime_defaults must return a mapping",
                )
            unknown = set(answer) - RUNTIME_DEFAULT_KEYS
            if unknown:
                raise self._invalid(
                    "invalid_default",
                    hook,
                    kwargs,
                    owner,
                    lambda a: isinstance(a, Mapping) and bool(set(a) - RUNTIME_DEFAULT_KEYS),
                    f"unknown runtime defaults {sorted(unknown)}; known: {sorted(RUNTIME_DEFAULT_KEYS)}",
                )
            out.update(answer)
        return out

    def codecs(self, settings: Settings) -> CodecRegistry:
        """The value-codec registry: the built-in codecs, then every plugin's ``smthrs_value_codecs`` answer
        (called through pluggy's caller). An answer that is not a sequence of codecs is ``PluginError
        (invalid_plugin)`` naming the plugin; a duplicate tag is ``CodecError(duplicate_codec)``."""
        hook, kwargs = "smthrs_value_codecs", {"settings": settings}
        registry = CodecRegistry(builtin_codecs())
        # pluggy returns answers most-recent-registration first; register in registration order so a later
        # plugin's codec is asked before an earlier one's (the registry asks the most recent first).
        for owner, answer in reversed(owned_answers(self.pm, hook, kwargs)):
            if not isinstance(answer, (list, tuple)):
                raise self._invalid(
                    "invalid_plugin",
                    hook,
                    kwargs,
                    owner,
                    lambda a: a is not None and not isinstance(a, (list, tuple)),
                    f"smthrs_value_codecs returned {answer!r}; return a list of codecs (each with `tag`, "
                    "handles, key_form, encode, decode, blob_digests)",
                )
            for codec in answer:
                registry.register(codec)
        return registry

    def _invalid(
        self,
        code: str,
        hook: str,
        kwargs: Mapping[str, Any],
        owner: str | None,
        guilty: Callable[[Any], bool],
        what: str,
        *,
        first_only: bool = False,
    ) -> PluginError:
        """``PluginError(code)`` naming the plugin behind an invalid answer: its owner when known, else the
        plugins whose own answer, asked alone, is ``guilty`` (``_calls.culprits``)."""
        names = [owner] if owner is not None else culprits(self.pm, hook, kwargs, guilty)
        if first_only:
            names = names[:1]
        return PluginError(
            code,
            f"{describe_culprits(names, hook)}: {what}",
            plugin=", ".join(names) or None,
        )

    # -- observers -------------------------------------------------------------------------------------------
    # Told through ``pm.hook.<name>`` too (``_calls.notify``): wrappers and tracing see them; one that raises is
    # logged naming its plugin and the others are still told.

    def has_observers(self, hook: str) -> bool:
        """Whether any plugin implements ``hook`` (a wrapper counts: it wants to see the calls)."""
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    def notify_node_settled(self, run_id: str, plan_id: str | None, settlement: Settlement) -> None:
        notify(
            self.pm,
            "smthrs_node_settled",
            {"run_id": run_id, "plan_id": plan_id, "settlement": settlement},
            log,
        )

    def notify_cache_decision(self, decision: str) -> None:
        notify(self.pm, "smthrs_cache_decision", {"decision": decision}, log)

    def notify_run_settled(self, run_id: str, report: Report) -> None:
        notify(self.pm, "smthrs_run_settled", {"run_id": run_id, "report": report}, log)

    def notify_approval_decided(self, **fact: Any) -> None:
        """Tell the ``smthrs_approval_decided`` observers (``Control``'s ``on_decided``; keywords as the hookspec)."""
        notify(self.pm, "smthrs_approval_decided", fact, log)

    def __repr__(self) -> str:
        return f"Plugins({[n for n, _ in self.pm.list_name_plugin()]})"


def _claims(action: str) -> Callable[[Any], bool]:
    return lambda answer: isinstance(answer, Mapping) and action in answer


def _items(answer: Any) -> list[Any]:
    return list(answer) if isinstance(answer, (list, tuple)) else [answer]


def _is_provider(p: Any) -> bool:
    return callable(getattr(p, "select", None)) and isinstance(getattr(p, "name", None), str)


def _is_action(name: Any, fn: Any) -> bool:
    return isinstance(name, str) and bool(name) and ":" not in name and callable(fn)


def _callable_name(fn: Any) -> str:
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        return type(owner).__name__
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


@dataclass(frozen=True)
class _MergedWaker:
    """The plugins' run wakers as one (see :meth:`Plugins.host_waker`)."""

    wakers: tuple[tuple[str, HostWaker], ...]

    def __call__(self, run_id: str, journal: Journal) -> HostWake:
        last: HostWake = HostNotParked(run_id, None, "no plugin's host continues this run on its own")
        for plugin, waker in self.wakers:
            try:
                outcome = waker(run_id, journal)
            except Exception as exc:  # answered, not raised: the caller's decision is already committed
                return HostWakeFailed(
                    run_id, plugin, f"plugin {plugin!r}'s run waker raised {type(exc).__name__}: {exc}", exc
                )
            if not isinstance(outcome, HostNotParked):
                return outcome
            last = outcome
        return last

    def ended(self, run_id: str, journal: Journal) -> HostWake | None:
        """Asked before a decision on a parked run: the first plugin waker's optional ``ended(run_id, journal)``
        answer other than None (its host ended the run on its own side and settled it; facade ``_host_ended``)."""
        for _plugin, waker in self.wakers:
            ended = getattr(waker, "ended", None)
            outcome = None if ended is None else ended(run_id, journal)
            if outcome is not None:
                return outcome  # type: ignore[no-any-return]  # a duck-typed plugin answer
        return None


# ------------------------------------------------------------------------------------------------ loading


def _default_name(plugin: object) -> str:
    return getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{id(plugin):x}"


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    if pm.has_plugin(name):
        raise PluginError(
            "duplicate_plugin",
            f"a plugin named {name!r} is already registered; entry-point names must be unique across distributions",
            plugin=name,
        )
    try:
        pm.register(plugin, name=name)
        pm.check_pending()
    except (pluggy.PluginValidationError, ValueError) as exc:
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        raise PluginError(
            "invalid_plugin",
            f"plugin {name!r} does not match the smthrs hook specs: {exc}",
            cause=exc,
            plugin=name,
        ) from exc


def _info(
    pm: pluggy.PluginManager, plugin: object, name: str, source: str, dist: str | None, version: str | None
) -> PluginInfo:
    hooks = tuple(sorted(h.name for h in (pm.get_hookcallers(plugin) or ())))
    value = getattr(plugin, "__name__", None) or type(plugin).__qualname__
    return PluginInfo(name, source, dist, version, hooks, str(value))


def _entry_points() -> list[tuple[importlib.metadata.EntryPoint, str | None, str | None]]:
    seen: dict[tuple[str, str], tuple[importlib.metadata.EntryPoint, str | None, str | None]] = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP:
                continue
            dist_name = dist.metadata["Name"]
            # The same distribution can be visible twice on sys.path (an editable install and a build dir):
            # one entry per (name, value), a genuine name clash is refused at registration.
            seen.setdefault((ep.name, ep.value), (ep, dist_name, dist.version))
    return sorted(seen.values(), key=lambda t: (t[0].name, t[0].value))


def new_plugins(
    *, entry_points: bool = True, extra: Iterable[object] = (), block: Iterable[str] = ()
) -> Plugins:
    """A fresh manager: the built-ins, then (``entry_points``) every installed ``smthrs`` entry point except the
    names in ``block``, then ``extra`` plugins registered by hand."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(SmthrsSpecs)
    builtin = BuiltinPlugin()
    pm.register(builtin, name=BUILTIN_NAME)
    infos = [_info(pm, builtin, BUILTIN_NAME, "builtin", None, None)]
    blocked = set(block)
    if entry_points:
        for ep, dist, version in _entry_points():
            if ep.name in blocked:
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    "load_failed",
                    f"the smthrs plugin {ep.name!r} ({ep.value}) from distribution {dist!r} failed to load: "
                    f"{type(exc).__name__}: {exc}. Fix or uninstall that distribution",
                    cause=exc,
                    plugin=ep.name,
                    distribution=dist,
                ) from exc
            _register(pm, plugin, ep.name)
            infos.append(_info(pm, plugin, ep.name, "entry-point", dist, version))
    plugins = Plugins(pm, infos)
    for p in extra:
        plugins.register(p)
    return plugins


_GLOBAL: Plugins | None = None
_GLOBAL_LOCK = threading.Lock()


def get_plugins() -> Plugins:
    """The process-wide plugins (built-ins + installed entry points), loaded on first use."""
    global _GLOBAL
    with _GLOBAL_LOCK:
        if _GLOBAL is None:
            _GLOBAL = new_plugins()
        return _GLOBAL


def reset_plugins() -> None:
    """Forget the process-wide manager (the next :func:`get_plugins` rediscovers entry points)."""
    global _GLOBAL
    with _GLOBAL_LOCK:
        _GLOBAL = None
