"""Common ``@sp.step`` mistakes get one typed, readable error: ``ws: sp.Workspace`` is found in any position, a
declared read that does not exist is refused before the body runs, a refusal is logged once (not once per Prefect
layer), and a return value no codec stores fails the first build unless the step says ``cache_value=False``.

A body counts its runs in a file OUTSIDE the workspace (whatever process or namespace it is isolated in, that file
is the one the test reads)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import counted_workspace, ran, runs
from prefect import flow

import smthrs_plugin as sp
from smthrs_plugin.errors import CacheError
from smthrs_plugin.prefect.steprun import current_spec

pytestmark = pytest.mark.prefect


#: The environment variable naming where bodies count their runs (set per test, outside its workspace). Not a
#: module global: a step's key folds the plain constants its code names, and one set per test would change it.
@sp.step(reads=["in.txt"])
def second(prefix: str, ws: sp.Workspace, suffix: str = "!") -> str:
    ran("second")
    return prefix + (ws / "in.txt").read_text() + suffix


@sp.step(reads=["in.txt"])
def keyword_only(prefix: str, *, ws: sp.Workspace, times: int = 1) -> str:
    ran("keyword_only")
    return prefix + (ws / "in.txt").read_text() * times


@sp.step(reads=["data/raw.csv"])
def typo(ws: sp.Workspace) -> int:
    ran("typo")
    return len((ws / "data/raw.csv").read_text())


@sp.step(reads=["data/*.csv"])
def globbed(ws: sp.Workspace) -> int:
    ran("globbed")
    return len(list((ws / "data").glob("*.csv"))) if (ws / "data").exists() else 0


@sp.step
def add(a: Any, b: int) -> int:
    ran("add")
    return 1


@sp.step
async def add_async(a: Any, b: int) -> int:
    ran("add")
    return 1


class Opaque:
    """A return type no value codec stores."""


@sp.step
def opaque() -> Opaque:
    ran("opaque")
    return Opaque()


@sp.step(writes=["report.txt"], cache_value=False)
def report(ws: sp.Workspace, title: str) -> Opaque:
    ran("report")
    (ws / "report.txt").write_text(title)
    return Opaque()  # not cached: every call returns None


@pytest.fixture
def ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from counted_workspace(tmp_path, monkeypatch)


def test_the_workspace_parameter_is_not_a_task_parameter_in_any_position() -> None:
    for s in (second, keyword_only):
        assert "ws" not in s.step_spec.call_signature.parameters
        assert "ws" not in inspect.signature(s.fn).parameters  # what Prefect binds a call to
        assert s.step_spec.workspace_param == "ws"
    spec, root = second.step_spec, Path("/sandbox")
    args, kwargs = spec.body_arguments(root, spec.call_signature.bind("x"))
    assert args[0] == "x" and isinstance(args[1], sp.Workspace) and Path(args[1]) == root
    assert args[2:] == () and kwargs == {}  # unapplied default: the function's own
    bound = spec.call_signature.bind("x", suffix="?")
    bound.apply_defaults()
    args, kwargs = spec.body_arguments(root, bound)
    assert (args[0], Path(args[1]), args[2], kwargs) == ("x", root, "?", {})
    k = keyword_only.step_spec
    bound = k.call_signature.bind("x", times=2)
    bound.apply_defaults()
    args, kwargs = k.body_arguments(root, bound)
    assert args == ("x",) and kwargs["times"] == 2 and Path(kwargs["ws"]) == root


def test_a_workspace_in_second_or_keyword_only_position_receives_the_sandbox(ws: Path) -> None:
    @flow(persist_result=False)
    def both() -> list[str]:
        return [second("<"), second("<", suffix="?"), keyword_only(">", times=2)]

    assert both() == ["<abc!", "<abc?", ">abcabc"]
    assert both() == ["<abc!", "<abc?", ">abcabc"]  # all hits
    assert (runs("second"), runs("keyword_only")) == (2, 1)


def test_two_workspace_parameters_are_refused() -> None:
    with pytest.raises(CacheError) as err:

        @sp.step
        def two(a: sp.Workspace, b: sp.Workspace) -> int:
            return 1

    assert err.value.code == "invalid_declaration" and "a, b" in err.value.message


def test_a_declared_read_that_does_not_exist_is_refused_before_the_bodyruns(ws: Path) -> None:
    @flow(persist_result=False)
    def uses_typo() -> int:
        return typo()

    with pytest.raises(CacheError) as err:
        uses_typo()
    assert err.value.code == "missing_read"
    assert err.value.message.startswith(
        f"step {typo.step_spec.identity} declares reads=['data/raw.csv'] but data/raw.csv does not exist in the"
        f" workspace {ws}"
    )
    assert runs("typo") == 0  # the body never ran
    rt = current_spec().open()
    assert all(e.type != "step-settled" for r in rt.runs.list() for e in rt.journal.read(r.run_id))

    (ws / "data").mkdir()
    (ws / "data/raw.csv").write_text("1,2\n")
    assert uses_typo() == 4 and runs("typo") == 1


def test_a_glob_that_matches_nothing_is_not_a_missing_read(ws: Path) -> None:
    assert globbed() == 0 and runs("globbed") == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_refusal_is_logged_once_and_still_raised_typed(
    ws: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    @flow(persist_result=False)
    def bad() -> int:
        return add(object(), 3)

    @flow(persist_result=False)
    async def bad_async() -> int:
        return await add_async(object(), 3)

    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="prefect")  # the flow run's final state is an INFO record
    with pytest.raises(CacheError) as err:
        bad() if kind == "sync" else asyncio.run(bad_async())
    assert err.value.code == "key_uncomputable" and err.value.details["argument"] == "a"
    assert runs("add") == 0

    formatter = logging.Formatter()

    def text(r: logging.LogRecord) -> str:
        return r.getMessage() + (formatter.formatException(r.exc_info) if r.exc_info else "")

    telling = [r for r in caplog.records if "key_uncomputable" in text(r)]
    assert len(telling) == 1, [text(r) for r in telling]
    assert telling[0].levelno == logging.ERROR and "argument 'a'" in telling[0].getMessage()
    # Prefect still says the task run and the flow run failed, pointing at that one record.
    echoes = [r.getMessage() for r in caplog.records if "the refusal logged above" in r.getMessage()]
    assert any(m.startswith("Task run failed with exception: CacheError") for m in echoes), echoes
    assert any(m.startswith("Encountered exception during execution: CacheError") for m in echoes), echoes
    assert sum(m.startswith("Finished in state Failed") for m in echoes) == 2, echoes


def test_a_return_value_no_codec_stores_fails_the_first_build_typed(ws: Path) -> None:
    with pytest.raises(CacheError) as err:
        opaque()
    assert err.value.code == "value_uncacheable"
    assert "Opaque" in err.value.message and "cache_value=False" in err.value.message
    rt = current_spec().open()
    assert rt.dispatcher.local.rows(subject=opaque.step_spec.identity) == []  # nothing cached
    with pytest.raises(CacheError):
        opaque()
    assert runs("opaque") == 2


def test_cache_value_false_caches_the_outputs_and_every_call_returns_none(ws: Path) -> None:
    assert report("q1") is None
    assert (ws / "report.txt").read_text() == "q1"
    (ws / "report.txt").unlink()
    assert report("q1") is None  # a hit: the output replayed, the body not run
    assert (ws / "report.txt").read_text() == "q1"
    assert runs("report") == 1
