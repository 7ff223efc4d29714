"""Remote workers that share only S3 (and the database's owner, the coordinator) with the flow: plan nodes and
``@sp.step`` calls run on Dask worker processes that CANNOT SEE THE WORKSPACE.

The cluster is real: a ``dask scheduler`` and two ``dask worker`` processes (``examples/_hidden_cluster.py``) in a
mount namespace of their own where an empty, read-only tmpfs covers the directory every workspace of this module
lives in. A worker that opened a workspace path would find nothing there (and anything it wrote would vanish with
its namespace), so a run that completes with the right bytes in the workspace proves the bodies got their inputs
from the coordinator (through S3, or inline with the task for small files) and sent their outputs back the same
way. A negative control checks the hiding itself: a body that reads the workspace by absolute path fails.

Failure modes pinned here: a worker killed mid-body (Dask reschedules it; the node settles once), an input blob
missing from or corrupted in the store (an input too large to travel inline: uploaded again once; a second loss is
the node's typed failure), a worker whose clock is off (no timestamp crosses: its mtimes never reach the workspace,
a touched read is no change), an artifact store the workers cannot reach (refused, typed).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import smthrs_plugin as sp
from smthrs_plugin.boundary.transfer import INLINE_FILE_MAX
from smthrs_plugin.errors import RemoteError, SchedulerError
from smthrs_plugin.prefect import _remote
from smthrs_plugin.prefect.host import PrefectHost

pytestmark = [pytest.mark.prefect, pytest.mark.s3, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from _hidden_cluster import can_hide, hidden_cluster  # noqa: E402

# The workers import smthrs_plugin, not this test module: its bodies and steps travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

_IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def hidden_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory every workspace of this module lives in: hidden from the workers."""
    return tmp_path_factory.mktemp("remote-workspaces")


