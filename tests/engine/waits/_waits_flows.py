"""Flows the durable-waits process tests register in real worker processes (``smthrs worker --flow
name=_waits_flows:fn``, with this directory on PYTHONPATH). Each leaves a marker line per execution of the code
AFTER its wait in ``$WAITS_MARKS/<run id>.<what>``, so a test can count how often that code ran."""

from __future__ import annotations

import os
from typing import Any

import smthrs_plugin as sp


def _mark(ctx: Any, what: str) -> None:
    marks = os.environ.get("WAITS_MARKS")
    if marks:
        with open(os.path.join(marks, f"{ctx.run_id}.{what}"), "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")


def nap(ctx: Any) -> dict[str, Any]:
    """Sleep ``$WAITS_NAP_S`` seconds on a durable clock named ``nap``."""
    sp.sleep(float(os.environ.get("WAITS_NAP_S", "2")), name="nap")
    _mark(ctx, "after-nap")
    return {"woke_at_ms": ctx.clock.now_ms(), "pid": os.getpid()}


def approval(ctx: Any) -> dict[str, Any]:
    """Wait for the deferred ``approval``."""
    value = sp.wait_for("approval")
    _mark(ctx, "approved")
    return {"value": value, "pid": os.getpid()}
