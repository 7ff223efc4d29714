"""Typed values through real Prefect flow runs (the session's server, a ``ThreadPoolTaskRunner``): async steps taking
a pydantic model and returning a DataFrame, ``.map`` over dates and models, a DataFrame handed from one step to
another by reference, and a value no codec handles refused naming its argument and the hook."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from _prefect_support import poll, step_outcomes, task_runs_of
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel

import smthrs_plugin as sp
from smthrs_plugin.codecs import frames
from smthrs_plugin.errors import CacheError
from smthrs_plugin.prefect.steprun import current_spec


@pytest.fixture(autouse=True)
def _bodies_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count body calls in this process's memory, so bodies run in-thread; how a body is isolated
    (a child process) is pinned by the isolation tests."""
    monkeypatch.setenv("SMTHRS_ISOLATION", "thread")


pytestmark = pytest.mark.prefect

#: Body executions, appended by the bodies (they all run in this process: the flow's loop or the pool's threads).
CALLS: list[str] = []


class Window(BaseModel):
    """A pydantic argument (module level: a stored model names its class by import path)."""

    region: str
    start: dt.date
    days: int


class Summary(BaseModel):
    """A pydantic result."""

    region: str
    rows: int
    total: float


@sp.step
async def load(window: Window) -> pd.DataFrame:
    CALLS.append("load")
    await asyncio.sleep(0)
    days = [window.start + dt.timedelta(days=i) for i in range(window.days)]
    return pd.DataFrame(
        {"day": [d.isoformat() for d in days], "amount": [1.5 * i for i in range(window.days)]}
    )


@sp.step
async def summarize(frame: pd.DataFrame, window: Window) -> Summary:
    CALLS.append("summarize")
    await asyncio.sleep(0)
    return Summary(region=window.region, rows=len(frame), total=float(frame["amount"].sum()))


@sp.step
def heaviest(frame: pd.DataFrame) -> dt.date:
    CALLS.append("heaviest")
    return dt.date.fromisoformat(str(frame.loc[frame["amount"].idxmax(), "day"]))


@sp.step
def weekday(day: dt.date) -> str:
    CALLS.append("weekday")
    return day.strftime("%A")


@sp.step
def span(window: Window) -> tuple:
    CALLS.append("span")
    return (window.start, window.start + dt.timedelta(days=window.days - 1))


@sp.step
def count(items: Any) -> int:
    CALLS.append("count")
    return len(items)


@flow(task_runner=ThreadPoolTaskRunner(max_workers=4), persist_result=False)
async def typed_pipeline(window: Window, others: list[Window]) -> dict:
    from prefect.runtime import flow_run

    frame = await load(window)  # an async step: pydantic in, DataFrame out
    summary = await summarize(frame, window)  # a DataFrame argument, received from the step above
    peak = heaviest.submit(frame).result()  # the same frame on a pool thread
    days = [window.start + dt.timedelta(days=i) for i in range(3)]
    names = [f.result() for f in weekday.map(days)]  # .map over dates
    spans = [f.result() for f in span.map(others)]  # .map over pydantic models
    return {
        "flow_run_id": str(flow_run.id),
        "frame": frame,
        "summary": summary,
        "peak": peak,
        "names": names,
        "spans": spans,
    }


def _settled(flow_run_id: str) -> list[dict[str, Any]]:
    rt = current_spec().open()
    return [e.payload for e in rt.journal.read(f"prefect-{flow_run_id}") if e.type == "step-settled"]


@pytest.fixture
def ws(tmp_path: Path) -> Any:
    CALLS.clear()
    with sp.step_settings(workspace=tmp_path):
        yield tmp_path


