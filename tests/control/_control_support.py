"""Helpers of the control-plane suites (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from smthrs_plugin.control.facade import AdmittedRun
from smthrs_plugin.plan import Plan, compile_plan, node
from smthrs_plugin.stores.database import Database


def release_plan(deploy_cmd: str = "true", *, plan_id: str = "release") -> Plan:
    """build → test → deploy, deploy gated by the node approval ``ship``."""
    return compile_plan(
        plan_id,
        "ci/release",
        [
            node("build", body={"run": "true"}),
            node("test", body={"run": "true"}, inputs=[]),
            node(
                "deploy",
                body={"run": deploy_cmd},
                approval={"request": "ship", "envelope": {"capabilities": ["deploy:prod"]}},
            ),
        ],
    )


@dataclass
class RecordingLauncher:
    """An executor seam that records what it was handed (and, optionally, what it saw of the committed state)."""

    calls: list[AdmittedRun] = field(default_factory=list)
    seen: list[Any] = field(default_factory=list)
    probe: Any = None
    refuse: BaseException | None = None

    def launch(self, run: AdmittedRun) -> None:
        self.calls.append(run)
        if self.probe is not None:
            self.seen.append(self.probe(run))
        if self.refuse is not None:
            raise self.refuse


def count(db: Database, table: str) -> int:
    return int(db.read(lambda c: c.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()))


def journal_types(db: Database, partition: str) -> list[str]:
    return list(
        db.read(
            lambda c: c.execute(
                sa.text("SELECT type FROM journal_events WHERE partition = :p ORDER BY seq"), {"p": partition}
            ).scalars()
        )
    )


def crash_plan(marker: str) -> Plan:
    """``build`` kills its own driving process (SIGKILL to the shell's parent) the first time it runs."""
    return compile_plan(
        "app",
        "ci/app",
        [
            node("prepare", body={"run": "true"}),
            node(
                "build",
                body={"run": f"test -f {marker} || {{ touch {marker} && kill -9 $PPID; sleep 2; }}"},
                inputs=[],
            ),
        ],
    )
