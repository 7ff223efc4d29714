"""The metrics port: the closed outcome vocabularies, the exit classifier, and the no-op sink core code defaults to.

Why this lives on floor 0 and not in ``observe/``: the code that *decides* outcomes — the run driver (engine), the
dispatch seam and the sandbox (cache, boundary), the plan scheduler — sits below ``observe`` and may not import
it. Those layers take a :class:`MetricsPort` collaborator in their constructor and default it to
:data:`NULL_METRICS`, so they can always call ``metrics.cache_decision("Miss")`` without a check. The
OpenTelemetry-backed implementation (``smthrs_plugin.observe.metrics.Metrics``) is injected by the composition
root. Prior art: the reference's ``EngineStoreMetrics`` (``@smthrs/engine-store``).

Invariants
- Every vocabulary is closed. A tag outside it is a programming error and raises ``ValueError`` at once, in the
  no-op sink too: a typo in core code surfaces in the first test that uses the default, never in production.
- Outcome tags become attribute values in snake case (``HeartbeatFresh`` → ``heartbeat_fresh``); the table is
  precomputed, so recording never runs a regular expression.
- :func:`exit_tag` says ``Interrupt`` only when *every* cause is an interruption (a caller's cancellation, a
  ``KeyboardInterrupt``, or the fencing self-interruption ``FenceLost``) — the reference's ``Cause.hasInterruptsOnly``.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from .errors import FenceLost

__all__ = [
    "ExitTag",
    "NodeOutcome",
    "BoundarySettlement",
    "CacheDecision",
    "ClaimDecision",
    "EXIT_TAGS",
    "NODE_OUTCOMES",
    "BOUNDARY_SETTLEMENTS",
    "CACHE_DECISIONS",
    "CLAIM_DECISIONS",
    "DEFAULT_INTERRUPTS",
    "attribute_value",
    "outcome_attributes",
    "check_tag",
    "exit_tag",
    "classify_exit",
    "Observer",
    "MetricsPort",
    "NullMetrics",
    "NULL_METRICS",
]

ExitTag = Literal["Success", "Failure", "Interrupt"]
NodeOutcome = Literal["built", "clean", "failed", "skipped", "deferred"]
BoundarySettlement = Literal["Clean", "Deviation", "Violation", "Refused"]
CacheDecision = Literal[
    "VerifiedHit", "Miss", "UnverifiableEvidence", "Unmeasurable", "StaleReadSet", "ReplayFailed"
]
ClaimDecision = Literal[
    "Activated", "Terminal", "HeartbeatFresh", "StealRefusedOwnerAlive", "ClaimLost", "ActivationLost"
]

EXIT_TAGS: tuple[ExitTag, ...] = ("Success", "Failure", "Interrupt")
NODE_OUTCOMES: tuple[NodeOutcome, ...] = ("built", "clean", "failed", "skipped", "deferred")
BOUNDARY_SETTLEMENTS: tuple[BoundarySettlement, ...] = ("Clean", "Deviation", "Violation", "Refused")
CACHE_DECISIONS: tuple[CacheDecision, ...] = (
    "VerifiedHit",
    "Miss",
    "UnverifiableEvidence",
    "Unmeasurable",
    "StaleReadSet",
    "ReplayFailed",
)
CLAIM_DECISIONS: tuple[ClaimDecision, ...] = (
    "Activated",
    "Terminal",
    "HeartbeatFresh",
    "StealRefusedOwnerAlive",
    "ClaimLost",
    "ActivationLost",
)

# Interruptions, not failures: the user's Ctrl-C, a process told to exit, the fencing self-interruption (another
# owner holds the run, or a cancellation was requested), and the two stdlib cancellation types a host's futures or
# Prefect's anyio runtime raise when a caller cancels the work.
DEFAULT_INTERRUPTS: tuple[type[BaseException], ...] = (
    KeyboardInterrupt,
    SystemExit,
    FenceLost,
    concurrent.futures.CancelledError,
    asyncio.CancelledError,
)

_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def attribute_value(tag: str) -> str:
    """The snake-case attribute value of an outcome tag: ``"StealRefusedOwnerAlive"`` → ``"steal_refused_owner_alive"``."""
    return _CAMEL_BOUNDARY.sub("_", tag).lower()


def outcome_attributes(tags: tuple[str, ...]) -> Mapping[str, Mapping[str, str]]:
    """``{tag: {"outcome": attribute_value(tag)}}`` as read-only mappings, built once per vocabulary.

    Read-only because the same mapping is handed to the OpenTelemetry SDK (which keeps it as the point's
    attributes) and to every listener: a listener mutating it would corrupt the exported series."""
    return MappingProxyType({t: MappingProxyType({"outcome": attribute_value(t)}) for t in tags})


def check_tag(vocabulary: str, tag: object, allowed: Mapping[str, object]) -> None:
    """Refuse a tag outside a closed vocabulary (a programming error in the caller, never user input)."""
    if not isinstance(tag, str) or tag not in allowed:
        raise ValueError(f"unknown {vocabulary} tag {tag!r}; the closed vocabulary is {list(allowed)}")


# Exception groups exist from Python 3.11; looked up by name so 3.10 still imports this module.
_GROUP: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)
_GROUPS: tuple[type[BaseException], ...] = (_GROUP,) if _GROUP is not None else ()


def _leaves(exc: BaseException) -> list[BaseException]:
    if _GROUPS and isinstance(exc, _GROUPS):
        out: list[BaseException] = []
        for inner in exc.exceptions:  # type: ignore[attr-defined]
            out.extend(_leaves(inner))
        return out
    return [exc]


def classify_exit(exc: BaseException | None, interrupts: tuple[type[BaseException], ...]) -> ExitTag:
    """:func:`exit_tag` against a complete, precomputed tuple of interrupt types (the hot-path form)."""
    if exc is None:
        return "Success"
    if all(isinstance(leaf, interrupts) for leaf in _leaves(exc)):
        return "Interrupt"
    return "Failure"


def exit_tag(exc: BaseException | None, *, cancellation: tuple[type[BaseException], ...] = ()) -> ExitTag:
    """Classify how an operation exited: ``"Success"`` when ``exc`` is None; ``"Interrupt"`` when every cause is an
    interruption (:data:`DEFAULT_INTERRUPTS` plus the caller's own ``cancellation`` types; an exception group
    counts only when all its leaves are); ``"Failure"`` otherwise."""
    return classify_exit(exc, DEFAULT_INTERRUPTS + tuple(cancellation))


F = TypeVar("F", bound=Callable[..., Any])


class Observer(Protocol):
    """A timed, exit-counted operation: ``with observer: ...`` or ``@observer`` on a synchronous function.

    Either form records one duration and one exit outcome on success, failure and interruption alike, and lets the
    wrapped call's value or exception through untouched (the same exception object, traceback intact)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

    def __call__(self, fn: F) -> F: ...


