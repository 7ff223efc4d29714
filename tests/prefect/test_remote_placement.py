"""Where node and step bodies run (prefect/_remote.py): the placement decision from the flow's task runner
and the ``execution`` choice, the refusal of a store workers cannot reach, the settings that carry the choice,
errors that cross a process boundary intact, the worker side of a body (``_run_body``) and the coordinator side
(``RemoteTarget.run``: ship, retry once on a missing input, apply the delta).

No cluster is started: constructing a ``DaskTaskRunner`` does not connect, and ``RemoteTarget.run`` is driven
through a stand-in task runner that runs the real body task's function in this thread — it stands in for Dask, not
for smthrs code, and round-trips what it ships through cloudpickle as a real runner does."""

from __future__ import annotations

import inspect
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import smthrs_plugin as sp
import smthrs_plugin.errors as errors_mod
from smthrs_plugin.boundary.transfer import INLINE_FILE_MAX, Delta, Entry, manifest_of, upload
from smthrs_plugin.errors import RemoteError, SettingsError, SmthrsError, WaitError
from smthrs_plugin.prefect._remote import RemoteTarget, _Box, _Returned, _run_body, _Shipment, execution_for
from smthrs_plugin.prefect.host import PrefectHost
from smthrs_plugin.prefect.steprun import step_settings
from smthrs_plugin.settings import Settings, load_settings
from smthrs_plugin.stores.artifacts import ArtifactStore

pytestmark = pytest.mark.prefect


@pytest.fixture(autouse=True)
def _no_execution_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SMTHRS_EXECUTION", raising=False)


# -- execution_for ----------------------------------------------------------------------------------------------


class UnknownRunner:
    """A task runner smthrs knows nothing about (Ray, a custom one): it may run bodies anywhere."""


def _thread_pool() -> Any:
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner()


def _process_pool() -> Any:
    from prefect.task_runners import ProcessPoolTaskRunner

    return ProcessPoolTaskRunner()


def _dask_local() -> Any:
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner()  # would start its own LocalCluster on this machine (not started here)


def _dask_address() -> Any:
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address="tcp://127.0.0.1:1")  # somebody else's cluster (never contacted here)


@pytest.mark.parametrize(
    ("make", "choice", "expected"),
    [
        (_thread_pool, "auto", "in-process"),
        (_thread_pool, "shared", "in-process"),
        (_thread_pool, "remote", "remote"),
        (_process_pool, "auto", "shared"),
        (_process_pool, "remote", "remote"),
        (_dask_local, "auto", "shared"),
        (_dask_local, "remote", "remote"),
        (_dask_address, "auto", "remote"),
        (_dask_address, "shared", "shared"),
        (lambda: None, "auto", "in-process"),
        (lambda: None, "shared", "in-process"),
        (UnknownRunner, "auto", "remote"),
        (UnknownRunner, "shared", "shared"),
    ],
    ids=lambda v: (
        v if isinstance(v, str) else ("none" if v.__name__ == "<lambda>" else v.__name__.lstrip("_"))
    ),
)
def test_execution_for_places_bodies_from_the_task_runner_and_the_choice(
    make: Callable[[], Any], choice: str, expected: str
) -> None:
    assert execution_for(make(), choice) == expected


@pytest.mark.parametrize("choice", ["sideways", "", "REMOTE", "in-process"])
def test_execution_for_refuses_a_choice_outside_auto_shared_remote(choice: str) -> None:
    with pytest.raises(SettingsError) as ei:
        execution_for(_thread_pool(), choice)
    assert ei.value.code == "invalid_setting"
    assert "SMTHRS_EXECUTION" in str(ei.value)


# -- RemoteTarget.of: a store the workers can reach -------------------------------------------------------------


def test_an_s3_store_is_accepted_for_remote_bodies_under_auto() -> None:
    store = ArtifactStore("s3://never-contacted/artifacts", {"endpoint_url": "http://127.0.0.1:1"})
    target = RemoteTarget.of(_dask_address(), store, "auto")
    assert target.store is store


def test_a_local_disk_store_is_refused_under_auto_with_a_message_naming_the_fixes(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "artifacts"))
    with pytest.raises(RemoteError) as ei:
        RemoteTarget.of(_dask_address(), store, "auto")
    assert ei.value.code == "store_not_shared"
    assert "SMTHRS_EXECUTION" in str(ei.value)
    assert "s3://" in str(ei.value)


