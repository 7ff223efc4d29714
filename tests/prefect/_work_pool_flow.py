"""The durable flow ``tests/prefect/test_work_pool.py`` deploys to a ``process`` work pool: a step, a durable timer,
a step, an approval, a step. Each step body appends its name to the file ``WORK_POOL_MARKS`` names (outside the
workspace, so it is no undeclared output), so the test counts executions across processes.

Copied into a fresh directory as ``wpflow.py``, the deployment's source; ``python wpflow.py NAME POOL`` deploys it
the way a team does in production: ``flow.from_source(...).deploy(work_pool_name=...)``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prefect import flow

import smthrs_plugin as sp


def _mark(what: str) -> None:
    with open(os.environ["WORK_POOL_MARKS"], "a") as f:
        f.write(what + "\n")


@sp.step
def extract(day: str) -> str:
    _mark("extract")
    return day + ":rows"


@sp.step
def transform(rows: str) -> str:
    _mark("transform")
    return rows + ":clean"


@sp.step
def publish(rows: str) -> str:
    _mark("publish")
    return rows + ":published"


@flow(persist_result=False)
def nightly(day: str, seconds: float) -> str:
    rows = extract(day)
    sp.sleep(seconds, name="cool-down")  # a durable clock: the flow run parks Scheduled at its deadline
    clean = transform(rows)
    sp.require_approval("publish")  # parks Paused until `smthrs approve`
    return publish(clean)


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    nightly.from_source(source=str(here), entrypoint=f"{Path(__file__).name}:nightly").deploy(
        name=sys.argv[1], work_pool_name=sys.argv[2], ignore_warnings=True
    )
