"""An example smthrs plugin, discovered through its ``smthrs`` entry point — no change to smthrs or to your code.

- a plan action: ``call: shout`` in a plan file (``with: {text: ..., out: ...}``) writes the text, upper-cased,
  into the node's sandbox;
- an observer: every settled node (plan nodes and ``@step`` calls) is appended as one JSON line to the file named
  by ``SMTHRS_EXAMPLE_LOG`` (default ``smthrs-example-plugin.jsonl`` in the current directory).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from smthrs_plugin.hooks import hookimpl


def shout(node_input: Any, text: str = "", out: str = "shout.txt") -> dict:
    """``call: shout`` — the action runs in the node's sandbox; declare ``out`` in the node's ``writes``."""
    loud = text.upper() + "!"
    (Path(node_input.root) / out).write_text(loud + "\n")
    return {"chars": len(loud)}


@hookimpl
def smthrs_plan_actions() -> dict:
    return {"shout": shout}


@hookimpl
def smthrs_node_settled(run_id: str, plan_id: str | None, settlement: Any) -> None:
    line = {
        "run_id": run_id,
        "plan_id": plan_id,
        "node": settlement.node,
        "outcome": settlement.outcome,
        "cache_decision": settlement.cache_decision,
    }
    with open(os.environ.get("SMTHRS_EXAMPLE_LOG", "smthrs-example-plugin.jsonl"), "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
