"""A remote body is cancelled with its scheduler pass (prefect/_remote.py): when a sibling's typed failure
interrupts the pass, the coordinator cancels the body's Dask task, the body's own token fires on the worker, the
node fails like any interrupted node (its attempt ``failed`` as ``interrupted``, journaled once), the run settles
``failed``, and neither the coordinator's sandbox nor the worker's tree is left behind.

The cluster is the real one of the remote-execution tests (``examples/_hidden_cluster.py``: a ``dask scheduler``
and worker processes, the workspace hidden from them where this machine allows it), reporting to the session's
Prefect server; the artifact store is the moto S3 server."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import smthrs_plugin as sp
from smthrs_plugin.errors import StoreError
from smthrs_plugin.records.attempts import AttemptStore

pytestmark = [pytest.mark.prefect, pytest.mark.s3, pytest.mark.slow]

DEADLINE_S = 120.0
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from _hidden_cluster import can_hide, hidden_cluster  # noqa: E402

# The workers import smthrs_plugin, not this test module: its bodies travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _until(cond: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {DEADLINE_S} s: {what}")
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def hidden_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remote-cancel-workspaces")


@pytest.fixture(scope="module")
def worker_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workers' temporary directory (their ``TMPDIR``), visible here: where their body trees live."""
    return tmp_path_factory.mktemp("remote-cancel-worker-tmp")


@pytest.fixture(scope="module")
def cluster(hidden_root: Path, worker_tmp: Path, prefect_api: str) -> Iterator[str]:
    # Two threads per worker: the blocked body and its sibling run at once wherever Dask places them.
    env = {"PREFECT_API_URL": prefect_api, "TMPDIR": str(worker_tmp)}
    with hidden_cluster([hidden_root], 2, hide=can_hide(), env=env, threads=2) as address:
        yield address


@pytest.fixture
def ws(hidden_root: Path) -> Path:
    path = hidden_root / uuid.uuid4().hex[:10]
    (path / "in").mkdir(parents=True)
    (path / "in/data.txt").write_text("input\n")
    return path


@pytest.fixture
def markers(tmp_path: Path) -> Path:
    """Files the workers and this test both see: how the bodies say what they did."""
    path = tmp_path / "markers"
    path.mkdir()
    return path


@pytest.fixture
def coordinator_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's temporary directory for the test: where the coordinator's sandboxes are made."""
    path = tmp_path / "coordinator-tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def body(ni: sp.NodeInput) -> dict[str, Any]:
    """``blocker`` waits for ``go`` (never written) and stops when its token fires; ``trigger`` returns once the
    blocker runs (its settlement commits the blocker's attempt row with it); ``victim``, after ``trigger``, fails
    the pass with a typed store failure."""
    b = ni.node.draft.material.body
    started, deadline = Path(b["started"]), time.monotonic() + DEADLINE_S
    if b["kind"] == "trigger":
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"blocker_started": started.exists()}
    if b["kind"] == "victim":
        raise StoreError("corrupt", "the database under this sibling is damaged: a typed scheduler failure")
    started.write_text(str(os.getpid()))
    while not Path(b["go"]).exists() and time.monotonic() < deadline:
        if ni.cancel.wait(0.05):  # the worker-side token of this body's Dask task
            Path(b["saw"]).write_text(ni.cancel.reason or "")
            raise RuntimeError("stopped: the body's task was cancelled")
    (ni.root / "out").mkdir(exist_ok=True)
    (ni.root / "out/blocked.txt").write_text("finished\n")
    Path(b["finished"]).write_text("finished")
    return {"finished": True}


def test_a_sibling_failure_cancels_a_blocked_remote_body_on_its_worker_and_leaves_nothing_behind(
    cluster: str,
    ws: Path,
    tmp_path: Path,
    markers: Path,
    worker_tmp: Path,
    coordinator_tmp: Path,
    s3_bucket: str,
    s3_options: dict[str, str],
) -> None:
    from distributed import Client
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    m = {name: str(markers / name) for name in ("started", "go", "saw", "finished")}
    plan = sp.plan.compile_plan(
        "cancel",
        "tests/remote-cancel",
        [
            sp.plan.node(
                "blocker", body={"kind": "block", **m}, reads=["in/data.txt"], writes=["out/blocked.txt"]
            ),
            # Every node reads an input, so each runs in a full sandbox of its own (none is pooled).
            sp.plan.node("trigger", body={"kind": "trigger", "started": m["started"]}, reads=["in/data.txt"]),
            sp.plan.node(
                "victim",
                body={"kind": "victim", "started": m["started"]},
                reads=["in/data.txt"],
                inputs=[sp.plan.Pending("trigger")],
            ),
        ],
    )
    db = f"sqlite:///{tmp_path / 'state.db'}"
    run_id = f"remote-cancel-{uuid.uuid4().hex[:8]}"

    @flow(task_runner=DaskTaskRunner(address=cluster), persist_result=False)
    def remote_flow() -> str | None:
        with sp.open_runtime(
            ws, db=db, artifacts=f"s3://{s3_bucket}/cache", artifacts_options=s3_options
        ) as rt:
            try:
                rt.scheduler(run_id).run(plan, body)
            except sp.SchedulerError as exc:
                return exc.code
        return None

    assert remote_flow() == "store_failed"  # the sibling's typed failure ended the pass

    # The blocked body's own token fired on its worker: its Dask task was cancelled, not waited for.
    assert "cancelled" in _until(lambda: Path(m["saw"]).exists() and Path(m["saw"]).read_text(), "the body")
    assert not Path(m["finished"]).exists()
    with Client(cluster, timeout=DEADLINE_S) as client:
        busy = [k for keys in client.processing().values() for k in keys if str(k).startswith("smthrs-body-")]
        assert busy == []
    # The worker removed the body's tree when the body stopped; the coordinator's sandbox is gone too.
    _until(lambda: not list(worker_tmp.glob("smthrs-remote-*")), "the worker's tree to be removed")
    assert list(coordinator_tmp.glob("smthrs-sandbox-*")) == []
    assert not (ws / "out").exists()

    with sp.open_runtime(ws, db=db) as rt:
        run = rt.runs.get(run_id)
        assert run is not None and run.status == "failed"
        rows = {r.node_id: r for r in AttemptStore(rt.db).list(run_id)}
        assert rows["blocker"].state == "failed" and rows["blocker"].error["type"] == "interrupted"
        finished = [
            e.payload
            for e in rt.journal.read(run_id, limit=500)
            if e.type == "attempt-finished" and e.payload["node_id"] == "blocker"
        ]
        assert [p["outcome"] for p in finished] == ["failed"]  # exactly one: the interrupt's
