"""The Prefect integration: ``@sp.step`` (``step.py``), durable flow runs and deployments, Prefect events, remote
execution, and the Prefect host that runs plan nodes as task runs (``host.py``; announced to the plugin manager by
``plugin.py`` through this distribution's ``smthrs`` entry point).

Importing this package has no side effect and never imports Prefect itself. :func:`flow_run_context` is the
run-context provider that lends a Prefect ``@flow`` body its smthrs run, so ``sp.sleep``, ``sp.wait_for`` and
``sp.require_approval`` work there; the package root (``smthrs_plugin/__init__.py``) registers it explicitly.
"""

from __future__ import annotations

import sys

from ..engine.context import RunContext


def flow_run_context() -> RunContext | None:
    """The smthrs run of the Prefect flow run this code runs in, or None (also when Prefect was never imported)."""
    if "prefect.context" not in sys.modules:
        return None
    from ._flowrun import run_context

    return run_context()


__all__ = ["flow_run_context"]
