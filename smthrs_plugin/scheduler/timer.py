"""Timer nodes: a plan node declaring ``wait: {seconds: N}`` or ``wait: {until: <ISO-8601>}`` is a durable clock of
its run (``cool-down``).

Invariants:

- A wait spec has exactly one of ``seconds`` (a finite number >= 0) or ``until`` (ISO-8601 with an offset); a
  malformed one is refused (``PlanError(invalid_plan)``) with the node's other declarations, before anything is
  written (:func:`check_wait_spec`).
- A timer is run-scoped: it is keyed with the run-local key, so an elapsed timer of one run is never served to
  another (a content key would make every later run of the same plan skip its wait), and it is dispatched around
  the cache (:class:`TimerDispatcher`: no effects to measure, nothing to publish). Its attempt row still settles
  through the ordinary job path, so a reopened run replays it ``clean``.
- The first attempt schedules the clock ``node:<id>`` of the current run (fenced on the run's owner); a re-run
  (after a park, a crash or a steal) gets ``Existing`` with the ORIGINAL deadline. Within the run's in-process
  wait budget the node sleeps; beyond it the node raises ``RunParked``: the pass stops (other running nodes
  settle first), the run parks ``timer`` at the stored deadline and the process may exit; whoever drives the run
  next (``smthrs run --run-id``, a worker's clock fire) replays settled nodes ``clean`` and continues.
- The node's value is ``{"due_at_ms": <stored deadline>}``.
- A timer honours its pass's cancel token (``NodeInput.cancel``): once the pass is interrupted (a sibling's typed
  failure, an interrupt of the scheduler) the wait stops within ``poll_s`` of the run's context and the node fails
  :class:`TimerInterrupted`, so the pass never waits out a timer to report its failure. The clock stays scheduled
  (the next drive of the run finds its original deadline).

Prior art: Temporal's durable timers; Argo's suspend-with-duration steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..cache.model import DispatchRequest, DispatchResult, Execute
from ..engine.context import RunContext, current_run
from ..engine.waits.flow_waits import deadline_ms, sleep_to
from ..errors import PlanError, WaitError
from ..records.wait_rows import ClockRecord
from .cancel import CancelToken
from .model import NodeInput

__all__ = [
    "check_wait_spec",
    "is_timer",
    "run_timer",
    "TimerDispatcher",
    "TIMER_DISPATCHER",
    "TimerInterrupted",
    "timer_name",
]


class TimerInterrupted(Exception):
    """A timer node stopped waiting because its scheduler pass was interrupted (the node's failure outcome)."""

    def __init__(self, node_id: str, reason: str | None) -> None:
        super().__init__(f"node {node_id!r}: timer stopped: the scheduler pass was interrupted ({reason})")
        self.node_id = node_id
        self.reason = reason


def is_timer(node: Any) -> bool:
    """Whether a plan node is a timer node (declares ``wait:``)."""
    return getattr(node.draft, "wait", None) is not None


def timer_name(node_id: str) -> str:
    """The clock name of a timer node within its run."""
    return f"node:{node_id}"


def check_wait_spec(node_id: str, spec: Mapping[str, Any]) -> None:
    """Refuse a malformed ``wait:`` spec with ``PlanError(invalid_plan)`` naming the node."""

    def refuse(why: str) -> PlanError:
        return PlanError("invalid_plan", f"node {node_id!r}: wait: {why}", node=node_id, field="wait")

    if not isinstance(spec, Mapping) or set(spec) not in ({"seconds"}, {"until"}):
        raise refuse("declare exactly one of {seconds: N} or {until: <ISO-8601 with offset>}")
    if "seconds" in spec:
        s = spec["seconds"]
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise refuse(f"seconds must be a finite number >= 0, not {s!r}")
        return
    if not isinstance(spec["until"], str):
        raise refuse(f"until must be an ISO-8601 string with an offset, not {spec['until']!r}")
    try:
        deadline_ms(spec["until"])
    except WaitError as exc:
        raise refuse(exc.message) from exc


def run_timer(ni: NodeInput) -> dict[str, int]:
    """The executor of a timer node (see the module invariants); needs the run context its driver activated."""
    spec = ni.node.draft.wait
    assert spec is not None
    check_wait_spec(ni.node.id, spec)
    ctx = current_run()
    if "until" in spec:
        due = deadline_ms(spec["until"])
    else:
        due = ctx.clock.now_ms() + math.ceil(
            float(spec["seconds"]) * 1000
        )  # first attempt only: re-runs keep theirs
    record = _sleep_to(ctx, ni.node.id, due, ni.cancel)
    return {"due_at_ms": record.due_at_ms}


def _sleep_to(ctx: RunContext, node_id: str, due_at_ms: int, cancel: CancelToken) -> ClockRecord:
    """``flow_waits.sleep_to`` on the node's clock, ended by ``TimerInterrupted`` when the pass is cancelled."""

    def stop() -> None:
        if cancel.cancelled:
            raise TimerInterrupted(node_id, cancel.reason)

    return sleep_to(ctx, timer_name(node_id), due_at_ms, stop)


class TimerDispatcher:
    """The dispatch seam for timer nodes: runs the executor directly (no sandbox, no cache consult, nothing
    published). An ``Exception`` is the node's failure; control flow (``RunParked``...) propagates."""

    def dispatch(self, request: DispatchRequest, execute: Execute) -> DispatchResult:
        try:
            value = execute(request.workspace)
        except (
            Exception
        ) as exc:  # the timer's own failure (e.g. no run context) is an outcome, not an exception
            return DispatchResult(outcome="failed", key=request.key, decision=None, error=exc)
        return DispatchResult(outcome="built", key=request.key, decision=None, value=value)


#: Stateless: one instance serves every timer node.
TIMER_DISPATCHER = TimerDispatcher()
