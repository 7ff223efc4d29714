"""Scale out to workers that share only S3 (and, optionally, PostgreSQL) with the coordinator: the same plan on
a Dask cluster of worker processes that CANNOT SEE THE WORKSPACE. Run 1 builds every node on the workers; run 2
is all ``clean``; the outputs appear in the coordinator's workspace byte for byte.

This is the two-machine setup on one machine. The script starts a Dask scheduler and worker processes (not a
``LocalCluster`` inside this process) and, when run as root, gives the workers their own mount namespace with an
empty tmpfs over the workspace path (``--hide-workspace``, default on when possible). The flow's
``DaskTaskRunner(address=...)`` is not in this process and the workspace is not known to be shared, so smthrs
runs every node REMOTELY: the coordinator keys the node, uploads the declared reads to the artifact store (S3),
a worker hydrates a private tree from S3 alone (verified by digest), runs the body and uploads what it changed;
the coordinator copies the outputs back into the workspace and journals the settlement (its own database: no
worker ever connects to it).

    python examples/dask_scale_out.py --db postgresql+psycopg://user@host/db [--endpoint URL] [--workers N]
    python examples/dask_scale_out.py --sqlite          # the coordinator's state in one SQLite file

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hidden_cluster import can_hide, hidden_cluster  # noqa: E402


def _sees_workspace() -> bool:
    """Whether this process can see the workspace's inputs (the script tells its workers the path in the
    environment, only to prove they cannot use it: no node is ever given it)."""
    ws = os.environ.get("SMTHRS_EXAMPLE_WORKSPACE")
    return bool(ws) and os.path.exists(os.path.join(ws, "in"))


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
    return {"pid": os.getpid(), "bytes": len(src), "sees_workspace": _sees_workspace()}


def merge(ni: sp.NodeInput) -> dict:
    body = ni.node.draft.material.body
    parts = [(ni.root / p).read_text() for p in body["parts"]]
    (ni.root / "out/all.txt").write_text("".join(parts))
    return {"pid": os.getpid(), "parts": len(parts), "sees_workspace": _sees_workspace()}


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
    ws: Path,
    db: str,
    artifacts: str,
    options: dict,
    workers: int,
    parts: int,
    rounds: int,
    hide: bool,
) -> dict:
    from prefect import flow
    from prefect_dask import DaskTaskRunner

    from smthrs_plugin.prefect.host import quiet_flow_settings, share_prefect_api

    api = share_prefect_api()  # the workers report their task runs to this process's Prefect server
    plan = make_plan(parts, rounds)
    worker_env = {"PREFECT_API_URL": api, "SMTHRS_EXAMPLE_WORKSPACE": str(ws)}
    runs = []
    with hidden_cluster([ws], workers, hide=hide, env=worker_env) as address:

        @flow(name="smthrs-dask-scale-out", task_runner=DaskTaskRunner(address=address), persist_result=False)
        def scale_out(run_id: str) -> dict:
            with sp.open_runtime(ws, db=db, artifacts=artifacts, artifacts_options=options) as rt:
                report = rt.scheduler(run_id).run(plan, execute)  # remote: the runner is not in this process
            return {"outcomes": report.outcomes, "results": dict(report.results)}

        with quiet_flow_settings():
            for _ in range(2):
                runs.append(scale_out(f"scale-out-{uuid.uuid4().hex[:8]}"))
    return {"flow_pid": os.getpid(), "runs": runs, "workspace_hidden": hide}


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
    ap.add_argument(
        "--hide-workspace",
        choices=["auto", "yes", "no"],
        default="auto",
        help="give the workers an empty tmpfs over the workspace path (needs root; auto: when possible)",
    )
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
        hide = can_hide() if args.hide_workspace == "auto" else args.hide_workspace == "yes"
        if not hide:
            print(
                "dask_scale_out: the workers can see this machine's filesystem (run as root to hide the workspace"
                " from them); they are still never given the workspace path",
                file=sys.stderr,
            )
        out = run_twice(
            ws, db, f"s3://{bucket}/cache", options, args.workers, args.parts, args.rounds, hide
        )
    finally:
        if moto is not None:
            moto.stop()
    first, second = out["runs"]
    worker_pids = sorted({v["pid"] for v in first["results"].values()})
    ok = (
        not any(r.get("sees_workspace") for r in first["results"].values()) or not out["workspace_hidden"]
    ) and (
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
        hidden = "could not see" if out["workspace_hidden"] else "could see (not hidden)"
        print(
            f"flow process {out['flow_pid']}, node bodies ran in worker processes {worker_pids}, which {hidden} "
            f"the workspace; outputs in {ws / 'out'}; ok={ok}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
