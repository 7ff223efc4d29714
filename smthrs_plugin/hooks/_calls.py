"""Calling hooks through pluggy's own caller (``pm.hook.<name>(...)``) while still naming the plugin behind an answer
or a failure — the two things pluggy's caller does not report.

Invariants
- Every call of a hook goes through a pluggy ``HookCaller`` (``pm.hook.<name>`` or ``pm.subset_hook_caller``), so
  ``firstresult``, ``tryfirst``/``trylast``, hook wrappers (``wrapper=True`` and old-style ``hookwrapper=True``),
  ``pm.add_hookcall_monitoring`` and ``pm.trace`` see every call. Nothing here calls an implementation's
  function itself.
- Naming is exact or it says it is not: an answer is attributed to a plugin by position when nothing can have
  changed the list (no wrapper on the hook, every implementation answered), else by asking each implementing
  plugin alone (a pluggy subset call) and matching its answer. What cannot be matched is ``None`` ("unknown"),
  never a guess.
- Asking a plugin alone is done only to name a plugin (an invalid answer, a duplicate claim, a waker's owner):
  the answers used by the runtime are always those of the one whole-hook call.
- An observer that raises never stops the others: the failure is logged with its traceback naming the plugin,
  and the observers that had not yet been called are called through a subset caller without the ones already
  called (no observer hears one event twice; a hook wrapper wraps that second call too, as it wraps any call).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import FrameType, TracebackType
from typing import Any

import pluggy

from ..errors import PluginError

__all__ = ["call_order", "owned_answers", "answers_alone", "culprits", "notify"]


def _caller(pm: pluggy.PluginManager, hook: str) -> pluggy.HookCaller:
    return getattr(pm.hook, hook)  # type: ignore[no-any-return]


def _is_wrapper(impl: pluggy.HookImpl) -> bool:
    return bool(impl.wrapper or impl.hookwrapper)


def call_order(pm: pluggy.PluginManager, hook: str) -> list[pluggy.HookImpl]:
    """The plain (non-wrapper) implementations of ``hook`` in the order pluggy calls them: ``tryfirst``, then the
    most recently registered, ``trylast`` last. pluggy's answer list follows this order."""
    return [i for i in reversed(_caller(pm, hook).get_hookimpls()) if not _is_wrapper(i)]


def _plugins_of(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, object]]:
    """Every plugin with an implementation (plain or wrapper) of ``hook``, in call order, once each."""
    out: dict[str, object] = {}
    for impl in reversed(_caller(pm, hook).get_hookimpls()):
        out.setdefault(impl.plugin_name, impl.plugin)
    return list(out.items())


def _firstresult(pm: pluggy.PluginManager, hook: str) -> bool:
    spec = _caller(pm, hook).spec
    return bool(spec is not None and spec.opts.get("firstresult"))


