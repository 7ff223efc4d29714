"""Durable waits, as the engine names them: re-exported from the waits owner (:mod:`smthrs_plugin.records.waits`),
which holds every deferred/clock statement and the park/wake transitions."""

from __future__ import annotations

from ..records.waits import MAX_LIST_LIMIT, WaitStore

__all__ = ["WaitStore", "MAX_LIST_LIMIT"]
