"""``smthrs plugins [--json]`` — what loaded, from which distribution, and what it provides.

Invariant: it loads plugins exactly as ``open_runtime`` does (built-ins + every installed ``smthrs`` entry point),
so a plugin that fails here fails there too, with the same typed ``PluginError`` (exit 2). One line per plugin,
then the plan actions and host providers they contribute; ``--json`` prints one object
``{"plugins": [...], "actions": {name: plugin}, "hosts": [name, ...]}``.
"""

from __future__ import annotations

from typing import Any

import typer

from smthrs_plugin.cli._common import JsonOption, done, refuse
from smthrs_plugin.cli.exits import EXIT_OK
from smthrs_plugin.errors import SmthrsError

__all__ = ["register", "list_plugins"]


def register(app: typer.Typer) -> None:
    """Add ``smthrs plugins`` to the root app."""
    app.command("plugins")(list_plugins)


def list_plugins(as_json: JsonOption = False) -> None:
    """List the loaded smthrs plugins (entry-point group ``smthrs``), their hooks, actions and hosts."""
    from smthrs_plugin.hooks.manager import new_plugins
    from smthrs_plugin.settings import load_settings

    try:
        plugins = new_plugins()
        settings = load_settings()
        infos = plugins.describe()
        actions = plugins.actions()
        owners = plugins.action_owners()
        hosts = [p.name for p in plugins.host_providers(settings)]
    except SmthrsError as exc:
        refuse(as_json, exc)
    payload: dict[str, Any] = {
        "plugins": [i.to_json() for i in infos],
        "actions": {name: owners.get(name) for name in sorted(actions)},
        "hosts": hosts,
    }
    lines = []
    for i in infos:
        origin = i.source if i.distribution is None else f"{i.distribution} {i.version}"
        lines.append(f"{i.name:<20} {origin:<28} {', '.join(i.hooks) or '-'}")
    lines.append(f"actions: {', '.join(sorted(actions)) or '-'}")
    lines.append(f"hosts:   {', '.join(hosts) + ', ' if hosts else ''}local (default)")
    done(as_json, payload, "\n".join(lines))
    raise typer.Exit(EXIT_OK)
