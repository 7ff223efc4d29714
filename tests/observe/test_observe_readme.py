"""The docs/how-to/observe.md observe example, run verbatim (in a temporary working directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner


def test_readme_observe_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # --- example (keep identical to docs/how-to/observe.md, "Observe") ---
    from opentelemetry.sdk.metrics import MeterProvider  # the host picks the SDK/exporter, not the plugin
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    import smthrs_plugin as sp
    from smthrs_plugin.observe import Metrics, feed, list_runs, snapshot, watch

    reader = InMemoryMetricReader()  # e.g. PeriodicExportingMetricReader(OTLPMetricExporter()) in production
    metrics = Metrics(MeterProvider(metric_readers=[reader]))
    plan = sp.plan.compile_plan(
        plan_id="demo", flow="ci/demo", nodes=[sp.plan.node("hello", body={"say": "hi"})]
    )
    with sp.open_runtime(workspace=".", metrics=metrics) as rt:
        rt.scheduler(run_id="demo-1").run(plan, executor=lambda inp: {"node": inp.node.id})
        db = rt.db

    events = list(watch(db, "demo-1", follow=False))  # a finite snapshot; omit follow for the live stream
    print([e.kind for e in events][-2:])  # ['node-settled', 'run-settled']
    with watch(db, "demo-1", follow=True, after_cursor=events[-1].cursor) as live:
        rt.journal.append("demo-1", "note", {"by": "me"})  # any process may append; the tail polls the table
        print(live.next_within(5.0).payload)  # {'by': 'me'}

    page = list_runs(db, {"status": "completed", "flow": "ci/demo"}, limit=50)
    print([r.run_id for r in page.runs], page.cursor)  # ['demo-1'] None  (cursor: pass it back for more)
    print(snapshot.read(db, ["demo-1", "nope"]).items[1])  # Missing(run_id='nope', deleted=False, ...)
    pos = feed.current(db)
    print([c.run_id for c in feed.changes_since(db, pos.source, 0).changes])  # ['demo-1']
    print(sorted(m.name for rm in reader.get_metrics_data().resource_metrics
                 for sm in rm.scope_metrics for m in sm.metrics)[:2])  # fmt: skip
    # --- end of the example ---
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "['node-settled', 'run-settled']"
    assert out[1] == "{'by': 'me'}"
    assert out[2] == "['demo-1'] None"
    assert out[3].startswith("Missing(run_id='nope', deleted=False, revision=")
    assert out[4] == "['demo-1']"
    assert out[5] == "['flows_engine_boundary_settlements', 'flows_engine_dispatch_duration']"
    from smthrs_plugin.cli import app

    url = "sqlite:///.smthrs/state.db"
    cli = CliRunner()
    runs = cli.invoke(app, ["runs", "--db", url, "--status", "completed"])
    assert runs.exit_code == 0 and "demo-1" in runs.output and "ci/demo" in runs.output
    shown = cli.invoke(app, ["show", "demo-1", "--db", url])
    assert shown.exit_code == 0 and "completed" in shown.output
    watched = cli.invoke(app, ["watch", "demo-1", "--db", url])
    assert watched.exit_code == 0 and "run-settled" in watched.output and "note" in watched.output
