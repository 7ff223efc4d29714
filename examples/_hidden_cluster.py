"""A Dask cluster whose workers cannot see the coordinator's workspace: the two-machine setup on one machine.

A ``dask scheduler`` and ``dask worker`` processes are started as real processes (not a ``LocalCluster`` inside
this process). With ``hide=True`` the workers run in a mount namespace of their own (``unshare --mount``, root
only) where an empty tmpfs covers every hidden path: the workspace's path exists there but is empty, so a worker
that tried to read an input or write an output in the workspace would fail or write into nothing. Used by
``dask_scale_out.py``, the remote-execution tests and ``benchmarks/remote.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["can_hide", "hidden_cluster"]


def can_hide() -> bool:
    """Whether this process may give workers their own mount namespace (root, with ``unshare`` installed)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("unshare") is not None


@contextmanager
def hidden_cluster(
    hidden: Sequence[str | os.PathLike[str]],
    workers: int,
    *,
    hide: bool = True,
    env: Mapping[str, str] | None = None,
    threads: int = 1,
    startup_s: float = 300.0,
) -> Iterator[str]:
    """Start a scheduler and ``workers`` single-threaded worker processes; yield the scheduler's address. With
    ``hide`` every path in ``hidden`` is an empty tmpfs in the workers' view. ``env`` is added to the workers'
    environment (``PREFECT_API_URL``, so their task runs report to this process's Prefect server)."""
    if hide and not can_hide():
        raise RuntimeError("hiding the workspace from workers needs root and `unshare` (util-linux)")
    work = Path(tempfile.mkdtemp(prefix="smthrs-cluster-"))
    child_env = {**os.environ, **(env or {})}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(work / "scheduler.log", "wb") as slog, open(work / "workers.log", "wb") as wlog:
            try:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1"]
                        + ["--port", "0", "--no-dashboard", "--scheduler-file", str(work / "scheduler.json")],
                        stdout=slog,
                        stderr=subprocess.STDOUT,
                        env=child_env,
                        cwd=work,
                    )
                )
                deadline = time.monotonic() + startup_s
                address = _read_address(work / "scheduler.json", procs[0], deadline, work)
                worker = [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    address,
                    "--nworkers",
                    str(workers),
                ]
                worker += [
                    "--nthreads",
                    str(threads),
                    "--no-dashboard",
                    "--local-directory",
                    str(work / "workers"),
                ]
                if hide:
                    mounts = " && ".join(
                        f"mount -t tmpfs -o size=1m,mode=0555 none {shlex.quote(str(p))}" for p in hidden
                    )
                    inner = f"{mounts} && exec {shlex.join(worker)}"
                    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner]
                else:
                    cmd = worker
                procs.append(
                    subprocess.Popen(cmd, stdout=wlog, stderr=subprocess.STDOUT, env=child_env, cwd=work)
                )
                _wait_for_workers(address, workers, procs[1], deadline, work)
                yield address
            finally:
                for p in reversed(procs):
                    p.terminate()
                for p in reversed(procs):
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _read_address(path: Path, proc: subprocess.Popen[bytes], deadline: float, work: Path) -> str:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the dask scheduler exited: {(work / 'scheduler.log').read_text()[-2000:]}")
        try:
            return str(json.loads(path.read_text())["address"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.1)
    raise RuntimeError("the dask scheduler did not write its address in time")


def _wait_for_workers(
    address: str, n: int, proc: subprocess.Popen[bytes], deadline: float, work: Path
) -> None:
    from distributed import Client

    with Client(address, timeout=max(1.0, deadline - time.monotonic())) as client:
        while len(client.scheduler_info()["workers"]) < n:
            if proc.poll() is not None:
                raise RuntimeError(f"the dask workers exited: {(work / 'workers.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {len(client.scheduler_info()['workers'])} of {n} dask workers started"
                )
            time.sleep(0.1)
