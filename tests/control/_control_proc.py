"""A control-plane client in its own process, for the crash tests: ``python _control_proc.py MODE DB_URL WORKSPACE
HOST_ID KEY MARKER``.

- ``admit-and-die``: plan + admit under KEY, then SIGKILL itself inside the launcher (admitted, never launched).
- ``die-mid-run``: plan + admit + launch for real; the ``build`` node kills this process mid-run (run left
  ``running`` under a dead owner).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from _control_support import crash_plan

from smthrs_plugin.cli.control_support import PlanLauncher
from smthrs_plugin.runtime import open_runtime


class _Die:
    def launch(self, run: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, db_url, workspace, host_id, key, marker = sys.argv[1:7]
    with open_runtime(workspace=workspace, db=db_url, host_id=host_id) as rt:
        control = rt.control()
        card = control.plan(crash_plan(marker))
        launcher: Any = _Die() if mode == "admit-and-die" else PlanLauncher(rt, {})
        control.run(card, idempotency_key=key, launcher=launcher)
    sys.exit(3)  # never reached: both modes die by SIGKILL


if __name__ == "__main__":
    main()
