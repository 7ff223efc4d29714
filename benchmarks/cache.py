"""Hit latency of the cache dispatch seam for a small step: local tier vs the shared tier on file:// and s3 (moto).

Run: ``python benchmarks/cache.py [--hits 200] [--shared-hits 60]``. Starts moto's S3 server on 127.0.0.1 itself.

Three kinds of hit, each for the same small step (one 4 KiB declared read, one 4 KiB output, a JSON value):

- ``local``: the entry is in the SQL local tier and the output is already in the workspace (the common re-run):
  lookup (one SELECT) → verify (re-admit + re-measure the read set through the stat cache) → replay (outputs
  present: measured, not rewritten).
- ``local+replay``: the same, but the output was deleted first, so it is replayed from the entry.
- ``shared file://`` / ``shared s3``: the local row is dropped before each hit (a machine that never ran the
  step): local miss → shared GET → verify → replay → record the row locally.

``key`` is the caller's share: measuring the declared reads and computing ``plan.keys.dispatch_key``. Figures are
per-hit milliseconds (median, and mean) measured in this one run; ``miss`` is the built dispatch (sandbox +
settle + publish) for scale. Not a test: nothing is asserted.

Publisher trust (every "machine" signs with and trusts one team key): the last block prints what
signing adds to a hit, measured side by side in this run — on a shared hit, judging the signed document
(decode + RFC 8785 bytes + Ed25519 verify) vs the unsigned path (decode only), and the fresh listing of revocation
markers a shared lookup makes; on a warm LOCAL hit, the revocation snapshot check (no round trip). Goal: ≤ 0.1 ms
added on a warm hit.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

for _k, _v in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ.setdefault(_k, _v)

import sqlalchemy as sa  # noqa: E402

import smthrs_plugin as sp  # noqa: E402
from smthrs_plugin.boundary import Measurer  # noqa: E402
from smthrs_plugin.cache import CacheDispatcher  # noqa: E402
from smthrs_plugin.cache.entry import decode_entry  # noqa: E402
from smthrs_plugin.cache.requests import node_request  # noqa: E402
from smthrs_plugin.cache.shared import check_document  # noqa: E402
from smthrs_plugin.cache.signing import Trust, workspace_key  # noqa: E402
from smthrs_plugin.stores.artifacts import ArtifactStore  # noqa: E402
from smthrs_plugin.stores.database import open_database  # noqa: E402
from smthrs_plugin.stores.schema import step_cache  # noqa: E402

INPUT = os.urandom(4096)  # the same bytes on every "machine": one key
PHASES = ("key", "lookup", "verify", "replay", "record", "total")


def body(root: Path) -> dict[str, Any]:
    data = (root / "in.txt").read_bytes()
    (root / "out.txt").write_bytes(data[::-1])
    return {"bytes": len(data)}


DRAFT = sp.plan.node("reverse", body={"cmd": "reverse"}, reads=["in.txt"], writes=["out.txt"])


class Bench:
    def __init__(
        self, base: Path, name: str, shared: ArtifactStore, *, one_store: bool, trust: Trust
    ) -> None:
        self.root = base / name
        self.ws = self.root / "ws"
        self.ws.mkdir(parents=True)
        (self.ws / "in.txt").write_bytes(INPUT)
        self.db = open_database(f"sqlite:///{(self.root / 'state.db').as_posix()}")
        self.artifacts = shared if one_store else ArtifactStore((self.root / "blobs").as_uri())
        self.measurer = Measurer(self.ws)
        self.dispatcher = CacheDispatcher(
            self.db, self.artifacts, self.ws, shared=shared, measurer=self.measurer, trust=trust
        )

    def one(self, *, drop_row: bool = False, drop_output: bool = False) -> dict[str, float]:
        if drop_row:
            self.db.write(lambda c: c.execute(sa.delete(step_cache)))
        if drop_output:
            (self.ws / "out.txt").unlink(missing_ok=True)
        t0 = time.perf_counter()
        req = node_request(DRAFT, run_id="bench", workspace=self.ws, measurer=self.measurer)
        t1 = time.perf_counter()
        res = self.dispatcher.dispatch(req, body)
        t2 = time.perf_counter()
        out = {k: float(v) for k, v in res.timings.items()}
        out["key"] = (t1 - t0) * 1000
        out["total"] = (t2 - t0) * 1000
        out["_clean"] = 1.0 if res.outcome == "clean" else 0.0
        return out


def run(bench: Bench, n: int, **kw: bool) -> dict[str, tuple[float, float]]:
    for _ in range(3):  # warm up: engines, fs handles, stat cache
        bench.one(**kw)
    samples = [bench.one(**kw) for _ in range(n)]
    if not all(s["_clean"] for s in samples):
        raise SystemExit("a hit was not served clean: the benchmark setup is wrong")
    return {
        p: (
            statistics.median(s.get(p, 0.0) for s in samples),
            statistics.fmean(s.get(p, 0.0) for s in samples),
        )
        for p in PHASES
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hits", type=int, default=200, help="local hits per row (default 200)")
    ap.add_argument("--shared-hits", type=int, default=60, help="shared-tier hits per row (default 60)")
    args = ap.parse_args()

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
    base = Path(tempfile.mkdtemp(prefix="smthrs-bench-cache-"))
    try:
        import s3fs

        bucket = "bench-" + uuid.uuid4().hex[:8]
        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(bucket)
        file_shared = ArtifactStore((base / "shared").as_uri())
        s3_shared = ArtifactStore(f"s3://{bucket}/cache", options)

        team = Trust(workspace_key(base / "team"), (), "configured")
        rows: list[tuple[str, dict[str, tuple[float, float]]]] = []
        local = Bench(base, "local", file_shared, one_store=True, trust=team)
        t = time.perf_counter()
        local.one()
        miss_ms = (time.perf_counter() - t) * 1000
        rows.append(("local", run(local, args.hits)))
        rows.append(("local+replay", run(local, args.hits, drop_output=True)))
        shared_file = Bench(base, "file", file_shared, one_store=False, trust=team)
        rows.append(("shared file://", run(shared_file, args.shared_hits, drop_row=True, drop_output=True)))
        s3 = Bench(base, "s3", s3_shared, one_store=False, trust=team)
        t = time.perf_counter()
        s3.one()
        s3_miss_ms = (time.perf_counter() - t) * 1000
        rows.append(("shared s3 (moto)", run(s3, args.shared_hits, drop_row=True, drop_output=True)))

        print(
            f"cache hit latency per hit, ms (median / mean); miss for scale: local {miss_ms:.1f}, s3 {s3_miss_ms:.1f}"
        )
        print(f"{'hit':18}" + "".join(f"{p:>16}" for p in PHASES))
        for name, stats in rows:
            print(f"{name:18}" + "".join(f"{stats[p][0]:>8.2f} /{stats[p][1]:>6.2f}" for p in PHASES))
        base_total = rows[0][1]["total"][0]
        print(
            "ratios of median totals vs the warm local hit: "
            + ", ".join(f"{n} {s['total'][0] / base_total:.1f}x" for n, s in rows[1:])
        )
        signing_figures(rows, local, shared_file, s3, args.hits)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def _per_call_us(fn: Any, n: int) -> float:
    """Median of ``n`` timed calls, in microseconds (after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


def signing_figures(
    rows: list[tuple[str, dict[str, tuple[float, float]]]], local: Bench, file: Bench, s3: Bench, n: int
) -> None:
    """Signature verification cost on a hit vs the unsigned path, local and S3, as ratios of this run's hits."""
    totals = {name: stats["total"][0] for name, stats in rows}
    key = node_request(DRAFT, run_id="bench", workspace=local.ws, measurer=local.measurer).key
    hit = local.dispatcher.local.lookup(key)
    entry = getattr(hit, "entry", None)
    if entry is None:
        raise SystemExit("no local entry to measure: the benchmark setup is wrong")
    revocations = local.dispatcher.shared.revocations
    local_check = _per_call_us(lambda: revocations.revoking(entry, fresh=False), n)
    print(
        "publisher trust (signed entries), added cost per hit, µs (median); ratio = share of that hit's median"
    )
    print(
        f"  warm local hit: revocation snapshot check {local_check:8.1f} µs"
        f"  ({local_check / 1000 / totals['local'] * 100:.2f}% of {totals['local']:.2f} ms; no round trip)"
    )
    for label, bench, row in (("file://", file, "shared file://"), ("s3 (moto)", s3, "shared s3 (moto)")):
        tier = bench.dispatcher.shared
        signer = bench.dispatcher.trust.signer
        assert signer is not None
        name = f"{entry.name}.{signer.key_id}"
        data = tier.store.get_entry(name)
        if data is None:
            raise SystemExit(f"no shared entry {name}: the benchmark setup is wrong")
        unsigned = _per_call_us(lambda d=data: decode_entry(d, name=entry.name), n)
        signed = _per_call_us(lambda d=data, t=tier, nm=name: check_document(nm, d, t.trust), n)
        listing = _per_call_us(tier.revocations.refresh, max(10, n // 10))
        added = signed - unsigned
        print(
            f"  shared {label:9}: verify {signed:8.1f} vs unsigned decode {unsigned:8.1f} → +{added:6.1f} µs"
            f" ({added / 1000 / totals[row] * 100:.2f}% of the {totals[row]:.2f} ms hit);"
            f" revocation listing per lookup {listing / 1000:.2f} ms ({listing / 1000 / totals[row] * 100:.1f}%)"
        )


if __name__ == "__main__":
    main()
