"""``smthrs serve``: the control plane over HTTP — JSON-RPC verbs, run projections, the review page.

Modules: ``_auth`` (credential, bind rule, operator principal), ``rpc`` (the JSON-RPC method table over
:class:`~smthrs_plugin.control.facade.Control`), ``_projections`` (``/projections``, HTTP ndjson and WebSocket),
``wire`` (the JSON objects shared with the CLI), ``_app`` (the FastAPI application), ``server`` (uvicorn, the
announcement lines, graceful shutdown), ``limits`` and ``_connections`` (header and body deadlines, connection caps
per client and in total, enforced in uvicorn's HTTP protocol), ``_review`` and ``static/`` (the review page).

Invariant: importing this package imports no web framework. FastAPI, Starlette and uvicorn load only when a server
is built (``_app``/``server``/``_projections``/``_connections``), so ``import smthrs_plugin`` and ``smthrs --help``
stay light.
Top layer (beside ``cli`` and ``prefect``): it imports the runtime, control and observe, never ``cli``.
"""

from __future__ import annotations

__all__: list[str] = []
