"""The smthrs quickstart (``make demo``): a small data pipeline of ``@step``s and a plan, run twice in Prefect.

Run 1 builds everything; run 2 changes nothing and is served entirely from the content-addressed cache (every
step and plan node ``clean``: verified hits whose outputs were replayed into the workspace). A table shows each
outcome and the time saved.

Everything is embedded: SQLite and artifacts under ``<workspace>/.smthrs``, Prefect's ephemeral server with
``PREFECT_HOME`` under the repository's ``.smthrs/`` and a quiet environment. Point ``PREFECT_API_URL`` at a server
to watch the task runs, events and the report artifact in the Prefect UI.

    python examples/quickstart.py [--workspace DIR] [--rows N] [--keep] [--json]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import random
import shutil
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".smthrs"
# Quiet, local Prefect before Prefect is imported: our own PREFECT_HOME, no analytics, warnings only,
# and an in-memory database for the ephemeral server (a file-backed one stalls under many task runs).
for _k, _v in {
    "PREFECT_HOME": str(STATE / "prefect-home"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_ROOT_LEVEL": "CRITICAL",
    # Prefect waits only 20 s for its ephemeral server; a first start on a busy machine needs longer.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}.items():
    os.environ.setdefault(_k, _v)
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)

from prefect import flow  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.prefect.host import host_for_run, quiet_flow_settings  # noqa: E402

REGIONS = ("north", "south", "east", "west", "centre")

# ----------------------------------------------------------------------------------------------- the steps


@sp.step(reads=["data/raw.csv"], writes=["data/clean.csv"])
def clean(ws: sp.Workspace, min_amount: float) -> dict:
    """Drop malformed and tiny sales; normalise regions."""
    kept = dropped = 0
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["day", "region", "amount"])
    with open(ws / "data/raw.csv", newline="") as f:
        for row in csv.DictReader(f):
            try:
                amount = float(row["amount"])
            except ValueError:
                dropped += 1
                continue
            if amount < min_amount:
                dropped += 1
                continue
            writer.writerow([row["day"], row["region"].strip().lower(), f"{amount:.2f}"])
            kept += 1
    (ws / "data/clean.csv").write_text(out.getvalue())
    return {"kept": kept, "dropped": dropped}


@sp.step(reads=["data/clean.csv"], writes=["data/by_region.json"])
def aggregate(ws: sp.Workspace) -> dict:
    """Totals and counts per region."""
    totals: dict[str, list[float]] = {}
    with open(ws / "data/clean.csv", newline="") as f:
        for row in csv.DictReader(f):
            t = totals.setdefault(row["region"], [0.0, 0])
            t[0] += float(row["amount"])
            t[1] += 1
    by_region = {r: {"total": round(t[0], 2), "sales": int(t[1])} for r, t in sorted(totals.items())}
    (ws / "data/by_region.json").write_text(json.dumps(by_region, indent=2, sort_keys=True))
    return {"regions": len(by_region)}


@sp.step(reads=["data/by_region.json"], writes=["reports/summary.md"])
def summarize(ws: sp.Workspace, title: str) -> dict:
    """A markdown summary."""
    by_region = json.loads((ws / "data/by_region.json").read_text())
    lines = [f"# {title}", "", "| region | sales | total |", "|---|---|---|"]
    lines += [f"| {r} | {v['sales']} | {v['total']:.2f} |" for r, v in by_region.items()]
    (ws / "reports").mkdir(exist_ok=True)
    (ws / "reports/summary.md").write_text("\n".join(lines) + "\n")
    return {"lines": len(lines)}


# ------------------------------------------------------------------------------------------------ the plan


def histogram(ni: sp.NodeInput) -> dict:
    by_region = json.loads((ni.root / "data/by_region.json").read_text())
    top = max(v["total"] for v in by_region.values())
    rows = [f"{r:<8} {'#' * round(40 * v['total'] / top)}" for r, v in by_region.items()]
    (ni.root / "reports").mkdir(exist_ok=True)
    (ni.root / "reports/histogram.txt").write_text("\n".join(rows) + "\n")
    return {"bars": len(rows)}


def checksums(ni: sp.NodeInput) -> dict:
    names = ["reports/summary.md", "reports/histogram.txt"]
    sums = [f"{hashlib.sha256((ni.root / n).read_bytes()).hexdigest()}  {n}" for n in names]
    (ni.root / "reports/SHA256SUMS").write_text("\n".join(sums) + "\n")
    return {"files": len(sums)}


ACTIONS = {"histogram": histogram, "checksums": checksums}


def run_action(ni: sp.NodeInput) -> dict:
    return ACTIONS[ni.node.draft.material.body["action"]](ni)


def publish_plan() -> sp.plan.Plan:
    return sp.plan.compile_plan(
        "quickstart-publish",
        "quickstart/publish",
        [
            sp.plan.node(
                "histogram",
                body={"action": "histogram"},
                reads=["data/by_region.json"],
                writes=["reports/histogram.txt"],
            ),
            sp.plan.node(
                "checksums",
                body={"action": "checksums"},
                reads=["reports/summary.md", "reports/histogram.txt"],
                writes=["reports/SHA256SUMS"],
            ),
        ],
    )


# ------------------------------------------------------------------------------------------------ the flow


@flow(name="smthrs-quickstart", persist_result=False)
def pipeline(workspace: str) -> dict:
    rows: list[dict] = []

    def timed(kind: str, name: str, fn, *args) -> None:
        t = time.perf_counter()
        fn(*args)
        rows.append({"kind": kind, "name": name, "ms": (time.perf_counter() - t) * 1000.0})

    timed("step", "clean", clean, 5.0)
    timed("step", "aggregate", aggregate)
    timed("step", "summarize", summarize, "Sales by region")
    run_id = f"quickstart-publish-{uuid.uuid4().hex[:8]}"
    with sp.open_runtime(workspace) as rt:
        t = time.perf_counter()
        report = rt.scheduler(run_id).run(
            publish_plan(), run_action
        )  # the Prefect host: one task run per node
        plan_ms = (time.perf_counter() - t) * 1000.0
    host = host_for_run(run_id)
    for s in report.settlements:
        ms = host.durations_ms.get(s.node) if host is not None else None
        rows.append({"kind": "plan node", "name": s.node, "ms": ms if ms is not None else plan_ms})
    for r in rows:
        if r["kind"] == "plan node":
            r["outcome"] = report.outcomes[r["name"]]
    from prefect.runtime import flow_run

    return {"rows": rows, "flow_run_id": str(flow_run.id)}


def fill_step_outcomes(workspace: Path, result: dict) -> list[dict]:
    """Each step call's outcome, read from the flow run's smthrs run (``prefect-<flow run id>``) once the flow run
    ended: its journal holds one ``step-settled`` record per call (hits are journaled in batches, by run end)."""
    with sp.open_runtime(workspace) as rt:
        records = rt.journal.read(f"prefect-{result['flow_run_id']}")
    outcomes = {e.payload["node"]: e.payload["outcome"] for e in records if e.type == "step-settled"}
    for r in result["rows"]:
        if r["kind"] == "step":
            r["outcome"] = outcomes[r["name"]]
    return list(result["rows"])


# ------------------------------------------------------------------------------------------------ main


def make_raw(ws: Path, n: int) -> None:
    rnd = random.Random(42)
    (ws / "data").mkdir(parents=True, exist_ok=True)
    with open(ws / "data/raw.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["day", "region", "amount"])
        for i in range(n):
            amount = "n/a" if i % 97 == 0 else f"{rnd.lognormvariate(3, 1):.2f}"
            w.writerow([f"2025-01-{1 + i % 28:02d}", f" {rnd.choice(REGIONS).upper()} ", amount])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=STATE / "quickstart", help="scratch workspace (reset)")
    ap.add_argument("--rows", type=int, default=200_000, help="rows of synthetic sales data")
    ap.add_argument(
        "--keep", action="store_true", help="keep the workspace (and its cache) from a previous demo"
    )
    ap.add_argument("--json", action="store_true", help="print the two runs' rows as one JSON object")
    args = ap.parse_args(argv)
    ws: Path = args.workspace.resolve()
    if not args.keep and ws.exists():
        shutil.rmtree(ws)
    ws.mkdir(parents=True, exist_ok=True)
    if not (ws / "data/raw.csv").exists():
        make_raw(ws, args.rows)

    runs = []
    with sp.step_settings(workspace=ws), quiet_flow_settings():
        for i in (1, 2):
            t = time.perf_counter()
            result = pipeline(str(ws))
            runs.append((fill_step_outcomes(ws, result), time.perf_counter() - t))
            if i == 1:  # run 2 must be served from the cache: prove the outputs come back
                shutil.rmtree(ws / "reports")
    if args.json:
        print(json.dumps({"runs": [rows for rows, _ in runs], "seconds": [t for _, t in runs]}))
    else:
        _print_table(runs, ws)
    second = [r["outcome"] for r in runs[1][0]]
    if not all(o == "clean" for o in second):
        print(f"unexpected: run 2 was not all clean: {second}", file=sys.stderr)
        return 1
    if not (ws / "reports/SHA256SUMS").exists():
        print("unexpected: run 2 did not replay reports/", file=sys.stderr)
        return 1
    return 0


def _print_table(runs: list[tuple[list[dict], float]], ws: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    (first, t1), (second, t2) = runs
    table = Table(title="smthrs quickstart: the same pipeline, twice")
    for col in ("", "name", "run 1", "ms", "run 2", "ms", "saved ms"):
        table.add_column(col, justify="right" if col in ("ms", "saved ms") else "left")
    style = {"built": "yellow", "clean": "green"}
    saved = 0.0
    for a, b in zip(first, second, strict=True):
        d = a["ms"] - b["ms"]
        saved += d
        table.add_row(
            a["kind"],
            a["name"],
            f"[{style.get(a['outcome'], 'red')}]{a['outcome']}[/]",
            f"{a['ms']:.0f}",
            f"[{style.get(b['outcome'], 'red')}]{b['outcome']}[/]",
            f"{b['ms']:.0f}",
            f"{d:.0f}",
        )
    console = Console()
    console.print(table)
    boot = "" if os.environ.get("PREFECT_API_URL") else " (includes starting Prefect's local server)"
    console.print(
        f"flow run 1: {t1:.2f} s{boot} · flow run 2: {t2:.2f} s · time saved in steps and nodes: "
        f"{saved / 1000:.2f} s · outputs replayed into {ws / 'reports'}"
    )


if __name__ == "__main__":
    sys.exit(main())
