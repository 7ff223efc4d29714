"""A cached DataFrame handed from one step to another keys on its stored digest on EVERY host:
a Prefect process pool and a Dask cluster of worker processes pickle the frame between processes, and the consumer
step (sync or async) is keyed without hashing it again. Real processes; every hashing of a frame's canonical stream, in any
process, is logged through a ``sitecustomize`` the test puts on the children's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _prefect_support import step_outcomes

pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

#: Loaded by every Python process started with the hook dir on PYTHONPATH (the flow, pool workers, Dask
#: workers): appends "<pid>" to $HASH_LOG each time a frame's canonical stream is hashed for a key.
SITECUSTOMIZE = """\
import os

def _install():
    from smthrs_plugin.codecs import frames
    original = frames._Arrow.digest_form
    def logged(self, table):
        with open(os.environ["HASH_LOG"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        return original(self, table)
    frames._Arrow.digest_form = logged

if os.environ.get("HASH_LOG"):
    _install()
"""

FLOW_PY = """\
import json, os, sys
import pandas as pd
from prefect import flow
import smthrs_plugin as sp

@sp.step
def make_frame(rows: int) -> pd.DataFrame:
    with open(os.environ["BODY_LOG"], "a") as f:
        f.write(f"make_frame:{os.getpid()}\\n")
    return pd.DataFrame({"i": list(range(rows)), "s": [f"v{i}" for i in range(rows)]})

@sp.step
def total(frame: pd.DataFrame) -> int:
    with open(os.environ["BODY_LOG"], "a") as f:
        f.write(f"total:{os.getpid()}\\n")
    return int(frame["i"].sum())

@sp.step
async def rows_of(frame: pd.DataFrame) -> int:
    with open(os.environ["BODY_LOG"], "a") as f:
        f.write(f"rows_of:{os.getpid()}\\n")
    return len(frame)

def runner(kind):
    if kind == "processes":
        from prefect.task_runners import ProcessPoolTaskRunner
        return ProcessPoolTaskRunner(max_workers=2)
    from prefect_dask import DaskTaskRunner
    return DaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 1, "processes": True})

def main(kind):
    @flow(persist_result=False, task_runner=runner(kind))
    def pipeline() -> int:
        frame = make_frame.submit(50_000)
        return [total.submit(frame).result(), rows_of.submit(frame).result()]
    total_, rows = pipeline()
    print(json.dumps({"total": total_, "rows": rows, "pid": os.getpid()}))

if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.parametrize("kind", ["processes", "dask"])
def test_a_cached_frame_reaches_the_next_step_in_another_process_by_reference(tmp_path: Path, kind: str) -> None:
    if kind == "dask":
        pytest.importorskip("prefect_dask")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "byref_flow.py").write_text(FLOW_PY)
    env = {
        **os.environ,
        "SMTHRS_WORKSPACE": str(ws),
        "PYTHONPATH": os.pathsep.join([str(hooks), str(tmp_path)]),
        "BODY_LOG": str(tmp_path / "bodies.log"),
    }

    def run(label: str) -> tuple[dict[str, int], list[str]]:
        log = tmp_path / f"hashed-{label}.log"
        out = subprocess.run(
            [sys.executable, str(tmp_path / "byref_flow.py"), kind],
            cwd=ws,
            env={**env, "HASH_LOG": str(log)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return result, (log.read_text().split() if log.exists() else [])

    first, hashed_first = run("first")
    assert (first["total"], first["rows"]) == (sum(range(50_000)), 50_000)
    # The frame a body built is the author's object: it is hashed where each consumer is keyed, in a worker.
    assert len(hashed_first) == 2 and str(first["pid"]) not in hashed_first

    second, hashed_second = run("second")
    assert second == {**first, "pid": second["pid"]}
    assert step_outcomes(ws) == ["built"] * 3 + ["clean"] * 3
    bodies = (tmp_path / "bodies.log").read_text().split()
    # Each body ran once (the async one too), in a worker process.
    assert sorted(b.split(":")[0] for b in bodies) == ["make_frame", "rows_of", "total"]
    assert all(b.split(":")[1] != str(first["pid"]) for b in bodies)
    # The second run: `make_frame` was a hit (decoded in a worker), the frame crossed to the flow process and on
    # to other workers, and both consumers were keyed on the stored digest there: no process hashed it.
    assert hashed_second == []