def test_a_local_disk_store_is_accepted_when_remote_execution_is_chosen_explicitly(tmp_path: Path) -> None:
    # The user then vouches that the path is mounted on every worker.
    store = ArtifactStore(str(tmp_path / "artifacts"))
    assert RemoteTarget.of(_dask_address(), store, "remote").store is store


@pytest.mark.parametrize("choice", ["auto", "shared", "remote"])
def test_a_memory_store_is_refused_for_remote_bodies_whatever_the_choice(choice: str) -> None:
    store = ArtifactStore("memory://smthrs-remote-placement")
    with pytest.raises(RemoteError) as ei:
        RemoteTarget.of(_dask_address(), store, choice)
    assert ei.value.code == "store_not_shared"


# -- the choice in settings -------------------------------------------------------------------------------------


def test_prefect_host_refuses_a_bad_execution_choice_at_construction() -> None:
    with pytest.raises(SettingsError) as ei:
        PrefectHost(execution="sideways")
    assert ei.value.code == "invalid_setting"


@pytest.mark.parametrize("choice", ["auto", "shared", "remote"])
def test_settings_accept_each_execution_choice(choice: str) -> None:
    assert Settings(execution=choice).execution == choice  # type: ignore[arg-type]
    assert load_settings(execution=choice).execution == choice
    PrefectHost(execution=choice)


def test_settings_default_to_auto() -> None:
    assert load_settings().execution == "auto"


@pytest.mark.parametrize("choice", ["sideways", "in-process", ""])
def test_load_settings_refuses_another_execution_choice(choice: str) -> None:
    with pytest.raises(SettingsError) as ei:
        load_settings(execution=choice)
    assert ei.value.code == "invalid_setting"


def test_smthrs_execution_in_the_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMTHRS_EXECUTION", "remote")
    assert load_settings().execution == "remote"
    monkeypatch.setenv("SMTHRS_EXECUTION", "sideways")
    with pytest.raises(SettingsError):
        load_settings()


def test_step_settings_carry_the_execution_choice_into_the_spec(tmp_path: Path) -> None:
    with step_settings(workspace=tmp_path, execution="remote") as spec:
        assert spec.execution == "remote"
    with step_settings(workspace=tmp_path) as spec:
        assert spec.execution == "auto"
    with pytest.raises(SettingsError), step_settings(workspace=tmp_path, execution="sideways"):
        pass


# -- errors cross a process boundary intact ---------------------------------------------------------------------


def _error_cases() -> list[Any]:
    cases = []
    for name in errors_mod.__all__:
        cls = getattr(errors_mod, name)
        if not (inspect.isclass(cls) and issubclass(cls, SmthrsError)):
            continue
        for code in sorted(cls.codes):
            cases.append(pytest.param(cls, code, id=f"{name}-{code}"))
    return cases


ERROR_CASES = _error_cases()


def test_every_error_family_and_the_remote_family_are_covered() -> None:
    families = {p.values[0] for p in ERROR_CASES}
    assert RemoteError in families
    assert {p.values[1] for p in ERROR_CASES if p.values[0] is RemoteError} == set(RemoteError.codes)


@pytest.mark.parametrize(("cls", "code"), ERROR_CASES)
def test_every_typed_error_round_trips_through_pickle_with_its_type_code_message_and_details(
    cls: type[SmthrsError], code: str
) -> None:
    # A refusal raised on a worker crosses back to the coordinator pickled (process pool, Dask).
    err = cls(code, "what happened; what to do next", cause=OSError(2, "no such file"), path="a/b.txt", n=3)
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps(err))
        assert type(back) is cls
        assert back.code == code
        assert back.message == err.message
        assert str(back) == str(err)
        assert back.details == {"path": "a/b.txt", "n": 3}
        assert isinstance(back.cause, OSError) and back.cause.args == (2, "no such file")
        assert back.__cause__ is back.cause


