"""``@sp.step`` freshness with Prefect's names: ``cache_expiration`` (an older entry is a miss whose reason is
``expired``, in the local and the shared tier, and ``smthrs cache explain`` says so), ``refresh_cache`` (and
Prefect's ``PREFECT_TASKS_REFRESH_CACHE``), ``cache_exclude``, ``cache_policy=NO_CACHE``. Time moves only on the
runtime's injected clock (a ``ManualClock`` in its dispatcher): nothing sleeps, nothing measures elapsed time.

A body counts its runs in a file OUTSIDE the workspace (whatever process or namespace it is isolated in, that file
is the one the test reads)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _prefect_support import counted_workspace, ran, runs
from prefect import flow
from prefect.cache_policies import INPUTS, NO_CACHE
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings
from typer.testing import CliRunner

import smthrs_plugin as sp
from smthrs_plugin._clock import ManualClock
from smthrs_plugin.errors import CacheError
from smthrs_plugin.prefect.steprun import current_spec

pytestmark = pytest.mark.prefect

HOUR = dt.timedelta(hours=1)


#: The environment variable naming where bodies count their runs (set per test, outside its workspace). Not a
#: module global: a step's key folds the plain constants its code names, and one set per test would change it.
@sp.step(reads=["in.txt"], cache_expiration=HOUR)
def hourly(ws: sp.Workspace, tag: str) -> dict:
    return {"tag": tag, "text": (ws / "in.txt").read_text(), "run": ran("hourly")}


@sp.step
def counter(tag: str) -> int:
    return ran("counter")


@sp.step(cache_exclude=["client", "log"])
def query(sql: str, client: Any, log: Any = None) -> str:
    ran("query")
    return client.run(sql)


@sp.step(cache_policy=NO_CACHE, writes=["stamp.txt"])
def stamp(ws: sp.Workspace, text: str) -> str:
    n = ran("stamp")
    (ws / "stamp.txt").write_text(f"{text} {n}")
    return text


class Client:
    """Not data: no value codec keys it (an HTTP or database client)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def run(self, sql: str) -> str:
        return f"rows of {sql}"


@pytest.fixture
def ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from counted_workspace(tmp_path, monkeypatch)


