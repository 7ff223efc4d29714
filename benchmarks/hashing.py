"""Read-set hashing: our measurement vs raw hashlib, and stat-cached re-measurement vs re-hashing.

Run: ``python benchmarks/hashing.py [--size 1G] [--files 1024]``. Prints side-by-side ratios from one run.

1. Throughput: ``Measurer.measure_paths`` (parallel SHA-256, no stat cache) over 16 equal files vs a plain
   sequential ``hashlib.sha256`` loop over the same (page-cached) bytes. Goal: >= 0.85x.
2. Re-measurement of an unchanged tree (``--files`` files totalling ``--size``) with the persisted stat cache
   (a fresh ``Measurer``, as a new process would start) vs hashing it again. Goal: >= 50x faster.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _goals import goal_line  # noqa: E402

from smthrs_plugin.boundary.measure import DEFAULT_RACY_WINDOW_NS, Measurer  # noqa: E402

CHUNK = 1 << 20


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def fill(root: Path, rel_prefix: str, count: int, size: int) -> list[str]:
    block = os.urandom(min(size, 4 * CHUNK))
    rels = []
    for i in range(count):
        rel = f"{rel_prefix}/{i // 256:03d}/f{i:05d}.bin"
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            left = size
            while left > 0:
                n = min(left, len(block))
                # vary the content per file so that nothing dedupes by accident
                f.write(i.to_bytes(8, "little") + block[8:n] if n >= 8 else block[:n])
                left -= n
        rels.append(rel)
    return rels


def raw_hashlib(root: Path, rels: list[str]) -> float:
    t = time.perf_counter()
    for rel in rels:
        h = hashlib.sha256()
        with open(root / rel, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        h.hexdigest()
    return time.perf_counter() - t


def ours(root: Path, rels: list[str], **kw: object) -> float:
    m = Measurer(root, **kw)  # type: ignore[arg-type]
    t = time.perf_counter()
    m.measure_paths(rels)
    elapsed = time.perf_counter() - t
    m.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--size", default="1G", help="bytes per part (default 1G: 16 x 64 MiB, then a 1 GiB tree)"
    )
    ap.add_argument("--files", type=int, default=1024, help="files in the re-measurement tree (default 1024)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir on the main disk)")
    args = ap.parse_args()
    total = parse_size(args.size)
    base = Path(tempfile.mkdtemp(prefix="smthrs-bench-hash-", dir=args.dir or "/var/tmp"))
    try:
        # -- 1. throughput ---------------------------------------------------------------------------------
        per = total // 16
        rels = fill(base, "wide", 16, per)
        raw_hashlib(base, rels)  # warm the page cache: both sides hash cached bytes
        raw = min(raw_hashlib(base, rels) for _ in range(2))
        mine = min(ours(base, rels, stat_cache=None) for _ in range(2))
        gb = total / 1e9
        print(
            f"1. read-set measurement, 16 files x {per / 2**20:.0f} MiB ({gb:.2f} GB), {os.cpu_count()} cores"
        )
        print(f"   raw hashlib.sha256 (sequential): {raw:7.3f} s  {gb / raw:6.2f} GB/s")
        print(f"   Measurer (parallel, no cache):   {mine:7.3f} s  {gb / mine:6.2f} GB/s")
        print(f"   ratio ours/raw throughput: {raw / mine:.2f}x  (goal >= 0.85x)")
        shutil.rmtree(base / "wide")

        # -- 2. stat-cached re-measurement -----------------------------------------------------------------
        tree = fill(base, "tree", args.files, max(1, total // args.files))
        # Freshly written files are racily clean for DEFAULT_RACY_WINDOW_NS; a real tree is older than that.
        time.sleep(DEFAULT_RACY_WINDOW_NS / 1e9 + 0.2)
        ours(base, tree)  # populate and persist .smthrs/statcache.json
        rehash = min(ours(base, tree, stat_cache=None) for _ in range(2))
        cached = min(ours(base, tree) for _ in range(3))  # fresh Measurer: loads the cache file each time
        print(f"2. re-measurement of an unchanged tree, {args.files} files, {gb:.2f} GB")
        print(f"   re-hash everything:        {rehash:8.4f} s")
        print(f"   stat cache (fresh process): {cached:8.4f} s")
        print(f"   ratio re-hash/stat-cache: {rehash / cached:.0f}x  (goal >= 50x)")
        print()
        print(
            goal_line(
                "read-set measurement vs raw sha256",
                f"{raw / mine:.2f}x throughput",
                ">= 0.85x",
                raw / mine >= 0.85,
                f"{mine:.3f} vs {raw:.3f} s for {gb:.2f} GB, {os.cpu_count()} cores",
            )
        )
        print(
            goal_line(
                "stat-cached re-measurement",
                f"{rehash / cached:.0f}x faster than re-hashing",
                ">= 50x",
                rehash / cached >= 50,
                f"{cached:.4f} vs {rehash:.4f} s, {args.files} files",
            )
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