@runtime_checkable
class MetricsPort(Protocol):
    """What core code calls. Implemented by :class:`NullMetrics` (record nothing) and by the OpenTelemetry-backed
    ``smthrs_plugin.observe.metrics.Metrics``. Every method refuses a tag outside its closed vocabulary."""

    def dispatch_exited(self, tag: ExitTag) -> None:
        """One durable dispatch exited (cache-served and fresh alike)."""

    def observe_dispatch(self) -> Observer:
        """Time one durable dispatch, admission through settlement, and count its exit."""

    def scheduler_admission(self) -> None:
        """One scheduler admission pass launched at least one dispatch (no outcome attribute: the reference requires none)."""

    def observe_scheduler_dispatch(self) -> Observer:
        """Time one scheduler node dispatch, rebase turns included (a timer only: node outcomes count apart)."""

    def node_settled(self, outcome: NodeOutcome) -> None:
        """One plan node settled with ``outcome``."""

    def sandbox_execution_exited(self, tag: ExitTag) -> None:
        """One workspace transaction exited (an ``Invalidated`` verdict is a ``Success`` exit)."""

    def observe_sandbox_execution(self) -> Observer:
        """Time one workspace transaction and count its exit."""

    def materialization_exited(self, tag: ExitTag) -> None:
        """One copy-back exited."""

    def observe_materialization(self) -> Observer:
        """Time one copy-back and count its exit."""

    def sandbox_conflict(self) -> None:
        """One copy-back compare-and-set refusal (no outcome attribute: the reference requires none)."""

    def boundary_settled(self, tag: BoundarySettlement) -> None:
        """One step-boundary settlement at the dispatch seam."""

    def cache_decision(self, tag: CacheDecision) -> None:
        """The effective cache decision of one cache-consulting dispatch (at most one per dispatch)."""

    def claim_decision(self, tag: ClaimDecision) -> None:
        """One run-driver claim-and-activate decision."""


_EXIT = outcome_attributes(EXIT_TAGS)
_NODE = outcome_attributes(NODE_OUTCOMES)
_BOUNDARY = outcome_attributes(BOUNDARY_SETTLEMENTS)
_CACHE = outcome_attributes(CACHE_DECISIONS)
_CLAIM = outcome_attributes(CLAIM_DECISIONS)


class _NullObserver:
    """Stateless, so one shared instance serves every thread and every nesting depth."""

    __slots__ = ()

    def __enter__(self) -> _NullObserver:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None

    def __call__(self, fn: F) -> F:
        # The function itself, unwrapped: a decorated hot path pays nothing when metrics are off.
        return fn


_NULL_OBSERVER = _NullObserver()


class NullMetrics:
    """Records nothing and reads no clock; still refuses unknown tags so core-code typos fail in tests."""

    __slots__ = ()

    def dispatch_exited(self, tag: ExitTag) -> None:
        check_tag("exit", tag, _EXIT)

    def observe_dispatch(self) -> Observer:
        return _NULL_OBSERVER

    def scheduler_admission(self) -> None:
        return None

    def observe_scheduler_dispatch(self) -> Observer:
        return _NULL_OBSERVER

    def node_settled(self, outcome: NodeOutcome) -> None:
        check_tag("node outcome", outcome, _NODE)

    def sandbox_execution_exited(self, tag: ExitTag) -> None:
        check_tag("exit", tag, _EXIT)

    def observe_sandbox_execution(self) -> Observer:
        return _NULL_OBSERVER

    def materialization_exited(self, tag: ExitTag) -> None:
        check_tag("exit", tag, _EXIT)

    def observe_materialization(self) -> Observer:
        return _NULL_OBSERVER

    def sandbox_conflict(self) -> None:
        return None

    def boundary_settled(self, tag: BoundarySettlement) -> None:
        check_tag("boundary settlement", tag, _BOUNDARY)

    def cache_decision(self, tag: CacheDecision) -> None:
        check_tag("cache decision", tag, _CACHE)

    def claim_decision(self, tag: ClaimDecision) -> None:
        check_tag("claim decision", tag, _CLAIM)


NULL_METRICS = NullMetrics()
"""The shared no-op sink: the default ``metrics`` collaborator of every core class."""