# -- the worker side: _run_body ---------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "coordinator-tree"
    (root / "in").mkdir(parents=True)
    (root / "in" / "data.txt").write_bytes(b"input bytes")
    (root / "tool.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(root / "tool.sh", 0o755)
    (root / "old.txt").write_bytes(b"to be removed")
    return root


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore((tmp_path / "artifacts").as_uri())


def _shipment(call: Callable[[Path], Any], tree: Path, store: ArtifactStore) -> _Box:
    manifest = manifest_of(tree)
    upload(tree, manifest, store)
    return _Box(_Shipment(call, manifest, store))


def test_a_body_runs_in_a_fresh_tree_holding_exactly_its_manifest_and_its_writes_come_back_as_a_delta(
    tree: Path, store: ArtifactStore
) -> None:
    seen: dict[str, Any] = {}

    def body(root: Path) -> str:
        seen["root"] = root
        seen["manifest"] = manifest_of(root)
        (root / "out.txt").write_bytes(b"result")
        (root / "old.txt").unlink()
        return "value"

    box = _shipment(body, tree, store)
    out = _run_body(box, "n #1 · remote")

    assert isinstance(out, _Returned)
    assert out.value == "value"
    assert seen["manifest"] == box.shipment.manifest
    root: Path = seen["root"]
    assert root.resolve() != tree.resolve()
    assert not root.resolve().is_relative_to(tree.resolve())
    assert not os.path.lexists(root)  # the private tree is gone
    assert not os.path.lexists(root.parent)
    assert dict(out.delta.changed) == {
        "out.txt": Entry("file", digest=store.put_bytes(b"result"), mode=0o644, size=6)
    }
    assert out.delta.removed == ("old.txt",)
    assert (tree / "old.txt").exists() and not (tree / "out.txt").exists()  # the source tree is untouched


class BodyFailed(Exception):
    """The body's own failure (module-level: it pickles by reference, as a user's exception would)."""


def test_a_body_that_raises_propagates_its_own_exception_and_its_tree_is_still_removed(
    tree: Path, store: ArtifactStore
) -> None:
    seen: dict[str, Path] = {}
    boom = BodyFailed("the body's own failure")

    def body(root: Path) -> None:
        seen["root"] = root
        (root / "partial.txt").write_bytes(b"half")
        raise boom

    with pytest.raises(BodyFailed) as ei:
        _run_body(_shipment(body, tree, store), "n #1 · remote")
    assert ei.value is boom
    assert not os.path.lexists(seen["root"].parent)


def test_a_body_may_not_wait(tree: Path, store: ArtifactStore) -> None:
    # Outside a body the same call fails for another reason (no run): the ban is checked first, inside the body.
    with pytest.raises(WaitError) as outside:
        sp.sleep(1)
    assert outside.value.code == "no_run_context"

    def body(root: Path) -> None:
        sp.sleep(1)

    with pytest.raises(WaitError) as ei:
        _run_body(_shipment(body, tree, store), "n #1 · remote")
    assert ei.value.code == "invalid_wait"
    assert "n #1 · remote" in str(ei.value)


# -- the coordinator side: RemoteTarget.run ---------------------------------------------------------------------


class _Future:
    def __init__(self, state: Any) -> None:
        self.state = state

    def wait(self) -> None:
        return None


class StandInRunner:
    """Stands in for a task runner: ``submit(task, parameters)`` runs ``task.fn`` here, on a pickled copy of the
    parameters (what a worker would receive), and returns its outcome as a real Prefect state — ``Completed``
    with the value (directly, or in a ``ResultRecord`` as the engine stores it) or ``Failed`` with the
    exception. ``before_run`` lets a test act between the coordinator's upload and the worker's hydration."""

    def __init__(self, *, records: bool = False, before_run: Callable[[int], object] | None = None) -> None:
        self.records = records
        self.before_run = before_run
        self.submitted: list[str] = []

    def submit(self, task: Any, parameters: dict[str, Any]) -> _Future:
        from prefect.results import ResultStore
        from prefect.states import Completed, Failed

        self.submitted.append(parameters["label"])
        if self.before_run is not None:
            self.before_run(len(self.submitted))
        shipped = cloudpickle.loads(cloudpickle.dumps(parameters))
        try:
            value = task.fn(**shipped)
        except Exception as exc:
            back = cloudpickle.loads(cloudpickle.dumps(exc))
            data = ResultStore().create_result_record(back) if self.records else back
            return _Future(Failed(data=data))
        value = cloudpickle.loads(cloudpickle.dumps(value))
        return _Future(Completed(data=ResultStore().create_result_record(value) if self.records else value))


def _write_result(root: Path) -> dict[str, int]:
    (root / "out").mkdir()
    (root / "out" / "result.txt").write_bytes((root / "in" / "data.txt").read_bytes().upper())
    (root / "old.txt").unlink()
    return {"lines": 1}


@pytest.mark.parametrize("records", [False, True], ids=["data", "result-record"])
@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_run_ships_the_body_applies_its_delta_to_the_root_and_returns_its_value(
    tree: Path, tmp_path: Path, request: pytest.FixtureRequest, kind: str, records: bool
) -> None:
    if kind == "file":
        store = ArtifactStore((tmp_path / "artifacts").as_uri())
    else:
        store = ArtifactStore(
            f"s3://{request.getfixturevalue('s3_bucket')}/artifacts", request.getfixturevalue("s3_options")
        )
    runner = StandInRunner(records=records)
    target = RemoteTarget.of(runner, store, "remote")

    assert target.run("n #1 · remote", _write_result, tree) == {"lines": 1}
    assert runner.submitted == ["n #1 · remote"]
    assert (tree / "out" / "result.txt").read_bytes() == b"INPUT BYTES"
    assert not (tree / "old.txt").exists()
    assert (tree / "in" / "data.txt").read_bytes() == b"input bytes"


def _store_only_input(tree: Path) -> bytes:
    """Make the input too large to travel inline: it goes through the store (boundary/transfer.py)."""
    data = b"input bytes " + b"x" * INLINE_FILE_MAX
    (tree / "in" / "data.txt").write_bytes(data)
    return data


def test_run_reuploads_every_input_with_force_and_submits_again_when_the_worker_finds_one_missing(
    tree: Path, store: ArtifactStore
) -> None:
    data = _store_only_input(tree)
    digest = manifest_of(tree)["in/data.txt"].digest

    def lose_on_first(n: int) -> None:
        if n == 1:
            store.delete_blob(digest)  # gone between upload and hydration (a gc, a lifecycle rule)

    runner = StandInRunner(before_run=lose_on_first)
    target = RemoteTarget.of(runner, store, "remote")
    assert target.run("n #1 · remote", _write_result, tree) == {"lines": 1}
    assert len(runner.submitted) == 2
    assert store.has(digest)
    assert (tree / "out" / "result.txt").read_bytes() == data.upper()


def test_run_fails_with_input_unavailable_when_the_input_is_missing_again_after_the_reupload(
    tree: Path, store: ArtifactStore
) -> None:
    _store_only_input(tree)
    digest = manifest_of(tree)["in/data.txt"].digest
    runner = StandInRunner(before_run=lambda n: store.delete_blob(digest))
    target = RemoteTarget.of(runner, store, "remote")
    with pytest.raises(RemoteError) as ei:
        target.run("n #1 · remote", _write_result, tree)
    assert ei.value.code == "input_unavailable"
    assert ei.value.details["path"] == "in/data.txt"
    assert len(runner.submitted) == 2
    assert not (tree / "out").exists() and (tree / "old.txt").exists()  # nothing applied


@pytest.mark.parametrize("records", [False, True], ids=["data", "result-record"])
def test_run_reraises_the_bodys_own_exception_once_without_a_retry(
    tree: Path, store: ArtifactStore, records: bool
) -> None:
    def body(root: Path) -> None:
        (root / "partial.txt").write_bytes(b"half")
        raise BodyFailed("no good")

    runner = StandInRunner(records=records)
    with pytest.raises(BodyFailed, match="no good"):
        RemoteTarget.of(runner, store, "remote").run("n #1 · remote", body, tree)
    assert len(runner.submitted) == 1
    assert not (tree / "partial.txt").exists()


class NeitherRunner:
    """A runner whose task run ends Completed with something that is neither the body's return nor an error."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def submit(self, task: Any, parameters: dict[str, Any]) -> _Future:
        from prefect.states import Completed

        return _Future(Completed(data=self.data))


@pytest.mark.parametrize("data", ["a string", 42, Delta((), ())], ids=["str", "int", "bare-delta"])
def test_run_fails_with_worker_failed_when_the_task_run_carries_no_outcome_of_the_body(
    tree: Path, store: ArtifactStore, data: Any
) -> None:
    with pytest.raises(RemoteError) as ei:
        RemoteTarget.of(NeitherRunner(data), store, "remote").run("n #1 · remote", _write_result, tree)
    assert ei.value.code == "worker_failed"
    assert "n #1 · remote" in str(ei.value)
    assert (tree / "old.txt").exists()


class LostRunner:
    """The runner lost the body (its workers died, the runner gave up): the task run never reached a final state."""

    def submit(self, task: Any, parameters: dict[str, Any]) -> _Future:
        from prefect.states import Running

        return _Future(Running())


def test_run_fails_with_worker_failed_when_the_runner_lost_the_body_before_it_ended(
    tree: Path, store: ArtifactStore
) -> None:
    with pytest.raises(RemoteError) as ei:
        RemoteTarget.of(LostRunner(), store, "remote").run("n #1 · remote", _write_result, tree)
    assert ei.value.code == "worker_failed" and "RUNNING" in ei.value.message
    assert (tree / "old.txt").exists()
