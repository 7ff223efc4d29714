"""Decoded run rows, as the engine names them: re-exported from the runs owner (:mod:`smthrs_plugin.records.runs`),
the only decoder of a run row."""

from __future__ import annotations

from ..records.runs import (
    CancelAck,
    RunRecord,
    Undecodable,
    Waiting,
    decode_run,
    decode_run_or_raise,
    json_column,
    json_text,
)

__all__ = [
    "RunRecord",
    "Waiting",
    "CancelAck",
    "Undecodable",
    "decode_run",
    "decode_run_or_raise",
    "json_column",
    "json_text",
]
