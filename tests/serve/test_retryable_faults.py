"""A passing fault of the store under ``smthrs serve``: the call is answered ``503`` with ``Retry-After`` and an
error marked ``retryable`` (nothing was refused), and the same call succeeds once the fault is gone."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def test_a_full_disk_under_a_call_is_503_retryable_and_the_same_call_succeeds_once_freed(
    volume: Path, start: Callable[..., Any], plan_text: str, fill_volume: Callable[[Path], None]
) -> None:
    ws = volume / "ws"  # the workspace and its database on the small volume
    ws.mkdir()
    plan = ws / "plan.yaml"
    plan.write_text(plan_text)
    env = {k: v for k, v in os.environ.items() if k not in ("SMTHRS_SERVE_TOKEN", "SMTHRS_DB_URL")}
    server = start(env={**env, "SMTHRS_WORKSPACE": str(ws)})
    filler = volume / "filler"
    fill_volume(filler)
    full = server.rpc("plan", {"path": str(plan)})
    assert full.status_code == 503, full.text
    assert full.headers["retry-after"] == "5"
    error = full.json()["error"]["data"]
    assert (error["family"], error["code"], error["retryable"]) == ("store", "disk_full", True)
    filler.unlink()
    done = server.rpc("plan", {"path": str(plan)})
    assert done.status_code == 200 and "result" in done.json(), done.text
