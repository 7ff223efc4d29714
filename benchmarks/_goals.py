"""The one shape of a goal's line in every benchmark's output (``make bench | grep ^GOAL`` is the summary): a
helper module, not a benchmark (``make bench`` runs no ``_*.py``)."""

from __future__ import annotations


def goal_line(name: str, figure: str, goal: str, met: bool, anchors: str) -> str:
    """``GOAL <name>: <figure> (goal <goal>) met|NOT met  [anchors: <anchors>]``."""
    return f"GOAL {name}: {figure} (goal {goal}) {'met' if met else 'NOT met'}  [anchors: {anchors}]"
