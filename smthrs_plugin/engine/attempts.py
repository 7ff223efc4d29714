"""Node attempts, as the engine names them: re-exported from the attempts owner
(:mod:`smthrs_plugin.records.attempts`), which holds every statement on the ``attempts`` table and its only row
decoder."""

from __future__ import annotations

from ..records.attempts import AttemptCompleted, AttemptFailed, AttemptRecord, AttemptStarted, AttemptStore

__all__ = ["AttemptStore", "AttemptRecord", "AttemptStarted", "AttemptCompleted", "AttemptFailed"]
