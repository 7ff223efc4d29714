"""Plugins: pluggy hookspecs (``specs``), the manager over the ``smthrs`` entry-point group (``manager``), the
built-in implementations (``defaults``) and how the composition root applies them (``wiring``).

Write a plugin::

    from smthrs_plugin.hooks import hookimpl

    @hookimpl
    def smthrs_plan_actions():
        return {"shout": lambda node_input, text="": text.upper()}

and announce the module under ``[project.entry-points.smthrs]`` in its distribution's ``pyproject.toml``. Hooks are
called through pluggy's own caller, so ``tryfirst``/``trylast``, ``firstresult`` and hook wrappers work as pluggy
documents them::

    @hookimpl(wrapper=True)
    def smthrs_liveness_check(settings):
        check = yield          # the answer of the plugins below this wrapper
        return check           # ... or a replacement
"""

from __future__ import annotations

from .manager import PluginInfo, Plugins, get_plugins, new_plugins, reset_plugins
from .specs import (
    ENTRY_POINT_GROUP,
    ApprovalAuthority,
    AuthorityVerdict,
    Authorized,
    HostProvider,
    HostRequest,
    PlanAction,
    Principal,
    Unauthorized,
    hookimpl,
    hookspec,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ApprovalAuthority",
    "AuthorityVerdict",
    "Authorized",
    "HostProvider",
    "HostRequest",
    "PlanAction",
    "PluginInfo",
    "Plugins",
    "Principal",
    "Unauthorized",
    "get_plugins",
    "hookimpl",
    "hookspec",
    "new_plugins",
    "reset_plugins",
]