@pytest.fixture(scope="module")
def markers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the workers CAN see (outside the hidden one): how a test tells a body what happened before."""
    return tmp_path_factory.mktemp("remote-markers")


@pytest.fixture(scope="module")
def cluster(hidden_root: Path, prefect_api: str) -> Iterator[str]:
    if not can_hide():
        if _IN_CI:
            pytest.fail("CI runs as root with unshare: the workers' hidden workspace must be tested there")
        pytest.skip("hiding the workspace from workers needs root and unshare")
    with hidden_cluster([hidden_root], 2, env={"PREFECT_API_URL": prefect_api}) as address:
        yield address


@pytest.fixture
def ws(hidden_root: Path) -> Path:
    path = hidden_root / uuid.uuid4().hex[:10]
    (path / "in").mkdir(parents=True)
    for i in range(4):
        (path / f"in/part-{i}.txt").write_text(f"part {i}\n" * 50)
    return path


@pytest.fixture
def s3_artifacts(s3_bucket: str, s3_options: dict[str, str]) -> tuple[str, dict[str, str]]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_options)
    if not fs.exists(s3_bucket):
        fs.mkdir(s3_bucket)
    return f"s3://{s3_bucket}/cache", dict(s3_options)


# ------------------------------------------------------------------------------------------------ node bodies


def _probe(ws: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "sees_workspace": os.path.exists(os.path.join(ws, "in"))}


def render(ni: sp.NodeInput) -> dict[str, Any]:
    b = ni.node.draft.material.body
    if b.get("kind") == "merge":
        parts = [(ni.root / p).read_text() for p in b["parts"]]
        (ni.root / "out/all.txt").write_text("".join(parts))
        return _probe(b["ws"])
    if b.get("kind") == "peek":  # the negative control: the real workspace, by absolute path
        return {"read": Path(b["ws"], "in/part-0.txt").read_text()}
    if b.get("kind") == "die-once":
        marker = Path(b["marker"])
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
    if b.get("kind") == "die-always":
        with open(b["marker"], "a") as f:
            f.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    if b.get("kind") == "skewed":
        far = b["mtime"]
        os.utime(ni.root / b["src"], (far, far))  # a worker whose clock is off touches a read: same bytes
    src = (ni.root / b["src"]).read_bytes()
    out = ni.root / b["dst"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(hashlib.sha256(src).hexdigest().encode() + b"\n" + src.upper())
    if b.get("kind") == "skewed":
        os.utime(out, (b["mtime"], b["mtime"]))
    return _probe(b["ws"])


def expected_output(ws: Path, i: int) -> bytes:
    src = (ws / f"in/part-{i}.txt").read_bytes()
    return hashlib.sha256(src).hexdigest().encode() + b"\n" + src.upper()


def render_node(ws: Path, i: int, **extra: Any) -> Any:
    return sp.plan.node(
        f"render-{i}",
        body={"src": f"in/part-{i}.txt", "dst": f"out/part-{i}.txt", "ws": str(ws), **extra},
        reads=[f"in/part-{i}.txt"],
        writes=[f"out/part-{i}.txt"],
    )


def fan_in_plan(ws: Path, n: int = 4, **extra: Any) -> sp.plan.Plan:
    nodes = [render_node(ws, i, **extra) for i in range(n)]
    outs = [f"out/part-{i}.txt" for i in range(n)]
    nodes.append(
        sp.plan.node(
            "merge", body={"kind": "merge", "parts": outs, "ws": str(ws)}, reads=outs, writes=["out/all.txt"]
        )
    )
    return sp.plan.compile_plan("remote", "tests/remote", nodes)


def run_on_cluster(
    address: str,
    ws: Path,
    db: str,
    artifacts: tuple[str, dict[str, str]],
    plan: sp.plan.Plan,
    *,
    executor: Any = render,
    **kw: Any,
) -> Any:
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    @flow(task_runner=DaskTaskRunner(address=address), persist_result=False)
    def remote_flow(run_id: str) -> Any:
        with sp.open_runtime(ws, db=db, artifacts=artifacts[0], artifacts_options=artifacts[1]) as rt:
            return rt.scheduler(run_id, **kw).run(plan, executor)

    return remote_flow(f"remote-{uuid.uuid4().hex[:8]}")


# ------------------------------------------------------------------------------------------------------ plans


def test_a_plan_on_workers_that_cannot_see_the_workspace_builds_then_is_all_clean(
    cluster: str, ws: Path, db_url: str, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    plan = fan_in_plan(ws)
    first = run_on_cluster(cluster, ws, db_url, s3_artifacts, plan)
    assert set(first.outcomes.values()) == {"built"} and len(first.outcomes) == 5
    # Every body ran in a worker process, none of which could see the workspace...
    assert all(r["pid"] != os.getpid() and r["sees_workspace"] is False for r in first.results.values())
    # ... and still every output is in the coordinator's workspace, byte for byte.
    for i in range(4):
        assert (ws / f"out/part-{i}.txt").read_bytes() == expected_output(ws, i)
    assert (ws / "out/all.txt").read_bytes() == b"".join(expected_output(ws, i) for i in range(4))
    second = run_on_cluster(cluster, ws, db_url, s3_artifacts, plan)
    assert set(second.outcomes.values()) == {"clean"}


def test_the_hiding_is_real_a_body_reading_the_workspace_by_absolute_path_fails_on_the_worker(
    cluster: str, ws: Path, tmp_path: Path, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    plan = sp.plan.compile_plan(
        "peek", "tests/remote", [sp.plan.node("peek", body={"kind": "peek", "ws": str(ws)})]
    )
    report = run_on_cluster(cluster, ws, f"sqlite:///{tmp_path / 'state.db'}", s3_artifacts, plan)
    assert report.outcomes == {"peek": "failed"}
    assert "FileNotFoundError" in (report.settlements[0].error or "")


def test_a_worker_killed_mid_body_is_rescheduled_and_the_node_settles_once(
    cluster: str, ws: Path, tmp_path: Path, markers: Path, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    marker = markers / f"died-{uuid.uuid4().hex[:8]}"
    plan = fan_in_plan(ws, n=1, kind="die-once", marker=str(marker))
    report = run_on_cluster(cluster, ws, f"sqlite:///{tmp_path / 'state.db'}", s3_artifacts, plan)
    assert marker.exists()  # the first worker really died inside the body
    assert report.outcomes == {"render-0": "built", "merge": "built"}
    # The coordinator's one attempt settled once; the worker that died wrote nothing anyone reads.
    assert {s.node: s.attempts for s in report.settlements}["render-0"] == 1
    assert report.results["render-0"]["pid"] != int(marker.read_text())
    assert (ws / "out/part-0.txt").read_bytes() == expected_output(ws, 0)


def test_a_body_that_kills_every_worker_it_lands_on_fails_the_node_typed_once_dask_gives_up(
    cluster: str, ws: Path, tmp_path: Path, markers: Path, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    marker = markers / f"deaths-{uuid.uuid4().hex[:8]}"
    plan = fan_in_plan(ws, n=1, kind="die-always", marker=str(marker))
    report = run_on_cluster(cluster, ws, f"sqlite:///{tmp_path / 'state.db'}", s3_artifacts, plan)
    assert report.outcomes == {"render-0": "failed", "merge": "skipped"}
    assert "RemoteError[worker_failed]" in (report.settlements[0].error or "")
    assert len(marker.read_text().split()) > 1  # Dask retried on fresh workers before it gave up
    assert not (ws / "out").exists()


def test_a_worker_whose_clock_is_off_changes_nothing_the_workspace_keeps_its_own_time(
    cluster: str, ws: Path, tmp_path: Path, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    db = f"sqlite:///{tmp_path / 'state.db'}"
    far_future = 4_102_444_800.0  # 2100-01-01: what a worker whose clock runs a century ahead stamps
    before = os.stat(ws / "in/part-0.txt").st_mtime
    plan = fan_in_plan(ws, n=1, kind="skewed", mtime=far_future)
    first = run_on_cluster(cluster, ws, db, s3_artifacts, plan)
    # The touched read is not a write (hard boundary: an undeclared write would fail the node).
    assert first.outcomes == {"render-0": "built", "merge": "built"}
    assert os.stat(ws / "in/part-0.txt").st_mtime == before
    assert os.stat(ws / "out/part-0.txt").st_mtime < far_future
    assert (ws / "out/part-0.txt").read_bytes() == expected_output(ws, 0)
    second = run_on_cluster(cluster, ws, db, s3_artifacts, plan)
    assert set(second.outcomes.values()) == {"clean"}


def test_a_timer_node_stays_on_the_coordinator_while_work_is_shipped(
    cluster: str, ws: Path, tmp_path: Path, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    # A timer is a durable clock of the run (it needs the run's context), not work: it is never shipped.
    plan = sp.plan.compile_plan(
        "timer",
        "tests/remote",
        [
            sp.plan.node("cool-down", wait={"seconds": 0}),
            render_node(ws, 0),
        ],
    )
    report = run_on_cluster(cluster, ws, f"sqlite:///{tmp_path / 'state.db'}", s3_artifacts, plan)
    assert report.outcomes == {"cool-down": "built", "render-0": "built"}
    assert report.results["render-0"]["sees_workspace"] is False


class _LosingStore:
    """Wraps the transfer's upload so the store loses what was just uploaded (a lifecycle rule, an operator's
    cleanup): ``times`` uploads lose their blobs; ``corrupt`` replaces them with other bytes instead. Only blobs
    that go through the store can be lost: a small file travels inline (:func:`_store_only_input`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, times: int, corrupt: bool = False) -> None:
        self.calls: list[bool] = []
        self.times = times
        self.corrupt = corrupt
        real = _remote.upload

        def upload(root: Path, manifest: Any, store: Any, *, force: bool = False, **kw: Any) -> int:
            sent = real(root, manifest, store, force=force, **kw)
            self.calls.append(force)
            if len(self.calls) <= self.times:
                for e in manifest.values():
                    if e.kind == "file" and e.digest not in kw.get("skip", ()):
                        if self.corrupt:
                            store.fs.pipe_file(
                                store.blob_path(e.digest), b"not the bytes you are looking for"
                            )
                        else:
                            store.delete_blob(e.digest)
            return sent

        monkeypatch.setattr(_remote, "upload", upload)


