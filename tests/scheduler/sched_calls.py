"""Functions plan files in the tests ``call:`` (``call: "sched_calls:summarise"``)."""

from __future__ import annotations

from typing import Any


def summarise(ni: Any, indent: int = 0) -> dict[str, Any]:
    return {"node": ni.id, "attempt": ni.attempt, "inputs": list(ni.inputs), "indent": indent}