def _on_clock(clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The current step runtime, its dispatcher reading ``clock`` (what entries are stamped with and aged by)."""
    rt = current_spec().open()
    monkeypatch.setattr(rt.dispatcher, "clock", clock)
    return rt


def _provenance(rt: Any, action: str) -> list[dict[str, Any]]:
    return [
        e.payload
        for r in rt.runs.list()
        for e in rt.journal.read(r.run_id)
        if e.type == "cache-provenance" and e.payload.get("action") == action
    ]


def _explain(rt: Any, subject: str) -> Any:
    from smthrs_plugin.cli import app

    out = CliRunner().invoke(
        app, ["cache", "explain", subject, "--db", rt.db.url, "--workspace", str(rt.workspace), "--json"]
    )
    assert out.exit_code == 0, out.output
    text = CliRunner().invoke(
        app, ["cache", "explain", subject, "--db", rt.db.url, "--workspace", str(rt.workspace)]
    )
    return json.loads(out.output), text.output


def test_an_entry_older_than_cache_expiration_is_a_miss_whose_reason_is_expired_in_the_local_tier(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    rt = _on_clock(clock, monkeypatch)
    assert hourly("a")["run"] == 1
    clock.advance(3599)
    assert hourly("a")["run"] == 1  # within the hour: a verified hit
    clock.advance(2)
    assert hourly("a") == {"tag": "a", "text": "abc", "run": 2}  # 3601 s old: not served, built again
    # Both tiers held the entry (the shared tier is the workspace's own artifact store here): both expired.
    expired = {p["tier"]: (p["age_ms"], p["max_age_ms"]) for p in _provenance(rt, "expired")}
    assert expired == {"local": (3_601_000, 3_600_000), "shared": (3_601_000, 3_600_000)}
    assert hourly("a")["run"] == 2  # the rebuilt entry is fresh: served

    explained, text = _explain(rt, hourly.step_spec.identity)
    assert explained["renewed"] == {
        "reason": "expired",
        "tier": "local",
        "age_ms": 3_601_000,
        "max_age_ms": 3_600_000,
    }
    assert "expired: the previous entry of this key (local tier) was 1:00:01 old" in text
    assert "over cache_expiration 1:00:00" in text


def test_an_expired_shared_entry_is_not_served_and_the_rebuild_replaces_it(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    _on_clock(clock, monkeypatch)
    assert hourly("s")["run"] == 1  # published to the shared tier (the workspace's artifact store)

    clock.advance(2 * 3600)
    # Another database, same workspace and artifact store: an empty local tier, so only the shared entry is there.
    with sp.step_settings(workspace=ws, db=f"sqlite:///{tmp_path / 'other.db'}"):
        other = _on_clock(clock, monkeypatch)
        assert hourly("s")["run"] == 2
        (expired,) = _provenance(other, "expired")
        assert (expired["tier"], expired["age_ms"], expired["max_age_ms"]) == ("shared", 7_200_000, 3_600_000)
        assert [p["action"] for p in _provenance(other, "replaced")] == ["replaced"]
        explained, text = _explain(other, hourly.step_spec.identity)
        assert explained["renewed"]["reason"] == "expired" and explained["renewed"]["tier"] == "shared"
        assert "expired" in text and "2:00:00 old" in text

    # A third database finds the replaced (fresh) shared entry: served, nothing runs.
    with sp.step_settings(workspace=ws, db=f"sqlite:///{tmp_path / 'third.db'}"):
        _on_clock(clock, monkeypatch)
        assert hourly("s")["run"] == 2
    assert runs("hourly") == 2


def test_cache_expiration_is_not_part_of_the_key(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock()
    _on_clock(clock, monkeypatch)
    assert counter("k") == 1
    clock.advance(600)
    # Adding (or changing) an expiration finds the same entry: 600 s old, within 15 minutes — served.
    assert counter.with_options(cache_expiration=dt.timedelta(minutes=15))("k") == 1
    assert counter.with_options(cache_expiration=dt.timedelta(minutes=5))("k") == 2  # too old for 5 minutes
    assert counter("k") == 2  # the renewed entry, under the same key, for a step with no expiration too


@pytest.mark.parametrize("bad", [dt.timedelta(0), dt.timedelta(seconds=-1), 3600, "1h"])
def test_cache_expiration_must_be_a_positive_timedelta(bad: Any) -> None:
    with pytest.raises(CacheError) as err:

        @sp.step(cache_expiration=bad)
        def nope() -> int:
            return 1

    assert err.value.code == "invalid_declaration" and "cache_expiration" in err.value.message
    with pytest.raises(CacheError) as again:
        counter.with_options(cache_expiration=bad)
    assert again.value.code == "invalid_declaration"


def test_refresh_cache_runs_the_body_and_its_result_replaces_the_entry(ws: Path) -> None:
    assert counter("r") == 1
    assert counter("r") == 1
    refreshing = counter.with_options(refresh_cache=True)
    assert refreshing("r") == 2  # always runs: a different result replaces the entry (no result mismatch)
    assert refreshing("r") == 3
    assert counter("r") == 3  # later calls hit the newest entry
    assert counter.with_options(refresh_cache=False)("r") == 3


def test_refresh_cache_none_follows_prefects_setting_at_call_time(ws: Path) -> None:
    @flow(persist_result=False)
    def twice() -> list[int]:
        return [counter("p"), counter("p")]

    assert twice() == [1, 1]
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        assert twice() == [2, 3]  # every call refreshes
        assert counter.with_options(refresh_cache=False)("p") == 3  # the step's own False wins
    assert twice() == [3, 3]


def test_an_excluded_argument_reaches_the_body_but_not_the_key(ws: Path) -> None:
    assert query("select 1", Client("a")) == "rows of select 1"
    # Another client (no key form at all: it is never keyed), another log: the same entry.
    assert query("select 1", Client("b"), log=object()) == "rows of select 1"
    assert runs("query") == 1
    assert query("select 2", Client("a")) == "rows of select 2"  # a keyed argument changed: built
    assert runs("query") == 2


def test_cache_exclude_names_must_be_parameters() -> None:
    with pytest.raises(CacheError) as err:

        @sp.step(cache_exclude=["clinet"])
        def fetch(url: str, client: Any) -> str:
            return url

    assert err.value.code == "invalid_declaration"
    assert "'clinet'" in err.value.message and "url, client" in err.value.message
    with pytest.raises(CacheError) as bare:
        sp.step(cache_exclude="client")(lambda client: 1)
    assert bare.value.code == "invalid_declaration"
    with pytest.raises(CacheError) as ws_param:

        @sp.step(cache_exclude=["ws"])
        def body(ws: sp.Workspace, x: int) -> int:
            return x

    assert ws_param.value.code == "invalid_declaration"  # the workspace is never keyed: nothing to exclude


def test_no_cache_always_runs_stores_nothing_and_still_copies_back(ws: Path) -> None:
    @flow(persist_result=False)
    def stamped() -> str:
        from prefect.runtime import flow_run

        stamp("x")
        stamp("x")
        return str(flow_run.id)

    flow_run_id = stamped()
    assert runs("stamp") == 2
    assert (ws / "stamp.txt").read_text() == "x 2"  # the sandbox's write was copied back
    rt = current_spec().open()
    settled = [e.payload for e in rt.journal.read(f"prefect-{flow_run_id}") if e.type == "step-settled"]
    assert [(p["outcome"], p["decision"]) for p in settled] == [("built", None), ("built", None)]
    assert rt.dispatcher.local.rows(subject=stamp.step_spec.identity) == []  # nothing stored

    plain = sp.step(counter.step_spec.fn, name="uncached").with_options(cache_policy=NO_CACHE)
    assert [plain("n"), plain("n")] == [1, 2]


@pytest.mark.parametrize(
    "options", [{"cache_policy": INPUTS}, {"cache_policy": None}, {"cache_key_fn": lambda *a: "k"}]
)
def test_other_prefect_caching_options_are_still_refused(options: dict[str, Any]) -> None:
    with pytest.raises(CacheError) as err:
        sp.step(**options)(lambda x: x)
    assert err.value.code == "invalid_declaration"
    assert "does not take Prefect caching options" in err.value.message
    with pytest.raises(CacheError) as again:
        counter.with_options(**options)
    assert again.value.code == "invalid_declaration"


def test_readme_freshness_exampleruns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMTHRS_WORKSPACE", raising=False)
    # --- example (keep identical to docs/tutorials/flow-authors.md, "Freshness") ---
    import datetime as dt

    from prefect import flow
    from prefect.cache_policies import NO_CACHE

    import smthrs_plugin as sp

    class RatesClient:  # stands for an HTTP client: not data, never keyed
        def get(self, pair: str) -> dict:
            return {"pair": pair, "rate": 1.08}

    @sp.step(cache_expiration=dt.timedelta(hours=1), cache_exclude=["client"])
    def rate(pair: str, client: RatesClient) -> dict:
        return client.get(pair)  # served for an hour, then fetched again

    @sp.step(cache_policy=NO_CACHE, writes=["out/rate.txt"])
    def publish(ws: sp.Workspace, quote: dict) -> None:
        (ws / "out").mkdir(exist_ok=True)
        (ws / "out/rate.txt").write_text(f"{quote['pair']} {quote['rate']}\n")  # runs on every call

    @flow
    def rates() -> dict:
        quote = rate("EURUSD", RatesClient())
        publish(quote)
        return quote

    print(rates())  # rate and publish built
    print(rates())  # rate is a verified hit (within the hour), publish ran again
    # rate.with_options(refresh_cache=True) would fetch now and replace the entry
    # --- end of the example ---
    assert capsys.readouterr().out.splitlines()[-2:] == ["{'pair': 'EURUSD', 'rate': 1.08}"] * 2
    assert (tmp_path / "out/rate.txt").read_text() == "EURUSD 1.08\n"
    from _prefect_support import step_outcomes

    assert step_outcomes(tmp_path) == ["built", "built", "built", "clean"]