def _store_only_input(ws: Path, i: int) -> None:
    """Make input ``i`` too large to travel inline: it goes through the store (boundary/transfer.py)."""
    (ws / f"in/part-{i}.txt").write_bytes(b"part %d " % i + b"z" * INLINE_FILE_MAX)


@pytest.mark.parametrize("corrupt", [False, True], ids=["missing", "corrupt"])
def test_an_input_blob_lost_from_the_store_is_uploaded_again_once_and_the_node_builds(
    cluster: str,
    ws: Path,
    tmp_path: Path,
    s3_artifacts: tuple[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    corrupt: bool,
) -> None:
    _store_only_input(ws, 0)
    losing = _LosingStore(monkeypatch, times=1, corrupt=corrupt)
    plan = sp.plan.compile_plan("lossy", "tests/remote", [render_node(ws, 0)])
    report = run_on_cluster(cluster, ws, f"sqlite:///{tmp_path / 'state.db'}", s3_artifacts, plan)
    assert report.outcomes == {"render-0": "built"}
    assert losing.calls == [False, True]  # the worker's refusal made the coordinator replace the blob, once
    assert (ws / "out/part-0.txt").read_bytes() == expected_output(ws, 0)


def test_an_input_blob_lost_twice_fails_the_node_with_a_typed_error_and_writes_no_output(
    cluster: str,
    ws: Path,
    tmp_path: Path,
    s3_artifacts: tuple[str, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _store_only_input(ws, 0)
    losing = _LosingStore(monkeypatch, times=2)
    plan = fan_in_plan(ws, n=1)
    report = run_on_cluster(cluster, ws, f"sqlite:///{tmp_path / 'state.db'}", s3_artifacts, plan)
    assert report.outcomes == {"render-0": "failed", "merge": "skipped"}
    assert "RemoteError[input_unavailable]" in (report.settlements[0].error or "")
    assert losing.calls == [False, True]
    assert not (ws / "out").exists()


def test_an_artifact_store_the_workers_cannot_reach_is_refused_typed(
    cluster: str, ws: Path, tmp_path: Path
) -> None:
    local = (tmp_path / "artifacts").as_posix()
    with pytest.raises(RemoteError) as err:
        run_on_cluster(cluster, ws, f"sqlite:///{tmp_path / 'state.db'}", (local, {}), fan_in_plan(ws, n=1))
    assert err.value.code == "store_not_shared" and "SMTHRS_EXECUTION" in err.value.message
    assert not (ws / "out").exists()


def test_shared_execution_chosen_explicitly_is_honoured_and_fails_typed_where_workers_cannot_see_the_workspace(
    cluster: str, ws: Path, tmp_path: Path, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    # Trusting these workers to see the workspace is exactly what fails: the choice is honoured (never silently
    # upgraded to remote) and the failure names the missing workspace.
    err = shared_run_error(cluster, ws, tmp_path, s3_artifacts)
    assert err.code == "boundary_unavailable" and "workspace_missing" in err.message
    assert not (ws / "out").exists()


def shared_run_error(
    cluster: str, ws: Path, tmp_path: Path, artifacts: tuple[str, dict[str, str]], **kw: Any
) -> SchedulerError:
    """The typed error a one-node fan-in plan run under explicit shared execution must fail with."""
    with pytest.raises(SchedulerError) as err:
        run_on_cluster(
            cluster,
            ws,
            f"sqlite:///{tmp_path / 'state.db'}",
            artifacts,
            fan_in_plan(ws, n=1),
            host=PrefectHost(execution="shared"),
            **kw,
        )
    return err.value


def test_a_node_task_run_the_cluster_cannot_unpickle_fails_the_run_typed_with_the_clusters_own_reason(
    cluster: str, ws: Path, tmp_path: Path, hidden_root: Path, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    # The executor comes from a module only this process can import (it lives where the cluster sees nothing), the
    # way a flow's own module often is: Dask's scheduler cannot unpickle the node's task run and the runner gives
    # it up. The run fails typed, naming the node and Dask's reason, not with Prefect's "run is in PENDING state".
    name = f"smthrs_unimportable_{uuid.uuid4().hex[:8]}"
    mod_dir = hidden_root / name
    mod_dir.mkdir()
    (mod_dir / f"{name}.py").write_text("def render(ni):\n    return {'ran': True}\n")
    sys.path.insert(0, str(mod_dir))
    try:
        err = shared_run_error(
            cluster, ws, tmp_path, s3_artifacts, executor=importlib.import_module(name).render
        )
    finally:
        sys.path.remove(str(mod_dir))
        sys.modules.pop(name, None)
    assert err.code == "task_run_lost", err
    assert "render-0" in err.message and "deserialization" in err.message
    assert err.cause is not None and err.details["state"] in ("PENDING", "RUNNING")
    assert not (ws / "out").exists()


# ------------------------------------------------------------------------------------------------------ steps


@sp.step(reads=["in/part-0.txt"])
def line_count(ws: sp.Workspace, times: int) -> dict[str, Any]:
    return {"lines": len((ws / "in/part-0.txt").read_text().splitlines()) * times, "pid": os.getpid()}


@sp.step(reads=["in/part-1.txt"], writes=["out/upper.txt"])
def shout(ws: sp.Workspace) -> dict[str, Any]:
    (ws / "out").mkdir(exist_ok=True)
    (ws / "out/upper.txt").write_text((ws / "in/part-1.txt").read_text().upper())
    return {"pid": os.getpid()}


@sp.step
async def add(a: int, b: int) -> dict[str, Any]:
    return {"sum": a + b, "pid": os.getpid()}


def test_steps_map_submit_and_direct_calls_run_on_workers_that_cannot_see_the_workspace(
    cluster: str, ws: Path, db_url: str, s3_artifacts: tuple[str, dict[str, str]]
) -> None:
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    @flow(task_runner=DaskTaskRunner(address=cluster), persist_result=False)
    def steps_flow() -> dict[str, Any]:
        mapped = [f.result() for f in line_count.map([1, 2, 3])]
        direct = shout()
        summed = add.submit(2, 3).result()
        return {"mapped": mapped, "direct": direct, "summed": summed}

    def settings() -> Any:
        return sp.step_settings(ws, db=db_url, artifacts=s3_artifacts[0], artifacts_options=s3_artifacts[1])

    with settings():
        first = steps_flow()
    assert [m["lines"] for m in first["mapped"]] == [50, 100, 150]
    assert first["summed"]["sum"] == 5
    pids = {m["pid"] for m in first["mapped"]} | {first["direct"]["pid"], first["summed"]["pid"]}
    assert os.getpid() not in pids
    assert (ws / "out/upper.txt").read_text() == (ws / "in/part-1.txt").read_text().upper()
    with settings():
        second = steps_flow()
    assert second == first  # hits return the stored values (the pids of the first run's workers)
    with sp.open_runtime(ws, db=db_url) as rt:
        outcomes = sorted(
            e.payload["outcome"]
            for r in rt.runs.list()
            for e in rt.journal.read(r.run_id)
            if e.type == "step-settled"
        )
    assert outcomes == ["built"] * 5 + ["clean"] * 5
