"""The local host: node executions on a thread pool in this process.

``LocalHost`` is the hosts-layer name of :class:`smthrs_plugin.scheduler.host.ThreadHost` (the implementation
lives beside the host protocol so that the composition root, which sits below ``hosts`` in the layering, can
default to it). Use it directly, or let ``rt.scheduler(...)`` create one. Submitting returns a
``concurrent.futures.Future``; ``close()`` waits for running executions.
"""

from __future__ import annotations

from ..scheduler.host import Host, InlineHost, ThreadHost

__all__ = ["LocalHost", "InlineHost", "Host"]


class LocalHost(ThreadHost):
    """A thread pool of ``max_workers`` threads (default: ``min(32, cpu_count + 4)``)."""

    def __init__(self, max_workers: int | None = None) -> None:
        super().__init__(max_workers, thread_name_prefix="smthrs-local")

    def __repr__(self) -> str:
        return f"LocalHost(max_workers={self.max_workers})"
