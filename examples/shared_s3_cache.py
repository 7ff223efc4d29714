"""Two "machines", one ``s3://`` cache: machine A builds, machine B (another process, a fresh workspace, its own
database) gets only verified ``clean`` hits from the shared tier, and its output files appear, byte for byte.

Without ``--endpoint`` the script starts moto's S3 server on 127.0.0.1 (a correctness fake of S3; point it at a
real bucket with ``--endpoint``/credentials in the environment and ``--bucket``). Prefect: machine B reuses
machine A's Prefect server (``PREFECT_API_URL``, or A's ephemeral server).

    python examples/shared_s3_cache.py [--endpoint URL] [--bucket NAME] [--workdir DIR] [--json]

Exit code 0 when B was all clean from the shared tier and every output matched A's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
}.items():
    os.environ.setdefault(_k, _v)

from prefect import flow  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.prefect.host import quiet_flow_settings, share_prefect_api  # noqa: E402

OUTPUTS = ["out/words.json", "out/top.json", "out/report.txt"]

# ----------------------------------------------------------------------------------------------- the steps


@sp.step(reads=["corpus/a.txt", "corpus/b.txt"], writes=["out/words.json"])
def count_words(ws: sp.Workspace) -> dict:
    counts: dict[str, int] = {}
    for name in ("a.txt", "b.txt"):
        for word in (ws / "corpus" / name).read_text().lower().split():
            w = word.strip(".,;:!?\"'()")
            if w:
                counts[w] = counts.get(w, 0) + 1
    (ws / "out").mkdir(exist_ok=True)
    (ws / "out/words.json").write_text(json.dumps(counts, sort_keys=True))
    return {"distinct": len(counts)}


@sp.step(reads=["out/words.json"], writes=["out/top.json"])
def top_words(ws: sp.Workspace, n: int) -> list:
    counts = json.loads((ws / "out/words.json").read_text())
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    (ws / "out/top.json").write_text(json.dumps(top))
    return [w for w, _ in top]


@sp.step(reads=["out/top.json"], writes=["out/report.txt"])
def report(ws: sp.Workspace, title: str) -> int:
    top = json.loads((ws / "out/top.json").read_text())
    text = title + "\n" + "\n".join(f"{c:>5}  {w}" for w, c in top) + "\n"
    (ws / "out/report.txt").write_text(text)
    return len(text)


@flow(name="smthrs-shared-cache", persist_result=False)
def pipeline() -> list:
    count_words()
    top_words(5)
    report("Top words")
    from prefect.runtime import flow_run

    return [str(flow_run.id)]


def seed_corpus(ws: Path) -> None:
    (ws / "corpus").mkdir(parents=True, exist_ok=True)
    (ws / "corpus/a.txt").write_text("The cache serves what the bytes say. Bytes, not names, decide.\n" * 50)
    (ws / "corpus/b.txt").write_text(
        "One machine builds; every other machine gets verified clean hits.\n" * 50
    )


# ------------------------------------------------------------------------------------------------ machines


def run_machine(ws: Path, artifacts: str, options: dict) -> dict:
    """Run the pipeline once in workspace ``ws`` (own SQLite) against the shared ``artifacts`` URL."""
    db = f"sqlite:///{(ws / '.smthrs' / 'state.db').as_posix()}"
    with (
        sp.step_settings(workspace=ws, db=db, artifacts=artifacts, artifacts_options=options),
        quiet_flow_settings(),
    ):
        flow_run_id = pipeline()[0]
        with sp.open_runtime(ws, db=db, artifacts=artifacts, artifacts_options=options) as rt:
            records = [
                e.payload for e in rt.journal.read(f"prefect-{flow_run_id}") if e.type == "step-settled"
            ]
    return {
        "workspace": str(ws),
        "steps": [
            {"step": r["node"], "outcome": r["outcome"], "decision": r["decision"], "tier": r.get("tier")}
            for r in records
        ],
        "files": {name: (ws / name).read_bytes().hex() for name in OUTPUTS if (ws / name).exists()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", help="S3 endpoint URL (default: start moto on 127.0.0.1)")
    ap.add_argument("--bucket", default=None, help="bucket name (default: a fresh one)")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where the two workspaces live (default: a temp dir)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--machine", choices=["B"], help=argparse.SUPPRESS)  # internal: run machine B only
    ap.add_argument("--artifacts", help=argparse.SUPPRESS)
    ap.add_argument("--workspace", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    options = {
        "key": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
    }

    if args.machine == "B":  # the second process: a fresh workspace, nothing but the source files
        options["endpoint_url"] = args.endpoint
        print(json.dumps(run_machine(args.workspace, args.artifacts, options)))
        return 0

    moto = None
    endpoint = args.endpoint
    if endpoint is None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
    options["endpoint_url"] = endpoint
    bucket = args.bucket or f"smthrs-shared-{uuid.uuid4().hex[:8]}"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="smthrs-shared-"))
    try:
        import s3fs

        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            **{k: v for k, v in options.items() if k != "endpoint_url"},
            endpoint_url=endpoint,
        )
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        artifacts = f"s3://{bucket}/cache"
        # Publisher trust (docs/tutorials/data-teams.md, "Trusting a shared cache"): both machines sign with, and so trust, one team key;
        # machine B inherits the variable. Without it each workspace trusts only its own key and B would rebuild.
        from smthrs_plugin.cache import workspace_key

        os.environ["SMTHRS_CACHE_SIGNING_KEY"] = str(workspace_key(work / "team").path)
        ws_a, ws_b = work / "machine-a", work / "machine-b"
        for ws in (ws_a, ws_b):
            shutil.rmtree(ws, ignore_errors=True)
            seed_corpus(ws)
        a = run_machine(ws_a, artifacts, options)
        share_prefect_api()  # machine B reports to machine A's Prefect server instead of starting another one
        env = dict(os.environ)
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--machine",
                "B",
                "--endpoint",
                endpoint,
                "--artifacts",
                artifacts,
                "--workspace",
                str(ws_b),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        b = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        if moto is not None:
            moto.stop()
    ok = (
        all(s["outcome"] == "built" for s in a["steps"])
        and all(s["outcome"] == "clean" and s["tier"] == "shared" for s in b["steps"])
        and len(b["steps"]) == len(a["steps"]) == 3
        and b["files"] == a["files"]
        and len(a["files"]) == len(OUTPUTS)
    )
    summary = {"ok": ok, "artifacts": artifacts, "machine_a": a, "machine_b": b}
    if args.json:
        print(json.dumps(summary))
    else:
        for label, m in (("A", a), ("B", b)):
            for s in m["steps"]:
                print(
                    f"machine {label}  {s['step']:<12} {s['outcome']:<6} {s['decision']:<12} {s['tier'] or ''}"
                )
        same = "byte-identical" if b["files"] == a["files"] else "DIFFERENT"
        print(f"{len(b['files'])} output files on machine B, {same} to machine A's; shared cache {artifacts}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
