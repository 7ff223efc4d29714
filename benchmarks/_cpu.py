"""CPU per process for the benchmarks: a helper module, not a benchmark (``make bench`` runs no ``_*.py``)."""

from __future__ import annotations


def cpu_by_process() -> dict[str, float]:
    """CPU seconds so far of this process (the coordinator) and of its live children: moto's S3 server, Prefect's
    server, the Dask scheduler, the Dask workers (nannies and worker processes)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    out = {
        "coordinator": t.user + t.system,
        "moto": 0.0,
        "prefect server": 0.0,
        "dask scheduler": 0.0,
        "workers": 0.0,
    }
    for child in me.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            ct = child.cpu_times()
        except psutil.Error:
            continue
        group = "prefect server" if "prefect" in cmd and "server" in cmd else "workers"
        group = "dask scheduler" if "dask_scheduler" in cmd else group
        group = "moto" if "moto.server" in cmd else group
        out[group] += ct.user + ct.system
    return out
