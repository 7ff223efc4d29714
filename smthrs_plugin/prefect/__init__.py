"""Hosts: where plan node executions run. The local thread pool is ``scheduler.ThreadHost`` (the default); the Prefect
host lives in ``prefect``.

Importing this package registers the run-context provider that lends a Prefect ``@flow`` body its smthrs run
(``_flowrun.py``), so ``sp.sleep``/``sp.wait_for``/``sp.require_approval`` work there. It costs nothing outside a
flow run and never imports Prefect itself: Prefect is consulted only once the flow's code has imported it.
"""

from __future__ import annotations

import sys

from ..engine.context import RunContext, register_provider


def _prefect_flow_run_context() -> RunContext | None:
    if "prefect.context" not in sys.modules:
        return None
    from ._flowrun import run_context

    return run_context()


register_provider(_prefect_flow_run_context)