@pytest.fixture
def stream_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a frame's canonical stream was HASHED to key it (the codecs' by-reference path skips it)."""
    calls: list[int] = []
    original = frames._Arrow.digest_form

    def counting(self: Any, table: Any) -> Any:
        calls.append(table.num_rows)
        return original(self, table)

    monkeypatch.setattr(frames._Arrow, "digest_form", counting)
    return calls


WINDOW = Window(region="north", start=dt.date(2026, 3, 2), days=5)
OTHERS = [Window(region="south", start=dt.date(2026, 3, d), days=d) for d in (1, 2, 3)]


def test_a_flow_of_async_typed_steps_is_all_clean_on_its_second_run_and_ran_each_body_once(
    ws: Path, prefect_api: str, stream_hashes: list[int]
) -> None:
    first = asyncio.run(typed_pipeline(WINDOW, OTHERS))
    assert isinstance(first["frame"], pd.DataFrame) and list(first["frame"]["day"])[0] == "2026-03-02"
    assert first["summary"] == Summary(region="north", rows=5, total=15.0)
    assert first["peak"] == dt.date(2026, 3, 6)
    assert first["names"] == ["Monday", "Tuesday", "Wednesday"]
    assert first["spans"] == [(dt.date(2026, 3, d), dt.date(2026, 3, 2 * d - 1)) for d in (1, 2, 3)]
    ran_once = sorted(["load", "summarize", "heaviest"] + ["weekday"] * 3 + ["span"] * 3)
    assert sorted(CALLS) == ran_once
    built = _settled(first["flow_run_id"])
    assert [r["outcome"] for r in built] == ["built"] * 9
    assert stream_hashes  # the returned frame (the author's own object) was hashed to key the next steps

    stream_hashes.clear()
    second = asyncio.run(typed_pipeline(WINDOW, OTHERS))
    assert sorted(CALLS) == ran_once  # no body ran again
    hits = _settled(second["flow_run_id"])
    assert [(r["outcome"], r["decision"]) for r in hits] == [("clean", "VerifiedHit")] * 9
    # Every hit decoded to an equal value of the same type.
    pd.testing.assert_frame_equal(second["frame"], first["frame"])
    assert type(second["summary"]) is Summary and second["summary"] == first["summary"]
    assert type(second["peak"]) is dt.date and second["peak"] == first["peak"]
    assert second["names"] == first["names"]
    assert all(type(s) is tuple for s in second["spans"]) and second["spans"] == first["spans"]
    # The cached frame reached `summarize` and `heaviest` by reference: keyed on its stored digest, never hashed
    # again — and still the same keys as the first run's hashing (both calls hit).
    assert stream_hashes == []
    assert sorted(r["dispatch_key"] for r in hits) == sorted(r["dispatch_key"] for r in built)
    # Every hit is a Cached task run in Prefect, direct awaits, submits and maps alike.
    names: list[str] = poll(
        lambda: sorted(t["state"]["name"] for t in task_runs_of(prefect_api, second["flow_run_id"])),
        lambda v: len(v) == 9 and not {"Running", "Pending", "Scheduled"} & set(v),
    )
    assert names == ["Cached"] * 9


def test_a_cached_frame_hashed_again_keys_like_the_frame_it_was_stored_from(
    ws: Path, monkeypatch: pytest.MonkeyPatch, stream_hashes: list[int]
) -> None:
    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2), persist_result=False)
    async def peak_of(window: Window) -> dt.date:
        return heaviest.submit(await load(window)).result()  # type: ignore[no-any-return]

    assert asyncio.run(peak_of(WINDOW)) == dt.date(2026, 3, 6)
    # Without the by-reference shortcut (e.g. a frame that crossed a process boundary), the decoded frame is hashed
    # again — and its canonical stream is the one stored, so the next step still hits.
    monkeypatch.setattr(frames._IDENTITIES, "lookup", lambda obj: None)
    stream_hashes.clear()
    assert asyncio.run(peak_of(WINDOW)) == dt.date(2026, 3, 6)
    assert stream_hashes == [5]
    assert sorted(CALLS) == ["heaviest", "load"]


def test_a_changed_cell_or_model_field_is_a_new_key_and_runs_the_body(ws: Path) -> None:
    @flow(persist_result=False)
    async def once(window: Window) -> Summary:
        return await summarize(await load(window), window)

    assert asyncio.run(once(WINDOW)).total == 15.0
    assert asyncio.run(once(WINDOW.model_copy(update={"days": 4}))).total == 9.0
    assert asyncio.run(once(WINDOW.model_copy(update={"region": "east"}))).region == "east"
    # days=4 changed the frame (new load, new summarize); region changed the model only (new load: its argument
    # changed; summarize too) — never served another value.
    assert CALLS.count("load") == 3 and CALLS.count("summarize") == 3


def test_an_argument_no_codec_handles_is_refused_naming_the_argument_and_the_codec_hook_before_any_body_runs(
    ws: Path,
) -> None:
    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2), persist_result=False)
    def direct() -> int:
        return count(collections.deque([1, 2]))  # type: ignore[no-any-return]

    with pytest.raises(CacheError) as err:
        direct()
    assert err.value.code == "key_uncomputable" and err.value.details["argument"] == "items"
    assert "'items'" in err.value.message and "smthrs_value_codecs" in err.value.message

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=2), persist_result=False)
    def mapped() -> list[int]:
        return [f.result() for f in count.map([[1], collections.deque([2, 3])])]

    with pytest.raises(CacheError) as err:
        mapped()
    assert err.value.code == "key_uncomputable" and err.value.details["argument"] == "items"
    assert "smthrs_value_codecs" in err.value.message
    assert CALLS == ["count"]  # only the mapped list element ran; no deque reached a body


def test_readme_dataframe_step_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMTHRS_WORKSPACE", raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/sales.csv").write_text("day,amount\n2026-01-01,3.5\n2026-01-02,4.0\n2026-01-02,0.5\n")
    # --- example (keep identical to the DataFrame block of "For Prefect flow authors: @step") ---
    import datetime as dt

    import pandas as pd
    from prefect import flow

    import smthrs_plugin as sp

    @sp.step(reads=["data/sales.csv"])
    def sales_on(ws: sp.Workspace, day: dt.date) -> pd.DataFrame:
        sales = pd.read_csv(ws / "data/sales.csv")
        return sales[sales["day"] == day.isoformat()].reset_index(drop=True)

    @sp.step
    def total(sales: pd.DataFrame) -> float:
        return float(sales["amount"].sum())

    @flow
    def daily_total(day: dt.date) -> float:
        sales = sales_on(day)  # a DataFrame result: stored as Arrow IPC bytes in the artifact store
        return total(sales)  # keyed on its content; a cached frame by its stored digest

    print(daily_total(dt.date(2026, 1, 2)))  # built: both bodies ran
    print(daily_total(dt.date(2026, 1, 2)))  # clean: the frame decoded from the store, then `total` hit
    # --- end of the example ---
    assert capsys.readouterr().out.splitlines()[-2:] == ["4.5", "4.5"]
    assert step_outcomes(tmp_path) == ["built"] * 2 + ["clean"] * 2