def answers_alone(pm: pluggy.PluginManager, hook: str, kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(plugin, answer)`` for every answer each implementing plugin gives when asked alone, through a pluggy
    subset caller (its own wrappers included), in call order; ``None`` answers are left out, as pluggy does.
    Used only to name a plugin; see the module invariants."""
    plugins = _plugins_of(pm, hook)
    everyone = [p for _, p in plugins]
    single = _firstresult(pm, hook)
    out: list[tuple[str, Any]] = []
    for name, plugin in plugins:
        alone = pm.subset_hook_caller(hook, remove_plugins=[p for p in everyone if p is not plugin])
        answer = alone(**kwargs)
        if single:
            items = [] if answer is None else [answer]
        else:
            # A collecting hook answers a list (an item per answering implementation; a wrapper may add or drop).
            items = list(answer) if isinstance(answer, (list, tuple)) else [answer]
        out.extend((name, item) for item in items)
    return out


def owned_answers(
    pm: pluggy.PluginManager, hook: str, kwargs: Mapping[str, Any]
) -> list[tuple[str | None, Any]]:
    """``pm.hook.<hook>(**kwargs)``'s answers (a collecting hook: a list), each with the plugin that gave it, or
    ``None`` when that cannot be told exactly (see the module invariants)."""
    answers = _caller(pm, hook)(**kwargs)
    if not isinstance(answers, list):
        raise PluginError(
            "invalid_plugin",
            f"a hook wrapper of {hook} returned {answers!r}; a wrapper of a collecting hook must return the list "
            "of answers it was given, or a changed list",
            hook=hook,
        )
    plain = call_order(pm, hook)
    wrapped = any(_is_wrapper(i) for i in _caller(pm, hook).get_hookimpls())
    if not wrapped and len(answers) == len(plain):
        return [(impl.plugin_name, answer) for impl, answer in zip(plain, answers, strict=True)]
    alone = answers_alone(pm, hook, kwargs)
    out: list[tuple[str | None, Any]] = []
    for answer in answers:
        owner = next((name for name, theirs in alone if _same(theirs, answer)), None)
        out.append((owner, answer))
    return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # an answer with a broken __eq__ is simply not matched (its owner stays unknown)
        return False


def culprits(
    pm: pluggy.PluginManager, hook: str, kwargs: Mapping[str, Any], guilty: Callable[[Any], bool]
) -> list[str]:
    """The plugins whose answer, asked alone, satisfies ``guilty`` (an invalid answer, a claim of a name)."""
    out = []
    for name, answer in answers_alone(pm, hook, kwargs):
        try:
            if guilty(answer):
                out.append(name)
        except Exception:  # the predicate met an answer too broken to inspect: that plugin is the culprit
            out.append(name)
    return out


def describe_culprits(names: list[str], hook: str) -> str:
    """``plugin 'one'`` / ``plugins 'one' and 'two'`` / who else it can be (a hook wrapper changed the answer)."""
    if len(names) == 1:
        return f"plugin {names[0]!r}"
    if names:
        return "plugins " + " and ".join(repr(n) for n in names)
    return f"a hook wrapper of {hook} (no plugin gives that answer when asked alone)"


# ------------------------------------------------------------------------------------------------ observers


def notify(pm: pluggy.PluginManager, hook: str, kwargs: Mapping[str, Any], log: logging.Logger) -> None:
    """Tell every observer of ``hook`` through pluggy; one that raises is logged and the rest are still told."""
    done: list[object] = []
    while True:
        caller = pm.subset_hook_caller(hook, remove_plugins=done) if done else _caller(pm, hook)
        try:
            caller(**kwargs)
            return
        except Exception as exc:
            impls = list(reversed(caller.get_hookimpls()))
            failed = _raiser(exc.__traceback__, impls)
            if failed is None or _is_wrapper(failed):
                # Which observers had been called is unknowable once a wrapper failed: stop rather than tell
                # anyone twice, and say so.
                log.exception(
                    "%s failed in a hook wrapper of %s; observers not yet called for this event were skipped; "
                    "the work it observed is unaffected",
                    "plugin " + repr(failed.plugin_name) if failed is not None else "a plugin",
                    hook,
                )
                return
            log.exception(
                "plugin %r failed in %s; the work it observed is unaffected", failed.plugin_name, hook
            )
            plain = [i for i in impls if not _is_wrapper(i)]
            called = plain[: plain.index(failed) + 1]
            done.extend(i.plugin for i in called)
            if len(called) == len(plain):
                return


def _raiser(tb: TracebackType | None, impls: list[pluggy.HookImpl]) -> pluggy.HookImpl | None:
    """The implementation that raised: a plain one whose frame is in ``tb`` (a wrapper that only let the exception
    through its ``yield`` is in ``tb`` too, outside it), else the wrapper that raised on its own."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for wanted in (False, True):
        for frame in frames:
            for impl in impls:
                if _is_wrapper(impl) is wanted and _runs_in(impl, frame):
                    return impl
    return None


def _runs_in(impl: pluggy.HookImpl, frame: FrameType) -> bool:
    fn = impl.function
    if getattr(getattr(fn, "__func__", fn), "__code__", None) is not frame.f_code:
        return False
    owner = getattr(fn, "__self__", None)
    # Two instances of one class share the code object: the bound ``self`` tells them apart.
    return owner is None or any(v is owner for v in frame.f_locals.values())
