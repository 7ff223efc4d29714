"""Scale out: the same plan on a Dask LocalCluster of process workers, with PostgreSQL for state and S3 for the
cache. Run 1 builds every node in the workers; run 2 is all ``clean``.

Each node dispatch is a Prefect task run executed by a Dask worker process; the worker opens its own database
engine and S3 filesystem (nothing is pickled but URLs), and its writes are fenced by the run's owner token.

    python examples/dask_scale_out.py --db postgresql+psycopg://user@host/db [--endpoint URL] [--workers N]
    python examples/dask_scale_out.py --sqlite          # explicit single-machine fallback (one SQLite file)

``--db`` defaults to ``SMTHRS_DB_URL``. Without ``--endpoint`` the script starts moto's S3 server on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

for _k, _v in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_ROOT_LEVEL": "CRITICAL",
    # Prefect waits only 20 s for its ephemeral server; a first start on a busy machine needs longer.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
}.items():
    os.environ.setdefault(_k, _v)

import smthrs_plugin as sp  # noqa: E402


def render(ni: sp.NodeInput) -> dict:
    """A node body: some CPU work on its input part, in whatever worker process Dask chose."""
    body = ni.node.draft.material.body
    src = (ni.root / body["src"]).read_bytes()
    digest = src
    for _ in range(body["rounds"]):
        digest = hashlib.sha256(digest).digest()
    out = ni.root / body["dst"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{body['src']} {digest.hex()}\n")
    return {"pid": os.getpid(), "bytes": len(src)}


def merge(ni: sp.NodeInput) -> dict:
    body = ni.node.draft.material.body
    parts = [(ni.root / p).read_text() for p in body["parts"]]
    (ni.root / "out/all.txt").write_text("".join(parts))
    return {"pid": os.getpid(), "parts": len(parts)}


def execute(ni: sp.NodeInput) -> dict:
    return merge(ni) if ni.node.draft.material.body["kind"] == "merge" else render(ni)


def make_plan(parts: int, rounds: int) -> sp.plan.Plan:
    nodes = [
        sp.plan.node(
            f"render-{i}",
            body={"kind": "render", "src": f"in/part-{i}.txt", "dst": f"out/part-{i}.txt", "rounds": rounds},
            reads=[f"in/part-{i}.txt"],
            writes=[f"out/part-{i}.txt"],
        )
        for i in range(parts)
    ]
    outs = [f"out/part-{i}.txt" for i in range(parts)]
    nodes.append(
        sp.plan.node("merge", body={"kind": "merge", "parts": outs}, reads=outs, writes=["out/all.txt"])
    )
    return sp.plan.compile_plan("scale-out", "examples/scale-out", nodes)


def run_twice(
    ws: Path, db: str, artifacts: str, options: dict, workers: int, parts: int, rounds: int
) -> dict:
    from distributed import LocalCluster
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    from smthrs_plugin.hosts.prefect import quiet_flow_settings, share_prefect_api

    share_prefect_api()  # Dask workers report their task runs to this process's Prefect server
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    plan = make_plan(parts, rounds)

    def flow_for(address: str):  # one flow object bound to the running cluster
        @flow(name="smthrs-dask-scale-out", task_runner=DaskTaskRunner(address=address), persist_result=False)
        def scale_out(run_id: str) -> dict:
            with sp.open_runtime(ws, db=db, artifacts=artifacts, artifacts_options=options) as rt:
                report = rt.scheduler(run_id).run(plan, execute)  # Prefect host on the Dask task runner
            return {"outcomes": report.outcomes, "results": dict(report.results)}

        return scale_out

    runs = []
    # One cluster for both flow runs: its worker processes start once and inherit PREFECT_API_URL.
    with LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    ) as cluster:
        scale_out = flow_for(cluster.scheduler_address)
        with quiet_flow_settings():
            for _ in range(2):
                runs.append(scale_out(f"scale-out-{uuid.uuid4().hex[:8]}"))
    return {"flow_pid": os.getpid(), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--db", default=os.environ.get("SMTHRS_DB_URL"), help="PostgreSQL URL (default SMTHRS_DB_URL)"
    )
    ap.add_argument("--sqlite", action="store_true", help="explicitly fall back to one SQLite file")
    ap.add_argument("--endpoint", help="S3 endpoint URL (default: start moto on 127.0.0.1)")
    ap.add_argument("--bucket", default=None)
    ap.add_argument("--workspace", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--parts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=200_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ws = (args.workspace or Path(tempfile.mkdtemp(prefix="smthrs-dask-"))).resolve()
    db = args.db
    if db is None or not db.startswith(("postgresql", "postgres")):
        if not args.sqlite:
            print(
                "dask_scale_out: give a PostgreSQL URL (--db or SMTHRS_DB_URL=postgresql+psycopg://...): several "
                "worker processes share the state; pass --sqlite to use one SQLite file on this machine instead",
                file=sys.stderr,
            )
            return 2
        db = f"sqlite:///{(ws / '.smthrs' / 'state.db').as_posix()}"
    moto = None
    endpoint = args.endpoint
    if endpoint is None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
    options = {
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "endpoint_url": endpoint,
    }
    try:
        import s3fs

        bucket = args.bucket or f"smthrs-dask-{uuid.uuid4().hex[:8]}"
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        (ws / "in").mkdir(parents=True, exist_ok=True)
        for i in range(args.parts):
            (ws / f"in/part-{i}.txt").write_text(f"part {i}\n" * 1000)
        out = run_twice(ws, db, f"s3://{bucket}/cache", options, args.workers, args.parts, args.rounds)
    finally:
        if moto is not None:
            moto.stop()
    first, second = out["runs"]
    worker_pids = sorted({v["pid"] for v in first["results"].values()})
    ok = (
        all(o == "built" for o in first["outcomes"].values())
        and all(o == "clean" for o in second["outcomes"].values())
        and out["flow_pid"] not in worker_pids
        and (ws / "out/all.txt").exists()
    )
    summary = {"ok": ok, "db": db.split("@")[-1], "worker_pids": worker_pids, **out}
    if args.json:
        print(json.dumps(summary))
    else:
        for node_id, o in first["outcomes"].items():
            print(
                f"{node_id:<10} run 1 {o:<6} (pid {first['results'][node_id]['pid']})  run 2 {second['outcomes'][node_id]}"
            )
        print(f"flow process {out['flow_pid']}, node bodies ran in worker processes {worker_pids}; ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
